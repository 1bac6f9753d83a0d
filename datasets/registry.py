"""The synthetic generators, one entry each: name -> module, modality, splits and options.

The wiring (``data.generator``), ``perceptrl data generate --kind`` and the evaluation table
(modality order) read this table; a new generator is one entry here (or, from user code,
``register_generator(Generator(...))`` before the recipe loads) plus its module, which
provides ``FAMILIES``, ``generate(out_dir, splits, families, seed, **options)`` and
``reasoning_trace(sample)`` (optionally ``reasoning_trace(sample, tools)``: the tools an
episode may call, for multi-turn traces given as a list of turns). Modules load only when a
generator is used.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType


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
        fn = self.load().reasoning_trace
        if "tools" in inspect.signature(fn).parameters:
            return fn(sample, tools=tuple(tools))
        return fn(sample)


GENERATORS: dict[str, Generator] = {
    g.name: g
    for g in (
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
            "plan", ".plan", "robot",
            "long-horizon MuJoCo tasks (agent-view PNG + instruction) for a VLM planner whose "
            "subgoals a VLA executes", splits=("train", "val", "test"),
            options={"image_size": "image_size"},
        ),
    )
}  # fmt: skip


def register_generator(gen: Generator) -> Generator:
    """Add ``gen`` to `GENERATORS` under ``gen.name`` (``data.generator`` then accepts it);
    registering an equal entry again is a no-op, another entry under a taken name raises."""
    old = GENERATORS.get(gen.name)
    if old is not None and old != gen:
        raise ValueError(
            f"generator {gen.name!r} is already registered (module {old.module!r}); "
            "register yours under another name"
        )
    GENERATORS[gen.name] = gen
    return gen


def get_generator(name: str) -> Generator:
    if name not in GENERATORS:
        raise KeyError(f"unknown generator {name!r}; valid: {', '.join(GENERATORS)}")
    return GENERATORS[name]


def modalities() -> tuple[str, ...]:
    """Modalities in the table's order (first appearance in GENERATORS)."""
    return tuple(dict.fromkeys(g.modality for g in GENERATORS.values()))
