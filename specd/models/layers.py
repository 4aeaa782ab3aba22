"""Building blocks shared by the architectures: Linear, RMSNorm, rotary embeddings, SwiGLU, attention.

They follow the Hugging Face Qwen3 numerics (norm in fp32, rotary tables in fp32 cast to the
activation dtype) so that logits match `transformers` to ~1e-5 in fp32.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache
from specd.models.attention import AttentionMetadata

SMALL_ROWS = 6
"""Up to this many rows (tokens of a pass), a CPU `linear` may compute ``W @ x.T`` (see `linear`)."""

FEW_ROWS_ENV = "SPECD_CPU_FEW_ROWS"
"""``auto`` (default): the few-row products are measured and the fastest form kept; ``mm``:
always ``W @ x.T`` with fused QKV and gate/up weights; ``linear``: always plain ``F.linear`` on
separate weights (for A/B runs)."""

TRIALS_PER_FORM = 4
"""Timed calls of each form, taken in turn, before a shape is settled."""


class _FewRowForms:
    """Which way of computing a few-row product is fastest, per (shapes, dtype, rows), measured
    in place.

    The first calls of a key take the candidate forms in turn and time them, on the model's own
    weights streamed as the pass streams them; then the one with the lowest median is kept for
    the process. No per-machine constant: what wins differs by CPU and BLAS (see `linear`).
    """

    def __init__(self, mode: str = "auto") -> None:
        self.chosen: dict[tuple, str] = {}
        self.trials: dict[tuple, dict[str, list[float]]] = {}
        self.force(mode)

    def force(self, mode: str) -> None:
        """``auto`` (measure), ``mm`` or ``linear`` from now on (a forced mode names the first or
        the last form of every candidate list)."""
        if mode not in ("auto", "mm", "linear"):
            raise ValueError(f"the few-row form must be auto, mm or linear ({FEW_ROWS_ENV}), got {mode!r}")
        self.mode = mode

    def run(self, key: tuple, forms: dict[str, Callable[[], object]]):
        """Run the form chosen for ``key`` (``forms``: name -> thunk, the ``mm`` one first and the
        plain ``F.linear`` one last), measuring while the key is not yet settled."""
        if self.mode != "auto":
            names = list(forms)
            return forms[names[0] if self.mode == "mm" else names[-1]]()
        chosen = self.chosen.get(key)
        if chosen is not None:
            return forms[chosen]()
        times = self.trials.setdefault(key, {name: [] for name in forms})
        name = min(forms, key=lambda n: len(times[n]))  # each in turn
        start = time.perf_counter()
        out = forms[name]()
        times[name].append(time.perf_counter() - start)
        if all(len(t) >= TRIALS_PER_FORM for t in times.values()):
            self.chosen[key] = min(times, key=lambda n: statistics.median(times[n]))
            self.trials.pop(key, None)  # a drafter thread may settle the same shape at the same time
        return out


FEW_ROW_FORMS = _FewRowForms(os.environ.get(FEW_ROWS_ENV, "auto"))


def _few_rows(x: Tensor) -> int:
    """The rows of a CPU inference product that the few-row forms apply to; 0 for any other."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= SMALL_ROWS or x.device.type != "cpu" or torch.is_grad_enabled():
        return 0
    return rows


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, computed the faster way for the few rows of a CPU decode or
    verification pass.

    For 1-6 rows the BLAS may be far faster on ``weight @ x.T`` (the weight as the long operand,
    the rows as a few columns; one row is sent as two, the row twice, which keeps it off a slow
    gemv) than on ``x @ weight.T``, or far slower, by CPU: on 2 AVX2 cores of an AMD EPYC (MKL)
    SmolLM2's 30 layers took 24 ms against 58 ms at 4 rows and plain decoding went 15.6 -> 18
    tok/s; on 2 cores of an AVX-512 Xeon the same change halved plain decoding (30.8 -> 14 tok/s).
    So the form is measured per shape (`_FewRowForms`), or forced with ``SPECD_CPU_FEW_ROWS``.
    Results differ from ``F.linear``'s by rounding only (another summation order). Training
    (gradients), GPUs and passes of more rows take ``F.linear``.
    """
    rows = _few_rows(x)
    if not rows:
        return F.linear(x, weight, bias)
    key = (tuple(weight.shape), weight.dtype, rows)
    chosen = "linear" if FEW_ROW_FORMS.mode == "linear" else FEW_ROW_FORMS.chosen.get(key)
    if chosen == "linear":  # the settled common case, without building the forms
        return F.linear(x, weight, bias)
    forms = {"mm": lambda: _mm_form(x, weight, bias, rows), "linear": lambda: F.linear(x, weight, bias)}
    return FEW_ROW_FORMS.run(key, forms)


def grouped_linear(x: Tensor, linears: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
    """``(m(x) for m in linears)`` (QKV, gate/up): for a few-row CPU pass, the fastest of four
    forms measured in place (`_FewRowForms`): one product over a fused copy of the weights
    (`fused_weight`) or one per weight, each as ``W @ x.T`` or ``F.linear``. Where the fused copy
    loses it is dropped again (it costs its weights' memory: 300 MB for SmolLM2)."""
    rows = _few_rows(x)
    if not rows or any(m.bias is not None for m in linears):
        return tuple(m(x) for m in linears)
    key = (tuple(m.weight.shape for m in linears), linears[0].weight.dtype, rows)
    chosen = "separate-linear" if FEW_ROW_FORMS.mode == "linear" else FEW_ROW_FORMS.chosen.get(key)
    if chosen is not None and chosen.startswith("separate"):
        linears[0].__dict__.pop("_specd_fused", None)  # made while measuring: its memory back
        if chosen == "separate-linear":  # the settled common case, without building the forms
            return tuple(F.linear(x, m.weight) for m in linears)
    sizes = [m.out_features for m in linears]
    forms = {
        "fused-mm": lambda: _mm_form(x, fused_weight(linears), None, rows).split(sizes, dim=-1),
        "separate-mm": lambda: tuple(_mm_form(x, m.weight, None, rows) for m in linears),
        "fused-linear": lambda: F.linear(x, fused_weight(linears)).split(sizes, dim=-1),
        "separate-linear": lambda: tuple(F.linear(x, m.weight) for m in linears),
    }
    return tuple(FEW_ROW_FORMS.run(key, forms))


def _mm_form(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``rows`` rows, computed as ``weight @ x.T`` (see `linear`)."""
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()  # contiguous: a stride-0 operand would leave BLAS
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and state dict) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def _version(tensor: Tensor) -> int:
    """The in-place write counter (-1 for an inference tensor, which keeps none)."""
    return -1 if tensor.is_inference() else tensor._version


def fused_weight(linears: tuple[nn.Linear, ...]) -> Tensor | None:
    """One ``[sum(out), in]`` copy of the weights of ``linears``, for one matrix product instead of
    several (QKV, gate/up) in inference passes; None wherever autograd records (training passes
    keep exactly the products they always had), with biases, or on a GPU (where separate kernels
    cost little).

    The copy is kept on the first module and made again whenever a weight changes: another
    tensor (tensor-parallel slicing, ``.to()``) or an in-place write (an optimizer step, a
    ``load_state_dict``), which the tensors' version counters show. A copy, not views the
    parameters are re-pointed at: parameters may be shared with other modules (a drafter built
    from its target) or wrapped (FSDP), and must stay exactly the tensors they were. It costs the
    memory of those weights once more (SmolLM2: 300 MB of fp32), and only on the CPU.
    """
    weights = [module.weight for module in linears]
    first = weights[0]
    if first.device.type != "cpu" or any(m.bias is not None for m in linears) or torch.is_grad_enabled():
        return None
    key = tuple((w.data_ptr(), _version(w), tuple(w.shape), w.dtype) for w in weights)
    cached = getattr(linears[0], "_specd_fused", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    # A normal tensor even inside inference_mode (which would make it an inference tensor).
    with torch.inference_mode(False), torch.no_grad():
        whole = torch.cat([w.detach() for w in weights])
    object.__setattr__(linears[0], "_specd_fused", (key, whole))  # not a buffer: never in a state dict
    return whole


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., dim]
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same products in one fused op (a third of the time of the five below on a CPU).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_tables(
    positions: Tensor,  # [num_seqs, max_new] int64
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """cos, sin: ``[num_seqs, max_new, head_dim]`` for the "rotate half" convention."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [num_seqs, max_new, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def token_major(rotary: tuple[Tensor, Tensor], real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`rotary_tables`' ``[num_seqs, max_new, head_dim]`` cos/sin as ``[num_tokens, head_dim]``,
    the real tokens' only with ``real`` (`ForwardBatch.real_index`): what `GQAttention` takes,
    built once per pass rather than gathered again in every layer."""
    cos, sin = (table.reshape(-1, table.shape[-1]) for table in rotary)
    return (cos, sin) if real is None else (cos[real], sin[real])


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: ``[num_seqs, num_heads, max_new, head_dim]``; cos/sin: ``[num_seqs, max_new, head_dim]``
    (or token-major: x ``[num_tokens, num_heads, head_dim]``, cos/sin ``[num_tokens, head_dim]``)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = grouped_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


class GQAttention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3; ``qk_norm=False``: none, as in
    Llama), over a `ForwardBatch`. ``bias`` is on all four projections, as in Hugging Face's
    Qwen3 and Llama (``attention_bias``).

    With a cache, the new keys/values are written to their slots and queries attend over the
    slots the batch mask allows; without one, over the new tokens themselves. The attention
    itself is the pass's backend (`specd.models.attention`).
    """

    def __init__(
        self,
        *,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool = False,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()

    def forward(
        self,
        x: Tensor,  # [num_seqs, max_new, hidden], or [num_real, hidden] with ``real``
        rotary: tuple[Tensor, Tensor],  # cos, sin [num_tokens, head_dim] (`token_major`: x's tokens)
        batch: ForwardBatch,
        cache: KVCache | None,
        attention: AttentionMetadata,  # the pass's mask and backend (built once per pass)
        real: Tensor | None = None,
    ) -> Tensor:
        """With ``real`` (`ForwardBatch.real_index`), ``x`` holds the real tokens only: the
        projections, the q/k norms and the rotary embedding run on those, and only the cache write
        and the attention itself see the padded grid. A prompt of 190 tokens prefilled beside 15
        decoding rows is a grid of 3040 positions for 205 real tokens, and the norms and rotary
        embedding of the grid (elementwise, over q and k) cost more than the prompt's products.

        Padded or not, the norms and the rotary embedding run token-major (``[tokens, heads,
        head_dim]``, contiguous), so a token gets the same arithmetic, bit for bit, whichever
        batch it is in (a scorer that batches other sequences beside it, or none)."""
        num_seqs, max_new = batch.input_ids.shape if real is not None else x.shape[:2]
        q, k, v = grouped_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rotary
        q = apply_rotary(self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(-1, self.num_kv_heads * self.head_dim)
        if real is not None:
            q, k, v = (unpack(t.flatten(1), real, num_seqs, max_new) for t in (q, k, v))
        split = lambda t, h: t.reshape(num_seqs, max_new, h, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(q, self.num_heads), split(k, self.num_kv_heads), split(v, self.num_kv_heads)
        if cache is not None:
            k, v = cache.update(self.layer_index, k, v, batch)
        out = attention.attend(q, k, v).transpose(1, 2)  # [num_seqs, max_new, num_heads, head_dim]
        if real is not None:
            return self.o_proj(out.reshape(num_seqs * max_new, -1)[real])
        return self.o_proj(out.reshape(num_seqs, max_new, -1))


def unpack(x: Tensor, real: Tensor, num_seqs: int, max_new: int) -> Tensor:
    """``[num_real, width]`` rows back onto the padded grid ``[num_seqs, max_new, width]`` (zeros
    at padding, whose outputs nobody reads)."""
    grid = x.new_zeros(num_seqs * max_new, x.shape[-1])
    grid[real] = x
    return grid.view(num_seqs, max_new, -1)
