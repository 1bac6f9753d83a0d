"""Rollout records (trainer/records.py): what a record holds, that it stays bounded, that a
resumed run ends with the records of the uninterrupted one, and that recording never changes a
run or stops it."""

from __future__ import annotations

import copy
import logging

import torch

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.engine import build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.trainer.metrics import read_metrics
from perceptrl.trainer.records import (
    RolloutRecorder,
    pick_groups,
    read_records,
    record_files,
    row_fields,
)
from perceptrl.trainer.segments import OBSERVATION as OB
from perceptrl.trainer.segments import POLICY as P
from perceptrl.trainer.segments import Segments


def fit(cfg, policy, source, run_dir, resume=False):
    trainer = Trainer(cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train))
    trainer.fit(resume=resume)
    return trainer


def recording(config, steps, every=2, groups=2, keep=50):
    cfg = config(steps=steps)
    cfg.log.rollouts_every, cfg.log.rollouts_groups, cfg.log.rollouts_keep = every, groups, keep
    return cfg


def test_a_record_holds_the_groups_with_their_per_token_values(toy, tmp_path):
    Policy, Source, config = toy
    torch.manual_seed(0)
    fit(recording(config, 4), Policy(), Source(groups=4, group_size=3), tmp_path)
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4]  # step 1, then every 2
    groups = records[-1]["groups"]
    assert [g["group"] for g in groups] == [0, 3]  # spread over the 4 groups
    for g in groups:
        assert len(g["rows"]) == 3
        for row in g["rows"]:
            n = len(row["adv"])
            assert n == row["length"] and len(row["logp"]) == n  # ragged rows: own length
            assert all(lp <= 0 for lp in row["logp"])
            # GRPO: one advantage per row, broadcast over its tokens
            assert len(set(row["adv"])) == 1


def test_the_recorded_log_probs_are_the_behaviour_policys(toy, tmp_path):
    """An on-policy step records the log-probs its own forward took, before the update."""
    Policy, Source, config = toy
    policy = Policy()
    with torch.no_grad():
        policy.logits.normal_()
    before = torch.log_softmax(policy.logits.detach().clone(), -1)
    fit(recording(config, 1), policy, Source(groups=2, group_size=2), tmp_path)
    (record,) = read_records(tmp_path)
    assert not torch.equal(before, torch.log_softmax(policy.logits.detach(), -1))  # it learnt
    same = Policy()
    with torch.no_grad():
        same.logits.copy_(before)  # the same distribution (log-softmax is shift-invariant)
    torch.manual_seed(0)  # the trainer seeds 0 before its first step: the same tokens again
    batch, _ = Source(groups=2, group_size=2).collect(same, 0)
    for g in record["groups"]:
        for row in g["rows"]:
            tokens = batch.tokens[row["row"], : row["length"]]
            expect = before[torch.arange(len(tokens)), tokens]
            torch.testing.assert_close(torch.tensor(row["logp"]), expect.float(), atol=1e-4, rtol=0)


def test_records_stay_bounded(toy, tmp_path):
    Policy, Source, config = toy
    fit(recording(config, 10, every=1, keep=3), Policy(), Source(), tmp_path)
    assert [s for _, s in record_files(tmp_path / "rollouts")] == [1, 9, 10]


def test_a_resumed_run_ends_with_the_uninterrupted_runs_records(toy, tmp_path):
    Policy, Source, config = toy
    cfg = recording(config, 6)
    cfg.checkpoint.every = 3
    torch.manual_seed(0)
    fit(cfg, Policy(), Source(), tmp_path / "full")
    cut = copy.deepcopy(cfg)
    cut.train.steps = 4  # past its checkpoint at 3: the record of step 4 is written twice
    torch.manual_seed(0)
    fit(cut, Policy(), Source(), tmp_path / "cut")
    fit(cfg, Policy(), Source(), tmp_path / "cut", resume=True)
    assert read_records(tmp_path / "cut") == read_records(tmp_path / "full")


