"""``perceptrl sim demo``: an MP4 of the scripted expert on every task (agent view | wrist view).

Usage from Python: ``main("out/sim_demo")``; as a script: ``python -m perceptrl.sim.showcase OUT``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gymnasium as gym
import numpy as np

from . import ENV_IDS
from .demonstrations import annotate, write_video
from .expert import ScriptedExpert


def demo_task(
    task: str, out_path: str | Path, seed: int = 0, size: int = 224, episodes: int = 1
) -> dict:
    """Write ``episodes`` expert episodes of ``task`` to one MP4; returns per-episode results."""
    env = gym.make(ENV_IDS[task], width=size, height=size)
    frames, results = [], []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        expert = ScriptedExpert(env)
        success = False
        for _ in range(env.spec.max_episode_steps):
            pair = np.concatenate([obs["agentview"], obs["wrist"]], axis=1)  # (H, 2W, 3)
            frames.append(annotate(pair, bottom=obs["instruction"]))
            obs, _, term, trunc, info = env.step(expert.act(obs))
            success = success or info["success"]
            if term or trunc:
                break
        pair = np.concatenate([obs["agentview"], obs["wrist"]], axis=1)
        frames += [
            annotate(pair, bottom=obs["instruction"] + (" - done" if success else " - failed"))
        ] * 5
        results.append({"seed": seed + k, "success": bool(success)})
    write_video(out_path, frames, int(env.metadata["render_fps"]))
    env.close()
    return {"task": task, "video": str(out_path), "episodes": results}


def main(
    out_dir: str | Path,
    tasks: list[str] | None = None,
    seed: int = 0,
    size: int = 224,
    episodes: int = 1,
) -> list[dict]:
    """Write ``<out_dir>/<task>.mp4`` for every task (default: all registered ones).

    Args:
        out_dir: folder to create.
        tasks: task names (``sim.TASKS`` keys); None for all.
        seed: reset seed of the first episode (episode k uses ``seed + k``).
        size: camera resolution (square), 64 to 224.
        episodes: episodes per video.

    Returns:
        One dict per task: ``task``, ``video`` path, ``episodes`` [{seed, success}].
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = tasks or list(ENV_IDS)
    unknown = [t for t in names if t not in ENV_IDS]
    if unknown:
        raise KeyError(f"unknown task(s) {unknown}; registered: {sorted(ENV_IDS)}")
    results = [demo_task(t, out / f"{t}.mp4", seed, size, episodes) for t in names]
    for r in results:
        ok = sum(e["success"] for e in r["episodes"])
        print(f"{r['task']:>6}: {ok}/{len(r['episodes'])} successful -> {r['video']}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tasks", nargs="*", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--episodes", type=int, default=1)
    a = parser.parse_args()
    main(a.out_dir, a.tasks, a.seed, a.size, a.episodes)
