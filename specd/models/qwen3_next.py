"""Qwen3-Next: gated full attention interleaved with Gated DeltaNet (linear attention) layers.

Module names mirror Hugging Face's `Qwen3NextForCausalLM` (``model.layers.N.linear_attn.in_proj_qkvz``,
``model.layers.N.self_attn.q_proj`` ...), so checkpoints load through `specd.models.loading` with
the identity name mapping. What differs from Qwen3 (all from HF's modeling_qwen3_next.py):

- RMSNorms are zero-centred: ``x_hat * (1 + weight)``, computed in fp32 then cast;
- full attention has an output gate (``q_proj`` emits query and gate per head, interleaved;
  ``out = o_proj(attn * sigmoid(gate))``) and partial rotary (the first
  ``head_dim * partial_rotary_factor`` channels of q and k);
- ``layer_types`` says which layers are ``linear_attention`` (`GatedDeltaNet`) and which
  ``full_attention``.

The MLP is dense (SwiGLU). Mixture-of-experts layers are not implemented: a checkpoint whose
config puts experts on any layer (``num_experts > 0`` outside ``mlp_only_layers``) is rejected
with a message saying so; ``mlp_only_layers`` covering every layer (or ``num_experts = 0``)
is a dense model and loads.

Every pass is over a `ForwardBatch` of token trees with an optional `HybridCache`; the linear
layers are exact on trees by indexed state replay (see `specd.models.gated_deltanet`). How the
full-attention layers run is ``model.set_attention_backend(name)`` (default "auto"; see
`specd.models.attention`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache
from specd.models.attention import AttentionMetadata, get_backend
from specd.models.gated_deltanet import GatedDeltaNet, RecurrentMetadata
from specd.models.layers import SwiGLU, rotary_tables
from specd.models.qwen3 import init_weights
from specd.state_cache import HybridCache, RecurrentStateCache

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(kw_only=True, slots=True)
class Qwen3NextConfig:
    vocab_size: int = 4096
    """Rows of the embedding and LM head."""
    hidden_size: int = 256
    """Residual stream width."""
    intermediate_size: int = 768
    """SwiGLU inner width (every layer's MLP is dense)."""
    num_hidden_layers: int = 4
    """Decoder layers."""
    layer_types: list[str] = field(default_factory=lambda: [LINEAR, LINEAR, LINEAR, FULL])
    """Per layer: "linear_attention" (Gated DeltaNet) or "full_attention"."""
    num_attention_heads: int = 4
    """Query heads of the full-attention layers."""
    num_key_value_heads: int = 2
    """Key/value heads of the full-attention layers (GQA)."""
    head_dim: int = 64
    """Per-head width of the full-attention layers."""
    partial_rotary_factor: float = 0.25
    """Fraction of head_dim that RoPE rotates (the first channels)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    linear_num_key_heads: int = 2
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 4
    """Gated DeltaNet value heads (a multiple of the key heads; each key head serves a group)."""
    linear_key_head_dim: int = 64
    """Gated DeltaNet query/key head width."""
    linear_value_head_dim: int = 64
    """Gated DeltaNet value head width."""
    linear_conv_kernel_dim: int = 4
    """Short causal depthwise conv kernel."""
    linear_chunk_size: int = 32
    """Chunk of the chunked delta rule, and the interval of the cache's state checkpoints
    (so a branch at any anchor replays at most this many trunk tokens). Not a HF field."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for (informational)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Bias on the full-attention q/k/v/o projections."""
    torch_dtype: str = "float32"
    """Weights' dtype on disk and by default in memory."""
    eos_token_id: int | list[int] | None = None
    """Token(s) that end generation, when the checkpoint names them."""

    model_type = "qwen3_next"
    architecture_name = "Qwen3NextForCausalLM"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - set(self.mixer_kinds())
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; expected {self.mixer_kinds()}")

    @classmethod
    def mixer_kinds(cls) -> tuple[str, ...]:
        return (LINEAR, FULL)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen3NextConfig":
        """From a Hugging Face ``config.json`` dict; rejects what this implementation lacks."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        num_layers = hf["num_hidden_layers"]
        num_experts = hf.get("num_experts", 0) or 0
        dense = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        moe_layers = [i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0]
        if moe_layers:
            raise ValueError(
                f"mixture-of-experts MLPs are not implemented in specd: this checkpoint has num_experts="
                f"{num_experts} on {len(moe_layers)} of {num_layers} layers (e.g. layer {moe_layers[0]}); "
                "only dense Qwen3-Next MLPs load (num_experts=0, or mlp_only_layers listing every layer)"
            )
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        if values.get("layer_types") is None:
            interval = hf.get("full_attention_interval", 4)
            values["layer_types"] = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        values["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        values["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if values.get("head_dim") is None:
            values["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        return cls(**values)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that `transformers.Qwen3NextForCausalLM` loads (dense MLPs)."""
        out = asdict(self)
        rope = {"rope_type": "default", "rope_theta": out.pop("rope_theta"),
                "partial_rotary_factor": out.pop("partial_rotary_factor")}
        return {
            "architectures": [self.architecture_name],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "rope_parameters": rope,
            "num_experts": 0,
            "mlp_only_layers": list(range(self.num_hidden_layers)),
            **out,
        }


FLAVOURS: dict[str, Qwen3NextConfig] = {
    # The zoo's target: 3 Gated DeltaNet + 1 full-attention layer, sized for CPU training.
    "tiny": Qwen3NextConfig(),
    # For unit tests: random weights, small chunks so trees and anchors cross chunk boundaries.
    "debug": Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=[LINEAR, FULL, LINEAR, FULL], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_chunk_size=4,
    ),
}


