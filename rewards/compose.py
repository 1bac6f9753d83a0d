"""Weighted composition of rewards, with failure isolation and a per-call time limit.

``build_reward({"format": 0.5, "accuracy": 1.0})`` gives a :class:`CompositeReward`; calling it
returns the weighted totals, every component's scores (logged as ``reward/<name>``) and
statistics. A term may carry keyword parameters: ``{"numeric": {"weight": 1.0, "abs_tol": 0.5}}``.

Gating: a term's mapping may hold ``"gate"``, so that the term counts only on completions where
other terms score at least a threshold — e.g. a length bonus paid only for correct answers::

    {"accuracy": 1.0,
     "format": {"weight": 0.5, "gate": "accuracy"},          # accuracy >= 1
     "rouge_l": {"weight": 0.2, "gate": {"accuracy": 0.5, "format": 1.0}}}  # all must hold

A gate compares the *ungated* scores of the named terms, which must be terms of the same
composite (give one weight 0 to use it only as a gate). A closed gate sets the term's component
to 0 for that completion; ``reward/<name>/gate_open`` logs the fraction of open gates and
``reward/<name>/ungated`` the mean score before gating.

Per-call context: the composite is called as ``reward(completions, samples, ctx)`` with a
:class:`~perceptrl.rewards.registry.RewardContext` (completion lengths in tokens, prompt group
ids, episode records; each optional) and hands every term the same context, with its own time
limit in ``ctx.timeout_s``. Every reward has the one signature ``fn(completions, samples, ctx,
**params)``; a term reads what it needs (``overlong`` the lengths, ``majority`` the group ids,
``tool_calls`` the episodes).

What a reward declares when it registers (``perceptrl.registry.REWARDS``, see
:class:`~perceptrl.rewards.registry.RewardNeeds`) is all the composite reads of it:

- ``prepare(**params)``: called once with the term's parameters when the composite is built,
  outside any time limit — the ``judge`` starts its worker and loads its model there, so a
  wrong path fails at start-up and loading never eats a call's limit;
- ``counters(**params)``: running totals ``{counter: value}`` (the ``judge``: its worker's
  ``restarts``); the composite logs each total's change during a call as
  ``reward/<counter>/<name>`` and their sum as ``reward/<counter>``;
- ``self_timed``: the reward enforces ``ctx.timeout_s`` itself and raises
  :class:`RewardTimeout` when it runs out, instead of being timed by the composite. The
  ``judge`` does so: it kills its worker process, which no timer in this process could stop
  inside native code.

A ``package.module:function`` term that is not registered declares nothing: nothing to
prepare, no counters, timed by the composite. Its signature is checked once, when the composite
is built.

Failures never stop a run:

- a component that raises is retried sample by sample, so only the samples it fails on score 0
  for that component; they count in ``reward/errors`` and ``reward/errors/<name>`` (as do
  non-finite scores and outputs of the wrong length);
- a call that exceeds ``timeout_s`` scores 0 for every sample of that call, counted in
  ``reward/timeouts`` and ``reward/timeouts/<name>``.

Time limit: on the main thread (and when no other interval timer is running) the limit is a
``signal.setitimer(ITIMER_REAL)`` alarm that interrupts the reward at the next Python bytecode;
a long call inside C code (a regex, a C extension) is interrupted only when it returns. Elsewhere
(worker threads, platforms without SIGALRM) the call runs in a daemon thread that is abandoned at
the limit: the run goes on, but the abandoned call keeps running in the background until it ends.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..registry import REWARDS
from .registry import RewardContext, RewardFn, RewardNeeds, check_call

log = logging.getLogger(__name__)


class RewardTimeout(BaseException):
    """A reward call exceeded its time limit (a BaseException so that ``except Exception``
    inside a reward cannot swallow it)."""


def _alarm_usable() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any) -> Any:
    """``fn(*args)``; raises :class:`RewardTimeout` after ``timeout_s`` s (None or 0: no limit)."""
    if not timeout_s or timeout_s <= 0:
        return fn(*args)
    if _alarm_usable():

        def on_alarm(signum, frame):
            raise RewardTimeout(f"exceeded {timeout_s} s")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    t = threading.Thread(target=run, daemon=True, name="reward-call")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardTimeout(f"exceeded {timeout_s} s (left running in a background thread)")
    if "err" in box:
        raise box["err"]
    return box["out"]


@dataclass
class RewardTerm:
    name: str
    """component name, logged as reward/<name>"""
    fn: RewardFn
    """fn(completions, samples, ctx) -> list[float], parameters already bound"""
    weight: float = 1.0
    """weight of this component in the total"""
    gate: dict[str, float] = field(default_factory=dict)
    """term name -> minimum (ungated) score of that term for this one to count; all must hold"""
    counters: Callable[[], Mapping[str, float]] | None = None
    """running totals of fn (e.g. worker restarts); their change per call is logged"""
    self_timed: bool = False
    """fn enforces ``ctx.timeout_s`` itself (declared at registration)"""


def _valid_scores(out: Any, n: int) -> list[float | None]:
    """Scores as floats, None where an entry is not a finite number; raises on a wrong length."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != n:
        got = len(out) if hasattr(out, "__len__") else type(out).__name__
        raise ValueError(f"returned {got} scores for {n} completions")
    vals: list[float | None] = []
    for v in out:
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        vals.append(f if math.isfinite(f) else None)
    return vals


