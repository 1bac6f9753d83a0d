"""A reward model in a supervised child process: time and memory limits, restart on hang or death.

:class:`SupervisedWorker` runs ``factory(*args)`` (e.g. "load the judge model") once in a child
process and sends it requests over a pipe; the child answers each with ``handler(request)``. The
child is started with multiprocessing's "spawn" method: a fresh interpreter that inherits none of
the parent's torch threads, CUDA or EGL state (forking a process that holds them can deadlock or
crash the child). The parent supervises it:

- **time limit**: a call waits ``timeout_s`` for its answer (from sending the request; waiting for
  a (re)starting child to load is bounded by ``start_timeout_s`` instead). Past it the child is
  killed with SIGKILL — it may be stuck in native code that no timer in a Python process can
  interrupt — a replacement starts loading in the background, and the call raises
  :class:`~perceptrl.rewards.compose.RewardTimeout`, which the composite scores 0 and counts;
- **death**: a child that exits or is killed (the kernel's OOM killer, a segfault) is replaced;
  a call it was serving raises :class:`WorkerError` (the composite then retries the samples one
  by one, on the new child, so only a sample that kills it again scores 0);
- **memory limit**: the child's address space is capped with ``RLIMIT_AS`` (``memory_limit_gb``),
  so a runaway allocation fails inside it (a ``MemoryError``, reported as an error) before it can
  push the machine into the OOM killer. Address space exceeds resident memory (thread stacks and
  allocator arenas are reserved up front: a Python process with torch and a tiny Qwen2.5-VL
  reserved 3.7 GiB for 0.9 GiB resident, measured on 2 cores), so the default is generous: half
  the machine's memory, at least 8 GiB;
- **counts**: ``restarts`` (every replacement after a hang, a death or a failed start) is a running
  total that the composite logs per call as ``reward/restarts/<name>``;
- **giving up**: after ``max_failures`` failures in a row (hangs, deaths, failed starts with no
  call answered between them) it stops restarting; every later call raises :class:`WorkerError`
  that names the setting to change. A child that cannot start the first time raises at once.

Shutdown: workers stop when garbage-collected and at interpreter exit (``weakref.finalize``), and
a child exits by itself when its parent dies (``PR_SET_PDEATHSIG`` on Linux when started from the
main thread, and a thread that polls the parent's pid), so no child outlives the trainer.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from .compose import RewardTimeout

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
"""How often a child checks that its parent is still alive."""

_PR_SET_PDEATHSIG = 1
_MEMORY_SIGNS = ("MemoryError", "allocate memory", "failed to map segment", "out of memory")
"""How running out of address space shows in a child's error (Python, torch's allocator, the
dynamic loader mapping a library)."""


class WorkerError(RuntimeError):
    """A supervised worker failed a call or cannot be (re)started; the message says what to do."""


def default_memory_limit_gb() -> float:
    """Half the machine's physical memory in GiB, at least 8 (0: unknown, no limit)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0.0
    return max(8.0, total / 2**30 / 2)


# ---- the child ------------------------------------------------------------------------------


