"""Shared by the synthetic generators: their options checked once (`generator_config`), a
split written as PNG images plus a JSONL file (`write_split`), a box answer as text
(`format_box`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from pathlib import Path

import cv2
import numpy as np


def generator_config(cls, families: Sequence[str], builders: dict, **config):
    """``cls()`` with ``config`` applied; unknown fields and unknown question families (not in
    ``builders``) raise, naming the valid ones. Shared by the synthetic generators."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} fields {unknown}; valid: {sorted(known)}")
    bad = [f for f in families if f not in builders]
    if bad or not families:
        raise ValueError(f"unknown question families {bad or families}; valid: {list(builders)}")
    return replace(cls(), **config)


def write_split(out: Path, split: str, samples: Iterable[tuple[dict, np.ndarray]]) -> Path:
    """Write each (sample, RGB image) as ``out/images/<split>/<id>.png`` and the samples, their
    ``images`` set to that relative path, to ``out/<split>.jsonl``; returns the JSONL path."""
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for sample, img in samples:
            rel = f"images/{split}/{sample['id']}.png"
            if not cv2.imwrite(str(out / rel), cv2.cvtColor(img, cv2.COLOR_RGB2BGR)):
                raise OSError(f"could not write image {out / rel}")
            sample["images"] = [rel]
            f.write(json.dumps(sample) + "\n")
    return path


def format_box(box: Sequence[float]) -> str:
    """A box answer as the rewards parse it: ``[x1, y1, x2, y2]`` in whole pixels."""
    return "[" + ", ".join(str(int(round(v))) for v in box) + "]"
