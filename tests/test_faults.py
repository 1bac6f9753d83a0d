"""Whole runs through the `perceptrl` command: the same seed gives the same metrics for every
shipped recipe, and a training run (`perceptrl train`; `perceptrl sft` has no resume) killed with SIGKILL (at random moments, inside checkpoint writes too)
and resumed logs exactly the metrics of the uninterrupted run, every step once.

Runs are compared on every logged value except wall-clock ones (`WALL_CLOCK`), exactly, on one
thread. Each recipe's second run starts after drawing from the process's global generators (as
a benchmark's second arm or an earlier import would), so anything built from an unseeded
generator shows; the killed runs are other processes (another hash seed) than their reference.
Runs that need no kill run in this process (`perceptrl.cli.main`), which spares the imports.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.cli import main  # noqa: E402
from perceptrl.trainer.metrics import read_metrics  # noqa: E402

PAUSE_ENV = "PERCEPTRL_TEST_CHECKPOINT_PAUSE_S"
"""trainer/checkpoint.py sleeps this long between writing a checkpoint and renaming it"""
WALL_CLOCK = ("time/", "sys/", "rollout/env_steps_per_s")
"""metric keys (prefixes) that measure the machine, not the run"""
QUIET = ["log.progress=false", "log.tensorboard=false"]
VLM_TINY = [
    "data.n_train=12", "data.n_val=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=8", "train.micro_batch_size=4", "train.eval_samples=4",
]  # fmt: skip
VLA_TINY = ["env.num_envs=2", "env.eval_episodes=2", "vla.hidden=32"]
RECIPES = {
    # recipe: (command, overrides); PPO episodes (12 steps) span collections (8 steps)
    "vla_ppo_reach_state": ("train", [*VLA_TINY, "train.steps=6", "env.steps_per_rollout=8",
                            "env.max_episode_steps=12", "train.ppo_epochs=2", "train.eval_every=3"]),
    "vla_grpo": ("train", [*VLA_TINY, "train.steps=2", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "env.max_episode_steps=8", "algo.max_collects=2"]),
    "vla_ppo_reach": ("train", [*VLA_TINY, "train.steps=2", "env.image_size=32",
                      "env.steps_per_rollout=4", "env.max_episode_steps=6",
                      "vla.channels=[4,8,8]", "train.ppo_epochs=1"]),
    "vla_ppo_reach_warp": ("train", [*VLA_TINY, "train.steps=2", "env.image_size=32",
                           "env.steps_per_rollout=4", "env.max_episode_steps=6", "env.device=cpu",
                           "vla.channels=[4,8,8]", "train.ppo_epochs=1"]),
    "vla_bc_pick": ("sft", [*VLA_TINY, "train.steps=2", "env.steps_per_rollout=8",
                    "train.eval_every=0"]),
    "vlm_clevr": ("train", [*VLM_TINY, "train.steps=2", "train.eval_every=1",
                  "algo.dynamic_sampling=false"]),
    "vlm_sft": ("sft", [*VLM_TINY, "train.steps=2", "train.eval_every=1"]),
    "vlm_clevr_tree": ("train", [*VLM_TINY, "train.steps=2", "rollout.group_size=4",
                       "rollout.tree.branches=[2,2]", "rollout.tree.segment_tokens=3"]),
    "vlm_process": ("train", [*VLM_TINY, "train.steps=2", "rollout.process_reward=implicit_prm"]),
    "vlm_spatial": ("train", [*VLM_TINY, "train.steps=1", "data.n_train=4", "data.n_val=2",
                    "train.eval_samples=2", "algo.dynamic_sampling=false"]),
    "vlm_video": ("train", [*VLM_TINY, "train.steps=1", "data.n_train=4", "data.n_val=2",
                  "train.eval_samples=2", "algo.dynamic_sampling=false"]),
}  # fmt: skip
FAST = ("vla_ppo_reach_state", "vla_grpo", "vla_bc_pick", "vlm_clevr", "vlm_clevr_tree")
"""the recipes checked in `make test` (a few seconds each: each VLA builder, one VLM recipe)"""


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), **(extra or {})}  # fmt: skip


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "perceptrl.cli", *args]


def _args(recipe: str, run_dir: Path, extra=()) -> list[str]:
    command, overrides = RECIPES[recipe]
    return [command, recipe, *overrides, *QUIET, *extra, "--run-dir", str(run_dir)]


def _run(args: list[str], cwd: Path, env_extra=None) -> None:
    """`perceptrl` in a process of its own."""
    out = subprocess.run(_cmd(args), cwd=cwd, env=_env(env_extra), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]


def _here(args: list[str], cwd: Path, disturb: bool = False) -> None:
    """`perceptrl` in this process, on one thread; ``disturb`` draws from the global
    generators first."""
    threads, old = torch.get_num_threads(), Path.cwd()
    torch.set_num_threads(1)
    os.chdir(cwd)
    try:
        if disturb:
            random.random(), np.random.rand(3), torch.rand(5)
        assert main(args) == 0
    finally:
        os.chdir(old)
        torch.set_num_threads(threads)


def _resume(run_dir: Path, cwd: Path) -> None:
    _here(["train", "--resume", str(run_dir)], cwd)


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock values and resume markers."""
    return [
        {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
        for r in read_metrics(run_dir / "metrics.jsonl")
        if "resumed_from_step" not in r
    ]


def assert_same_run(want: Path, got: Path) -> None:
    """Same rows (every step once, in order) with exactly the same values."""
    a, b = rows(want), rows(got)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b, strict=True):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys()
                          if ra.get(k) != rb.get(k)}  # fmt: skip


