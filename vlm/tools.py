"""Tools a VLM may call inside an episode, as a registry: parsing a call, running it, failing safely.

A tool is a plain function ``fn(ctx: ToolContext, **arguments) -> Observation | str | Image``
registered in ``perceptrl.registry.TOOLS`` with the one-line usage shown to the model declared
beside it (``@TOOLS.register("zoom", usage="zoom(box=...): ...")``; without one, its docstring's
first line), or given as ``"module:function"`` (its declared usage when it is registered, else
its docstring's first line). Built in:

=======  ==========================================  ===========================================
name     call                                        returns
=======  ==========================================  ===========================================
zoom     ``zoom(box=[x1, y1, x2, y2], image=0)``      the crop of that box (pixels of the original
                                                     image), scaled so its longer side is
                                                     ``options.zoom.size`` (default 224)
frame    ``frame(t=1.5, video=0)``                    the video's frame at ``t`` seconds
depth    ``depth(x=10, y=20, image=0)``               the depth in metres at that pixel (3D
                                                     scenes written with depth maps)
=======  ==========================================  ===========================================

A call is written ``<tool_call>...</tool_call>`` in a policy turn, either as Qwen's JSON
(``{"name": "zoom", "arguments": {"box": [0, 0, 64, 64]}}``) or as a Python-style call
(``zoom(box=[0, 0, 64, 64])``, literal arguments only; fewer tokens for small models).

Nothing a model writes can stop a run: a malformed call, an unknown tool, bad arguments, a box
outside the image, a tool that raises or one that exceeds its time limit all become an error
observation (the message is shown to the model as the tool's result) and are counted by the
episode rollout under ``tool/errors/<name>`` (``malformed`` and ``unknown`` for calls that name no
usable tool).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from ..registry import TOOLS
from ..rewards.compose import RewardTimeout, call_with_timeout

log = logging.getLogger(__name__)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)
_PYCALL = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*\((.*)\)\s*$", re.DOTALL)
MALFORMED, UNKNOWN = "malformed", "unknown"
"""Error counter names of calls that name no usable tool."""


@dataclass
class Observation:
    """What a tool (or an environment) hands back to the policy as the next turn's input."""

    text: str = ""
    """text shown to the model"""
    images: list[Image.Image] = field(default_factory=list)
    """images shown to the model, in order, before the text"""
    error: str | None = None
    """set when the call failed: the counter it is logged under (tool name, malformed, unknown)"""
    tool: str | None = None
    """the tool that answered (set by `run_call`)"""
    info: dict[str, Any] = field(default_factory=dict)
    """data for rewards and metrics, never shown to the model (e.g. an executor's outcome)"""


class ToolError(ValueError):
    """Raised by a tool for a call it cannot serve (bad arguments, box outside the image); the
    message is shown to the model."""


@dataclass
class ToolContext:
    """What a tool may read: the episode's sample and its decoded images, and the recipe's
    per-tool options."""

    sample: dict
    images: list[Image.Image] = field(default_factory=list)
    """the sample's images at their original resolution"""
    options: dict[str, dict] = field(default_factory=dict)
    """tool name -> options from the recipe (``rollout.episode.tool_options``)"""

    def image(self, index: Any) -> Image.Image:
        """Image ``index`` of the sample, or a ToolError naming the valid indices."""
        i = _as_int(index, "image")
        if not 0 <= i < len(self.images):
            raise ToolError(
                f"image={i} does not exist; this sample has {len(self.images)} image(s)"
            )
        return self.images[i]


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    usage: str
    """one line shown to the model in the system prompt"""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_name(spec: str) -> str:
    """The name the policy writes for a tool spec: the registered name, or a
    ``package.module:function`` spec's function name."""
    return spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if ":" in spec else spec


def get_tool(spec: str) -> Tool:
    """The tool of a registered name or of ``"package.module:function"``, with its usage line
    (declared at registration, else the function's docstring's first line).

    Raises:
        UnknownName: an unknown name (listing the valid ones).
        ValueError: an import that fails.
    """
    entry = TOOLS.resolve(spec)
    name = tool_name(spec)
    usage = entry.meta.get("usage") or (entry.obj.__doc__ or name).strip().splitlines()[0]
    return Tool(name, entry.obj, usage)


