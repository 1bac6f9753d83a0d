"""pass@k of a VLM: sampled answers per question, the unbiased estimator, per family and modality.

For every question the policy samples ``n`` answers (its rollout temperature, or ``temperature``;
episodes with the tools when it has them) and the correctness reward scores each (correct:
score >= 0.5). With ``c`` correct of ``n``, pass@k is ``1 - C(n - c, k) / C(n, k)`` (Chen et
al. 2021), the chance that k answers drawn without replacement hold a correct one; averaged over
questions, per family, per modality and overall. Comparing a base's curve with an RL model's at
large k is how the field tells sharpening (RL ahead at k = 1, the base catching up at large k)
from discovery (RL ahead at every k).

``write_pass_k`` writes ``passk.json``, ``passk.md`` and one chart of pass@k against k with a line
per model (``passk.png``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .episode import episode_context
from .prompts import PromptConfig, encode_prompts
from .report import _order, modality, save_figure
from .rollout import SamplingParams
from .sampler import Rollouts

CORRECT = 0.5
"""an answer is correct when its correctness reward is at least this"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples (needs ``k <= n``), computed as the
    product ``prod_{i = n - c + 1}^{n} (1 - k / i)`` for ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def evaluate_pass_k(
    policy,
    samples: list[dict],
    reward,
    ks: Sequence[int],
    n: int,
    *,
    temperature: float | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 64,
    prompt: PromptConfig | None = None,
    strict: bool = True,
    token_budget: int = 16384,
) -> dict:
    """``n`` sampled answers per sample, scored by ``reward`` (a correctness reward; a policy
    with ``episode`` settings samples episodes, and the reward gets their records as
    ``episodes``, as in `source.evaluate_accuracy`).

    Returns:
        ``{"n", "ks", "questions", "correct": [c per question], "rows": [{"modality",
        "family", "questions", "pass@k": {k: value}}], "overall": {k: value}}``.
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"--pass-k values must lie in 1..{n} (the samples per question); got {ks}")
    sp = SamplingParams(
        temperature=policy.sampling.temperature if temperature is None else temperature,
        top_p=policy.sampling.top_p, max_new_tokens=max_new_tokens, token_budget=token_budget,
    )  # fmt: skip
    prompt = prompt or policy.prompt
    per_question: list[tuple[dict, int]] = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        idx = list(range(start, start + len(chunk)))
        enc, _ = encode_prompts(policy.processor, chunk, prompt, strict=strict, indices=idx)
        if not enc:
            continue
        b = Rollouts(policy).sample(enc, n, sp)
        totals, _, _ = reward(
            [m["completion"] for m in b.meta], [m["sample"] for m in b.meta], episode_context(b)
        )
        counts: dict[int, int] = defaultdict(int)
        for g, t in zip(b.group_id.tolist(), totals):
            counts[g] += int(float(t) >= CORRECT)
        per_question += [(p.sample, counts[g]) for g, p in enumerate(enc)]
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for s, c in per_question:
        groups[(modality(s), str(s.get("family", "all")))].append(c)
    rows = [
        {"modality": m, "family": f, "questions": len(cs),
         "pass@k": {k: _mean(pass_at_k(n, c, k) for c in cs) for k in ks}}
        for (m, f), cs in sorted(groups.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1]))
    ]  # fmt: skip
    all_c = [c for _, c in per_question]
    return {
        "n": n, "ks": ks, "questions": len(all_c), "correct": all_c, "rows": rows,
        "overall": {k: _mean(pass_at_k(n, c, k) for c in all_c) for k in ks},
    }  # fmt: skip


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def markdown(results: dict[str, dict]) -> str:
    """One table: a row per (model, modality, family) and per model overall, a column per k."""
    ks = next(iter(results.values()))["ks"]
    lines = ["| model | modality | family | questions | " + " | ".join(f"pass@{k}" for k in ks)
             + " |", "|---|---|---|---|" + "---|" * len(ks)]  # fmt: skip
    for name, r in results.items():
        for row in r["rows"]:
            vals = " | ".join(f"{row['pass@k'][k]:.3f}" for k in ks)
            lines.append(
                f"| {name} | {row['modality']} | {row['family']} | {row['questions']} | {vals} |"
            )
        vals = " | ".join(f"{r['overall'][k]:.3f}" for k in ks)
        lines.append(f"| {name} | all | all | {r['questions']} | {vals} |")
    return "\n".join(lines)


def chart(results: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """pass@k against k (log2 axis), one line per model (overall)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for name, r in results.items():
        ks = r["ks"]
        ax.plot(ks, [r["overall"][k] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, ax, path, title)


def write_pass_k(results: dict[str, dict], out_dir: str | Path) -> dict:
    """Write ``passk.json``, ``passk.md`` and ``passk.png``; returns {"table", "files"}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    serial = {
        name: {**r, "rows": [{**row, "pass@k": {str(k): v for k, v in row["pass@k"].items()}}
                             for row in r["rows"]],
               "overall": {str(k): v for k, v in r["overall"].items()}}
        for name, r in results.items()
    }  # fmt: skip
    (out / "passk.json").write_text(json.dumps(serial, indent=1))
    (out / "passk.md").write_text(table + "\n")
    png = chart(
        results, out / "passk.png", title=f"pass@k, n = {next(iter(results.values()))['n']}"
    )
    return {"table": table, "files": [out / "passk.json", out / "passk.md", png]}
