"""Rollout records: a bounded sample of a run's rollouts, kept for the viewer and the doctor.

Every ``log.rollouts_every`` steps (and at step 1) the trainer hands the scored batch, with its
advantages, to `RolloutRecorder.record`, which keeps ``log.rollouts_groups`` of its groups
(spread over the batch, chosen without randomness so recording never moves a run's random
stream) and writes them to ``<run>/rollouts/step_<step>.json.gz``:

    {"step": 10, "groups": [{"group": 3, ...side fields (prompt, images, task)...,
                             "rows": [{"reward": 1.0, "length": 41, "adv": [...],
                                       "logp": [...], ...side fields...}]}]}

The trainer fills what every side has (per position: advantage, behaviour log-prob, the loss
mask, tree nodes, process rewards, per-step rewards, values and returns); the rollout source
adds what only it knows through an optional ``describe_group(policy, batch, rows)`` returning
(group fields, one dict per row): the prompt and its image thumbnails, each token's text, the
reward components, tool turns (VLM, vlm/records.py), frames, actions and the end reason (VLA,
vla/records.py). In a ``train.pipeline`` run the trainer's process describes the joined batch
with the same functions (`PipelineSource`'s ``describe``): the batches carry what they read.

At most ``log.rollouts_keep`` files stay on disk: the first one and the latest others. A resume
drops the files written after its checkpoint (they are recorded again). Recording is a window
on the run, never a reason to stop it: an error while recording is logged once and recording
stops for the rest of the run.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .batch import RolloutBatch
from .files import atomic_write_bytes

log = logging.getLogger(__name__)

RECORDS_DIR = "rollouts"
_NAME = re.compile(r"^step_(\d+)\.json\.gz$")

Describe = Callable[[object, RolloutBatch, list[int]], tuple[dict, list[dict]]]
"""``describe_group(policy, batch, rows) -> (group fields, row fields)`` of a rollout source"""


class RolloutRecorder:
    """Writes the sampled groups of a step (see the module docstring).

    Args:
        run_dir: the run directory; records go to ``<run_dir>/rollouts``.
        every: record every N steps (and step 1); 0 records nothing.
        groups: groups kept per recorded step.
        keep: record files kept on disk (the first and the latest ``keep - 1``).
    """

    def __init__(self, run_dir: str | Path, every: int, groups: int, keep: int):
        self.dir = Path(run_dir) / RECORDS_DIR
        self.every, self.groups, self.keep = every, groups, keep
        self.broken = False

    def due(self, step: int) -> bool:
        return self.every > 0 and not self.broken and (step == 1 or step % self.every == 0)

    def record(self, step: int, batch: RolloutBatch, policy=None, describe: Describe | None = None):
        """Write step ``step``'s record of ``batch`` (advantages filled in)."""
        try:
            groups = [
                self._group(batch, rows, policy, describe)
                for rows in pick_groups(batch, self.groups)
            ]
            data = json.dumps({"step": step, "groups": groups}, separators=(",", ":"))
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.dir / f"step_{step:06d}.json.gz", gzip.compress(data.encode()))
            self._prune()
        except Exception as e:  # a viewer's window, not the run: warn once, record no more
            self.broken = True
            log.warning(
                "rollout records stopped at step %d (%s: %s); training goes on. Set "
                "log.rollouts_every=0 to turn them off", step, type(e).__name__, e,
            )  # fmt: skip

    def _group(self, batch: RolloutBatch, rows: list[int], policy, describe) -> dict:
        out = {"group": int(batch.group_id[rows[0]])}
        side_rows: list[dict] = [{} for _ in rows]
        if describe is not None:
            shared, side_rows = describe(policy, batch, rows)
            out.update(shared)
        out["rows"] = [{**row_fields(batch, r), **side} for r, side in zip(rows, side_rows)]
        return out

    def truncate_after(self, step: int) -> None:
        """Remove the records of steps after ``step`` (a resume records them again)."""
        for path, s in record_files(self.dir):
            if s > step:
                path.unlink(missing_ok=True)

    def _prune(self) -> None:
        files = record_files(self.dir)
        for path, _ in files[1 : max(1, len(files) - self.keep + 1)]:
            path.unlink(missing_ok=True)


def pick_groups(batch: RolloutBatch, k: int) -> list[list[int]]:
    """Rows of ``k`` groups spread evenly over the batch's groups (in order of first row)."""
    gid = batch.group_id.cpu().tolist()
    order = list(dict.fromkeys(gid))
    if len(order) > k:
        order = [order[i] for i in np.linspace(0, len(order) - 1, k).round().astype(int)]
    return [[i for i, g in enumerate(gid) if g == want] for want in order]


def row_fields(batch: RolloutBatch, r: int) -> dict:
    """What the trainer knows of row ``r``: its reward and, per position up to its last loss
    position, the advantage, behaviour log-prob and (when present) mask, tree node, process
    reward, per-step reward, value and return."""
    mask = batch.mask[r].float().cpu()
    on = torch.nonzero(mask > 0).flatten()
    n = int(on[-1]) + 1 if len(on) else 0
    rewards = batch.rewards[r].float().cpu() if batch.rewards is not None else torch.zeros(())
    out: dict = {
        "row": r,
        "reward": _num(rewards.sum() if rewards.dim() else rewards),
        "length": int(mask.sum()),
    }
    if bool((mask[:n] == 0).any()):
        out["mask"] = mask[:n].int().tolist()
    per_pos = {
        "adv": batch.advantages, "logp": batch.logp_old, "nodes": batch.tree_ids(),
        "step_rewards": batch.step_rewards, "values": batch.values_old,
        "returns": batch.returns if batch.values_old is not None else None,  # else = adv
        "rewards": batch.rewards if rewards.dim() else None,
    }  # fmt: skip
    for key, x in per_pos.items():
        if x is not None and x.dim() >= 2:
            v = x[r, :n].detach().float().cpu()
            v = v.reshape(n, -1).sum(1) if v.dim() > 1 else v  # flow sub-steps: their sum
            out[key] = v.long().tolist() if key == "nodes" else _rounded(v)
    return out


def _rounded(x: Tensor) -> list[float | None]:
    """4 decimals; a value that is not finite (a critic without its inputs) becomes None (the
    page's JSON has no NaN)."""
    return [
        v if math.isfinite(v) else None for v in np.round(x.numpy().astype(np.float64), 4).tolist()
    ]


def _num(x: Tensor | float) -> float | None:
    v = float(x)
    return round(v, 6) if math.isfinite(v) else None


def thumbnail(image, size: int = 128, quality: int = 70) -> str:
    """A JPEG data URI of ``image`` (PIL image, or an array [H, W, 3] uint8) no larger than
    ``size`` pixels on its longer side."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    image = image.convert("RGB")
    image.thumbnail((size, size))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def record_files(directory: Path) -> list[tuple[Path, int]]:
    """(path, step) of the record files in ``directory``, by step."""
    if not directory.is_dir():
        return []
    found = [(p, _NAME.match(p.name)) for p in directory.iterdir()]
    return sorted(((p, int(m.group(1))) for p, m in found if m), key=lambda x: x[1])


def read_records(run_dir: str | Path) -> list[dict]:
    """The records of a run, by step; a file that does not read (cut short by a failing disk)
    is skipped with a warning naming it."""
    out = []
    for path, _ in record_files(Path(run_dir) / RECORDS_DIR):
        try:
            out.append(json.loads(gzip.decompress(path.read_bytes())))
        except (OSError, EOFError, ValueError) as e:
            log.warning("%s: skipped, it does not read (%s)", path, e)
    return out
