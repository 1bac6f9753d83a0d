"""Behaviour cloning from a LeRobot dataset on disk (``bc.dataset``, `vla.bc_dataset`) and the
evaluation's export of its episodes as one."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gymnasium import spaces  # noqa: E402

from perceptrl.cli import main  # noqa: E402
from perceptrl.errors import DataError  # noqa: E402
from perceptrl.sim.lerobot_format import DatasetReader, DatasetWriter  # noqa: E402
from perceptrl.trainer.metrics import read_metrics  # noqa: E402
from perceptrl.vla.bc_dataset import DatasetSource  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CAM = "observation.images.agentview"
QUIET = ["log.progress=false", "log.tensorboard=false", "train.device=cpu"]


def _dataset(root: Path, lengths=(6, 3, 9), action_dim=5, codec_size=16) -> None:
    """Frame k of the dataset (over all episodes): grey level 11 k + 20, proprio [k, episode,
    0...], action [k, 2k, episode, 0...]; task "reach <episode % 2>"."""
    features = {
        CAM: {"dtype": "video", "shape": [codec_size, codec_size, 3], "names": None},
        "observation.state": {"dtype": "float32", "shape": [8], "names": None},
        "action": {"dtype": "float32", "shape": [action_dim], "names": None},
    }
    w, k = DatasetWriter(root, 20, features), 0
    for e, n in enumerate(lengths):
        idx = np.arange(k, k + n)
        level = (11 * idx + 20).astype(np.uint8)[:, None, None, None]
        state, action = np.zeros((n, 8), np.float32), np.zeros((n, action_dim), np.float32)
        state[:, 0], state[:, 1] = idx, e
        action[:, 0], action[:, 1], action[:, 2] = idx, 2 * idx, e
        frames = np.broadcast_to(level, (n, codec_size, codec_size, 3))
        w.add_episode({CAM: frames, "observation.state": state, "action": action}, f"reach {e % 2}")
        k += n
    w.finalize()


class Observer:
    """A policy's ``observe``: the proprio and camera images as they arrive."""

    def observe(self, batch):
        return {"proprio": torch.as_tensor(batch.proprio),
                "image": torch.as_tensor(np.concatenate(list(batch.images.values()), -1)),
                "task": [torch.tensor(len(t)) for t in batch.instructions]}  # fmt: skip


def _spaces(size=8, action_dim=5, objects=0):
    obs = {"agentview": spaces.Box(0, 255, (size, size, 3), np.uint8),
           "proprio": spaces.Box(-9, 9, (8,), np.float32)}  # fmt: skip
    if objects:
        obs["objects"] = spaces.Box(-9, 9, (objects,), np.float32)
    return {"observation": spaces.Dict(obs), "action": spaces.Box(-1, 1, (action_dim,))}


@pytest.mark.parametrize("chunk", [1, 3])
def test_targets_are_the_next_recorded_actions(tmp_path, chunk):
    """Against a plain loop over the episodes: each valid step's target is the episode's next K
    actions (the last repeated past its end), its inputs the frame's own observation."""
    _dataset(tmp_path / "d")
    src = DatasetSource(Observer(), tmp_path / "d", _spaces(), {}, rows=6, steps=4, chunk=chunk)
    actions = [DatasetReader(tmp_path / "d").columns(e)["action"] for e in range(3)]
    seen = set()
    for step in range(12):
        batch = src.next_batch(step)
        assert batch.tokens.shape[2] == chunk * 5 and batch.mask.shape == batch.tokens.shape[:2]
        for b in range(len(batch.mask)):
            n = int(batch.mask[b].sum())
            proprio, image = batch.inputs["proprio"][b], batch.inputs["image"][b]
            assert len(proprio) == len(image) == n >= 1
            e, k0 = int(proprio[0, 1]), int(proprio[0, 0])
            first = k0 - sum(len(a) for a in actions[:e])  # the window's first frame
            for t in range(n):
                want = [actions[e][min(first + t + j, len(actions[e]) - 1)] for j in range(chunk)]
                assert torch.equal(batch.tokens[b, t], torch.from_numpy(np.concatenate(want)))
                assert abs(float(image[t].float().mean()) - (11 * (k0 + t) + 20)) < 5
                seen.add(k0 + t)
            assert int(batch.inputs["task"][b][0]) == len(f"reach {e % 2}")
    assert seen == set(range(18))  # every frame drawn
    again = src.next_batch(5)  # a pure function of the step: a resumed run sees the same data
    assert torch.equal(again.tokens, src.next_batch(5).tokens)
    assert not torch.equal(src.next_batch(6).tokens[:1], again.tokens[:1])


