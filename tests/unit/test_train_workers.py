"""Training split over processes (`specd.train.workers`) trains the same model as one process."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specd.models import qwen3
from specd.train import workers
from specd.train.pretrain import PretrainConfig, pretrain


def _streams() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    # Four "domains" with different token statistics, so rows of a batch differ.
    return [rng.integers(lo, lo + 200, size=4000, dtype=np.int64) for lo in (0, 100, 200, 300)]


def test_a_batch_split_over_processes_trains_the_model_one_process_trains():
    """Every rank takes its rows of the same batch and the gradients are summed: the parameters
    after a few steps, and the reported loss, equal one process's up to summation order. A rank
    that trained on its rows alone (no all-reduce), the wrong rows, or an unscaled share of the
    loss would each be far off. Three ranks do not divide the 8 windows: shares are uneven (the
    zoo's two ranks split evenly, the easier case)."""
    world = 3
    torch.manual_seed(0)
    model = qwen3.Qwen3ForCausalLM(qwen3.FLAVOURS["debug"])
    alone, start = copy.deepcopy(model), copy.deepcopy(model)
    config = PretrainConfig(steps=4, seq_len=32, windows_per_domain=2, warmup_steps=1, bf16=False)
    split = pretrain(model, _streams(), config, workers=world)
    single = pretrain(alone, _streams(), config, workers=1)
    assert split["workers"] == world and split["tokens_seen"] == single["tokens_seen"]
    assert split["final_loss"] == pytest.approx(single["final_loss"], rel=1e-5)
    for (name, a), b in zip(model.named_parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), start.parameters()))
    assert moved > 1e-3  # training changed the model (the comparison is not of two untouched copies)


def test_the_worker_count_override_is_checked(monkeypatch):
    monkeypatch.setenv(workers.ENV_VAR, "two")
    with pytest.raises(ValueError, match="SPECD_TRAIN_WORKERS must be a whole number"):
        workers.default_workers()
    monkeypatch.setenv(workers.ENV_VAR, "3")
    assert workers.default_workers() == 3
    assert workers.default_workers(split=False) == 3  # the override wins for a wide model too
    monkeypatch.delenv(workers.ENV_VAR)
    assert workers.default_workers(split=False) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert workers.default_workers() == 2
