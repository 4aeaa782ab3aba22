"""One computing thread per process: a released OpenMP pool really ends its workers, and
`ComputeThread` runs every call on one thread with the caller's results and errors."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from specd.threads import ComputeThread, FairLock, _libgomp, release_pool


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or _libgomp() is None,
                    reason="needs Linux and torch built with libgomp")
def test_release_pool_ends_the_calling_threads_openmp_workers():
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    seen: dict[str, int | bool] = {}

    def work() -> None:  # a fresh thread: its pool is its own
        before = _os_threads()
        for _ in range(3):
            torch.randn(256, 256) @ torch.randn(256, 256)  # a parallel region: this thread's pool starts
        seen["with_pool"] = _os_threads()
        seen["released"] = release_pool()
        seen["ended"] = _wait_for(lambda: _os_threads() <= before)
        torch.randn(256, 256) @ torch.randn(256, 256)  # a new pool, the same sums
        seen["again"] = _os_threads() > before
        release_pool()
        seen["before"] = before

    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)
    assert seen["released"] is True
    assert seen["with_pool"] > seen["before"], seen  # the pool's workers started
    assert seen["ended"], f"the pool's workers did not end: {seen}"
    assert seen["again"], f"no new pool after the release: {seen}"


def test_compute_thread_runs_every_call_on_one_thread():
    compute = ComputeThread("test-compute")
    callers = []

    def call(i: int) -> tuple[int, str]:
        return compute.run(lambda: (i * i, threading.current_thread().name))

    threads = [threading.Thread(target=lambda i=i: callers.append(call(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(value for value, _ in callers) == [i * i for i in range(8)]
    assert {name for _, name in callers} == {"test-compute"}
    # A call from the compute thread itself runs inline instead of waiting for itself.
    assert compute.run(lambda: compute.run(lambda: 7)) == 7
    compute.close()


def test_compute_thread_hands_errors_back_and_refuses_after_close():
    compute = ComputeThread()

    def fail() -> None:
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        compute.run(fail)
    assert compute.run(lambda: 1) == 1  # an error does not end the thread
    compute.close()
    with pytest.raises(RuntimeError, match="closed"):
        compute.run(lambda: 1)


def test_a_fair_lock_goes_to_the_oldest_waiter_before_the_holder_takes_it_back():
    """The engine loop releases the target and asks again at once: with `FairLock` a Score thread
    already waiting gets it first (a `threading.Lock` lets the releasing thread take it back)."""
    lock = FairLock()
    order: list[str] = []
    lock.acquire()
    waiters = [threading.Thread(target=lambda name=name: (lock.acquire(), order.append(name), lock.release()))
               for name in ("first", "second")]
    for count, waiter in enumerate(waiters, start=1):
        waiter.start()
        assert _wait_for(lambda: lock.waiting == count)
    lock.release()
    assert not lock.acquire(blocking=False)  # owed to the waiters, not to whoever asks now
    with lock:  # queues behind both
        order.append("holder")
    for waiter in waiters:
        waiter.join(5)
    assert order == ["first", "second", "holder"]
    assert not lock.locked() and lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()


def test_a_score_thread_gets_the_target_while_a_loop_steps_back_to_back():
    """A loop that holds the lock for a 'step', releases it and takes it again (the engine) lets a
    thread that asks for it in between in within one step."""
    lock, stop, steps = FairLock(), threading.Event(), []

    def loop():
        while not stop.is_set():
            with lock:
                steps.append(time.monotonic())
                time.sleep(0.005)

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        assert _wait_for(lambda: len(steps) >= 3)
        for _ in range(20):
            asked = len(steps)
            with lock:
                got = len(steps)
            assert got - asked <= 1  # the step in progress when it asked, and none after
    finally:
        stop.set()
        looper.join(5)
