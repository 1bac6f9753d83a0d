"""LoRA policies: adapters on the language model only, GRPO updates only them, the reference is
the base model (adapters disabled, no copy), checkpoints hold the adapter and a merged export."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from perceptrl.trainer.engine import build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.vlm.lora import LoraVLMPolicy, apply_lora
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.wiring import Config

_spec = importlib.util.spec_from_file_location(
    "zero_worker", Path(__file__).resolve().parent / "zero_worker.py"
)
zero_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zero_worker)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from perceptrl.vlm.tiny import build_tiny

    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("lora") / "tiny", seed=0)


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[dict]:
    return zero_worker.make_samples(tmp_path_factory.mktemp("lora_images"))


def lora_policy(tiny: Path, **kw) -> LoraVLMPolicy:
    torch.manual_seed(0)
    kw = {"rank": 4, "alpha": 8.0, **kw}
    return apply_lora(VLMPolicy.from_pretrained(tiny), **kw)


def storages(*modules: nn.Module) -> int:
    """Bytes of distinct parameter/buffer storages held by ``modules`` (shared ones once)."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_adapters_on_language_model_only_and_vision_optional(tiny):
    policy = lora_policy(tiny)
    trainable = dict(policy.trainable_parameters())
    assert trainable and all(".lora_" in n for n in trainable)
    assert all("language_model" in n for n in trainable)
    for t in ("q_proj", "v_proj", "down_proj"):
        assert any(f".{t}.lora_A" in n for n in trainable)
    frozen = [p for n, p in policy.model.named_parameters() if ".lora_" not in n]
    assert not any(p.requires_grad for p in frozen)
    with_vision = dict(lora_policy(tiny, vision=True).trainable_parameters())
    assert any("visual.blocks" in n and ".attn.qkv.lora_A" in n for n in with_vision)


def test_unknown_target_names_say_what_exists(tiny):
    with pytest.raises(ValueError, match="matches no linear layer.*q_proj"):
        lora_policy(tiny, targets=["query"])


def test_fresh_adapters_start_at_the_base(tiny, samples):
    base = VLMPolicy.from_pretrained(tiny)
    policy = lora_policy(tiny)
    batch = policy.completions_batch(samples[:3], ["<answer>2</answer>", "two", "3"])
    with torch.no_grad():
        torch.testing.assert_close(policy.evaluate(batch).logp, base.evaluate(batch).logp)


def _train(policy, samples, run_dir: Path, steps: int = 3, kl_coef: float = 0.05) -> Trainer:
    cfg = Config()
    cfg.train.steps, cfg.train.lr, cfg.train.micro_batch_size = steps, 2e-2, 4
    cfg.train.device, cfg.algo.kl_coef = "cpu", kl_coef
    cfg.log.tensorboard, cfg.log.progress = False, False
    source = zero_worker.FixedSource(samples, 0, 1)
    trainer = Trainer(
        cfg,
        policy,
        source,
        run_dir,
        engine=build_engine(policy, cfg.train),
        ref_policy=policy.reference(),
    )
    trainer.fit()
    return trainer


def test_grpo_changes_only_adapters_and_reference_is_the_base(tiny, samples, tmp_path):
    policy = lora_policy(tiny)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    ref = policy.reference()
    # no second copy: the reference holds exactly the policy's storages
    assert storages(policy.model) == storages(policy.model, *_modules(ref))
    assert all(a is b for a, b in zip(ref.parameters(), policy.parameters()))
    # the measure sees copies: full fine-tuning's reference doubles the bytes
    full = VLMPolicy.from_pretrained(tiny)
    assert storages(full.model, full.reference().model) == 2 * storages(full.model)

    _train(policy, samples, tmp_path / "run")
    metrics = _metrics(tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in metrics)
    assert any(m["actor/kl"] > 0 for m in metrics[1:])  # policy drifted from the reference

    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at 0: the update reached the output

    base = VLMPolicy.from_pretrained(tiny)
    batch = policy.completions_batch(samples[:3], ["<answer>2</answer>", "two", "3"])
    with torch.no_grad():
        ref_logp = ref.evaluate(batch).logp
        torch.testing.assert_close(ref_logp, base.evaluate(batch).logp, atol=1e-5, rtol=1e-5)
        assert (policy.evaluate(batch).logp - ref_logp).abs().max() > 1e-3


