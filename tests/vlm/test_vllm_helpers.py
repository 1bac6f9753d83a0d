"""The vLLM rollout engine's parts that need no vLLM: weight buckets, the prompt-token check
(vision placeholders included), placeholder stripping, the rollout/trainer log-prob gap and TIS
monitor, the text-only processor, and the config/wiring switch."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from perceptrl.trainer import algos
from perceptrl.trainer.config import AlgoConfig, ConfigError
from perceptrl.trainer.corrections import token_tis
from perceptrl.vlm.prompts import PromptConfig, encode_prompt, vision_token_ids
from perceptrl.vlm.sampler import Rollouts
from perceptrl.vlm.vllm_rollout import (
    PromptMismatchError,
    TextProcessor,
    build_tiny_text,
    check_prompt_ids,
    collapse_vision_runs,
    iter_buckets,
    plan_buckets,
    strip_vision_tokens,
)
from perceptrl.wiring import load_config


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_text(tmp_path_factory.mktemp("tiny_text") / "m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, TextProcessor(AutoTokenizer.from_pretrained(path))


# ---- weight buckets ---------------------------------------------------------------------------


def test_plan_buckets_caps_size_and_separates_dtypes():
    named = [
        ("a", torch.zeros(10)),  # 40 B
        ("b", torch.zeros(10, dtype=torch.bfloat16)),  # 20 B
        ("c", torch.zeros(10)),  # 40 B
        ("d", torch.zeros(30)),  # 120 B > cap: alone
        ("e", torch.zeros(5)),  # 20 B
    ]
    buckets = plan_buckets(named, bucket_bytes=100)
    assert sorted(i for b in buckets for i in b) == list(range(5))  # each tensor exactly once
    for b in buckets:
        assert len({named[i][1].dtype for i in b}) == 1
        size = sum(named[i][1].numel() * named[i][1].element_size() for i in b)
        assert len(b) == 1 or size <= 100
    assert [0, 2] in buckets and [3] in buckets and [4] in buckets and [1] in buckets
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets(named, 0)


def test_buckets_round_trip_a_real_model_as_views(text_model):
    model, _ = text_model
    params = dict(model.named_parameters())  # tied LM head listed once
    total = sum(p.numel() * p.element_size() for p in params.values())
    buckets = list(iter_buckets(model.named_parameters(), bucket_bytes=512 << 10))
    assert len(buckets) >= total // (512 << 10)  # several buckets, none over the cap unless alone
    seen = {}
    for b in buckets:
        assert b.buffer.dim() == 1 and b.buffer.is_contiguous()
        lo = b.buffer.data_ptr()
        hi = lo + b.nbytes
        for name, view in b.unpack():
            assert lo <= view.data_ptr() < hi  # a view into the bucket, not a copy
            seen[name] = view
        assert len(b.names) == 1 or b.nbytes <= 512 << 10
    assert list(seen) == list(params)
    for name, p in params.items():
        assert torch.equal(seen[name], p.detach())
    assert sum(b.nbytes for b in buckets) == total


# ---- prompt tokens and placeholders ------------------------------------------------------------


def _encode(tiny_dirs, images, max_pixels):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dirs["qwen2_5_vl"])
    sample = {"id": "s0", "images": [images[0], images[1]], "question": "How many objects?"}
    cfg = PromptConfig(max_pixels=max_pixels, max_prompt_length=4096)
    return proc, sample, cfg, encode_prompt(proc, sample, cfg)


def test_collapsed_prompt_is_the_unexpanded_chat_template(tiny_dirs, images):
    proc, sample, cfg, enc = _encode(tiny_dirs, images, None)
    vis = vision_token_ids(proc)
    ids = enc.input_ids.tolist()
    assert sum(t in vis for t in ids) == enc.num_vision_tokens > 2
    from perceptrl.vlm.prompts import build_messages

    text = proc.apply_chat_template(
        build_messages(sample, cfg.system_prompt), tokenize=False, add_generation_prompt=True
    )
    raw = proc.tokenizer(text)["input_ids"]  # one placeholder per image, as vLLM expects
    assert sum(t in vis for t in raw) == 2
    assert collapse_vision_runs(ids, vis) == raw
    assert collapse_vision_runs(raw, vis) == raw
    assert collapse_vision_runs([5, 6, 6, 7], vis) == [5, 6, 6, 7]  # text repeats are kept


def test_prompt_check_catches_a_different_vision_token_count(tiny_dirs, images):
    proc, _, _, big = _encode(tiny_dirs, images, None)
    _, _, _, small = _encode(tiny_dirs, images, 56 * 56)
    vis = vision_token_ids(proc)
    check_prompt_ids(big.input_ids.tolist(), big.input_ids.tolist(), "s0", vis)
    assert small.num_vision_tokens < big.num_vision_tokens
    with pytest.raises(PromptMismatchError) as e:
        check_prompt_ids(big.input_ids.tolist(), small.input_ids.tolist(), "s0", vis)
    msg = str(e.value)
    assert "'s0'" in msg and "max_pixels" in msg
    assert f"{big.num_vision_tokens} vision" in msg and f"{small.num_vision_tokens} vision" in msg
    first = next(i for i, t in enumerate(big.input_ids.tolist()) if t in vis)
    pos = int(msg.split("from position ")[1].split(";")[0])
    assert pos > first  # the prompts agree up to the end of the smaller image's tokens


def test_strip_vision_tokens_cuts_before_the_first_placeholder():
    ids, lps, cut = strip_vision_tokens([4, 5, 9, 6, 9], [-1.0, -2.0, -3.0, -4.0, -5.0], [9, 8])
    assert (ids, lps, cut) == ([4, 5], [-1.0, -2.0], True)
    assert strip_vision_tokens([4, 5], [-1.0, -2.0], [9]) == ([4, 5], [-1.0, -2.0], False)
    assert strip_vision_tokens([8, 1], [-1.0, -2.0], [9, 8]) == ([], [], True)


# ---- log-prob gap and TIS ---------------------------------------------------------------------


def test_rollout_gap_metrics_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(4, 6, generator=g) * 3
    logp_rollout = logp_old + torch.randn(4, 6, generator=g) * 0.5
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    cap = 1.5
    m = algos.rollout_gap_metrics(logp_old, logp_rollout, mask, cap)
    diffs, seq = [], []
    for b in range(4):
        s = 0.0
        for t in range(6):
            if mask[b, t] > 0:
                d = float(logp_old[b, t] - logp_rollout[b, t])
                diffs.append(d)
                s += d
        seq.append(abs(s))
    assert m["rollout_gap/abs_mean"] == pytest.approx(sum(abs(d) for d in diffs) / len(diffs))
    assert m["rollout_gap/abs_max"] == pytest.approx(max(abs(d) for d in diffs))
    k3 = sum(math.exp(d) - 1 - d for d in diffs) / len(diffs)
    assert m["rollout_gap/kl_k3"] == pytest.approx(k3, rel=1e-5)
    assert m["rollout_gap/seq_abs_max"] == pytest.approx(max(seq), rel=1e-5)
    w, _ = token_tis(logp_old, logp_rollout, mask, AlgoConfig(tis_cap=cap))
    assert m["tis/weight_mean"] == pytest.approx(float(w[mask > 0].mean()), rel=1e-5)
    capped = sum(math.exp(d) > cap for d in diffs) / len(diffs)
    assert m["tis/capped_frac"] == pytest.approx(capped)
    same = algos.rollout_gap_metrics(logp_old, logp_old.clone(), mask)
    assert same["rollout_gap/abs_max"] == 0.0 and "tis/capped_frac" not in same
    assert algos.rollout_gap_metrics(logp_old, logp_rollout, torch.zeros(4, 6)) == {}


# ---- text-only models through the shared code ---------------------------------------------------


def test_text_model_runs_through_policy_and_hf_engine(text_model):
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.rollout import SamplingParams

    model, proc = text_model
    policy = VLMPolicy(model, proc, PromptConfig(max_prompt_length=256))
    prompts, _ = policy.encode([{"id": 0, "question": "How many red circles are there?"}])
    assert policy.banned_ids == [] and prompts[0].vision == {}
    torch.manual_seed(0)
    batch = Rollouts(policy).sample(
        prompts, 2, SamplingParams(max_new_tokens=6, return_logprobs=True)
    )
    assert batch.tokens.shape[0] == 2
    with torch.no_grad():
        logp = policy.evaluate(batch).logp
    gap = algos.rollout_gap_metrics(logp, batch.logp_rollout, batch.mask)
    assert gap["rollout_gap/abs_max"] < 1e-4  # HF engine and trainer agree at T = 1
    # the rollouts' temperature is the policy's: evaluate scores the tempered distribution
    policy.sampling = SamplingParams(max_new_tokens=6, temperature=0.7, return_logprobs=True)
    batch = Rollouts(policy).sample(prompts, 2)
    with torch.no_grad():
        logp = policy.evaluate(batch).logp
    gap = algos.rollout_gap_metrics(logp, batch.logp_rollout, batch.mask)
    assert gap["rollout_gap/abs_max"] < 1e-4
    with pytest.raises(ValueError, match="images"):
        proc(text=["x"], images=[object()])


# ---- config and wiring --------------------------------------------------------------------------


def test_vllm_config_keys_and_engine_validation():
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.bucket_mb=64"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.bucket_mb == 64
    with pytest.raises(ConfigError, match="bucket_mb"):
        load_config(None, ["rollout.vllm.bucket_m=64"])
    with pytest.raises(ConfigError, match="hf, vllm"):  # checked when the recipe loads
        load_config(None, ["rollout.engine=sglang"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_engine_without_vllm_says_how_to_install(text_model, tmp_path):
    from perceptrl.vlm.vllm_rollout import VLLMEngine

    with pytest.raises(ImportError, match="setup-vllm"):
        VLLMEngine(tmp_path, text_model[1])


def test_vllm_engine_refuses_what_it_cannot_sync():
    """Refused when the recipe loads, before any model or engine is built."""
    for override, match in (("model.lora_rank=8", "LoRA"), ("train.zero_stage=3", "ZeRO-3")):
        extra = ["train.backend=deepspeed"] if "zero" in override else []
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["rollout.engine=vllm", override, *extra])


def test_prompt_check_names_a_missing_image():
    """An observation image that never reached the request: the engine's prompt has one image
    fewer, and the error says so instead of blaming the image bounds."""
    vis = [9]
    trainer = [1, 9, 9, 2, 3, 9, 9, 9, 4]  # two images
    engine = [1, 9, 9, 2, 3, 4]  # the second never sent
    with pytest.raises(PromptMismatchError, match=r"got 1 image\(s\) where the trainer has 2"):
        check_prompt_ids(trainer, engine, "s1", vis)
