"""Composite rewards: weights, components, stats, raising / slow / invalid components."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from perceptrl.registry import REWARDS
from perceptrl.rewards import RewardTimeout, build_reward, call_with_timeout


def S(answer: str, reward: str = "numeric", **meta) -> dict:
    return {
        "id": f"s-{answer}",
        "images": [],
        "question": "q",
        "answer": answer,
        "reward": reward,
        "family": "f",
        "meta": meta,
    }


GOOD = "<think>x</think><answer>3</answer>"
COMPLETIONS = [GOOD, "<answer>3</answer>", "<think>x</think><answer>4</answer>", "garbage"]
SAMPLES = [S("3")] * 4


# helpers reached through "module:function" specs ------------------------------------------


def slow_reward(completions, samples, ctx):
    time.sleep(5.0)
    return [1.0] * len(completions)


def stubborn_slow_reward(completions, samples, ctx):
    """Tries to swallow the timeout with a broad except; must not succeed."""
    try:
        time.sleep(5.0)
    except Exception:
        return [1.0] * len(completions)
    return [1.0] * len(completions)


def short_sleep_reward(completions, samples, ctx):
    time.sleep(0.6)
    return [1.0] * len(completions)


def two_arguments(completions, samples):
    return [1.0] * len(completions)


@REWARDS.register("test_compose_boom")
def boom(completions, samples, ctx):
    """Raises on any batch holding a sample with meta["boom"]; else 1 per completion."""
    if any(s["meta"].get("boom") for s in samples):
        raise RuntimeError("boom")
    return [1.0] * len(completions)


@REWARDS.register("test_compose_invalid")
def invalid(completions, samples, ctx):
    return [float("nan"), "x", 2.0][: len(completions)]


@REWARDS.register("test_compose_wrong_len")
def wrong_len(completions, samples, ctx):
    return []


# ---------------------------------------------------------------------------------------------


def test_weighted_sum_components_and_stats():
    reward = build_reward({"format": 0.5, "accuracy": 1.0})
    totals, comps, stats = reward(COMPLETIONS, SAMPLES)
    assert comps == {"format": [1.0, 0.0, 1.0, 0.0], "accuracy": [1.0, 1.0, 0.0, 0.0]}
    assert totals == [1.5, 1.0, 0.5, 0.0]
    assert stats["reward/total"] == 0.75
    assert stats["reward/format"] == 0.5 and stats["reward/accuracy"] == 0.5
    assert stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0
    assert reward.names == ["format", "accuracy"]


def test_list_and_string_specs_weight_one():
    for spec in (["format", "numeric"], "format, numeric"):
        totals, comps, _ = build_reward(spec)(COMPLETIONS, SAMPLES)
        assert totals == [2.0, 1.0, 1.0, 0.0] and list(comps) == ["format", "numeric"]


def test_term_parameters_and_errors_in_spec():
    spec = {"numeric": {"weight": 2.0, "abs_tol": 1}}
    totals, comps, _ = build_reward(spec)(["<answer>4</answer>"], [S("3")])
    assert totals == [2.0] and comps["numeric"] == [1.0]
    with pytest.raises(ValueError, match=r"does not take parameters \['tol'\].*rel_tol, abs_tol"):
        build_reward({"numeric": {"tol": 1}})
    with pytest.raises(ValueError, match="unknown reward 'acuracy'.*valid:"):
        build_reward({"acuracy": 1.0})
    with pytest.raises(ValueError, match=r"must take \(completions, samples, ctx\)"):
        build_reward([f"{__name__}:two_arguments"])  # checked once, when the reward is built
    with pytest.raises(ValueError, match="weight must be a finite number"):
        build_reward({"format": float("inf")})
    with pytest.raises(ValueError, match="empty reward spec"):
        build_reward({})
    reward = build_reward(["format"])
    assert build_reward(reward) is reward


def test_raising_component_fails_only_its_samples():
    samples = [S("3"), S("3", boom=True), S("3"), S("3", boom=True)]
    reward = build_reward({"test_compose_boom": 1.0, "format": 1.0})
    totals, comps, stats = reward(COMPLETIONS, samples)
    assert comps["test_compose_boom"] == [1.0, 0.0, 1.0, 0.0]
    assert comps["format"] == [1.0, 0.0, 1.0, 0.0]
    assert totals == [2.0, 0.0, 2.0, 0.0]
    assert stats["reward/errors"] == 2 and stats["reward/errors/test_compose_boom"] == 2
    assert stats["reward/errors/format"] == 0 and stats["reward/timeouts"] == 0


def test_bad_ground_truth_counts_as_error_not_crash():
    samples = [S("3"), S("lots"), S("[1, 2]", "iou")]
    totals, _, stats = build_reward(["accuracy"])([GOOD, GOOD, GOOD], samples)
    assert totals == [1.0, 0.0, 0.0] and stats["reward/errors/accuracy"] == 2


def test_invalid_outputs_count_as_errors():
    _, comps, stats = build_reward(["test_compose_invalid"])(["a", "b", "c"], [S("1")] * 3)
    assert comps["test_compose_invalid"] == [0.0, 0.0, 2.0] and stats["reward/errors"] == 2
    _, comps, stats = build_reward(["test_compose_wrong_len"])(["a", "b"], [S("1")] * 2)
    assert comps["test_compose_wrong_len"] == [0.0, 0.0] and stats["reward/errors"] == 2


def test_slow_component_times_out_on_main_thread():
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGALRM)
    for name in ("slow_reward", "stubborn_slow_reward"):
        spec = {f"{__name__}:{name}": 1.0, "format": 1.0}
        t0 = time.perf_counter()
        totals, comps, stats = build_reward(spec, timeout_s=0.2)(COMPLETIONS, SAMPLES)
        assert time.perf_counter() - t0 < 2.0
        assert comps[f"{__name__}:{name}"] == [0.0] * 4 and comps["format"] == [1.0, 0.0, 1.0, 0.0]
        assert stats["reward/timeouts"] == 4 and stats[f"reward/timeouts/{__name__}:{name}"] == 4
        assert stats["reward/errors"] == 0 and totals == [1.0, 0.0, 1.0, 0.0]
    assert signal.getsignal(signal.SIGALRM) is before  # handler restored, timer cleared
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_slow_component_times_out_off_main_thread():
    result = {}
    spec = {f"{__name__}:short_sleep_reward": 1.0}

    def worker():
        result["out"] = build_reward(spec, timeout_s=0.1)(["a", "b"], [S("1")] * 2)

    t = threading.Thread(target=worker)
    t.start()
    t.join(5.0)
    totals, _, stats = result["out"]
    assert totals == [0.0, 0.0] and stats["reward/timeouts"] == 2


def test_timeout_disabled_and_fast_calls_pass():
    spec = {f"{__name__}:short_sleep_reward": 1.0}
    totals, _, stats = build_reward(spec, timeout_s=None)(["a"], [S("1")])
    assert totals == [1.0] and stats["reward/timeouts"] == 0
    assert call_with_timeout(lambda x: x + 1, 1.0, 1) == 2
    with pytest.raises(RewardTimeout):
        call_with_timeout(time.sleep, 0.05, 1.0)
