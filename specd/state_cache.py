"""Recurrent-state cache (Gated DeltaNet) and the hybrid cache of the Qwen3-Next and sparse targets.

Same verbs as `specd.cache.KVCache`: ``prepare(batch)`` before a pass, ``commit(batch, paths)``
to keep an accepted root-to-node path, ``rollback(lengths)`` to forget everything past a length.

What a Gated DeltaNet layer keeps per sequence, and why:

- **its conv inputs at every slot** (``inputs``, ``[num_seqs, capacity, conv_dim]``: the projected
  q/k/v channels before the short causal conv), plus the per-token decay ``g`` and write
  strength ``beta`` (``gates``). New tokens write them at slots ``cache_len + j`` like keys in a
  KV cache, and commit moves the accepted path's nodes to ``cache_len + depth``. The conv tail
  at any position is then a slice of ``inputs``, and the trunk can be *replayed* from any kept
  state: this is what makes a branch at an anchor inside the committed context exact.
- **checkpoints**: the recurrent state after every ``chunk_size`` committed tokens (positions
  ``0, C, 2C, ...``; position 0 is the zero state). A chain pass computes them for free (they are
  the chunked algorithm's inter-chunk states, with chunks aligned to absolute positions).
- **the tip**: the state at ``tip_pos`` (normally the committed length), so decoding never replays.

The state at an anchor ``a`` is the nearest kept state at or before ``a`` (the tip or a
checkpoint) replayed through the committed tokens in between -- at most ``chunk_size - 1``
tokens when the checkpoints are complete (*indexed state replay*; the replay itself runs in the
layer, which owns the conv weights: `specd.models.gated_deltanet`). States found by a replay are
remembered, so the next pass starts from them.

The states a pass computes for its *new* nodes are tentative, like their KV slots: the layer
leaves them in ``pending`` (node -> state) and ``commit`` adopts those on the accepted path. A
commit that ends on a node without a pending state (a tree pass, a partially accepted block)
leaves the tip where it was; the next pass replays the few accepted tokens from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.batch import ForwardBatch
from specd.cache import KVCache, path_moves


class SlotStore:
    """Per-layer tensors ``[num_seqs, capacity, *features]`` written at a batch's write slots."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_seqs: int,
        features: tuple[int, ...],
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_seqs, capacity, *features)
        self.tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[1] if self.tensors else 0

    def reserve(self, num_slots: int) -> None:
        """Grow to at least ``num_slots`` slots (doubling), keeping contents."""
        if num_slots <= self.capacity or not self.tensors:
            return
        new_capacity = max(num_slots, 2 * self.capacity)
        for i, old in enumerate(self.tensors):
            grown = old.new_zeros(old.shape[0], new_capacity, *old.shape[2:])
            grown[:, : old.shape[1]] = old
            self.tensors[i] = grown

    def write(self, layer: int, values: Tensor, batch: ForwardBatch) -> None:
        """``values``: ``[num_seqs, max_new, *features]``, written to ``batch.write_slots``."""
        seq_index, new_index = (batch.write_slots >= 0).nonzero(as_tuple=True)
        store = self.tensors[layer]
        store[seq_index, batch.write_slots[seq_index, new_index]] = values[seq_index, new_index].to(store.dtype)

    def move(self, seq_index: Tensor, src: Tensor, dst: Tensor) -> None:
        if len(seq_index):
            for store in self.tensors:
                store[seq_index, dst] = store[seq_index, src].clone()


@dataclass(slots=True)
class PendingStates:
    """States a pass computed after some of its new nodes (tentative until commit)."""

    seq_index: Tensor  # [num_pending] int64
    node_index: Tensor  # [num_pending] int64 node of that sequence's tree
    states: Tensor  # [num_pending, num_heads, key_dim, value_dim] fp32


