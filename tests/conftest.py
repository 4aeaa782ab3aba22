"""Shared fixtures: tiny random checkpoints in Hugging Face layout."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on the CPU in Triton's interpreter, which reads this when Triton is first
# imported: set it before any test module imports a kernel (on a GPU machine they run on CUDA).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