CKPT = ["checkpoint.every=1", "checkpoint.keep_last=2"]
_REFERENCE: dict[tuple, Path] = {}


def reference(recipe: str, root: Path, extra: tuple = ()) -> Path:
    """The recipe's reference run (once per session, here, checkpoints every step)."""
    key = (recipe, *extra)
    if key not in _REFERENCE:
        run = root / f"ref-{recipe}-{len(_REFERENCE)}"
        _here(_args(recipe, run, [*CKPT, *extra]), root)
        _REFERENCE[key] = run
    return _REFERENCE[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.mark.parametrize(
    "recipe", [r if r in FAST else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES]
)
def test_same_seed_same_metrics(recipe, root):
    ref = reference(recipe, root)
    again = root / f"again-{recipe}"
    _here(_args(recipe, again, CKPT), root, disturb=True)
    assert len(rows(again)) >= 2
    assert_same_run(ref, again)


def _start(args: list[str], cwd: Path, pause: float) -> subprocess.Popen:
    """`perceptrl` in a process of its own, its stderr appended to ``cwd/stderr.log``."""
    with (cwd / "stderr.log").open("a") as err:
        return subprocess.Popen(
            _cmd(args), cwd=cwd, env=_env({PAUSE_ENV: str(pause)}), stdout=subprocess.DEVNULL,
            stderr=err,
        )  # fmt: skip


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not cond() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)


def _kill(proc: subprocess.Popen) -> bool:
    """SIGKILL; True when the process was still running."""
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return alive


def _writing(ckpts: Path) -> bool:
    return ckpts.is_dir() and any(p.name.startswith(".tmp-step_") for p in ckpts.iterdir())


def test_vla_sigkill_after_first_checkpoint_resumes_to_the_same_metrics(root):
    """PPO with episodes in flight at every checkpoint: killed at a random moment after the
    first checkpoint (seeded draw), resumed, the same metrics as the uninterrupted run."""
    recipe = "vla_ppo_reach_state"
    ref = reference(recipe, root)
    run = root / "killed-vla"
    proc = _start(_args(recipe, run, CKPT), root, pause=0.3)  # a run of >= 1.5 s after step 1
    ckpts = run / "checkpoints"
    _wait_for(lambda: (ckpts / "step_000001").exists(), proc)
    time.sleep(random.Random(13).uniform(0.0, 1.2))
    assert _kill(proc), (
        "the run ended before it was killed: " + (root / "stderr.log").read_text()[-3000:]
    )
    assert not (ckpts / "step_000006").exists()
    _resume(run, root)
    assert_same_run(ref, run)


def test_killed_before_its_first_checkpoint_starts_over_without_its_rows(root):
    """What a kill before the first checkpoint leaves (the config and some rows, no
    checkpoint): `--resume` runs from the start and logs every step once."""
    import shutil

    ref = reference("vla_ppo_reach_state", root)
    run = root / "killed-early"
    run.mkdir()
    shutil.copy(ref / "config.yaml", run / "config.yaml")
    lines = (ref / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:3]))  # step 0's evaluation, step 1, ...
    _resume(run, root)
    assert_same_run(ref, run)


