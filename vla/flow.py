"""`FlowVLA`: the compact VLA with a flow-matching action-chunk head (pi0-style), trainable by RL.

The encoder, instruction FiLM, trunk, critic and auxiliary head are `CompactVLA`'s; the head
generates an action chunk a (K*A = D numbers) by integrating a learned velocity field
v(x, t | h) from noise x_0 ~ N(0, I) at t = 0 to x_1 = a at t = 1 in S Euler steps
(t_k = k / S, dt = 1 / S), conditioned on the trunk features h.

**Behaviour cloning** (`sft_loss`, what ``perceptrl sft`` optimises for this head): flow
matching (Lipman et al. 2023; pi0's conditional flow): x_t = (1 - t) eps + t a with
t ~ U(0, 1), eps ~ N(0, I); loss = mean over the chunk of (v(x_t, t | h) - (a - eps))^2.

**Acting.** ``deterministic`` acting integrates the ODE x_{k+1} = x_k + dt v(x_k, t_k) from
x_0 = 0 (the noise's mode), so the deterministic policy is a function of the observation.
Sampled acting draws x_0 ~ N(0, I) and makes each Euler step a Gaussian transition, so that the
chunk's log-probability is tractable (RLinf's pi_RL, after Flow-GRPO):

* ``vla.flow_noise=sde``: the SDE with the ODE's marginals, dx = [v - (g^2 / 2) (x - t v) /
  (1 - t)] dt + g dW (the score of the linear path is -(x - t v) / (1 - t)), with the stated
  schedule g(t) = a sqrt((1 - t) / max(t, dt)), a = ``vla.flow_noise_level``; its Euler-Maruyama
  step is N(mean_k, (g(t_k) sqrt(dt))^2). With a = 0 it is the ODE step.
* ``vla.flow_noise=learned``: N(x_k + dt v, sigma_k^2) with sigma_k predicted per dimension by a
  small network on (x_k, t_k, h), bounded to ``vla.flow_noise_std`` and trained with the policy
  through the log-probabilities (pi_RL's flow-noise). Zero noise is again the ODE step.

The policy step's "tokens" are its denoising steps: the sampled chain x_0 .. x_S is what the
rollout stores (``tokens`` [B, T, (S+1)*D]; the env receives x_S, `env_action`), and the
chunk's log-probability is the sum over the S transitions (x_0's density does not depend on the
weights and is left out), recomputed by `evaluate` from the stored chain in one batched pass.
With ``vla.flow_logp=step`` (default) the policy reports the S transition log-probs [B, T, S]
and the trainer's policy loss treats each as a token (`trainer.batch.substep_tokens`: its own
ratio and clip, its position's advantage, as Flow-GRPO does); with ``chain`` it reports their
sum [B, T], one ratio per chunk as the Gaussian head has one per action. The existing losses,
estimators and aggregation apply unchanged either way. ``entropy`` is the sum of the
transitions' Gaussian entropies (the chain's conditional entropy given x_0).

A chain that is not finite (a diverging velocity field) becomes a NaN env action, which the env
runner replaces by a no-op and counts (``rollout/bad_actions``): it never reaches the physics. Its stored step then carries no
gradient: `evaluate` gives it log-probability 0 (as ``act`` recorded), from a zeroed chain, so
no NaN enters the backward pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..registry import VLA_HEADS
from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from .compact import CompactVLA, flatten_inputs

TIME_FEATURES = 16
"""sinusoidal features of the flow time t fed to the velocity and noise networks"""
HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)


def time_features(t: Tensor) -> Tensor:
    """Flow times [N] in [0, 1] -> sinusoidal features [N, TIME_FEATURES] (frequencies 1..2^7)."""
    freqs = 2.0 ** torch.arange(TIME_FEATURES // 2, device=t.device, dtype=t.dtype)
    x = math.pi * t[:, None] * freqs  # (N, F/2)
    return torch.cat([x.sin(), x.cos()], dim=-1)


def _mlp(inp: int, width: int, out: int) -> nn.Sequential:
    net = nn.Sequential(
        nn.Linear(inp, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, out)
    )
    nn.init.zeros_(net[-1].weight)
    nn.init.zeros_(net[-1].bias)
    return net


class FlowVLA(CompactVLA):
    """`CompactVLA` with the flow-matching chunk head; see the module docstring."""

    def _build_head(self, hidden: int, dim: int) -> None:
        vla = self.spec.vla
        why = vla.flow_problem()  # the recipe loader asks the same of a recipe's vla section
        if why is not None:
            raise ValueError(why)
        self.dim, self.steps = dim, vla.flow_steps
        self.velocity = _mlp(dim + TIME_FEATURES + hidden, hidden, dim)
        self.noise_net = None
        if vla.flow_noise == "learned":
            self.noise_net = _mlp(dim + TIME_FEATURES + hidden, hidden // 4, dim)

    # ------------------------------------------------------------------ the flow
    def _inputs(self, x: Tensor, t: Tensor, h: Tensor) -> Tensor:
        return torch.cat([x, time_features(t), h], dim=-1)

    def _transition(self, x: Tensor, t: Tensor, h: Tensor, noisy: bool) -> tuple[Tensor, Tensor]:
        """One Euler step from x [M, D] at times t [M] given h [M, H] -> (mean [M, D],
        std [M, D] or [M, 1]) of the next state; std 0 (the ODE step) when not ``noisy``."""
        inp = self._inputs(x, t, h)
        v = self.velocity(inp)
        dt = 1.0 / self.steps
        if not noisy:
            return x + dt * v, x.new_zeros(len(x), 1)
        if self.noise_net is not None:
            lo, hi = (math.log(s) for s in self.spec.vla.flow_noise_std)
            log_std = lo + (hi - lo) * torch.sigmoid(self.noise_net(inp))
            return x + dt * v, log_std.exp()
        a = self.spec.vla.flow_noise_level
        tc = t.clamp(min=dt)[:, None]  # (M, 1)
        g2 = a * a * (1 - t[:, None]) / tc  # g(t)^2
        mean = x + dt * (v - g2 / (2 * (1 - t[:, None])) * (x - t[:, None] * v))
        return mean, (g2 * dt).sqrt()

    def _times(self, device) -> Tensor:
        return torch.arange(self.steps, device=device, dtype=torch.float32) / self.steps

    def sample_chain(
        self, h: Tensor, deterministic: bool = False, x0: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Trunk features h [N, H] -> (chain x_0..x_S [N, S+1, D], log-prob of each transition
        [N, S]): the ODE (``deterministic``, log-probs 0) or the stochastic sampler, from ``x0``
        [N, D] (default: 0 for the ODE, N(0, I) for the sampler)."""
        N = len(h)
        if x0 is not None:
            x = x0
        elif deterministic:
            x = h.new_zeros(N, self.dim)
        else:
            x = torch.randn(N, self.dim, device=h.device)
        chain, logp = [x], []
        for t in self._times(h.device):
            mean, std = self._transition(x, t.expand(N), h, noisy=not deterministic)
            if deterministic:
                x = mean
                logp.append(h.new_zeros(N))
            else:
                x = mean + std * torch.randn_like(mean)
                logp.append(_normal_logp(x, mean, std))
            chain.append(x)
        return torch.stack(chain, dim=1), torch.stack(logp, dim=1)

    def chain_logp(self, chain: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Stored chains [N, S+1, D] and features [N, H] -> (log-prob of each transition
        [N, S], entropy of the chain [N]), all in one batched pass of the networks."""
        N, S, D = len(chain), self.steps, self.dim
        x = chain[:, :-1].reshape(N * S, D)
        t = self._times(h.device).repeat(N)  # (N*S,) step-major within each row
        mean, std = self._transition(x, t, h.repeat_interleave(S, 0), noisy=True)
        nxt = chain[:, 1:].reshape(N * S, D)
        logp = _normal_logp(nxt, mean, std).view(N, S)
        entropy = (HALF_LOG_2PI_E + std.log()).expand(N * S, D).sum(-1).view(N, S).sum(1)
        return logp, entropy

    def _reported(self, steps: Tensor) -> Tensor:
        """Per-transition log-probs [N, S] -> what the policy reports: [N, S] (``flow_logp=step``:
        the loss clips each denoising step) or their sum [N] (``chain``)."""
        return steps if self.spec.vla.flow_logp == "step" else steps.sum(-1)

    # ------------------------------------------------------------------ policy protocol
    def forward(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Flat observations (N rows) -> (deterministic ODE action chunk [N, D], value [N])."""
        h, value, _ = self._features(obs)
        return self.sample_chain(h, deterministic=True)[0][:, -1], value

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Re-score the stored chains: log-prob and entropy of the S transitions per policy
        step, the value and auxiliary losses as `CompactVLA.evaluate`, each [B, T]."""
        mask = batch.mask > 0
        h, value, aux = self._features(flatten_inputs(batch, self.obs_keys()))
        chain = self._chains(batch.tokens[mask].to(h.dtype))  # (N, S+1, D)
        finite = chain.isfinite().all(-1).all(-1)  # (N,)
        logp, entropy = self.chain_logp(torch.where(finite[:, None, None], chain, 0.0), h)
        logp = torch.where(finite[:, None], logp, torch.zeros_like(logp))
        return self._evaluation(mask, self._reported(logp), entropy, value, aux)

    def sft_loss(self, batch: RolloutBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Flow-matching behaviour cloning: ``tokens`` [B, T, D] are target action chunks ->
        (per-step loss [B, T], auxiliary losses), 0 on padding."""
        mask = batch.mask > 0
        h, value, aux = self._features(flatten_inputs(batch, self.obs_keys()))
        target = batch.tokens[mask].to(h.dtype)  # (N, D)
        if target.shape[-1] != self.dim:
            raise ValueError(
                f"flow matching needs target chunks of {self.dim} numbers (chunk x action "
                f"dims); the batch holds {target.shape[-1]}"
            )
        t = torch.rand(len(target), device=h.device)
        eps = torch.randn_like(target)
        x = (1 - t[:, None]) * eps + t[:, None] * target
        loss = (self.velocity(self._inputs(x, t, h)) - (target - eps)).square().mean(-1)
        ev = self._evaluation(mask, loss, torch.zeros_like(loss), value, aux)
        return ev.logp, ev.aux

    @torch.no_grad()
    def act(
        self, obs: dict[str, Tensor], deterministic: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Observations [N, ...] -> (chain [N, (S+1)*D], logp [N, S] or [N] (``flow_logp``),
        value [N]); `env_action`
        takes the chunk the env executes out of the chain. A non-finite chain gets logp 0 and
        a NaN action: the env runner gives that env a no-op and counts it (``bad_actions``)."""
        obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        h, value, _ = self._features(obs)
        chain, logp = self.sample_chain(h, deterministic)
        finite = chain.isfinite().all(-1).all(-1)
        if not finite.all():
            chain[~finite] = float("nan")
            logp = torch.where(finite[:, None], logp, torch.zeros_like(logp))
        return chain.flatten(1), self._reported(logp), value

    def env_action(self, sampled: Tensor) -> Tensor:
        """What ``act`` returned [N, (S+1)*D] -> the action chunk the env executes [N, D]."""
        return sampled[:, -self.dim :]

    def _chains(self, tokens: Tensor) -> Tensor:
        """Stored tokens [N, (S+1)*D] -> chains [N, S+1, D]."""
        if tokens.shape[-1] != (self.steps + 1) * self.dim:
            raise ValueError(
                f"the batch's actions hold {tokens.shape[-1]} numbers per step; this flow head "
                f"stores chains of {self.steps + 1} x {self.dim} (was it collected by another "
                "policy?)"
            )
        return tokens.view(len(tokens), self.steps + 1, self.dim)


VLA_HEADS.register("flow", FlowVLA)


def _normal_logp(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Sum over the last dim of log N(x; mean, std^2) (std broadcasts)."""
    z = (x - mean) / std
    return (-0.5 * z.square() - std.log() - 0.5 * math.log(2 * math.pi)).expand_as(x).sum(-1)
