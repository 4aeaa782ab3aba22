"""The drafter contract: what the engine asks a drafter for and what it gets back.

A drafter sees only token ids (the committed context), never target hidden states, so the same
contract serves an in-process drafter and one behind gRPC. Blocks come back with the drafter's
distributions q when it sampled them (the rejection sampler needs q for losslessness) or
``None`` when the draft is deterministic (q is one-hot at each drafted token), plus a per-position
confidence that the engine's cost model uses to choose the next block length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from specd.sampling import SamplingParams


def check_block_size(block_size: int, max_block: int) -> None:
    """Raise a ValueError that says what is allowed when a block size is out of range."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size} (ask for no draft by not asking)")
    if block_size > max_block:
        raise ValueError(f"block_size {block_size} is above this drafter's max_block {max_block}")


@dataclass(kw_only=True, slots=True)
class DraftRequest:
    """Draft one block for one sequence."""

    seq_id: int
    """The engine's id of the sequence; drafters may keep per-sequence state under it."""
    context: list[int]
    """The committed tokens: prompt plus accepted output."""
    block_size: int
    """How many tokens to draft at most (1..max_block)."""
    params: SamplingParams
    """The request's sampling parameters (a sampling drafter follows temperature / top-p)."""


@dataclass(kw_only=True, slots=True)
class DraftBlock:
    """A drafted block for one request."""

    tokens: list[int]
    """The drafted tokens; may be shorter than block_size, even empty, when the drafter has nothing."""
    probs: Tensor | None = None  # [len(tokens), vocab] fp32
    """q for each drafted token (row i is the distribution token i was drawn from); None = deterministic."""
    confidence: list[float]
    """The drafter's estimate that position i is accepted (which needs every earlier one
    accepted too): non-increasing, so sum(confidence) estimates the accepted length k."""

    def __post_init__(self) -> None:
        if len(self.confidence) != len(self.tokens):
            raise ValueError(
                f"DraftBlock needs one confidence per token: {len(self.tokens)} tokens, "
                f"{len(self.confidence)} confidences"
            )
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(
                f"DraftBlock.probs must be [num_tokens={len(self.tokens)}, vocab], got {tuple(self.probs.shape)}"
            )

    @staticmethod
    def empty() -> "DraftBlock":
        return DraftBlock(tokens=[], probs=None, confidence=[])


@runtime_checkable
class Drafter(Protocol):
    """Proposes blocks for a batch of requests."""

    name: str
    """Short name for metrics and logs ("ngram", "d3d", ...)."""
    vocab_size: int
    """Width of ``DraftBlock.probs`` rows; must equal the target's."""
    max_block: int
    """Largest block_size a request may ask for."""

    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        """One block per request, in order."""
        ...


class DrafterUnavailable(RuntimeError):
    """The drafter cannot be reached; the engine falls back to plain decoding."""


@dataclass(kw_only=True, slots=True)
class SpeculateRequest:
    """Draft next blocks for the likely outcomes of verifying ``block`` after ``context``.

    Sent while the target verifies ``block``: the drafter answers with candidate blocks keyed by
    outcome ``(k, c)`` — k drafted tokens accepted, then token c (correction or bonus).
    """

    seq_id: int
    """The engine's id of the sequence."""
    context: list[int]
    """The committed tokens; ``block`` continues them."""
    block: list[int]
    """The block under verification (a prefix of a block this drafter returned)."""
    block_size: int
    """Size of the next blocks."""
    budget: int
    """How many outcomes to draft a next block for."""
    params: SamplingParams
    """The request's sampling parameters."""
