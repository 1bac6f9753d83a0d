"""The run doctor: reads a run's metrics and names the pathologies RL runs fail by, quietly.
Where the run kept rollout records (trainer/records.py), a finding also names a recorded group
that shows it (`with_examples`).

Each check looks at a few logged metrics (``metrics.jsonl``) and, when it finds its pathology,
returns a `Finding`: the step range and the figures (the evidence), why it matters, and what to
change in the recipe. A check compares the run's *early* window with its *late* one (the first
and last ``window`` share of the points of a metric) or looks at the late window alone, so a
run is judged by where it ended up, not by one noisy step. Thresholds are the fields of
`DoctorConfig`, each with the source of its default.

``serious`` findings make ``perceptrl doctor`` exit with status 1 (a linter's convention: the
run needs attention); ``warning`` ones are reported with status 0. A run with no finding gets a
short healthy summary. `write_report` writes ``doctor.md`` and ``doctor.png`` (the curves of the
metrics the findings read, their step ranges shaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, creating
from .metrics import latest_skips, read_metrics
from .records import read_records

ACCURACY_KEYS = ("eval/accuracy", "eval/success_rate", "reward/accuracy", "rollout/success_rate")
"""what the doctor reads as "the task is being solved", first one logged wins"""
NOT_COMPONENTS = ("mean", "std", "total", "accuracy", "guide_mean", "errors", "timeouts")
"""``reward/<name>`` entries that are not reward components (summaries, counters)"""


@dataclass(frozen=True)
class DoctorConfig:
    """The doctor's thresholds; the docstring of each names where its default comes from."""

    window: float = 0.25
    """share of a metric's points in the early and in the late window"""
    zero_std_warn: float = 0.5
    """share of groups scored alike (no group-relative signal) that wastes most of a step: DAPO
    (Yu et al. 2025) drops such groups for this reason"""
    zero_std_serious: float = 0.8
    """share of groups scored alike at which the run barely learns (the planner study saw
    70-74% and learnt little)"""
    entropy_collapse: float = 0.1
    """late / early policy entropy below which it collapsed (Cui et al. 2025, "The Entropy
    Mechanism of RL for Reasoning LMs": performance stops improving once entropy is spent)"""
    entropy_explosion: float = 3.0
    """late / early policy entropy above which the policy is coming apart"""
    clipfrac_max: float = 0.3
    """PPO clip fraction above which the updates go too far (0.1-0.3 is the usual range,
    Stable-Baselines3 and OpenAI baselines PPO guidance)"""
    approx_kl_max: float = 0.05
    """KL(old || new) per update above which PPO's trust region is broken (Spinning Up's
    target_kl 0.01-0.05)"""
    ref_kl_max: float = 1.0
    """KL to the reference policy per token (``actor/kl``) at which it has run away"""
    truncation_max: float = 0.2
    """share of completions cut at ``rollout.max_new_tokens`` (DAPO shapes overlong samples
    because truncated answers are scored as wrong)"""
    hack_rise: float = 0.1
    """rise of one reward component while accuracy stays within ``hack_flat``: reward hacking"""
    hack_flat: float = 0.02
    """accuracy change that counts as "does not improve\""""
    refill_share: float = 0.5
    """share of the step time spent on dynamic-sampling refills"""
    sim_unstable_max: float = 0.01
    """share of episodes cut by a physics blow-up"""
    slowdown: float = 1.5
    """late / early median step time: a throughput regression"""
    plateau_evals: int = 3
    """evaluations without a gain of ``plateau_gain`` over the best before them: a plateau"""
    plateau_gain: float = 0.01
    """smallest evaluation gain that counts as progress"""
    saturated: float = 0.95
    """a held-out rate at or above this is the goal reached, not a plateau"""


@dataclass
class Finding:
    """One pathology with its evidence, why it matters and what to change."""

    name: str
    severity: str  # "serious" | "warning"
    steps: tuple[int, int]
    evidence: str
    why: str
    fix: str
    keys: tuple[str, ...] = field(default_factory=tuple)
    """the metrics it read (plotted)"""
    example: str = ""
    """a recorded group that shows it (`with_examples`), when the run kept rollout records"""

    def line(self) -> str:
        a, b = self.steps
        return f"[{self.severity}] {self.name} (steps {a}-{b}): {self.evidence}"


