"""The VLM side through the shared trainer: one GRPO step per tiny architecture, micro-batch
invariance with real padding, and resume after a checkpoint."""

from __future__ import annotations

import pytest
import torch

from perceptrl.trainer.engine import TorchEngine, build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.trainer.metrics import read_metrics
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.run_plan import resolve
from perceptrl.vlm.source import VLMRolloutSource, evaluate_accuracy
from perceptrl.vlm.tiny import ARCHS
from perceptrl.wiring import Config


def grpo_config(**train) -> Config:
    cfg = Config()
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 12
    cfg.train.lr, cfg.train.steps, cfg.train.device = 1e-3, 1, "cpu"
    cfg.train.micro_batch_size = 4
    cfg.log.progress = cfg.log.tensorboard = False
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def length_reward(completions, samples, ctx=None):
    """Deterministic reward with spread inside groups: prefers shorter completions."""
    r = [1.0 / (1 + len(c)) for c in completions]
    return r, {"short": r}, {}


@pytest.mark.parametrize("arch", ARCHS)
def test_one_grpo_step_with_kl(tiny_dirs, samples, tmp_path, arch):
    cfg = grpo_config()
    cfg.algo.kl_coef = 0.05
    policy = VLMPolicy.from_pretrained(tiny_dirs[arch], sampling=resolve(cfg).sampling)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    source = VLMRolloutSource(samples, length_reward, cfg.rollout, seed=0)
    trainer = Trainer(
        cfg,
        policy,
        source,
        tmp_path,
        engine=build_engine(policy, cfg.train),
        ref_policy=policy.reference(),
    )
    m = trainer.train_step()
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > len(before) // 2
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    for key in ("reward/mean", "reward/short", "actor/kl", "actor/entropy", "grad_norm"):
        assert key in m and torch.isfinite(torch.tensor(m[key])), key
    assert m["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference


class RecordingEngine(TorchEngine):
    """Keeps a copy of the accumulated gradient that each optimizer step applies."""

    def step(self):
        self.grads = torch.cat([p.grad.flatten() for p in self.params if p.grad is not None])
        return super().step()


def test_micro_batch_accumulation_is_invariant_with_padding(tiny_dirs, samples, tmp_path):
    """micro-batch 4 x accumulation 3 == micro-batch 12 x accumulation 1 on ragged VLM rows
    (compared on the gradient: Adam's first step amplifies float noise of near-zero entries)."""
    grads = []
    for micro in (4, 12):
        cfg = grpo_config(micro_batch_size=micro)
        policy = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"], sampling=resolve(cfg).sampling)
        source = VLMRolloutSource(samples, length_reward, cfg.rollout, seed=0)
        engine = RecordingEngine(policy.parameters(), cfg.train)
        Trainer(cfg, policy, source, tmp_path / str(micro), engine=engine).train_step()
        grads.append(engine.grads)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_resume_reproduces_the_uninterrupted_run(tiny_dirs, samples, tmp_path):
    def run(run_dir, steps, resume=False):
        cfg = grpo_config(steps=steps)
        cfg.checkpoint.every, cfg.checkpoint.keep_last = 1, 3
        policy = VLMPolicy.from_pretrained(tiny_dirs["qwen3_vl"], sampling=resolve(cfg).sampling)
        source = VLMRolloutSource(samples, length_reward, cfg.rollout, seed=0)

        def evaluator(p):
            return evaluate_accuracy(p, samples[:2], length_reward, max_new_tokens=6)

        Trainer(
            cfg,
            policy,
            source,
            run_dir,
            engine=build_engine(policy, cfg.train),
            evaluator=evaluator,
        ).fit(resume=resume)
        rows = read_metrics(run_dir / "metrics.jsonl")
        return [r for r in rows if "reward/mean" in r], policy

    full, p_full = run(tmp_path / "full", 3)
    run(tmp_path / "cut", 2)
    resumed, p_res = run(tmp_path / "cut", 3, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("reward/mean", "rollout/completion_len_mean", "actor/pg_loss"):
        assert resumed[-1][key] == pytest.approx(full[-1][key], abs=1e-6), key
    for a, b in zip(p_full.parameters(), p_res.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
