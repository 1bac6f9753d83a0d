"""Off-policy heads of the compact VLA: SAC (``vla.head=sac``) and DSRL (``vla.head=dsrl``).

**SAC** (Haarnoja et al. 2018, with automatic entropy temperature; the layout of CleanRL's
``sac_continuous_action.py`` and DrQ's pixel encoder sharing): `SACVLA` keeps `CompactVLA`'s
encoder, instruction FiLM and trunk (features h), and puts on them a tanh-squashed Gaussian
actor (an MLP of its own on h) with a state-dependent standard deviation and twin Q critics
Q_i(h, a) (MLPs with layer normalisation, as RLPD). The critics' loss trains the encoder; the
actor reads h detached (DrQ), so the actor loss moves only the actor. A
target copy of the encoder and critics follows by Polyak averaging (``vla.sac_tau``). One
minibatch of transitions (s, a, R, discount, s') gives, with alpha = exp(log_alpha):

    y = R + discount * (min_i Q'_i(s', a') - alpha log pi(a'|s')),  a' ~ pi(.|s')
    critic = 1/2 sum_i mean (Q_i(s, a) - y)^2
    actor  = mean (alpha log pi(a~|s) - min_i Q_i(s, a~)),          a~ ~ pi(.|s) (rsample)
    alpha  = -mean log_alpha (log pi(a~|s) + target_entropy)

summed into one loss: the critics take no gradient from the actor term (their parameters are
frozen while it is built) and the temperature none from the others, so one optimizer over all
parameters makes the three updates. ``discount`` is gamma^n (0 after a terminal state), ``R`` the
n-step return, both from the replay buffer (trainer/replay.py). ``target_entropy`` is
``vla.sac_target_entropy`` per action dimension (-1: SAC's -dim(A)).

**DSRL** (Wagenmaker et al. 2025, "Steering Your Diffusion Policy with Latent Space RL"):
`DSRLVLA` is a behaviour-cloned `FlowVLA` (loaded from ``model.path``) whose weights stay frozen;
a small SAC actor chooses the flow's initial noise w (``vla.dsrl_noise_scale`` * tanh of a
Gaussian, per chunk dimension) and the frozen flow integrates its ODE from w to the action chunk
the env executes. The critics are learned on the env's action chunks, Q_i(h, a); the latent
actor maximises Q_i(h, flow(h, w)) through the frozen flow (the DSRL variant that learns Q on
actions). Deterministic acting uses the actor's mean noise. Only the actor, the critics and the
temperature train; `after_update` moves only their targets.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributions import Normal

from ..errors import ModelError
from ..registry import VLA_HEADS
from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from ..trainer.replay import Transitions
from .compact import CONFIG, WEIGHTS, CompactVLA, _checked, flatten_inputs, spec_from_json
from .config import VLAConfig
from .flow import FlowVLA

LOG_STD_BOUNDS = (-5.0, 2.0)
"""the actor's log-std is squashed into this range (CleanRL's and SpinningUp's)"""


def _q_net(hidden: int, action_dim: int) -> nn.Sequential:
    """A Q critic: an MLP with layer normalisation after each hidden layer, which RLPD (Ball et
    al. 2023) found keeps Q from extrapolating far above the data (demonstrations especially)."""
    return nn.Sequential(
        nn.Linear(hidden + action_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 1),
    )  # fmt: skip


def tanh_gaussian(mean: Tensor, log_std: Tensor, deterministic: bool = False):
    """(a = tanh(u) with u ~ N(mean, std) (or u = mean), log pi(a) [N]) with the tanh
    change of variables, log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))."""
    log_std = LOG_STD_BOUNDS[0] + 0.5 * (LOG_STD_BOUNDS[1] - LOG_STD_BOUNDS[0]) * (
        torch.tanh(log_std) + 1
    )
    dist = Normal(mean, log_std.exp())
    u = mean if deterministic else dist.rsample()
    logp = dist.log_prob(u) - 2 * (math.log(2) - u - F.softplus(-2 * u))
    return torch.tanh(u), logp.sum(-1)


