"""Rollouts on Ray workers, overlapped with training: ``train.pipeline = one_step_off | async``.

The trainer still sees one `RolloutSource`: `PipelineSource.collect(policy, step)` returns a
scored batch. Behind it, `rollout.workers` Ray actors (`RolloutWorker`) each build a side's policy
copy and rollout source in their own process (a VLM with the HF engine, or a VLA with its vector
env), receive the trainer's weights with a version number through Ray's object store, and return
scored chunks of whole groups (a chunk is what one worker's source collects in one call, so GRPO
groups and VLA groups from one initial state never straddle workers); a step joins
``chunks_per_step`` chunks (one per worker: each worker's source collects its share of the step). Every row carries the
policy version that produced it (``RolloutBatch.policy_version``); a worker loads weights only
between calls and every row is cut at a call's end, so weights never change within a row.

* ``one_step_off``: the chunk of step k+1 is generated (with the weights of version k) while step
  k trains; every sample is exactly one version old (the first step's is on-policy).
* ``async``: a background thread keeps every worker busy with the latest published weights and
  puts finished chunks into a buffer of at most ``buffer_chunks``; the trainer takes chunks until
  it has a step's worth, dropping (and counting) chunks more than ``max_staleness`` versions old.

Off-policy data is handed over as behaviour log-probs: a source's ``logp_old`` (the VLA collector
fills it while acting) becomes ``logp_rollout`` and the trainer scores the proximal log-probs
itself; the loss is corrected by ``algo.rollout_correction`` (trainer/corrections.py). A worker that
dies or hangs past ``worker_timeout_s`` is restarted by Ray (counted); its chunk is dropped. The
trainer never waits forever: no chunk within ``timeout_s`` is an error naming the workers' states.
Resuming an asynchronous run continues from the checkpoint's version and drops what was in
flight (the synchronous default stays exact).

Under data parallelism (torchrun/DeepSpeed) rank 0 is the only Ray driver: its pipeline collects
the global batch and `RankShards` scatters whole groups to the ranks, which train as in sync mode.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import RunError
from ..registry import import_modules
from .batch import RolloutBatch

PIPELINES = ("sync", "one_step_off", "async")
COUNT_METRICS = frozenset({"rollout/env_steps", "rollout/episodes"})
"""chunk metrics that count things: summed over a step's chunks (the others are row-weighted
means)"""


MAX_WORKER_FAILURES = 3
"""failed chunks in a row from one worker (it died each time: e.g. its policy or source cannot
be built in its process) before the pipeline stops with that worker's error"""
RESTART_POLL_S = 0.5
"""seconds between asking a restarting worker (Ray's ActorUnavailableError) for a chunk again"""


LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
"""what torchrun sets for its ranks (a worker started from rank 0 inherits it)"""


class PipelineError(RunError):
    """The rollout workers produced nothing usable in time, or one fails every time it runs."""


class RolloutWorker:
    """A Ray actor body: a side's policy copy and rollout source in their own process.

    Args:
        factory: ``factory(*args, index) -> (policy, source)``, a module-level function of the
            side (picklable), e.g. the VLM side's ``run.rollout_worker``.
        index: this worker's number (the factory seeds its data order and envs with it).
        threads: torch threads of the worker.
        imports: the recipe's ``imports`` (the user's registrations), imported first: a worker
            is a process of its own.
    """

    def __init__(
        self, factory: Callable, args: tuple, index: int, threads: int, imports: tuple = ()
    ):
        import os

        torch.set_num_threads(max(1, threads))
        for key in LAUNCHER_ENV:  # inherited from a torchrun rank 0; a worker is no rank
            os.environ.pop(key, None)
        import_modules(imports)
        self.policy, self.source = factory(*args, index)
        self.version: int | None = None

    def pid(self) -> int:
        import os

        return os.getpid()

    def collect(self, step: int, weights: list, version: int):
        """Load ``weights`` (``[ObjectRef]`` of a state dict) unless already at ``version``,
        then collect one chunk. Returns (batch on the CPU, metrics, version, seconds)."""
        import ray

        t0 = time.perf_counter()
        if version != self.version:
            self.policy.load_state_dict(ray.get(weights[0]))
            self.version = version
        batch, metrics = self.source.collect(self.policy, step)
        return batch.to("cpu"), metrics, version, time.perf_counter() - t0


@dataclass
class Chunk:
    batch: RolloutBatch
    metrics: dict
    version: int
    worker: int
    seconds: float


