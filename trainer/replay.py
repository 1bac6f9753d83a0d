"""`ReplayBuffer`: off-policy experience in fixed preallocated tensors, sampled uniformly with
n-step returns.

Layout (CleanRL's ``[num_steps, num_envs]`` buffers, made circular): ``C`` rows of ``N`` envs.
Row ``r`` of env ``i`` holds the observation the env was in, the action taken there, the reward
it got and whether the episode terminated (a true end: no bootstrap) or ended otherwise (a time
limit: bootstrap from the final observation). Each observation is stored once (a frame is an
image, so a transition does not store its next observation again): the next observation of row
``r`` is row ``r + 1``'s, except when the episode ended at ``r``; then the env's next row starts
a new episode, and the final observation is kept in a small side store (``final_*``) only where
it is needed, for episodes that ended without terminating.

`add` writes one row: the observations acted in, the actions, rewards and end flags, and the
final observations of the envs whose episode was cut. A transition is sampled only once its next
observation is in the buffer (the newest row's continuing episodes wait for the next row). `state_dict` / `load_state_dict` hold everything (tensors,
pointers, the sampling generator's state), so a run resumed from a checkpoint samples the same
minibatches as the uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Transitions:
    """A sampled minibatch of M transitions (what an off-policy loss reads)."""

    obs: dict[str, Tensor]
    """key -> [M, ...] the observation acted in"""
    action: Tensor
    """[M, X] the action taken"""
    reward: Tensor
    """[M] the discounted sum of the n rewards (or fewer, up to an episode end)"""
    discount: Tensor
    """[M] gamma^n, or 0 after a terminal state (no bootstrap)"""
    next_obs: dict[str, Tensor]
    """key -> [M, ...] the observation n steps on (or the final one of an ended episode)"""
    demo: Tensor
    """[M] bool: drawn from the demonstrations"""

    def to(self, device) -> Transitions:
        move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
        return Transitions(
            move(self.obs), self.action.to(device), self.reward.to(device),
            self.discount.to(device), move(self.next_obs), self.demo.to(device),
        )  # fmt: skip

    @staticmethod
    def cat(parts: list[Transitions]) -> Transitions:
        cat = lambda xs: torch.cat(xs)  # noqa: E731
        keys = parts[0].obs.keys()
        return Transitions(
            {k: cat([p.obs[k] for p in parts]) for k in keys}, cat([p.action for p in parts]),
            cat([p.reward for p in parts]), cat([p.discount for p in parts]),
            {k: cat([p.next_obs[k] for p in parts]) for k in keys}, cat([p.demo for p in parts]),
        )  # fmt: skip


class ReplayBuffer:
    """``rows`` x ``envs`` transitions; see the module docstring.

    Args:
        rows: C, rows kept (capacity ``C * N`` transitions).
        envs: N, envs writing one transition each per row.
        obs: an example observation: key -> [N, ...] tensor (shapes and dtypes).
        action_dim: X, numbers per action.
        seed: the sampling generator's seed.
        demo: the buffer holds demonstrations (its samples are flagged ``demo``).
    """

    def __init__(self, rows: int, envs: int, obs: dict[str, Tensor], action_dim: int,
                 seed: int = 0, demo: bool = False):  # fmt: skip
        if rows < 2:
            raise ValueError(f"a replay buffer needs at least 2 rows, got {rows}")
        self.C, self.N, self.is_demo = rows, envs, demo
        C, N = rows, envs
        self.obs = {k: torch.zeros(C, N, *v.shape[1:], dtype=v.dtype) for k, v in obs.items()}
        self.action = torch.zeros(C, N, action_dim)
        self.reward = torch.zeros(C, N)
        self.terminated = torch.zeros(C, N, dtype=torch.bool)
        self.ended = torch.zeros(C, N, dtype=torch.bool)
        self.acted = torch.zeros(C, N, dtype=torch.bool)
        """the row's action was taken (False: idle envs, or the newest row)"""
        # final observations of episodes cut without terminating, at most one per env per row
        self.F = max(N, C * N // 4)
        self.final = {k: torch.zeros(self.F, *v.shape[1:], dtype=v.dtype) for k, v in obs.items()}
        self.final_at = torch.full((C, N), -1, dtype=torch.long)
        self.final_ptr = 0
        self.ptr = 0  # the row the next `add` writes
        self.gen = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------ writing
    def add(self, obs: dict[str, Tensor], action: Tensor, reward: Tensor, terminated: Tensor,
            ended: Tensor, final_obs: dict[str, Tensor] | None = None,
            acted: Tensor | None = None) -> None:  # fmt: skip
        """One row: every env's step from ``obs``.

        Args:
            obs: key -> [N, ...] the observations acted in.
            action: [N, X]; reward: [N]; terminated, ended: [N] bool (ended: the episode is
                over, by termination or a time limit; terminated implies ended).
            final_obs: key -> [N, ...] the observations after the step; read only for the
                episodes that ended without terminating (their next observation is not the
                next row's). None when no episode was cut.
            acted: [N] bool, the envs whose step is a transition (default all; False for
                idle envs and for steps a physics blow-up undid).
        """
        r = self.ptr
        acted = torch.ones(self.N, dtype=torch.bool) if acted is None else acted.bool().cpu()
        for k, v in obs.items():
            self.obs[k][r] = v.to(self.obs[k].dtype)
        self.action[r], self.reward[r] = action.float().cpu(), reward.float().cpu()
        terminated = terminated.bool().cpu()
        self.terminated[r], self.ended[r] = terminated, ended.bool().cpu() | terminated
        self.acted[r], self.final_at[r] = acted, -1
        cut = (self.ended[r] & ~self.terminated[r] & acted).nonzero().flatten()
        if len(cut):
            if final_obs is None:
                raise ValueError("episodes were cut without their final observations")
            slots = (self.final_ptr + torch.arange(len(cut))) % self.F
            # an older transition whose final observation this overwrites is sampled no more
            stale = torch.isin(self.final_at, slots)
            self.acted[stale], self.final_at[stale] = False, -1
            for k, v in final_obs.items():
                self.final[k][slots] = v[cut].to(self.final[k].dtype)
            self.final_at[r, cut] = slots
            self.final_ptr = int((self.final_ptr + len(cut)) % self.F)
        self.ptr = (r + 1) % self.C

    def drop_newest(self) -> None:
        """Forget the newest row's transitions (their next observations will never come: the
        envs were restarted)."""
        self.acted[(self.ptr - 1) % self.C] = False

    # ------------------------------------------------------------------ sampling
    def _sampleable(self) -> Tensor:
        """[C, N] bool: the transitions whose next observation is stored (every acted row but
        the newest, whose episodes continue into a row not written yet, unless they ended)."""
        ok = self.acted.clone()
        newest = (self.ptr - 1) % self.C
        ok[newest] &= self.ended[newest]
        return ok

    def ready(self) -> int:
        """Transitions that can be sampled."""
        return int(self._sampleable().sum())

    def sample(self, m: int, gamma: float, n_step: int = 1) -> Transitions:
        """``m`` transitions drawn uniformly (with replacement) from those stored, with their
        ``n_step`` returns: rewards summed along the env's row until n steps or the episode's
        end; the bootstrap observation is the one n rows on, or the final one of an episode cut
        inside the window."""
        ok = self._sampleable()
        flat = ok.flatten().nonzero().flatten()
        if len(flat) == 0:
            raise ValueError("sampling from a replay buffer with no complete transition")
        pick = flat[torch.randint(len(flat), (m,), generator=self.gen)]
        rows, envs = pick // self.N, pick % self.N
        reward = torch.zeros(m)
        discount = torch.ones(m)
        alive = torch.ones(m, dtype=torch.bool)  # the window has not ended yet
        last = rows.clone()  # the row whose next observation bootstraps
        for j in range(n_step):
            r = (rows + j) % self.C
            step = alive & ok[r, envs] if j else alive
            reward += torch.where(step, discount * self.reward[r, envs], 0.0)
            last = torch.where(step, r, last)
            discount = torch.where(step, discount * gamma, discount)
            alive = step & ~self.ended[r, envs]
        term = self.terminated[last, envs]
        discount = torch.where(term, torch.zeros_like(discount), discount)
        nxt = (last + 1) % self.C
        final = self.final_at[last, envs]
        use = final >= 0  # cut inside the window: its final observation
        obs = {k: v[rows, envs] for k, v in self.obs.items()}
        next_obs = {}
        for k, v in self.obs.items():
            x = v[nxt, envs]
            if use.any():
                x = x.clone()
                x[use] = self.final[k][final[use]]
            next_obs[k] = x
        demo = torch.full((m,), self.is_demo)
        return Transitions(obs, self.action[rows, envs], reward, discount, next_obs, demo)

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        """Memory of the buffer's tensors, in bytes."""
        tensors = [*self.obs.values(), *self.final.values(), self.action, self.reward,
                   self.terminated, self.ended, self.acted, self.final_at]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        return {
            "obs": self.obs, "final": self.final, "action": self.action, "reward": self.reward,
            "terminated": self.terminated, "ended": self.ended, "acted": self.acted,
            "final_at": self.final_at, "final_ptr": self.final_ptr, "ptr": self.ptr,
            "gen": self.gen.get_state(), "demo": self.is_demo,
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: dict, seed: int = 0) -> ReplayBuffer:
        """The buffer a `state_dict` describes (its shapes), holding that state."""
        C, N = state["reward"].shape
        example = {k: v[0] for k, v in state["obs"].items()}  # key -> [N, ...]
        buf = cls(C, N, example, state["action"].shape[-1], seed=seed, demo=state["demo"])
        buf.load_state_dict(state)
        return buf

    def load_state_dict(self, state: dict) -> None:
        for key in ("action", "reward", "terminated", "ended", "acted", "final_at"):
            getattr(self, key).copy_(state[key])
        for store in ("obs", "final"):
            for k, v in getattr(self, store).items():
                v.copy_(state[store][k])
        self.final_ptr, self.ptr = int(state["final_ptr"]), int(state["ptr"])
        self.gen.set_state(state["gen"])
