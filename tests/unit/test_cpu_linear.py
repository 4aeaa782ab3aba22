"""The CPU's fast paths for few-row passes: `linear` (W @ x.T) and `fused_weight` (QKV, gate/up
in one product) give what the plain modules give, and stay in step with the parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specd.models import layers
from specd.models.layers import SMALL_ROWS, TRIALS_PER_FORM, GQAttention, Linear, SwiGLU, fused_weight, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, SMALL_ROWS, SMALL_ROWS + 1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_to_rounding(rows, bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    b = torch.randn(96) if bias else None
    with torch.no_grad():
        got = linear(x.view(1, rows, 40), weight, b)
    assert got.shape == (1, rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got[0], F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["mm", "linear", "auto"])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_form_equals_f_linear_while_measuring_and_after(mode, rows, monkeypatch):
    forms = layers._FewRowForms(mode)
    monkeypatch.setattr(layers, "FEW_ROW_FORMS", forms)
    torch.manual_seed(rows)
    weight, x = torch.randn(64, 24), torch.randn(rows, 24)
    mlp = SwiGLU(24, 40)
    with torch.no_grad():
        expected = mlp.down_proj(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight))
        for _ in range(4 * TRIALS_PER_FORM + 2):
            torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
    # Forced: nothing measured; auto: both keys settled after their trials, nothing left measuring.
    assert len(forms.chosen) == (3 if mode == "auto" else 0) and not forms.trials
    fused_kept = "_specd_fused" in mlp.gate_proj.__dict__
    # A grouped key's first field is a tuple of shapes; a single linear's is one shape.
    grouped = [name for key, name in forms.chosen.items() if isinstance(key[0][0], tuple)]
    assert len(grouped) == (1 if mode == "auto" else 0)
    assert fused_kept == (mode == "mm" or (grouped != [] and grouped[0].startswith("fused")))


def test_the_fastest_form_is_kept(monkeypatch):
    forms = layers._FewRowForms("auto")
    clock = iter(range(10_000))
    monkeypatch.setattr(layers.time, "perf_counter", lambda: next(clock) * 1.0)
    slow = lambda: (next(clock), next(clock))  # noqa: E731 - two more ticks: a slower form
    for _ in range(3 * TRIALS_PER_FORM):
        forms.run("key", {"a": slow, "b": lambda: None, "c": slow})
    assert forms.chosen["key"] == "b"
    assert forms.run("key", {"a": slow, "b": lambda: "b ran", "c": slow}) == "b ran"


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="auto, mm or linear"):
        layers._FewRowForms("fast")


def test_linear_keeps_autograd_for_training():
    layer = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # the F.linear path: gradients reach both the input and the weight
    assert x.grad is not None and layer.weight.grad is not None


def test_fused_weight_is_the_weights_and_follows_a_later_load():
    torch.manual_seed(0)
    mlp = SwiGLU(16, 24)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        expected = mlp.down_proj(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight))
        state = {k: v.clone() for k, v in mlp.state_dict().items()}
        fused = fused_weight((mlp.gate_proj, mlp.up_proj))
        assert fused.shape == (48, 16) and torch.equal(fused, torch.cat([state["gate_proj.weight"], state["up_proj.weight"]]))
        assert fused_weight((mlp.gate_proj, mlp.up_proj)) is fused  # made once
        # The parameters are untouched (a copy, nothing re-pointed) and the state dict is unchanged.
        assert mlp.gate_proj.weight.data_ptr() != fused.data_ptr()
        assert set(mlp.state_dict()) == set(state) and all(torch.equal(v, state[k]) for k, v in mlp.state_dict().items())
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
        # An in-place load (as a new drafter version or an optimizer step writes) is seen.
        new = {k: torch.randn_like(v) for k, v in state.items()}
        mlp.load_state_dict(new)
        again = fused_weight((mlp.gate_proj, mlp.up_proj))
        assert torch.equal(again[:24], new["gate_proj.weight"]) and torch.equal(again[24:], new["up_proj.weight"])


def test_fused_weight_refuses_under_autograd_and_follows_a_parameter_swap():
    attention = GQAttention(layer_index=0, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    assert fused_weight(projections) is None  # autograd records: the separate products
    with torch.no_grad():
        first = fused_weight(projections)
        swapped = torch.randn_like(attention.k_proj.weight)
        attention.k_proj.weight = nn.Parameter(swapped)  # as tensor-parallel slicing does
        second = fused_weight(projections)
    assert second is not first and torch.equal(second[32:48], swapped)
