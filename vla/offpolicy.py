"""`ReplaySource`: the VLA side's off-policy source (the trainer's ``offpolicy`` objective).

Each trainer step, `ReplaySource.collect` runs ``env.steps_per_rollout`` policy steps of every
env through the one episode loop (`EpisodeRunner.horizon`; episodes continue across steps) and
its ``on_step`` hook writes every step into the replay buffer (trainer/replay.py: observations
once per frame, actions, rewards, terminations apart from time limits, the final observation of
a cut episode). No update is made until ``replay.learning_starts`` transitions are stored;
until then the actions are uniform (SAC's warm-up: in [-1, 1], or DSRL's noise through the
flow), except in a run with demonstrations, where the policy acts from the first step (RLPD
sets ``learning_starts`` to 0 and updates from it too).

`ReplaySource.minibatches` then yields the step's updates: ``replay.utd`` per stored transition
(the fraction carried over to the next step), each ``replay.batch_size`` transitions with
``replay.n_step`` returns. With ``replay.demos`` (RLPD, Ball et al. 2023) a demonstration
buffer holds that many scripted-expert episodes, recorded once on envs of their own, and
``replay.demo_share`` of every batch comes from it. ``replay.augment=shift`` shifts the images of
every sampled observation by up to 4 pixels (DrQ, Kostrikov et al. 2021: pad by replication,
random crop), independently for the observation and the next one.

Resume: `state_dict` holds the collector's state (`vla.collect._Base`: RNG, counters, the
episodes in flight), both buffers, the sampling and augmentation generators and the update
carry, so a resumed run collects and samples exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..sim.vector import VecEnv
from ..trainer.replay import ReplayBuffer, Transitions
from .bc import Experts
from .collect import _Base
from .config import EnvConfig, ReplayConfig
from .envs import make_envs
from .episode_runner import Actor, EpisodeRunner

SHIFT = 4
"""pixels of DrQ's random shift"""
DEMO_SEED = 50_000
"""offset of the demonstration envs' seed from the training envs'"""