class Series:
    """One metric over the run: steps and finite values, with its early and late windows."""

    def __init__(self, rows: list[dict], key: str, window: float):
        pts = [(r["step"], float(r[key])) for r in rows if key in r and "step" in r]
        pts = [(s, v) for s, v in pts if math.isfinite(v)]
        self.key = key
        self.steps = np.array([s for s, _ in pts], dtype=np.int64)
        self.values = np.array([v for _, v in pts], dtype=np.float64)
        self.k = max(1, int(math.ceil(window * len(pts)))) if pts else 0

    def __len__(self) -> int:
        return len(self.values)

    @property
    def early(self) -> float:
        return float(self.values[: self.k].mean())

    @property
    def late(self) -> float:
        return float(self.values[-self.k :].mean())

    @property
    def late_steps(self) -> tuple[int, int]:
        return int(self.steps[-self.k]), int(self.steps[-1])

    @property
    def span(self) -> tuple[int, int]:
        return int(self.steps[0]), int(self.steps[-1])


Check = Callable[[list[dict], DoctorConfig], "Finding | None"]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Add ``fn`` to the doctor's checks (run in the order they are defined)."""
    CHECKS.append(fn)
    return fn


def _first(rows: list[dict], keys: tuple[str, ...], cfg: DoctorConfig) -> Series | None:
    for key in keys:
        s = Series(rows, key, cfg.window)
        if len(s) >= 2:
            return s
    return None


# ----------------------------------------------------------------------------- the checks


@check
def groups_scored_alike(rows, cfg):
    s = _first(rows, ("adv/group_zero_std_frac", "rollout/zero_std_groups"), cfg)
    if s is None or s.late < cfg.zero_std_warn:
        return None
    return Finding(
        "groups scored alike", "serious" if s.late >= cfg.zero_std_serious else "warning",
        s.late_steps, f"{s.late:.0%} of the groups had equal rewards late in the run "
        f"(early {s.early:.0%}) ({s.key})",
        "a group whose samples all score alike has zero advantage: it costs a rollout and "
        "teaches nothing",
        "make the groups disagree: larger rollout.group_size, algo.dynamic_sampling=true, a "
        "higher rollout.temperature, or data of the difficulty the policy is at",
        (s.key,),
    )  # fmt: skip


@check
def entropy_out_of_range(rows, cfg):
    s = _first(rows, ("actor/entropy",), cfg)
    if s is None or s.early <= 0:  # a Gaussian's differential entropy may be negative
        return None
    ratio = s.late / s.early
    if cfg.entropy_collapse <= ratio <= cfg.entropy_explosion:
        return None
    collapsed = ratio < cfg.entropy_collapse
    return Finding(
        "entropy collapse" if collapsed else "entropy explosion", "warning", s.late_steps,
        f"policy entropy {s.early:.3g} early, {s.late:.3g} late ({ratio:.2f}x)",
        "a collapsed policy samples the same answer in every group, so exploration and the "
        "group signal stop" if collapsed else "the updates are pushing the policy towards "
        "uniform noise",
        "keep exploring: algo.clip_high=0.28 (DAPO's clip-higher), a small algo.entropy_coef, "
        "or a higher rollout.temperature" if collapsed else "lower train.lr, a tighter "
        "train.grad_clip, or check the rewards' scale",
        (s.key,),
    )  # fmt: skip


@check
def updates_too_large(rows, cfg):
    clip = _first(rows, ("actor/clipfrac",), cfg)
    kl = _first(rows, ("actor/approx_kl",), cfg)
    bad = [(s, lim) for s, lim in ((clip, cfg.clipfrac_max), (kl, cfg.approx_kl_max))
           if s is not None and s.late > lim]  # fmt: skip
    if not bad:
        return None
    s = bad[0][0]
    return Finding(
        "updates too large", "warning", s.late_steps,
        "; ".join(f"{b.key} {b.late:.3g} late (limit {lim:g})" for b, lim in bad),
        "PPO's ratio leaves its trust region: the clipped objective no longer bounds the "
        "step, and training becomes unstable",
        "lower train.lr, fewer train.ppo_epochs, or smaller steps per update "
        "(train.minibatch_size)",
        tuple(b.key for b, _ in bad),
    )  # fmt: skip


