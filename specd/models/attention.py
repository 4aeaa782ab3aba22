"""Attention backends: one small interface, several implementations, chosen per model.

Every attention layer (Qwen3's `GQAttention`, the gated attention of Qwen3-Next and of the
sparse target, the D3D drafter's layers) ends in the same call,

    attention.attend(q, k, v)
        q     [num_seqs, num_heads,    max_new,  head_dim]
        k, v  [num_seqs, num_kv_heads, num_keys, head_dim]    (GQA: num_heads % num_kv_heads == 0)
        ->    [num_seqs, num_heads,    max_new,  head_dim]

where ``attention`` is an `AttentionMetadata`: built ONCE per pass from the step's
`ForwardBatch` by the model, passed down to every layer (never global), holding the step's
boolean mask (or ``None``: plain causal over the new tokens, no cache), the causal shape of the
step when a backend can use it, and the backend the model was told to use. A backend is a small
object with one method, ``attend(q, k, v, metadata)``.

Backends (`get_backend(name)`):

- ``"sdpa"``: `F.scaled_dot_product_attention`, ``is_causal`` for dense causal passes, else the
  boolean mask; runs everywhere; the reference the others are tested against.
- ``"flex"``: `torch.nn.attention.flex_attention` with a ``mask_mod`` that reads the step's
  boolean mask (a tree mask becomes a block mask, so fully masked key blocks are skipped).
  Compiled (`torch.compile`) on CUDA; eager on the CPU, where it materialises the scores (slow
  for long contexts, exact).
- ``"flash"``: flash-attn, on CUDA fp16/bf16 tensors with head_dim <= 256, for the shapes it
  has: dense causal passes (``flash_attn_func``, causal) and causal chunks appended to a KV
  cache with one chunk length for every sequence — decode, equal-length prefill or chain
  verification (``flash_attn_with_kvcache``, whose causal mask is aligned to the bottom right,
  i.e. query ``j`` sees slots ``< cache_len + j + 1``). Everything else (token trees, ragged
  chunks, fp32, CPU tensors) **falls back to "sdpa"**. Choosing it without flash-attn installed
  raises at choice time, naming the install command; importing specd never needs it.
- ``"triton"``: the tree-attention kernel of `specd.kernels.tree_attention` (any mask, one
  pass over the keys); needs CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``.
- ``"auto"`` (the default): "flash" for CUDA tensors when flash-attn imports (so trees fall
  back to "sdpa"), "sdpa" otherwise.

**Choosing a backend** is ``model.set_attention_backend(name)`` on `Qwen3ForCausalLM`,
`Qwen3NextForCausalLM` (and the sparse target) and `D3DModel`; a new model starts with
"auto". A setter rather than a config field: the backend is a property of the machine a model
runs on, not of its checkpoint, so ``config.json`` stays what Hugging Face reads and
`specd.models.loading.load_model` needs no new argument; a service config names the backend
and calls the setter after loading.

Rows whose mask is all False (no key visible) come out as zeros in "sdpa" (PyTorch 2.13's CPU
kernel, as the tests check), "flex" and "triton"; `ForwardBatch` gives padding rows slot 0, so
its own masks have no such rows (the sparse target's selections are never empty either).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from specd.batch import ForwardBatch
from specd.kernels.runtime import INSTALL_HINT as TRITON_INSTALL_HINT
from specd.kernels.runtime import triton_available

FLASH_INSTALL_HINT = "pip install flash-attn --no-build-isolation (CUDA only)"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


class AttentionBackend:
    """How one pass's attention is computed (see the module docstring). Stateless per step."""

    name: ClassVar[str] = ""

    def attend(
        self,
        q: Tensor,  # [num_seqs, num_heads, max_new, head_dim]
        k: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
        v: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
        metadata: AttentionMetadata,
    ) -> Tensor:  # [num_seqs, num_heads, max_new, head_dim]
        raise NotImplementedError

    def uses_key_lens(self, device: torch.device) -> bool:
        """Whether this backend reads `AttentionMetadata.causal_key_lens` for tensors on ``device``
        (finding it costs a comparison over the mask and one host sync per pass)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every attention layer of one pass needs; built once per pass by `from_batch`."""

    backend: AttentionBackend
    mask: Tensor | None  # [num_seqs or 1, max_new, num_keys] bool; None: causal over the new tokens
    causal_key_lens: Tensor | None = None
    """[num_seqs] int32, only when the mask is "causal chunks appended to the cache": query ``j``
    of sequence ``b`` sees exactly slots ``[0, causal_key_lens[b] - max_new + j]`` (and only
    when the backend asked for it, see `AttentionBackend.uses_key_lens`)."""
    split: tuple[int, Tensor] | None = None
    """``(width, long_rows)``: attend over the first ``width`` new tokens of every sequence, then
    over the rest of the rows in ``long_rows`` only (see `attention_split`)."""

    @staticmethod
    def from_batch(batch: ForwardBatch, backend: AttentionBackend) -> AttentionMetadata:
        if batch.dense_causal:
            return AttentionMetadata(backend=backend, mask=None)
        # A static (graph-captured) pass may not sync with the host: it takes the masked path.
        wants = backend.uses_key_lens(batch.mask.device) and batch.scratch_slot < 0
        key_lens = causal_key_lens(batch) if wants else None
        split = None if key_lens is not None else attention_split(batch)
        return AttentionMetadata(backend=backend, mask=batch.mask, causal_key_lens=key_lens, split=split)

    def with_mask(self, mask: Tensor) -> AttentionMetadata:
        """This step with another mask ``[num_seqs or 1, max_new, num_keys]`` (the sparse target's
        top-k selection): no longer known to be causal."""
        return AttentionMetadata(backend=self.backend, mask=mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``[num_seqs, num_heads, max_new, head_dim]`` through this pass's backend."""
        if self.split is None:
            return self.backend.attend(q, k, v, self)
        width, rows = self.split
        long = self.backend.attend(
            q[rows, :, width:], k[rows], v[rows], AttentionMetadata(backend=self.backend, mask=self.mask[rows, width:]))
        # In the backend's output dtype, not q's: under CPU autocast SDPA answers in bf16 for fp32 q.
        out = long.new_zeros(*q.shape[:3], v.shape[-1])
        out[rows, :, width:] = long
        if width:  # (0: the short rows are idle ones, with no query at all)
            out[:, :, :width] = self.backend.attend(
                q[:, :, :width], k, v, AttentionMetadata(backend=self.backend, mask=self.mask[:, :width]))
        return out


def attention_split(batch: ForwardBatch) -> tuple[int, Tensor] | None:
    """Where a CPU inference pass mixes long rows with short ones (a prompt prefilled beside
    decoding sequences, a block verified beside one-token rows), attention over the padded grid
    computes every row at the longest row's width: one 150-token prompt beside 15 decoding rows
    is 2400 queries for 165 real ones. Split at the width that minimises the queries computed,
    ``num_seqs * width + len(long_rows) * (max_new - width)``; exact, since each query attends
    on its own. None where no split saves half the queries (or on a GPU, or in a graph)."""
    if batch.scratch_slot >= 0 or batch.mask.device.type != "cpu" or batch.mask.shape[0] != batch.num_seqs:
        return None
    if torch.is_grad_enabled():
        return None
    sizes = batch.num_new.tolist()
    if min(sizes) == batch.max_new:  # no padding (a decode step): nothing to split
        return None
    whole = len(sizes) * batch.max_new
    best, width = whole, batch.max_new
    for candidate in set(sizes):
        cost = len(sizes) * candidate + sum(1 for n in sizes if n > candidate) * (batch.max_new - candidate)
        if cost < best:
            best, width = cost, candidate
    if 2 * best > whole:
        return None
    return width, torch.tensor([b for b, n in enumerate(sizes) if n > width], dtype=torch.long)


def causal_key_lens(batch: ForwardBatch) -> Tensor | None:
    """``[num_seqs]`` int32 ``cache_len + num_new`` when every sequence appends a causal chunk of
    ``max_new`` tokens at its cache length (decode, equal prefill chunks, chain verification),
    else None (trees, branches at earlier anchors, ragged chunks, padding rows)."""
    mask = batch.mask  # [num_seqs or 1, max_new, num_keys]
    max_new, num_keys = mask.shape[1], mask.shape[2]
    device = mask.device
    last_slot = batch.cache_lens[:, None] + torch.arange(max_new, device=device)  # [num_seqs, max_new]
    expected = torch.arange(num_keys, device=device)[None, None, :] <= last_slot[..., None]
    causal = (batch.num_new == max_new).all() & (mask == expected).all()
    if not bool(causal):  # the pass's one host sync
        return None
    return (batch.cache_lens + batch.num_new).to(torch.int32)


class SdpaBackend(AttentionBackend):
    """`F.scaled_dot_product_attention`: ``is_causal`` for dense causal passes, else the mask."""

    name = "sdpa"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, metadata: AttentionMetadata) -> Tensor:
        gqa = q.shape[1] != k.shape[1]
        if metadata.mask is None:
            # Dense causal (training) shape: SDPA picks its fused causal kernel, no mask tensor.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.mask[:, None], enable_gqa=gqa)


