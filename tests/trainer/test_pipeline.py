"""The rollout pipeline (trainer/pipeline.py) on a local Ray cluster with the toy policy and
source: policy versions and staleness in one_step_off and async, stale chunks dropped, dead and
hung workers restarted while training continues. Ray starts once for the module (seconds)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.engine import build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.trainer.pipeline import (
    PipelineError,
    PipelineSource,
    RankShards,
    _join,
    shard_groups,
)
from perceptrl.trainer.records import read_records

ray = pytest.importorskip("ray")


def toy_worker(slow_from: int, index: int):
    """A pipeline worker's (policy, source): the toy ones of conftest.py (passed by value)."""
    policy_cls, source_cls = toy_worker.classes
    if slow_from == -2:  # a worker that cannot be built (e.g. a recipe its process rejects)
        raise ValueError("this worker's recipe names an environment its process lacks")
    source = source_cls(groups=2, group_size=4)
    if slow_from >= 0:  # every call from the slow_from-th on hangs (a stuck worker)
        inner = source.collect

        def collect(policy, step):
            if source.calls >= slow_from:
                time.sleep(3600)
            return inner(policy, step)

        source.collect = collect
    return policy_cls(), source


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture
def make(toy, cluster, tmp_path):
    Policy, Source, config = toy
    toy_worker.classes = (Policy, Source)
    ray.cloudpickle.register_pickle_by_value(sys.modules[Policy.__module__])
    made = []

    def build(mode, steps=3, workers=1, slow_from=-1, **kw):
        cfg = config(steps=steps)
        source = PipelineSource(mode, toy_worker, (slow_from,), workers=workers, **kw)
        made.append(source)
        policy, run_dir = Policy(), tmp_path / f"{mode}{len(made)}"
        return Trainer(cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train)), source

    yield build
    for s in made:
        s.close()


def _rows(run_dir):
    from perceptrl.trainer.metrics import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "pipeline/staleness_max" in r]


def test_join_numbers_groups_records_versions_and_hands_over_behaviour_logps():
    def chunk(v, gid):
        b = RolloutBatch(
            tokens=torch.zeros(4, 2, dtype=torch.long), mask=torch.ones(4, 2),
            group_id=torch.tensor(gid), logp_old=torch.full((4, 2), -1.0),
            values_old=torch.zeros(4, 2),
        )  # fmt: skip
        return b

    on = _join([chunk(3, [0, 0, 5, 5]), chunk(3, [0, 0, 1, 1])], [3, 3], step=3)
    assert on.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert on.policy_version.tolist() == [3] * 8 and on.logp_old is not None  # on-policy: kept
    off = _join([chunk(2, [0, 0, 1, 1])], [2], step=3)
    assert off.logp_old is None and off.values_old is None  # the trainer scores the proximal
    assert torch.equal(off.logp_rollout, torch.full((4, 2), -1.0))  # the behaviour log-probs


def test_rank_shards_are_whole_groups_the_same_number_per_rank():
    """Rank 0 splits a step's batch over the ranks: whole groups, in order, the same number
    each (one more rank's worth of groups would make that rank step more often); leftovers
    dropped and counted; fewer groups than ranks is an error."""
    gid = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4])  # 5 groups (one of 3 rows)
    batch = RolloutBatch(
        tokens=torch.arange(11)[:, None], mask=torch.ones(11, 1), group_id=gid,
        rewards=torch.arange(11.0),
    )  # fmt: skip
    shards, dropped = shard_groups(batch, 2)
    assert dropped == 1
    assert [s.group_id.tolist() for s in shards] == [[0, 0, 1, 1, 1], [2, 2, 3, 3]]
    assert shards[1].tokens.squeeze(1).tolist() == [5, 6, 7, 8]  # rows travel with their group
    assert shard_groups(batch, 5)[1] == 0
    with pytest.raises(PipelineError, match="at least one group per rank"):
        shard_groups(batch, 6)
    with pytest.raises(ValueError, match="only rank 0"):
        RankShards(None, 0, 2)