def _modules(ref) -> list[nn.Module]:
    return [ref.policy.model]


def _metrics(run: Path) -> list[dict]:
    import json

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


class PreferenceSource:
    """Every step the same 3 prompts, each with a rewarded and an unrewarded completion."""

    TEXTS = ("<answer>2</answer>", "no idea")

    def __init__(self, samples: list[dict]):
        self.samples = samples[:3]

    def collect(self, policy, step: int):
        rows = [s for s in self.samples for _ in self.TEXTS]
        batch = policy.completions_batch(rows, list(self.TEXTS) * len(self.samples))
        batch.group_id = torch.arange(len(self.samples)).repeat_interleave(len(self.TEXTS))
        batch.rewards = torch.tensor([1.0, 0.0] * len(self.samples))
        return batch, {}


def test_lora_learns_the_rewarded_completion(tiny, samples, tmp_path):
    """GRPO through the adapters moves the log-probability of the rewarded completion up
    relative to the other's (both share the stop token, whose probability rises for both)."""
    policy = lora_policy(tiny)
    source = PreferenceSource(samples)
    batch, _ = source.collect(policy, 0)
    good = batch.rewards > 0.5
    with torch.no_grad():
        before = policy.evaluate(batch).logp.sum(1)
    cfg = Config()
    cfg.train.steps, cfg.train.lr, cfg.train.device = 4, 1e-2, "cpu"
    cfg.log.tensorboard, cfg.log.progress = False, False
    Trainer(cfg, policy, source, tmp_path / "run", engine=build_engine(policy, cfg.train)).fit()
    with torch.no_grad():
        gain = policy.evaluate(batch).logp.sum(1) - before
    assert gain[good].min() > gain[~good].max() + 0.2


def test_checkpoint_holds_adapter_and_merged_export(tiny, samples, tmp_path):
    from transformers import AutoModelForImageTextToText

    policy = lora_policy(tiny)
    _train(policy, samples, tmp_path / "run", steps=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    assert (ckpt / "adapter" / "adapter_config.json").is_file()

    # merged export: a plain HF model whose outputs equal the adapter model's
    merged = VLMPolicy(AutoModelForImageTextToText.from_pretrained(ckpt), policy.processor)
    assert not any(".lora_" in n for n, _ in merged.model.named_parameters())
    batch = policy.completions_batch(samples[:3], ["<answer>2</answer>", "two", "3"])
    with torch.no_grad():
        torch.testing.assert_close(
            merged.evaluate(batch).logp, policy.evaluate(batch).logp, atol=1e-5, rtol=1e-5
        )

    # resume path: a fresh LoRA policy loads the adapter in place
    fresh = lora_policy(tiny)
    params = dict(fresh.trainable_parameters())
    fresh.load(ckpt)
    for n, p in policy.trainable_parameters():
        assert params[n] is dict(fresh.trainable_parameters())[n]
        torch.testing.assert_close(params[n], p)
    with pytest.raises(FileNotFoundError, match="not written by a LoRA policy"):
        fresh.load(tiny)


def test_wiring_builds_a_lora_policy(tiny, tmp_path):
    from perceptrl.vlm.builder import build_policy as vlm_policy
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.wiring import load_config

    cfg = load_config(None, [f"model.path={tiny}", "model.lora_rank=2", "train.device=cpu"])
    policy = vlm_policy(resolve(cfg), tmp_path)
    assert isinstance(policy, LoraVLMPolicy)
    assert sum(p.numel() for _, p in policy.trainable_parameters()) < 0.1 * sum(
        p.numel() for p in policy.parameters()
    )