@check
def reference_kl_runs_away(rows, cfg):
    s = _first(rows, ("actor/kl",), cfg)
    if s is None or s.late < cfg.ref_kl_max:
        return None
    return Finding(
        "KL to the reference runs away", "serious", s.late_steps,
        f"KL to the reference {s.early:.3g} early, {s.late:.3g} late per token",
        "the policy has left the reference model far behind; its language may degrade while "
        "the reward still rises",
        "raise algo.kl_coef, lower train.lr, or check the reward for a shortcut",
        (s.key,),
    )  # fmt: skip


@check
def completions_hit_the_limit(rows, cfg):
    s = _first(rows, ("rollout/clip_ratio",), cfg)
    if s is None or s.late < cfg.truncation_max:
        return None
    length = _first(rows, ("rollout/completion_len_mean",), cfg)
    grew = f"; mean length {length.early:.0f} -> {length.late:.0f} tokens" if length else ""
    return Finding(
        "completions hit the length limit", "serious" if s.late >= 0.5 else "warning",
        s.late_steps, f"{s.late:.0%} of the completions were cut at rollout.max_new_tokens "
        f"(early {s.early:.0%}){grew}",
        "a cut completion has no answer and is scored as wrong, whatever its reasoning",
        "raise rollout.max_new_tokens, or penalise length (an overlong reward term, as DAPO)",
        (s.key,) + ((length.key,) if length else ()),
    )  # fmt: skip


@check
def reward_hacking(rows, cfg):
    acc = _first(rows, ACCURACY_KEYS, cfg)
    if acc is None or acc.late - acc.early >= cfg.hack_flat:
        return None
    keys = sorted({k for r in rows for k in r if k.startswith("reward/")})
    parts = [k for k in keys if k.count("/") == 1 and k.split("/")[1] not in NOT_COMPONENTS]
    rising = [s for s in (Series(rows, k, cfg.window) for k in parts)
              if len(s) >= 2 and s.late - s.early >= cfg.hack_rise]  # fmt: skip
    if not rising:
        return None
    s = rising[0]
    return Finding(
        "a reward component rises while accuracy does not", "warning", s.span,
        f"{s.key} {s.early:.3f} -> {s.late:.3f} while {acc.key} {acc.early:.3f} -> "
        f"{acc.late:.3f}",
        "the policy is collecting a component's reward without solving the task: the "
        "component can be satisfied by a shortcut",
        "lower that component's weight in rollout.reward, or tighten its rule; check what the "
        "completions write (perceptrl eval on a checkpoint)",
        (s.key, acc.key),
    )  # fmt: skip


@check
def non_finite_updates(rows, cfg):
    s = Series(rows, "nonfinite/skipped_updates", cfg.window)
    hit = s.values > 0
    if not hit.any():
        return None
    share = float(hit.mean())
    steps = s.steps[hit]
    return Finding(
        "non-finite updates skipped", "serious" if share > 0.1 else "warning",
        (int(steps[0]), int(steps[-1])), f"{int(hit.sum())} of {len(s)} steps skipped their "
        "update for a non-finite loss or gradient",
        "a skipped update is a step of rollouts thrown away; many of them mean the numerics "
        "are breaking",
        "lower train.lr, keep train.grad_clip on, and check rewards and advantages for "
        "infinities (a reward that returns inf)",
        (s.key,),
    )  # fmt: skip


@check
def refills_dominate(rows, cfg):
    refill, step = Series(rows, "time/refill", cfg.window), Series(rows, "time/step", cfg.window)
    if len(refill) < 2 or len(step) < 2 or step.late <= 0:
        return None
    share = refill.late / step.late
    if share < cfg.refill_share:
        return None
    return Finding(
        "dynamic-sampling refills dominate the step", "warning", refill.late_steps,
        f"refills take {share:.0%} of the step time late in the run",
        "most rollouts are thrown away because their groups scored alike",
        "give the groups signal instead of refilling them: a larger rollout.group_size, data "
        "nearer the policy's level, a lower algo.max_collects, or algo.dynamic_sampling=false",
        (refill.key, step.key),
    )  # fmt: skip


@check
def data_skipped(rows, cfg):
    skipped = latest_skips(rows)
    if not skipped:
        return None
    steps = [r["step"] for r in rows if any(k in r for k in skipped)]
    return Finding(
        "samples skipped", "warning", (min(steps), max(steps)),
        ", ".join(f"{k} {v:g}" for k, v in sorted(skipped.items())),
        "a lenient run trains on less data than the file holds",
        "fix the samples the counters name (perceptrl train with data.strict=true names each)",
        tuple(skipped),
    )  # fmt: skip


