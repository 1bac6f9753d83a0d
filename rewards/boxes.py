"""Box rewards beyond ``iou``: ``giou`` (one box) and ``det`` (a list of scored boxes).

``det`` scores a detection list the way Visual-RFT does (``metric="rft"``): predictions are
de-duplicated, sorted by confidence (highest first) and each greedily takes the unmatched ground
truth box of highest IoU; the pair counts as matched when that IoU exceeds ``iou_threshold``
(0.5). Then

- IoU term = (sum of matched IoUs) / max(#ground truth, #predictions), so missed objects and
  extra boxes both cost;
- confidence term = mean over predictions of ``c`` if matched else ``1 - c``, so a model is paid
  for being sure of its hits and unsure of its misses;

and ``det = iou_weight * IoU term + conf_weight * confidence term`` (Visual-RFT adds the two as
separate rewards: range [0, 2] with the default weights). ``metric="map"`` instead gives the COCO
mAP@[.5:.95] of the completion's boxes (``"map50"``: AP at IoU 0.5) computed by pycocotools'
``COCOeval`` on a one-image dataset.

Answers and ground truths are lists of boxes, written as JSON / Python literals:
``[{"bbox_2d": [x1, y1, x2, y2], "label": "cat", "confidence": 0.9}, ...]`` (also the keys
``bbox``/``box``/``Position``, ``score``/``Confidence``, ``category``), or bare
``[[x1, y1, x2, y2], ...]``. A box without a confidence has confidence 1. Labels count only when
every ground truth box has one: then a prediction matches only a box of the same label
(case-insensitive) and COCO mAP is averaged over the labels; otherwise labels are ignored
(class-agnostic, as Visual-RFT's one-category questions). A truncated list keeps its complete
entries.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..registry import REWARDS
from .builtin import _box_answer, _check, _sid, answer_box, to_original
from .parse import answer_or_text, box_iou, parse_box
from .registry import RewardContext

_BOX_KEYS = ("bbox_2d", "bbox", "box", "position", "bbox2d")
_CONF_KEYS = ("confidence", "score", "conf")
_LABEL_KEYS = ("label", "category", "class", "name")
_OBJECT = re.compile(r"\{[^{}]*\}")
_LIST_BOX = re.compile(r"\[[^\[\]]*\]")


def _finite(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _gbox(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalized IoU of two valid boxes: IoU - (|C| - |A ∪ B|) / |C|, in (-1, 1]."""
    iou = box_iou(a, b)
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(iw, 0.0) * max(ih, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    return iou - (hull - union) / hull


def giou_value(a: Sequence[float], b: Sequence[float]) -> float | None:
    """GIoU of two [x1, y1, x2, y2] boxes, None when either is degenerate."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return None
    return _gbox(a, b)


@REWARDS.register("giou", check_answer=_box_answer)
def giou(
    completions: list[str], samples: list[dict], ctx: RewardContext, rescale: bool = True
) -> list[float]:
    """Generalized IoU of the first answered box with the sample's box.

    Args:
        rescale: return ``(1 + GIoU) / 2`` in [0, 1] (default), so that a valid but distant
            box still earns more than a malformed answer (0); False returns GIoU in (-1, 1] and
            a malformed answer scores 0 all the same.
    Boxes are handled as in ``iou`` (model coordinates mapped back, degenerate boxes score 0).
    """
    _check(completions, samples)
    out = []
    for c, s in zip(completions, samples):
        gt = answer_box(s)
        pred = parse_box(answer_or_text(c))
        g = None if pred is None else giou_value(to_original(pred, s.get("meta") or {}), gt)
        out.append(0.0 if g is None else ((1.0 + g) / 2.0 if rescale else g))
    return out


# ---- detection lists ------------------------------------------------------------------------


@dataclass(frozen=True)
class Detection:
    box: tuple[float, float, float, float]
    """[x1, y1, x2, y2]"""
    confidence: float = 1.0
    """in [0, 1]"""
    label: str | None = None
    """lower-cased label, None when not given"""


def _entry(e) -> Detection | None:
    """One list entry (a dict or a bare 4-list) as a Detection, None if unreadable."""
    box, conf, label = None, 1.0, None
    if isinstance(e, dict):
        low = {str(k).lower(): v for k, v in e.items()}
        box = next((low[k] for k in _BOX_KEYS if k in low), None)
        c = next((low[k] for k in _CONF_KEYS if k in low), None)
        if c is not None:
            conf = _finite(c)
            if conf is None:
                return None
        lab = next((low[k] for k in _LABEL_KEYS if k in low), None)
        label = str(lab).strip().lower() if lab is not None else None
    elif isinstance(e, (list, tuple)):
        box = e
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return None
    vals = [_finite(v) for v in box]
    if any(v is None for v in vals):
        return None
    return Detection(tuple(vals), min(max(conf, 0.0), 1.0), label)  # type: ignore[arg-type]


def _literal(text: str):
    for load in (json.loads, ast.literal_eval):
        try:
            return load(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return None


def parse_detections(text) -> list[Detection] | None:
    """The detection list in ``text`` (or a list already parsed), None if there is none.

    ``"[]"`` is an empty list (an answer of "nothing there"); a list whose entries are all
    unreadable gives None. A single box ``[x1, y1, x2, y2]`` is a list of one.
    """
    if isinstance(text, (list, tuple)):
        obj = text
    elif isinstance(text, str) and len(text) <= 100_000:
        s = text.strip()
        if s.startswith("```"):  # markdown code fence
            s = s.strip("`").removeprefix("json").strip()
        obj = _literal(s)
        if obj is None:  # truncated or chatty: salvage the complete entries
            objs = [_literal(m) for m in _OBJECT.findall(s)]
            if not any(isinstance(o, dict) for o in objs):
                objs = [_literal(m) for m in _LIST_BOX.findall(s)]
            obj = [o for o in objs if o is not None]
            if not obj:
                return None
    else:
        return None
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, (list, tuple)):
        return None
    if len(obj) == 4 and all(_finite(v) is not None for v in obj):
        obj = [obj]
    dets = [d for d in (_entry(e) for e in obj) if d is not None]
    return dets if dets or not obj else None


def match_detections(
    preds: Sequence[Detection], gts: Sequence[Detection], iou_threshold: float = 0.5
) -> list[tuple[Detection, float]]:
    """Visual-RFT greedy matching: (prediction, matched IoU or 0) per unique prediction, sorted
    by confidence (highest first)."""
    seen, unique = set(), []
    for p in preds:
        if p.box not in seen:
            seen.add(p.box)
            unique.append(p)
    unique.sort(key=lambda d: -d.confidence)
    taken: set[int] = set()
    out = []
    for p in unique:
        best, best_j = 0.0, -1
        for j, g in enumerate(gts):
            if j in taken or (g.label is not None and p.label != g.label):
                continue
            v = box_iou(p.box, g.box)
            if v > best:
                best, best_j = v, j
        if best > iou_threshold:
            taken.add(best_j)
            out.append((p, best))
        else:
            out.append((p, 0.0))
    return out


def rft_terms(
    preds: Sequence[Detection], gts: Sequence[Detection], iou_threshold: float = 0.5
) -> tuple[float, float]:
    """(IoU term, confidence term) of Visual-RFT's detection reward, each in [0, 1]."""
    if not preds:
        return (1.0, 1.0) if not gts else (0.0, 0.0)
    matched = match_detections(preds, gts, iou_threshold)
    iou_term = sum(v for _, v in matched) / max(len(gts), len(matched))
    conf_term = sum(p.confidence if v > 0 else 1.0 - p.confidence for p, v in matched)
    return iou_term, conf_term / len(matched)


def coco_map(preds: Sequence[Detection], gts: Sequence[Detection], iou: str = "coco") -> float:
    """COCO AP of ``preds`` against ``gts`` on one image with pycocotools' COCOeval.

    Args:
        iou: ``"coco"`` for mAP averaged over IoU 0.50:0.95, ``"50"`` for AP at IoU 0.5.
    Returns:
        AP in [0, 1]; 1 when there are neither ground truths nor predictions, 0 when only
        one side is empty.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if not gts or not preds:
        return 1.0 if not gts and not preds else 0.0
    labels = sorted({d.label or "" for d in (*gts, *preds)})
    cat = {name: i + 1 for i, name in enumerate(labels)}  # COCO ids start at 1 (0 = unmatched)

    def xywh(b):
        return [b[0], b[1], max(b[2] - b[0], 0.0), max(b[3] - b[1], 0.0)]

    anns = [
        {"id": i + 1, "image_id": 1, "category_id": cat[g.label or ""], "bbox": xywh(g.box),
         "area": xywh(g.box)[2] * xywh(g.box)[3], "iscrowd": 0}
        for i, g in enumerate(gts)
    ]  # fmt: skip
    res = [
        {"image_id": 1, "category_id": cat[p.label or ""], "bbox": xywh(p.box),
         "score": p.confidence}
        for p in preds
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco = COCO()
        coco.dataset = {
            "images": [{"id": 1}],
            "annotations": anns,
            "categories": [{"id": i} for i in cat.values()],
        }
        coco.createIndex()
        ev = COCOeval(coco, coco.loadRes(res), iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    ap = float(ev.stats[0] if iou == "coco" else ev.stats[1])
    return max(ap, 0.0)  # -1 marks "no ground truth in this category set"


@REWARDS.register("det")
def det(
    completions: list[str],
    samples: list[dict],
    ctx: RewardContext,
    metric: str = "rft",
    iou_threshold: float = 0.5,
    iou_weight: float = 1.0,
    conf_weight: float = 1.0,
) -> list[float]:
    """Detection-list reward (see the module docstring).

    Args:
        metric: ``"rft"`` (Visual-RFT IoU + confidence terms), ``"map"`` (COCO mAP@[.5:.95]) or
            ``"map50"`` (COCO AP@0.5).
        iou_threshold: IoU a greedy match must exceed (rft only).
        iou_weight, conf_weight: weights of the two rft terms.
    Ground truth: ``answer`` as a detection list (string or list). Predicted boxes are mapped
    from model to image coordinates like ``iou``'s. No list in the answer scores 0.
    """
    _check(completions, samples)
    if metric not in ("rft", "map", "map50"):
        raise ValueError(f"det: unknown metric {metric!r}; valid: rft, map, map50")
    out = []
    for c, s in zip(completions, samples):
        gts = parse_detections(s["answer"])
        if gts is None:
            raise ValueError(
                f"sample {_sid(s)}: det needs answer as a list of boxes "
                f'\'[{{"bbox_2d": [x1, y1, x2, y2], "label": ...}}, ...]\', got {s["answer"]!r}'
            )
        preds = parse_detections(answer_or_text(c))
        if preds is None:
            out.append(0.0)
            continue
        meta = s.get("meta") or {}
        labelled = bool(gts) and all(g.label is not None for g in gts)
        if not labelled:
            gts = [Detection(g.box, g.confidence) for g in gts]
        preds = [
            Detection(
                tuple(to_original(list(p.box), meta)), p.confidence, p.label if labelled else None
            )
            for p in preds
        ]
        if metric == "rft":
            iou_t, conf_t = rft_terms(preds, gts, iou_threshold)
            out.append(iou_weight * iou_t + conf_weight * conf_t)
        else:
            out.append(coco_map(preds, gts, "coco" if metric == "map" else "50"))
    return out