def _causal(batch, head, q_index, kv_index):  # flex mask_mod for dense causal passes
    return q_index >= kv_index


class FlexBackend(AttentionBackend):
    """FlexAttention with a ``mask_mod`` reading the step's mask; compiled on CUDA only."""

    name = "flex"

    def __init__(self) -> None:
        # Compiled only where CUDA exists (merely wrapping imports dynamo: seconds); lazy, so
        # nothing compiles before the first CUDA call. Dynamic: num_keys grows every decode step.
        self.compiled = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, metadata: AttentionMetadata) -> Tensor:
        num_seqs, num_heads, max_new, _ = q.shape
        num_keys = k.shape[2]
        if metadata.mask is None:
            mask_mod, mask_batch = _causal, None
        else:
            mask = metadata.mask.expand(num_seqs, max_new, num_keys)

            def mask_mod(batch, head, q_index, kv_index):
                return mask[batch, q_index, kv_index]

            mask_batch = num_seqs
        block_mask = create_block_mask(mask_mod, mask_batch, None, max_new, num_keys, device=q.device)
        run = self.compiled if q.is_cuda and self.compiled is not None else flex_attention
        return run(q, k, v, block_mask=block_mask, enable_gqa=num_heads != k.shape[1])


def flash_attn_functions() -> tuple[Callable, Callable] | None:
    """(flash_attn_func, flash_attn_with_kvcache), or None when flash-attn does not import."""
    try:
        flash_attn = importlib.import_module("flash_attn")
    except ImportError:
        return None
    return flash_attn.flash_attn_func, flash_attn.flash_attn_with_kvcache


