"""The GPU lane (``make gpu-lane``): short runs of both sides with ``train.device=cuda``, the
shared-prefix forward on CUDA, and the real-size benchmark script. The ``gpu``-marked tests skip
without CUDA and are deselected by default; the unmarked ones check here, on the CPU, that the
benchmark's Qwen2.5-VL-3B configuration builds (on the meta device) and that the script runs."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BENCH = REPO / "bench" / "bench_gpu_scale.py"
QUIET = ["log.tensorboard=false", "log.progress=false", "train.device=cuda"]

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def bench_module():
    """bench/bench_gpu_scale.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_scale", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(tmp_path: Path, *args: str) -> dict:
    """The benchmark script in its own process (``--tiny``, results into ``tmp_path``)."""
    cmd = [sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "0",
           "--out", str(tmp_path), "--name", "tiny", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=600)
    assert (tmp_path / "tiny.md").is_file()
    return json.loads((tmp_path / "tiny.json").read_text())


def check_bench_result(res: dict, settings: int) -> None:
    assert len(res["runs"]) == settings
    for r in res["runs"]:
        assert r["rollout_tokens_per_s"] > 0 and r["train_step_s"] > 0
        assert 0 < r["train_mfu"] < 1 and 0 < r["rollout_mfu"] < 1
        assert r["rows"] == 4 and r["lm_tokens_per_step"] > r["rows"] * r["completion_len_mean"]
        assert all(math.isfinite(x) for x in r["loss"] + r["grad_norm"])


# --------------------------------------------------------------- CPU: configuration and script


def test_real_size_config_builds_on_meta():
    from transformers import AutoProcessor
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as conf

    bench = bench_module()
    size = bench.QWEN25_VL_3B
    # every key is an argument of the installed config classes (unknown ones would be ignored)
    for keys, cls in ((size["text"], conf.Qwen2_5_VLTextConfig),
                      (size["vision"], conf.Qwen2_5_VLVisionConfig)):  # fmt: skip
        unknown = set(keys) - set(inspect.signature(cls.__init__).parameters)
        assert not unknown, f"{cls.__name__} has no {unknown}"
    processor = AutoProcessor.from_pretrained(bench.BASE)
    config = bench.model_config(size, processor.tokenizer)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (2048, 36, 2)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert vision.fullatt_block_indexes == [7, 15, 23, 31] and vision.out_hidden_size == 2048
    assert config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    model = bench.build_model(config, torch.bfloat16, "meta")
    counts = bench.param_counts(model)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    assert 3.70e9 < counts["total"] < 3.80e9, counts  # Qwen2.5-VL-3B: 3.75 B
    assert 0.66e9 < counts["visual"] < 0.68e9, counts
    assert counts["trainable"] == counts["total"]


def test_bench_script_runs_tiny_on_cpu(tmp_path):
    res = run_bench(tmp_path, "--device", "cpu", "--gc", "off,on")
    assert res["size"] == "tiny" and res["settings"]["device"] == "cpu"
    check_bench_result(res, settings=2)
    assert [r["gradient_checkpointing"] for r in res["runs"]] == [False, True]


# --------------------------------------------------------------- GPU lane


@pytest.mark.gpu
@cuda_only
def test_vlm_grpo_run_on_cuda(tmp_path):
    from perceptrl.trainer.metrics import read_metrics
    from perceptrl.vlm.builder import build_trainer as vlm_trainer
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_clevr.yaml",
        ["train.steps=2", "data.n_train=16", "data.n_val=4", "train.eval_samples=4",
         "train.eval_every=0", "algo.dynamic_sampling=false", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=16", "train.micro_batch_size=4",
         "checkpoint.every=0", *QUIET],
    )  # fmt: skip
    trainer = vlm_trainer(cfg, tmp_path)
    params = list(trainer.policy.parameters())
    assert all(p.device.type == "cuda" for p in params)
    before = [p.detach().clone() for p in params]
    trainer.fit()
    rows = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(rows) == 2
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert all(p.device.type == "cuda" and torch.isfinite(p).all() for p in params)
    changed = any(not torch.equal(a, b) for a, b in zip(before, params))
    assert changed or all(r.get("adv/abs_mean", 0) == 0 for r in rows)
    assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.gpu
