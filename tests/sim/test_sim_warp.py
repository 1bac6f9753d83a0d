"""The MJWarp backend (``env.backend=warp``) against CPU MuJoCo, on warp's CPU device.

Tolerances: MJWarp computes in float32, MuJoCo in float64. Measured here, the same actions from
the same initial state keep every proprio and entity-pose coordinate within about 1e-6 over a
scripted pick (grasp and lift included); the tests allow `TOL` = 1e-4 over short random-action
sequences. The first test to build a model compiles MJWarp's kernels (about a minute on 2 cores,
cached by warp for later runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.sim import ENV_IDS, TASKS  # noqa: E402
from perceptrl.sim.env import ManipEnv  # noqa: E402
from perceptrl.sim.expert import ScriptedExpert  # noqa: E402
from perceptrl.sim.scene import COLOURS  # noqa: E402
from perceptrl.sim.tasks import World  # noqa: E402
from perceptrl.sim.vector import make_backend  # noqa: E402
from perceptrl.sim.warp_support import mat_to_quat, warp_available  # noqa: E402
from perceptrl.vla.config import EnvConfig  # noqa: E402
from perceptrl.vla.envs import make_envs  # noqa: E402

TOL = 1e-4
"""largest |warp - mujoco| allowed on proprio and entity poses after a few random actions"""
needs_warp = pytest.mark.skipif(not warp_available(), reason="mujoco-warp is not installed")


def _pair(task: str, n: int, **kw):
    """The two backends (`sim.vector.make_backend`) of ``n`` envs of ``task``: warp (on warp's CPU), mujoco."""
    warp = make_backend(ENV_IDS[task], n, backend="warp", device="cpu", **kw)
    cpu = make_backend(ENV_IDS[task], n, backend="mujoco", **kw)
    return warp, cpu


def _indexed(n: int, trial: int = 3) -> list[dict]:
    """Reset options of indexed initial states (i, ``trial``), one per env."""
    return [{"task_id": i, "trial_id": trial} for i in range(n)]


def _reset(env, options: list, mask=None):
    """Reset a backend: the envs of ``mask`` (default all), each with its options, no seeds."""
    n = len(options)
    return env.reset(np.ones(n, bool) if mask is None else np.asarray(mask), options, [None] * n)


# ----------------------------------------------------------------------------- no warp needed
def test_mat_to_quat_matches_mujoco():
    rng = np.random.default_rng(0)
    quats = rng.normal(size=(300, 4))
    mats = np.zeros((300 + 3, 9))
    for i, q in enumerate(quats):
        mujoco.mju_quat2Mat(mats[i], q / np.linalg.norm(q))
    mats[300:] = [np.eye(3).ravel(), np.diag([1.0, -1, -1]).ravel(), np.diag([-1.0, 1, -1]).ravel()]
    ref = np.zeros((len(mats), 4))
    for i, m in enumerate(mats):
        mujoco.mju_mat2Quat(ref[i], m)
    np.testing.assert_allclose(mat_to_quat(mats.reshape(-1, 3, 3)), ref, atol=1e-12)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_batched_scores_equal_one_world_at_a_time(task):
    """Every task's success and shaping on a batched `World` [N, ...] give, per world, what
    they give one world at a time (the warp backend scores all worlds in one call)."""
    env = ManipEnv(task=task, obs_mode="state")
    rng = np.random.default_rng(1)
    worlds = []
    for trial in range(6):
        env.reset(options={"task_id": trial, "trial_id": trial})
        w = env.world()
        # perturb so that some worlds succeed: entities near their goals, random contacts
        jitter = lambda x: x + rng.normal(scale=0.03, size=x.shape)  # noqa: E731
        worlds.append(World(
            jitter(w.targets[0]) if trial % 2 and len(w.targets) else jitter(w.tcp),
            float(rng.uniform(0, 0.08)), jitter(w.blocks), w.bowls, w.zones, w.targets,
            rng.uniform(0, 0.1, len(w.blocks)), rng.random(len(w.blocks)) < 0.5,
            rng.random(len(w.blocks)) < 0.5,
        ))  # fmt: skip
    batch = World(*(np.stack([getattr(w, f) for w in worlds]) for f in World.__dataclass_fields__))
    t = TASKS.get(task)
    np.testing.assert_array_equal(t.success(batch), [bool(t.success(w)) for w in worlds])
    for k, v in t.shaping(batch).items():
        np.testing.assert_allclose(v, [float(t.shaping(w)[k]) for w in worlds], atol=1e-12)


# ----------------------------------------------------------------------------- warp vs mujoco
@needs_warp
@pytest.mark.parametrize("task", sorted(TASKS))
def test_same_actions_same_trajectory(task):
    """From the same indexed initial states, the same random actions give the same proprio,
    entity poses, rewards and success on both backends (within `TOL`)."""
    n, steps = 2, 5
    warp, cpu = _pair(task, n, obs_mode="state", reward_mode="dense")
    bw, iw = _reset(warp, _indexed(n))
    bc, ic = _reset(cpu, _indexed(n))
    assert bw.instructions == bc.instructions
    np.testing.assert_allclose(bw.objects, bc.objects, atol=TOL)
    np.testing.assert_allclose(bw.proprio, bc.proprio, atol=TOL)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        a = rng.uniform(-1, 1, (n, 5)).astype(np.float32)
        bw, rw, tw, trw, iw = warp.step(a)
        bc, rc, tc, trc, ic = cpu.step(a)
        np.testing.assert_allclose(bw.proprio, bc.proprio, atol=TOL)
        np.testing.assert_allclose(bw.objects, bc.objects, atol=TOL)
        np.testing.assert_allclose(rw, rc, atol=TOL)
        np.testing.assert_array_equal(iw["success"], ic["success"])
        assert not iw["sim_unstable"].any()
    cpu.close()


@needs_warp
@pytest.mark.parametrize("task", ["reach", "pick"])
def test_scripted_expert_succeeds_on_both_backends(task):
    """The scripted experts (reading the warp worlds through `WorldView`) succeed on the same
    initial states on both backends, along trajectories that stay within `TOL`."""
    n = 3
    out = {}
    for backend in ("warp", "mujoco"):
        cfg = EnvConfig(id=ENV_IDS[task], num_envs=n, obs_mode="state", backend=backend,
                        device="cpu")  # fmt: skip
        runner = make_envs(cfg)
        runner.reset(options=_indexed(n, trial=7))
        experts = [ScriptedExpert(e) for e in runner.envs]
        done, success, poses = np.zeros(n, bool), np.zeros(n, bool), []
        while not done.all():
            res = runner.step(np.stack([e.act() for e in experts])[:, None])
            success |= res.success & ~done
            done |= res.terminated | res.truncated
            poses.append(res.batch.objects.copy())
        out[backend] = success, np.array(poses)
        runner.close()
    assert out["warp"][0].all() and out["mujoco"][0].all()
    np.testing.assert_allclose(out["warp"][1], out["mujoco"][1], atol=TOL)


def _colour_mask(img: np.ndarray, rgb) -> np.ndarray:
    """Pixels [H, W] whose chromaticity is within a small angle of colour ``rgb`` (shading
    changes brightness, not the direction of the colour vector)."""
    x = img.astype(np.float64) + 1e-6
    ref = np.asarray(rgb, np.float64)
    cos = (x @ ref) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(ref))
    return (cos > 0.995) & (x.sum(-1) > 60)


