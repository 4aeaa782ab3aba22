"""One computing thread per process: OpenMP's workers only spin while the process has one pool.

libgomp, the OpenMP runtime of PyTorch's Linux CPU wheels, gives every thread that starts a
parallel region a pool of worker threads of its own and keeps it until that thread ends. Between
two regions the workers spin, so the next region starts in microseconds, but only while the
threads of all pools together do not outnumber the CPUs the process may use; past that they sleep
after a few spins (``gomp_throttled_spin_count``, at most 1000 whatever ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` say) and every region pays a futex wake-up. A server that loads its weights on
the main thread (one pool) and runs its passes on another thread (a second pool) is past that
line on a 2-core machine, and each of the hundreds of small parallel ops in a decode pass pays
the wake-up: ``bench/thread_cost.py`` measures the cost.

So a process runs its passes on one thread, and every other thread that computed frees its pool:

- `release_pool` frees the calling thread's pool (OpenMP 5's ``omp_pause_resource_all``, which
  libgomp implements as "free this thread's pool"). The serving engine calls it on the thread
  that built it (which loaded the weights) before its own loop computes; a thread that runs an
  occasional pass (the verifier's Score) calls it when done.
- `ComputeThread` runs callables on one long-lived thread, for a server whose passes arrive on
  many request threads (the drafter service).

Only libgomp is released: LLVM's and Intel's runtimes pause the whole process instead, which
would stall a pass on another thread; there (and without OpenMP) `release_pool` does nothing.

**Processes that take turns on the same cores** (a sync verifier and the drafter it waits for, the
demo's plain verifier, the trainer) meet the other side of the spinning: after a region, a
process's workers spin ``GOMP_SPINCOUNT`` times (300,000 by default: milliseconds) before they
sleep, on the cores the other process now wants. A verifier that sends a Draft call keeps a core
busy through much of the drafter's pass, and the drafter's workers spin on into the next
verification. `shared_machine_env` gives such processes a spin count of `SHARED_SPIN_COUNT`:
long enough to bridge the gaps between the ops of one pass (microseconds), short enough to hand
the core over soon after it. ``bench/draft_rpc.py`` measures a draft and a verification taking
turns both ways.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Callable, Mapping, TypeVar

import torch  # noqa: F401  (loads libgomp, which `release_pool` looks up)

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: keep the runtime's state, free the threads


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith("libgomp"):
            try:
                library = ctypes.CDLL(path)
            except OSError:
                return None
            return library if hasattr(library, "omp_pause_resource_all") else None
    return None


_GOMP: ctypes.CDLL | None | bool = False  # False: not looked up yet


SHARED_SPIN_COUNT = 10_000
"""libgomp spins a worker makes after a region before it sleeps, for processes that take turns on
the same cores (module docstring); libgomp's default is 300,000. 0 (``OMP_WAIT_POLICY=passive``)
would make every op of a pass wait for a futex wake-up."""


def shared_machine_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to add for a process that takes turns on its cores with another computing
    process (module docstring): ``GOMP_SPINCOUNT``, unless ``environ`` already sets the spin count
    or the wait policy, which then stand."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(SHARED_SPIN_COUNT)}


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp only; module docstring). The
    next parallel op on this thread starts a new pool, so this is safe anywhere outside a
    parallel region. True when a pool was released (or there was none to release)."""
    global _GOMP
    if _GOMP is False:
        _GOMP = _libgomp()
    if _GOMP is None:
        return False
    return _GOMP.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


class ComputeThread:
    """Runs callables one at a time on one long-lived thread and hands back their results (or
    raises their exceptions) to the caller: the passes of a server whose requests arrive on
    many threads all compute on this one, so the process keeps a single OpenMP pool."""

    def __init__(self, name: str = "specd-compute") -> None:
        self._jobs: SimpleQueue[tuple[Callable[[], object], Future] | None] = SimpleQueue()
        self._lock = threading.Lock()  # a job is queued before the closing sentinel, or refused
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the compute thread (inline when called from it); blocks until it is done."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compute thread was closed: no more passes can run on it")
            self._jobs.put((fn, future))
        return future.result()

    def close(self) -> None:
        """Finish the queued calls, then end the thread (its pool goes with it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # handed to the caller, who raises it
                    future.set_exception(err)


class FairLock:
    """A lock handed over in the order it was asked for (a ticket lock), for a resource one thread
    uses back to back while others wait: the serving engine's loop holds the target for a step,
    releases it and asks again at once, and the verifier's Score threads wait for it between steps.

    `threading.Lock` is not FIFO: a release wakes a waiter, but the releasing thread still holds
    the GIL (and a CPU), so it takes the lock straight back before the waiter runs. On a busy host
    a Score call then waited for minutes while the engine stepped, and its caller (the trainer,
    holding its own lock around the step that scores) stopped with it. Here a release passes the
    lock to the oldest waiter; whoever asks after that queues behind. A context manager, like Lock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the ticket the next caller draws
        self._serving = 0  # the ticket that holds the lock (or may take it)

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock once every earlier caller has had it; False without waiting when
        ``blocking`` is False and it is held or owed to a waiter."""
        with self._cond:
            if not blocking and self._next != self._serving:
                return False
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
            return True

    def release(self) -> None:
        with self._cond:
            if self._next == self._serving:
                raise RuntimeError("release of an unlocked FairLock")
            self._serving += 1
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Callers queued behind the holder (0 when free or held with none waiting)."""
        with self._cond:
            return max(0, self._next - self._serving - 1)

    def locked(self) -> bool:
        with self._cond:
            return self._next != self._serving

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
