"""The drafter contract: what the engine asks a drafter for and what it gets back.

A drafter sees only token ids (the committed context), so the same contract serves an in-process
drafter and one behind gRPC; the one exception, a DFlash-style drafter that reads the target's
hidden states, says so (``needs_target_hidden``) and runs in process. Blocks come back with the
drafter's distributions q when it sampled them (the rejection sampler needs q for losslessness)
or ``None`` when the draft is deterministic (q is one-hot at each drafted token), plus a
per-position confidence that the engine's cost model uses to choose the next block length.

`Drafter` declares everything the engine calls. Every drafter subclasses it, and so inherits an
explicit answer for each optional capability it lacks (no speculation, no target states, nothing
to release) instead of the engine probing for methods.
"""

from __future__ import annotations

from abc import abstractmethod
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
    accepted too): non-increasing, so sum(confidence) estimates the accepted length k. For a
    sampled block (``probs`` given) it must depend on q alone, not on the tokens drawn from it:
    the engine decides from it how much of the block to verify, and a decision that looked at
    the draws would bias which draws are verified (the rejection sampler's losslessness needs
    each verified token distributed as its row of q)."""

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


Outcome = tuple[int, int]
"""The outcome ``(k, c)`` of verifying a block: k drafted tokens accepted, then token c (the
target's correction at position k, or its bonus token after a fully accepted block)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes blocks for a batch of requests: the contract between the engine and every drafter.

    A drafter subclasses this class (a protocol's members with a body are inherited as defaults):
    ``draft`` and the three attributes without a default are its own; what it does not override
    says it lacks that capability, and the engine only calls it when the matching flag is set.
    """

    name: str
    """Short name for metrics and logs ("ngram", "d3d", ...)."""
    vocab_size: int
    """Width of ``DraftBlock.probs`` rows; must equal the target's."""
    max_block: int
    """Largest block_size a request may ask for."""
    can_speculate: bool = False
    """Whether `speculate` works: the drafter needs no target state of the tokens under
    verification, so it can draft the next blocks while the target verifies (async mode)."""
    needs_target_hidden: bool = False
    """Whether the drafter reads the target's final hidden states: the engine then runs the
    target's hidden-state pass and hands it every committed token's state (`observe`)."""

    @abstractmethod
    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        """One block per request, in order."""

    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        """Candidate next blocks keyed by outcome, one dict per request, in order (an outcome
        missing from it is a miss). Called only when ``can_speculate``."""
        raise NotImplementedError(f"the {self.name} drafter cannot draft during verification (can_speculate is False)")

    def observe(self, seq_id: int, tokens: list[int], hidden: Tensor) -> None:
        """The target's hidden states ``[len(tokens), hidden]`` of tokens it just committed after
        the sequence's context. Called only when ``needs_target_hidden``."""
        raise NotImplementedError(f"the {self.name} drafter reads no target states (needs_target_hidden is False)")

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence (its per-sequence state, its cache row). Default: nothing
        is kept per sequence."""
