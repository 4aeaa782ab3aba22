"""CPU compute dtype, chosen in one place: bf16 autocast only where the CPU computes bf16."""

from __future__ import annotations

import pytest
import torch

from specd import precision
from specd.train.drafter import DrafterTrainConfig
from specd.train.pretrain import PretrainConfig


@pytest.mark.parametrize("forced,dtype", [("1", torch.bfloat16), ("0", torch.float32)])
def test_autocast_follows_the_choice(monkeypatch, forced, dtype):
    monkeypatch.setenv(precision.ENV_VAR, forced)
    layer = torch.nn.Linear(8, 8)
    with precision.cpu_autocast():
        out = layer(torch.randn(2, 8))
    assert out.dtype == dtype
    assert PretrainConfig().bf16 == (forced == "1") and DrafterTrainConfig().bf16 == (forced == "1")
    assert ("bf16" in precision.describe()) == (forced == "1")


def test_disabled_autocast_is_fp32_even_where_bf16_is_native(monkeypatch):
    monkeypatch.setenv(precision.ENV_VAR, "1")
    with precision.cpu_autocast(enabled=False):
        assert torch.nn.Linear(4, 4)(torch.randn(1, 4)).dtype == torch.float32


def test_without_override_the_probe_decides(monkeypatch):
    monkeypatch.delenv(precision.ENV_VAR, raising=False)
    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert precision.cpu_computes_bf16() == native
    assert PretrainConfig().bf16 == native


def test_a_bad_override_says_what_to_set(monkeypatch):
    monkeypatch.setenv(precision.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="SPECD_CPU_BF16 must be 1"):
        precision.cpu_computes_bf16()
