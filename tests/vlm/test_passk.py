"""pass@k: the unbiased estimator against brute force over all k-subsets, and the evaluation on a
tiny policy with rewards whose answers are known (always right, never right, right by a rule the
test can recount)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from perceptrl.vlm.passk import evaluate_pass_k, pass_at_k, write_pass_k
from perceptrl.vlm.policy import VLMPolicy


@pytest.mark.parametrize("n", [1, 3, 6])
def test_estimator_is_the_chance_a_k_subset_holds_a_correct_answer(n):
    for c in range(n + 1):
        answers = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(answers, k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@pytest.fixture(scope="module")
def pol(tiny_dirs) -> VLMPolicy:
    return VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])


def rule_reward(calls: list):
    """Correct when the answer has an even number of characters; records every call."""

    def reward(completions, samples, ctx=None):
        scores = [float(len(c) % 2 == 0) for c in completions]
        calls.extend(zip([s["id"] for s in samples], scores))
        return scores, {}, {}

    return reward


def test_evaluation_counts_correct_answers_per_question(pol, samples):
    calls: list = []
    torch.manual_seed(0)
    r = evaluate_pass_k(pol, samples, rule_reward(calls), [1, 2, 4], 4, batch_size=4,
                        max_new_tokens=6)  # fmt: skip
    assert r["questions"] == len(samples) == len(r["correct"])
    recount = {s["id"]: 0 for s in samples}
    for sid, score in calls:
        recount[sid] += int(score)
    assert r["correct"] == [recount[s["id"]] for s in samples]
    assert len(calls) == 4 * len(samples)
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, c, k) for c in r["correct"]) / len(samples)
        assert r["overall"][k] == pytest.approx(want)
    assert {row["family"] for row in r["rows"]} == {"count", "mcq"}
    assert sum(row["questions"] for row in r["rows"]) == len(samples)


def test_known_answers_and_the_report(pol, samples, tmp_path):
    def always(value):
        return lambda completions, samples, ctx: ([value] * len(completions), {}, {})

    right = evaluate_pass_k(pol, samples[:2], always(1.0), [1, 2], 2, max_new_tokens=4)
    wrong = evaluate_pass_k(pol, samples[:2], always(0.0), [1, 2], 2, max_new_tokens=4)
    assert right["overall"] == {1: 1.0, 2: 1.0} and wrong["overall"] == {1: 0.0, 2: 0.0}
    out = write_pass_k({"right": right, "wrong": wrong}, tmp_path)
    assert "| right | all | all | 2 | 1.000 | 1.000 |" in out["table"]
    saved = json.loads((tmp_path / "passk.json").read_text())
    assert saved["wrong"]["overall"] == {"1": 0.0, "2": 0.0}
    assert (tmp_path / "passk.png").stat().st_size > 0
    with pytest.raises(ValueError, match="1..2"):
        evaluate_pass_k(pol, samples[:1], always(1.0), [4], 2)


class OneTurn:
    """An episode environment that ends every episode after the policy's first turn."""

    def reset(self, samples):
        pass

    def respond(self, row, text):
        return None


def test_episode_answers_reach_the_reward_with_their_records(tiny_dirs, samples):
    """A policy with episode settings samples episodes; the reward gets one record per answer
    (episode terms such as the planner's task success score from them, not from the text)."""
    from perceptrl.vlm.episode import EpisodeSettings

    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    pol.episode = EpisodeSettings(env=OneTurn, max_tokens=64)
    seen: list = []

    def from_records(completions, samples, ctx):
        seen.append(None if ctx.episodes is None else len(ctx.episodes))
        return [float(ctx.episodes is not None)] * len(completions), {}, {}

    r = evaluate_pass_k(pol, samples[:2], from_records, [1, 2], 2, max_new_tokens=4)
    assert seen == [4] and r["overall"] == {1: 1.0, 2: 1.0}


def test_the_plan_recipe_scores_pass_k_by_task_success():
    import perceptrl.vla.plan_env  # noqa: F401  (registers the planner's episode environment)
    from perceptrl.cli import CONFIGS
    from perceptrl.vlm.run_plan import EVAL_REWARD, resolve
    from perceptrl.wiring import load_config

    def eval_reward(recipe):
        return resolve(load_config(CONFIGS / recipe)).evaluation.reward

    assert eval_reward("plan_grpo.yaml") == {"plan_success": 1.0}
    assert eval_reward("vlm_clevr.yaml") == EVAL_REWARD
