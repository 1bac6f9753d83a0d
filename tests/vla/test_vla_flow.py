"""The flow-matching action head (`FlowVLA`): exact chain log-probs, the ODE at zero noise,
non-finite chains, flow-matching BC, chunked expert targets, and RL through the shared trainer."""

from __future__ import annotations

import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl.trainer.batch import RolloutBatch  # noqa: E402
from perceptrl.vla.bc import chunk_targets  # noqa: E402
from perceptrl.vla.collect import PPOCollector  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA  # noqa: E402
from perceptrl.vla.config import EnvConfig, VLAConfig  # noqa: E402
from perceptrl.vla.envs import make_envs  # noqa: E402
from perceptrl.vla.episode_runner import CONTINUES, CUT, TERMINATED, Rows  # noqa: E402
from perceptrl.vla.flow import FlowVLA  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["log.tensorboard=false", "log.progress=false", "train.device=cpu"]
OBJ = 21


def flow_policy(
    noise: str = "sde", chunk: int = 2, steps: int = 4, seed: int = 0, objects: int = OBJ,
    logp: str = "step",
) -> FlowVLA:  # fmt: skip
    torch.manual_seed(seed)
    vla = VLAConfig(encoder="state", hidden=32, head="flow", flow_steps=steps, flow_noise=noise,
                    flow_logp=logp)  # fmt: skip
    policy = FlowVLA(CompactSpec(5, chunk=chunk, objects_dim=objects, vla=vla))
    with torch.no_grad():  # a velocity field that is not zero (the last layers start at 0)
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return policy


