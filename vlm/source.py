"""`VLMRolloutSource`: samples -> prompts -> G completions each -> rewards, one batch per step.

It walks the samples in a seeded shuffled order, epoch after epoch; each step's sampling RNG is
derived from ``(seed, step)`` (forked, so the global RNG is untouched), hence a run resumed from
``state_dict()`` draws exactly the batches an uninterrupted run would have drawn.

T-GRPO (Video-R1, ``rollout.tgrpo_alpha > 0``): each video prompt is also sampled
``tgrpo_shuffled`` times with its frames shuffled (same timestamps, content out of order). Those
rollouts are scored but never trained on; they only decide, per group, whether the correct
ordered rollouts earn the bonus ``alpha`` (see :func:`tgrpo_bonus`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from ..datasets.loader import DataError
from ..rewards.registry import RewardContext
from ..trainer.batch import GUIDE, RolloutBatch
from . import rollout
from .config import RolloutConfig, tgrpo_correct_key  # noqa: F401  (tgrpo_correct_key: re-exported)
from .episode import episode_context, episode_metrics, summarize
from .process import ProcessMonitor
from .prompts import EncodedPrompt, PromptConfig, encode_prompt, encode_prompts
from .records import describe_group
from .sampler import Rollouts, sampled_tokens

RewardFn = Callable[
    [list[str], list[dict], RewardContext], tuple[list[float], dict[str, list[float]], dict]
]
"""A composite reward (``rewards.build_reward``): ``(completions, samples, ctx) -> (totals [B],
components {name: [B]}, stats)``."""


@contextlib.contextmanager
def _step_rng(seed: int, step: int, device: torch.device):
    """A private torch RNG stream for one step's sampling, seeded by ``(seed, step)``."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))
        yield


