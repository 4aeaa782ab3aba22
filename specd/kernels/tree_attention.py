"""Tree attention: one step's masked attention (prefill, decode, verification, token trees).

Every target pass is a batch of token trees appended after each sequence's cached context
(`specd.batch.ForwardBatch`): query ``j`` of sequence ``b`` may see the key slots its row of the
boolean mask ``[num_seqs, max_new, num_keys]`` allows (the context before its tree's anchor,
then its own ancestors). This kernel computes

    out[b, h, j] = softmax_s( q[b, h, j] . k[b, h // group, s] / sqrt(d)  where mask[b, j, s] ) @ v

without materialising the scores, FlashAttention-style (Dao et al., arXiv 2205.14135; the loop
order of FlashAttention-2, arXiv 2307.08691): a program walks the keys in blocks and keeps, per
query row, the running maximum ``m``, the running sum ``l`` and the unnormalised output ``acc``:

    m' = max(m, rowmax(s));  alpha = 2^(m - m');  p = 2^(s - m')          (FA2, Algorithm 1)
    l' = alpha * l + rowsum(p);  acc' = alpha * acc + p @ v;  out = acc / l

Design choices:

- **One program per (sequence, kv head, block of query rows)**, where the rows are the flattened
  (query, head-of-the-group) pairs: a GQA group's query heads share their keys, so packing them
  into one tile reads each key/value block once per group instead of once per head (the same
  trick as FlashDecoding/FlashInfer's GQA decode). With ``num_heads == num_kv_heads`` it is the
  usual one program per (sequence, head, query block). Decode (one query) then still fills a
  tile with ``group`` rows.
- **The mask is read as bytes** from the step's boolean tensor (a batch stride of 0 broadcasts
  one mask over every sequence, as `ForwardBatch.dense` makes it). A key block that no row of
  the tile may see is skipped (tree siblings, padding rows, shorter sequences of a ragged batch).
  ``mask=None`` is plain causal attention over the new tokens (no cache), computed from indices.
- **Rows that see no key** produce zeros (``l = 0`` is divided as 1), as PyTorch's SDPA does for
  a fully masked row on the CPU; `ForwardBatch` gives padding rows slot 0, so its rows always
  see a key, and padding rows are finite and never read.
- Scores and the softmax are fp32 whatever the input dtype; ``p`` is cast to the value dtype for
  the second product (FlashAttention's choice). fp32 inputs use IEEE products (not TF32) so the
  kernel matches the fp32 reference to ~1e-6.
- ``bug`` builds deliberately wrong variants (tests check that the comparison catches them).

`tree_attention_reference` is the plain-torch definition (SDPA with the boolean mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from specd.kernels.runtime import autotune_configs, require

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BUGS = {"": 0, "no_rescale": 1, "no_mask": 2}  # deliberately wrong variants, for tests only
LOG2_E = 1.4426950408889634


def tree_attention_reference(
    q: Tensor,  # [num_seqs, num_heads, max_new, head_dim]
    k: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
    v: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
    mask: Tensor | None,  # [num_seqs or 1, max_new, num_keys] bool; None: causal, num_keys == max_new
) -> Tensor:
    """``[num_seqs, num_heads, max_new, head_dim]``: SDPA with the boolean mask (GQA)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)


def _configs() -> list:
    # The first config is the interpreter's (small tiles: several key blocks even in tiny tests).
    tiles = [(16, 16, 4, 1), (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2), (32, 64, 4, 3), (16, 128, 4, 3)]
    return autotune_configs([
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles
    ])


