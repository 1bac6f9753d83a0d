"""The off-policy heads (vla/sac.py): SAC's losses against a hand computation, the gradient
routing of its one loss, the entropy temperature, Polyak targets, and DSRL's frozen flow."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from perceptrl.trainer.replay import Transitions
from perceptrl.vla.compact import CompactSpec, build_compact
from perceptrl.vla.config import VLAConfig
from perceptrl.vla.sac import DSRLVLA, SACVLA, tanh_gaussian

OBJ, A = 14, 4


def spec(head="sac", **vla):
    vla = {"encoder": "state", "hidden": 32, **vla}
    return CompactSpec(A, objects_dim=OBJ, vla=VLAConfig(head=head, **vla))


def batch(m=6, seed=0, terminal=False):
    g = torch.Generator().manual_seed(seed)
    obs = lambda: {  # noqa: E731
        "objects": torch.randn(m, OBJ, generator=g) * 0.1, "proprio": torch.randn(m, 8, generator=g) * 0.1,
        "words": torch.randint(2, 6, (m, 4), generator=g),
    }  # fmt: skip
    discount = torch.zeros(m) if terminal else torch.full((m,), 0.9)
    return Transitions(obs(), torch.rand(m, A, generator=g) * 2 - 1, torch.randn(m, generator=g),
                       discount, obs(), torch.zeros(m, dtype=torch.bool))  # fmt: skip


def test_tanh_gaussian_log_prob_by_hand():
    # u = mean = 0 and std = exp(-1.5) (log-std parameter 0 maps to the middle of [-5, 2]):
    # log N(0; 0, s) - log(1 - tanh(0)^2) = -log(s) - log(2 pi) / 2 per dimension
    a, logp = tanh_gaussian(torch.zeros(1, 3), torch.zeros(1, 3), deterministic=True)
    assert torch.equal(a, torch.zeros(1, 3))
    expect = 3 * (1.5 - 0.5 * math.log(2 * math.pi))
    assert float(logp) == pytest.approx(expect, abs=1e-5)


def test_sac_loss_is_the_hand_computed_one():
    torch.manual_seed(0)
    policy = SACVLA(spec())
    with torch.no_grad():  # targets apart from the online nets, so the test tells them apart
        for p in policy.target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    b = batch()
    torch.manual_seed(1)
    loss, m = policy.offpolicy_loss(b)
    torch.manual_seed(1)  # the same noise, drawn in the same order
    alpha = policy.log_alpha.exp()

    def sample(net, h):
        mean, log_std = net.actor(h).chunk(2, dim=-1)
        log_std = -5 + 3.5 * (torch.tanh(log_std) + 1)
        u = mean + log_std.exp() * torch.randn_like(mean)
        logp = (-0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
                - torch.log(1 - torch.tanh(u) ** 2)).sum(-1)  # fmt: skip
        return torch.tanh(u), logp

    def q(net, h, a):
        x = torch.cat([h, a], -1)
        return net.q1(x).squeeze(-1), net.q2(x).squeeze(-1)

    with torch.no_grad():
        a2, lp2 = sample(policy, policy._features(b.next_obs)[0])
        t1, t2 = q(policy.target, policy.target._features(b.next_obs)[0], a2)
        y = b.reward + b.discount * (torch.min(t1, t2) - alpha * lp2)
        h = policy._features(b.obs)[0]
        q1, q2 = q(policy, h, b.action)
        critic = 0.5 * (F.mse_loss(q1, y) + F.mse_loss(q2, y))
        a_pi, lp_pi = sample(policy, h)
        actor = (alpha * lp_pi - torch.min(*q(policy, h, a_pi))).mean()
        temp = -(policy.log_alpha * (lp_pi - A)).mean()  # target entropy -A
    assert m["sac/critic_loss"] == pytest.approx(float(critic), rel=1e-4, abs=1e-6)
    assert m["sac/actor_loss"] == pytest.approx(float(actor), rel=1e-4, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(float(critic + actor + temp), rel=1e-4, abs=1e-5)


def test_one_loss_routes_each_gradient_to_its_part():
    """The critics and the encoder take no gradient from the actor term; the actor's heads
    none from the critic term (DrQ)."""
    torch.manual_seed(0)
    policy = SACVLA(spec())
    b = batch(terminal=True)

    def grads(term):
        policy.zero_grad()
        torch.manual_seed(3)
        loss, _ = policy.offpolicy_loss(b)
        if term == "all":
            loss.backward()
        return {n: p.grad.clone() if p.grad is not None else None
                for n, p in policy.named_parameters()}  # fmt: skip

    full = grads("all")
    assert all(full[n] is None for n in full if n.startswith("target."))
    assert full["q1.0.weight"].abs().sum() > 0 and full["actor.0.weight"].abs().sum() > 0
    assert full["log_alpha"] is not None
    # recompute the critic term alone: the critics' and the encoder's gradients are the same
    policy.zero_grad()
    torch.manual_seed(3)
    h = policy._features(b.obs)[0]
    q1, q2 = policy._q(h, b.action)
    y = b.reward  # terminal: discount 0
    (0.5 * ((q1 - y).square().mean() + (q2 - y).square().mean())).backward()
    for name in ("q1.0.weight", "q2.3.bias", "feat.weight", "trunk.0.weight"):
        torch.testing.assert_close(full[name], policy.get_parameter(name).grad)
    assert policy.actor[0].weight.grad is None


@pytest.mark.parametrize("target, direction", [(5.0, 1), (-20.0, -1)])
def test_the_temperature_moves_toward_the_target_entropy(target, direction):
    torch.manual_seed(0)
    policy = SACVLA(spec(sac_target_entropy=target))
    opt = torch.optim.Adam([policy.log_alpha], lr=0.05)
    before = float(policy.log_alpha)
    for i in range(20):
        loss, _ = policy.offpolicy_loss(batch(seed=i))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (float(policy.log_alpha) - before) * direction > 0.5


def test_polyak_targets_follow_by_tau():
    torch.manual_seed(0)
    policy = SACVLA(spec(sac_tau=0.25))
    with torch.no_grad():
        policy.q1[0].weight.add_(1.0)
    before = policy.target.q1[0].weight.clone()
    policy.after_update()
    torch.testing.assert_close(
        policy.target.q1[0].weight, before + 0.25 * (policy.q1[0].weight - before)
    )
    assert "target.q1.0.weight" in policy.state_dict()  # saved with the policy (exact resume)


def test_dsrl_trains_its_actor_and_leaves_the_flow_bit_identical():
    torch.manual_seed(0)
    flow = build_compact(spec("flow", flow_steps=4))
    policy = DSRLVLA(spec("dsrl", flow_steps=4))
    policy.load_flow(flow.state_dict())
    frozen = {n: p.clone() for n, p in policy.named_parameters()
              if not p.requires_grad and not n.startswith("target.")}  # fmt: skip
    assert "velocity.0.weight" in frozen and "feat.weight" in frozen
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert {n.split(".")[0] for n, p in policy.named_parameters() if p.requires_grad} == set(
        DSRLVLA.TRAINED
    )
    actor_before = policy.actor[0].weight.clone()
    opt = torch.optim.Adam(trained, lr=1e-2)
    for i in range(5):
        loss, _ = policy.offpolicy_loss(batch(seed=i))
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.after_update()
    for n, p in policy.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert not torch.equal(policy.actor[0].weight, actor_before)
    # the action is the frozen flow's ODE from the actor's noise
    obs = batch().obs
    a, _, _ = policy.act(obs, deterministic=True)
    with torch.no_grad():
        h = flow._features(obs)[0]
        w = 1.5 * torch.tanh(policy.actor(h).chunk(2, dim=-1)[0])
        expect = flow.sample_chain(h, deterministic=True, x0=w)[0][:, -1]
    torch.testing.assert_close(a, expect)


def test_a_flow_policy_of_another_shape_is_refused():
    flow = build_compact(spec("flow", flow_steps=4, hidden=16))
    policy = DSRLVLA(spec("dsrl", flow_steps=4))
    with pytest.raises(RuntimeError, match="size mismatch"):
        policy.load_flow(flow.state_dict())