@needs_warp
def test_rendered_frames_show_the_same_objects_in_the_same_places():
    """Both cameras, both backends: every coloured entity is visible where the other backend
    shows it (mask centroids within 1.5 px, masks overlapping), also after a few steps."""
    n = 2
    warp, cpu = _pair("pick", n, obs_mode="rgb", width=64, height=64,
                      cameras=("agentview", "wrist"))  # fmt: skip
    bw, _ = _reset(warp, _indexed(n))
    bc, _ = _reset(cpu, _indexed(n))
    for _ in range(2):
        a = np.tile([[0.5, 0.3, -0.8, 0.0, -1.0]], (n, 1)).astype(np.float32)
        bw, *_ = warp.step(a)
        bc, *_ = cpu.step(a)
    assert set(bw.images) == {"agentview", "wrist"}
    compared = 0
    for cam, imgs in bw.images.items():
        assert isinstance(imgs, torch.Tensor) and imgs.dtype == torch.uint8
        assert imgs.shape == (n, 64, 64, 3)
        for i in range(n):
            for name in warp.layouts[i].colours["blocks"]:
                mw = _colour_mask(imgs[i].numpy(), COLOURS[name])
                mc = _colour_mask(bc.images[cam][i], COLOURS[name])
                if mc.sum() < 6:  # out of view on the CPU frame
                    assert mw.sum() < 12
                    continue
                assert mw.sum() >= 6, f"{name} block missing from the warp {cam} frame {i}"
                cw, cc = np.argwhere(mw).mean(0), np.argwhere(mc).mean(0)
                assert np.abs(cw - cc).max() < 1.5, (cam, i, name, cw, cc)
                assert (mw & mc).sum() / (mw | mc).sum() > 0.5
                compared += 1
    assert compared >= 6
    cpu.close()