class Fn(torch.nn.Module):
    """A function in a module's slot (to replace the velocity network in a test)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def random_obs(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "objects": 0.1 * torch.randn(n, OBJ, generator=g) + 0.3,
        "proprio": 0.1 * torch.randn(n, 8, generator=g) + 0.3,
        "words": torch.randint(2, 20, (n, 6), generator=g),
    }


def as_batch(obs: dict, tokens: torch.Tensor, lens: list[int]) -> RolloutBatch:
    """Rows of ``lens`` steps cut in order out of N = sum(lens) flat steps."""
    B, T = len(lens), max(lens)
    padded, mask = tokens.new_zeros(B, T, tokens.shape[-1]), torch.zeros(B, T)
    inputs = {k: [] for k in obs}
    start = 0
    for i, n in enumerate(lens):
        padded[i, :n], mask[i, :n] = tokens[start : start + n], 1
        for k, v in obs.items():
            inputs[k].append(v[start : start + n])
        start += n
    return RolloutBatch(tokens=padded, mask=mask, group_id=torch.arange(B), inputs=inputs)


@pytest.mark.parametrize(
    "noise,logp_mode", [("sde", "step"), ("learned", "step"), ("sde", "chain")]
)
def test_chain_logp_recomputed_equals_acting(noise, logp_mode):
    policy = flow_policy(noise, logp=logp_mode)
    obs = random_obs(7)
    torch.manual_seed(3)
    chain, logp, value = policy.act(obs)
    assert chain.shape == (7, (4 + 1) * 10) and torch.isfinite(logp).all()
    assert logp.shape == ((7, 4) if logp_mode == "step" else (7,))  # per denoising step or sum
    ev = policy.evaluate(as_batch(obs, chain, [3, 4]))
    got = torch.cat([ev.logp[0, :3], ev.logp[1, :4]])
    torch.testing.assert_close(got, logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([ev.value[0, :3], ev.value[1, :4]]), value)
    assert (ev.logp[0, 3] == 0).all() and torch.isfinite(ev.entropy).all()
    # the log-prob is the chain's: changing an intermediate state changes it
    other = chain.clone()
    other[0, 10:20] += 0.5
    assert not torch.allclose(policy.evaluate(as_batch(obs, other, [3, 4])).logp[0, 0], logp[0])


def test_collected_logp_old_equal_training_forward():
    """Through the real runner and env: what the PPO collector recorded while acting is what
    the training forward gives the stored chains (the ratio starts at exactly 1)."""
    cfg = EnvConfig(id="perceptrl/Reach-v0", num_envs=2, obs_mode="state", steps_per_rollout=6,
                    max_episode_steps=8, action_chunk=2)  # fmt: skip
    runner = make_envs(cfg, seed=0)
    policy = flow_policy("sde", chunk=2, objects=runner.observation_space["objects"].shape[0])
    batch, m = PPOCollector(cfg, seed=0, runner=runner).collect(policy, 0)
    runner.close()
    assert batch.tokens.shape[-1] == 5 * 10 and m["rollout/env_steps"] > 0
    ev = policy.evaluate(batch)
    assert ev.logp.shape == batch.logp_old.shape == (*batch.mask.shape, 4)
    torch.testing.assert_close(
        ev.logp, batch.logp_old * batch.mask[..., None], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("noise", ["sde", "learned"])
def test_zero_noise_sampler_is_the_ode(noise):
    policy = flow_policy(noise)
    obs = random_obs(5)
    ode, _, _ = policy.act(obs, deterministic=True)
    h = policy._features(obs)[0]
    if noise == "sde":
        policy.spec.vla.flow_noise_level = 0.0
    else:
        policy.spec.vla.flow_noise_std = [1e-30, 2e-30]
    with torch.no_grad():
        chain, _ = policy.sample_chain(h, x0=torch.zeros(5, 10))
    torch.testing.assert_close(chain.flatten(1), ode, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(policy(obs)[0], policy.env_action(ode))
    # and from any x0 the noiseless sampler follows the ODE's Euler path
    x0 = torch.randn(5, 10)
    with torch.no_grad():
        a, _ = policy.sample_chain(h, x0=x0)
        b, _ = policy.sample_chain(h, deterministic=True, x0=x0)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_sde_keeps_the_flow_marginal_of_a_known_field():
    """For data a ~ N(m, s^2) the exact velocity is known in closed form; the SDE sampler with
    that field must end at N(m, s^2), like the ODE (noise changes the paths, not the law)."""
    policy = flow_policy("sde", chunk=1, steps=50)
    policy.dim = 1
    m, s = 0.3, 0.2

    def velocity(inp):  # E[a - eps | x_t = x] for Gaussian data
        x, t = inp[:, :1], inp[:, 1:2]  # t recovered from the features below
        var = (1 - t) ** 2 + (t * s) ** 2
        return m + ((t * s * s - (1 - t)) / var) * (x - t * m)

    def inputs(x, t, h):
        return torch.cat([x, t[:, None]], dim=-1)

    policy.velocity, policy._inputs = Fn(velocity), inputs
    torch.manual_seed(0)
    h = torch.zeros(20000, 1)
    for noisy in (False, True):
        chain, _ = policy.sample_chain(h, deterministic=not noisy, x0=torch.randn(20000, 1))
        a = chain[:, -1, 0]
        assert abs(float(a.mean()) - m) < 0.01 and abs(float(a.std()) - s) < 0.015, (noisy, a.std())


def test_nonfinite_chain_is_a_counted_noop_and_carries_no_gradient():
    cfg = EnvConfig(id="perceptrl/Reach-v0", num_envs=2, obs_mode="state", max_episode_steps=8,
                    action_chunk=2)  # fmt: skip
    runner = make_envs(cfg, seed=0)
    policy = flow_policy("sde", chunk=2, objects=runner.observation_space["objects"].shape[0])
    velocity = policy.velocity
    diverged = torch.tensor([[float("nan")], [1.0]])  # env 0's velocity field diverges
    policy.velocity = Fn(lambda inp: velocity(inp) * diverged)
    batch = runner.reset()
    obs = policy.observe(batch)
    qpos0 = runner.envs[0].unwrapped.data.qpos.copy()
    chain, logp, _ = policy.act(obs)
    assert torch.isnan(chain[0]).all() and torch.isfinite(chain[1]).all()
    assert (logp[0] == 0).all() and (logp[1] != 0).all()
    res = runner.step(policy.env_action(chain).numpy().reshape(2, 2, 5))
    assert runner.counters["bad_actions"] == 1
    assert np.isfinite(runner.envs[0].unwrapped.data.qpos).all() and not res.unstable[0]
    assert np.abs(runner.envs[0].unwrapped.data.qpos - qpos0).max() < 0.05  # a no-op
    policy.velocity = velocity
    ev = policy.evaluate(as_batch(obs, chain, [1, 1]))
    assert (ev.logp[0, 0] == 0).all() and torch.isfinite(ev.logp).all()
    ev.logp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
    runner.close()


def test_flow_matching_fits_target_chunks():
    """Flow matching on fixed (observation, chunk) pairs: the ODE's actions reach the targets."""
    policy = flow_policy("sde", chunk=2, steps=8)
    obs = random_obs(16, seed=5)
    target = torch.tanh(torch.randn(16, 10, generator=torch.Generator().manual_seed(6)))
    batch = as_batch(obs, target, [8, 8])
    err0 = float((policy(obs)[0] - target).abs().mean().detach())
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(600):
        loss, _ = policy.sft_loss(batch)
        opt.zero_grad()
        (loss.sum() / batch.mask.sum()).backward()
        opt.step()
    err = float((policy(obs)[0] - target).abs().mean().detach())
    assert err < 0.25 * err0, (err0, err)


