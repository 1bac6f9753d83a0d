"""What the VLA side adds to a rollout record (trainer/records.py): each episode's camera
frames (a flip-book the viewer plays as a video), its actions, the end reason and the task.
Per-step rewards, values, returns and advantages are the trainer's part of the record."""

from __future__ import annotations

import numpy as np

from ..trainer.batch import RolloutBatch
from ..trainer.records import thumbnail

MAX_FRAMES = 16
"""frames kept per episode (evenly spaced, the last one always)"""
MAX_FRAME_ROWS = 4
"""episodes of a group that keep frames (spread over the group): the records stay small"""
MAX_ACTION_DIMS = 8
"""action dimensions kept per step (a flow head's chains are long)"""


def describe_group(env_id: str, batch: RolloutBatch, rows: list[int]) -> tuple[dict, list[dict]]:
    """(the group's fields, one dict per row of ``rows``); see the module docstring."""
    first = batch.meta[rows[0]] if batch.meta else {}
    group = {"env": env_id, **{k: first[k] for k in ("task_id", "trial_id") if k in first}}
    with_frames = set(np.linspace(0, len(rows) - 1, min(len(rows), MAX_FRAME_ROWS)).astype(int))
    out = []
    for j, r in enumerate(rows):
        m = batch.meta[r] if batch.meta else {}
        n = int(batch.mask[r].sum())
        actions = batch.tokens[r, :n].float().reshape(n, -1)[:, :MAX_ACTION_DIMS].cpu()
        row = {"actions": np.round(actions.numpy().astype(np.float64), 3).tolist()}
        if "end" in m:
            row["end"] = m["end"]
        frames = batch.inputs.get("image")
        if frames is not None and j in with_frames:
            row["frames"] = _frames(frames[r][:n])
        out.append(row)
    return group, out


def _frames(images) -> list[str]:
    """Thumbnails of up to `MAX_FRAMES` steps of ``images`` [T, H, W, 3 * cameras] uint8 (the
    first camera)."""
    T = len(images)
    if T == 0:
        return []
    picks = np.unique(np.linspace(0, T - 1, min(T, MAX_FRAMES)).round().astype(int))
    return [thumbnail(images[t, ..., :3].cpu().numpy(), size=64) for t in picks]
