"""Shared fixtures: tiny random checkpoints in Hugging Face layout."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