# Keyed on the shape class, not on num_keys (which grows every decode step): tuning once per
# (head_dim, group, causal, rows bucket) and reusing it is what a serving loop needs.
@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "CAUSAL", "rows_bucket"])
@triton.jit
def _tree_attention_kernel(
    Q, K, V, Mask, Out,
    stride_qs, stride_qh, stride_qn,
    stride_ks, stride_kh, stride_kn,
    stride_vs, stride_vh, stride_vn,
    stride_ms, stride_mn,
    stride_os, stride_oh, stride_on,
    num_kv_heads, num_new, num_keys, rows_bucket, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    BUG: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row_block = tl.program_id(0)
    seq = (tl.program_id(1) // num_kv_heads).to(tl.int64)  # a big cache's offsets pass 2^31
    kv_head = tl.program_id(1) % num_kv_heads
    num_rows = num_new * GROUP
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (query, head in group)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_ptrs = Q + seq * stride_qs + head[:, None] * stride_qh + query[:, None] * stride_qn + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + seq * stride_ks + kv_head * stride_kh
    v_base = V + seq * stride_vs + kv_head * stride_vh
    m_base = Mask + seq * stride_ms + query[:, None] * stride_mn

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running unnormalised output

    key_end = num_keys
    if CAUSAL:  # keys == queries: the tile's last query sees no key past itself
        last_query = (tl.minimum((row_block + 1) * BLOCK_M, num_rows) - 1) // GROUP
        key_end = tl.minimum(num_keys, last_query + 1)
    for start in range(0, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = keys < num_keys
        if CAUSAL:
            visible = key_ok[None, :] & (keys[None, :] <= query[:, None])
        else:
            bits = tl.load(m_base + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0)
            visible = bits != 0  # [BLOCK_M, BLOCK_N]
        if BUG == 2:
            visible = key_ok[None, :] & (query[:, None] >= 0)
        if tl.max(visible.to(tl.int32)) > 0:  # skip key blocks no row of the tile may see
            k_t = tl.load(k_base + keys[None, :] * stride_kn + dims[:, None],
                          mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            if IEEE:
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            s = tl.where(visible, s * scale_log2, float("-inf"))  # [BLOCK_M, BLOCK_N] log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; shift by 0 so no inf - inf = NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(s - m_shift[:, None])
            if BUG == 1:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            v_blk = tl.load(v_base + keys[:, None] * stride_vn + dims[None, :],
                            mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if IEEE:
                pv = tl.dot(p.to(v_blk.dtype), v_blk, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v_blk.dtype), v_blk)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw no key: zeros (as SDPA)
    o_ptrs = Out + seq * stride_os + head[:, None] * stride_oh + query[:, None] * stride_on + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """Raise a ValueError that says what is wrong with the arguments of `tree_attention`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"tree_attention: {name} must be 4-D [num_seqs, heads, tokens, head_dim], "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"tree_attention: {name} has dtype {t.dtype}; expected one of {DTYPES}")
        if t.stride(-1) != 1:
            raise ValueError(f"tree_attention: {name} must be contiguous in head_dim (stride(-1) == 1), "
                             f"got strides {t.stride()}")
    num_seqs, num_heads, max_new, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"tree_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k.shape[0] != num_seqs or k.shape[3] != head_dim:
        raise ValueError(f"tree_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} "
                         "(need the same num_seqs and head_dim)")
    if num_heads % k.shape[1]:
        raise ValueError(f"tree_attention: num_heads {num_heads} is not a multiple of num_kv_heads {k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"tree_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim > 256:
        raise ValueError(f"tree_attention: head_dim {head_dim} > 256 is not supported")
    num_keys = k.shape[2]
    if mask is None:
        if num_keys != max_new:
            raise ValueError(f"tree_attention: causal attention (mask=None) needs num_keys == max_new, "
                             f"got {num_keys} keys for {max_new} queries")
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"tree_attention: mask must be bool, got {mask.dtype}")
    if mask.dim() != 3 or mask.shape[0] not in (1, num_seqs) or tuple(mask.shape[1:]) != (max_new, num_keys):
        raise ValueError(f"tree_attention: mask must be [num_seqs or 1, max_new, num_keys] = "
                         f"[{num_seqs} or 1, {max_new}, {num_keys}], got {tuple(mask.shape)}")
    if mask.stride(-1) != 1:
        raise ValueError(f"tree_attention: mask must be contiguous over keys (stride(-1) == 1), got {mask.stride()}")


def tree_attention(
    q: Tensor,  # [num_seqs, num_heads, max_new, head_dim]
    k: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
    v: Tensor,  # [num_seqs, num_kv_heads, num_keys, head_dim]
    mask: Tensor | None,  # [num_seqs or 1, max_new, num_keys] bool; None: causal, num_keys == max_new
    *,
    bug: str = "",
) -> Tensor:
    """``[num_seqs, num_heads, max_new, head_dim]`` = `tree_attention_reference` (see module doc).

    Any strides with a contiguous last dimension (a slice of a KV cache works without a copy).
    ``bug`` ("no_rescale": the running sum is not rescaled; "no_mask": every key is visible)
    builds a deliberately wrong kernel, for tests only.
    """
    _check(q, k, v, mask)
    require(*(t for t in (q, k, v, mask) if t is not None), kernel="tree_attention")
    if bug not in BUGS:
        raise ValueError(f"tree_attention: unknown bug variant {bug!r}; expected one of {sorted(BUGS)}")
    num_seqs, num_heads, max_new, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if mask is None:
        mask_bytes, mask_strides = q.new_zeros(1, dtype=torch.uint8), (0, 0)
    else:
        # Same-size reinterpretation: no copy, keeps the (possibly 0) batch stride.
        mask_bytes = mask.view(torch.uint8)
        mask_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1))
    num_rows = max_new * group
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_M"]), num_seqs * num_kv_heads)
    _tree_attention_kernel[grid](
        q, k, v, mask_bytes, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *mask_strides,
        out.stride(0), out.stride(1), out.stride(2),
        num_kv_heads, max_new, num_keys, min(triton.next_power_of_2(num_rows), 128),
        head_dim**-0.5 * LOG2_E,  # softmax in base 2: 2^(x log2 e) = e^x
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        CAUSAL=mask is None, BUG=BUGS[bug], IEEE=q.dtype == torch.float32,
    )
    return out