def _watch_parent(parent_pid: int, deathsig: bool) -> None:
    """Exit when the parent dies: at once by the kernel (Linux, when the parent's spawning thread
    is its main thread), or within PARENT_POLL_S by a watchdog thread."""
    if deathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_memory(limit_bytes: int) -> None:
    if limit_bytes <= 0:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit_bytes = min(limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def _serve(
    conn: Connection,
    factory: Callable[..., Callable[[Any], Any]],
    args: tuple,
    limit_bytes: int,
    parent_pid: int,
    deathsig: bool,
) -> None:
    """The child's main: limits, ``handler = factory(*args)``, then answer ``(id, request)``
    messages with ``("ok", id, result)`` or ``("error", id, type, message)`` until it receives
    None or the pipe closes."""
    _watch_parent(parent_pid, deathsig)
    _limit_memory(limit_bytes)
    try:
        handler = factory(*args)
    except BaseException as e:  # reported to the parent, which raises it with a hint
        conn.send(("failed", type(e).__name__, str(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        rid, request = msg
        try:
            reply = ("ok", rid, handler(request))
        except Exception as e:  # the worker stays up; the parent raises it for this call
            reply = ("error", rid, type(e).__name__, str(e))
        conn.send(reply)


# ---- the parent -----------------------------------------------------------------------------


def _exit_reason(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return "was killed by SIGKILL (the kernel's OOM killer, or another process)"
    return f"was killed by {name}"


def _send_quietly(conn: Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except (OSError, ValueError):  # the child died or was killed: the caller sees that
        pass


class _Live:
    """The current child and its pipe (shared with the finalizer, which must not hold the
    worker itself)."""

    def __init__(self, owner: int):
        self.owner = owner
        self.proc = None
        self.conn: Connection | None = None

    def stop(self, graceful: bool = True) -> None:
        """Stop the child (ask, then kill); a no-op in a forked copy of the owner."""
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is None or os.getpid() != self.owner:
            return
        if graceful and proc.is_alive() and conn is not None:
            _, writable, _ = select.select([], [conn.fileno()], [], 0)
            if writable:  # never block here (e.g. at exit, behind a stuck child's full pipe)
                _send_quietly(conn, None)
                proc.join(1.0)
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        if conn is not None:
            conn.close()


class SupervisedWorker:
    """``factory(*args)`` in a supervised child process (see the module docstring).

    Args:
        factory: importable callable (spawn pickles it by name) that builds the handler in the
            child; the handler maps a request to a picklable result.
        args: picklable arguments of ``factory``.
        name: how messages name the worker and its settings, e.g. "judge".
        memory_limit_gb: cap on the child's address space in GiB; None: half the machine's
            memory, at least 8 GiB; 0: no cap.
        start_timeout_s: longest wait for a child to build its handler.
        max_failures: failures in a row (hangs, deaths, failed starts) after which it gives up.
    """

    def __init__(
        self,
        factory: Callable[..., Callable[[Any], Any]],
        args: tuple = (),
        *,
        name: str = "worker",
        memory_limit_gb: float | None = None,
        start_timeout_s: float = 300.0,
        max_failures: int = 3,
    ):
        if max_failures < 1:
            raise ValueError(f"{name}: max_failures must be >= 1, got {max_failures}")
        if memory_limit_gb is not None and memory_limit_gb < 0:
            raise ValueError(f"{name}: memory_limit_gb must be >= 0 (0: no limit)")
        self.factory, self.args, self.name = factory, tuple(args), name
        self.memory_limit_gb = (
            default_memory_limit_gb() if memory_limit_gb is None else float(memory_limit_gb)
        )
        self.start_timeout_s, self.max_failures = float(start_timeout_s), int(max_failures)
        self.restarts = 0
        """replacements started after a hang, a death or a failed start (running total)"""
        self._failures = 0  # in a row, reset by any answered call
        self._broken: str | None = None
        self._ready = self._ever_ready = False
        self._started_at = 0.0
        self._next_id = 0
        self._lock = threading.RLock()
        self._live = _Live(os.getpid())
        self._finalizer = weakref.finalize(self, self._live.stop)

    @property
    def pid(self) -> int | None:
        """The current child's pid (None before the first start or after giving up)."""
        return self._live.proc.pid if self._live.proc is not None else None

    def counters(self) -> dict[str, float]:
        return {"restarts": float(self.restarts)}

    def close(self) -> None:
        """Stop the child; a later call starts a new one."""
        with self._lock:
            self._live.stop()
            self._ready = False

    # ---- lifecycle --------------------------------------------------------------------------

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        limit = int(self.memory_limit_gb * 2**30)
        main = threading.current_thread() is threading.main_thread()
        proc = ctx.Process(
            target=_serve,
            args=(child, self.factory, self.args, limit, os.getpid(), main),
            name=f"perceptrl-{self.name}",
            daemon=True,
        )
        proc.start()
        child.close()  # the child's end lives in the child only: its death closes the pipe
        self._live.proc, self._live.conn = proc, parent
        self._ready, self._started_at = False, time.monotonic()

    def _kill(self) -> None:
        self._live.stop(graceful=False)
        self._ready = False

    def _hint(self, kind: str, why: str = "") -> str:
        """What to change after a failure of ``kind`` (hang, start, death, memory)."""
        if kind == "start" and any(m in why for m in _MEMORY_SIGNS):
            kind = "memory"
        if self.memory_limit_gb > 0:
            mem = (
                f"the {self.name}'s memory_limit_gb (now {self.memory_limit_gb:g}; 0 lifts it) "
                "caps the worker's address space: raise it, or use a smaller model, dtype or "
                "batch_size"
            )
        else:
            mem = (
                "if it ran out of memory, use a smaller model, dtype or batch_size, or set the "
                f"{self.name}'s memory_limit_gb so that it fails inside the worker instead"
            )
        if kind == "hang":
            return (
                "if it is just slow, raise rollout.reward_timeout_s or lower the "
                f"{self.name}'s batch_size / max_new_tokens"
            )
        if kind == "start":
            return (
                f"raise the {self.name}'s start_timeout_s (now {self.start_timeout_s:g} s) for a "
                f"slow load; {mem}; a script that builds the reward at import time needs an "
                '`if __name__ == "__main__":` guard (the worker is started with spawn)'
            )
        return mem

    def _fail(self, why: str, kind: str) -> None:
        """Count a hang, death or failed start; start a replacement or give up."""
        self._kill()
        self._failures += 1
        if self._failures >= self.max_failures:
            self._broken = (
                f"the {self.name} worker failed {self._failures} times in a row (last: it {why}) "
                f"and is not restarted again in this process (the {self.name}'s max_failures="
                f"{self.max_failures}); {self._hint(kind, why)}"
            )
            log.error(self._broken)
            return
        self.restarts += 1
        log.warning("the %s worker %s; restarting it (restart %d)", self.name, why, self.restarts)
        self._spawn()

    def _wait_ready(self) -> str | None:
        """None once the child has built its handler, else why it did not (it is then gone)."""
        live = self._live
        left = max(0.0, self.start_timeout_s - (time.monotonic() - self._started_at))
        ready = wait([live.conn, live.proc.sentinel], left)
        msg = None
        if live.conn in ready:
            try:
                msg = live.conn.recv()
            except (EOFError, OSError):
                live.proc.join(1.0)
        if msg is not None and msg[0] == "ready":
            self._ready = self._ever_ready = True
            return None
        if msg is not None:
            why = f"raised {msg[1]} while starting: {msg[2]}"
        elif ready:
            live.proc.join(1.0)
            why = f"{_exit_reason(live.proc)} while starting"
        else:
            why = f"did not finish starting within start_timeout_s={self.start_timeout_s:g} s"
        self._kill()
        return why

    def start(self) -> None:
        """Start the child and wait until it is ready (e.g. at start-up, outside any time limit).

        Raises:
            WorkerError: it failed to start, or the worker gave up earlier; says what to change.
        """
        with self._lock:
            while True:
                if self._broken:
                    raise WorkerError(self._broken)
                if self._live.proc is None:
                    self._spawn()
                if self._ready:
                    if self._live.proc.is_alive():
                        return
                    self._fail(f"{_exit_reason(self._live.proc)} while idle", "death")
                    continue
                why = self._wait_ready()
                if why is None:
                    return
                if not self._ever_ready:  # a first start that fails is a setting to fix
                    raise WorkerError(f"the {self.name} worker {why}; {self._hint('start', why)}")
                self._fail(why, "start")

    def call(self, request: Any, timeout_s: float | None = None) -> Any:
        """The child's answer to ``request``.

        Args:
            request: picklable request for the handler.
            timeout_s: longest wait for the answer once sent; None or 0: no limit.
        Raises:
            RewardTimeout: no answer in time; the child was killed and a new one is starting.
            WorkerError: the child died serving the call (it is restarted), the handler raised
                (the child stays up), or the worker gave up after repeated failures.
        """
        with self._lock:
            self.start()
            live = self._live
            self._next_id += 1
            rid = self._next_id
            # a thread sends: a large request to a stuck child would block on a full pipe
            sender = threading.Thread(target=_send_quietly, args=(live.conn, (rid, request)))
            sender.daemon = True
            msg, ready = None, []
            try:
                sender.start()
                ready = wait([live.conn, live.proc.sentinel], timeout_s or None)
                if live.conn in ready:
                    msg = live.conn.recv()
            except (EOFError, OSError):
                pass  # the child died mid-answer: below
            except BaseException:  # interrupted (Ctrl-C, an outer timer): the child is unknown
                self._kill()
                raise
            return self._answer(msg, rid, ready, timeout_s, sender)

    def _answer(self, msg, rid: int, ready: list, timeout_s: float | None, sender) -> Any:
        if msg is not None and msg[1] == rid:
            self._failures = 0
            if msg[0] == "ok":
                return msg[2]
            etype, text = msg[2], msg[3]
            hint = ""
            if any(m in f"{etype}: {text}" for m in _MEMORY_SIGNS):
                hint = f" ({self._hint('memory')})"
            raise WorkerError(f"the {self.name} worker raised {etype}: {text}{hint}")
        proc = self._live.proc
        if not ready:
            self._fail(f"did not answer within {timeout_s:g} s", "hang")
            sender.join(1.0)
            raise RewardTimeout(
                self._broken
                or f"the {self.name} worker did not answer within {timeout_s:g} s; it was killed "
                f"and restarted ({self._hint('hang')})"
            )
        proc.join(1.0)
        why = f"{_exit_reason(proc)} while serving a call"
        self._fail(why, "death")
        raise WorkerError(
            self._broken
            or f"the {self.name} worker {why}; it was restarted ({self._hint('death')})"
        )
