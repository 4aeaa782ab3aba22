"""Caches with commit of an accepted path and rollback to a length.

A pass over a `ForwardBatch` writes the new tokens' keys and values to slots
``cache_len[b] + j`` (see `specd.batch`). Those slots are *tentative* until committed:

- ``commit(batch, paths)`` keeps, for sequence ``b``, the nodes ``paths[b]`` (a root-to-node
  path of its tree, node indices in order), moving them down to slots
  ``cache_len[b] + 0 .. len(path) - 1`` and advancing the committed length. A node at depth
  ``d`` already had position ``anchor + d == cache_len + d``, so its rotary-encoded key is
  valid in its new slot unchanged.
- ``rollback(lengths)`` forgets everything past the given lengths (cheap: slots are reused).

Slots are preallocated per sequence and grow by doubling, so a step never reallocates in the
common case. Recurrent-state caches (Gated DeltaNet) and the hybrid cache of the Qwen3-Next and
sparse targets follow the same verbs: see `specd.state_cache`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specd.batch import ForwardBatch


class KVCache:
    """Key/value slots for ``num_layers`` attention layers and ``num_seqs`` sequences.

    A batch may cover only the first rows (``batch.num_seqs <= num_seqs``): a server with many
    rows and few busy ones then pays for the busy prefix, not for every row
    (`supports_row_prefix`).
    """

    supports_row_prefix = True
    """A batch may cover the first rows only (the engine asks every cache)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_seqs: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_seqs, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_seqs, dtype=torch.long, device=device)  # [num_seqs]
        self._writes: tuple | None = None  # (batch, slices or None, index tensors): `_plan` of the pass

    SLICE_ROWS = 4
    """Up to this many sequences, a pass writes its keys with a slice copy per sequence; more take
    one index_put (fewer ops then, for the same bytes)."""

    def _plan(self, batch: ForwardBatch) -> tuple:
        """Where the pass's new keys go, worked out once per pass rather than once per layer."""
        if batch.num_seqs <= self.SLICE_ROWS:
            starts, counts = batch.cache_lens.tolist(), batch.num_new.tolist()
            plan = (batch, list(zip(starts, counts)), None)
        else:
            seq_index, new_index = (batch.write_slots >= 0).nonzero(as_tuple=True)
            plan = (batch, None, (seq_index, new_index, batch.write_slots[seq_index, new_index]))
        self._writes = plan
        return plan

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, num_slots: int) -> None:
        """Grow every layer to at least ``num_slots`` slots (doubling), keeping contents."""
        if num_slots <= self.capacity:
            return
        new_capacity = max(num_slots, 2 * self.capacity)
        with torch.inference_mode(False):  # normal tensors even inside a pass run in inference mode
            self._grow(new_capacity)

    def _grow(self, new_capacity: int) -> None:
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                store[i] = grown

    def update(
        self,
        layer: int,
        keys: Tensor,  # [num_seqs, num_kv_heads, max_new, head_dim]
        values: Tensor,  # [num_seqs, num_kv_heads, max_new, head_dim]
        batch: ForwardBatch,
    ) -> tuple[Tensor, Tensor]:
        """Write the new keys/values to their slots; return all keys/values the mask covers."""
        num_slots = batch.mask.shape[-1]
        if batch.scratch_slot >= 0:
            return self._update_static(layer, keys, values, batch)
        cache_k, cache_v = self.keys[layer], self.values[layer]
        writes = self._writes if self._writes is not None and self._writes[0] is batch else self._plan(batch)
        if writes[1] is not None:  # a few sequences: one slice copy each (new token j -> slot cache_len + j)
            for b, (start, count) in enumerate(writes[1]):
                cache_k[b, :, start : start + count] = keys[b, :, :count]
                cache_v[b, :, start : start + count] = values[b, :, :count]
        else:
            seq_index, new_index, slot_index = writes[2]
            # Advanced indexing puts the indexed dims first: [num_real, num_kv_heads, head_dim].
            cache_k[seq_index, :, slot_index] = keys[seq_index, :, new_index].to(cache_k.dtype)
            cache_v[seq_index, :, slot_index] = values[seq_index, :, new_index].to(cache_v.dtype)
        rows = batch.num_seqs  # the batch covers the first `rows` cache rows
        return cache_k[:rows, :, :num_slots], cache_v[:rows, :, :num_slots]

    def _update_static(self, layer: int, keys: Tensor, values: Tensor, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """`update` without data-dependent shapes (CUDA-graph capturable): every token writes,
        padding to the batch's scratch slot, which no mask lets anyone read."""
        num_seqs, num_kv_heads, max_new, head_dim = keys.shape
        slots = torch.where(batch.write_slots >= 0, batch.write_slots, batch.scratch_slot)  # [num_seqs, max_new]
        index = slots[:, None, :, None].expand(num_seqs, num_kv_heads, max_new, head_dim)
        cache_k, cache_v = self.keys[layer][:num_seqs], self.values[layer][:num_seqs]
        cache_k.scatter_(2, index, keys.to(cache_k.dtype))  # duplicate indices only at the scratch slot
        cache_v.scatter_(2, index, values.to(cache_v.dtype))
        num_slots = batch.mask.shape[-1]
        return cache_k[:, :, :num_slots], cache_v[:, :, :num_slots]

    def commit(self, batch: ForwardBatch, paths: Sequence[Sequence[int] | None]) -> None:
        """Keep ``paths[b]`` (root-to-node node indices) of each sequence's tree; see module doc.

        ``paths[b] = None`` leaves sequence b untouched (its length stays what it is now).
        """
        seq_index, src, dst = path_moves(batch, paths)
        if len(seq_index):  # a chain's accepted prefix is already in place: nothing moves
            for store in (self.keys, self.values):
                for cache in store:
                    cache[seq_index, :, dst] = cache[seq_index, :, src].clone()
        self._writes = None
        for b, path in enumerate(paths):
            if path is not None:
                self.lengths[b] = batch.cache_lens[b] + len(path)

    def rollback(self, lengths: Sequence[int] | Tensor) -> None:
        """Forget every slot at or past ``lengths[b]``."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        if bool((lengths > self.lengths).any()):
            raise ValueError("rollback can only shorten sequences")
        self.lengths = lengths.clone()

    def prepare(self, batch: ForwardBatch) -> None:
        """Make room for a batch's writes before the pass (it covers the first rows)."""
        if batch.num_seqs > len(self.lengths):
            raise ValueError(f"the batch has {batch.num_seqs} sequences, the cache {len(self.lengths)} rows")
        if batch.scratch_slot >= 0:
            return  # a static pass: its runner checked lengths and room on the host, no sync here
        if bool((batch.cache_lens != self.lengths[: batch.num_seqs]).any()):
            raise ValueError(
                "the batch was built for other cache lengths than the cache holds: "
                f"{batch.cache_lens.tolist()} vs {self.lengths[: batch.num_seqs].tolist()}"
            )
        self.reserve(batch.mask.shape[-1])
        self._plan(batch)


def path_moves(
    batch: ForwardBatch, paths: Sequence[Sequence[int] | None]
) -> tuple[Tensor, Tensor, Tensor]:
    """(sequence, source slot, destination slot) for every kept node that is not already where it
    belongs (a chain's nodes are: node i at depth i), as flat index tensors."""
    if len(paths) != batch.num_seqs:
        raise ValueError(f"commit needs one path per sequence: {len(paths)} for {batch.num_seqs}")
    seqs, sources, destinations = [], [], []
    for b, path in enumerate(paths):
        if path is None:
            continue
        start = int(batch.cache_lens[b])
        tree = batch.trees[b]
        if path and tree.path(path[-1]) != list(path):
            raise ValueError(f"sequence {b}: {list(path)} is not a root-to-node path of its tree")
        if path and int(tree.anchors[path[0]]) != start:
            raise ValueError(
                f"sequence {b}: the path starts at anchor {int(tree.anchors[path[0]])}, "
                f"not at the committed length {start}; roll back first"
            )
        for depth, node in enumerate(path):
            if node == depth:
                continue
            seqs.append(b)
            sources.append(start + node)
            destinations.append(start + depth)
    device = batch.write_slots.device
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return as_long(seqs), as_long(sources), as_long(destinations)