@needs_warp
def test_masked_reset_and_restore_leave_the_other_worlds_alone():
    """A masked reset of world 0 does not move world 1 (it continues bit for bit as without the
    reset); a snapshot restored into a fresh env continues exactly; a blow-up in one world
    truncates that world only and restores its initial state."""
    from perceptrl.sim.mjwarp import WarpEnv

    kw = dict(obs_mode="state")
    a_env, b_env = (WarpEnv(ENV_IDS["pick"], 2, device="cpu", **kw) for _ in range(2))
    for e in (a_env, b_env):
        _reset(e, _indexed(2))
    initial = a_env.get_state()[1]["env"]["physics"]  # world 1's episode-initial state
    act = np.tile([[0.4, -0.2, -0.6, 0.2, -1.0]], (2, 1)).astype(np.float32)
    for e in (a_env, b_env):
        e.step(act)
    snap = a_env.get_state()
    _reset(a_env, _indexed(2, trial=9), mask=[True, False])
    ba, *_ = a_env.step(act)
    bb, *_ = b_env.step(act)
    np.testing.assert_array_equal(ba.objects[1], bb.objects[1])
    np.testing.assert_array_equal(ba.proprio[1], bb.proprio[1])
    assert not np.allclose(ba.objects[0], bb.objects[0])

    c_env = WarpEnv(ENV_IDS["pick"], 2, device="cpu", **kw)
    _reset(c_env, [None, None])
    c_env.set_state(snap)
    bc, *_ = c_env.step(act)
    np.testing.assert_array_equal(bc.objects, bb.objects)
    np.testing.assert_array_equal(bc.proprio, bb.proprio)
    assert c_env.layouts[0].instruction == b_env.layouts[0].instruction

    a_env.t_qvel[1, 0] = float("nan")
    out, rew, term, trunc, info = a_env.step(act)
    assert info["sim_unstable"].tolist() == [False, True] and trunc[1] and not trunc[0]
    assert rew[1] == 0.0 and np.isfinite(out.objects).all()
    assert a_env.unstable_count.tolist() == [0, 1]
    np.testing.assert_allclose(a_env.get_state()[1]["env"]["physics"], initial, atol=1e-6)


@needs_warp
def test_ppo_recipe_on_warp_collects_on_device_tensors_and_updates(tmp_path):
    """The shipped warp recipe (pixels, two cameras, asymmetric critic) runs a PPO step on warp's
    CPU device and evaluates; its images reach the policy as tensors."""
    from pathlib import Path

    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config(
        configs / "vla_ppo_reach_warp.yaml",
        ["env.num_envs=2", "env.steps_per_rollout=4", "env.eval_episodes=2", "env.eval_videos=0",
         "env.max_episode_steps=6", "env.device=cpu", "vla.channels=[8, 16, 16]",
         "vla.hidden=32", "train.steps=1", "train.time_limit_min=0", "log.tensorboard=false",
         "log.progress=false", "train.device=cpu"],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.fit()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    images = trainer.source.runner.batch.images
    assert list(images) == ["agentview", "wrist"]
    assert all(isinstance(v, torch.Tensor) for v in images.values())
    import json

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in lines if "actor/pg_loss" in m)
    assert np.isfinite(step["actor/pg_loss"]) and step["rollout/env_steps"] == 8
    from perceptrl.vla.evaluate import write_report

    rec = write_report(trainer.policy, cfg.env, tmp_path / "eval")
    assert rec["tasks"][0]["episodes"] == 2
    trainer.source.close()


@needs_warp
def test_behaviour_cloning_sees_the_same_demonstrations_on_both_backends(tmp_path):
    """`perceptrl sft` on the VLA side reads the warp worlds through the experts' views: the
    same seed gives the same BC losses on both backends (the demonstrations agree to float32
    rounding, so the losses do to 1e-4)."""
    from pathlib import Path

    from perceptrl.vla.builder import run_sft
    from perceptrl.wiring import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    losses = {}
    for backend in ("warp", "mujoco"):
        cfg = load_config(
            configs / "vla_bc_pick.yaml",
            ["env.id=perceptrl/Reach-v0", "env.num_envs=2", "env.steps_per_rollout=8",
             "env.eval_episodes=0", "train.steps=3", f"env.backend={backend}", "env.device=cpu",
             "log.tensorboard=false", "log.progress=false", "train.device=cpu"],
        )  # fmt: skip
        run_sft(cfg, tmp_path / backend)
        import json

        lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
        losses[backend] = [json.loads(x)["sft/loss"] for x in lines if '"sft/loss"' in x]
    assert len(losses["warp"]) == 3
    np.testing.assert_allclose(losses["warp"], losses["mujoco"], rtol=1e-4, atol=1e-4)


@needs_warp
def test_grpo_tree_branches_from_warp_snapshots(tmp_path):
    """A VLA GRPO tree on the warp backend: episodes branch from snapshots of warp worlds
    restored into other worlds (`WarpEnv.get_state` / `set_state` through the runner)."""
    from pathlib import Path

    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config(
        configs / "vla_grpo.yaml",
        ["env.id=perceptrl/Reach-v0", "env.max_episode_steps=8", "env.num_envs=4",
         "env.backend=warp", "env.device=cpu", "env.eval_episodes=0",
         "rollout.prompts_per_step=1", "rollout.group_size=4", "rollout.tree.branches=[4]",
         "rollout.tree.segment_tokens=4", "algo.adv_estimator=treepo",
         "algo.dynamic_sampling=false", "train.steps=1", "log.tensorboard=false",
         "log.progress=false", "train.device=cpu"],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    trainer.fit()
    assert trainer.step == 1
    import json

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "rollout/episodes" in r)
    assert step["rollout/episodes"] == 4 and step["rollout/sim_unstable"] == 0
    trainer.source.close()
