"""Building blocks shared by the architectures: RMSNorm, rotary embeddings, SwiGLU, attention.

They follow the Hugging Face Qwen3 numerics exactly (norm in fp32, rotary tables in fp32 cast
to the activation dtype) so that logits match `transformers` to ~1e-6 in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache
from specd.models.attention import AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., dim]
        dtype = x.dtype
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


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: ``[num_seqs, num_heads, max_new, head_dim]``; cos/sin: ``[num_seqs, max_new, head_dim]``."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3), over a `ForwardBatch`.

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
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()

    def forward(
        self,
        x: Tensor,  # [num_seqs, max_new, hidden]
        rotary: tuple[Tensor, Tensor],  # cos, sin [num_seqs, max_new, head_dim]
        batch: ForwardBatch,
        cache: KVCache | None,
        attention: AttentionMetadata,  # the pass's mask and backend (built once per pass)
    ) -> Tensor:
        num_seqs, max_new, _ = x.shape
        split = lambda t, h: t.view(num_seqs, max_new, h, self.head_dim).transpose(1, 2)  # noqa: E731
        q = self.q_norm(split(self.q_proj(x), self.num_heads))
        k = self.k_norm(split(self.k_proj(x), self.num_kv_heads))
        v = split(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            k, v = cache.update(self.layer_index, k, v, batch)
        out = attention.attend(q, k, v)  # [num_seqs, num_heads, max_new, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(num_seqs, max_new, -1))