class RecurrentStateCache:
    """Conv inputs, gates and recurrent states for ``num_layers`` Gated DeltaNet layers."""

    supports_row_prefix = False
    """A batch covers every row (`prepare` checks it against every row's length), unlike
    `specd.cache.KVCache`'s."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_seqs: int,
        conv_dim: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        chunk_size: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.chunk_size = chunk_size
        self.num_layers = num_layers
        common = dict(num_layers=num_layers, num_seqs=num_seqs, capacity=capacity, device=device)
        self.inputs = SlotStore(features=(conv_dim,), dtype=dtype, **common)
        self.gates = SlotStore(features=(2, num_heads), dtype=torch.float32, **common)  # (g, beta)
        state_shape = (num_heads, key_dim, value_dim)
        num_checkpoints = capacity // chunk_size + 1
        self.checkpoints = [
            torch.zeros(num_seqs, num_checkpoints, *state_shape, device=device) for _ in range(num_layers)
        ]
        # [num_layers, num_seqs, num_checkpoints]; checkpoint 0 (the empty context) is always valid.
        self.checkpoint_valid = torch.zeros(num_layers, num_seqs, num_checkpoints, dtype=torch.bool, device=device)
        self.checkpoint_valid[:, :, 0] = True
        self.tips = [torch.zeros(num_seqs, *state_shape, device=device) for _ in range(num_layers)]
        self.tip_pos = torch.zeros(num_layers, num_seqs, dtype=torch.long, device=device)  # -1: none
        self.lengths = torch.zeros(num_seqs, dtype=torch.long, device=device)  # [num_seqs]
        self.pending: list[PendingStates | None] = [None] * num_layers

    # ------------------------------------------------------------------ storage
    @property
    def capacity(self) -> int:
        return self.inputs.capacity

    def reserve(self, num_slots: int) -> None:
        self.inputs.reserve(num_slots)
        self.gates.reserve(num_slots)
        needed = self.capacity // self.chunk_size + 1
        have = self.checkpoint_valid.shape[-1]
        if needed > have:
            for i, old in enumerate(self.checkpoints):
                grown = old.new_zeros(old.shape[0], needed, *old.shape[2:])
                grown[:, :have] = old
                self.checkpoints[i] = grown
            valid = self.checkpoint_valid.new_zeros(*self.checkpoint_valid.shape[:2], needed)
            valid[..., :have] = self.checkpoint_valid
            self.checkpoint_valid = valid

    def write(self, layer: int, inputs: Tensor, gates: Tensor, batch: ForwardBatch) -> None:
        """Tentative conv inputs ``[num_seqs, max_new, conv_dim]`` and gates ``[.., 2, num_heads]``."""
        self.inputs.write(layer, inputs, batch)
        self.gates.write(layer, gates, batch)

    # ------------------------------------------------------------------ states
    def nearest_state(self, layer: int, seq_index: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The latest kept state at or before ``positions`` (committed): (its position, the state).

        ``seq_index``, ``positions``: ``[num_queries]``. Returns ``[num_queries]`` positions and
        ``[num_queries, num_heads, key_dim, value_dim]`` fp32 states.
        """
        valid = self.checkpoint_valid[layer, seq_index]  # [num_queries, num_checkpoints]
        index = torch.arange(valid.shape[-1], device=valid.device)
        usable = valid & (index * self.chunk_size <= positions[:, None])
        best = torch.where(usable, index, 0).amax(dim=-1)  # checkpoint 0 is always usable
        start = best * self.chunk_size
        states = self.checkpoints[layer][seq_index, best]
        tip_pos = self.tip_pos[layer, seq_index]
        use_tip = (tip_pos >= 0) & (tip_pos <= positions) & (tip_pos > start)
        start = torch.where(use_tip, tip_pos, start)
        states = torch.where(use_tip[:, None, None, None], self.tips[layer][seq_index], states)
        return start, states

    def remember(self, layer: int, seq_index: Tensor, positions: Tensor, states: Tensor) -> None:
        """Keep states found for *committed* positions (by a replay): checkpoints and tips."""
        aligned = positions % self.chunk_size == 0
        if bool(aligned.any()):
            rows, slots = seq_index[aligned], positions[aligned] // self.chunk_size
            self.checkpoints[layer][rows, slots] = states[aligned]
            self.checkpoint_valid[layer, rows, slots] = True
        at_tip = positions == self.lengths[seq_index]
        if bool(at_tip.any()):
            rows = seq_index[at_tip]
            self.tips[layer][rows] = states[at_tip]
            self.tip_pos[layer, rows] = positions[at_tip]

    def set_pending(self, layer: int, pending: PendingStates | None) -> None:
        self.pending[layer] = pending

    # ------------------------------------------------------------------ verbs
    def prepare(self, batch: ForwardBatch) -> None:
        if bool((batch.cache_lens != self.lengths).any()):
            raise ValueError(
                "the batch was built for other cache lengths than the cache holds: "
                f"{batch.cache_lens.tolist()} vs {self.lengths.tolist()}"
            )
        self.reserve(batch.mask.shape[-1])
        self.pending = [None] * self.num_layers

    def commit(self, batch: ForwardBatch, paths: Sequence[Sequence[int] | None]) -> None:
        """Keep ``paths[b]`` of each tree: move its inputs/gates down, adopt its pending states.

        ``paths[b] = None`` leaves sequence b untouched (as `KVCache.commit` does).
        """
        seq_index, src, dst = path_moves(batch, paths)
        self.inputs.move(seq_index, src, dst)
        self.gates.move(seq_index, src, dst)
        old = batch.cache_lens.tolist()
        paths = [() if path is None else path for path in paths]
        new_lengths = [start + len(path) for start, path in zip(old, paths)]
        chunk = self.chunk_size
        for layer in range(self.num_layers):
            # Boundaries the path crosses: stale unless a pending state below sets them.
            for b, (start, end) in enumerate(zip(old, new_lengths)):
                self.checkpoint_valid[layer, b, start // chunk + 1 : end // chunk + 1] = False
            pending = self.pending[layer]
            if pending is None:
                continue
            found = {
                (b, node): i
                for i, (b, node) in enumerate(zip(pending.seq_index.tolist(), pending.node_index.tolist()))
            }
            for b, path in enumerate(paths):
                for depth, node in enumerate(path):
                    i = found.get((b, node))
                    if i is None:
                        continue
                    position = old[b] + depth + 1  # the state after this node covers [0, position)
                    if position % chunk == 0:
                        self.checkpoints[layer][b, position // chunk] = pending.states[i]
                        self.checkpoint_valid[layer, b, position // chunk] = True
                    if depth == len(path) - 1:
                        self.tips[layer][b] = pending.states[i]
                        self.tip_pos[layer, b] = position
        self.lengths = torch.tensor(new_lengths, dtype=torch.long, device=self.lengths.device)
        self.pending = [None] * self.num_layers

    def rollback(self, lengths: Sequence[int] | Tensor) -> None:
        """Forget everything at or past ``lengths[b]`` (kept states past it become invalid)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        if bool((lengths > self.lengths).any()):
            raise ValueError("rollback can only shorten sequences")
        self.tip_pos = torch.where(self.tip_pos > lengths, -1, self.tip_pos)
        index = torch.arange(self.checkpoint_valid.shape[-1], device=lengths.device)
        self.checkpoint_valid &= (index * self.chunk_size <= lengths[:, None])[None]
        self.lengths = lengths.clone()
        self.pending = [None] * self.num_layers


class HybridCache:
    """KV slots for the attention layers, recurrent state for the Gated DeltaNet layers, and
    (sparse targets) the lightning indexer's keys; one set of verbs for all of them."""

    supports_row_prefix = False
    """As its recurrent part: a batch covers every row."""

    def __init__(
        self,
        *,
        kv: KVCache,
        recurrent: RecurrentStateCache,
        index_keys: SlotStore | None = None,
    ) -> None:
        self.kv = kv
        self.recurrent = recurrent
        self.index_keys = index_keys

    @property
    def lengths(self) -> Tensor:  # [num_seqs]
        return self.recurrent.lengths

    def prepare(self, batch: ForwardBatch) -> None:
        self.kv.prepare(batch)
        self.recurrent.prepare(batch)
        if self.index_keys is not None:
            self.index_keys.reserve(batch.mask.shape[-1])

    def commit(self, batch: ForwardBatch, paths: Sequence[Sequence[int] | None]) -> None:
        if self.index_keys is not None:
            self.index_keys.move(*path_moves(batch, paths))
        self.kv.commit(batch, paths)
        self.recurrent.commit(batch, paths)

    def rollback(self, lengths: Sequence[int] | Tensor) -> None:
        self.kv.rollback(lengths)
        self.recurrent.rollback(lengths)