class PipelineSource:
    """A `RolloutSource` whose rollouts run on Ray workers; see the module docstring.

    Args:
        mode: ``one_step_off`` or ``async``.
        factory, args: what each worker builds (see `RolloutWorker`).
        chunks_per_step: chunks joined into a step's batch (default: one per worker).
        workers: number of rollout workers; cpus / gpus: Ray resources of each.
        max_staleness: async: chunks older than this many versions are dropped.
        buffer_chunks: async: finished chunks held at most (workers wait when it is full).
        worker_timeout_s: a chunk that takes longer kills (and restarts) its worker.
        timeout_s: the trainer's longest wait for data before `PipelineError`.
        address: Ray cluster address ("" starts a local one).
        describe: the side's ``describe_group(policy, batch, rows)`` for the rollout records
            (trainer/records.py), run in the trainer's process on the joined batch; None: the
            records hold the trainer's fields only.
    """

    def __init__(
        self, mode: str, factory: Callable, args: tuple, *, chunks_per_step: int = 0,
        workers: int = 1, cpus: float = 1.0, gpus: float = 0.0, max_staleness: int = 1,
        buffer_chunks: int = 2, worker_timeout_s: float = 600.0, timeout_s: float = 1800.0,
        address: str = "", imports: tuple = (), describe: Callable | None = None,
    ):  # fmt: skip
        if mode not in ("one_step_off", "async"):
            raise ValueError(f"train.pipeline={mode!r}: the pipeline runs one_step_off | async")
        import ray

        if not ray.is_initialized():
            ray.init(address=address or None, include_dashboard=False, log_to_driver=True)
        self.mode, self.chunks_per_step = mode, chunks_per_step or workers
        self.describe = describe
        self.max_staleness, self.buffer_chunks = max_staleness, max(1, buffer_chunks)
        self.worker_timeout_s, self.timeout_s = worker_timeout_s, timeout_s
        actor = ray.remote(RolloutWorker).options(
            num_cpus=cpus, num_gpus=gpus, max_restarts=-1, max_concurrency=1
        )
        threads = max(1, int(cpus))
        self.workers = [
            actor.remote(factory, args, i, threads, tuple(imports)) for i in range(workers)
        ]
        self.version, self.weights = -1, None
        self.pending: dict = {}  # ObjectRef -> (worker index, launch time)
        self.buffer: deque[Chunk] = deque()
        self.counters: Counter = Counter()
        self.idle_s = [0.0] * workers  # async: time each worker waited for buffer room
        self.failures = [0] * workers  # failed chunks in a row, per worker
        self.restarting: set[int] = set()  # workers Ray reports as restarting (counted once)
        self._idle_since: dict[int, float] = {}
        self._lock, self._stop = threading.RLock(), threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._next_step = 0

    def describe_group(self, policy, batch: RolloutBatch, rows: list[int]):
        """The side's fields of one group's rollout record (trainer/records.py)."""
        if self.describe is None:
            return {}, [{} for _ in rows]
        return self.describe(policy, batch, rows)

    # ---- weights -------------------------------------------------------------------------
    def publish(self, policy, version: int) -> None:
        """Put the trainer's weights (on the CPU) in the object store as ``version``."""
        import ray

        if version == self.version:
            return
        state = {k: v.detach().to("cpu") for k, v in policy.state_dict().items()}
        with self._lock:
            self.weights, self.version = [ray.put(state)], version

    # ---- launching and gathering ----------------------------------------------------------
    def _launch(self, w: int) -> None:
        """Start a chunk on worker ``w`` with the latest published weights."""
        with self._lock:
            ref = self.workers[w].collect.remote(self._next_step, self.weights, self.version)
            self._next_step += 1
            self.pending[ref] = (w, time.monotonic())

    def _gather(self, timeout: float) -> list[Chunk]:
        """Finished chunks (waiting up to ``timeout`` s for the first); dead and hung workers
        are counted, restarted and their chunks dropped."""
        import ray

        done, rest = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        if rest:  # and whatever else has finished by now
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        out = []
        for ref in done:
            w, _ = self.pending.pop(ref)
            try:
                batch, metrics, version, seconds = ray.get(ref)
            except ray.exceptions.RayError as e:  # the worker died (Ray restarts it)
                self.counters["dropped_chunks"] += 1
                self.counters[f"worker_error/{type(e).__name__}"] += 1
                if isinstance(e, ray.exceptions.ActorUnavailableError):
                    # it died and Ray is restarting it: one restart however long that takes, and
                    # not a failure of the worker's own (a slow restart is not a broken worker)
                    if w not in self.restarting:
                        self.restarting.add(w)
                        self.counters["worker_restarts"] += 1
                    time.sleep(RESTART_POLL_S)
                    self._launch(w)
                    continue
                self.restarting.discard(w)
                self.counters["worker_restarts"] += 1
                self.failures[w] += 1
                if self.failures[w] >= MAX_WORKER_FAILURES:
                    last = "\n".join(str(e).strip().splitlines()[-6:])
                    raise PipelineError(
                        f"rollout worker {w} failed {self.failures[w]} times in a row without "
                        f"producing a chunk (a restart does not help: it fails as it starts or "
                        f"collects); fix the error below, or run train.pipeline=sync to see it "
                        f"in this process. Last error ({type(e).__name__}):\n{last}"
                    ) from e
                self._launch(w)
                continue
            self.failures[w] = 0
            self.restarting.discard(w)
            out.append(Chunk(batch, metrics, version, w, seconds))
        self._kill_hung()
        return out

    def _kill_hung(self) -> None:
        """Kill (Ray restarts) workers whose chunk takes longer than ``worker_timeout_s``; their
        chunks are dropped and each restarted worker gets a new one."""
        import ray

        now = time.monotonic()
        for ref, (w, t0) in list(self.pending.items()):
            if now - t0 > self.worker_timeout_s:
                ray.kill(self.workers[w], no_restart=False)
                del self.pending[ref]
                self.counters["worker_hangs"] += 1
                self.counters["worker_restarts"] += 1
                self.counters["dropped_chunks"] += 1
                self._launch(w)

    # ---- RolloutSource -------------------------------------------------------------------
    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """A step's batch: ``chunks_per_step`` chunks joined (see the module docstring for which
        weights produced them), and the pipeline's metrics."""
        t0 = time.perf_counter()
        self.publish(policy, step)
        chunks = self._one_step_off() if self.mode == "one_step_off" else self._async(step)
        batch = _join([c.batch for c in chunks], [c.version for c in chunks], step)
        metrics = _mean_metrics([c.metrics for c in chunks], [len(c.batch) for c in chunks])
        metrics["rollout/samples"] = float(len(batch))
        metrics.update(self._metrics(chunks, step, time.perf_counter() - t0))
        return batch, metrics

    def _one_step_off(self) -> list[Chunk]:
        """Wait for the chunk launched last step, then launch the next with these weights."""
        chunks: list[Chunk] = []
        while len(chunks) < self.chunks_per_step:
            if not self.pending:
                self._launch_all()
            chunks += self._wait()
        self._launch_all()  # generated while this step trains: one version old
        return chunks

    def _launch_all(self) -> None:
        busy = {w for w, _ in self.pending.values()}
        for w in range(len(self.workers)):
            if w not in busy:
                self._launch(w)

    def _wait(self) -> list[Chunk]:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            got = self._gather(timeout=min(5.0, self.worker_timeout_s))
            if got:
                return got
        raise PipelineError(self._stuck_message())

    def _async(self, step: int) -> list[Chunk]:
        """Take buffered chunks no more than ``max_staleness`` versions old until the step has
        ``chunks_per_step`` (the background thread keeps the workers busy)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, daemon=True)
            self._thread.start()
        chunks: list[Chunk] = []
        deadline = time.monotonic() + self.timeout_s
        while len(chunks) < self.chunks_per_step:
            with self._lock:
                chunk = self.buffer.popleft() if self.buffer else None
            if chunk is None:
                if time.monotonic() > deadline or self._error is not None:
                    raise PipelineError(self._stuck_message())
                time.sleep(0.01)
                continue
            if step - chunk.version > self.max_staleness:
                self.counters["dropped_stale"] += 1
                continue
            chunks.append(chunk)
        return chunks

    def _produce(self) -> None:
        """Background thread: keep every worker busy while the buffer has room."""
        try:
            while not self._stop.is_set():
                with self._lock:
                    room = self.buffer_chunks - len(self.buffer) - len(self.pending)
                    busy = {w for w, _ in self.pending.values()}
                    now = time.monotonic()
                    for w in range(len(self.workers)):
                        if w in busy:
                            continue
                        if room > 0:
                            self.idle_s[w] += now - self._idle_since.pop(w, now)
                            self._launch(w)
                            room -= 1
                        else:
                            self._idle_since.setdefault(w, now)
                if not self.pending:
                    time.sleep(0.01)
                    continue
                got = self._gather(timeout=0.2)
                with self._lock:
                    self.buffer.extend(got)
        except BaseException as e:  # noqa: BLE001 - reported by the trainer's next collect
            self._error = e

    def _stuck_message(self) -> str:
        states = ", ".join(
            f"worker {w}: running {time.monotonic() - t0:.0f} s" for w, t0 in self.pending.values()
        )
        err = f"; the producer thread failed: {self._error!r}" if self._error else ""
        return (
            f"no rollout chunk within train.pipeline_timeout_s={self.timeout_s:g} s "
            f"({states or 'no worker running'}; restarts so far "
            f"{self.counters['worker_restarts']}){err}. Check the workers' logs (Ray prints "
            "them), raise the timeout, or run train.pipeline=sync"
        )

    def _metrics(self, chunks: list[Chunk], step: int, waited: float) -> dict[str, float]:
        stale = [step - c.version for c in chunks]
        m = {
            "pipeline/trainer_wait_s": waited,
            "pipeline/buffer_chunks": float(len(self.buffer)),
            "pipeline/staleness_mean": sum(stale) / len(stale),
            "pipeline/staleness_max": float(max(stale)),
            "pipeline/worker_chunk_s": sum(c.seconds for c in chunks) / len(chunks),
            "pipeline/worker_idle_s_total": sum(self.idle_s),
        }
        for s, n in Counter(stale).items():
            m[f"pipeline/staleness_hist/{s}"] = float(n)
        m.update({f"pipeline/{k}": float(v) for k, v in self.counters.items()})
        return m

    def state_dict(self) -> dict:
        """The version and counters (what was in flight is dropped on resume, see above)."""
        return {"version": self.version, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state.get("counters", {}))

    def close(self) -> None:
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for w in self.workers:
            ray.kill(w, no_restart=True)


class RankShards:
    """The `RolloutSource` of every data-parallel rank when one pipeline feeds them: rank 0 is the
    Ray driver (its `PipelineSource` collects each step's global batch from the workers), splits
    it into whole groups, the same number for every rank (`shard_groups`; groups past a multiple
    of the world size are dropped and counted), and scatters the shards; every other rank
    receives its own. An error on rank 0 (a `PipelineError`) is sent to every rank and raised
    there too, so no rank waits for a batch that will not come.

    Args:
        inner: rank 0's pipeline (None on the other ranks).
        rank, world: this process's rank and the number of ranks.
    """

    def __init__(self, inner: PipelineSource | None, rank: int, world: int):
        if (inner is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, drives the pipeline")
        self.inner, self.rank, self.world = inner, rank, world
        self.dropped_groups = 0

    def collect(self, policy, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        import torch.distributed as dist

        shards = None
        if self.rank == 0:
            try:
                batch, metrics = self.inner.collect(policy, step)
                parts, dropped = shard_groups(batch, self.world)
                self.dropped_groups += dropped
                metrics["pipeline/dropped_groups_uneven"] = float(self.dropped_groups)
                shards = [(part, metrics) for part in parts]
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised below
                shards = [e] * self.world
        box = [None]
        dist.scatter_object_list(box, shards, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def describe_group(self, policy, batch: RolloutBatch, rows: list[int]):
        """Rank 0's pipeline describes the groups it records (the other ranks record none)."""
        if self.inner is None:
            return {}, [{} for _ in rows]
        return self.inner.describe_group(policy, batch, rows)

    def state_dict(self) -> dict:
        return {} if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def shard_groups(batch: RolloutBatch, world: int) -> tuple[list[RolloutBatch], int]:
    """``batch`` split into ``world`` shards of whole groups, the same number of groups each (in
    order: rank r gets the r-th run of groups). Returns the shards and how many groups were left
    over (dropped: a rank with more groups would take more collective steps than the others)."""
    ids = torch.unique(batch.group_id.cpu())
    per = len(ids) // world
    if per == 0:
        raise PipelineError(
            f"the step's batch has {len(ids)} group(s) for {world} ranks; collect at least one "
            "group per rank (rollout.prompts_per_step >= the number of ranks)"
        )
    shards = []
    for r in range(world):
        mine = torch.isin(batch.group_id.cpu(), ids[r * per : (r + 1) * per])
        shards.append(batch.select(mine.nonzero().squeeze(1)))
    return shards, len(ids) - per * world


def _join(batches: list[RolloutBatch], versions: list[int], step: int) -> RolloutBatch:
    """Chunks as one batch: group ids made distinct across chunks, each row's policy version,
    and behaviour log-probs of off-policy rows moved to ``logp_rollout`` (the trainer scores
    the proximal ones)."""
    offset = 0
    for b, v in zip(batches, versions):
        ids, inv = torch.unique(b.group_id, return_inverse=True)
        b.group_id = inv.to(b.group_id.device) + offset
        offset += len(ids)
        b.policy_version = torch.full((len(b),), v, dtype=torch.long)
    batch = RolloutBatch.concat(batches)
    if batch.logp_old is not None and (batch.policy_version < step).any():
        if batch.logp_rollout is None:
            batch.logp_rollout = batch.logp_old
        batch.logp_old = batch.values_old = None
    return batch


def _mean_metrics(rows: list[dict], weights: list[int]) -> dict[str, float]:
    """The chunks' metrics: counts (`COUNT_METRICS`) summed, the others averaged, each chunk
    weighted by its rows."""
    out = {}
    for k in {k for r in rows for k in r}:
        pairs = [(r[k], w) for r, w in zip(rows, weights) if k in r]
        if k in COUNT_METRICS:
            out[k] = float(sum(v for v, _ in pairs))
        else:
            out[k] = sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1)
    return out
