"""In-process decoding loops over a target model.

`autoregressive` is plain decoding: the baseline every speculative result is compared to
(and the reference for "greedy speculative output == plain greedy output"). It batches ragged
prompts: one prefill pass, then one decode pass per step for the sequences still running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from specd.batch import ForwardBatch
from specd.sampling import SamplingParams, sample, target_probs
from specd.tree import TokenTree


@dataclass(kw_only=True, slots=True)
class Generation:
    """One request's output."""

    token_ids: list[int] = field(default_factory=list)
    """Generated ids (prompt excluded; a stop token that ended it included)."""
    finish_reason: str = "length"
    """"stop" (a stop token) or "length" (max_tokens)."""
    num_passes: int = 0
    """Target passes that produced this request's tokens (prefill included)."""


def check_prompt(prompt: Sequence[int], vocab_size: int) -> None:
    """Reject prompts the model cannot take, with a message that says what was wrong."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@torch.inference_mode()
def autoregressive(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[Generation]:
    """Plain decoding of a batch of prompts, one token per sequence per pass."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    vocab_size = model.config.vocab_size
    for prompt in prompts:
        check_prompt(prompt, vocab_size)
    device = next(model.parameters()).device
    generators = [p.generator(device) for p in params]
    outputs = [Generation() for _ in prompts]
    longest = max(len(p) for p in prompts) + max(p.max_tokens for p in params)
    cache = model.new_cache(len(prompts), capacity=longest)
    new_tokens: list[list[int]] = [list(map(int, p)) for p in prompts]
    running = [True] * len(prompts)
    while any(running):
        trees = [
            TokenTree.chain(tokens if run else [], int(length))
            for tokens, run, length in zip(new_tokens, running, cache.lengths)
        ]
        batch = ForwardBatch.from_trees(trees, cache.lengths, device)
        logits = model(batch, cache)  # [num_seqs, max_new, vocab]
        cache.commit(batch, [list(range(t.num_nodes)) for t in trees])
        last = logits[torch.arange(len(prompts)), batch.last_index()]  # [num_seqs, vocab]
        for b, out in enumerate(outputs):
            if not running[b]:
                continue
            token = int(sample(target_probs(last[b : b + 1], params[b]), generators[b]))
            out.token_ids.append(token)
            out.num_passes += 1
            new_tokens[b] = [token]
            if token in params[b].stop_token_ids:
                out.finish_reason, running[b] = "stop", False
            elif len(out.token_ids) >= params[b].max_tokens:
                running[b] = False
    return outputs


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start
