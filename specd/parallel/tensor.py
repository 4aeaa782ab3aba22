"""Tensor parallelism for the targets: one model's heads and channels split over the ranks of a
process group, Megatron-style (Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3).

``tensor_parallel(model, group)`` shards a loaded `Qwen3ForCausalLM`, `Qwen3NextForCausalLM` or
`SparseForCausalLM` IN PLACE. Afterwards every rank runs the same passes over the same batch, in
lockstep, each with its own cache (``model.new_cache`` then allocates the rank's own heads only),
and every rank gets the same full logits ``[.., vocab]``. Per layer, with W ranks, rank r:

- **attention** (GQA, Qwen3-Next's gated attention, the sparse target's): q/k/v projections are
  column-parallel by HEAD: query heads ``[r H/W, (r+1) H/W)`` and key/value heads
  ``[r KV/W, (r+1) KV/W)``, so under GQA a rank's query heads read exactly its own key/value
  heads (query head h reads kv head ``h // (H/KV)``). Qwen3-Next's ``q_proj`` emits query and
  gate interleaved per head, so the per-head slice keeps both. q/k norms are per head (their
  weight is over head_dim): replicated. ``o_proj`` is row-parallel: partial sums, one all-reduce.
- **MLP** (SwiGLU): gate/up column-parallel, down row-parallel + all-reduce.
- **Gated DeltaNet**: key heads ``[r K/W, (r+1) K/W)`` and their value-head groups. ``in_proj_qkvz``
  and ``in_proj_ba`` are grouped by key head (as in HF's Qwen3-Next), so a rank's rows are one
  contiguous span; the conv channels are laid out ``[q | k | v]`` over all heads, so a rank keeps
  three spans; ``A_log`` / ``dt_bias`` per value head; the gated norm is over value_head_dim
  (replicated); ``out_proj`` row-parallel. The recurrence is per value head, so the recurrent
  state cache (conv inputs, gates, checkpoints, tips) holds local heads only.
- **Lightning indexer** (sparse target): REPLICATED on every rank. Top-k must pick the same keys
  on every rank (else ranks attend to different key sets and the all-reduced output is no
  model's output); the indexer reads the replicated hidden state, so replicas compute identical
  scores bit for bit, with no collective. It is small (H_I heads of d_I over one shared key), so
  splitting its heads would save little and cost an all-reduce of ``[new, keys]`` scores per layer.
- **LM head**: vocabulary-parallel: rank r holds rows ``[r V'/W, (r+1) V'/W)`` of the head (V'
  the vocabulary rounded up to a multiple of W, the last rank's extra rows zero), logits are
  all-gathered along the vocabulary and trimmed to V, so ``model(batch, cache)`` and
  ``model.lm_head(hidden)`` return the full ``[.., vocab]`` on every rank. Tied embeddings are
  untied: the embedding stays whole (an embedding lookup is cheap and needs no collective), the
  head gets its own sliced copy.
- Norms, embeddings, rotary tables: replicated.

**Why explicit slicing and not DTensor's `parallelize_module`.** The forward passes reshape with
head counts read from module attributes (``view(.., self.num_heads, head_dim)``), so a sharded
projection needs its attribute changed either way; the Gated DeltaNet conv's ``[q | k | v]``
channels are three strided spans per rank, which no ``Shard(dim)`` placement expresses (a
``ColwiseParallel`` plan would give rank 0 all of q); and on the decode path DTensor dispatch
adds per-op host overhead for nothing, since every activation is either replicated or local to a
head. So the modules stay plain ``nn.Linear`` / ``nn.Conv1d`` holding the rank's slice (the maths
of the model files runs unchanged on fewer heads), and the two collectives are explicit:
`RowParallelLinear` (``dist.all_reduce`` of partial sums, bias added once after it) and
`VocabParallelHead` (``dist.all_gather`` along the vocabulary). A `DeviceMesh` may be passed for
the group (its 1-D group is used).

The sharded model is for inference: parameters are frozen (the collectives run outside autograd),
and `specd.models.loading.save_model` refuses it (it holds 1/W of the weights). ``model.config``
keeps the checkpoint's (global) numbers, so the engine reads vocab_size and stop tokens as
before; ``model.tp_rank`` / ``model.tp_size`` / ``model.tp_group`` say how it is sharded.
Sums over ranks run in another order than one process's matmul: logits agree to ~1e-6 in fp32
(`tests/integration/test_tensor_parallel.py`), and agree exactly across ranks (gloo's and NCCL's
all-reduce hand every rank the same sum, which the replicated indexer's top-k relies on).

Not done (yet): key/value heads are not replicated when W exceeds their count (vLLM does), so
such a W is refused; the checkpoint is loaded whole, then sliced (a rank's peak host memory is
the whole model); the embedding is not vocabulary-parallel.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from specd.models.gated_deltanet import GatedDeltaNet
from specd.models.layers import GQAttention, Linear, SwiGLU, linear
from specd.models.qwen3_next import GatedAttention


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input features are split over the ranks
    (each rank holds the columns of its heads or channels), the output is whole on every rank."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out_features, local in_features]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out_features]
        self.group = group
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:  # [..., local in_features] -> [..., out_features]
        out = linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        # The bias once, after the sum (added on every rank before it, it would count W times).
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


class VocabParallelHead(nn.Module):
    """The LM head split along the vocabulary; returns the full ``[..., vocab_size]`` logits."""

    def __init__(self, weight: Tensor, vocab_size: int, group: ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [padded vocab / W, hidden]
        self.vocab_size = vocab_size
        self.group = group
        self.world_size = dist.get_world_size(group)

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden] -> [..., vocab_size]
        local = linear(x, self.weight).contiguous()  # [..., padded vocab / W]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]} (local), vocab_size={self.vocab_size}"


# ---------------------------------------------------------------------------------- slicing
def spans(count: int, rank: int, world_size: int, width: int, offset: int = 0) -> Tensor:
    """Feature indices of this rank's ``count / world_size`` units (heads, channels) of ``width``
    features each, in a layout that starts at ``offset``: ``[offset + r n w, offset + (r+1) n w)``."""
    local = count // world_size
    return torch.arange(offset + rank * local * width, offset + (rank + 1) * local * width)


def column_slice(linear: nn.Linear, rows: Tensor) -> nn.Linear:
    """A ``Linear`` keeping output features ``rows`` (column parallel: no collective)."""
    weight = linear.weight
    rows = rows.to(weight.device)
    out = Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(weight.index_select(0, rows), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.index_select(0, rows), requires_grad=False)
    return out


def row_slice(linear: nn.Linear, columns: Tensor, group: ProcessGroup) -> RowParallelLinear:
    """A `RowParallelLinear` keeping input features ``columns``."""
    weight = linear.weight
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(weight.index_select(1, columns.to(weight.device)), bias, group)


# ---------------------------------------------------------------------------------- layers
def shard_attention(attn: GQAttention | GatedAttention, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Query heads and their key/value heads to this rank; ``o_proj`` row-parallel."""
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    # head_dim rows per query head for Qwen3; 2 * head_dim (query then gate) for Qwen3-Next.
    q_width = attn.q_proj.out_features // num_heads
    attn.q_proj = column_slice(attn.q_proj, spans(num_heads, rank, world_size, q_width))
    kv_rows = spans(num_kv_heads, rank, world_size, head_dim)
    attn.k_proj = column_slice(attn.k_proj, kv_rows)
    attn.v_proj = column_slice(attn.v_proj, kv_rows)
    attn.o_proj = row_slice(attn.o_proj, spans(num_heads, rank, world_size, head_dim), group)
    attn.num_heads, attn.num_kv_heads = num_heads // world_size, num_kv_heads // world_size


