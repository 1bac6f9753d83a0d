"""`ReplayBuffer` (trainer/replay.py): transitions against hand-made episodes, n-step returns,
final observations of cut episodes, wrap-around, and an exact round trip of its state."""

from __future__ import annotations

import pytest
import torch

from perceptrl.trainer.replay import ReplayBuffer

T, F_ = True, False


def obs_of(values):
    """Observations of 2 envs whose one feature names the step (and an image-like key)."""
    v = torch.tensor(values, dtype=torch.float32)
    return {
        "x": v[:, None],
        "image": (v[:, None, None, None] * 10).to(torch.uint8).expand(-1, 2, 2, 3),
    }


def fill(buf, steps):
    """steps: (obs values [2], reward [2], terminated [2], ended [2], final values [2] or None)"""
    for values, reward, term, ended, final in steps:
        buf.add(
            obs_of(values), torch.tensor(values, dtype=torch.float32)[:, None] * 0.1,
            torch.tensor(reward, dtype=torch.float32), torch.tensor(term), torch.tensor(ended),
            obs_of(final) if final is not None else None,
        )  # fmt: skip


# env 0: obs 1, 2, 3 (terminated at 3), then 10, 11 ...; env 1: obs 5, 6 (time limit: final 7),
# then 20, 21 ...
EPISODES = [
    ([1, 5], [1.0, 2.0], [F_, F_], [F_, F_], None),
    ([2, 6], [1.0, 2.0], [F_, F_], [F_, T], [0, 7]),
    ([3, 20], [1.0, 2.0], [T, F_], [T, F_], None),
    ([10, 21], [1.0, 2.0], [F_, F_], [F_, F_], None),
]


def transitions(buf, n_step, gamma=0.5, m=400):
    b = buf.sample(m, gamma, n_step)
    out = {}
    for i in range(m):
        key = float(b.obs["x"][i])
        out[key] = (float(b.reward[i]), float(b.discount[i]), float(b.next_obs["x"][i]))
        assert float(b.action[i, 0]) == pytest.approx(key * 0.1)
        assert int(b.obs["image"][i, 0, 0, 0]) == int(key * 10) % 256
    return out


def test_one_step_transitions_follow_the_episodes():
    buf = ReplayBuffer(8, 2, obs_of([0, 0]), 1)
    fill(buf, EPISODES)
    got = transitions(buf, 1)
    # the newest row (10, 21) is not sampled: its next observations are not stored yet
    assert got == {
        1.0: (1.0, 0.5, 2.0), 2.0: (1.0, 0.5, 3.0), 3.0: (1.0, 0.0, 10.0),  # terminal: no bootstrap
        5.0: (2.0, 0.5, 6.0), 6.0: (2.0, 0.5, 7.0),  # cut by the time limit: its final obs 7
        20.0: (2.0, 0.5, 21.0),
    }  # fmt: skip


def test_n_step_returns_stop_at_episode_ends():
    buf = ReplayBuffer(8, 2, obs_of([0, 0]), 1)
    fill(buf, EPISODES)
    got = transitions(buf, 3)
    assert got[1.0] == (1.0 + 0.5 + 0.25, 0.0, 10.0)  # 1 -> 2 -> 3 (terminal)
    assert got[2.0] == (1.0 + 0.5, 0.0, 10.0)
    assert got[5.0] == (2.0 + 1.0, 0.25, 7.0)  # 5 -> 6 -> cut: bootstrap from 7 at gamma^2
    assert got[20.0] == (2.0, 0.5, 21.0)  # the window stops before the newest row


def test_wrap_around_keeps_the_newest_rows():
    buf = ReplayBuffer(3, 2, obs_of([0, 0]), 1)
    steps = [([k, 100 + k], [k, k], [F_, F_], [F_, F_], None) for k in range(1, 7)]
    fill(buf, steps)
    got = transitions(buf, 1)
    assert sorted(got) == [4.0, 5.0, 104.0, 105.0]  # rows 4, 5 (6 is the newest)
    assert got[5.0][2] == 6.0


def test_overwritten_final_observations_retire_their_transitions():
    buf = ReplayBuffer(4, 2, obs_of([0, 0]), 1)  # room for 2 final observations (one row)
    cut = lambda k: ([k, 50 + k], [0, 0], [F_, F_], [T, T], [k + 0.5, 50.5 + k])  # noqa: E731
    fill(buf, [cut(1), ([2, 52], [0, 0], [F_, F_], [F_, F_], None)])
    got = transitions(buf, 1)
    assert sorted(got) == [1.0, 51.0] and got[1.0][2] == 1.5 and got[51.0][2] == 51.5
    fill(buf, [cut(3)])  # its final observations take the slots of step 1's
    got = transitions(buf, 1)
    assert sorted(got) == [2.0, 3.0, 52.0, 53.0] and got[3.0][2] == 3.5 and got[2.0][2] == 3.0


def test_state_round_trip_samples_the_same():
    buf = ReplayBuffer(8, 2, obs_of([0, 0]), 1, seed=3)
    fill(buf, EPISODES)
    buf.sample(5, 0.9, 2)  # moves the generator
    copy = ReplayBuffer.from_state(buf.state_dict())
    a, b = buf.sample(16, 0.9, 2), copy.sample(16, 0.9, 2)
    for x, y in zip((a.obs["x"], a.reward, a.discount, a.next_obs["image"]),
                    (b.obs["x"], b.reward, b.discount, b.next_obs["image"])):  # fmt: skip
        assert torch.equal(x, y)
    assert buf.nbytes() > 0


def test_idle_envs_and_dropped_rows_are_never_sampled():
    buf = ReplayBuffer(8, 2, obs_of([0, 0]), 1)
    buf.add(obs_of([1, 5]), torch.tensor([[0.1], [0.5]]), torch.zeros(2), torch.tensor([F_, F_]),
            torch.tensor([F_, F_]), acted=torch.tensor([T, F_]))  # fmt: skip
    fill(buf, [([2, 6], [0, 0], [F_, F_], [F_, F_], None)])
    assert sorted(transitions(buf, 1)) == [1.0]
    buf.drop_newest()
    fill(buf, [([3, 7], [0, 0], [F_, F_], [F_, F_], None)])
    assert sorted(transitions(buf, 1)) == [1.0]  # row 2's next observations were lost
    with pytest.raises(ValueError, match="no complete transition"):
        ReplayBuffer(4, 1, {"x": torch.zeros(1, 1)}, 1).sample(1, 0.9)
