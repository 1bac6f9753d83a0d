"""CompactVLA: Policy protocol, act/evaluate consistency, save/load, instruction encoding."""

from __future__ import annotations

import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402  (import torch before any rendering)

from perceptrl.trainer.batch import RolloutBatch  # noqa: E402
from perceptrl.trainer.policy import Policy  # noqa: E402
from perceptrl.vla.builder import load_policy  # noqa: E402
from perceptrl.vla.compact import CompactSpec, CompactVLA, SpatialSoftmax  # noqa: E402
from perceptrl.vla.config import VLAConfig  # noqa: E402
from perceptrl.vla.language import UNK, encode_words, instruction_words  # noqa: E402


def _obs(policy: CompactVLA, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = policy.spec
    obs = {
        "proprio": torch.randn(n, s.proprio_dim, generator=g),
        "words": encode_words(["reach the red target"] * n, policy.vocab, s.vla.max_words),
    }
    if s.vla.encoder in ("cnn", "keypoint"):
        shape = (n, s.image_size, s.image_size, 3 * s.cameras)
        obs["image"] = torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    if s.vla.encoder == "state" or s.vla.critic == "state" or s.vla.aux != "none":
        obs["objects"] = torch.randn(n, s.objects_dim, generator=g)
    return obs


def _rows(obs: dict, actions: torch.Tensor, lens: list[int]) -> RolloutBatch:
    """Cut N flat steps into right-padded rows of the given lengths."""
    T, D = max(lens), actions.shape[-1]
    tokens, mask = torch.zeros(len(lens), T, D), torch.zeros(len(lens), T)
    inputs: dict[str, list] = {k: [] for k in obs}
    start = 0
    for b, n in enumerate(lens):
        tokens[b, :n] = actions[start : start + n]
        mask[b, :n] = 1
        for k, v in obs.items():
            inputs[k].append(v[start : start + n])
        start += n
    return RolloutBatch(tokens=tokens, mask=mask, group_id=torch.arange(len(lens)), inputs=inputs)


def state_policy(chunk: int = 1) -> CompactVLA:
    torch.manual_seed(0)
    return CompactVLA(
        CompactSpec(
            action_dim=5, chunk=chunk, objects_dim=21, vla=VLAConfig(encoder="state", hidden=32)
        )
    )


def cnn_policy(encoder: str = "cnn") -> CompactVLA:
    torch.manual_seed(0)
    spec = CompactSpec(
        action_dim=5, image_size=64, vla=VLAConfig(encoder=encoder, channels=[8, 16, 16], hidden=32)
    )
    return CompactVLA(spec)


def test_policy_protocol():
    assert isinstance(state_policy(), Policy)


def test_act_logp_equals_evaluate():
    for policy, chunk in (
        (state_policy(chunk=2), 2),
        (cnn_policy(), 1),
        (cnn_policy("keypoint"), 1),
    ):
        obs = _obs(policy, 7)
        action, logp, value = policy.act(obs)
        assert action.shape == (7, 5 * chunk) and logp.shape == value.shape == (7,)
        batch = _rows(obs, action, [4, 2, 1])
        ev = policy.evaluate(batch)
        lp, ent, v = ev.logp, ev.entropy, ev.value
        assert lp.shape == ent.shape == v.shape == (3, 4)
        valid = batch.mask.bool()
        torch.testing.assert_close(lp[valid], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[valid], value, rtol=1e-5, atol=1e-5)
        assert (lp[~valid] == 0).all() and (ent[valid] > -100).all()
        det, _, _ = policy.act(obs, deterministic=True)
        assert not torch.equal(det, action)  # sampling adds noise; the mean does not


def test_evaluate_has_gradients_for_all_heads():
    policy = state_policy()
    obs = _obs(policy, 5)
    action, _, _ = policy.act(obs)
    ev = policy.evaluate(_rows(obs, action, [5]))
    lp, ent, v = ev.logp, ev.entropy, ev.value
    (lp.sum() + ent.sum() + v.sum()).backward()
    for name in ("mean_head.weight", "value_head.weight", "log_std", "instr.embed.weight"):
        grad = dict(policy.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


@pytest.mark.parametrize("encoder", ["cnn", "keypoint"])
def test_cnn_output_depends_on_image_and_instruction(encoder):
    policy = cnn_policy(encoder)
    with torch.no_grad():  # make FiLM non-trivial so the instruction matters
        for film in policy.films:
            film.proj.weight.normal_(0, 0.5)
    obs = _obs(policy, 2)
    obs["image"][1] = obs["image"][0]
    obs["proprio"][1] = obs["proprio"][0]
    m, _ = policy(obs)
    torch.testing.assert_close(m[0], m[1])
    other = dict(obs, image=obs["image"].clone())
    other["image"][1] = 255 - other["image"][1]
    assert not torch.allclose(policy(other)[0][0], policy(other)[0][1])
    words = obs["words"].clone()
    words[1] = encode_words(["reach the blue target"], policy.vocab, policy.spec.vla.max_words)[0]
    assert not torch.allclose(*policy(dict(obs, words=words))[0])


def test_two_cameras_share_the_tower_and_both_matter():
    torch.manual_seed(0)
    spec = CompactSpec(
        action_dim=5, cameras=2, vla=VLAConfig(encoder="keypoint", channels=[8, 16, 16], hidden=32)
    )
    policy = CompactVLA(spec)
    obs = _obs(policy, 3)
    action, logp, _ = policy.act(obs)
    lp = policy.evaluate(_rows(obs, action, [2, 1])).logp
    torch.testing.assert_close(lp[_rows(obs, action, [2, 1]).mask.bool()], logp)
    for cam in (slice(0, 3), slice(3, 6)):  # changing either camera changes the action mean
        other = dict(obs, image=obs["image"].clone())
        other["image"][..., cam] = 255 - other["image"][..., cam]
        assert not torch.allclose(policy(other)[0], policy(obs)[0])


def asym_policy() -> CompactVLA:
    torch.manual_seed(0)
    spec = CompactSpec(
        action_dim=5,
        objects_dim=21,
        vla=VLAConfig(encoder="keypoint", channels=[8, 16, 16], hidden=32, critic="state"),
    )
    return CompactVLA(spec)


def test_state_critic_reads_poses_and_the_actor_does_not():
    policy = asym_policy()
    assert policy.obs_keys() == ("image", "proprio", "words", "objects")
    obs = _obs(policy, 4)
    mean, value = policy(obs)
    moved = dict(obs, objects=obs["objects"] + 1.0)
    mean2, value2 = policy(moved)
    torch.testing.assert_close(mean2, mean)  # the actor never sees the true poses
    assert not torch.allclose(value2, value)
    other = dict(obs, image=255 - obs["image"])
    torch.testing.assert_close(policy(other)[1], value)  # the critic never sees the pixels
    action, logp, v = policy.act(obs)
    ev = policy.evaluate(_rows(obs, action, [3, 1]))
    lp, vv = ev.logp, ev.value
    valid = _rows(obs, action, [3, 1]).mask.bool()
    torch.testing.assert_close(lp[valid], logp)
    torch.testing.assert_close(vv[valid], v)
    vv.sum().backward()  # value gradients reach only the critic
    grads = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.any()}
    assert grads and all(n.startswith("critic.") for n in grads), grads


def test_subject_auxiliary_loss_trains_the_actor_features_only():
    torch.manual_seed(0)
    spec = CompactSpec(
        action_dim=5,
        objects_dim=21,
        vla=VLAConfig(
            encoder="keypoint", channels=[8, 16, 16], hidden=32, aux="subject", aux_coef=2.0
        ),
    )
    policy = CompactVLA(spec)
    obs = _obs(policy, 5)
    action, logp, _ = policy.act(obs)
    batch = _rows(obs, action, [3, 2])
    ev = policy.evaluate(batch)
    lp, aux = ev.logp, ev.aux
    torch.testing.assert_close(lp[batch.mask.bool()], logp)
    assert set(aux) == {"subject"} and aux["subject"].shape == (2, 3)
    loss = aux["subject"]
    assert (loss[batch.mask == 0] == 0).all() and (loss[batch.mask > 0] > 0).all()
    loss.sum().backward()
    grads = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.any()}
    assert {"aux_head.weight", "convs.0.weight", "trunk.0.weight"} <= grads
    assert not grads & {"mean_head.weight", "log_std", "value_head.weight"}
    # by hand: a head that guesses 0 scores 2 x the mean square of (entity 0 - tcp) / 0.1 m
    with torch.no_grad():
        policy.aux_head.weight.zero_()
        policy.aux_head.bias.zero_()
    rel = (obs["objects"][:, :3] - obs["proprio"][:, :3]) / 0.1  # the workspace centre cancels
    aux = policy.evaluate(batch).aux
    torch.testing.assert_close(aux["subject"][batch.mask > 0], 2.0 * rel.square().mean(1))