def _where(ckpts: Path) -> str:
    """Where a kill landed, from what it left behind."""
    if _writing(ckpts):
        return "in a checkpoint write"
    if not ckpts.is_dir() or not any(p.name.startswith("step_") for p in ckpts.iterdir()):
        return "before the first checkpoint"
    return "between checkpoints"


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe", ["vla_ppo_reach_state", "vla_grpo", "vlm_clevr", "vla_ppo_reach_warp"]
)
def test_random_sigkills_every_resumed_run_matches(recipe, root):
    """Per recipe, 4 trials of a 5-step run with a checkpoint every step: trial 0 is killed
    inside a checkpoint write (files written, not yet renamed), trial 1 at a seeded random
    moment of the whole run (startup included), trials 2-3 at a random moment after a random
    checkpoint; half of the resumes are killed again at a random moment. Every run resumed to
    its end logs the reference's metrics, every step once."""
    steps = ("train.steps=5",)
    ref = reference(recipe, root, steps)
    args = lambda run: _args(recipe, run, [*CKPT, *steps])  # noqa: E731
    t0 = time.time()
    _run(args(root / f"timed-{recipe}"), root, env_extra={PAUSE_ENV: "0.2"})
    duration = time.time() - t0  # a whole run in its own process, checkpoint pauses included
    rng = random.Random(f"kills-{recipe}")
    kills = []
    for trial in range(4):
        run = root / f"kill-{recipe}-{trial}"
        ckpts = run / "checkpoints"
        proc = _start(args(run), root, pause=0.2)
        for attempt in range(3):
            if (trial, attempt) == (0, 0):
                _wait_for(lambda c=ckpts: _writing(c), proc)
            elif trial >= 2 and attempt == 0:
                k = rng.randint(1, 4)
                _wait_for(lambda c=ckpts, k=k: (c / f"step_{k:06d}").exists(), proc)
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                _wait_for(lambda r=run: (r / "config.yaml").exists(), proc)
                time.sleep(rng.uniform(0.1, duration))
            if not _kill(proc):
                break
            kills.append((trial, attempt, _where(ckpts)))
            if rng.random() < 0.5:
                break
            proc = _start(["train", "--resume", str(run)], root, pause=0.2)
        _resume(run, root)
        assert_same_run(ref, run)
    print(f"{recipe}: {len(kills)} kills", *kills, sep="\n  ")
    where = [w for *_, w in kills]
    assert len(kills) >= 4 and "in a checkpoint write" in where and "between checkpoints" in where


# ---- damaged checkpoints and the resume's metrics rewrite -------------------------------------


def _cut(path: Path) -> None:
    """Keep the first half of the file (a copy or a disk that failed part way)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "truncated weights": lambda ckpt: _cut(ckpt / "model" / "model.safetensors"),
    "truncated trainer state": lambda ckpt: _cut(ckpt / "trainer_state.pt"),
    "empty state.json": lambda ckpt: (ckpt / "state.json").write_text(""),
}


def _latest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("recipe", ["vla_ppo_reach_state", "vlm_clevr"])
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(recipe, damage, root, caplog):
    """The latest checkpoint is damaged (as by a bad copy): the resume says so, sets it aside
    as ``damaged-step_*`` (never deleted), resumes from the previous one, counts it in the
    resume's row, and logs the uninterrupted run's metrics."""
    import shutil

    ref = reference(recipe, root)
    run = root / f"damaged-{recipe}-{damage.replace(' ', '_')}"
    shutil.copytree(ref, run)
    latest = _latest(run)
    DAMAGE[damage](latest)
    with caplog.at_level("WARNING", logger="perceptrl.trainer.checkpoint"):
        _resume(run, root)
    assert f"damaged checkpoint: {latest}" in caplog.text and "Resuming from step_" in caplog.text
    assert (latest.parent / f"damaged-{latest.name}").is_dir()  # kept, beside the others
    marker = next(r for r in read_metrics(run / "metrics.jsonl") if "resumed_from_step" in r)
    assert marker["resume/damaged_checkpoints"] == 1.0
    assert marker["resumed_from_step"] == int(latest.name[5:]) - 1
    assert_same_run(ref, run)


def test_every_checkpoint_damaged_is_a_run_error_that_keeps_everything(root, capsys):
    import shutil

    ref = reference("vla_ppo_reach_state", root)
    run = root / "all-damaged"
    shutil.copytree(ref, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        DAMAGE["empty state.json"](ckpt)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run)]) == 6
    err = capsys.readouterr().err
    assert "perceptrl: run error: every checkpoint of" in err and "state.json" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


REWRITE_PAUSE = "PERCEPTRL_TEST_REWRITE_PAUSE_S"
"""trainer/files.py sleeps this long between writing a rewrite's new file and renaming it"""


def test_a_kill_during_the_resumes_metrics_rewrite_loses_no_line(root):
    """A resume rewrites metrics.jsonl without the rows logged after its checkpoint; killed
    inside that rewrite, the file is as it was (the old code truncated it first and a kill
    there emptied it), and the next resume logs the uninterrupted run's metrics."""
    import shutil

    ref = reference("vla_ppo_reach_state", root)
    run = root / "killed-in-rewrite"
    shutil.copytree(ref, run)
    shutil.rmtree(_latest(run))  # as killed after logging the last step, before its checkpoint
    before = (run / "metrics.jsonl").read_bytes()
    with (root / "stderr.log").open("a") as err:
        proc = subprocess.Popen(
            _cmd(["train", "--resume", str(run)]), cwd=root, env=_env({REWRITE_PAUSE: "60"}),
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    _wait_for(lambda: any(run.glob(".tmp-metrics.jsonl-*")), proc)
    assert _kill(proc), "the resume ended before it was killed"
    assert (run / "metrics.jsonl").read_bytes() == before
    _resume(run, root)
    assert_same_run(ref, run)
    assert not any(run.glob(".tmp-metrics.jsonl-*"))
