"""Comparisons against transformers shared by the architecture tests (Qwen3, Qwen3-Next, Llama)."""

from __future__ import annotations

import torch

from specd.engine import autoregressive
from specd.sampling import SamplingParams


def assert_greedy_matches_generate(reference, model, prompts: list[list[int]], max_tokens: int = 24) -> None:
    """specd's plain greedy decoding of ``model`` == transformers' greedy ``generate`` of ``reference``
    (no eos: every token of both runs is compared)."""
    ours = autoregressive(model, prompts, SamplingParams(max_tokens=max_tokens))
    for prompt, generation in zip(prompts, ours):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
        assert generation.token_ids == expected, f"prompt {prompt}: {generation.token_ids} != {expected}"