def test_recording_leaves_the_run_unchanged(toy, tmp_path):
    Policy, Source, config = toy
    runs = {}
    for every in (0, 1):
        torch.manual_seed(0)
        fit(recording(config, 5, every=every), Policy(), Source(), tmp_path / str(every))
        rows = read_metrics(tmp_path / str(every) / "metrics.jsonl")
        runs[every] = [{k: v for k, v in r.items() if not k.startswith(("time/", "sys/"))}
                       for r in rows]  # fmt: skip
    assert runs[0] == runs[1]
    assert not (tmp_path / "0" / "rollouts").exists()


class BrokenDescribe:
    """A source whose record fields cannot be built."""

    def __init__(self, inner):
        self.inner = inner

    def collect(self, policy, step):
        return self.inner.collect(policy, step)

    def describe_group(self, policy, batch, rows):
        raise RuntimeError("no thumbnails today")


def test_a_failing_record_warns_once_and_the_run_goes_on(toy, tmp_path, caplog):
    Policy, Source, config = toy
    with caplog.at_level(logging.WARNING, logger="perceptrl.trainer.records"):
        fit(recording(config, 4, every=1), Policy(), BrokenDescribe(Source()), tmp_path)
    warned = [r for r in caplog.records if "rollout records stopped" in r.getMessage()]
    assert len(warned) == 1 and "no thumbnails today" in warned[0].getMessage()
    assert max(r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")) == 4
    assert read_records(tmp_path) == []


def test_pick_groups_and_row_fields_of_an_episode_batch():
    """Rows keep their positions up to their last loss token (observation tokens inside stay,
    with their mask), tree nodes, process rewards and per-step values."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    batch = RolloutBatch(
        tokens=torch.zeros(2, 6, dtype=torch.long), mask=mask, group_id=torch.tensor([7, 7]),
        rewards=torch.tensor([1.0, 0.0]), advantages=torch.ones(2, 6) * 0.5,
        segments=Segments.from_tokens(
            torch.tensor([[1, 1, 1, 1, 2, 0], [1, 1, 3, 0, 0, 0]]),
            torch.tensor([[P, P, OB, OB, P, 0], [P, P, P, 0, 0, 0]]), torch.tensor([7, 7]), True,
        ),
        step_rewards=torch.zeros(2, 6),
    )  # fmt: skip
    assert pick_groups(batch, 4) == [[0, 1]]
    row = row_fields(batch, 0)
    assert row["length"] == 3 and row["mask"] == [1, 1, 0, 0, 1]
    assert row["nodes"] == [1, 1, 0, 0, 3] and row["adv"] == [0.5] * 5  # observations: 0
    assert "mask" not in row_fields(batch, 1) and row_fields(batch, 1)["nodes"] == [1, 1, 4]


def test_a_damaged_record_file_is_skipped(tmp_path, caplog):
    rec = RolloutRecorder(tmp_path, every=1, groups=1, keep=5)
    batch = RolloutBatch(
        tokens=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3),
        group_id=torch.tensor([0, 1]), rewards=torch.tensor([1.0, 0.0]),
    )  # fmt: skip
    rec.record(1, batch)
    rec.record(2, batch)
    path = tmp_path / "rollouts" / "step_000002.json.gz"
    path.write_bytes(path.read_bytes()[:10])  # cut short
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_records(tmp_path)] == [1]
    assert "step_000002.json.gz" in caplog.text


def test_values_that_are_not_finite_are_recorded_as_null():
    """The viewer embeds the records as JSON, which has no NaN."""
    batch = RolloutBatch(
        tokens=torch.zeros(1, 2, dtype=torch.long), mask=torch.ones(1, 2),
        group_id=torch.tensor([0]), rewards=torch.tensor([float("nan")]),
        values_old=torch.tensor([[0.5, float("nan")]]),
    )  # fmt: skip
    row = row_fields(batch, 0)
    assert row["reward"] is None and row["values"] == [0.5, None]