def test_privileged_options_need_poses_to_train_not_to_act():
    with pytest.raises(ValueError, match="privileged_state"):
        CompactVLA(CompactSpec(action_dim=5, vla=VLAConfig(encoder="keypoint", critic="state")))
    with pytest.raises(ValueError, match="vla.critic"):
        CompactVLA(CompactSpec(action_dim=5, vla=VLAConfig(critic="twin")))
    from perceptrl.sim.vector import Batch

    policy = asym_policy()
    img = {"agentview": torch.zeros(1, 64, 64, 3, dtype=torch.uint8).numpy()}
    batch = Batch(img, torch.zeros(1, 8).numpy(), None, ["reach the red target"])
    obs = policy.observe(batch)  # an env without poses: the actor still acts (evaluation)
    assert "objects" not in obs
    action, _, value = policy.act(obs, deterministic=True)
    assert torch.isfinite(action).all() and torch.isnan(value).all()
    with_poses = dict(obs, objects=torch.zeros(1, 21))
    torch.testing.assert_close(policy.act(with_poses, deterministic=True)[0], action)
    with pytest.raises(KeyError, match="objects"):  # training needs them
        policy.evaluate(_rows(obs, action, [1]))


def test_spatial_softmax_returns_peak_positions():
    ssm = SpatialSoftmax(16, 16)
    maps = torch.zeros(2, 3, 16, 16)
    maps[0, 0, 3, 12] = maps[0, 1, 0, 0] = maps[1, 2, 15, 15] = 50.0  # sharp peaks
    kp = ssm(maps).view(2, 3, 2)  # (N, C, (x, y))
    grid = torch.linspace(-1, 1, 16)
    torch.testing.assert_close(kp[0, 0], torch.stack([grid[12], grid[3]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(kp[0, 1], torch.tensor([-1.0, -1.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(kp[1, 2], torch.tensor([1.0, 1.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(kp[0, 2], torch.zeros(2), atol=1e-6, rtol=0)  # flat map: centre
    try:
        ssm(torch.zeros(1, 3, 8, 8))
    except ValueError as e:
        assert "image size" in str(e)
    else:
        raise AssertionError("expected ValueError for a map of the wrong size")


def test_instruction_vocabulary_and_unknown_words():
    words = instruction_words()
    assert {"reach", "red", "bowl", "stack"} <= set(words)
    policy = state_policy()
    ids = encode_words(["Reach the RED xylophone target", ""], policy.vocab, 4)
    assert ids.shape == (2, 4)
    assert ids[0, 3] == UNK and (ids[0, :3] > UNK).all() and (ids[1] == 0).all()


def test_save_load_round_trip(tmp_path):
    policy = state_policy()
    obs = _obs(policy, 3)
    policy.save(tmp_path / "m")
    loaded = load_policy(tmp_path / "m")
    assert isinstance(loaded, CompactVLA)
    torch.testing.assert_close(loaded.act(obs, True)[0], policy.act(obs, True)[0])
    other = state_policy()
    with torch.no_grad():
        other.log_std.fill_(3.0)
    params = [p.data_ptr() for p in other.parameters()]
    other.load(tmp_path / "m")
    assert [p.data_ptr() for p in other.parameters()] == params  # in place
    torch.testing.assert_close(other.log_std, policy.log_std)
    # config.json nests the recipe's vla section; older checkpoints hold its fields flat
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["vla"]["encoder"] == "state" and "encoder" not in saved
    flat = {**{k: v for k, v in saved.items() if k != "vla"}, **saved["vla"], "policy": "compact"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(flat))
    old = load_policy(tmp_path / "m")
    assert old.spec == policy.spec
    torch.testing.assert_close(old.act(obs, True)[0], policy.act(obs, True)[0])


def test_load_names_missing_files(tmp_path):
    from perceptrl.errors import ModelError

    try:
        CompactVLA.from_pretrained(tmp_path)
    except ModelError as e:
        assert "config.json" in str(e) and "model.safetensors" in str(e)
    else:
        raise AssertionError("expected ModelError")
