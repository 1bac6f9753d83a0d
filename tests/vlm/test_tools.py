"""The tool registry: call parsing, the built-in tools (zoom in original-image pixels, video
frames, depth), user tools, and every way a call can fail becoming a counted error observation."""

from __future__ import annotations

import time

import cv2
import numpy as np
import pytest
from PIL import Image

from perceptrl.datasets.video import write_mp4
from perceptrl.registry import TOOLS
from perceptrl.vlm.tool_env import ToolEnv, check_sample_tools, resolve_tools
from perceptrl.vlm.tools import (
    MALFORMED,
    UNKNOWN,
    ToolContext,
    ToolError,
    get_tool,
    parse_call,
    run_call,
)


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    """200 x 100, left half red, right half blue, a white pixel at (150, 40)."""
    a = np.zeros((100, 200, 3), dtype=np.uint8)
    a[:, :100] = (255, 0, 0)
    a[:, 100:] = (0, 0, 255)
    a[40, 150] = 255
    return Image.fromarray(a)


def ctx(picture, **sample) -> ToolContext:
    return ToolContext({"id": "s", **sample}, [picture], {"zoom": {"size": 0}})


@TOOLS.register("sleepy", usage="sleepy(): waits")
def _sleepy(ctx):
    time.sleep(5)
    return "awake"


@TOOLS.register("broken", usage="broken(): raises")
def _broken(ctx):
    raise RuntimeError("boom")


def call(text, picture, names=("zoom", "sleepy", "broken"), timeout=1.0, **sample):
    return run_call(text, resolve_tools(list(names)), ctx(picture, **sample), timeout)


def test_both_call_forms_parse():
    j = parse_call('{"name": "zoom", "arguments": {"box": [1, 2, 3, 4]}}')
    p = parse_call("zoom(box=[1, 2, 3, 4], image=0)")
    assert (j.name, j.arguments) == ("zoom", {"box": [1, 2, 3, 4]})
    assert (p.name, p.arguments) == ("zoom", {"box": [1, 2, 3, 4], "image": 0})
    assert parse_call('{"name": "zoom", "arguments": "{\\"box\\": [1, 2, 3, 4]}"}').arguments
    for bad in ("zoom[1, 2]", "zoom(1, 2)", "zoom(box=open('x'))", "{}", ""):
        with pytest.raises(ToolError):
            parse_call(bad)


def test_zoom_crops_in_original_image_pixels(picture):
    obs = call("<think>look</think><tool_call>zoom(box=[140, 30, 160, 50])</tool_call>", picture)
    assert obs.error is None and obs.tool == "zoom" and "[140, 30, 160, 50]" in obs.text
    crop = np.asarray(obs.images[0])
    assert crop.shape == (20, 20, 3)
    assert tuple(crop[10, 10]) == (255, 255, 255) and tuple(crop[0, 0]) == (0, 0, 255)
    scaled = run_call(
        "<tool_call>zoom(box=[0, 0, 50, 25])</tool_call>",
        resolve_tools(["zoom"]),
        ToolContext({}, [picture], {"zoom": {"size": 100}}),
        None,
    )
    assert scaled.images[0].size == (100, 50)  # longer side scaled to options.zoom.size


def test_no_call_means_the_turn_answers(picture):
    assert call("<answer>3</answer>", picture) is None


@pytest.mark.parametrize(
    "text,error,words",
    [
        ("<tool_call>zoom(box=[0, 0, 300, 50])</tool_call>", "zoom", "not inside the image"),
        ("<tool_call>zoom(box=[50, 50, 10, 60])</tool_call>", "zoom", "not inside the image"),
        ("<tool_call>zoom(box=[1, 2, 3])</tool_call>", "zoom", "x1, y1, x2, y2"),
        ("<tool_call>zoom(box=['a', 2, 3, 4])</tool_call>", "zoom", "must be a number"),
        ("<tool_call>zoom(box=[0, 0, 9, 9], image=3)</tool_call>", "zoom", "image=3"),
        ("<tool_call>zoom(size=3)</tool_call>", "zoom", "unexpected keyword"),
        ("<tool_call>zoom(box=[0, 0, 5</tool_call>", MALFORMED, "cannot read"),
        ("<tool_call>{oops}</tool_call>", MALFORMED, "cannot read"),
        ("<tool_call>crop(box=[0, 0, 5, 5])</tool_call>", UNKNOWN, "no tool 'crop'"),
        ("<tool_call>broken()</tool_call>", "broken", "failed (RuntimeError)"),
        ("<tool_call>sleepy()</tool_call>", "sleepy", "longer than"),
    ],
)
def test_every_failure_is_an_error_observation(picture, text, error, words):
    t = time.perf_counter()
    obs = call(text, picture, timeout=0.5)
    assert obs.error == error and obs.text.startswith("Error:") and words in obs.text, obs.text
    assert not obs.images and time.perf_counter() - t < 3


