"""Shared fixtures: tiny random checkpoints in Hugging Face layout."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on the CPU in Triton's interpreter, which reads this when Triton is first
# imported: set it before any test module imports a kernel (on a GPU machine they run on CUDA).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite in pytest-xdist workers (one per 2 cores' worth of torch threads):
# each worker takes its share of the threads, so two workers do not both spread over every core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
