"""Processes for the multi-rank tests: spawned, waited on with a deadline, never left behind."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable

import torch.multiprocessing as mp


def _run_and_exit(rank: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, *args)``; on success flush and leave at once with status 0.

    A rank's work is done when ``fn`` returns. What follows, interpreter finalization, destroys
    whatever still holds a gloo process group (a DeviceMesh, an FSDP module in a cycle) with
    gloo's C++ threads running, and that was seen to abort a finished rank now and then
    (SIGABRT, "terminate called without an active exception"), failing a test whose every
    property held. ``os._exit`` skips finalization; a failure still raises as usual.
    """
    fn(rank, *args)
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_spawned(fn: Callable, args: tuple, nprocs: int, timeout_seconds: float, what: str) -> float:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; seconds taken. A process that
    fails re-raises here; past ``timeout_seconds`` a TimeoutError names ``what``. Survivors are killed."""
    start = time.monotonic()
    context = mp.start_processes(_run_and_exit, args=(fn, *args), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join(timeout=max(1.0, timeout_seconds - (time.monotonic() - start))):
            if time.monotonic() - start > timeout_seconds:
                raise TimeoutError(f"{what} did not finish in {timeout_seconds} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return time.monotonic() - start
