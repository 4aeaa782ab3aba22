"""Sampling parameters and the target distribution they define.

`SamplingParams` follows vLLM's names. ``temperature == 0`` means greedy. Otherwise the
distribution a request samples from is: logits / temperature, then top-k, then top-p (nucleus)
filtering, renormalised. Each request owns a `torch.Generator` seeded from its ``seed`` so its
output does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    """Tokens to generate at most (stop tokens end earlier)."""
    temperature: float = 0.0
    """0 = greedy; otherwise the softmax temperature."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    seed: int | None = None
    """Seed of this request's generator (None = nondeterministic)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after emitting one of these (it is included in the output)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """``[..., vocab]`` logits -> fp32 probabilities after temperature, top-k and top-p.

    For greedy params this is the one-hot of the argmax, so greedy decoding is sampling from
    it: one code path for both in the rejection sampler.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row of ``[num_rows, vocab]`` probabilities -> ``[num_rows]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