def _check_reward(out, n: int) -> tuple[list[float], dict[str, list[float]], dict]:
    totals, comps, stats = out
    if len(totals) != n or any(len(v) != n for v in comps.values()):
        raise ValueError(
            f"reward returned {len(totals)} totals / component lengths "
            f"{ {k: len(v) for k, v in comps.items()} } for {n} completions"
        )
    return list(totals), comps, stats or {}


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def tgrpo_bonus(
    correct: torch.Tensor,
    group_id: torch.Tensor,
    correct_shuffled: torch.Tensor,
    group_id_shuffled: torch.Tensor,
    alpha: float,
    mu: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """T-GRPO's temporal bonus, computed group by group (any number of groups per batch).

    A group that has shuffled-frame rollouts gets ``alpha`` on each of its correct ordered
    rollouts when ``p >= mu * p_shuffled``, p being the group's fraction of correct ordered
    rollouts and p_shuffled that of its shuffled rollouts. Groups without shuffled rollouts
    (e.g. image prompts) get nothing.

    Args:
        correct: [B] 1/0 (or bool) per ordered rollout; group_id: [B] its prompt group.
        correct_shuffled: [S] 1/0 per shuffled rollout; group_id_shuffled: [S] its prompt group.

    Returns:
        bonus [B] float, and metrics ``tgrpo_bonus_rate`` (share of T-GRPO groups whose correct
        rollouts got the bonus),
        ``tgrpo_acc_ordered`` / ``tgrpo_acc_shuffled`` (accuracy over those groups' rollouts) and
        ``tgrpo_groups``.
    """
    c = correct.float()
    cs = correct_shuffled.float().to(c.device)
    group_id, gs = group_id.to(c.device), group_id_shuffled.to(c.device)
    ids, inv = torch.unique(torch.cat([group_id, gs]), return_inverse=True)
    inv_o, inv_s = inv[: len(group_id)], inv[len(group_id) :]
    G = len(ids)
    n_o = torch.zeros(G, device=c.device).index_add_(0, inv_o, torch.ones_like(c))
    k_o = torch.zeros(G, device=c.device).index_add_(0, inv_o, c)
    n_s = torch.zeros(G, device=c.device).index_add_(0, inv_s, torch.ones_like(cs))
    k_s = torch.zeros(G, device=c.device).index_add_(0, inv_s, cs)
    has = (n_s > 0) & (n_o > 0)  # groups that T-GRPO applies to
    p = k_o / n_o.clamp(min=1)
    p_s = k_s / n_s.clamp(min=1)
    earned = has & (k_o > 0) & (p >= mu * p_s)  # [G]: groups whose correct rollouts get alpha
    bonus = alpha * (earned[inv_o] & (c > 0)).float()  # [B]
    m = {
        "tgrpo_groups": float(has.sum()),
        "tgrpo_bonus_rate": float(earned.sum() / has.sum()) if has.any() else 0.0,
        "tgrpo_acc_ordered": float(k_o[has].sum() / n_o[has].sum()) if has.any() else 0.0,
        "tgrpo_acc_shuffled": float(k_s[has].sum() / n_s[has].sum()) if has.any() else 0.0,
    }
    return bonus, m


class SkippedAllError(DataError, RuntimeError):
    """Lenient mode: every sample drawn for a step failed to load (a `DataError`; also a
    RuntimeError, as it was before)."""


class VLMRolloutSource:
    """Implements ``trainer.policy.RolloutSource`` for a ``VLMPolicy``.

    Args:
        samples: the training samples (see ``vlm.prompts`` for the schema).
        reward: composite reward ``(completions, samples, ctx) -> (totals, components, stats)``.
        cfg: rollout settings (prompts per step, group size, sampling, lengths, system prompt).
        seed: seed of the data order and of each step's sampling.
        strict: an unreadable image raises (naming file and sample); False skips and counts it.
        data_skipped: samples skipped when the data loaded, by reason (``malformed``,
            ``images``, ``videos``, ``too_long``): every step's metrics carry the non-zero
            ones as ``data/skipped_<reason>``, so a run's log (and a resumed run's) has them.

    Prompts are encoded with the policy's prompt settings and sampled with its sampling settings
    (``policy.prompt``, ``policy.sampling``): the distribution the trainer scores is the one the
    rollouts drew from, because both read the one setting.
    """

    def __init__(
        self,
        samples: list[dict],
        reward: RewardFn,
        cfg: RolloutConfig | None = None,
        *,
        seed: int = 0,
        strict: bool = True,
        data_skipped: dict[str, int] | None = None,
        process=None,
        guide: Callable[[dict], str | list[str]] | None = None,
        engine=None,
        fork: bool = True,
    ):
        if not samples:
            raise ValueError("VLMRolloutSource needs at least one sample")
        cfg = cfg or RolloutConfig()
        self.samples, self.reward, self.cfg = samples, reward, cfg
        self.seed, self.strict = seed, strict
        self.data_metrics = {
            f"data/skipped_{k}": float(v) for k, v in (data_skipped or {}).items() if v
        }
        self.tgrpo_key = tgrpo_correct_key(cfg.reward) if cfg.tgrpo_alpha > 0 else None
        self.process = process
        """process reward (``vlm/process.py``: ``(batch, correct) -> ([B, T], stats)``)"""
        self.guide = guide if cfg.guide else None
        """``rollout.guide``: a sample's reference trace (``run.guide_traces``)"""
        self.engine, self.fork = engine, fork
        """the rollout engine (``vlm/sampler.py``; None: the HF engine on the policy's model)"""
        self._rollouts: Rollouts | None = None
        self.monitor = ProcessMonitor()
        self.epoch, self.pos, self.skipped_total = 0, 0, 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    # ---- data order ---------------------------------------------------------------------------

    def _next_index(self) -> int:
        if self.pos >= len(self.samples):
            self.epoch, self.pos = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order, self._order_epoch = rng.permutation(len(self.samples)), self.epoch
        i = int(self._order[self.pos])
        self.pos += 1
        return i

    def _next_prompts(self, policy) -> tuple[list, int]:
        """``prompts_per_step`` encoded prompts; lenient mode replaces unreadable samples."""
        prompts, skipped = [], 0
        while len(prompts) < self.cfg.prompts_per_step:
            idx = [self._next_index() for _ in range(self.cfg.prompts_per_step - len(prompts))]
            enc, bad = policy.encode(
                [self.samples[i] for i in idx], strict=self.strict, indices=idx
            )
            prompts += enc
            skipped += len(bad)
            if skipped >= len(self.samples):
                raise SkippedAllError(
                    f"{skipped} samples skipped in one step because their images or videos "
                    f"failed to load (last: {bad[-1]['error']}); check the data's files"
                )
        self.skipped_total += skipped
        return prompts, skipped

    def rollouts(self, policy) -> Rollouts:
        """The sampler driver over this source's engine for ``policy``."""
        if self._rollouts is None or self._rollouts.policy is not policy:
            self._rollouts = Rollouts(policy, self.engine, fork=self.fork)
        return self._rollouts

    # ---- RolloutSource ----------------------------------------------------------------------

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One scored batch of ``prompts_per_step * group_size`` completions, and its metrics."""
        t0 = time.perf_counter()
        prompts, skipped = self._next_prompts(policy)
        with _step_rng(self.seed, step, policy.device):
            batch = self.rollouts(policy).sample(
                prompts, self.cfg.group_size - (self.cfg.guide if self.guide else 0)
            )
            shuffled = self._shuffled_rollouts(policy, prompts, step) if self.tgrpo_key else None
        if self.guide is not None:
            batch = self._with_guide(policy, prompts, batch)
        t1 = time.perf_counter()
        completions = [m["completion"] for m in batch.meta]
        episodes = None  # e.g. overlong reads the lengths, majority the groups, tool_calls these
        if any("episode" in m for m in batch.meta):
            episodes = [m.get("episode") for m in batch.meta]
        ctx = RewardContext(
            lengths=batch.mask.sum(1).long().tolist(), group_ids=batch.group_id.tolist(),
            episodes=episodes,
        )  # fmt: skip
        totals, comps, stats = _check_reward(
            self.reward(completions, [m["sample"] for m in batch.meta], ctx), len(batch)
        )
        if shuffled is not None:
            totals, tstats = self._apply_tgrpo(batch, totals, comps, shuffled)
            stats = {**stats, **tstats}
        t2 = time.perf_counter()
        batch.rewards = torch.tensor(totals, dtype=torch.float32, device=batch.tokens.device)
        for i, m in enumerate(batch.meta):  # each row's reward components (rollout records)
            m["components"] = {name: vals[i] for name, vals in comps.items()}
        metrics = self._metrics(batch, totals, comps, stats)
        if self.process is not None:
            metrics.update(self._process(batch, totals, comps, step))
            t2 = time.perf_counter()
        metrics.update(episode_metrics(self._sampled(batch, metrics)))
        metrics.update(
            {
                "rollout/skipped_images": float(skipped),
                "rollout/skipped_images_total": float(self.skipped_total),
                "rollout/epoch": float(self.epoch),
                "time/rollout": t1 - t0,
                "time/reward": t2 - t1,
                **self.data_metrics,
            }
        )
        return batch, metrics

    def describe_group(self, policy, batch: RolloutBatch, rows: list[int]):
        """The rollout record's fields of one group (vlm/records.py)."""
        return describe_rollouts(policy, batch, rows)

    # ---- off-policy guidance ------------------------------------------------------------------

    def _with_guide(self, policy, prompts: list[EncodedPrompt], sampled: RolloutBatch):
        """``sampled`` with ``rollout.guide`` rows of each prompt's reference trace added to its
        group (the policy scores the trace's tokens; an episode's turns run in its environment),
        rows of one group adjacent; guide rows have ``origin`` `GUIDE`."""
        k = self.cfg.guide
        samples = [p.sample for p in prompts for _ in range(k)]
        try:
            guided = policy.completions_batch(samples, [self.guide(s) for s in samples])
        except ValueError as e:  # a trace's turn the environment refuses
            raise DataError(
                f"rollout.guide: a reference trace does not run: {e}. Check that sample's "
                "metadata, or train without guide rows (rollout.guide=0)"
            ) from e
        guided.group_id = (
            torch.arange(len(prompts)).repeat_interleave(k).to(sampled.group_id.device)
        )
        guided.origin = torch.full_like(guided.group_id, GUIDE)
        batch = RolloutBatch.concat([sampled, guided])
        return batch.select(torch.argsort(batch.group_id.cpu(), stable=True))

    @staticmethod
    def _sampled(batch: RolloutBatch, metrics: dict) -> RolloutBatch:
        """The rows the policy sampled (all but guide rows), after adding the guide rows'
        count and mean reward to ``metrics``: the episode metrics describe the policy."""
        is_guide = (batch.row_origin() == GUIDE).cpu()
        guide, own = (
            is_guide.nonzero().squeeze(1).tolist(),
            (~is_guide).nonzero().squeeze(1).tolist(),
        )
        if not guide:
            return batch
        metrics["rollout/guide_rows"] = float(len(guide))
        metrics["reward/guide_mean"] = float(batch.rewards[guide].mean())
        metrics["reward/sampled_mean"] = float(batch.rewards[own].mean())
        return batch.select(own)

    # ---- T-GRPO -------------------------------------------------------------------------------

    def _shuffled_rollouts(self, policy, prompts: list[EncodedPrompt], step: int):
        """(batch, group ids [S]) of rollouts on shuffled frames for the video prompts, or None."""
        shuf, groups = [], []
        for j, p in enumerate(prompts):
            if not p.sample.get("videos"):
                continue
            seed = int(np.random.SeedSequence([self.seed, step, j, 7]).generate_state(1)[0])
            shuf.append(encode_prompt(policy.processor, p.sample, policy.prompt, shuffle_seed=seed))
            groups.append(j)
        if not shuf:
            return None
        n = self.cfg.tgrpo_shuffled or self.cfg.group_size
        b = self.rollouts(policy).sample(shuf, n)
        gid = torch.tensor(groups).repeat_interleave(n)
        return b, gid

    def _apply_tgrpo(self, batch: RolloutBatch, totals: list[float], comps, shuffled):
        """Totals with T-GRPO's bonus on the ordered rollouts, and its metrics."""
        sb, sgid = shuffled
        key = self.tgrpo_key
        ctx = RewardContext(lengths=sb.mask.sum(1).long().tolist(), group_ids=sgid.tolist())
        _, scomps, _ = _check_reward(
            self.reward([m["completion"] for m in sb.meta], [m["sample"] for m in sb.meta], ctx),
            len(sb),
        )
        if key not in comps or key not in scomps:
            raise KeyError(f"T-GRPO: the reward returned no {key!r} component ({list(comps)})")
        thr = self.cfg.tgrpo_threshold
        correct = torch.tensor([v >= thr for v in comps[key]])
        correct_s = torch.tensor([v >= thr for v in scomps[key]])
        bonus, m = tgrpo_bonus(
            correct, batch.group_id.cpu(), correct_s, sgid, self.cfg.tgrpo_alpha, self.cfg.tgrpo_mu
        )
        stats = {f"reward/{k}": v for k, v in m.items()}
        stats["reward/tgrpo_bonus"] = float(bonus.mean())
        stats["reward/tgrpo_shuffled_samples"] = float(len(sb))
        return [t + float(b) for t, b in zip(totals, bonus.tolist())], stats

    def _process(self, batch: RolloutBatch, totals, comps, step: int) -> dict:
        """Process rewards into ``batch.step_rewards``; their metrics and the hacking monitor
        (outcome = the ``accuracy`` component, or the total reward without one)."""
        correct = torch.tensor(comps.get("accuracy", totals), dtype=torch.float32)
        steps, stats = self.process(batch, correct)
        if not torch.isfinite(steps).all():
            raise ValueError("the process reward returned NaN or infinite step rewards")
        batch.step_rewards = steps.to(batch.tokens.device)
        per_row = steps.sum(1)
        m = {f"reward/{k}": float(v) for k, v in stats.items()}
        m["reward/process_mean"] = float(per_row.mean())
        m["reward/process_std"] = float(per_row.std()) if len(per_row) > 1 else 0.0
        m["reward/process_vs_outcome"] = self.monitor(
            m["reward/process_mean"], float(correct.mean()), step
        )
        return m

    def _metrics(self, batch: RolloutBatch, totals, comps, stats) -> dict[str, float]:
        lengths = batch.mask.sum(1)
        r = torch.tensor(totals, dtype=torch.float64)
        groups = defaultdict(list)
        for g, v in zip(batch.group_id.tolist(), totals):
            groups[g].append(v)
        m = {
            "reward/mean": float(r.mean()),
            "reward/std": float(r.std()) if len(r) > 1 else 0.0,
            "rollout/completion_len_mean": float(lengths.mean()),
            "rollout/completion_len_max": float(lengths.max()),
            "rollout/clip_ratio": _mean(float(x["truncated"]) for x in batch.meta),
            "rollout/prompt_len_mean": _mean(x.numel() for x in batch.row_prompts()["prompt_ids"]),
            "rollout/samples": float(len(batch)),
            "rollout/zero_std_groups": _mean(float(max(v) == min(v)) for v in groups.values()),
        }
        if batch.segments is not None and batch.segments.branches:
            sampled, leaf = sampled_tokens(batch)
            m["rollout/sampled_tokens"] = float(sampled)
            m["rollout/tree_token_ratio"] = sampled / max(leaf, 1)
        for name, vals in comps.items():
            m[f"reward/{name}"] = _mean(vals)
        for k, v in stats.items():  # e.g. error / timeout counts of the composite reward
            if isinstance(v, (int, float)) and math.isfinite(v):
                m[k if k.startswith("reward/") else f"reward/{k}"] = float(v)
        return m

    def state_dict(self) -> dict:
        """Data position (the order and the sampling RNG are pure functions of seed, epoch, step)."""
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "skipped_total": self.skipped_total,
            "seed": self.seed,
            "num_samples": len(self.samples),
            "process": self.process.state_dict() if hasattr(self.process, "state_dict") else {},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples", len(self.samples)) != len(self.samples):
            raise ValueError(
                f"resume state is for {state['num_samples']} samples but this source has "
                f"{len(self.samples)}; resume with the same dataset"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.skipped_total = int(state.get("skipped_total", 0))
        if state.get("process") and hasattr(self.process, "load_state_dict"):
            self.process.load_state_dict(state["process"])
        self._order_epoch = -1


def _greedy(policy, prompts: list[EncodedPrompt], max_new_tokens: int, token_budget: int):
    """Greedy answers: episodes with the tools when the policy has ``episode`` settings, else
    one completion each."""
    if getattr(policy, "episode", None) is None:
        return rollout.greedy(policy.model, policy.processor, prompts, max_new_tokens, token_budget)
    sp = rollout.SamplingParams(0.0, max_new_tokens=max_new_tokens, token_budget=token_budget)
    return Rollouts(policy).sample(prompts, 1, sp)


def evaluate_accuracy(
    policy,
    samples: list[dict],
    reward: RewardFn,
    batch_size: int = 16,
    *,
    max_new_tokens: int = 64,
    prompt: PromptConfig | None = None,
    strict: bool = True,
    token_budget: int = 16384,
    scores: dict[str, float] | None = None,
    records: dict[str, dict] | None = None,
) -> dict[str, float]:
    """Greedy-decode every sample and score it: accuracy is the mean reward total, so pass a
    correctness reward (e.g. numeric / mcq / iou without the format bonus). ``scores``, when
    given, receives each scored sample's total under its ``id`` (``#<position among the scored
    samples>`` when it has none), so two models can be compared question by question
    (``report.paired_gain``). ``records``, likewise, receives each scored episode's record
    (``meta["episode"]``: its turn texts, observations and environment info).

    A policy with ``episode`` settings answers in greedy episodes (tools called as in training;
    the answer is the last turn).

    Returns:
        ``accuracy``, ``accuracy/<family>``, ``count``, ``count/<family>``, ``reward/<component>``,
        ``completion_len_mean``, ``clip_ratio`` and ``skipped`` (lenient image failures); for
        episodes also ``episode/...`` and ``tool/...`` (see ``episode.summarize``). When
        samples share a ``meta["group"]`` (MMBench's circular copies of a question, MME's two
        questions on an image), also ``group_accuracy``, ``groups`` and their ``/<family>``
        values: a group counts as correct only when every sample of it scores at least 0.5.
    """
    prompt = prompt or policy.prompt
    tally = _Tally(scores, records)
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        idx = list(range(start, start + len(chunk)))
        enc, bad = encode_prompts(policy.processor, chunk, prompt, strict=strict, indices=idx)
        tally.skipped += len(bad)
        if not enc:
            continue
        b = _greedy(policy, enc, max_new_tokens, token_budget)
        context = episode_context(b)  # for episode terms
        done = [m["sample"] for m in b.meta]
        completions = [m["completion"] for m in b.meta]
        totals, comps, _ = _check_reward(reward(completions, done, context), len(b))
        tally.add(b, context, totals, comps)
    return tally.metrics()


def describe_rollouts(policy, batch: RolloutBatch, rows: list[int]) -> tuple[dict, list[dict]]:
    """The VLM side's fields of one group's rollout record (vlm/records.py), read with the
    trainer's processor: what a pipeline run's records are described with too."""
    return describe_group(policy.processor, batch, rows)


class _Tally:
    """What `evaluate_accuracy` adds up over its batches; ``scores`` and ``records`` (the
    caller's, or None) receive each scored sample's total and episode record."""

    def __init__(self, scores: dict | None, records: dict | None):
        self.scores, self.records = scores, records
        self.by_family: dict[str, list[float]] = defaultdict(list)
        self.by_group: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.components: dict[str, list[float]] = defaultdict(list)
        self.lengths: list[float] = []
        self.clipped: list[float] = []
        self.episodes: list = []
        self.skipped = self.scored = 0

    def add(self, b: RolloutBatch, context: RewardContext, totals: list[float], comps) -> None:
        """One scored batch: its totals [B], components {name: [B]} and rows."""
        self.episodes += list(context.episodes or [])
        for j, (m, t) in enumerate(zip(b.meta, totals)):
            s = m["sample"]
            family = str(s.get("family", "all"))
            self.by_family[family].append(float(t))
            group = (s.get("meta") or {}).get("group")
            if group is not None:
                self.by_group[family, str(group)].append(float(t))
            key = str(s["id"]) if "id" in s else f"#{self.scored + j}"  # else: position
            if self.scores is not None:
                self.scores[key] = float(t)
            if self.records is not None and "episode" in m:
                self.records[key] = m["episode"]
        self.scored += len(b.meta)
        for k, v in comps.items():
            self.components[k] += [float(x) for x in v]
        self.lengths += b.mask.sum(1).tolist()
        self.clipped += [float(m["truncated"]) for m in b.meta]

    def metrics(self) -> dict[str, float]:
        all_scores = [v for vs in self.by_family.values() for v in vs]
        out = {
            "accuracy": _mean(all_scores),
            "count": float(len(all_scores)),
            "skipped": float(self.skipped),
        }
        for fam, vs in sorted(self.by_family.items()):
            out[f"accuracy/{fam}"] = _mean(vs)
            out[f"count/{fam}"] = float(len(vs))
        if any(len(vs) > 1 for vs in self.by_group.values()):
            out.update(self._group_metrics())
        for k, vs in self.components.items():
            out[f"reward/{k}"] = _mean(vs)
        out["completion_len_mean"] = _mean(self.lengths)
        out["clip_ratio"] = _mean(self.clipped)
        if self.episodes:
            out.update(summarize(self.episodes))
        return out

    def _group_metrics(self) -> dict[str, float]:
        """All-or-nothing accuracy over the question groups, overall and per family."""
        right: dict[str, list[float]] = defaultdict(list)
        for (family, _), vs in sorted(self.by_group.items()):
            right[family].append(float(all(v >= 0.5 for v in vs)))
        every = [v for vs in right.values() for v in vs]
        out = {"group_accuracy": _mean(every), "groups": float(len(every))}
        for family, vs in right.items():
            out[f"group_accuracy/{family}"] = _mean(vs)
            out[f"groups/{family}"] = float(len(vs))
        return out