class _SAC:
    """What SAC and DSRL share: the critics' targets, the temperature and the three losses. A
    subclass provides `_actor(h)`, `_env_action(h, sample)` and `_critic_features(obs)`."""

    def _build_sac(self, hidden: int, action_dim: int) -> None:
        vla = self.spec.vla
        # the actor's own MLP on the (detached) features: mean and log-std of each dimension
        self.actor = nn.Sequential(
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2 * action_dim)
        )
        self.q1, self.q2 = _q_net(hidden, action_dim), _q_net(hidden, action_dim)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(vla.sac_init_alpha)))
        self.tau = vla.sac_tau

    def _make_target(self) -> None:
        """The target networks: a frozen copy of the whole policy (without its old target)."""
        self._modules.pop("target", None)
        target = copy.deepcopy(self)
        for p in target.parameters():
            p.requires_grad_(False)
        self.target = target

    def offpolicy_loss(self, batch: Transitions) -> tuple[Tensor, dict[str, float]]:
        """One minibatch -> (critic + actor + temperature loss, metrics); see the module
        docstring."""
        alpha = self.log_alpha.exp()
        with torch.no_grad():
            h_next = self._critic_features(batch.next_obs, target=False)
            a_next, logp_next = self._sample(h_next)
            ht = self._critic_features(batch.next_obs, target=True)
            q_next = torch.min(*self._q(ht, a_next, target=True)) - alpha * logp_next
            y = batch.reward + batch.discount * q_next  # (M,)
        h = self._critic_features(batch.obs, target=False)
        q1, q2 = self._q(h, batch.action.to(h.dtype))
        critic = 0.5 * ((q1 - y).square().mean() + (q2 - y).square().mean())
        hd = h.detach()
        a_pi, logp_pi = self._sample(hd)
        frozen = [p for p in (*self.q1.parameters(), *self.q2.parameters()) if p.requires_grad]
        for p in frozen:  # the actor's term moves the actor only
            p.requires_grad_(False)
        try:
            q_pi = torch.min(*self._q(hd, a_pi))
        finally:
            for p in frozen:
                p.requires_grad_(True)
        actor = (alpha.detach() * logp_pi - q_pi).mean()
        target_entropy = self.spec.vla.sac_target_entropy * self._latent_dim()
        temperature = -(self.log_alpha * (logp_pi.detach() + target_entropy)).mean()
        metrics = {
            "sac/critic_loss": float(critic.detach()), "sac/actor_loss": float(actor.detach()),
            "sac/alpha": float(alpha.detach()), "sac/entropy": float(-logp_pi.detach().mean()),
            "sac/q": float(q1.detach().mean()), "sac/target": float(y.mean()),
        }  # fmt: skip
        if batch.demo.any():  # the demonstrations' Q and the policy's own data's apart
            metrics["sac/q_demo"] = float(q1.detach()[batch.demo].mean())
            metrics["sac/q_online"] = float(q1.detach()[~batch.demo].mean())
        return critic + actor + temperature, metrics

    has_critic = False
    """no state-value critic for the trainer's estimators (the Q critics are SAC's own)"""

    @torch.no_grad()
    def act(self, obs: dict[str, Tensor], deterministic: bool = False):
        """Observations [N, ...] -> (env action [N, K*A] in (-1, 1), logp [N], value [N] (0)):
        the actor's mean with ``deterministic``."""
        obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        h = self._features(obs)[0]
        a, logp = self._sample(h, deterministic)
        return a, logp, torch.zeros(len(a), device=a.device)

    @torch.no_grad()
    def warmup_act(self, obs: dict[str, Tensor], gen: torch.Generator):
        """SAC's warm-up actions before learning starts: uniform where the actor samples (the
        actions in [-1, 1]; DSRL: its noise, which the flow turns into actions)."""
        obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        h = self._features(obs)[0]
        u = torch.rand(len(h), self._latent_dim(), generator=gen) * 2 - 1
        return self._from_unit(h, u.to(h.device)), None, None

    def _from_unit(self, h: Tensor, u: Tensor) -> Tensor:
        """A point ``u`` of [-1, 1]^D of the actor's squashed space -> the env action."""
        return u

    @torch.no_grad()
    def after_update(self) -> None:
        """Polyak averaging of the target networks toward the trained ones (frozen parts, which
        never change, are left alone)."""
        online = dict(self.named_parameters())
        for name, p in self.target.named_parameters():
            src = online[name]
            if src.requires_grad:
                p.lerp_(src, self.tau)

    def _actor(self, h: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        """Features [N, H] -> (a point of (-1, 1)^D, its log-prob [N]) of the squashed actor."""
        mean, log_std = self.actor(h).chunk(2, dim=-1)
        return tanh_gaussian(mean, log_std, deterministic)

    def _q(self, h: Tensor, a: Tensor, target: bool = False) -> tuple[Tensor, Tensor]:
        net = self.target if target else self
        x = torch.cat([h, a], dim=-1)
        return net.q1(x).squeeze(-1), net.q2(x).squeeze(-1)


class SACVLA(_SAC, CompactVLA):
    """The compact VLA with SAC's actor and critics; see the module docstring."""

    def __init__(self, spec):
        super().__init__(spec)
        self._make_target()

    def _build_head(self, hidden: int, dim: int) -> None:
        self._build_sac(hidden, dim)

    def _latent_dim(self) -> int:
        return self.actor[-1].out_features // 2

    def _critic_features(self, obs: dict[str, Tensor], target: bool) -> Tensor:
        return (self.target if target else self)._features(obs)[0]

    def _sample(self, h: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        return self._actor(h, deterministic)

    def forward(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Flat observations (N rows) -> (the actor's mean action [N, K*A], value [N])."""
        h, value, _ = self._features(obs)
        return self._actor(h, deterministic=True)[0], value

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Log-probs of the stored (squashed) actions under the actor, [B, T]; entropy 0."""
        mask = batch.mask > 0
        h = self._features(flatten_inputs(batch, self.obs_keys()))[0]
        a = batch.tokens[mask].to(h.dtype).clamp(-1 + 1e-6, 1 - 1e-6)
        u = torch.atanh(a)
        mean, log_std = self.actor(h).chunk(2, dim=-1)
        lo, hi = LOG_STD_BOUNDS
        std = (lo + 0.5 * (hi - lo) * (torch.tanh(log_std) + 1)).exp()
        logp = Normal(mean, std).log_prob(u) - 2 * (math.log(2) - u - F.softplus(-2 * u))
        zeros = logp.new_zeros(len(logp))
        return self._evaluation(mask, logp.sum(-1), zeros, zeros, None)


class DSRLVLA(_SAC, FlowVLA):
    """A frozen flow policy steered by a latent SAC actor; see the module docstring."""

    TRAINED = ("actor", "q1", "q2", "log_alpha")
    """the modules DSRL trains; everything else (the flow policy) stays as loaded"""

    def __init__(self, spec):
        super().__init__(spec)
        for name, p in self.named_parameters():
            if name.split(".")[0] not in self.TRAINED:
                p.requires_grad_(False)
        self._make_target()

    def _build_head(self, hidden: int, dim: int) -> None:
        super()._build_head(hidden, dim)  # the flow's velocity (and noise) networks
        self._build_sac(hidden, dim)  # the actor chooses the flow's noise

    def load_flow(self, state: dict[str, Tensor]) -> None:
        """The behaviour-cloned flow policy's weights (a `FlowVLA` state dict) into the frozen
        part; the target copies them."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        new = [k for k in missing if k.split(".")[0] not in (*self.TRAINED, "target")]
        if unexpected or new:
            raise ValueError(
                f"the flow policy's weights do not fit this DSRL policy (unexpected "
                f"{unexpected[:4]}, missing {new[:4]}): was it trained with another vla section?"
            )
        self._make_target()

    def _latent_dim(self) -> int:
        return self.dim

    def _critic_features(self, obs: dict[str, Tensor], target: bool) -> Tensor:
        with torch.no_grad():  # the frozen encoder: the same features for the target
            return self._features(obs)[0]

    def _sample(self, h: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        """Features [N, H] -> (the flow's action chunk from the actor's noise [N, D], the
        noise's log-prob [N])."""
        w, logp = self._actor(h, deterministic)
        return self._from_unit(h, w), logp - self.dim * math.log(self.spec.vla.dsrl_noise_scale)

    def _from_unit(self, h: Tensor, u: Tensor) -> Tensor:
        scale = self.spec.vla.dsrl_noise_scale
        return self.sample_chain(h, deterministic=True, x0=scale * u)[0][:, -1]

    def env_action(self, sampled: Tensor) -> Tensor:
        """``act`` returns the action chunk itself (the flow ran inside)."""
        return sampled


STEERING_FIELDS = ("sac_tau", "sac_init_alpha", "sac_target_entropy", "dsrl_noise_scale")
"""what the recipe's vla section sets of a DSRL policy built on a saved flow policy"""


def steering(path: str | Path, vla: VLAConfig, chunk: int) -> DSRLVLA:
    """The DSRL policy of the recipe on the saved flow policy at ``path`` (a ``vla.head=flow``
    checkpoint's model folder; a saved DSRL policy loads as it is)."""
    folder = Path(path)
    cfg = json.loads((_checked(folder) / CONFIG).read_text())
    spec = spec_from_json(cfg)
    if spec.vla.head == "dsrl":
        return CompactVLA.from_pretrained(folder)
    if spec.vla.head != "flow":
        raise ModelError(
            f"vla.head=dsrl steers a flow policy; model.path={folder} holds a vla.head="
            f"{spec.vla.head} policy. Train one with `perceptrl sft vla_bc_flow`"
        )
    if spec.chunk != chunk:
        raise ModelError(
            f"model.path holds a flow policy with action chunk {spec.chunk}; the recipe has "
            f"env.action_chunk={chunk}"
        )
    own = {k: getattr(vla, k) for k in STEERING_FIELDS}
    spec.vla = dataclasses.replace(spec.vla, head="dsrl", **own)
    policy = DSRLVLA(spec)
    policy.load_flow(load_file(str(folder / WEIGHTS)))
    return policy


VLA_HEADS.register("sac", SACVLA)
VLA_HEADS.register("dsrl", DSRLVLA)
