"""What the VLM side adds to a rollout record (trainer/records.py): the prompt with its image
thumbnails, each sampled token's text, the reward components, and an episode's turns with
their observation texts and images. Read by `perceptrl view`."""

from __future__ import annotations

from ..trainer.batch import GUIDE, RolloutBatch
from ..trainer.records import thumbnail
from .prompts import load_images

MAX_IMAGES = 4
"""prompt and observation images kept per group / turn"""


def describe_group(processor, batch: RolloutBatch, rows: list[int]) -> tuple[dict, list[dict]]:
    """(the group's prompt fields, one dict per row of ``rows``); see the module docstring."""
    sample = batch.meta[rows[0]]["sample"]
    group = {
        "id": str(sample.get("id", "")),
        "prompt": sample.get("question", ""),
        "answer": str(sample.get("answer", "")),
        "images": [thumbnail(im) for im in load_images(sample)[:MAX_IMAGES]],
        "videos": [str(v).rsplit("/", 1)[-1] for v in sample.get("videos") or []],
    }
    tok = getattr(processor, "tokenizer", processor)
    out, origin = [], batch.row_origin().tolist()
    for r in rows:
        m = batch.meta[r]
        n = int((batch.mask[r] > 0).nonzero().max()) + 1 if batch.mask[r].any() else 0
        ids = batch.tokens[r, :n].tolist()
        row = {
            "text": m.get("completion", ""),
            "tokens": tok.batch_decode([[i] for i in ids]),
            "truncated": bool(m.get("truncated", False)),
            "components": m.get("components", {}),
        }
        if origin[r] == GUIDE:
            row["guide"] = True
        if "episode" in m:
            row["turns"] = _turns(m["episode"])
            row["stop"] = m["episode"].get("stop", "")
        out.append(row)
    return group, out


def _turns(episode: dict) -> list[dict]:
    """The episode's policy turns, each with the observation that answered it (text, images)."""
    texts, obs = episode.get("texts", []), episode.get("observations", [])
    images = episode.get("observation_images", [])
    turns = []
    for i, text in enumerate(texts):
        turn = {"text": text}
        if i < len(obs):
            turn["observation"] = obs[i]
            turn["images"] = [thumbnail(im) for im in (images[i] if i < len(images) else [])]
            turn["images"] = turn["images"][:MAX_IMAGES]
        turns.append(turn)
    return turns
