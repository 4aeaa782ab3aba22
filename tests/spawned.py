"""Processes for the multi-rank tests: spawned, waited on with a deadline, never left behind."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as mp


def run_spawned(fn: Callable, args: tuple, nprocs: int, timeout_s: float, what: str) -> float:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; seconds taken. A process that
    fails re-raises here; past ``timeout_s`` a TimeoutError names ``what``. Survivors are killed."""
    start = time.monotonic()
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join(timeout=max(1.0, timeout_s - (time.monotonic() - start))):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{what} did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return time.monotonic() - start
