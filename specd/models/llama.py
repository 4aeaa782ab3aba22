"""Llama: the full-attention target of the real CPU model (SmolLM2-135M-Instruct).

Llama is Qwen3 without the per-head q/k RMSNorm, with optional biases (``attention_bias`` on
q/k/v/o, ``mlp_bias`` on the SwiGLU): the same decoder (`specd.models.qwen3`, built from
`specd.models.layers`), so passes over a `ForwardBatch` and a `KVCache`, token trees, attention
backends, CUDA graphs and `specd.parallel.tensor_parallel` (which shards by module type) work
unchanged, and ``LlamaForCausalLM`` is a `Qwen3ForCausalLM` whose config turns q/k norm off.
Module names mirror Hugging Face's ``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj``,
``model.norm``, ``lm_head``), so a Hugging Face checkpoint loads by name through
`specd.models.loading` (``model_type: "llama"``).

Supported: the default RoPE (any ``rope_theta``), GQA/MQA/MHA, a ``head_dim`` other than
hidden/heads, tied or untied embeddings. Refused with a ValueError (never silently run wrong):
RoPE scaling (``llama3``, ``linear``, ``dynamic``, ``yarn``, ...), an activation other than
SiLU, and Llama checkpoints of another head (``LlamaForSequenceClassification``...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from specd.models.qwen3 import Qwen3ForCausalLM, eos_ids, hf_config, rope_theta

ARCHITECTURE = "LlamaForCausalLM"


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    """Defaults are `transformers.LlamaConfig`'s, so a ``config.json`` that omits a field reads
    as transformers reads it (the bare default is a 7B shape: use a flavour to build one)."""

    vocab_size: int = 32000
    """Rows of the embedding and LM head."""
    hidden_size: int = 4096
    """Residual stream width."""
    intermediate_size: int = 11008
    """SwiGLU inner width."""
    num_hidden_layers: int = 32
    """Decoder layers."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (GQA: each serves num_attention_heads / num_key_value_heads queries);
    None: as many as query heads (MHA), as in transformers."""
    head_dim: int | None = None
    """Per-head width; None: hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base (default RoPE only: no scaling)."""
    max_position_embeddings: int = 2048
    """Longest context the model was trained for (the verifier's default max_model_len)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections."""
    mlp_bias: bool = False
    """Bias on the SwiGLU's gate/up/down projections."""
    torch_dtype: str = "float32"
    """Weights' dtype on disk and by default in memory."""
    bos_token_id: int | None = 1
    """Token that starts a document (informational: prompts arrive tokenised, any BOS included)."""
    eos_token_id: int | list[int] | None = 2
    """Token(s) that end generation."""

    model_type = "llama"
    # Read by the shared decoder layer (`specd.models.qwen3.Qwen3DecoderLayer`): Llama has no
    # per-head q/k RMSNorm. A class attribute, not a field: no Llama checkpoint has it.
    qk_norm = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict; rejects what this implementation lacks."""
        if hf.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_type {hf['model_type']!r} is not {cls.model_type!r}")
        architectures = hf.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in architectures:
            raise ValueError(f"architectures {architectures} do not include {ARCHITECTURE!r} (an LM head)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        values["rope_theta"] = rope_theta(hf)
        values["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return cls(**values)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that `transformers.LlamaForCausalLM` loads."""
        return hf_config(self, ARCHITECTURE)


FLAVOURS: dict[str, LlamaConfig] = {
    # For unit tests: random weights, milliseconds per pass.
    "debug": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json: the real CPU target (DESIGN.md).
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
}


class LlamaForCausalLM(Qwen3ForCausalLM):
    """`Qwen3ForCausalLM`'s modules and passes, built from a `LlamaConfig` (no q/k norm)."""

    config_class = LlamaConfig