def _counters(term: RewardTerm) -> dict[str, float]:
    if term.counters is None:
        return {}
    try:
        return {str(k): float(v) for k, v in term.counters().items()}
    except Exception as e:  # counters are diagnostics: never let them fail a step
        log.warning("reward %r: counters failed: %s: %s", term.name, type(e).__name__, e)
        return {}


class CompositeReward:
    """Weighted sum of reward terms, with gates; see the module docstring."""

    def __init__(self, terms: Sequence[RewardTerm], timeout_s: float | None = 10.0):
        if not terms:
            raise ValueError("a composite reward needs at least one term")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward terms in {names}")
        for t in terms:
            for g in t.gate:
                if g == t.name or g not in names:
                    raise ValueError(
                        f"reward {t.name!r}: gate {g!r} must name another term of this reward "
                        f"({', '.join(n for n in names if n != t.name) or 'none'}); add it, with "
                        "weight 0 if it should only gate"
                    )
        self.terms = list(terms)
        self.timeout_s = timeout_s

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def _call(
        self, term: RewardTerm, ctx: RewardContext, completions: list[str], samples: list[dict]
    ) -> Any:
        """The term's raw output, within the time limit (its own, for a self-timed term)."""
        if term.self_timed:
            return term.fn(completions, samples, ctx)
        return call_with_timeout(term.fn, self.timeout_s, completions, samples, ctx)

    def _score(
        self, term: RewardTerm, completions: list[str], samples: list[dict], ctx: RewardContext
    ) -> tuple[list[float], int, int]:
        """(scores [B], errors, timeouts) for one term."""
        n = len(completions)
        try:
            vals = _valid_scores(self._call(term, ctx, completions, samples), n)
        except RewardTimeout:
            log.warning(
                "reward %r timed out after %s s on %d samples; they score 0",
                term.name,
                self.timeout_s,
                n,
            )
            return [0.0] * n, 0, n
        except Exception as e:
            log.warning(
                "reward %r raised %s: %s; retrying sample by sample", term.name, type(e).__name__, e
            )
            return self._score_each(term, completions, samples, ctx)
        errors = sum(v is None for v in vals)
        return [0.0 if v is None else v for v in vals], errors, 0

    def _score_each(
        self, term: RewardTerm, completions: list[str], samples: list[dict], ctx: RewardContext
    ) -> tuple[list[float], int, int]:
        scores, errors, timeouts = [0.0] * len(completions), 0, 0
        for i, (c, s) in enumerate(zip(completions, samples)):
            if timeouts:  # one slow sample already cost a full limit: skip the rest
                timeouts += 1
                continue
            try:
                v = _valid_scores(self._call(term, ctx.select([i]), [c], [s]), 1)[0]
            except RewardTimeout:
                timeouts += 1
                continue
            except Exception as e:
                log.warning(
                    "reward %r failed on sample %s: %s: %s",
                    term.name,
                    s.get("id", i) if isinstance(s, dict) else i,
                    type(e).__name__,
                    e,
                )
                v = None
            errors += v is None
            scores[i] = 0.0 if v is None else v
        return scores, errors, timeouts

    def __call__(
        self, completions: list[str], samples: list[dict], ctx: RewardContext | None = None
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        """Score a batch.

        Args:
            completions: [B] generated texts.
            samples: [B] dataset samples, one per completion.
            ctx: what the rollout knows of the completions (lengths [B] for ``overlong``,
                group ids [B] for ``majority``, episode records [B] for the episode terms);
                its ``timeout_s`` is replaced by the composite's own limit.
        Returns:
            totals [B] (weighted sums), components name -> [B] scores (after gating), and
            stats: ``reward/total``, ``reward/<name>`` (means), ``reward/errors[/<name>]`` and
            ``reward/timeouts[/<name>]`` (counts of failed samples), for gated terms
            ``reward/<name>/gate_open`` and ``reward/<name>/ungated``, and for terms with
            counters their change in this call, ``reward/<counter>[/<name>]`` (e.g.
            ``reward/restarts/judge``).
        """
        if len(completions) != len(samples):
            raise ValueError(f"got {len(completions)} completions for {len(samples)} samples")
        n = len(completions)
        ctx = dataclasses.replace((ctx or RewardContext()).checked(n), timeout_s=self.timeout_s)
        raw: dict[str, list[float]] = {}
        stats: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        for term in self.terms:
            before = _counters(term)
            scores, errors, timeouts = self._score(term, list(completions), list(samples), ctx)
            raw[term.name] = scores
            stats[f"reward/errors/{term.name}"] = float(errors)
            stats[f"reward/timeouts/{term.name}"] = float(timeouts)
            stats["reward/errors"] += errors
            stats["reward/timeouts"] += timeouts
            for k, v in _counters(term).items():
                stats[f"reward/{k}/{term.name}"] = v - before.get(k, 0.0)
                stats[f"reward/{k}"] = stats.get(f"reward/{k}", 0.0) + v - before.get(k, 0.0)
        components: dict[str, list[float]] = {}
        totals = [0.0] * n
        for term in self.terms:
            scores = raw[term.name]
            if term.gate:
                open_ = [all(raw[g][i] >= thr for g, thr in term.gate.items()) for i in range(n)]
                stats[f"reward/{term.name}/gate_open"] = sum(open_) / n if n else 0.0
                stats[f"reward/{term.name}/ungated"] = sum(scores) / n if n else 0.0
                scores = [v if o else 0.0 for v, o in zip(scores, open_)]
            components[term.name] = scores
            totals = [t + term.weight * v for t, v in zip(totals, scores)]
            stats[f"reward/{term.name}"] = sum(scores) / n if n else 0.0
        stats["reward/total"] = sum(totals) / n if n else 0.0
        return totals, components, stats

    def __repr__(self) -> str:
        def one(t: RewardTerm) -> str:
            gate = ("|gate:" + ",".join(f"{g}>={v:g}" for g, v in t.gate.items())) if t.gate else ""
            return f"{t.name}={t.weight:g}{gate}"

        inner = ", ".join(one(t) for t in self.terms)
        return f"CompositeReward({inner}, timeout_s={self.timeout_s})"


def _gate(name: str, gate: Any) -> dict[str, float]:
    """``"term"`` -> {term: 1.0}; {term: threshold, ...} -> as floats."""
    if isinstance(gate, str):
        gate = {gate: 1.0}
    if not isinstance(gate, Mapping) or not gate:
        raise ValueError(
            f"reward {name!r}: gate must be a term name or a mapping term -> minimum score, "
            f"got {gate!r}; e.g. gate: accuracy or gate: {{accuracy: 0.5}}"
        )
    out = {}
    for k, v in gate.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(
                f"reward {name!r}: gate threshold for {k!r} must be a number, got {v!r}"
            )
        out[str(k)] = float(v)
    return out


def _weight_and_params(name: str, value: Any) -> tuple[float, dict[str, float], dict]:
    """A term's recipe value -> (weight, gate, keyword parameters)."""
    gate: dict[str, float] = {}
    if isinstance(value, Mapping):
        params = dict(value)
        weight = params.pop("weight", 1.0)
        if "gate" in params:
            gate = _gate(name, params.pop("gate"))
    else:
        weight, params = value, {}
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
    return float(weight), gate, params


def _term(name: str, value: Any, prepare: bool = True) -> RewardTerm:
    """One term: the reward's entry, checked against its parameters, prepared as it declares
    (``prepare=False``: only checked, as when a recipe loads)."""
    weight, gate, params = _weight_and_params(name, value)
    entry = REWARDS.resolve(name)
    needs = RewardNeeds.of(entry)
    check_call(entry, params)
    if prepare and needs.prepare is not None:
        needs.prepare(**params)
    counters = functools.partial(needs.counters, **params) if needs.counters else None
    fn = functools.partial(entry.obj, **params) if params else entry.obj
    return RewardTerm(
        name=name, fn=fn, weight=weight, gate=gate, counters=counters,
        self_timed=needs.self_timed,
    )  # fmt: skip


def build_reward(
    spec: str | Sequence[str] | Mapping[str, Any] | CompositeReward, timeout_s: float | None = 10.0
) -> CompositeReward:
    """Composite reward from a spec.

    Args:
        spec: a name or ``"module:function"`` (comma-separated names allowed), a list of them
            (weight 1 each), a mapping name -> weight, or name -> {"weight": w, "gate": g,
            **params} (gates: see the module docstring).
        timeout_s: time limit per reward call in seconds; None or 0 disables it.
    Raises:
        ValueError: unknown reward (listing valid names), bad weight, parameters or gate.
    """
    if isinstance(spec, CompositeReward):
        return spec
    return CompositeReward([_term(k, v) for k, v in _items(spec)], timeout_s=timeout_s)


def check_reward(spec: str | Sequence[str] | Mapping[str, Any]) -> None:
    """Check a spec as `build_reward` does (names, ``module:function`` imports, signatures,
    weights, parameters, gates) without preparing anything (no judge worker starts): what a
    recipe's reward is checked with when it loads.

    Raises:
        ValueError: as `build_reward`.
    """
    CompositeReward([_term(k, v, prepare=False) for k, v in _items(spec)])


def _items(spec: str | Sequence[str] | Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A spec as (term name, recipe value) pairs."""
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, Sequence):
        bad = [s for s in spec if not isinstance(s, str)]
        if bad:
            raise ValueError(
                f"reward list entries must be names, got {bad!r}; use a mapping "
                "name -> weight for weights"
            )
        items = [(s, 1.0) for s in spec]
    else:
        raise ValueError(f"reward spec must be a name, list or mapping, got {type(spec).__name__}")
    if not items:
        raise ValueError("empty reward spec; e.g. {'format': 0.5, 'accuracy': 1.0}")
    return [(str(k), v) for k, v in items]
