"""The sparse-linear target: indexer-selected top-k attention interleaved with Gated DeltaNet.

The skeleton is Qwen3-Next's (`specd.models.qwen3_next`: zero-centred norms, gated attention
with partial RoPE, Gated DeltaNet layers, dense SwiGLU MLPs); the ``sparse_attention`` layers
replace full attention by DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, arXiv 2512.02556,
section 2.1): a *lightning indexer* scores every key the query may see,

    I[t, s] = sum_j  w[t, j] * ReLU(q_I[t, j] . k_I[s])                      (DeepSeek-V3.2, eq. 1)

with H_I small indexer heads ``q_I[t, j]`` and per-head weights ``w[t, j]`` from the query token,
and one shared indexer key ``k_I[s]`` per key token; then the attention of query t runs over
only the ``index_topk`` keys of largest ``I[t, s]``. As in DeepSeek's inference code,
``k_I`` goes through a LayerNorm, q_I and k_I get RoPE on their first channels (here the same
partial-rotary width as the attention), and scores are scaled by ``H_I^-1/2 * d_I^-1/2``. Our
attention is GQA (not MLA), and the indexer reads the hidden state (not MLA's query latent).

**Branch-consistent indexer groups.** On a token tree, the top-k of a query is taken only over
the keys its branch can see: the context up to its anchor and its own ancestors (the row of
the batch's tree mask). Every token of a branch therefore selects from its branch's own key
set, exactly as the path would alone. Selecting over all keys of the pass first and masking
after is wrong twice over: sibling branches' keys take top-k places (so a query keeps fewer
than k keys, and which ones depends on its siblings' tokens), or, unmasked, they leak in.
Ties in ``I`` (exact zeros are common after the ReLU) break towards the more recent position,
a rule that does not depend on where a token sits in the packed pass.

**Training the indexer.** Top-k selection passes no gradient to the indexer, so (as in the dense
warm-up stage of DeepSeek-V3.2's continued pre-training) it is trained with
``KL(p[t, :] || softmax(I[t, :]))`` over the visible keys, where ``p`` is the main attention
distribution summed over heads and L1-normalised (no gradient), with the indexer's input
detached so the loss trains the indexer alone. We use that objective throughout pre-training;
it is added to the training loss through the output's backward (no extra return value).

This is a dense reference implementation: the selection is a boolean mask over the keys and
the model's attention backend does the work with it (`specd.models.attention`: "flash" falls
back to SDPA for such masks). A GPU kernel would gather the k selected keys (FlashMLA's sparse
kernels).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.models.attention import AttentionMetadata
from specd.models.qwen3_next import (
    LINEAR,
    GatedAttention,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    apply_partial_rotary,
)
from specd.state_cache import HybridCache, SlotStore

SPARSE = "sparse_attention"


@dataclass(kw_only=True, slots=True)
class SparseConfig(Qwen3NextConfig):
    layer_types: list[str] = field(default_factory=lambda: [LINEAR, LINEAR, LINEAR, SPARSE])
    """Per layer: "linear_attention" (Gated DeltaNet) or "sparse_attention" (indexer top-k)."""
    index_n_heads: int = 4
    """Lightning indexer heads H_I."""
    index_head_dim: int = 32
    """Lightning indexer query/key width d_I (at least the attention's rotary width)."""
    index_topk: int = 64
    """Keys each query attends to (all visible keys when it sees no more than this)."""
    index_loss_weight: float = 1.0
    """Weight of the indexer's KL loss in training (it trains the indexer only)."""

    model_type = "specd_sparse"
    architecture_name = "SpecdSparseForCausalLM"

    def __post_init__(self) -> None:
        Qwen3NextConfig.__post_init__(self)
        if self.index_head_dim < self.rotary_dim:
            raise ValueError(f"index_head_dim {self.index_head_dim} is below the rotary width {self.rotary_dim}")
        if self.index_topk < 1:
            raise ValueError("index_topk must be at least 1")

    @classmethod
    def mixer_kinds(cls) -> tuple[str, ...]:
        return (LINEAR, SPARSE)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "SparseConfig":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        values["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return cls(**values)

    def to_hf(self) -> dict[str, Any]:
        """Our own ``config.json`` (model_type "specd_sparse"; transformers has no such model)."""
        return {"architectures": [self.architecture_name], "model_type": self.model_type,
                "hidden_act": "silu", **asdict(self)}


FLAVOURS: dict[str, SparseConfig] = {
    # The zoo's sparse target: 3 Gated DeltaNet + 1 sparse-attention layer (top-64 of the keys).
    "tiny": SparseConfig(),
    # For unit tests: top-4 keys, so selection matters from the fifth token; chunks of 4.
    "debug": SparseConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=[LINEAR, SPARSE, LINEAR, SPARSE], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_chunk_size=4,
        index_n_heads=4, index_head_dim=16, index_topk=4,
    ),
}


class LightningIndexer(nn.Module):
    """``I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s])`` (DeepSeek-V3.2, eq. 1)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.wq = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def queries(self, x: Tensor, rotary: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """q_I ``[seqs, heads_I, new, d_I]`` (RoPE'd) and weights ``[seqs, new, heads_I]`` (scaled)."""
        num_seqs, max_new, _ = x.shape
        q = self.wq(x).view(num_seqs, max_new, self.num_heads, self.head_dim).transpose(1, 2)
        weights = self.weights_proj(x) * (self.num_heads * self.head_dim) ** -0.5
        return apply_partial_rotary(q, *rotary), weights

    def keys(self, x: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """k_I ``[seqs, new, d_I]`` (LayerNorm, RoPE'd)."""
        return apply_partial_rotary(self.k_norm(self.wk(x))[:, None], *rotary)[:, 0]

    @staticmethod
    def scores(queries: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
        """``[seqs, new, num_keys]`` from q_I, w and k_I ``[seqs, num_keys, d_I]``."""
        per_head = torch.relu(queries @ keys[:, None].transpose(-1, -2))  # [seqs, heads_I, new, keys]
        return (per_head * weights.transpose(1, 2)[..., None]).sum(dim=1)


def key_positions(batch: ForwardBatch, num_keys: int) -> Tensor:
    """``[seqs or 1, num_keys]`` position of each key slot: committed slot s holds position s,
    new slot ``cache_len + j`` holds ``batch.positions[:, j]``."""
    device = batch.input_ids.device
    if batch.dense_causal:
        return torch.arange(num_keys, device=device)[None]
    positions = torch.arange(num_keys, device=device).repeat(batch.num_seqs, 1)
    seq_index, new_index = (batch.write_slots >= 0).nonzero(as_tuple=True)
    positions[seq_index, batch.write_slots[seq_index, new_index]] = batch.positions[seq_index, new_index]
    return positions


def select_top_k(scores: Tensor, visible: Tensor, positions: Tensor, top_k: int) -> Tensor:
    """``[seqs, new, keys]`` bool: the ``top_k`` visible keys of largest score per query.

    ``visible`` ``[seqs or 1, new, keys]``: the keys the query's branch can see (the tree mask),
    so selection never looks outside the branch. Ties go to the more recent position.
    """
    visible = visible.expand_as(scores)
    if scores.shape[-1] <= top_k:
        return visible
    # Order keys by position, most recent first; a stable sort by score then keeps that order
    # among equal scores, whatever the slots' order in the pass.
    recent_first = positions.argsort(dim=-1, descending=True, stable=True)  # [seqs or 1, keys]
    order = recent_first[:, None].expand_as(scores)
    ranked = scores.float().masked_fill(~visible, float("-inf")).gather(-1, order)
    best = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    chosen = order.gather(-1, best)
    selected = torch.zeros_like(visible).scatter_(-1, chosen, True)
    return selected & visible


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also feeds d(loss) = 1: adds ``loss`` to whatever is
    back-propagated through ``x`` (the pattern of DeepSeek's MoE auxiliary losses)."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


class SparseAttention(GatedAttention):
    """Qwen3-Next gated attention over the lightning indexer's top-k keys of each query's branch."""

    def __init__(self, config: SparseConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.top_k = config.index_topk
        self.loss_weight = config.index_loss_weight
        self.indexer = LightningIndexer(config.hidden_size, config.index_n_heads, config.index_head_dim)

    def forward(self, x: Tensor, rotary, batch: ForwardBatch, cache: HybridCache | None,
                attention: AttentionMetadata) -> Tensor:
        q, k, v, gate = self.qkv(x, rotary)
        # The indexer reads a detached input: its only training signal is its own KL loss.
        index_q, index_w = self.indexer.queries(x.detach(), rotary)
        index_k = self.indexer.keys(x.detach(), rotary)
        if cache is not None:
            k, v = cache.kv.update(self.layer_index, k, v, batch)
            cache.index_keys.write(self.layer_index, index_k, batch)
            index_k = cache.index_keys.tensors[self.layer_index][:, : k.shape[2]]
        num_keys = k.shape[2]
        visible = batch.mask  # [seqs or 1, new, keys]: context up to the anchor + ancestors
        scores = self.indexer.scores(index_q, index_w, index_k.to(index_q.dtype))
        selected = self.select(scores, visible, key_positions(batch, num_keys))
        out = self.attend(q, k, v, gate, attention.with_mask(selected))
        if self.training and torch.is_grad_enabled() and self.loss_weight > 0:
            out = _AttachLoss.apply(out, self.loss_weight * self.indexer_loss(q, k, scores, visible))
        return out

    def select(self, scores: Tensor, visible: Tensor, positions: Tensor) -> Tensor:
        """Branch-consistent selection (see the module docstring)."""
        return select_top_k(scores, visible, positions, self.top_k)

    def indexer_loss(self, q: Tensor, k: Tensor, scores: Tensor, visible: Tensor) -> Tensor:
        """KL(main attention summed over heads || softmax(I)) over visible keys (DeepSeek-V3.2's warm-up)."""
        visible = visible.expand_as(scores)
        with torch.no_grad():
            k_all = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            logits = (q @ k_all.transpose(-1, -2)).float() * self.head_dim**-0.5
            probs = logits.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1).sum(dim=1)
            target = probs / probs.sum(dim=-1, keepdim=True)
        log_index = scores.float().masked_fill(~visible, float("-inf")).log_softmax(dim=-1)
        terms = target * (target.clamp_min(1e-12).log() - log_index)
        return torch.where(visible, terms, 0.0).sum(dim=-1).mean()


class SparseForCausalLM(Qwen3NextForCausalLM):
    config_class = SparseConfig

    def make_mixer(self, kind: str, ordinal: int) -> nn.Module:
        if kind == SPARSE:
            return SparseAttention(self.config, ordinal)
        return super().make_mixer(kind, ordinal)

    def new_cache(self, num_seqs: int, capacity: int = 256) -> HybridCache:
        cache = super().new_cache(num_seqs, capacity)
        weight = self.model.embed_tokens.weight
        cache.index_keys = SlotStore(
            num_layers=self.num_mixers.get(SPARSE, 0), num_seqs=num_seqs, features=(self.config.index_head_dim,),
            capacity=capacity, dtype=weight.dtype, device=weight.device,
        )
        return cache