def test_malformed_datasets_are_named_data_errors(tmp_path):
    with pytest.raises(DataError, match="meta/info.json is missing"):
        DatasetSource(Observer(), tmp_path, _spaces(), {}, rows=2, steps=4)
    _dataset(tmp_path / "d")
    with pytest.raises(DataError, match=r"'observation.images.front'.*bc.features.agentview"):
        DatasetSource(Observer(), tmp_path / "d", _spaces(),
                      {"agentview": "observation.images.front"}, rows=2, steps=4)  # fmt: skip
    with pytest.raises(DataError, match=r"shape \[5\], and the env's action has shape \[4\]"):
        DatasetSource(Observer(), tmp_path / "d", _spaces(action_dim=4), {}, rows=2, steps=4)
    with pytest.raises(DataError, match="environment_state.*privileged_state"):
        DatasetSource(Observer(), tmp_path / "d", _spaces(objects=21), {}, rows=2, steps=4)
    with pytest.raises(DataError, match="three-channel video"):
        DatasetSource(Observer(), tmp_path / "d", _spaces(),
                      {"agentview": "observation.state"}, rows=2, steps=4)  # fmt: skip
    video = tmp_path / "d/videos" / CAM / "chunk-000/file-000.mp4"
    video.write_bytes(b"not a video")  # caught when the source is built, not mid-run
    with pytest.raises(DataError, match="file-000.mp4.*re-encode"):
        DatasetSource(Observer(), tmp_path / "d", _spaces(), {}, rows=2, steps=4)


def test_perceptrl_sft_clones_a_recorded_dataset(tmp_path, capsys):
    """`perceptrl sim record` writes a dataset, `perceptrl sft` with bc.dataset clones it: finite
    losses, the weights move from their seeded start; a dataset that does not fit ends the
    command with a data error (exit status 3)."""
    from perceptrl.trainer.runtime import seed_everything
    from perceptrl.vla.builder import build_policy
    from perceptrl.vla.compact import CompactVLA
    from perceptrl.vla.envs import make_envs
    from perceptrl.vla.run_plan import resolve
    from perceptrl.wiring import load_config

    data = tmp_path / "reach"
    record = ["sim", "record", "--task", "reach", "--episodes", "2", "--size", "32"]
    assert main([*record, "--cameras", "agentview", "--out", str(data)]) == 0
    assert DatasetReader(data).video_keys == [CAM] and len(DatasetReader(data)) == 2
    assert main([*record, "--task", "rech", "--out", str(tmp_path / "x")]) == 2
    args = ["vla_ppo_reach", "env.cameras=[agentview]", "env.image_size=24",
            "env.privileged_state=false", "vla.critic=shared", "vla.aux=none",
            "vla.channels=[4,8,8]", "vla.hidden=32", "env.num_envs=2", "env.steps_per_rollout=8",
            "env.action_chunk=2", "env.eval_episodes=0", "train.steps=3", "checkpoint.every=3",
            f"bc.dataset={data}", *QUIET]  # fmt: skip
    assert main(["sft", *args, "--run-dir", str(tmp_path / "run")]) == 0
    losses = [
        r["sft/loss"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "sft/loss" in r
    ]
    assert len(losses) == 3 and all(np.isfinite(losses))
    cfg = load_config(CONFIGS / f"{args[0]}.yaml", args[1:])
    plan = resolve(cfg)
    seed_everything(plan.seed)  # as run_sft: the same initial weights
    start = build_policy(plan.policy, make_envs(plan.env, seed=plan.seed))
    trained = CompactVLA.from_pretrained(tmp_path / "run/checkpoints/step_000003/model")
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), trained.parameters()))

    capsys.readouterr()
    rc = main(["sft", *args[:-4], "env.cameras=[wrist]", *QUIET, f"bc.dataset={data}",
               "--run-dir", str(tmp_path / "bad")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 3 and "observation.images.wrist" in err and "Traceback" not in err, err


def test_eval_exports_its_episodes_as_a_dataset(tmp_path):
    """env.eval_dataset: the evaluation's first episodes per task, replayed with the policy's
    deterministic actions, as a LeRobot dataset beside the report."""
    from perceptrl.vla.builder import build_policy
    from perceptrl.vla.envs import make_envs
    from perceptrl.vla.evaluate import write_report
    from perceptrl.vla.run_plan import resolve
    from perceptrl.wiring import load_config

    cfg = load_config(CONFIGS / "vla_ppo_reach_state.yaml", ["env.eval_episodes=2", "env.eval_videos=0",
                      "env.eval_dataset=2", "env.max_episode_steps=6", "env.num_envs=1",
                      "vla.hidden=16", "env.action_chunk=2"])  # fmt: skip
    plan = resolve(cfg)
    policy = build_policy(plan.policy, make_envs(plan.env))
    rec = write_report(policy, cfg.env, tmp_path)
    root = Path(rec["datasets"]["Reach"])
    assert root == tmp_path / "datasets" / "Reach"
    data = DatasetReader(root)
    assert [e["seed"] for e in data.episodes] == [1_000_000, 1_000_001]
    assert all(e["length"] == 6 for e in data.episodes)  # the time limit, in env steps
    cols = data.columns(0)
    assert cols["observation.environment_state"].shape == (6, 21)
    assert np.abs(cols["action"]).max() <= 1.0 and data.video_keys == []
    assert json.loads((tmp_path / "eval.json").read_text())["datasets"] == rec["datasets"]