def test_one_step_off_is_one_version_old_and_trains(make):
    seen = []

    def describe(policy, batch, rows):  # the side's record fields, in the trainer's process
        seen.append(policy)
        return {"side": "toy"}, [{"row": r} for r in rows]

    trainer, source = make("one_step_off", steps=4, describe=describe)
    before = trainer.policy.logits.detach().clone()
    trainer.fit()
    rows = _rows(trainer.run_dir)
    assert [r["pipeline/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/samples"] == 8.0 for r in rows)
    assert not torch.equal(before, trainer.policy.logits)
    # the records of step 1 hold the side's fields next to the trainer's
    (record,) = read_records(trainer.run_dir)
    assert seen and all(p is trainer.policy for p in seen)
    group = record["groups"][0]
    assert group["side"] == "toy" and [r["row"] for r in group["rows"]] == [0, 1, 2, 3]
    assert "reward" in group["rows"][0]


def test_async_drops_chunks_past_max_staleness(make):
    trainer, source = make("async", steps=4, workers=2, max_staleness=0, buffer_chunks=2)
    step = trainer.train_step

    def after_a_pause():  # the workers fill the buffer first, so an update makes chunks stale
        time.sleep(1.0)  # however slowly a busy machine runs them (the toy chunk takes ms)
        return step()

    trainer.train_step = after_a_pause
    trainer.fit()
    rows = _rows(trainer.run_dir)
    assert len(rows) == 4 and all(r["pipeline/staleness_max"] == 0.0 for r in rows)
    assert rows[-1].get("pipeline/dropped_stale", 0) > 0  # made with weights already replaced


def test_a_killed_worker_is_restarted_and_training_continues(make):
    trainer, source = make("one_step_off", steps=5)
    trainer.train_step()  # the worker is up and has a chunk in flight for the next step
    pid = ray.get(source.workers[0].pid.remote())
    os.kill(pid, signal.SIGKILL)
    for _ in range(3):
        m = trainer.train_step()
    assert m["pipeline/worker_restarts"] >= 1 and m["pipeline/dropped_chunks"] >= 1
    assert ray.get(source.workers[0].pid.remote()) != pid


@pytest.mark.slow
def test_a_hung_worker_is_killed_and_restarted(make):
    trainer, source = make("one_step_off", slow_from=1, worker_timeout_s=2.0)
    trainer.train_step()  # the chunk in flight now is the worker's second call: it hangs
    m = trainer.train_step()  # killed after 2 s; the restarted worker's first call answers
    assert m["pipeline/worker_hangs"] >= 1 and m["pipeline/worker_restarts"] >= 1
    assert m["rollout/samples"] == 8.0


@pytest.mark.slow
def test_no_data_in_time_is_an_error_naming_the_workers(make):
    trainer, source = make("one_step_off", slow_from=0, worker_timeout_s=2.0, timeout_s=5.0)
    with pytest.raises(PipelineError, match="no rollout chunk within .*restarts so far"):
        trainer.train_step()
    assert source.counters["worker_hangs"] >= 1


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_a_worker_that_fails_every_time_stops_the_run_with_its_error(make, mode):
    """A worker whose policy or source cannot be built dies at every restart: after
    `MAX_WORKER_FAILURES` in a row the trainer gets its error, not a wait until the timeout."""
    trainer, source = make(mode, slow_from=-2, timeout_s=600.0)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"(?s)failed 3 times in a row.*lacks"):
        trainer.train_step()
    assert time.monotonic() - t0 < 120 and source.counters["worker_restarts"] == 3


def test_a_worker_imports_the_recipes_modules_before_it_builds(tmp_path, monkeypatch):
    """A pipeline worker is a process of its own: it imports the recipe's ``imports`` (the
    user's registrations) before its factory builds the policy and source."""
    import sys

    from perceptrl.trainer.pipeline import RolloutWorker

    (tmp_path / "user_regs_for_worker.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def factory(index):
        seen.append("user_regs_for_worker" in sys.modules)
        return None, None

    RolloutWorker(factory, (), 0, 1, ("user_regs_for_worker",))
    assert seen == [True]