def test_learned_noise_is_trained_through_the_log_probs():
    policy = flow_policy("learned")
    obs = random_obs(4)
    chain, _, _ = policy.act(obs)
    policy.evaluate(as_batch(obs, chain, [2, 2])).logp.sum().backward()
    assert policy.noise_net[-1].weight.grad.abs().sum() > 0
    lo, hi = policy.spec.vla.flow_noise_std
    _, std = policy._transition(torch.zeros(3, 10), torch.zeros(3), torch.zeros(3, 32), True)
    assert (std > lo).all() and (std < hi).all()


def test_chunk_targets_pad_episode_ends_and_drop_cut_tails():
    a = torch.arange(1, 9, dtype=torch.float32).view(2, 4, 1)  # actions 1..4 and 5..8
    rows = Rows(
        actions=a, mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1.0]]), rewards=torch.ones(2, 4),
        logp=None, value=None, inputs={"x": [torch.arange(3), torch.arange(4)]},
        bootstrap=torch.zeros(2), end=np.array([TERMINATED, CUT], np.int8),
        spec=np.array([-1, -1]), success=np.zeros(2, bool),
    )  # fmt: skip
    tokens, mask, _, inputs = chunk_targets(rows, 2)
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert tokens[0].tolist() == [[1, 2], [2, 3], [3, 3]]  # the last action repeated
    assert tokens[1].tolist() == [[5, 6], [6, 7], [7, 8]]  # step 4's chunk runs past the horizon
    assert [len(x) for x in inputs["x"]] == [3, 3]
    assert CONTINUES == 0


def test_save_load_roundtrip_builds_the_flow_head(tmp_path):
    policy = flow_policy("learned")
    policy.save(tmp_path)
    again = CompactVLA.from_pretrained(tmp_path)
    assert isinstance(again, FlowVLA) and again.spec.vla.flow_noise == "learned"
    obs = random_obs(3)
    torch.testing.assert_close(again(obs)[0], policy(obs)[0])


def test_bad_flow_settings_are_named():
    vla = VLAConfig(encoder="state", head="flow", flow_noise="learned", flow_noise_std=[0.2, 0.1])
    with pytest.raises(ValueError, match="flow_noise_std"):
        FlowVLA(CompactSpec(5, objects_dim=OBJ, vla=vla))
    vla = VLAConfig(encoder="state", head="flow", flow_noise_level=0.0)
    with pytest.raises(ValueError, match="flow_noise_level"):
        FlowVLA(CompactSpec(5, objects_dim=OBJ, vla=vla))
    with pytest.raises(ValueError, match="vla.head"):
        CompactVLA(
            CompactSpec(5, objects_dim=OBJ, vla=VLAConfig(encoder="state", head="diffusion"))
        )


def test_bc_then_grpo_recipe_runs(tmp_path):
    """`perceptrl sft` (flow matching from chunked expert targets) then GRPO on the flow head,
    through the shared trainer."""
    from perceptrl.vla.builder import build_trainer, run_sft
    from perceptrl.wiring import load_config

    env = ["env.id=perceptrl/Reach-v0", "env.num_envs=4", "env.eval_episodes=0"]
    bc = load_config(
        CONFIGS / "vla_bc_flow.yaml",
        [*env, "env.steps_per_rollout=16", "train.steps=30", *QUIET],
    )
    run_sft(bc, tmp_path / "bc")
    rows = [json.loads(x) for x in (tmp_path / "bc" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])
    model = sorted((tmp_path / "bc" / "checkpoints").iterdir())[-1] / "model"
    cfg = load_config(
        CONFIGS / "vla_grpo_flow.yaml",
        [*env, f"model.path={model}", "env.max_episode_steps=20", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "train.steps=2", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path / "grpo")
    assert isinstance(trainer.policy, FlowVLA)
    trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/episodes" in r]
    assert len(steps) == 2 and steps[0]["rollout/episodes"] == 8
    assert all(np.isfinite(r.get("actor/pg_loss", 0.0)) for r in steps)
    trainer.source.close()


def test_ppo_with_gae_trains_velocity_noise_and_value(tmp_path):
    """PPO (GAE, the shared value head) on the flow head with the learned noise: the velocity
    field, the noise network and the value head all move."""
    from perceptrl.vla.builder import build_trainer
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vla_ppo_reach_state.yaml",
        ["vla.head=flow", "vla.flow_noise=learned", "vla.flow_steps=4", "env.action_chunk=2",
         "env.num_envs=4", "env.steps_per_rollout=16", "env.eval_episodes=0", "train.steps=2",
         "train.ppo_epochs=2", *QUIET],
    )  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    policy = trainer.policy
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    trainer.fit()
    moved = {k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])}
    assert {"velocity.4.weight", "noise_net.4.weight", "value_head.weight"} <= moved
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/vf_explained_var" in r for r in rows if "actor/pg_loss" in r)
    trainer.source.close()
