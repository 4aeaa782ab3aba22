"""Qwen3: the full-attention target (GQA, per-head q/k RMSNorm, RoPE, SwiGLU).

Module names mirror Hugging Face's `Qwen3ForCausalLM` (``model.layers.N.self_attn.q_proj``...),
so the weight-name mapping is the identity and a Hugging Face checkpoint (Qwen3-0.6B .. 32B)
loads as it is through `specd.models.loading`. Every pass is over a `ForwardBatch` (ragged
prefill, decode, verification blocks and token trees alike) with an optional `KVCache`.
How attention runs is ``model.set_attention_backend(name)`` (default "auto"; see
`specd.models.attention`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache
from specd.models.attention import AttentionMetadata, get_backend
from specd.models.layers import GQAttention, Linear, RMSNorm, SwiGLU, rotary_tables, token_major, unpack


@dataclass(kw_only=True, slots=True)
class Qwen3Config:
    vocab_size: int = 4096
    """Rows of the embedding and LM head."""
    hidden_size: int = 256
    """Residual stream width."""
    intermediate_size: int = 768
    """SwiGLU inner width."""
    num_hidden_layers: int = 4
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA: each serves num_attention_heads / num_key_value_heads queries)."""
    head_dim: int = 64
    """Per-head width; Qwen3 decouples it from hidden_size / num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for (informational; RoPE has no hard limit)."""
    tie_word_embeddings: bool = True
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Bias on q/k/v projections."""
    torch_dtype: str = "float32"
    """Weights' dtype on disk and by default in memory."""
    eos_token_id: int | list[int] | None = None
    """Token(s) that end generation, when the checkpoint names them."""

    model_type = "qwen3"
    # Class attributes, not fields (Hugging Face's Qwen3 has no such keys): what the decoder
    # layer builds, which Llama (`specd.models.llama`, the same modules) sets otherwise.
    qk_norm = True
    mlp_bias = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen3Config":
        """From a Hugging Face ``config.json`` dict; rejects what this implementation lacks."""
        theta = rope_theta(hf)
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        values["rope_theta"] = theta
        values["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if values.get("head_dim") is None:
            values["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        return cls(**values)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that `transformers.Qwen3ForCausalLM` loads."""
        return hf_config(self, "Qwen3ForCausalLM", use_sliding_window=False)


def rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base of a ``config.json``: transformers 5 writes ``rope_parameters``, older files
    ``rope_theta`` beside ``rope_scaling``. Any scaling type but "default" (or none) is refused:
    Llama 3.1's "llama3", "linear", "dynamic" and "yarn" all change the rotary frequencies."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{key}: rope type {rope_type!r} is not supported (only 'default', i.e. no RoPE scaling)")
    parameters = hf.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (one id, a list, or none) as a tuple of stop ids."""
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def hf_config(config, architecture: str, **extra: Any) -> dict[str, Any]:
    """A ``config.json`` dict for a config dataclass of these decoders (Qwen3, Llama)."""
    out = asdict(config)
    theta = out.pop("rope_theta")
    return {
        "architectures": [architecture], "model_type": config.model_type, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}, **extra, **out,
    }


FLAVOURS: dict[str, Qwen3Config] = {
    # The zoo's target: sized for CPU training throughput (see specd.zoo).
    "tiny": Qwen3Config(),
    # For unit tests: random weights, milliseconds per pass.
    "debug": Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    # Shapes of the real models, for GPU benchmarks with random weights.
    "qwen3-8b": Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "qwen3-32b": Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
}


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Hugging Face's initialisation (normal(0, 0.02), zero biases), so random models are sane."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Qwen3DecoderLayer(nn.Module):
    # ``config``: a Qwen3Config, or a LlamaConfig (same field names, plus qk_norm / mlp_bias).
    def __init__(self, config: Qwen3Config, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GQAttention(
            layer_index=layer_index,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            bias=config.attention_bias,
            qk_norm=config.qk_norm,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: Tensor, rotary, batch: ForwardBatch, cache: KVCache | None,
                attention: AttentionMetadata, real: Tensor | None = None) -> Tensor:
        """``x``: ``[num_seqs, max_new, hidden]``, or the real tokens ``[num_real, hidden]`` with
        ``real`` (`ForwardBatch.real_index`: everything but attention runs on those alone)."""
        x = x + self.self_attn(self.input_layernorm(x), rotary, batch, cache, attention, real)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    config_class = Qwen3Config
    packs_padding = True
    """A CPU inference pass computes its real tokens only (`hidden_states`): the engine's cost
    model prices a verification by its mean, not its longest, block (`CostModel.choose_lengths`)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(init_weights)
        self.attention_backend = get_backend("auto")
        # This rank's share of the heads (`specd.parallel.tensor_parallel` sets them; 1 = whole).
        self.tp_rank, self.tp_size = 0, 1

    def set_attention_backend(self, name: str) -> None:
        """How attention runs: "auto", "sdpa", "flex", "flash" or "triton" (`specd.models.attention`)."""
        self.attention_backend = get_backend(name)

    def new_cache(self, num_seqs: int, capacity: int = 256) -> KVCache:
        c = self.config
        weight = self.model.embed_tokens.weight
        return KVCache(
            num_layers=c.num_hidden_layers, num_seqs=num_seqs, num_kv_heads=c.num_key_value_heads // self.tp_size,
            head_dim=c.head_dim, capacity=capacity, dtype=weight.dtype, device=weight.device,
        )

    def hidden_states(self, batch: ForwardBatch, cache: KVCache | None = None) -> Tensor:
        """Final-norm hidden states ``[num_seqs, max_new, hidden]`` for every new token (zeros at
        padding). An inference pass with padding computes its token-wise products on the real
        tokens only (`ForwardBatch.real_index`): a verification in which a few sequences carry a
        block costs their tokens, not the longest block times the batch."""
        if cache is not None:
            cache.prepare(batch)
        real = None if torch.is_grad_enabled() else batch.real_index()
        ids = batch.input_ids if real is None else batch.input_ids.reshape(-1)[real]
        x = self.model.embed_tokens(ids)
        rotary = token_major(rotary_tables(batch.positions, self.config.head_dim, self.config.rope_theta, x.dtype), real)
        attention = AttentionMetadata.from_batch(batch, self.attention_backend)
        for layer in self.model.layers:
            x = layer(x, rotary, batch, cache, attention, real)
        x = self.model.norm(x)
        return x if real is None else unpack(x, real, batch.num_seqs, batch.max_new)

    def forward(self, batch: ForwardBatch, cache: KVCache | None = None) -> Tensor:
        """Logits ``[num_seqs, max_new, vocab]`` for every new token of the batch."""
        return self.lm_head(self.hidden_states(batch, cache))
