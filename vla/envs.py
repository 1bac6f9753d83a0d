"""The VLA side's envs: the recipe's ``env`` section built as the sim's one vector-env layer.

`make_envs` turns the section into a `sim.vector.VecEnv` (masked resets, action chunks, NaN
no-ops, worker restarts, snapshots; CPU MuJoCo or the MJWarp backend); `env_kwargs` is the
section as the options of one env (`sim.focus.make_env`, ``gymnasium.make``).
"""

from __future__ import annotations

from ..sim.backends import MUJOCO_ONLY
from ..sim.vector import VecEnv
from .config import EnvConfig


def env_kwargs(cfg: EnvConfig) -> dict:
    """Keyword arguments of `sim.focus.make_env` for the recipe's env section."""
    kw = dict(
        obs_mode=cfg.obs_mode, control=cfg.control, reward_mode=cfg.reward_mode,
        terminate_on_success=cfg.terminate_on_success,
        width=cfg.image_size, height=cfg.image_size, cameras=tuple(cfg.cameras),
        privileged_state=cfg.privileged_state,
    )  # fmt: skip
    for name in MUJOCO_ONLY:  # only when set: the warp env refuses them
        if getattr(cfg, name):
            kw[name] = True
    if cfg.wording != "train":  # only when set: the warp env has no wording
        kw["wording"] = cfg.wording
    if cfg.max_episode_steps > 0:
        kw["max_episode_steps"] = cfg.max_episode_steps
    return kw


def make_envs(cfg: EnvConfig, seed: int = 0, env_id: str | None = None) -> VecEnv:
    """``cfg.num_envs`` envs of ``env_id`` (default ``cfg.id``) on the recipe's backend; the
    first reset seeds env i with ``seed + i``."""
    return VecEnv(
        env_id or cfg.id, cfg.num_envs, seed=seed, backend=cfg.backend, async_=cfg.async_envs,
        device=cfg.device, **env_kwargs(cfg),
    )  # fmt: skip
