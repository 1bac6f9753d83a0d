"""End to end through the `perceptrl` command on the tiny model: SFT, GRPO, kill and resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perceptrl.trainer.metrics import read_metrics

TINY = [
    "data.n_train=24", "data.n_val=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=12", "train.micro_batch_size=4", "train.eval_samples=4",
    "train.eval_every=0", "log.progress=false", "log.tensorboard=false",
    "algo.dynamic_sampling=false",  # untrained tiny models score 0 everywhere: no group would stay
]  # fmt: skip


def perceptrl(
    *args: str, cwd: Path, check: bool = True, env_extra=None, **kw
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "perceptrl.cli", *args]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, **kw)
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def _compare(a_path: Path, b_path: Path) -> None:
    def rows(p):
        return [
            {k: v for k, v in r.items() if not k.startswith(("time/", "sys/"))}
            for r in read_metrics(p)
            if "resumed_from_step" not in r
        ]

    a, b = rows(a_path), rows(b_path)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)


def test_sft_then_grpo_from_the_sft_checkpoint(tmp_path):
    out = perceptrl("sft", "vlm_sft", "train.steps=3", *TINY, "--run-dir", "sft", cwd=tmp_path)
    assert "held-out metric" in out.stdout
    model = tmp_path / "sft" / "checkpoints" / "step_000003" / "model"
    assert (model / "config.json").exists() and (tmp_path / "sft" / "config.yaml").exists()
    perceptrl(
        "train",
        "vlm_clevr",
        f"model.path={model}",
        "train.steps=2",
        *TINY,
        "--run-dir",
        "grpo",
        cwd=tmp_path,
    )
    rows = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("actor/pg_loss" in r and "time/rollout" in r and "time/collect" in r for r in steps)
    assert (
        tmp_path / "grpo" / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    ).exists()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_one_grpo_step_per_tiny_architecture(tmp_path, arch):
    perceptrl("train", "vlm_clevr", "model.path=", f"model.tiny_arch={arch}", "train.steps=1", *TINY,
              "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    assert any("actor/pg_loss" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    args = [
        "train",
        "vlm_clevr",
        "model.path=",
        "train.steps=8",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        *TINY,
    ]
    perceptrl(*args, "--run-dir", "full", cwd=tmp_path)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "perceptrl.cli", *args, "--run-dir", "cut"], cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ckpts = tmp_path / "cut" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts / "step_000003").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (ckpts / "step_000008").exists(), "the run finished before it could be killed"

    perceptrl("train", "--resume", "cut", cwd=tmp_path)
    _compare(tmp_path / "full" / "metrics.jsonl", tmp_path / "cut" / "metrics.jsonl")


def test_config_errors_are_reported_not_raised(tmp_path):
    out = perceptrl("train", "vlm_clevr", "algo.kl_cof=0.1", cwd=tmp_path, check=False)
    assert out.returncode == 2 and "did you mean 'algo.kl_coef'" in out.stderr


def test_unknown_data_generator_is_a_config_error(tmp_path):
    from perceptrl.trainer.config import ConfigError
    from perceptrl.vlm.run import samples as vlm_samples
    from perceptrl.wiring import load_config

    with pytest.raises(ConfigError, match="data.generator='clever'.*clevr, video, spatial"):
        vlm_samples(load_config(None, ["data.generator=clever"]), tmp_path)


def test_data_generate_writes_every_split(tmp_path):
    out = perceptrl("data", "generate", "--out", "d", "--n-train", "6", "--n-val", "3", "--n-test", "3", "--n-ood", "3",
                    cwd=tmp_path)  # fmt: skip
    for split in ("train", "val", "test", "ood"):
        assert (tmp_path / "d" / f"{split}.jsonl").exists() and split in out.stdout


def test_eval_vlm_writes_a_per_family_table(tmp_path):
    out = perceptrl("eval", "vlm_clevr", "--model", "assets/vlm_base", "--out", "ev", "train.eval_samples=6",
                    "data.n_val=6", cwd=tmp_path)  # fmt: skip
    assert "| all | 6 |" in out.stdout
    metrics = json.loads((tmp_path / "ev" / "eval.json").read_text())["metrics"]
    assert metrics["count"] == 6 and 0.0 <= metrics["accuracy"] <= 1.0


def test_vla_train_then_eval_writes_table_and_video(tmp_path):
    env = {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    perceptrl("train", "vla_ppo_reach_state", "train.steps=2", "env.eval_episodes=0", "env.num_envs=2",
              "env.steps_per_rollout=8", "log.progress=false", "--run-dir", "run", cwd=tmp_path, env_extra=env)  # fmt: skip
    model = tmp_path / "run" / "checkpoints" / "step_000002" / "model"
    out = perceptrl("eval", "vla_ppo_reach_state", "--model", str(model), "--out", "ev", "env.eval_episodes=2",
                    "env.eval_videos=1", cwd=tmp_path, env_extra=env)  # fmt: skip
    assert "| Reach | 2 |" in out.stdout
    assert (tmp_path / "ev" / "Reach.mp4").stat().st_size > 0