def resolve_tools(names: list[str] | tuple[str, ...]) -> dict[str, Tool]:
    """Name the policy writes -> tool, for registered names and ``module:function`` specs."""
    out: dict[str, Tool] = {}
    for spec in names:
        tool = get_tool(spec)
        if tool.name in out:
            raise ValueError(f"two tools are called {tool.name!r} ({spec!r}); rename one")
        out[tool.name] = tool
    return out


# ---------------------------------------------------------------------------------------------
# parsing and running calls
# ---------------------------------------------------------------------------------------------


def find_call(text: str) -> str | None:
    """The body of the first ``<tool_call>`` in ``text`` (to its closing tag or the end), or None."""
    m = _CALL.search(text)
    return None if m is None else m.group(1).strip()


def parse_call(body: str) -> ToolCall:
    """A call body as JSON ``{"name", "arguments"}`` or ``name(key=literal, ...)``.

    Raises:
        ToolError: neither form parses (the message says what a call looks like).
    """
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates serialise the arguments twice
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ToolError(f"arguments are not a JSON object: {e}") from e
        if not isinstance(args, dict):
            raise ToolError("arguments must be an object of named arguments")
        return ToolCall(obj["name"], args)
    m = _PYCALL.match(body)
    if m is None:
        raise ToolError(
            'cannot read the call; write name(key=value, ...) or {"name": ..., "arguments": {...}}'
        )
    try:
        node = ast.parse(f"f({m.group(2)})", mode="eval").body
        if node.args:
            raise ToolError("give arguments by name, e.g. zoom(box=[0, 0, 64, 64])")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        if isinstance(e, ToolError):
            raise
        raise ToolError(f"cannot read the arguments ({type(e).__name__})") from e
    return ToolCall(m.group(1), args)


def run_call(
    text: str, tools: dict[str, Tool], ctx: ToolContext, timeout_s: float | None
) -> Observation | None:
    """The observation for the tool call in a policy turn, or None when the turn calls nothing.

    Every failure is an error observation whose ``error`` names the counter (see the module
    docstring); nothing raises.
    """
    body = find_call(text)
    if body is None:
        return None
    try:
        call = parse_call(body)
    except ToolError as e:
        return Observation(f"Error: {e}", error=MALFORMED)
    tool = tools.get(call.name)
    if tool is None:
        valid = ", ".join(sorted(tools)) or "none"
        return Observation(f"Error: no tool {call.name!r}; available: {valid}", error=UNKNOWN)
    try:
        out = call_with_timeout(lambda: tool.fn(ctx, **call.arguments), timeout_s)
    except RewardTimeout:
        return Observation(f"Error: {tool.name} took longer than {timeout_s} s", error=tool.name)
    except ToolError as e:
        return Observation(f"Error: {e}", error=tool.name)
    except TypeError as e:  # missing or unexpected arguments
        return Observation(f"Error: {tool.name}: {_arg_message(e)}", error=tool.name)
    except Exception as e:
        log.warning("tool %r raised %s: %s", tool.name, type(e).__name__, e)
        return Observation(f"Error: {tool.name} failed ({type(e).__name__})", error=tool.name)
    obs = _as_observation(out, tool.name)
    obs.tool = tool.name
    return obs


def _arg_message(e: TypeError) -> str:
    msg = str(e)
    return msg.split(") ", 1)[-1] if ") " in msg else msg


def _as_observation(out: Any, name: str) -> Observation:
    if isinstance(out, Observation):
        return out
    if isinstance(out, Image.Image):
        return Observation(images=[out])
    if isinstance(out, str):
        return Observation(out)
    return Observation(f"Error: {name} returned {type(out).__name__}", error=name)


# ---------------------------------------------------------------------------------------------
# built-in tools
# ---------------------------------------------------------------------------------------------


def _as_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ToolError(f"{name} must be a number, got {v!r}")
    return int(round(v))


