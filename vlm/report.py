"""Evaluation report of a VLM: accuracy per question family, grouped by modality (image, video,
3D), written as a table (Markdown), JSON and a bar chart (PNG).

A sample's modality is ``meta["modality"]`` when the generator set it (``"3d"`` for
datasets/spatial.py), else ``"video"`` when it carries ``videos``, else ``"image"``. Rows are
keyed by (modality, family), so two modalities may share a family name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..datasets.registry import modalities

MODALITIES: tuple[str, ...] = modalities()
"""Display order: the generators' (datasets/registry.py); other modality names follow
alphabetically."""
_COLORS = {"image": "#4C72B0", "video": "#DD8452", "3d": "#55A868"}


def modality(sample: dict) -> str:
    """The modality of one sample: ``meta["modality"]``, else video (has ``videos``), else image."""
    meta = sample.get("meta") or {}
    if meta.get("modality"):
        return str(meta["modality"])
    return "video" if sample.get("videos") else "image"


def _order(m: str) -> tuple[int, str]:
    return (MODALITIES.index(m) if m in MODALITIES else len(MODALITIES), m)


def family_rows(metrics: dict[str, float], samples: Sequence[dict]) -> list[dict]:
    """Rows ``{"modality", "family", "questions", "accuracy"}`` of one evaluation, with
    ``groups`` and ``group_accuracy`` where the family's samples form question groups.

    Args:
        metrics: what ``vlm.source.evaluate_accuracy`` returned for ``samples``
            (``accuracy/<family>``, ``count/<family>``, ``group_accuracy/<family>``).
        samples: the evaluated samples (their modality names each family's group).
    Raises:
        ValueError: a family holds samples of two modalities (a family's accuracy is one number).
    """
    mods: dict[str, set[str]] = {}
    for s in samples:
        mods.setdefault(str(s.get("family", "all")), set()).add(modality(s))
    rows = []
    for key, acc in metrics.items():
        if not key.startswith("accuracy/"):
            continue
        fam = key.split("/", 1)[1]
        found = mods.get(fam, {"image"})
        if len(found) > 1:
            raise ValueError(
                f"family {fam!r} mixes modalities {sorted(found)}; give each modality its own "
                "family name (or evaluate them as separate task sets)"
            )
        row = {"modality": found.pop(), "family": fam, "questions": int(metrics[f"count/{fam}"]),
               "accuracy": float(acc)}  # fmt: skip
        if f"groups/{fam}" in metrics:
            row["groups"] = int(metrics[f"groups/{fam}"])
            row["group_accuracy"] = float(metrics[f"group_accuracy/{fam}"])
        rows.append(row)
    return rows


def _weighted(rs: Sequence[dict]) -> dict:
    """The question-weighted accuracy of rows, and the group-weighted group accuracy of those
    that have groups."""
    n = sum(r["questions"] for r in rs)
    acc = sum(r["accuracy"] * r["questions"] for r in rs)
    out = {"questions": n, "accuracy": acc / n if n else 0.0}
    grouped = [r for r in rs if "groups" in r]
    if grouped:
        g = sum(r["groups"] for r in grouped)
        right = sum(r["group_accuracy"] * r["groups"] for r in grouped)
        out |= {"groups": g, "group_accuracy": right / g if g else 0.0}
    return out


def merge(rows: Sequence[dict]) -> list[dict]:
    """Combine rows of several evaluations: same (modality, family) -> question-weighted mean
    (group accuracy: group-weighted). Sorted by modality (MODALITIES order) then family."""
    same: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        same.setdefault((r["modality"], r["family"]), []).append(r)
    out = [{"modality": m, "family": f, **_weighted(rs)} for (m, f), rs in same.items()]
    return sorted(out, key=lambda r: (_order(r["modality"]), r["family"]))


def summarize(rows: Sequence[dict]) -> dict:
    """{"modalities": {m: {"questions", "accuracy"}}, "overall": {"questions", "accuracy"}}:
    question-weighted means (a family with more questions weighs more), with ``groups`` and
    ``group_accuracy`` where rows have groups."""
    mods = sorted({r["modality"] for r in rows}, key=_order)
    return {
        "modalities": {m: _weighted([r for r in rows if r["modality"] == m]) for m in mods},
        "overall": _weighted(rows),
    }


def paired_gain(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How far ``after`` moved from ``before`` on the same questions (``{question id: score}``,
    e.g. from ``evaluate_accuracy(scores=...)``; only ids both scored count): the mean
    per-question difference, its standard error (sample standard deviation of the differences
    over sqrt(n): the paired test, tighter than comparing two independent means because each
    question's difficulty cancels) and ``z`` = gain / SE (0 when nothing changed).

    Returns:
        ``questions``, ``before``, ``after``, ``gain``, ``se``, ``z``, ``improved`` (questions
        only ``after`` got right), ``regressed`` (the reverse).
    """
    ids = sorted(before.keys() & after.keys())
    n = len(ids)
    if n < 2:
        raise ValueError(f"a paired comparison needs 2 or more shared questions, got {n}")
    diffs = [after[i] - before[i] for i in ids]
    gain = sum(diffs) / n
    var = sum((d - gain) ** 2 for d in diffs) / (n - 1)
    se = (var / n) ** 0.5
    return {
        "questions": float(n),
        "before": sum(before[i] for i in ids) / n,
        "after": sum(after[i] for i in ids) / n,
        "gain": gain,
        "se": se,
        "z": gain / se if se > 0 else 0.0,
        "improved": float(sum(d > 0 for d in diffs)),
        "regressed": float(sum(d < 0 for d in diffs)),
    }


def markdown(rows: Sequence[dict]) -> str:
    """The table: one row per family, a subtotal row per modality, then the overall row; with
    question groups, two more columns: the groups and the share of them wholly right."""
    summary = summarize(rows)
    grouped = any("groups" in r for r in rows)

    def line(m: str, family: str, r: dict) -> str:
        cells = [m, family, str(r["questions"]), f"{r['accuracy']:.3f}"]
        if grouped:
            cells += (
                [str(r["groups"]), f"{r['group_accuracy']:.3f}"] if "groups" in r else ["-"] * 2
            )
        return "| " + " | ".join(cells) + " |"

    head = ["modality", "family", "questions", "accuracy"]
    head += ["groups", "all of group right"] if grouped else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, tot in summary["modalities"].items():
        lines += [line(m, r["family"], r) for r in rows if r["modality"] == m]
        lines.append(line(m, "all", tot))
    lines.append(line("all", "all", summary["overall"]))
    return "\n".join(lines)


def bar_chart(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Bars of accuracy per family, grouped and coloured by modality; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mods = sorted({r["modality"] for r in rows}, key=_order)
    xs, labels, x = [], [], 0.0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * len(rows) + 1.5 * len(mods)), 3.6))
    for m in mods:
        group = [r for r in rows if r["modality"] == m]
        pos = [x + i for i in range(len(group))]
        ax.bar(
            pos, [r["accuracy"] for r in group], color=_COLORS.get(m, "#8172B3"), label=m,
            width=0.8,
        )  # fmt: skip
        for p, r in zip(pos, group):
            ax.text(p, r["accuracy"] + 0.01, f"{r['accuracy']:.2f}", ha="center", fontsize=7)
        xs += pos
        labels += [r["family"] for r in group]
        x += len(group) + 1  # a gap between modalities
    ax.set_xticks(xs, labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.legend(title="modality", fontsize=8)
    return save_figure(fig, ax, path, title)


def save_figure(fig, ax, path: str | Path, title: str = "") -> Path:
    """Title ``ax`` (when given), lay ``fig`` out, write it as a PNG at ``path`` and close it."""
    import matplotlib.pyplot as plt

    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(
    rows: Sequence[dict], out_dir: str | Path, *, model: str = "", extra: dict | None = None
) -> dict:
    """Write ``eval.json``, ``eval.md`` and ``eval.png`` into out_dir.

    ``eval.json`` holds ``rows``, the per-modality and overall means, and ``metrics`` (flat:
    ``accuracy``, ``count``, ``accuracy/<modality>/<family>``, ``count/<modality>/<family>``;
    with question groups also ``group_accuracy``, ``groups`` and their per-family values).
    Returns {"table": Markdown text, "files": [paths]}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = merge(rows)
    summary = summarize(rows)
    metrics = {
        "accuracy": summary["overall"]["accuracy"],
        "count": float(summary["overall"]["questions"]),
    }
    if "groups" in summary["overall"]:
        metrics["group_accuracy"] = summary["overall"]["group_accuracy"]
        metrics["groups"] = float(summary["overall"]["groups"])
    for r in rows:
        metrics[f"accuracy/{r['modality']}/{r['family']}"] = r["accuracy"]
        metrics[f"count/{r['modality']}/{r['family']}"] = float(r["questions"])
        if "groups" in r:
            metrics[f"group_accuracy/{r['modality']}/{r['family']}"] = r["group_accuracy"]
            metrics[f"groups/{r['modality']}/{r['family']}"] = float(r["groups"])
    table = markdown(rows)
    record = {"model": model, "rows": rows, **summary, "metrics": metrics, **(extra or {})}
    (out / "eval.json").write_text(json.dumps(record, indent=1))
    (out / "eval.md").write_text(table + "\n")
    png = bar_chart(rows, out / "eval.png", title=f"held-out accuracy: {Path(model).name or model}")
    return {"table": table, "files": [out / "eval.json", out / "eval.md", png]}