@check
def simulator_unstable(rows, cfg):
    keys = ["rollout/sim_unstable_frac"] + sorted({k for r in rows for k in r
                                                   if k.startswith("eval/sim_unstable/")})  # fmt: skip
    bad = [s for s in (Series(rows, k, cfg.window) for k in keys)
           if len(s) and s.values.max() > cfg.sim_unstable_max]  # fmt: skip
    if not bad:
        return None
    s = bad[0]
    return Finding(
        "simulator instabilities", "warning", s.span,
        "; ".join(f"{b.key} up to {b.values.max():.1%}" for b in bad),
        "episodes cut by a physics blow-up score what they had achieved; the policy may be "
        "learning to provoke them",
        "bound the actions (env.control), check the task's layout, or lower the action scale",
        tuple(b.key for b in bad),
    )  # fmt: skip


@check
def throughput_regression(rows, cfg):
    # an off-policy run's warm-up steps (random actions, no updates) are not its pace
    rows = [r for r in rows if not r.get("replay/random_actions")]
    s = Series(rows, "time/step", cfg.window)
    if len(s) < 8:
        return None
    warm = s.values[2:]  # the first steps pay for warm-up
    k = max(1, int(math.ceil(cfg.window * len(warm))))
    early, late = float(np.median(warm[:k])), float(np.median(warm[-k:]))
    if early <= 0 or late / early < cfg.slowdown:
        return None
    return Finding(
        "steps got slower", "warning", s.late_steps,
        f"median step {early:.2f} s early, {late:.2f} s late ({late / early:.2f}x)",
        "the run will take longer than its first steps promised; often the completions grow",
        "check rollout/completion_len_mean and memory (sys/peak_rss_mb); cap the lengths",
        (s.key,),
    )  # fmt: skip


@check
def evaluation_plateau(rows, cfg):
    s = _first(rows, ("eval/accuracy", "eval/success_rate"), cfg)
    n = cfg.plateau_evals
    if s is None or len(s) <= n:
        return None
    before, recent = s.values[:-n], s.values[-n:]
    best = float(s.values.max())
    fell = s.values[-1] < best - 0.05
    if recent.max() >= before.max() + cfg.plateau_gain or (best >= cfg.saturated and not fell):
        return None
    return Finding(
        "evaluation falls from its best" if fell else "evaluation plateau", "warning",
        (int(s.steps[-n]), int(s.steps[-1])),
        f"{s.key}: best {best:.3f} at step {int(s.steps[s.values.argmax()])}, the last {n} "
        f"evaluations {', '.join(f'{v:.3f}' for v in recent)}",
        "more steps of this recipe are not buying held-out performance",
        "keep the best checkpoint (checkpoint.best), stop earlier, or lower train.lr "
        "(train.lr_schedule=cosine)",
        (s.key,),
    )  # fmt: skip


# ----------------------------------------------------------------------------- running it


def diagnose(rows: list[dict], cfg: DoctorConfig | None = None) -> list[Finding]:
    """Every check on a run's metric rows; the findings, serious ones first."""
    cfg = cfg or DoctorConfig()
    found = [f for f in (c(rows, cfg) for c in CHECKS) if f is not None]
    return sorted(found, key=lambda f: f.severity != "serious")


EXAMPLES: dict[str, Callable[[dict], bool]] = {
    "groups scored alike": lambda g: (
        len(g["rows"]) > 1 and len({r["reward"] for r in g["rows"]}) == 1
    ),
    "completions hit the length limit": lambda g: any(r.get("truncated") for r in g["rows"]),
    "simulator instabilities": lambda g: any(r.get("end") == "unstable" for r in g["rows"]),
}
"""finding name -> which recorded groups show it"""


def with_examples(findings: list[Finding], records: list[dict]) -> list[Finding]:
    """``findings``, each of `EXAMPLES` given the latest recorded group (trainer/records.py)
    that shows it, preferring one inside the finding's step range."""
    for f in findings:
        shows = EXAMPLES.get(f.name)
        hits = [(r["step"], g) for r in records for g in r["groups"] if shows and shows(g)]
        inside = [(s, g) for s, g in hits if f.steps[0] <= s <= f.steps[1]]
        if hits:
            step, g = (inside or hits)[-1]
            name = f" ({g['id']})" if g.get("id") else ""
            rewards = " ".join(
                "nan" if r["reward"] is None else f"{r['reward']:g}" for r in g["rows"]
            )
            text = next((r["text"] for r in g["rows"] if r.get("text")), "")
            sample = f"; a sample: {text[:120]!r}" if text else ""
            f.example = f"step {step}, group {g['group']}{name}: rewards {rewards}{sample}"
    return findings


