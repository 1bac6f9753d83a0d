"""SupervisedWorker with a stand-in handler (no model: a child starts in about a second): hangs
in native code are killed at the limit and restarted, deaths are restarted, both counted; handler
errors keep the child; repeated failures give up with the setting to change; the memory cap
applies in the child; no child outlives its parent. The real judge goes through the same paths in
test_rewards_judge.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from perceptrl.rewards.compose import CompositeReward, RewardTerm, RewardTimeout
from perceptrl.rewards.judge_worker import SupervisedWorker, WorkerError

HANDLER = '''
import os, resource, time

class Fake:
    """Stand-in for the judge model: answers requests, or hangs, dies or fails on demand."""

    def __init__(self, mode="ok"):
        if mode == "fail":
            raise ValueError("cannot load fake")
        if mode == "die":
            os._exit(7)
        if mode == "slow":
            time.sleep(30)

    def __call__(self, req):
        op = req.get("op")
        if op == "sleep":
            time.sleep(req["s"])  # native code, the GIL released: no Python timer interrupts it
        elif op == "exit":
            os._exit(3)
        elif op == "boom":
            raise ValueError("boom")
        elif op == "alloc":
            bytearray(req["n"])
        return {"pid": os.getpid(), "x": req.get("x"),
                "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0]}
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The stand-in handler class, importable here and in spawned children (sys.path travels)."""
    (tmp_path / "fake_judge_handler.py").write_text(HANDLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_judge_handler

    yield fake_judge_handler.Fake
    sys.modules.pop("fake_judge_handler", None)


@pytest.fixture
def workers():
    made = []

    def make(*args, **kw):
        made.append(SupervisedWorker(*args, name="judge", **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _gone(pid: int) -> bool:
    """The process has exited: gone, or a zombie whose every thread has ended (a killed
    multi-threaded process shows its leader as a zombie while its other threads still exit;
    only then can its parent reap it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            zombie = "zombie" in f.read()
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def test_hang_is_killed_at_the_limit_counted_and_the_next_call_works(fake, workers):
    w = workers(fake, memory_limit_gb=0)
    w.start()
    pid = w.pid
    assert w.call({"op": "echo", "x": 1}, timeout_s=30)["pid"] == pid != os.getpid()
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match="did not answer within 0.5 s; it was killed"):
        w.call({"op": "sleep", "s": 60}, timeout_s=0.5)
    assert time.monotonic() - t0 < 10 and _gone(pid) and w.restarts == 1
    out = w.call({"op": "echo", "x": 2}, timeout_s=30)  # waits for the replacement to load
    assert out["x"] == 2 and out["pid"] == w.pid != pid and w.counters() == {"restarts": 1.0}


def test_death_is_restarted_and_counted_and_handler_errors_keep_the_child(fake, workers):
    w = workers(fake, memory_limit_gb=0)
    w.start()
    pid = w.pid
    with pytest.raises(WorkerError, match="raised ValueError: boom"):
        w.call({"op": "boom"}, timeout_s=30)
    assert w.pid == pid and w.restarts == 0  # an error is an answer: the child stays
    died = "exited with code 3 while serving a call; it was restarted"
    with pytest.raises(WorkerError, match=died):
        w.call({"op": "exit"}, timeout_s=30)
    assert w.restarts == 1 and _gone(pid)
    assert w.call({"op": "echo", "x": 3}, timeout_s=30)["x"] == 3
    # killed from outside while idle (e.g. by the OOM killer): noticed at the next call
    pid = w.pid
    os.kill(pid, signal.SIGKILL)
    while not _gone(pid):
        time.sleep(0.01)
    assert w.call({"op": "echo", "x": 4}, timeout_s=30)["pid"] != pid and w.restarts == 2


def test_repeated_failures_give_up_with_the_setting_to_change(fake, workers):
    w = workers(fake, memory_limit_gb=0, max_failures=2)
    w.start()
    with pytest.raises(WorkerError, match="it was restarted"):
        w.call({"op": "exit"}, timeout_s=30)
    w.call({"op": "echo"}, timeout_s=30)  # an answer resets the count
    with pytest.raises(WorkerError, match="it was restarted"):
        w.call({"op": "exit"}, timeout_s=30)
    gave_up = "failed 2 times in a row .*max_failures=2.*memory_limit_gb"
    with pytest.raises(WorkerError, match=gave_up):
        w.call({"op": "exit"}, timeout_s=30)
    assert w.pid is None and w.restarts == 2
    with pytest.raises(WorkerError, match="not restarted again"):  # fails fast, starts nothing
        w.call({"op": "echo"}, timeout_s=30)
    assert w.pid is None


@pytest.mark.parametrize(
    "mode,kw,match",
    [
        ("fail", {}, "raised ValueError while starting: cannot load fake; raise the judge's start"),
        ("die", {}, "exited with code 7 while starting"),
        ("slow", {"start_timeout_s": 1.0}, "did not finish starting within start_timeout_s=1 s"),
    ],
)
def test_a_worker_that_cannot_start_fails_at_once_naming_its_settings(
    fake, workers, mode, kw, match
):
    w = workers(fake, (mode,), memory_limit_gb=0, **kw)
    with pytest.raises(WorkerError, match=match):
        w.start()
    assert w.pid is None and w.restarts == 0


def test_memory_limit_caps_the_child_and_a_runaway_allocation_is_an_error(fake, workers):
    w = workers(fake, memory_limit_gb=1.0)
    w.start()
    pid = w.pid
    assert w.call({"op": "echo"}, timeout_s=30)["rlimit_as"] == 2**30
    with pytest.raises(WorkerError, match=r"MemoryError.*memory_limit_gb \(now 1; 0 lifts it\)"):
        w.call({"op": "alloc", "n": 2 * 2**30}, timeout_s=30)
    assert w.call({"op": "echo"}, timeout_s=30)["pid"] == pid  # the child survived
    assert workers(fake, memory_limit_gb=0).memory_limit_gb == 0
    assert workers(fake).memory_limit_gb >= 8  # default: half the machine, at least 8 GiB


def test_composite_passes_its_limit_and_logs_restarts(fake, workers):
    w = workers(fake, memory_limit_gb=0)
    w.start()

    def scored(completions, samples, ctx):  # self-timed: bounds the worker's answer itself
        op = "sleep" if "hang" in completions else "echo"
        w.call({"op": op, "s": 60}, ctx.timeout_s)
        return [0.5] * len(completions)

    term = RewardTerm("fake", scored, counters=w.counters, self_timed=True)
    reward = CompositeReward([term], timeout_s=1.0)
    totals, _, stats = reward(["a", "b"], [{}, {}])
    assert totals == [0.5, 0.5] and stats["reward/restarts/fake"] == 0
    totals, _, stats = reward(["a", "hang"], [{}, {}])
    assert totals == [0.0, 0.0] and stats["reward/timeouts/fake"] == 2
    assert stats["reward/restarts/fake"] == 1 and stats["reward/restarts"] == 1
    totals, _, stats = reward(["a"], [{}])
    assert totals == [0.5] and stats["reward/restarts/fake"] == 0


SCRIPT = """
import sys, time
sys.path.insert(0, {path!r})
from fake_judge_handler import Fake
from perceptrl.rewards.judge_worker import SupervisedWorker
if __name__ == "__main__":
    w = SupervisedWorker(Fake, memory_limit_gb=0)
    w.start()
    print(w.pid, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
"""


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_no_worker_outlives_its_parent(fake, tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(SCRIPT.format(path=str(tmp_path))))
    arg = "exit" if how == "exit" else "wait"
    parent = subprocess.Popen([sys.executable, str(script), arg], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert not _gone(child)
    if how == "killed":  # no atexit, no finalizer: the child must notice by itself
        parent.kill()
    parent.wait(timeout=60)
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)
