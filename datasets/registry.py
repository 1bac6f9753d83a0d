"""The synthetic generators, one `Generator` record each: module, modality, splits and options.

Each record is an entry of ``perceptrl.registry.GENERATORS``, which ``data.generator``,
``perceptrl data generate --kind`` and the evaluation table (`modalities`) read; a new generator
is one record registered here (or, from user code, ``GENERATORS.register(name, Generator(...))``
before the recipe loads) plus its module, which provides ``FAMILIES``, ``generate(out_dir,
splits, families, seed, **options)`` and ``reasoning_trace(sample, tools=())`` (``tools``: the
tools an episode may call; a multi-turn trace is a list of turns). Modules load only when a
generator is used.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..registry import GENERATORS


@dataclass(frozen=True)
class Generator:
    """One synthetic task generator."""

    name: str
    module: str
    """module with FAMILIES, generate and reasoning_trace: relative to ``perceptrl.datasets``
    when it starts with a dot (``.clevr``), else a full module name (``mypkg.stripes``)"""
    modality: str
    """what its samples show the model: image | video | 3d (the evaluation table's groups)"""
    description: str
    splits: tuple[str, ...] = ("train", "val", "test")
    """splits it can write (clevr also writes ``ood``: held-out colour-shape pairs and counts)"""
    default_families: tuple[str, ...] = ()
    """families used when none are asked for (empty: all of ``FAMILIES``)"""
    options: dict[str, str] = field(default_factory=dict)
    """common option name -> the keyword its ``generate`` takes (others are not passed)"""

    def load(self) -> ModuleType:
        return importlib.import_module(self.module, "perceptrl.datasets")

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(self.load().FAMILIES)

    def check_families(self, families: Sequence[str]) -> list[str]:
        """``families`` (empty: the defaults), each checked against ``FAMILIES``."""
        if not families:
            return list(self.default_families or self.families)
        unknown = [f for f in families if f not in self.families]
        if unknown:
            raise ValueError(
                f"generator {self.name!r} has no question families {unknown}; valid: "
                f"{', '.join(self.families)}"
            )
        return list(families)

    def generate(
        self, out_dir: str | Path, splits: dict[str, int], families: Sequence[str] = (),
        seed: int = 0, **options,
    ) -> dict[str, Path]:  # fmt: skip
        """Write ``splits`` (name -> questions; splits it cannot write or of size 0 are left
        out) under ``out_dir``; ``options`` by their common names (``image_size``, ``seconds``,
        ``fps``, ``views``, ``depth``), those this generator does not take are ignored.
        Returns split -> JSONL path."""
        kwargs = {self.options[k]: v for k, v in options.items() if k in self.options}
        wanted = {k: n for k, n in splits.items() if n > 0 and k in self.splits}
        return self.load().generate(
            out_dir, splits=wanted, families=self.check_families(families), seed=seed, **kwargs
        )

    def reasoning_trace(self, sample: dict, tools: Sequence[str] = ()) -> str | list[str]:
        """The templated reasoning trace + answer of a generated sample (SFT targets): a text,
        or a list of policy turns when the trace calls one of ``tools`` (an episode)."""
        return _checked_trace(self.load().reasoning_trace)(sample, tools=tuple(tools))


@functools.cache
def _checked_trace(fn: Callable) -> Callable:
    """``fn`` once checked to take ``(sample, tools=())``, the one signature of a generator's
    ``reasoning_trace`` (validation only: what it receives never depends on its signature)."""
    try:
        inspect.signature(fn).bind({}, tools=())
    except TypeError as e:
        raise ValueError(
            f"{fn.__module__}.reasoning_trace must take (sample, tools=()) ({e}); tools: the "
            "tools an episode may call (ignore them for a single-turn trace)"
        ) from e
    return fn


MODALITIES = ("image", "video", "3d", "robot")
"""The evaluation table's modality order (a generator of another modality comes after these)."""

for _gen in (
    Generator(
        "clevr", ".clevr", "image", "CLEVR-like shapes on a grey background (PNG)",
        splits=("train", "val", "test", "ood"),
        default_families=("count_all", "count_color", "count_shape"),
        options={"image_size": "image_size"},
    ),
    Generator(
        "video", ".video", "video",
        "moving-shape clips (mp4): temporal order, direction, event count, grounding",
        options={"image_size": "size", "seconds": "seconds", "fps": "fps"},
    ),
    Generator(
        "spatial", ".spatial", "3d",
        "MuJoCo rooms in several views: VSI-style count, distance, size, direction, order",
        options={"image_size": "image_size", "views": "n_views", "depth": "depth"},
    ),
    Generator(
        "zoom", ".zoom", "image",
        "small checkered tiles in large images (448 px): read only by zooming in; with a "
        "large-tile control family",
        options={"image_size": "image_size"},
    ),
    Generator(
        "plan", ".plan_tasks", "robot",
        "long-horizon MuJoCo tasks (agent-view PNG + instruction) for a VLM planner whose "
        "subgoals a VLA executes", splits=("train", "val", "test"),
        options={"image_size": "image_size"},
    ),
):  # fmt: skip
    GENERATORS.register(_gen.name, _gen)


def modalities() -> tuple[str, ...]:
    """Modalities in the evaluation table's order: `MODALITIES`, then any other a registered
    generator has (sorted)."""
    more = {GENERATORS.get(name).modality for name in GENERATORS} - set(MODALITIES)
    return (*MODALITIES, *sorted(more))