class ZeroCenteredRMSNorm(nn.Module):
    """``x_hat * (1 + weight)`` in fp32, cast back (HF `Qwen3NextRMSNorm`); weight starts at 0."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels ("rotate half"); x: ``[seqs, heads, new, dim]``."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None], sin[:, None]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class GatedAttention(nn.Module):
    """Qwen3-Next full attention: GQA, zero-centred q/k norms, partial RoPE, sigmoid output gate."""

    def __init__(self, config: Qwen3NextConfig, layer_index: int) -> None:
        super().__init__()
        c = config
        self.layer_index = layer_index  # among the attention layers (its slot in the KV cache)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: Tensor, rotary: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q ``[seqs, heads, new, head_dim]``, k/v ``[seqs, kv_heads, new, head_dim]``,
        gate ``[seqs, new, heads * head_dim]``."""
        num_seqs, max_new, _ = x.shape
        query, gate = self.q_proj(x).view(num_seqs, max_new, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(num_seqs, max_new, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(num_seqs, max_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        return q, k, v, gate.reshape(num_seqs, max_new, -1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, attention: AttentionMetadata) -> Tensor:
        """Attention over ``attention``'s mask through its backend, then gate and output projection."""
        out = attention.attend(q, k, v)  # [num_seqs, num_heads, max_new, head_dim]
        num_seqs, _, max_new, _ = out.shape
        out = out.transpose(1, 2).reshape(num_seqs, max_new, -1)
        return self.o_proj(out * torch.sigmoid(gate))

    def forward(self, x: Tensor, rotary, batch: ForwardBatch, cache: HybridCache | None,
                attention: AttentionMetadata) -> Tensor:
        q, k, v, gate = self.qkv(x, rotary)
        if cache is not None:
            k, v = cache.kv.update(self.layer_index, k, v, batch)
        return self.attend(q, k, v, gate, attention)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3NextConfig, layer_index: int, mixer: nn.Module) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        if self.layer_type == LINEAR:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, rotary, batch: ForwardBatch, cache: HybridCache | None,
                meta: RecurrentMetadata, attention: AttentionMetadata) -> Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, batch, None if cache is None else cache.recurrent, meta)
        else:
            h = self.self_attn(h, rotary, batch, cache, attention)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: Qwen3NextConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(nn.Module):
    config_class = Qwen3NextConfig

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = config
        layers, counts = [], {}
        for i, kind in enumerate(config.layer_types):
            ordinal = counts.get(kind, 0)
            counts[kind] = ordinal + 1
            layers.append(Qwen3NextDecoderLayer(config, i, self.make_mixer(kind, ordinal)))
        self.num_mixers = counts
        self.model = Qwen3NextModel(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(_init)
        self.attention_backend = get_backend("auto")
        # This rank's share of the heads (`specd.parallel.tensor_parallel` sets them; 1 = whole).
        self.tp_rank, self.tp_size = 0, 1

    def set_attention_backend(self, name: str) -> None:
        """How attention runs: "auto", "sdpa", "flex", "flash" or "triton" (`specd.models.attention`)."""
        self.attention_backend = get_backend(name)

    def make_mixer(self, kind: str, ordinal: int) -> nn.Module:
        """The token mixer of a layer of ``kind``; ``ordinal`` counts layers of that kind."""
        c = self.config
        if kind == LINEAR:
            return GatedDeltaNet(
                layer_index=ordinal, hidden_size=c.hidden_size, num_key_heads=c.linear_num_key_heads,
                num_value_heads=c.linear_num_value_heads, key_head_dim=c.linear_key_head_dim,
                value_head_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                rms_norm_eps=c.rms_norm_eps, chunk_size=c.linear_chunk_size,
            )
        return GatedAttention(c, ordinal)

    def new_cache(self, num_seqs: int, capacity: int = 256) -> HybridCache:
        c = self.config
        weight = self.model.embed_tokens.weight
        common = dict(num_seqs=num_seqs, capacity=capacity, dtype=weight.dtype, device=weight.device)
        num_attention = sum(count for kind, count in self.num_mixers.items() if kind != LINEAR)
        kv = KVCache(num_layers=num_attention, num_kv_heads=c.num_key_value_heads // self.tp_size,
                     head_dim=c.head_dim, **common)
        key_heads, value_heads = c.linear_num_key_heads // self.tp_size, c.linear_num_value_heads // self.tp_size
        recurrent = RecurrentStateCache(
            num_layers=self.num_mixers.get(LINEAR, 0), conv_dim=2 * key_heads * c.linear_key_head_dim
            + value_heads * c.linear_value_head_dim, num_heads=value_heads,
            key_dim=c.linear_key_head_dim, value_dim=c.linear_value_head_dim, chunk_size=c.linear_chunk_size,
            **common,
        )
        return HybridCache(kv=kv, recurrent=recurrent)

    def hidden_states(self, batch: ForwardBatch, cache: HybridCache | None = None) -> Tensor:
        """Final-norm hidden states ``[num_seqs, max_new, hidden]`` for every new token."""
        if cache is not None:
            cache.prepare(batch)
        meta = RecurrentMetadata.build(batch, self.config.linear_conv_kernel_dim, cache is not None)
        x = self.model.embed_tokens(batch.input_ids)
        rotary = rotary_tables(batch.positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        attention = AttentionMetadata.from_batch(batch, self.attention_backend)
        for layer in self.model.layers:
            x = layer(x, rotary, batch, cache, meta, attention)
        return self.model.norm(x)

    def forward(self, batch: ForwardBatch, cache: HybridCache | None = None) -> Tensor:
        """Logits ``[num_seqs, max_new, vocab]`` for every new token of the batch."""
        return self.lm_head(self.hidden_states(batch, cache))


def _init(module: nn.Module) -> None:
    """Hugging Face's initialisation: normal(0, 0.02) for linear, conv and embedding weights."""
    init_weights(module)
    if isinstance(module, nn.Conv1d):
        nn.init.normal_(module.weight, std=0.02)
