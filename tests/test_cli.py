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
            {
                k: v
                for k, v in r.items()
                if not k.startswith(("time/", "sys/")) and not k.endswith("_per_s")
            }  # timings
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


SAC = [
    "env.num_envs=2", "env.steps_per_rollout=4", "env.eval_episodes=0", "replay.batch_size=16",
    "replay.learning_starts=12", "replay.size=64", "vla.hidden=32", "log.progress=false",
]  # fmt: skip
"""a tiny SAC run: random actions for 2 steps, then updates from a buffer that wraps around"""


@pytest.mark.parametrize(
    "run", [["vlm_clevr", "model.path=", *TINY], ["vla_sac_reach_state", *SAC]], ids=["vlm", "sac"]
)
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, run):
    """Killed after a checkpoint, resumed: the metrics of the uninterrupted run (for SAC: the
    replay buffer, its sampling and the episodes in flight resume exactly)."""
    args = ["train", *run[:1], "train.steps=8", "checkpoint.every=1", "checkpoint.keep_last=3",
            *run[1:]]  # fmt: skip
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


@pytest.mark.parametrize("left", ["metrics.jsonl", "checkpoints"])
def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path, capsys, left):
    """Starting over an earlier run would append to its metrics and leave its checkpoints
    beside the new ones; the CLI says to resume it or pick another directory."""
    from perceptrl.cli import main

    run = tmp_path / "r"
    run.mkdir()
    (run / left).mkdir() if left == "checkpoints" else (run / left).write_text("{}\n")
    assert main(["train", "vlm_clevr", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {run}" in err
    assert sorted(p.name for p in run.iterdir()) == [left]  # nothing written over it


def test_unknown_data_generator_is_a_config_error():
    from perceptrl.trainer.config import ConfigError
    from perceptrl.wiring import load_config

    with pytest.raises(ConfigError, match="data.generator='clever'.*clevr, plan, spatial"):
        load_config(None, ["data.generator=clever"])  # refused when the recipe loads


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


def test_eval_scores_exactly_the_validation_file_it_names(tmp_path):
    """``data.val`` alone (no ``data.train``) is the evaluated set: its samples, its name in the
    report, and the count read said on stdout."""
    import cv2
    import numpy as np

    cv2.imwrite(str(tmp_path / "a.png"), np.full((56, 56, 3), 128, np.uint8))
    rows = [{"id": f"q{i}", "images": ["a.png"], "question": "How many?", "answer": str(i),
             "reward": "count"} for i in range(3)]  # fmt: skip
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = perceptrl("eval", "vlm_clevr", "--model", "assets/vlm_base", "--out", "ev",
                    "data.val=val.jsonl", cwd=tmp_path)  # fmt: skip
    assert "3 of the 3 samples of data.val=val.jsonl" in out.stdout
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert report["metrics"]["count"] == 3 and report["task_sets"][0]["data"] == "val.jsonl"


def test_eval_pass_k_puts_two_models_on_one_chart(tmp_path):
    out = perceptrl("eval", "vlm_clevr", "--model", "base=assets/vlm_base", "--model", "again=assets/vlm_base",
                    "--pass-k", "1,2", "--pass-n", "3", "--out", "pk", "train.eval_samples=3", "data.n_val=3",
                    cwd=tmp_path)  # fmt: skip
    saved = json.loads((tmp_path / "pk" / "passk.json").read_text())
    assert set(saved) == {"base", "again"} and saved["base"]["n"] == 3
    assert saved["base"]["overall"]["1"] <= saved["base"]["overall"]["2"]
    assert "| again | all | all | 3 |" in out.stdout and (tmp_path / "pk" / "passk.png").exists()
    bad = perceptrl("eval", "vlm_clevr", "--model", "assets/vlm_base", "--pass-k", "1,8", "--pass-n", "4",
                    "--out", "pk2", "data.n_val=2", cwd=tmp_path, check=False)  # fmt: skip
    assert bad.returncode == 2 and "1..4" in bad.stderr


def test_vla_train_then_eval_writes_table_and_video(tmp_path):
    env = {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    perceptrl("train", "vla_ppo_reach_state", "train.steps=2", "env.eval_episodes=0", "env.num_envs=2",
              "env.steps_per_rollout=8", "checkpoint.every=1", "log.progress=false", "--run-dir", "run",
              cwd=tmp_path, env_extra=env)  # fmt: skip
    model = tmp_path / "run" / "checkpoints" / "step_000002" / "model"
    out = perceptrl("eval", "vla_ppo_reach_state", "--model", str(model), "--out", "ev", "env.eval_episodes=2",
                    "env.eval_videos=1", cwd=tmp_path, env_extra=env)  # fmt: skip
    # perceptrl eval scores the training wording and every held-out one on the same seeds
    assert "| Reach | train | 2 |" in out.stdout and "| Reach | synonym | 2 |" in out.stdout
    assert (tmp_path / "ev" / "Reach.mp4").stat().st_size > 0
    first = tmp_path / "run" / "checkpoints" / "step_000001" / "model"
    out = perceptrl("eval", "vla_ppo_reach_state", "--model", f"early={first}", "--model", f"late={model}",
                    "--out", "cmp", "env.eval_episodes=2", "env.eval_videos=1", cwd=tmp_path, env_extra=env)  # fmt: skip
    assert "| early |" in out.stdout and "| late |" in out.stdout
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(saved["metrics"]) == {"early", "late"}
    from perceptrl.sim.demonstrations import read_video

    assert read_video(tmp_path / "cmp" / "Reach_compare.mp4").shape[1:] == (256, 512, 3)


def test_demo_runs_both_parts_and_writes_its_summary(tmp_path):
    """`perceptrl demo` at a tiny budget: GRPO steps from the demo base, the base against the
    trained model on fresh questions, then PPO on reach; the summary files hold both parts."""
    env = {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    out = perceptrl("demo", "--out", "d", "--steps", "2", "--test-questions", "6", "--vla-steps", "2",
                    *TINY, cwd=tmp_path, env_extra=env)  # fmt: skip
    assert (
        "2 steps from assets/vlm_demo_base" in out.stdout and "paired standard error" in out.stdout
    )
    result = json.loads((tmp_path / "d" / "demo.json").read_text())
    vlm, vla = result["vlm_grpo"], result["vla_ppo_reach"]
    assert vlm["steps"] == 2 and vlm["held_out"]["questions"] == 6
    assert set(vlm["held_out"]["families"]) == {"count_all"}
    assert vla["steps"] == 2 and [s for s, _ in vla["success_curve"]] == [0, 2]
    assert "Part 2, VLA PPO on reach (2 steps" in (tmp_path / "d" / "demo.md").read_text()
    assert (tmp_path / "d" / "vla_ppo_reach" / "eval" / "before_after.mp4").stat().st_size > 0


def test_demo_without_its_base_says_how_to_restore_it(tmp_path):
    out = perceptrl("demo", "--out", "d", "model.path=nowhere/base", cwd=tmp_path, check=False)
    assert out.returncode == 2 and "assets/build/make_demo_base.py" in out.stderr
    assert "Traceback" not in out.stderr


# ---- errors a user can act on (data) ---------------------------------------------------------

FAST = [*TINY, "model.path=", "train.steps=1", "train.eval_samples=0", "rollout.max_new_tokens=4"]


def _user_data(root: Path, records: list) -> Path:
    """``root/d.jsonl`` with the records (a string is written as the line itself) beside a grey
    112x112 ``ok.png``, a grey 448x448 ``big.png`` and undecodable ``broken.png``/``broken.mp4``."""
    from PIL import Image

    Image.new("RGB", (112, 112), (128, 128, 128)).save(root / "ok.png")
    Image.new("RGB", (448, 448), (128, 128, 128)).save(root / "big.png")
    (root / "broken.png").write_bytes(b"\x89PNG not an image" * 8)
    (root / "broken.mp4").write_bytes(b"not a video" * 8)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (root / "d.jsonl").write_text("".join(line + "\n" for line in lines))
    return root / "d.jsonl"


OK = {"image": "ok.png", "question": "How many?", "answer": "2"}
BAD = {
    "malformed line": '{"image": "ok.png", "question": "How many?"',
    "missing answer": {"image": "ok.png", "question": "How many?"},
    "unreadable image": {"image": "broken.png", "question": "How many?", "answer": "2"},
    "bad video": {"video": "broken.mp4", "question": "When?", "answer": "[1, 2]", "reward": "tiou"},
}


@pytest.mark.parametrize("kind", list(BAD))
def test_strict_data_errors_end_with_a_message_not_a_traceback(tmp_path, capsys, kind):
    from perceptrl.cli import main

    path = _user_data(tmp_path, [OK, OK, BAD[kind]])
    rc = main(["train", "vlm_clevr", f"data.train={path}", *FAST, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert err.startswith("perceptrl: data error: ") and err.count("\n") == 1, err
    assert "d.jsonl" in err and "line 3" in err and "data.strict=false" in err


def test_too_long_prompts_are_found_when_the_data_loads(tmp_path, capsys):
    """Strict: before any step runs, the error lists the samples, both settings and per cause the
    setting that helps (the text of 'wordy', the vision tokens of 'big')."""
    from perceptrl.cli import main

    wordy = {**OK, "question": "How many circles? " * 30, "id": "wordy"}
    big = {**OK, "image": "big.png", "id": "big"}
    path = _user_data(tmp_path, [OK, wordy, OK, big])
    run = tmp_path / "r"
    rc = main(["train", "vlm_clevr", f"data.train={path}", "rollout.max_prompt_length=100", *FAST,
               "--run-dir", str(run)])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 3 and "Traceback" not in err, err
    msg = err.strip().splitlines()[-1]  # before it: the tiny model's build and load progress
    assert msg.startswith("perceptrl: data error: ")
    assert f"2 prompts of data.train={path} are longer than rollout.max_prompt_length=100" in msg
    assert "model.max_pixels=" in msg and "'wordy' (index 1)" in msg and "'big' (index 3)" in msg
    assert "text alone is too long in 1 (e.g. 'wordy')" in msg
    assert "vision tokens make 1 too long (e.g. 'big')" in msg
    assert "data.strict=false" in msg
    assert not (run / "metrics.jsonl").exists()  # found before training (or evaluation) began


def test_lenient_skips_are_run_metrics_and_in_the_summary(tmp_path, capsys):
    from perceptrl.cli import main

    wordy = {**OK, "question": "How many circles? " * 30, "id": "wordy"}
    records = [OK, BAD["malformed line"], OK, BAD["unreadable image"], OK, wordy, OK]
    path = _user_data(tmp_path, records)
    run = tmp_path / "r"
    rc = main(["train", "vlm_clevr", f"data.train={path}", "data.strict=false",
               "rollout.max_prompt_length=100", *FAST, "--run-dir", str(run)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    step = next(r for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r)
    assert step["data/skipped_malformed"] == 1.0 and step["data/skipped_images"] == 1.0
    assert step["data/skipped_too_long"] == 1.0 and "data/skipped_videos" not in step
    assert "skipped samples (data.strict=false): malformed 1, images 1, too_long 1" in out


RENDER = """
import perceptrl, mujoco, os
from perceptrl.sim.render import make_renderer
model = mujoco.MjModel.from_xml_string('<mujoco><worldbody><geom size="0.1"/></worldbody></mujoco>')
r = make_renderer(model, 24, 32)
r.update_scene(mujoco.MjData(model))
print(os.environ["MUJOCO_GL"], r.render().shape)
"""


def test_headless_processes_render_offscreen_without_setting_mujoco_gl():
    """MuJoCo's default GL backend needs a display; importing perceptrl picks EGL on a headless
    machine unless the user chose a backend."""
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "DISPLAY")}
    out = subprocess.run([sys.executable, "-c", RENDER], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "egl (24, 32, 3)"


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """`perceptrl config x | head -1`: the reader closes the pipe early; the command ends
    quietly with status 0."""
    cmd = [sys.executable, "-m", "perceptrl.cli", "config", "vlm_clevr"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in stderr, stderr
