"""Quality of a zoo target, so later acceptance figures mean something.

Per domain, on held-out prompts the model never trained on:

- held-out loss: mean next-token cross-entropy (nats) of the reference continuation given the
  prompt, for the model and for a unigram baseline fitted on the training tokens (add-one
  smoothed) — the model must beat it by a wide margin;
- degeneration: the number of distinct tokens in 96-token greedy and temperature-1
  continuations (a looping model produces ~10-20 distinct tokens in 96);
- a few sample continuations, to read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from specd.batch import ForwardBatch
from specd.data import HeldoutPrompt
from specd.engine import autoregressive
from specd.sampling import SamplingParams


@dataclass(kw_only=True, slots=True)
class DomainQuality:
    domain: str
    model_loss: float
    """Mean held-out cross-entropy of the model (nats/token)."""
    unigram_loss: float
    """Same tokens under the unigram baseline."""
    distinct_greedy: float
    """Mean distinct tokens in 96-token greedy continuations."""
    distinct_sampled: float
    """Mean distinct tokens in 96-token temperature-1 continuations."""
    samples: list[dict]
    """A few (prompt, greedy continuation) pairs."""


def unigram_log_probs(streams: list[np.ndarray], vocab_size: int) -> np.ndarray:
    counts = np.ones(vocab_size, dtype=np.float64)  # add-one smoothing
    for stream in streams:
        counts += np.bincount(stream, minlength=vocab_size)[:vocab_size]
    return np.log(counts / counts.sum())


@torch.inference_mode()
def heldout_losses(
    model: nn.Module, pairs: list[tuple[list[int], list[int]]], unigram: np.ndarray
) -> tuple[float, float]:
    """(model, unigram) mean cross-entropy over all reference tokens of (prompt, reference) pairs."""
    model_nll = unigram_nll = 0.0
    count = 0
    for prompt, reference in pairs:
        sequence = prompt + reference
        logits = model(ForwardBatch.causal([sequence]))[0].float()  # [len, vocab]
        log_probs = logits[len(prompt) - 1 : -1].log_softmax(-1)
        targets = torch.tensor(reference)
        model_nll -= log_probs.gather(1, targets[:, None]).sum().item()
        unigram_nll -= float(unigram[reference].sum())
        count += len(reference)
    return model_nll / count, unigram_nll / count


def evaluate_domain(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: list[HeldoutPrompt],
    unigram: np.ndarray,
    *,
    max_context: int = 384,
    num_continuations: int = 16,
    length: int = 96,
) -> DomainQuality:
    pairs = []
    for item in prompts:
        prompt = tokenizer.encode(item.prompt).ids[-max_context // 2 :]
        reference = tokenizer.encode(item.reference).ids[: max_context // 2]
        if prompt and reference:
            pairs.append((prompt, reference))
    model_loss, unigram_loss = heldout_losses(model, pairs, unigram)
    chosen = [p for p, _ in pairs[:num_continuations]]
    greedy = autoregressive(model, chosen, SamplingParams(max_tokens=length))
    sampled = autoregressive(model, chosen, SamplingParams(max_tokens=length, temperature=1.0, seed=0))
    distinct = lambda gens: float(np.mean([len(set(g.token_ids)) for g in gens]))  # noqa: E731
    samples = [
        {"prompt": tokenizer.decode(p[-48:], skip_special_tokens=False),
         "greedy": tokenizer.decode(g.token_ids, skip_special_tokens=False)}
        for p, g in list(zip(chosen, greedy))[:3]
    ]
    return DomainQuality(
        domain=prompts[0].domain if prompts else "",
        model_loss=model_loss,
        unigram_loss=unigram_loss,
        distinct_greedy=distinct(greedy),
        distinct_sampled=distinct(sampled),
        samples=samples,
    )


def evaluate_target(model: nn.Module, tokenizer: Tokenizer, heldout: dict[str, list[HeldoutPrompt]],
                    streams: list[np.ndarray]) -> list[DomainQuality]:
    unigram = unigram_log_probs(streams, model.config.vocab_size)
    return [evaluate_domain(model, tokenizer, prompts, unigram) for prompts in heldout.values()]


def as_json(rows: list[DomainQuality]) -> list[dict]:
    return [asdict(r) for r in rows]


def format_table(rows: list[DomainQuality]) -> str:
    lines = [f"{'domain':<10} {'model CE':>9} {'unigram CE':>11} {'ratio':>6} {'distinct greedy':>16} {'distinct T=1':>13}"]
    for r in rows:
        lines.append(
            f"{r.domain:<10} {r.model_loss:>9.3f} {r.unigram_loss:>11.3f} {r.model_loss / r.unigram_loss:>6.2f} "
            f"{r.distinct_greedy:>16.1f} {r.distinct_sampled:>13.1f}"
        )
    return "\n".join(lines)