def test_samples_restrict_the_tools_they_allow(picture):
    tools = resolve_tools(["zoom", "broken"])
    env = ToolEnv(tools, timeout_s=1.0)
    only_broken = {"id": "a", "images": [picture], "tools": ["broken"]}
    env.reset([only_broken, {"id": "b", "images": [picture]}])
    assert env.respond(0, "<tool_call>zoom(box=[0, 0, 5, 5])</tool_call>").error == UNKNOWN
    assert env.respond(1, "<tool_call>zoom(box=[0, 0, 5, 5])</tool_call>").error is None
    check_sample_tools([only_broken], tools, "data")
    with pytest.raises(ValueError, match="does not enable"):
        check_sample_tools([{"id": "c", "tools": ["depth"]}], tools, "data.train=x.jsonl")


def test_user_tools_by_module_path(tmp_path, monkeypatch, picture):
    (tmp_path / "my_tools.py").write_text(
        "def count_red(ctx, threshold=128):\n"
        '    """count_red(threshold=128): red pixels in the image"""\n'
        "    import numpy as np\n"
        "    a = np.asarray(ctx.images[0])\n"
        "    return f'{int((a[..., 0] >= threshold).sum())} red pixels'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = get_tool("my_tools:count_red")
    assert tool.name == "count_red" and tool.usage.startswith("count_red(threshold")
    obs = run_call("<tool_call>count_red()</tool_call>", {"count_red": tool}, ctx(picture), None)
    assert obs.text == "10001 red pixels" and obs.tool == "count_red"
    with pytest.raises(ValueError, match="did you mean 'zoom'"):
        get_tool("zom")
    with pytest.raises(ValueError, match="cannot import"):
        get_tool("no_such_module:f")


def test_frame_returns_the_video_frame_at_a_time(tmp_path, picture):
    frames = np.zeros((8, 64, 64, 3), dtype=np.uint8)
    for i in range(8):
        frames[i, :, :] = (30 * i, 0, 0)
    path = write_mp4(frames, tmp_path / "clip.mp4", fps=4)
    obs = call("<tool_call>frame(t=1.0)</tool_call>", picture, ("frame",), videos=[str(path)])
    assert obs.error is None and obs.images[0].size == (64, 64)
    assert abs(int(np.asarray(obs.images[0])[..., 0].mean()) - 120) < 12  # frame 4 of 8
    late = call("<tool_call>frame(t=9)</tool_call>", picture, ("frame",), videos=[str(path)])
    assert late.error == "frame" and "outside the video" in late.text


def test_depth_reads_the_depth_map_in_metres(tmp_path, picture):
    root = tmp_path / "spatial"
    (root / "images" / "train").mkdir(parents=True)
    (root / "depth" / "train").mkdir(parents=True)
    d = np.full((100, 200), 1500, dtype=np.uint16)
    d[40, 150] = 2750
    cv2.imwrite(str(root / "depth" / "train" / "s_v1.png"), d)
    sample = {"images": [str(root / "images" / "train" / "s_v1.png")],
              "meta": {"depth": ["depth/train/s_v1.png"]}}  # fmt: skip
    obs = call("<tool_call>depth(x=150, y=40)</tool_call>", picture, ("depth",), **sample)
    assert obs.text == "Depth at (150, 40): 2.75 m."
    bad = call("<tool_call>depth(x=500, y=40)</tool_call>", picture, ("depth",), **sample)
    assert bad.error == "depth" and "outside the image" in bad.text
