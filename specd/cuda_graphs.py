"""CUDA graphs for the target's decode / verification pass at fixed batch buckets.

At high batch a decode pass of a large target is a few hundred kernel launches, and at batch 1
of a small model the launches cost more than the maths: replaying a captured CUDA graph removes
them. A graph fixes every shape and address, so `GraphRunner` keeps static input buffers per
(rows bucket, new tokens) and copies each pass into them:

- **Buckets.** The pass's rows are padded up to the next bucket (1, 2, 4, 8, 16, 32, 64, ... as
  vLLM does); new tokens per row must be one of ``tokens`` (1 for decode, ``block + 1`` for
  verification); the mask always spans the cache's full capacity. Padding rows see slot 0 only
  and write nothing anyone reads (below); their logits are dropped.
- **Static writes.** A captured pass cannot have data-dependent shapes or host syncs, so it runs
  with ``ForwardBatch.scratch_slot`` set: the KV cache writes every token, padding included, with
  one scatter, padding to the cache's last slot, and skips its host-side checks
  (`specd.cache.KVCache._update_static`). The runner does those checks on the host before the
  replay: the batch covers the cache's first rows with the cache's lengths, and no row's writes
  reach the scratch slot.
- **Fallback.** A pass outside the buckets (more rows, another token count, a row near the
  cache's end, a tree that is not a chain is fine — only shapes matter) runs eagerly, as does
  every pass when the cache grew (its tensors moved: the graphs are dropped and recaptured).
- **CPU.** There are no graphs on the CPU; ``eager_static=True`` runs the same padded static
  pass eagerly, which is how the padding and the static cache writes are tested against the
  plain pass without a GPU. Graph capture itself is checked by ``specd bench gpu``.

Only full-attention targets (Qwen3) qualify: a hybrid target's state replay reads the pass's
trees on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(slots=True)
class _Static:
    """One captured shape: its input buffers, its batch, its output and its graph."""

    batch: ForwardBatch
    logits: Tensor | None = None  # [rows, tokens, vocab]
    graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """``runner(batch)`` = ``model(batch, cache)`` through captured graphs where the shape fits."""

    def __init__(self, model: nn.Module, cache: KVCache, *, tokens: tuple[int, ...] = (1,),
                 buckets: tuple[int, ...] = BUCKETS, eager_static: bool = False) -> None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"CUDA graphs need a plain KV cache (full attention), got {type(cache).__name__}")  # noqa: TRY004 (a config error)
        self.model, self.cache = model, cache
        self.tokens = tuple(sorted(set(tokens)))
        self.buckets = tuple(sorted(b for b in set(buckets) if b <= len(cache.lengths)))
        self.device = cache.lengths.device
        self.eager_static = eager_static or self.device.type != "cuda"
        self._static: dict[tuple[int, int], _Static] = {}
        self._cache_ptr = self._pointer()
        self._pool = None
        self.num_replays = 0
        self.num_fallbacks = 0

    # ------------------------------------------------------------------ a pass
    def __call__(self, batch: ForwardBatch) -> Tensor:
        """Logits ``[batch.num_seqs, batch.max_new, vocab]``, as ``model(batch, cache)`` gives them."""
        key = self._fits(batch)
        if key is None:
            self.num_fallbacks += 1
            return self.model(batch, self.cache)
        if self._pointer() != self._cache_ptr:  # the cache grew: its tensors moved
            self._static.clear()
            self._cache_ptr = self._pointer()
        static = self._static.get(key) or self._capture(key)
        self._fill(static.batch, batch)
        if static.graph is None:
            logits = self.model(static.batch, self.cache)
        else:
            static.graph.replay()
            logits = static.logits
        self.num_replays += 1
        return logits[: batch.num_seqs, : batch.max_new]

    def _fits(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The (rows bucket, tokens) this pass replays at, or None (host-side checks, no sync)."""
        if batch.scratch_slot >= 0 or batch.max_new not in self.tokens or batch.dense_causal:
            return None
        bucket = next((b for b in self.buckets if b >= batch.num_seqs), None)
        if bucket is None:
            return None
        lengths = batch.cache_lens.tolist()  # a host tensor (ForwardBatch keeps lengths there)
        if lengths != self.cache.lengths[: batch.num_seqs].tolist():
            return None  # not this cache's rows: let the eager pass raise its clear error
        if max(lengths) + batch.max_new >= self.cache.capacity - 1:
            return None  # the writes would reach the scratch slot
        return bucket, batch.max_new

    # ------------------------------------------------------------------ static buffers
    def _new_batch(self, rows: int, tokens: int) -> ForwardBatch:
        device, capacity = self.device, self.cache.capacity
        mask = torch.zeros(rows, tokens, capacity, dtype=torch.bool, device=device)
        mask[:, :, 0] = True
        return ForwardBatch(
            input_ids=torch.zeros(rows, tokens, dtype=torch.long, device=device),
            positions=torch.zeros(rows, tokens, dtype=torch.long, device=device),
            mask=mask,
            write_slots=torch.full((rows, tokens), -1, dtype=torch.long, device=device),
            num_new=torch.zeros(rows, dtype=torch.long, device=device),
            trees=(),
            cache_lens=torch.zeros(rows, dtype=torch.long, device=device),
            scratch_slot=capacity - 1,
        )

    def _fill(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        """Copy a pass into the static buffers; padding rows see slot 0 and write to scratch."""
        rows, width = batch.num_seqs, batch.mask.shape[-1]
        static.input_ids.zero_()
        static.positions.zero_()
        static.write_slots.fill_(-1)
        static.num_new.zero_()
        static.cache_lens.zero_()
        static.mask.zero_()
        static.mask[:, :, 0] = True
        static.input_ids[:rows].copy_(batch.input_ids, non_blocking=True)
        static.positions[:rows].copy_(batch.positions, non_blocking=True)
        static.write_slots[:rows].copy_(batch.write_slots, non_blocking=True)
        static.num_new[:rows].copy_(batch.num_new, non_blocking=True)
        static.cache_lens[:rows].copy_(batch.cache_lens, non_blocking=True)
        static.mask[:rows, :, :width].copy_(batch.mask, non_blocking=True)

    def _capture(self, key: tuple[int, int]) -> _Static:
        rows, tokens = key
        static = _Static(batch=self._new_batch(rows, tokens))
        if not self.eager_static:
            # Warm up on a side stream (allocations, autotuning), then capture; all graphs share
            # one memory pool, as they never run at the same time.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(static.batch, self.cache)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            static.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(static.graph, pool=self._pool):
                static.logits = self.model(static.batch, self.cache)
            self._pool = static.graph.pool()
        self._static[key] = static
        return static

    def _pointer(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (*self.cache.keys, *self.cache.values))
