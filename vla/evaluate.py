"""Held-out evaluation of a VLA policy: success rate per task over fixed seeds.

Episode ``j`` of a task is reset with seed ``env.eval_seed + j`` (training resets never use
that range), actions are deterministic (the Gaussian mean / greedy tokens). ``write_report``
adds a JSON + Markdown table and one mp4 per task (the first ``env.eval_videos`` episodes,
rendered from the agent-view camera, replayed with the same seeds) and, with
``env.eval_dataset``, the first episodes of each task as a LeRobot dataset (`export_episodes`).
An episode cut by a physics blow-up counts with what it achieved before it
(``sim_unstable/<task>``: their share; a warning names the task).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from ..sim.focus import make_env
from ..sim.vector import VecEnv
from .config import EnvConfig
from .envs import env_kwargs, make_envs
from .episode_runner import Actor, EpisodeRunner, EpisodeSpecs

log = logging.getLogger(__name__)


def run_seeded(policy, runner: VecEnv, seeds: list[int], deterministic: bool = True) -> dict:
    """Run one episode per seed, ``runner.n`` at a time, with the policy's mean / greedy
    actions (``deterministic``) or sampled ones. Returns per-episode lists ``success`` (the
    runner's `episode_success` rule), ``return``, ``length`` (env steps) and ``unstable`` (cut
    by a physics blow-up), in seed order."""
    act = lambda obs: policy.act(obs, deterministic=deterministic)  # noqa: E731
    loop = EpisodeRunner(runner, rows=False)
    ep = loop.episodes(Actor.of(policy, act), EpisodeSpecs.seeded(seeds)).episodes
    keys = ("success", "return", "length", "unstable")
    out = {k: [0.0] * len(seeds) for k in keys}
    for j, *values in zip(ep.spec.tolist(), ep.success.tolist(), ep.ret.tolist(),
                          ep.length.tolist(), ep.unstable.tolist()):  # fmt: skip
        for k, v in zip(keys, values):
            out[k][j] = float(v)
    return out


def evaluate_policy(
    policy, env_cfg: EnvConfig, episodes: int | None = None, deterministic: bool = True
) -> dict[str, float]:
    """Success rate per task (``env.eval_tasks``, default ``env.id``) over ``episodes`` held-out
    seeds, with the policy's mean actions (``deterministic``) or sampled ones, in the wording of
    ``env.wording`` and then of each of ``env.eval_wordings`` (the same seeds, so the same
    scenes). Returns flat metrics ``success/<task>``, ``return/<task>``, ``length/<task>``,
    ``sim_unstable/<task>`` (share of episodes cut by a physics blow-up), the same with
    ``<task>@<wording>`` for the held-out wordings, and ``success_rate`` (mean over tasks in
    ``env.wording``)."""
    n = episodes or env_cfg.eval_episodes
    seeds = [env_cfg.eval_seed + j for j in range(n)]
    metrics: dict[str, float] = {}
    runs = [
        (e, w) for e in env_cfg.eval_tasks or [env_cfg.id] for w in ["", *env_cfg.eval_wordings]
    ]
    for env_id, wording in runs:
        cfg = dataclasses.replace(
            env_cfg, num_envs=min(env_cfg.num_envs, n), async_envs=False,
            wording=wording or env_cfg.wording,
        )  # fmt: skip
        runner = make_envs(cfg, env_id=env_id)
        try:
            res = run_seeded(policy, runner, seeds, deterministic=deterministic)
        finally:
            runner.close()
        name = metric_name(env_id, wording)
        for k in ("success", "return", "length"):
            metrics[f"{k}/{name}"] = float(np.mean(res[k]))
        metrics[f"sim_unstable/{name}"] = float(np.mean(res["unstable"]))
        if any(res["unstable"]):
            log.warning(
                "evaluation on %s: %d of %d episodes ended in a physics blow-up (counted with "
                "what they achieved before it)", env_id, int(sum(res["unstable"])), n,
            )  # fmt: skip
    succ = [v for k, v in metrics.items() if k.startswith("success/") and "@" not in k]
    metrics["success_rate"] = float(np.mean(succ))
    return metrics


def metric_name(env_id: str, wording: str = "") -> str:
    """The name a task's evaluation is logged under: ``Reach``, or ``Reach@paraphrase`` for a
    held-out wording (empty: the run's own ``env.wording``)."""
    return task_name(env_id) + (f"@{wording}" if wording else "")


def task_name(env_id: str) -> str:
    """``perceptrl/PickClutter-v0`` -> ``PickClutter``."""
    return env_id.split("/")[-1].rsplit("-v", 1)[0]


VIDEO_SIZE = 256
"""side in pixels of evaluation videos, whatever the policy's observation size"""


def record_video(
    policy, env_cfg: EnvConfig, env_id: str, seeds: list[int], path: Path, size: int = VIDEO_SIZE
) -> Path:
    """Replay ``seeds`` with deterministic actions; write the agent view at ``size`` pixels to
    ``path``, with the instruction, the env step and the outcome drawn on the frames."""
    return compare_video({"": policy}, env_cfg, env_id, seeds, path, size)


def compare_video(
    policies: dict, env_cfg: EnvConfig, env_id: str, seeds: list[int], path: Path,
    size: int = VIDEO_SIZE,
) -> Path:  # fmt: skip
    """The episodes of ``seeds`` played by each policy (name -> policy, e.g. before / after
    training) side by side, one panel per policy labelled with its name; a panel whose episode
    ended holds its last frame until the longest one ends."""
    from ..sim.demonstrations import write_video

    cfg = dataclasses.replace(env_cfg, num_envs=1, async_envs=False)
    runner = make_envs(cfg, env_id=env_id)
    kw = {**env_kwargs(cfg), "obs_mode": "rgb", "width": size, "height": size}
    cam = make_env(env_id, render_mode="rgb_array", **kw)
    fps = int(cam.metadata.get("render_fps", 20))
    frames = []
    try:
        for seed in seeds:
            panels = [episode_frames(p, runner, cam, seed, name) for name, p in policies.items()]
            longest = max(len(p) for p in panels)
            for t in range(longest + fps // 2):  # half a second on the outcome
                frames.append(np.concatenate([p[min(t, len(p) - 1)] for p in panels], axis=1))
    finally:
        runner.close()
        cam.close()
    return write_video(path, frames, fps=fps)


def episode_frames(policy, runner: VecEnv, cam, seed: int, label: str = "") -> list[np.ndarray]:
    """One deterministic episode of ``seed``: the policy acts on ``runner``'s observations (the
    recipe's image size, one env) while ``cam``, an env of the same task reset with the same
    seed and sent the same actions, renders the agent view (at the video's size). Returns the
    frames with the instruction, ``label``, the env step and the outcome drawn on them."""
    from ..sim.demonstrations import annotate

    K = getattr(getattr(policy, "spec", None), "chunk", 1)
    frames, step, success = [], 0, False

    def shot() -> None:
        outcome = "success" if success else ""
        text = f"step {step}" + (f"  {outcome}" if outcome else "")
        top = [runner.batch.instructions[0]] + ([label] if label else [])
        frames.append(
            annotate(cam.render(), top, text, (80, 255, 80) if success else (255, 255, 255))
        )

    runner.reset(seeds=[seed])
    cam.reset(seed=seed)
    shot()
    done = False
    while not done:
        action, _, _ = policy.act(policy.observe(runner.batch), deterministic=True)
        if hasattr(policy, "env_action"):
            action = policy.env_action(action)
        chunk, _ = runner.sanitize(action.float().cpu().numpy().reshape(1, K, runner.action_dim))
        for a in chunk[0]:  # sanitised once: a bad chunk is counted once, not again by step
            _, _, te, tr, info = cam.step(a)
            step += 1
            success = success or bool(info.get("success", False) or te)
            shot()
            if te or tr:
                break
        res = runner.step(chunk)
        done = bool(res.terminated[0] or res.truncated[0])
    return frames


def export_episodes(
    policy, env_cfg: EnvConfig, env_id: str, seeds: list[int], root: Path
) -> Path:  # fmt: skip
    """The deterministic episodes of ``seeds`` as a LeRobot dataset at ``root``
    (`sim.demonstrations`): the observations the policy acted on (the recipe's cameras and
    image size) and the actions the env executed (chunks open-loop, clipped to [-1, 1]), with
    each episode's seed and success."""
    from ..sim.backends import Batch
    from ..sim.demonstrations import EpisodeWriter, cameras_of, record_episode

    env = make_env(env_id, **env_kwargs(env_cfg))
    cams = cameras_of(env.observation_space)

    def act(obs: dict) -> np.ndarray:  # one env's observation -> its chunk [K, A]
        batch = Batch(
            {c: obs[c][None] for c in cams}, obs["proprio"][None],
            obs["objects"][None] if "objects" in obs else None, [str(obs["instruction"])],
        )  # fmt: skip
        action, _, _ = policy.act(policy.observe(batch), deterministic=True)
        if hasattr(policy, "env_action"):
            action = policy.env_action(action)
        chunk = action.float().cpu().numpy().reshape(-1, env.action_space.shape[0])
        return np.clip(np.nan_to_num(chunk), -1.0, 1.0)

    out = EpisodeWriter(root, env)
    try:
        for seed in seeds:
            ep = record_episode(env, act, seed)
            out.add(ep, seed=seed, success=ep["success"])
        out.close()
    finally:
        env.close()
    return root


def write_report(policy, env_cfg: EnvConfig, out_dir: str | Path) -> dict:
    """Evaluate, then write ``eval.json``, ``eval.md``, ``<task>.mp4`` and (``env.eval_dataset``)
    ``datasets/<task>`` into ``out_dir``. Returns the JSON record (metrics, per-task rows,
    video and dataset paths)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = evaluate_policy(policy, env_cfg)
    rows, videos, datasets = [], {}, {}
    for env_id in env_cfg.eval_tasks or [env_cfg.id]:
        name = task_name(env_id)
        for held_out in ["", *env_cfg.eval_wordings]:
            key = metric_name(env_id, held_out)
            rows.append(
                {"task": name, "wording": held_out or env_cfg.wording,
                 "episodes": env_cfg.eval_episodes,
                 "success": metrics[f"success/{key}"], "return": metrics[f"return/{key}"],
                 "length": metrics[f"length/{key}"]}
            )  # fmt: skip
        if env_cfg.eval_videos > 0:
            seeds = [env_cfg.eval_seed + j for j in range(env_cfg.eval_videos)]
            videos[name] = str(record_video(policy, env_cfg, env_id, seeds, out / f"{name}.mp4"))
        if env_cfg.eval_dataset > 0:
            seeds = [env_cfg.eval_seed + j for j in range(env_cfg.eval_dataset)]
            datasets[name] = str(
                export_episodes(policy, env_cfg, env_id, seeds, out / "datasets" / name)
            )
    record = {"metrics": metrics, "tasks": rows, "videos": videos, "datasets": datasets,
              "eval_seed": env_cfg.eval_seed}  # fmt: skip
    (out / "eval.json").write_text(json.dumps(record, indent=1))
    lines = [
        "| task | wording | episodes | success | return | length |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['task']} | {r['wording']} | {r['episodes']} | {r['success']:.3f} | "
        f"{r['return']:.3f} | {r['length']:.1f} |"
        for r in rows
    ]
    (out / "eval.md").write_text("\n".join(lines) + "\n")
    return record