class ReplaySource(_Base):
    """Off-policy experience for the trainer; see the module docstring.

    Args:
        env_cfg: the env section (envs, steps per trainer step, chunk).
        replay: the replay section.
        gamma: discount per policy step (algo.gamma).
        seed: the collector's and the buffers' seeds.
        runner: the training envs (default: built from ``env_cfg``).
    """

    def __init__(self, env_cfg: EnvConfig, replay: ReplayConfig, gamma: float, seed: int = 0,
                 runner: VecEnv | None = None):  # fmt: skip
        super().__init__(env_cfg, seed, runner)
        self.cfg, self.gamma = replay, gamma
        self.loop = EpisodeRunner(
            self.runner, rows=False, chunk=env_cfg.action_chunk, on_step=self._store
        )
        self.buffer: ReplayBuffer | None = None
        self.demo: ReplayBuffer | None = None
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.stored = 0  # transitions written since the start
        self.carry = 0.0  # updates owed but not made (the fraction of utd * new transitions)
        self.new = 0  # transitions of the last collection
        self.restarts = 0
        self.rewards: list[float] = []  # this collection's reward sums per policy step
        self._observe = None

    # ------------------------------------------------------------------ collection
    def collect(self, policy, step: int) -> dict[str, float]:
        """``env.steps_per_rollout`` policy steps of every env into the buffer -> metrics."""
        t0 = time.perf_counter()
        self._observe = policy.observe
        if self.cfg.demos and self.demo is None:
            self.demo = record_demos(policy, self.env_cfg, self.cfg, self.seed)
        warmup = self.stored < self.cfg.learning_starts and not self.cfg.demos
        act = (lambda obs: policy.warmup_act(obs, self.gen)) if warmup else policy.act
        before, self.rewards = self.stored, []
        res = self.loop.horizon(
            Actor(policy.observe, act, None, getattr(policy, "env_action", None)),
            self.env_cfg.steps_per_rollout,
        )
        self.new = self.stored - before
        self._record(res.episodes)
        m = self._metrics(res.env_steps, time.perf_counter() - t0)
        m["replay/size"] = float(self.buffer.ready()) if self.buffer is not None else 0.0
        m["replay/mb"] = sum(b.nbytes() for b in (self.buffer, self.demo) if b) / 2**20
        m["replay/random_actions"] = float(warmup)
        m["reward/mean"] = sum(self.rewards) / max(self.new, 1)  # per stored transition
        return m

    def _store(self, obs: dict, action: Tensor, res, running: np.ndarray) -> None:
        """`EpisodeRunner`'s ``on_step``: one row of the buffer."""
        if self.buffer is None:
            rows = max(2, self.cfg.size // self.runner.n)
            self.buffer = ReplayBuffer(rows, self.runner.n, obs, action.shape[1], seed=self.seed)
        restarts = self.runner.counters.get("env_restarts", 0)
        if restarts != self.restarts:  # the newest row's next observations were lost
            self.buffer.drop_newest()
            self.restarts = restarts
        self.stored += _add(self.buffer, self._observe, obs, action, res, running)
        self.rewards.append(float(res.reward[running].sum()))

    # ------------------------------------------------------------------ updates
    def minibatches(self, step: int) -> Iterator[Transitions]:
        """This step's updates (none until ``learning_starts`` transitions are stored)."""
        if self.buffer is None or self.stored < max(self.cfg.learning_starts, 1):
            return
        self.carry += self.cfg.utd * self.new
        n, self.carry = int(self.carry), self.carry - int(self.carry)
        k = round(self.cfg.batch_size * self.cfg.demo_share) if self.demo is not None else 0
        for _ in range(n):
            parts = [self.buffer.sample(self.cfg.batch_size - k, self.gamma, self.cfg.n_step)]
            if k:
                parts.append(self.demo.sample(k, self.gamma, self.cfg.n_step))
            batch = Transitions.cat(parts)
            if self.cfg.augment == "shift":
                batch.obs, batch.next_obs = self._shift(batch.obs), self._shift(batch.next_obs)
            yield batch

    def _shift(self, obs: dict[str, Tensor]) -> dict[str, Tensor]:
        if "image" not in obs:
            return obs
        return {**obs, "image": random_shift(obs["image"], self.gen)}

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["replay"] = {
            "buffer": self.buffer.state_dict() if self.buffer is not None else None,
            "demo": self.demo.state_dict() if self.demo is not None else None,
            "gen": self.gen.get_state(), "stored": self.stored, "carry": self.carry,
            "new": self.new, "restarts": self.restarts,
        }  # fmt: skip
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        r = state.get("replay")
        if not r:
            return
        self.gen.set_state(r["gen"])
        self.stored, self.carry, self.new = int(r["stored"]), float(r["carry"]), int(r["new"])
        self.restarts = int(r["restarts"])
        for name in ("buffer", "demo"):
            if r[name] is not None:
                setattr(self, name, ReplayBuffer.from_state(r[name], self.seed))


def _add(buf: ReplayBuffer, observe, obs: dict, action: Tensor, res, running: np.ndarray) -> int:
    """Write one runner step into ``buf``; returns the transitions it holds."""
    acted = running & ~(res.unstable if res.unstable is not None else False)
    ended = torch.from_numpy((res.terminated | res.truncated) & running)
    cut = ended.numpy() & ~res.terminated & acted
    final = observe(res.batch) if cut.any() else None  # the ended episodes' last observations
    buf.add(
        obs, action, torch.from_numpy(res.reward), torch.from_numpy(res.terminated & running),
        ended, final, torch.from_numpy(acted),
    )  # fmt: skip
    return int(acted.sum())


def random_shift(images: Tensor, gen: torch.Generator, pad: int = SHIFT) -> Tensor:
    """DrQ's augmentation: images [M, H, W, C] uint8, each padded by ``pad`` replicated pixels
    and cropped back at a random offset."""
    M, H, W, C = images.shape
    x = F.pad(images.permute(0, 3, 1, 2).float(), (pad,) * 4, mode="replicate")
    dy = torch.randint(0, 2 * pad + 1, (M,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (M,), generator=gen)
    rows = (dy[:, None] + torch.arange(H))[:, None, :, None].expand(M, C, H, W + 2 * pad)
    x = x.gather(2, rows)
    cols = (dx[:, None] + torch.arange(W))[:, None, None, :].expand(M, C, H, W)
    return x.gather(3, cols).permute(0, 2, 3, 1).to(images.dtype)


def record_demos(policy, env_cfg: EnvConfig, cfg: ReplayConfig, seed: int) -> ReplayBuffer:
    """``cfg.demos`` scripted-expert episodes on envs of their own, as a replay buffer of the
    policy's observations (RLPD's offline data)."""
    vec = make_envs(env_cfg, seed=seed + DEMO_SEED)
    experts = Experts(vec)
    limit = vec.time_limit or 100
    rows = cfg.demos * limit // vec.n + limit + 2
    holder: dict = {}  # the buffer, made at the first step (it takes the observations' shapes)

    def store(obs, action, res, running):
        if "buf" not in holder:
            holder["buf"] = ReplayBuffer(rows, vec.n, obs, action.shape[1], seed=seed, demo=True)
        _add(holder["buf"], policy.observe, obs, action, res, running)

    loop = EpisodeRunner(vec, rows=False, on_reset=experts.reset, on_step=store)
    episodes = 0
    try:
        while episodes < cfg.demos:
            episodes += len(loop.horizon(Actor(policy.observe, experts.act), limit).episodes.spec)
    finally:
        vec.close()
    return holder["buf"]
