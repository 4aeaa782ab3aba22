"""Continuous batching: which requests run, and in which cache rows.

`Scheduler` is the one place that admits and finishes sequences, for `SpeculativeEngine.generate`
(a fixed batch of prompts) and `specd.serving.ServingEngine` (requests that come and go) alike.
Requests wait in arrival order; each one admitted takes the lowest free row of the target's cache;
a finished sequence leaves the batch at once and frees its row for the next waiting request (vLLM's
scheduler, with cache rows where vLLM has KV blocks). What a waiting request is, and how its
sequence starts, is the caller's: `generate` queues prompt indices, the serving loop its pending
requests with their streams; both start sequences with `SpeculativeEngine.start`.

Rows are handed out lowest first (`RowAllocator`): busy rows stay a short prefix, so a pass over the
rows up to the highest busy one (`specd.cache.KVCache.supports_row_prefix`) pays for the busy rows
only. The D3D drafter hands out the rows of its own cache with the same allocator.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import torch

from specd.drafters.base import DraftBlock
from specd.sampling import SamplingParams


class RowAllocator:
    """The free rows of a cache of ``num_rows`` rows, handed out lowest first."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))  # a heap (sorted is one)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """The lowest free row, now busy; IndexError when none is free."""
        return heapq.heappop(self._free)

    def free(self, row: int) -> None:
        heapq.heappush(self._free, row)


@dataclass(kw_only=True, slots=True)
class Generation:
    """One request's output."""

    token_ids: list[int] = field(default_factory=list)
    """Generated ids (prompt excluded; a stop token that ended it included)."""
    finish_reason: str = "length"
    """"stop" (a stop token), "length" (max_tokens), "abort" (cancelled while serving) or "error"
    (see ``error``)."""
    num_passes: int = 0
    """Target passes that produced this request's tokens (prefill included)."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Drafted tokens accepted at each of this request's verification passes (speculative only)."""
    error: str = ""
    """With finish_reason "error": what failed in this request alone (the others went on)."""


@dataclass(kw_only=True, slots=True)
class RunningSequence:
    """One sequence in a row of the target's cache, as the engine's step sees it."""

    seq_id: int
    """The id the drafter knows it by (`specd.drafters.base.DraftRequest.seq_id`)."""
    row: int
    """Its row of the target's cache."""
    params: SamplingParams
    generator: torch.Generator
    context: list[int]
    """Prompt plus committed output (the engine's own list: it grows at every step)."""
    num_prompt: int
    cached: int = 0
    """Tokens of ``context`` in the target's cache (all but the last, once it ran a step)."""
    block: DraftBlock | None = None
    """The drafted block the next step verifies (None: it needs a fresh one, or decodes plain)."""
    generation: Generation = field(default_factory=Generation)
    draft_gain: float | None = None
    """Drafted tokens the target accepted per step in which this sequence had a drafted block
    (exponentially weighted; None before its first): what drafting for it is worth
    (`CostModel.worth_drafting`)."""
    draft_skipped: int = 0
    """Steps in a row that did not draft for it because drafting did not pay."""
    draft_looks: int = 0
    """Drafts since its drafts last paid, each after skipped steps (`CostModel.look_after`)."""
    done: bool = False
    """It stopped (stop token, max_tokens, its own error, or cancelled): the scheduler finishes it."""


Request = TypeVar("Request")  # what waits for a row: the caller's


class Scheduler(Generic[Request]):
    """Requests waiting for a row, the sequences running in rows, and the free rows (module docstring)."""

    def __init__(self, num_rows: int) -> None:
        self.waiting: deque[Request] = deque()
        """In arrival order."""
        self.running: list[RunningSequence] = []
        """The batch each step runs over, in admission order."""
        self.rows = RowAllocator(num_rows)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self, start: Callable[[Request, int], RunningSequence | None]) -> None:
        """Start waiting requests, oldest first, while rows are free: ``start(request, row)`` returns
        the request's sequence in that row, or None when it does not run after all (cancelled while
        it waited, or it could not start): its row is then free again."""
        while self.waiting and self.rows.num_free:
            request = self.waiting.popleft()
            row = self.rows.take()
            seq = start(request, row)
            if seq is None:
                self.rows.free(row)
            else:
                self.running.append(seq)

    def finish(self, seq: RunningSequence) -> None:
        """Take ``seq`` out of the batch; its row serves the next waiting request."""
        self.running.remove(seq)
        self.rows.free(seq.row)

    def finish_done(self) -> list[RunningSequence]:
        """`finish` every sequence that is done; returns them, in batch order."""
        done = [seq for seq in self.running if seq.done]
        for seq in done:
            self.finish(seq)
        return done