class FlashBackend(AttentionBackend):
    """flash-attn for causal passes on CUDA (see the module docstring); "sdpa" for the rest."""

    name = "flash"

    def __init__(self) -> None:
        functions = flash_attn_functions()
        if functions is None:
            raise RuntimeError(
                "attention backend 'flash' needs flash-attn, which is not importable here: install it "
                f"with `{FLASH_INSTALL_HINT}`, or choose another backend ({', '.join(BACKENDS)})"
            )
        self.flash_attn_func, self.flash_attn_with_kvcache = functions
        self.fallback = SdpaBackend()

    def uses_key_lens(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, metadata: AttentionMetadata) -> Tensor:
        runs = q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        # flash-attn takes [num_seqs, tokens, heads, head_dim]: a transposed view, no copy.
        q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if runs and metadata.mask is None:
            out = self.flash_attn_func(q_t, k_t, v_t, causal=True)
        elif runs and metadata.causal_key_lens is not None:
            # Bottom-right causal over the first cache_seqlens slots: query j sees cache_len + j + 1.
            out = self.flash_attn_with_kvcache(q_t, k_t, v_t, cache_seqlens=metadata.causal_key_lens, causal=True)
        else:
            return self.fallback.attend(q, k, v, metadata)
        return out.transpose(1, 2)  # [num_seqs, num_heads, max_new, head_dim]


class TritonBackend(AttentionBackend):
    """The tree-attention Triton kernel (`specd.kernels.tree_attention`) for every mask."""

    name = "triton"

    def __init__(self) -> None:
        if not triton_available():
            raise RuntimeError(f"attention backend 'triton' needs Triton: {TRITON_INSTALL_HINT}")
        # The kernel module imports Triton, so it is loaded only once Triton is known to exist.
        self.kernel = importlib.import_module("specd.kernels.tree_attention").tree_attention

    def attend(self, q: Tensor, k: Tensor, v: Tensor, metadata: AttentionMetadata) -> Tensor:
        return self.kernel(q, k, v, metadata.mask)


class AutoBackend(AttentionBackend):
    """"flash" on CUDA when flash-attn imports (trees fall back to "sdpa"), else "sdpa"."""

    name = "auto"

    def __init__(self) -> None:
        self.sdpa = SdpaBackend()
        self.flash = FlashBackend() if flash_attn_functions() is not None else None

    def uses_key_lens(self, device: torch.device) -> bool:
        return self.flash is not None and self.flash.uses_key_lens(device)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, metadata: AttentionMetadata) -> Tensor:
        if self.flash is not None and q.is_cuda:
            return self.flash.attend(q, k, v, metadata)
        return self.sdpa.attend(q, k, v, metadata)


BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (AutoBackend, SdpaBackend, FlexBackend, FlashBackend, TritonBackend)
}


def get_backend(name: str) -> AttentionBackend:
    """A new backend by name; raises when it is unknown or cannot run here (saying what to do)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