def healthy_summary(rows: list[dict]) -> str:
    """A few lines on a run: steps, reward, held-out metric, entropy, step time."""
    cfg = DoctorConfig()
    steps = [r["step"] for r in rows if "step" in r]
    parts = [f"{len(set(steps))} logged steps up to step {max(steps) if steps else 0}"]
    for label, keys in (("reward", ("reward/mean",)), ("held-out", ("eval/accuracy",
                        "eval/success_rate")), ("entropy", ("actor/entropy",))):  # fmt: skip
        s = _first(rows, keys, cfg)
        if s is not None:
            parts.append(f"{label} ({s.key}) {s.values[0]:.3f} -> {s.values[-1]:.3f}")
    t = Series(rows, "time/step", cfg.window)
    if len(t):
        parts.append(f"median step {float(np.median(t.values)):.2f} s")
    return "; ".join(parts)


def doctor_paragraph(rows: list[dict]) -> str:
    """The one-paragraph summary `perceptrl train`, `sft` and the demo print at their end."""
    findings = diagnose(rows)
    if not findings:
        return f"doctor: nothing wrong found ({healthy_summary(rows)})."
    serious = sum(f.severity == "serious" for f in findings)
    names = "; ".join(f.line() for f in findings)
    return f"doctor: {len(findings)} finding(s), {serious} serious: {names}."


def run_doctor(run: Path, out: Path | None = None) -> tuple[str, bool]:
    """`perceptrl doctor RUN`: the report (``doctor.md`` and ``doctor.png`` in ``out``, default
    ``RUN/doctor``) as text, and whether a finding is serious."""
    if not (run / "metrics.jsonl").is_file():
        raise ConfigError(
            f"perceptrl doctor {run}: no metrics.jsonl there; give a run directory (the "
            "--run-dir of perceptrl train or sft)"
        )
    out = out or run / "doctor"
    with creating(out):
        findings = write_report(run, out)
    text = (out / "doctor.md").read_text().rstrip()
    return f"{text}\n\nwrote {out / 'doctor.md'} and {out / 'doctor.png'}", any(
        f.severity == "serious" for f in findings
    )


def write_report(run_dir: Path, out: Path, cfg: DoctorConfig | None = None) -> list[Finding]:
    """Diagnose ``run_dir``; write ``doctor.md`` and ``doctor.png`` into ``out``."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    findings = with_examples(diagnose(rows, cfg), read_records(run_dir))
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Run doctor: {run_dir}", "", healthy_summary(rows), ""]
    if not findings:
        lines.append("Nothing wrong found.")
    for f in findings:
        lines += [f"## {f.name} ({f.severity})", "", f"- **Evidence** (steps {f.steps[0]}-"
                  f"{f.steps[1]}): {f.evidence}", f"- **Why it matters**: {f.why}",
                  f"- **What to change**: {f.fix}"]  # fmt: skip
        if f.example:
            lines.append(f"- **Example** (`perceptrl view {run_dir}`): {f.example}")
        lines.append("")
    (out / "doctor.md").write_text("\n".join(lines).rstrip() + "\n")
    _plot(rows, findings, out / "doctor.png")
    return findings


def _plot(rows: list[dict], findings: list[Finding], path: Path) -> None:
    """The curves each finding read, its step range shaded (a healthy run: reward, held-out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f, k) for f in findings for k in f.keys[:2]] or [
        (None, k) for k in ("reward/mean", "eval/accuracy", "eval/success_rate")
        if any(k in r for r in rows)
    ]  # fmt: skip
    panels = panels[:8] or [(None, "time/step")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 1.8 * len(panels)), squeeze=False)
    for ax, (f, key) in zip(axes[:, 0], panels):
        s = Series(rows, key, 0.25)
        ax.plot(s.steps, s.values, lw=1)
        ax.set_ylabel(key, fontsize=7)
        if f is not None:
            ax.axvspan(*f.steps, color="tab:red" if f.severity == "serious" else "tab:orange",
                       alpha=0.15)  # fmt: skip
            ax.set_title(f.name, fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