def shard_mlp(mlp: SwiGLU, rank: int, world_size: int, group: ProcessGroup) -> None:
    channels = spans(mlp.gate_proj.out_features, rank, world_size, 1)
    mlp.gate_proj = column_slice(mlp.gate_proj, channels)
    mlp.up_proj = column_slice(mlp.up_proj, channels)
    mlp.down_proj = row_slice(mlp.down_proj, channels, group)


def shard_gated_deltanet(layer: GatedDeltaNet, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Key heads (with their value-head groups) to this rank; see the module docstring."""
    num_key_heads, num_value_heads = layer.num_key_heads, layer.num_value_heads
    key_head_dim, value_head_dim = layer.key_head_dim, layer.value_head_dim
    ratio = num_value_heads // num_key_heads
    # in_proj_qkvz / in_proj_ba rows are grouped per key head: [q k v.. z..] and [b.. a..].
    per_key_head = 2 * key_head_dim + 2 * ratio * value_head_dim
    layer.in_proj_qkvz = column_slice(layer.in_proj_qkvz, spans(num_key_heads, rank, world_size, per_key_head))
    layer.in_proj_ba = column_slice(layer.in_proj_ba, spans(num_key_heads, rank, world_size, 2 * ratio))
    # Conv channels are [q of all key heads | k of all key heads | v of all value heads].
    channels = torch.cat([
        spans(num_key_heads, rank, world_size, key_head_dim),
        spans(num_key_heads, rank, world_size, key_head_dim, offset=layer.key_dim),
        spans(num_value_heads, rank, world_size, value_head_dim, offset=2 * layer.key_dim),
    ])
    conv = layer.conv1d
    local = len(channels)
    layer.conv1d = nn.Conv1d(local, local, kernel_size=conv.kernel_size, groups=local, bias=False,
                             padding=conv.padding, device="meta")
    layer.conv1d.weight = nn.Parameter(conv.weight.index_select(0, channels.to(conv.weight.device)),
                                       requires_grad=False)
    value_heads = spans(num_value_heads, rank, world_size, 1).to(layer.A_log.device)
    layer.A_log = nn.Parameter(layer.A_log.index_select(0, value_heads), requires_grad=False)
    layer.dt_bias = nn.Parameter(layer.dt_bias.index_select(0, value_heads), requires_grad=False)
    layer.out_proj = row_slice(layer.out_proj, spans(num_value_heads, rank, world_size, value_head_dim), group)
    layer.num_key_heads, layer.num_value_heads = num_key_heads // world_size, num_value_heads // world_size
    layer.key_dim = layer.num_key_heads * key_head_dim
    layer.value_dim = layer.num_value_heads * value_head_dim
    layer.conv_dim = local


def shard_lm_head(model: nn.Module, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Vocabulary-parallel head; the (possibly tied) embedding stays whole."""
    weight = model.lm_head.weight  # [vocab, hidden], maybe the embedding's own tensor
    vocab_size = weight.shape[0]
    rows_per_rank = math.ceil(vocab_size / world_size)
    start, end = rank * rows_per_rank, min((rank + 1) * rows_per_rank, vocab_size)
    local = weight.new_zeros(rows_per_rank, weight.shape[1])
    local[: max(end - start, 0)] = weight.detach()[start:end]  # a copy: untied from the embedding
    model.lm_head = VocabParallelHead(local, vocab_size, group)


# ---------------------------------------------------------------------------------- the model
def divisibility(model: nn.Module) -> dict[str, int]:
    """What must divide by the number of ranks: the counts of every sharded kind of unit."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (GQAttention, GatedAttention)):
            counts["attention heads"] = module.num_heads
            counts["key/value heads"] = module.num_kv_heads
        elif isinstance(module, SwiGLU):
            counts["MLP intermediate size"] = module.gate_proj.out_features
        elif isinstance(module, GatedDeltaNet):
            counts["linear-attention key heads"] = module.num_key_heads
    return counts


def check_divisible(model: nn.Module, world_size: int) -> None:
    counts = divisibility(model)
    bad = {name: count for name, count in counts.items() if count % world_size}
    if bad:
        common = math.gcd(*counts.values())
        sizes = [size for size in range(1, common + 1) if common % size == 0]
        raise ValueError(
            f"cannot shard {type(model).__name__} over {world_size} ranks: "
            + ", ".join(f"{name} = {count}" for name, count in bad.items())
            + f" not divisible by {world_size}; use a tensor-parallel size that divides "
            + ", ".join(f"{name} ({count})" for name, count in counts.items())
            + f": one of {sizes}"
        )


def process_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"tensor_parallel takes a 1-D device mesh, got {group.ndim} dimensions")
        return group.get_group()
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("tensor_parallel needs torch.distributed initialised (torchrun, then "
                               "dist.init_process_group) or an explicit group")
        return dist.group.WORLD
    return group


@torch.no_grad()
def tensor_parallel(model: nn.Module, group: ProcessGroup | DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` in place over the ranks of ``group`` (default: WORLD); returns it.

    Every rank must call this on the same (whole) model, then run the same passes in lockstep.
    Raises ValueError, before touching the model, when a head count does not divide.
    """
    group = process_group(group)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if not hasattr(model, "tp_size"):
        raise ValueError(f"{type(model).__name__} is not a target that tensor_parallel knows how to shard")
    if model.tp_size > 1:
        raise ValueError(f"{type(model).__name__} is already sharded over {model.tp_size} ranks")
    check_divisible(model, world_size)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.tp_rank, model.tp_size, model.tp_group = rank, world_size, group
    if world_size == 1:
        return model
    for module in list(model.modules()):
        if isinstance(module, (GQAttention, GatedAttention)):
            shard_attention(module, rank, world_size, group)
        elif isinstance(module, SwiGLU):
            shard_mlp(module, rank, world_size, group)
        elif isinstance(module, GatedDeltaNet):
            shard_gated_deltanet(module, rank, world_size, group)
    shard_lm_head(model, rank, world_size, group)
    return model