def _as_box(box: Any, w: int, h: int) -> tuple[int, int, int, int]:
    if isinstance(box, str):
        try:
            box = ast.literal_eval(box)
        except (SyntaxError, ValueError) as e:
            raise ToolError(f"box must be [x1, y1, x2, y2], got {box!r}") from e
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise ToolError(f"box must be [x1, y1, x2, y2], got {box!r}")
    x1, y1, x2, y2 = (_as_int(v, "box") for v in box)
    if not (0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h):
        raise ToolError(
            f"box [{x1}, {y1}, {x2}, {y2}] is not inside the image (width {w}, height {h}) "
            "or is empty; use 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height"
        )
    return x1, y1, x2, y2


@TOOLS.register(
    "zoom", usage="zoom(box=[x1, y1, x2, y2]): look closer at a box, in pixels of the image"
)
def zoom(ctx: ToolContext, box: Any = None, image: int = 0) -> Observation:
    """The crop of ``box`` (original-image pixels, exclusive upper edges) scaled so its longer
    side is ``options.zoom.size`` (default 224; 0 keeps the crop's size)."""
    if box is None:
        raise ToolError("zoom needs box=[x1, y1, x2, y2]")
    im = ctx.image(image)
    x1, y1, x2, y2 = _as_box(box, im.width, im.height)
    crop = im.crop((x1, y1, x2, y2))
    size = int(ctx.options.get("zoom", {}).get("size", 224))
    if size > 0:
        s = size / max(crop.width, crop.height)
        crop = crop.resize((max(1, round(crop.width * s)), max(1, round(crop.height * s))))
    return Observation(f"Zoomed in on [{x1}, {y1}, {x2}, {y2}].", [crop])


@TOOLS.register("frame", usage="frame(t=seconds): the video frame at that time")
def frame(ctx: ToolContext, t: Any = None, video: int = 0) -> Observation:
    """The frame of the sample's video ``video`` nearest to ``t`` seconds."""
    videos = ctx.sample.get("videos") or []
    k = _as_int(video, "video")
    if not 0 <= k < len(videos):
        raise ToolError(f"video={k} does not exist; this sample has {len(videos)} video(s)")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ToolError(f"t must be a time in seconds, got {t!r}")
    import decord

    vr = decord.VideoReader(str(videos[k]), num_threads=1)
    fps = float(vr.get_avg_fps()) or 1.0
    duration = len(vr) / fps
    if not 0 <= t <= duration:
        raise ToolError(f"t={t} is outside the video (0 to {duration:.2f} s)")
    idx = min(int(round(t * fps)), len(vr) - 1)
    return Observation(f"Frame at {idx / fps:.2f} s.", [Image.fromarray(vr[idx].asnumpy())])


def _depth_path(ctx: ToolContext, k: int) -> Path:
    """Depth map ``k`` of the sample: ``meta["depth"][k]``, absolute or relative to a folder above
    the sample's first image (the spatial generator writes them relative to its output folder)."""
    maps = (ctx.sample.get("meta") or {}).get("depth") or []
    if not 0 <= k < len(maps):
        raise ToolError(f"no depth map for image={k} ({len(maps)} depth map(s) in this sample)")
    p = Path(maps[k])
    if p.is_absolute() or not ctx.sample.get("images"):
        return p
    for parent in Path(ctx.sample["images"][0]).parents:
        if (parent / p).exists():
            return parent / p
    return p


@TOOLS.register(
    "depth", usage="depth(x=px, y=px): distance in metres from the camera at that pixel"
)
def depth(ctx: ToolContext, x: Any = None, y: Any = None, image: int = 0) -> str:
    """Depth in metres at pixel (x, y) of image ``image`` (16-bit depth PNG in millimetres)."""
    import cv2

    k = _as_int(image, "image")
    d = cv2.imread(str(_depth_path(ctx, k)), cv2.IMREAD_UNCHANGED)
    if d is None:
        raise ToolError(f"the depth map of image={k} cannot be read")
    xi, yi = _as_int(x, "x"), _as_int(y, "y")
    h, w = d.shape[:2]
    if not (0 <= xi < w and 0 <= yi < h):
        raise ToolError(f"pixel ({xi}, {yi}) is outside the image (width {w}, height {h})")
    return f"Depth at ({xi}, {yi}): {float(d[yi, xi]) / 1000:.2f} m."