@cuda_only
def test_vla_ppo_run_on_cuda(tmp_path):
    from perceptrl.trainer.metrics import read_metrics
    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vla_ppo_reach_state.yaml",
        ["train.steps=2", "train.eval_every=0", "env.num_envs=4", "env.steps_per_rollout=16",
         "env.eval_episodes=2", "checkpoint.every=0", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    params = list(trainer.policy.parameters())
    assert all(p.device.type == "cuda" for p in params)
    before = [p.detach().clone() for p in params]
    seen = []
    act = trainer.policy.act

    def recording(*a, **kw):  # observation only: where collection computes the actions
        out = act(*a, **kw)
        seen.append(out[0].device.type)
        return out

    trainer.policy.act = recording  # an instance attribute, removed below
    try:
        trainer.fit()
    finally:
        del trainer.policy.act
        trainer.source.close()
    assert seen and set(seen) == {"cuda"}
    rows = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(rows) == 2 and all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    assert any(not torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.gpu
@cuda_only
def test_vla_ppo_on_warp_simulates_and_renders_on_cuda(tmp_path):
    """The shipped MJWarp recipe on the GPU: worlds stepped and ray-traced on CUDA, the images
    handed to the policy as CUDA tensors (no host copy), a PPO update that changes the weights.
    Skips when warp-lang is not installed on the GPU machine."""
    from perceptrl.sim.warp_support import warp_available
    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    if not warp_available():
        pytest.skip("mujoco-warp / warp-lang not importable on this machine")
    cfg = load_config(
        CONFIGS / "vla_ppo_reach_warp.yaml",
        ["train.steps=2", "train.eval_every=0", "env.num_envs=256", "env.steps_per_rollout=8",
         "env.device=cuda", "env.eval_episodes=4", "checkpoint.every=0", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.fit()
    images = trainer.source.runner.batch.images
    assert all(v.device.type == "cuda" and v.shape[0] == 256 for v in images.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    trainer.source.close()


@pytest.mark.gpu
@cuda_only
def test_shared_prefix_matches_plain_forward_on_cuda(tmp_path):
    from perceptrl.datasets.clevr import generate
    from perceptrl.datasets.loader import load_samples
    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.rollout import SamplingParams
    from perceptrl.vlm.sampler import Rollouts
    from perceptrl.vlm.tiny import build_tiny

    torch.backends.cudnn.allow_tf32 = False  # the patch-embedding convolution, full fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    path = generate(tmp_path / "data", splits={"train": 4}, seed=0)["train"]
    samples = load_samples(path)[0]
    policy = VLMPolicy.from_pretrained(
        build_tiny("qwen2_5_vl", tmp_path / "model", seed=0), device="cuda"
    )
    torch.manual_seed(0)
    prompts, _ = policy.encode(samples)
    batch = Rollouts(policy).sample(prompts, n=3, sampling=SamplingParams(max_new_tokens=12))
    batch = batch.select(torch.randperm(len(batch)).tolist())  # rows of a prompt no longer adjacent
    calls = []
    handle = policy.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    out = {}
    try:
        for share in (True, False):
            policy.share_prefix = share
            with torch.no_grad():
                ev = policy.evaluate(batch.to("cuda"))
                out[share] = ev.logp, ev.entropy
    finally:
        handle.remove()
        policy.share_prefix = True
    assert [c[0] for c in calls] == [len(prompts), len(batch), len(batch)]  # shared: 2 passes
    assert out[True][0].device.type == "cuda"
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-4, rtol=0)
    assert (out[True][0][batch.mask.bool().to("cuda")] < 0).all()


@pytest.mark.gpu
@cuda_only
def test_bench_script_runs_tiny_on_cuda(tmp_path):
    res = run_bench(tmp_path, "--device", "cuda", "--dtype", "bfloat16", "--gc", "off,on")
    assert res["settings"]["device"] == "cuda" and res["machine"]["cuda"]
    check_bench_result(res, settings=2)
    assert all(r["peak_gpu_mem_gb"] > 0 for r in res["runs"])
