"""The training loop, shared by both sides and both objectives.

`Trainer.fit` owns the run: seeding, the time limit, periodic evaluation, metrics, checkpoints,
resume and the non-finite streak; it drives the engine it is handed (one process or DeepSpeed,
trainer/engine.py). Each step is one of:

* ``objective="rl"``: collect scored experience from the rollout source -> (optional) drop
  groups without signal -> behaviour / reference log-probs (see `Trainer.behaviour_source`) ->
  advantages -> PPO-style epochs over minibatches with gradient accumulation -> optimizer steps;
* ``objective="sft"``: the source's next batch of targets -> token-mean negative log-likelihood
  (plus the policy's auxiliary losses) -> one optimizer step.

(``objective="offpolicy"``: trainer/offpolicy.py.) The loop sees only the `Policy` protocol,
`RolloutBatch` and a source; it never imports a model, a dataset or a simulator."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..errors import RunError
from ..registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
from . import algos
from .advantages import AdvantageInputs, declared_needs
from .batch import RolloutBatch, substep_tokens
from .checkpoint import (
    best_record,
    list_checkpoints,
    load_latest,
    remove_stale_temporaries,
    rng_state,
    save_best,
    save_checkpoint,
    set_rng_state,
    tidy_best,
)
from .config import TrainerConfig
from .corrections import apply_correction
from .engine import Engine
from .metrics import MetricsLogger, NullLogger
from .offpolicy import offpolicy_step
from .policy import Policy, RolloutSource, SFTSource
from .records import RolloutRecorder
from .runtime import peak_rss_mb, progress_bar, resolve_device, seed_everything


class TrainingDiverged(RunError):
    """Raised after ``train.max_bad_steps`` consecutive steps with a non-finite loss/gradient."""


OBJECTIVES = ("rl", "sft", "offpolicy")
"""what a step optimises: rl (a RolloutSource's scored experience) | sft (an SFTSource's targets)
| offpolicy (replay minibatches of an OffPolicySource, trainer/offpolicy.py)"""
SHARE_METRICS = frozenset({"actor/pg_loss", "actor/kl", "actor/entropy", "sft/loss"})
"""metrics that are losses under the minibatch's global normalisers: micro-batches and ranks
each hold a share of the value, so they are summed rather than token-weighted"""


class Trainer:
    """Drives one run. ``evaluator(policy) -> metrics`` is called before training, every
    ``train.eval_every`` steps and at the end; its metrics are logged under ``eval/``.

    Args:
        cfg: any config with the trainer's sections (``algo``, ``train``, ``log``,
            ``checkpoint``).
        source: a `RolloutSource` (``objective="rl"``) or an `SFTSource` (``"sft"``).
        engine: the optimisation engine over ``policy``'s weights, built by the caller
            (``trainer.engine.build_engine(policy, cfg.train)``); the trainer never builds one.
        objective: one of `OBJECTIVES`.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        policy: Policy,
        source: RolloutSource | SFTSource,
        run_dir: str | Path,
        *,
        engine: Engine,
        ref_policy: Policy | None = None,
        evaluator: Callable[[Policy], dict[str, float]] | None = None,
        objective: str = "rl",
    ):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r}; valid: {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.cfg = cfg
        self.policy = policy
        self.source = source
        self.ref_policy = ref_policy
        self.evaluator = evaluator
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.device = resolve_device(cfg.train.device)
        self.engine = engine
        # the number of ranks comes from the launch, not the recipe: checked here, not at load
        if self.engine.world_size > 1 and cfg.algo.dynamic_sampling:
            raise ValueError(
                "algo.dynamic_sampling with several ranks would give the ranks different batch "
                "sizes (and a different number of collective steps): set "
                "algo.dynamic_sampling=false under torchrun/deepspeed, or run in one process"
            )
        # one writer per run directory: rank 0 logs, the other ranks only compute
        self.logger = (
            MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard, recipe=cfg)
            if self.engine.is_main
            else NullLogger()
        )
        self.recorder = RolloutRecorder(
            self.run_dir, cfg.log.rollouts_every if self.engine.is_main else 0,
            cfg.log.rollouts_groups, cfg.log.rollouts_keep,
        )  # fmt: skip
        self.policy_loss = POLICY_LOSSES.get(cfg.algo.policy_loss)
        self.advantage = ADVANTAGES.get(cfg.algo.adv_estimator)
        self.advantage_needs = declared_needs(cfg.algo.adv_estimator)
        self.kl = KL_ESTIMATORS.get(cfg.algo.kl_estimator)
        self.step = 0
        self._captured: list[Tensor] | None = None  # log-probs of a step being recorded
        self.bad_streak = 0
        self.counters: dict[str, int] = defaultdict(int)
        self.last_eval: dict[str, float] = {}
        best = cfg.checkpoint.best
        self.best_key = best if not best or best.startswith("eval/") else f"eval/{best}"
        self.best_value: float | None = None
        # a side knows whether its runs evaluate (its check refuses the recipe at load): any side
        if best and evaluator is None:
            raise ValueError(
                f"checkpoint.best={best} keeps the weights of the best evaluation, but this run "
                "has no evaluation: give it evaluation data or episodes, or unset checkpoint.best"
            )

    # ------------------------------------------------------------------ run
    def fit(self, resume: bool = False) -> dict[str, float]:
        """Train for ``train.steps`` steps (continuing from the last checkpoint when
        ``resume``); returns the last evaluation metrics."""
        if self.engine.is_main:  # writes killed mid-way leave .tmp-step_* behind
            remove_stale_temporaries(self.run_dir / "checkpoints")
            tidy_best(self.run_dir, reset=False)
        self.engine.barrier()
        if not (resume and self._resume()):
            if resume:  # killed before its first checkpoint: start over without its rows
                self.logger.truncate_after(-1)
                self.recorder.truncate_after(-1)
            if self.engine.is_main:  # starting over: the earlier run's best is not this one's
                tidy_best(self.run_dir, reset=True)
            self.engine.barrier()
            seed_everything(self.cfg.train.seed)
            self._evaluate(0)
        total = self.cfg.train.steps
        bar = progress_bar(total, self.step, enabled=self.cfg.log.progress and self.engine.is_main)
        limit = self.cfg.train.time_limit_min * 60
        t_start = time.perf_counter()
        try:
            while self.step < total:
                out_of_time = bool(limit) and time.perf_counter() - t_start > limit
                if limit and not self.engine.all_true(not out_of_time):  # ranks stop together
                    total = self.step  # out of time: finish as if the run had this many steps
                    break
                metrics = self.train_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                bar.update(1)
                name, key = (
                    ("loss", "sft/loss") if self.objective == "sft" else ("reward", "reward/mean")
                )
                bar.set_postfix({name: f"{metrics.get(key, float('nan')):.3f}"})
                every = self.cfg.train.eval_every
                if every and self.step % every == 0 and self.step < total:
                    self._evaluate(self.step)
                ck = self.cfg.checkpoint.every
                if ck and self.step % ck == 0 and self.step < total:
                    self.save()
            if self.step == total and not self._checkpoint_exists(total):
                self._evaluate(self.step)
                self.save()
        finally:
            bar.close()
            self.logger.close()
        return self.last_eval

    def train_step(self) -> dict[str, float]:
        """One step of the run's objective. Returns the step's metrics."""
        if self.objective == "offpolicy":
            return offpolicy_step(self)
        return self._sft_step() if self.objective == "sft" else self._rl_step()

    def _sft_step(self) -> dict[str, float]:
        """The source's next targets -> token-mean NLL (+ auxiliary losses) -> one update."""
        t0 = time.perf_counter()
        batch = self.source.next_batch(self.step).to(self.device)
        t1 = time.perf_counter()
        finite, metrics = self._accumulate(batch, self._sft_loss)
        if finite:
            metrics["grad_norm"], finite = self.engine.step()
        else:
            self.engine.zero_grad()
        metrics["nonfinite/skipped_updates"] = float(not finite)
        self._track_bad_step(not finite)
        t2 = time.perf_counter()
        metrics.update({"time/data": t1 - t0, "time/forward_backward": t2 - t1})
        metrics.update(
            {"time/step": t2 - t0, "lr": self.engine.lr, "sys/peak_rss_mb": peak_rss_mb()}
        )
        return metrics

    def _rl_step(self) -> dict[str, float]:
        """One rollout + update."""
        t0 = time.perf_counter()
        with self.engine.rollout_context():  # ZeRO-3: full weights for sampling
            batch, metrics = self.source.collect(self.policy, self.step)
        metrics = dict(metrics)
        metrics["time/collect"] = time.perf_counter() - t0  # rollout + reward (+ env steps)
        seq_reward = (
            batch.rewards.float()
            if batch.rewards.dim() == 1
            else (batch.rewards * batch.mask).sum(1).float()
        )  # [B]; the mean is over the global batch (all ranks)
        metrics["reward/mean"] = float(
            self.engine.all_reduce_sum(seq_reward.sum()) / self.engine.all_reduce_sum(len(batch))
        )
        if self.cfg.algo.dynamic_sampling:
            batch = self._filter_groups(batch, metrics)
            if batch is None:
                return metrics
        batch = batch.to(self.device)
        t1 = time.perf_counter()
        if self.behaviour_source(batch) == "score":
            self._score_old(batch)
        self._score_ref(batch)
        metrics["time/old_logp"] = time.perf_counter() - t1
        if batch.logp_rollout is not None:  # rollout engine vs trainer log-probs (TIS monitor)
            metrics.update(
                algos.rollout_gap_metrics(
                    batch.logp_old, batch.logp_rollout, batch.mask, self.cfg.algo.tis_cap
                )
            )
        metrics.update(self._advantages(batch))
        metrics.update(self._correct(batch))
        record = self.recorder.due(self.step + 1)  # the step this one is logged as
        self._captured = [] if record and batch.logp_old is None else None
        metrics.update(self._update(batch))
        if record:
            self._record(batch)
        metrics["time/step"] = time.perf_counter() - t0
        metrics["lr"] = self.engine.lr
        metrics["sys/peak_rss_mb"] = peak_rss_mb()
        return metrics

    # ------------------------------------------------------------------ phases
    def _filter_groups(self, batch: RolloutBatch, metrics: dict) -> RolloutBatch | None:
        """DAPO dynamic sampling: keep only groups whose rewards differ, collecting again (up to
        ``algo.max_collects`` collections per step) until as many groups as the first collection
        had are kept. Returns None when no group carries a signal."""
        target = int(batch.group_id.unique().numel())
        kept: list[RolloutBatch] = []
        n_kept = seen = kept_rows = 0
        refill_s = 0.0
        for collect in range(1, self.cfg.algo.max_collects + 1):
            if collect > 1:
                t = time.perf_counter()
                with self.engine.rollout_context():
                    batch, _ = self.source.collect(self.policy, self.step)
                refill_s += time.perf_counter() - t
            keep = algos.filter_groups(
                batch.rewards.float().reshape(len(batch), -1).sum(1), batch.group_id
            )
            seen += len(batch)
            kept_rows += int(keep.sum())
            if keep.any():
                part = batch.select(torch.nonzero(keep).flatten())
                part.group_id = torch.unique(part.group_id, return_inverse=True)[1] + n_kept
                n_kept = int(part.group_id.max()) + 1
                kept.append(part)
            if n_kept >= target:
                break
        metrics["dynamic_sampling/kept_frac"] = kept_rows / max(seen, 1)
        metrics["dynamic_sampling/collects"] = float(collect)
        metrics["time/refill"] = refill_s  # the extra collections (time/collect is the first)
        if not kept:
            self.counters["steps_without_signal"] += 1
            metrics["dynamic_sampling/skipped_step"] = 1.0
            return None
        batch = RolloutBatch.concat(kept)
        return batch.select(torch.nonzero(batch.group_id < target).flatten())

    def behaviour_source(self, batch: RolloutBatch) -> str:
        """Where the update's behaviour log-probs (and values) come from, decided once here:

        * ``"source"``: the source filled ``logp_old`` (and ``values_old`` for a policy with a
          critic) while acting with these very parameters (VLA PPO collector);
        * ``"score"``: a no-grad scoring pass before the advantages, needed when something
          before the update reads them (critic values, KL folded into the reward, the rollout
          engine's log-probs to compare) or when the update takes several optimizer steps
          (later minibatches need the pre-update log-probs);
        * ``"own"``: one on-policy optimizer step uses its own forward's detached log-probs
          (no extra forward, as TRL does; the parameters are those that scored the batch).
        """
        if batch.logp_old is not None:
            if self.policy.has_critic and batch.values_old is None:
                raise ValueError(
                    "the rollout source filled logp_old but not values_old for a policy with a "
                    "critic; fill both (the values at acting time) or neither"
                )
            return "source"
        algo, train = self.cfg.algo, self.cfg.train
        kl_reward = algo.kl_in_reward and self.ref_policy is not None and algo.kl_coef > 0
        several = train.ppo_epochs > 1 or self._minibatch_size(len(batch)) < len(batch)
        if self.policy.has_critic or kl_reward or batch.logp_rollout is not None or several:
            return "score"
        return "own"

    @torch.no_grad()
    def _score_old(self, batch: RolloutBatch) -> None:
        """Behaviour log-probs (and values) from the training-side forward, before the update."""
        evals = [self.policy.evaluate(m) for m in batch.split(self.cfg.train.micro_batch_size)]
        batch.logp_old = torch.cat([e.logp.float() for e in evals])
        if self.policy.has_critic:
            batch.values_old = torch.cat([e.value.float() for e in evals])

    @torch.no_grad()
    def _score_ref(self, batch: RolloutBatch) -> None:
        """Reference log-probs when a KL term needs them."""
        if self.ref_policy is None or self.cfg.algo.kl_coef <= 0:
            return
        micro = batch.split(self.cfg.train.micro_batch_size)
        batch.logp_ref = torch.cat([self.ref_policy.evaluate(m).logp.float() for m in micro])

    def _advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """The estimator's advantages and returns into the batch. It gets the inputs it declared
        (``needs``); process rewards it does not read are folded into the rewards."""
        algo = self.cfg.algo
        rewards = batch.rewards.float()
        if algo.kl_in_reward and batch.logp_ref is not None:
            per_pos = lambda x: x.sum(-1) if x.dim() == 3 else x  # noqa: E731  (sub-steps)
            rewards = algos.kl_to_reward(
                rewards, per_pos(batch.logp_old), per_pos(batch.logp_ref), batch.mask,
                algo.kl_coef, algo.kl_estimator,
            )  # fmt: skip
        if batch.step_rewards is not None and "step_rewards" not in self.advantage_needs:
            steps = batch.step_rewards.float().to(rewards.device)  # outcome + process per token
            rewards = algos.token_rewards(rewards, batch.mask) + algo.process_coef * steps
        have = {
            "values": batch.values_old, "bootstrap_value": batch.bootstrap_value,
            "segments": batch.tree_ids(), "step_rewards": batch.step_rewards,
        }  # fmt: skip
        inp = AdvantageInputs(
            rewards, batch.mask, batch.group_id, **{k: have[k] for k in self.advantage_needs}
        )
        adv, ret, m = self.advantage(inp, algo)
        if algo.whiten_advantages:
            adv = self._whiten(adv, batch.mask)
        batch.advantages, batch.returns = adv, ret
        valid = batch.mask.bool()
        m = {f"adv/{k}": v for k, v in m.items()}
        n_valid = self.engine.all_reduce_sum(valid.sum().float()).clamp(min=1)  # global batch
        m["adv/mean"] = float(self.engine.all_reduce_sum(adv[valid].sum()) / n_valid)
        m["adv/abs_mean"] = float(self.engine.all_reduce_sum(adv[valid].abs().sum()) / n_valid)
        return m

    def _correct(self, batch: RolloutBatch) -> dict[str, float]:
        """The rollout correction (``algo.rollout_correction``, trainer/corrections.py) from the
        behaviour log-probs: importance weights into ``batch.is_weight``, rejected tokens or rows
        out of ``batch.mask`` (after the advantages, so only the loss loses them)."""
        algo = self.cfg.algo
        if algo.tis_cap <= 0 or batch.logp_rollout is None:
            return {}
        batch.is_weight, batch.mask, m = apply_correction(
            algo.rollout_correction, batch.logp_old, batch.logp_rollout, batch.mask, algo
        )
        return m

    def _record(self, batch: RolloutBatch) -> None:
        """Keep a sample of this step's rollouts (trainer/records.py). An on-policy step that
        scored nothing before its update ("own") records the log-probs its one forward took."""
        got, self._captured = self._captured, None
        if got and sum(len(x) for x in got) == len(batch):  # none when the loss was not finite
            batch.logp_old = torch.cat(got)
        describe = getattr(self.source, "describe_group", None)
        self.recorder.record(self.step + 1, batch, self.policy, describe)

    def _whiten(self, adv: Tensor, mask: Tensor) -> Tensor:
        """``algos.masked_whiten`` over the global batch: with data parallelism the count, mean
        and (unbiased) variance are taken over every rank's valid positions."""
        ranks = self.engine.all_reduce_sum if self.engine.world_size > 1 else None
        return algos.masked_whiten(adv, mask, all_reduce=ranks)

    def _minibatch_size(self, n: int) -> int:
        """Rows of this rank's minibatch out of its ``n`` (``train.minibatch_size`` is global)."""
        mb_global = self.cfg.train.minibatch_size // self.engine.world_size  # this rank's share
        return mb_global if 0 < mb_global < n else n

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        tcfg = self.cfg.train
        n = len(batch)
        mb_size = self._minibatch_size(n)
        gen = torch.Generator().manual_seed(tcfg.seed * 100_003 + self.step)
        sums: dict[str, float] = defaultdict(float)
        opt_steps = skipped = 0
        t_fb = t_opt = 0.0
        for _ in range(tcfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if mb_size < n else torch.arange(n)
            for start in range(0, n, mb_size):
                mb = batch.select(order[start : start + mb_size])
                t = time.perf_counter()
                finite, mb_metrics = self._accumulate(mb, self._loss)
                t_fb += time.perf_counter() - t
                t = time.perf_counter()
                if finite:
                    grad_norm, finite = self.engine.step()
                    mb_metrics["grad_norm"] = grad_norm
                else:
                    self.engine.zero_grad()
                t_opt += time.perf_counter() - t
                if finite:
                    opt_steps += 1
                    for k, v in mb_metrics.items():
                        sums[k] += v
                else:
                    skipped += 1
        metrics = {k: v / max(opt_steps, 1) for k, v in sums.items()}
        metrics.update({"time/forward_backward": t_fb, "time/optimizer": t_opt})
        metrics["nonfinite/skipped_updates"] = float(skipped)
        self._track_bad_step(skipped > 0 and opt_steps == 0)
        return metrics

    def _accumulate(self, mb: RolloutBatch, loss_fn) -> tuple[bool, dict[str, float]]:
        """Forward/backward over the micro-batches of one minibatch; gradients accumulate so
        that the result equals one pass over the whole minibatch (global normalisers).

        With data parallelism the normalisers are summed over ranks, so each rank's loss is its
        share of the global minibatch loss; so are the metrics (all-reduced before returning).
        Share metrics (losses normalised by the global counts) add up; the others are token-
        weighted means. ``loss_fn(micro, num_tokens, num_seqs) -> (loss, metrics)``."""
        num_tokens = self.engine.all_reduce_sum(mb.mask.sum())
        num_seqs = int(self.engine.all_reduce_sum((mb.mask.sum(-1) > 0).sum()))  # non-empty rows
        sums: dict[str, float] = defaultdict(float)
        for micro in mb.split(self.cfg.train.micro_batch_size):
            loss, m = loss_fn(micro, num_tokens, num_seqs)
            if not self.engine.all_true(bool(torch.isfinite(loss))):
                self.counters["nonfinite_loss"] += 1
                return False, {}
            self.engine.backward(loss)
            weight = float(micro.mask.sum() / num_tokens.clamp(min=1))
            for k, v in m.items():
                share = k in SHARE_METRICS or k.startswith("aux/")
                sums[k] += v if share else v * weight
        if self.engine.world_size > 1:
            keys = sorted(sums)
            total = self.engine.all_reduce_sum(torch.tensor([sums[k] for k in keys]))
            sums = dict(zip(keys, total.tolist()))
        return True, dict(sums)

    def _sft_loss(self, micro: RolloutBatch, num_tokens: Tensor, num_seqs: int):
        """Token-mean negative log-likelihood of the targets (or the policy's own imitation
        loss, ``policy.sft_loss``, where its likelihood is not what it trains on: a flow
        head's flow matching), plus the policy's aux losses."""
        own = getattr(self.policy, "sft_loss", None)
        if own is not None:
            per_token, aux = own(micro)
        else:
            ev = self.policy.evaluate(micro)
            per_token, aux = -ev.logp, ev.aux
        loss = algos.agg_loss(per_token.float(), micro.mask, "token-mean", num_tokens=num_tokens)
        metrics = {"sft/loss": float(loss.detach())}
        loss = loss + self._aux_loss(aux, micro, metrics, mode="token-mean", num_tokens=num_tokens)
        return loss, metrics

    def _aux_loss(
        self, aux: dict[str, Tensor], micro: RolloutBatch, metrics: dict, **agg
    ) -> Tensor:
        """The policy's auxiliary per-step losses, aggregated like the others (``aux/<name>``)."""
        total = torch.zeros((), device=micro.mask.device)
        for name, per_step in aux.items():
            term = algos.agg_loss(per_step.float(), micro.mask, **agg)
            total = total + term
            metrics[f"aux/{name}"] = float(term.detach())
        return total

    def _loss(self, micro: RolloutBatch, num_tokens: Tensor, num_seqs: int) -> tuple[Tensor, dict]:
        algo = self.cfg.algo
        ev = self.policy.evaluate(micro)
        logp, entropy, value = ev.logp.float(), ev.entropy, ev.value
        norm = {"num_tokens": num_tokens, "num_seqs": num_seqs}
        agg = dict(mode=algo.loss_agg_mode, norm_len=algo.loss_norm_len or None, **norm)
        tok, tok_norm, tok_agg = micro, norm, agg  # the policy loss's tokens
        if logp.dim() == 3:  # S sub-steps per position (a flow head's denoising steps)
            S = logp.shape[-1]
            tok, logp = substep_tokens(micro, S), logp.flatten(1)
            tok_norm = {"num_tokens": num_tokens * S, "num_seqs": num_seqs}
            tok_agg = {**agg, **tok_norm}
        # behaviour_source "own": on-policy, the behaviour log-probs are these very ones
        logp_old = tok.logp_old if tok.logp_old is not None else logp.detach()
        if tok.logp_old is None and self._captured is not None:  # micro-batches in row order
            self._captured.append(ev.logp.detach())
        loss, m = self.policy_loss(
            logp, logp_old, tok.advantages, tok.mask, algo, is_weight=tok.is_weight, **tok_norm
        )
        metrics = {f"actor/{k}": v for k, v in m.items()}
        metrics["actor/pg_loss"] = float(loss.detach())
        if algo.kl_coef > 0 and not algo.kl_in_reward and tok.logp_ref is not None:
            kl = algos.agg_loss(self.kl(logp, tok.logp_ref), tok.mask, **tok_agg)
            loss = loss + algo.kl_coef * kl
            metrics["actor/kl"] = float(kl.detach())
        loss = loss + self._aux_loss(ev.aux, micro, metrics, **agg)
        ent = algos.agg_loss(entropy.float(), micro.mask, **agg)
        metrics["actor/entropy"] = float(ent.detach())
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * ent
        if value is not None and micro.returns is not None and micro.values_old is not None:
            vloss, vm = algos.value_loss(
                value.float(), micro.values_old, micro.returns, micro.mask, algo, **norm
            )
            loss = loss + algo.value_coef * vloss
            metrics.update({f"critic/{k}": v for k, v in vm.items()})
        return loss, metrics

    def _track_bad_step(self, bad: bool) -> None:
        self.bad_streak = self.bad_streak + 1 if bad else 0
        if bad:
            self.counters["nonfinite_steps"] += 1
        if self.bad_streak >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"the loss or gradient was NaN/inf in {self.bad_streak} consecutive steps "
                f"(last at step {self.step}); the weights were not updated in those steps. "
                "Lower train.lr, check the rewards for NaN, or resume from the last checkpoint "
                f"under {self.run_dir / 'checkpoints'}."
            )

    # ------------------------------------------------------------------ eval / checkpoints
    def _evaluate(self, step: int) -> None:
        if self.evaluator is None:
            return
        t = time.perf_counter()
        with self.engine.rollout_context():  # every rank evaluates (ZeRO-3 needs them all)
            metrics = {f"eval/{k}": v for k, v in self.evaluator(self.policy).items()}
        metrics["time/eval"] = time.perf_counter() - t
        self.last_eval = metrics
        self.logger.log(step, metrics)
        if self.best_key:
            self._keep_if_best(step, metrics)

    def _keep_if_best(self, step: int, metrics: dict[str, float]) -> None:
        """``checkpoint.best``: write the weights to ``<run>/best`` when this evaluation's metric
        beats the best so far (every rank decides alike: the export is collective)."""
        key = self.best_key
        if key not in metrics:
            raise ValueError(
                f"checkpoint.best={self.cfg.checkpoint.best}: the evaluation has no {key}; it "
                f"logs {', '.join(sorted(k for k in metrics if k != 'time/eval'))}"
            )
        value, best = float(metrics[key]), self.best_value
        sign = 1.0 if self.cfg.checkpoint.best_mode == "max" else -1.0
        better = math.isfinite(value) and (best is None or sign * (value - best) > 0)
        if self.engine.all_true(better):
            self.best_value = value
            record = {"metric": key, "value": value, "mode": self.cfg.checkpoint.best_mode}
            save_best(self.run_dir, step, self.policy, record, engine=self.engine)

    def save(self) -> Path:
        state = {
            "engine": self.engine.state_dict(),
            "rng": rng_state(),
            "source": self.source.state_dict() if hasattr(self.source, "state_dict") else {},
        }
        counters = {"counters": dict(self.counters), "bad_streak": self.bad_streak}
        return save_checkpoint(
            self.run_dir / "checkpoints", self.step, self.policy, state, counters,
            self.cfg.checkpoint.keep_last, engine=self.engine,
        )  # fmt: skip

    def _checkpoint_exists(self, step: int) -> bool:
        return any(
            p.name.endswith(f"{step:06d}") for p in list_checkpoints(self.run_dir / "checkpoints")
        )

    def _resume(self) -> bool:
        found = load_latest(self.run_dir / "checkpoints", self.engine)  # newest intact one
        if found is None:
            return False
        last, state, counters, damage = found  # damage: metrics of checkpoints set aside
        self.engine.restore(last, state["engine"], self.policy)  # weights + optimizer
        if hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state["source"])
        set_rng_state(state["rng"])
        self.step = counters["step"]
        self.bad_streak = counters.get("bad_streak", 0)
        kept = best_record(self.run_dir)
        if kept is not None and kept.get("metric") == self.best_key:
            self.best_value = kept["value"]
        self.counters.update(counters.get("counters", {}))
        self.logger.truncate_after(self.step)
        self.recorder.truncate_after(self.step)
        self.logger.log(self.step, {"resumed_from_step": float(self.step), **damage})
        return True
