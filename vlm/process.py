"""Process rewards of VLM completions: rule-based step checks and PRIME's implicit PRM, placed on
tokens as ``RolloutBatch.step_rewards`` [B, T], and the monitor that flags a hacked one.

* `RuleSteps` runs a registered step reward (``rewards/process.py``) on the completion texts (a
  multi-turn episode's: its policy turns joined) and puts each step's score on the token that
  holds the step's last character.
* `ImplicitPRM` (PRIME, Cui et al. 2025): a second copy of the policy, trained online from the
  outcome labels alone; its per-token reward is ``beta * (log pi_prm(y_t) - log pi_ref(y_t))``
  against a frozen copy of the initial weights. Its loss is the cross-entropy of
  ``sigmoid(beta * sum_t log-ratio)`` against the outcome label (``correct >= 0.5``): the
  sequence-level ratio is trained as an outcome classifier, and its per-token terms are the
  process rewards it implies. One optimizer step per rollout batch; rewards come from the same
  forward, before that step (PRIME scores after its update; scoring first saves a forward).
* `ProcessMonitor`: process reward rising while outcome accuracy falls (half-window means over
  20 steps, a 0.05 margin) is logged as a warning with both curves and as
  ``reward/process_vs_outcome`` = 1.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import deque

import torch
from torch import Tensor

from ..registry import STEP_REWARDS
from ..rewards.registry import RewardContext, RewardNeeds, check_call
from ..trainer.batch import RolloutBatch
from .config import IMPLICIT  # noqa: F401  (the name of the implicit PRM, read by the builder)

log = logging.getLogger(__name__)


def token_of_chars(tokenizer, ids: list[int], ends: list[int]) -> list[int]:
    """For each character offset ``end`` of ``decode(ids)`` (special tokens skipped), the index
    of the token that holds character ``end - 1`` (the smallest prefix whose text reaches it)."""
    out = []
    for end in ends:
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(max(lo - 1, 0))
    return out


class RuleSteps:
    """A registered step reward on the completion texts, scores placed on tokens.

    Building it checks the step reward's signature against ``params`` and runs what it declares
    to prepare (``judge_steps`` starts its worker and loads its model), once.

    Args:
        name: a registered step reward (``STEP_REWARDS``) or ``module:function``.
        tokenizer: the policy's tokenizer (``decode(ids, skip_special_tokens=True)``): where a
            step's characters are among the completion's tokens.
        params: its keyword parameters.
        timeout_s: the time limit of a call (``rollout.reward_timeout_s``), handed to the step
            reward as ``ctx.timeout_s`` (``judge_steps`` bounds its worker's answer by it).
    """

    def __init__(
        self, name: str, tokenizer, params: dict | None = None, timeout_s: float | None = None
    ):
        entry = STEP_REWARDS.resolve(name)
        self.name, self.params, self.tokenizer = name, dict(params or {}), tokenizer
        check_call(entry, self.params, "step reward")
        needs = RewardNeeds.of(entry)
        if needs.prepare is not None:
            needs.prepare(**self.params)
        self.fn = functools.partial(entry.obj, **self.params)
        self.timeout_s = timeout_s or None

    def __call__(self, batch: RolloutBatch, correct: Tensor) -> tuple[Tensor, dict]:
        """Step scores on tokens [B, T]. A step reward that raises (a judge that timed out or
        died) scores every step of the batch 0 and is counted (``process_errors``).

        A multi-turn episode's completion is its policy turns' text joined (``episode.texts``:
        observations are not the policy's, and no step ends in one), and a step's character
        offset is placed on the policy token that holds it."""
        episodes = [m.get("episode") for m in batch.meta]
        multi = all(e is not None for e in episodes) and bool(episodes)
        if multi:
            texts = ["".join(e["texts"]) for e in episodes]
        else:
            texts = [m["completion"] for m in batch.meta]
        ctx = RewardContext(episodes=episodes if multi else None, timeout_s=self.timeout_s)
        out = torch.zeros(batch.mask.shape)
        try:
            steps = self.fn(texts, [m["sample"] for m in batch.meta], ctx)
            if len(steps) != len(batch):
                raise ValueError(f"returned {len(steps)} rows for {len(batch)} completions")
        except Exception as e:  # noqa: BLE001 - a process reward must not stop training
            log.warning("process reward %r failed: %s: %s", self.name, type(e).__name__, e)
            return out, {"process_errors": 1.0, "process_steps": 0.0}
        tok = self.tokenizer
        lengths = batch.mask.sum(1).long().tolist()
        for b, row in enumerate(steps):
            if not row:
                continue
            if multi:  # the policy's tokens, wherever the observations put them
                where = batch.mask[b].nonzero().flatten()
            else:
                where = torch.arange(lengths[b])
            ids = batch.tokens[b, where].tolist()
            for t, s in zip(token_of_chars(tok, ids, [st.end for st in row]), row):
                out[b, int(where[t])] += float(s.score)
        n = sum(len(r) for r in steps)
        return out, {"process_errors": 0.0, "process_steps": n / max(len(batch), 1)}


class ImplicitPRM:
    """PRIME's implicit process reward model (see the module docstring).

    Args:
        policy: the policy (a `VLMPolicy`); the PRM and its reference start as copies of it.
        beta: the log-ratio's scale.
        lr: the PRM's AdamW learning rate.
        micro_batch_size: rows per forward.
    """

    def __init__(self, policy, beta: float = 0.05, lr: float = 1e-5, micro_batch_size: int = 8):
        from .policy import VLMPolicy

        self.beta, self.micro = beta, micro_batch_size
        self.prm = VLMPolicy(
            copy.deepcopy(policy.model), policy.processor, policy.prompt, policy.sampling,
            share_prefix=policy.share_prefix,
        )  # fmt: skip
        self.ref = self.prm.reference()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.prm.parameters() if p.requires_grad], lr=lr
        )

    def __call__(self, batch: RolloutBatch, correct: Tensor) -> tuple[Tensor, dict]:
        """Per-token rewards [B, T] of ``batch`` and one PRM step on its outcome labels."""
        rows = len(batch)
        out = torch.zeros(batch.mask.shape)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, acc = 0.0, 0.0
        labels = (correct >= 0.5).float()
        for start in range(0, rows, self.micro):
            idx = list(range(start, min(start + self.micro, rows)))
            mb = batch.select(idx).to(self.prm.device)
            with torch.no_grad():
                ref = self.ref.evaluate(mb).logp.float()
            logp = self.prm.evaluate(mb).logp.float()
            mask = mb.mask.float()
            ratio = (logp - ref) * mask * self.beta  # [b, T]
            out[idx, : ratio.shape[1]] = ratio.detach().cpu()
            score = ratio.sum(1)
            y = labels[idx].to(score.device)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(score, y, reduction="sum")
            (loss / rows).backward()
            loss_sum += float(loss.detach())
            acc += float(((score > 0).float() == y).sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.prm.parameters(), 1.0)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out, {
            "prm_loss": loss_sum / max(rows, 1),
            "prm_accuracy": acc / max(rows, 1),
            "prm_grad_norm": float(grad_norm),
        }

    def state_dict(self) -> dict:
        return {"prm": self.prm.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prm.load_state_dict(state["prm"])
        self.optimizer.load_state_dict(state["optimizer"])


class ProcessMonitor:
    """Flags process reward rising while outcome accuracy falls: over the last ``window`` steps,
    the second half's mean process reward is above the first half's by more than ``margin``
    and its mean accuracy below by more than ``margin`` (half means, not slopes: batch-to-batch
    swings of 0.1 in accuracy made 10-step slopes flag noise). Warns once per window with both
    curves."""

    def __init__(self, window: int = 20, margin: float = 0.05):
        self.window, self.margin = window, margin
        self.process: deque[float] = deque(maxlen=window)
        self.outcome: deque[float] = deque(maxlen=window)
        self._quiet = 0

    def __call__(self, process: float, outcome: float, step: int) -> float:
        self.process.append(process)
        self.outcome.append(outcome)
        self._quiet = max(self._quiet - 1, 0)
        if len(self.process) < self.window:
            return 0.0
        up = _half_change(self.process) > self.margin
        down = _half_change(self.outcome) < -self.margin
        if not (up and down):
            return 0.0
        if self._quiet == 0:
            log.warning(
                "step %d: the process reward rises while outcome accuracy falls over the last "
                "%d steps (process %s; outcome %s): the process reward may be hacked; check the "
                "step format or lower algo.process_coef",
                step, self.window, _curve(self.process), _curve(self.outcome),
            )  # fmt: skip
            self._quiet = self.window
        return 1.0


def _half_change(ys) -> float:
    """Mean of the second half minus mean of the first half."""
    ys = list(ys)
    h = len(ys) // 2
    return sum(ys[h:]) / (len(ys) - h) - sum(ys[:h]) / h


def _curve(ys) -> str:
    return " ".join(f"{y:.3f}" for y in ys)
