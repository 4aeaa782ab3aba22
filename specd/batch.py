"""Per-step forward metadata: which tokens go in, where they sit, what each may attend to.

One `ForwardBatch` is built per model pass and passed down to every layer (no globals). Every
pass — ragged prefill, decode, block verification, a proposal tree — is a batch of
`TokenTree`s, one per sequence, each appended after that sequence's cached context:

- new tokens are right-padded to ``max_new = max(num_nodes)``;
- the new token ``j`` of sequence ``b`` writes its key/value to cache slot
  ``cache_len[b] + j`` (slot ``-1`` marks padding, which writes nothing);
- its attention mask over key slots ``[0, cache_len + max_new)`` is the tree's context mask
  (slots ``< anchor``) plus its ancestors' slots.

Without a cache (training passes) the keys are the new tokens themselves and anchors must be 0.
Padding rows attend to slot 0 only, so they stay finite; their outputs are never read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.tree import TokenTree


@dataclass(kw_only=True, slots=True)
class ForwardBatch:
    input_ids: Tensor  # [num_seqs, max_new] int64, padding = 0
    positions: Tensor  # [num_seqs, max_new] int64 position ids
    mask: Tensor  # [num_seqs, max_new, num_key_slots] bool
    write_slots: Tensor  # [num_seqs, max_new] int64 cache slot per new token, -1 = padding
    num_new: Tensor  # [num_seqs] int64 real (unpadded) new tokens per sequence
    trees: tuple[TokenTree, ...]  # the trees this batch was built from (state replay needs them)
    cache_lens: Tensor  # [num_seqs] int64 committed context length before this pass
    dense_causal: bool = False  # no cache, equal-length chains: attention may use is_causal
    scratch_slot: int = -1
    """>= 0: a static-shape pass (`specd.cuda_graphs`): padding tokens write to this cache slot
    (one no sequence uses) instead of being skipped, and nothing in the pass reads tensor values
    on the host, so the pass can be captured in a CUDA graph."""

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_new(self) -> int:
        return self.input_ids.shape[1]

    def real_index(self) -> Tensor | None:
        """Flat indices (into ``[num_seqs * max_new]``) of the batch's real tokens, for a pass that
        computes its token-wise products on those alone (`specd.models.qwen3`); None where
        there is no padding to skip, or the pass must keep its shapes static (a CUDA graph).

        Rows are right-padded to the longest: a verification where a few sequences carry a block
        and the rest one token, or a ragged prefill, would otherwise pay for every padding token
        in every projection. Host-side (``num_new`` is read), so CPU passes only: on a GPU the
        padded products cost little next to a device sync."""
        if self.scratch_slot >= 0 or self.input_ids.device.type != "cpu":
            return None
        real = torch.arange(self.max_new) < self.num_new[:, None]  # [num_seqs, max_new]
        if bool(real.all()):
            return None
        return real.view(-1).nonzero().squeeze(1)

    @staticmethod
    def from_trees(
        trees: Sequence[TokenTree],
        cache_lens: Sequence[int] | Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Batch ``trees[b]`` after ``cache_lens[b]`` cached tokens (``None``: no cache)."""
        num_seqs = len(trees)
        if num_seqs == 0:
            raise ValueError("a forward batch needs at least one sequence")
        use_cache = cache_lens is not None
        # Lengths are host-side metadata here (a cache keeps them on its device).
        lens = torch.as_tensor(cache_lens if use_cache else [0] * num_seqs, dtype=torch.long).cpu()
        num_new = torch.tensor([t.num_nodes for t in trees], dtype=torch.long)
        max_new = max(int(num_new.max()), 1)
        # Keys: with a cache, slots [0, max(cache_len + num_new)); without, the new tokens only.
        num_slots = int((lens + num_new).max()) if use_cache else max_new
        num_slots = max(num_slots, 1)

        input_ids = torch.zeros(num_seqs, max_new, dtype=torch.long)
        positions = torch.zeros(num_seqs, max_new, dtype=torch.long)
        write_slots = torch.full((num_seqs, max_new), -1, dtype=torch.long)
        mask = torch.zeros(num_seqs, max_new, num_slots, dtype=torch.bool)
        mask[:, :, 0] = True  # padding rows: see slot 0 only (overwritten for real rows below)
        for b, tree in enumerate(trees):
            n, start = tree.num_nodes, int(lens[b])
            if n == 0:
                continue
            if bool((tree.anchors > start).any()):
                raise ValueError(
                    f"sequence {b}: a tree anchor exceeds the cached context length {start}"
                )
            input_ids[b, :n] = tree.tokens
            positions[b, :n] = tree.positions()
            write_slots[b, :n] = torch.arange(start, start + n)
            mask[b, :n] = False
            mask[b, :n, :start] = tree.context_mask(start)
            mask[b, :n, start : start + n] = tree.ancestor_mask()
        dense_causal = (
            not use_cache
            and bool((num_new == max_new).all())
            and all(t.is_chain() and not bool(t.anchors.any()) for t in trees)
        )
        return ForwardBatch(
            dense_causal=dense_causal,
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            mask=mask.to(device),
            write_slots=write_slots.to(device),
            num_new=num_new.to(device),
            trees=tuple(t.to(device) for t in trees),
            cache_lens=lens.to(device),
        )

    @staticmethod
    def from_chains(
        token_lists: Sequence[Sequence[int]],
        cache_lens: Sequence[int] | Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Chain ``token_lists[b]`` after ``cache_lens[b]`` cached tokens (``None``: no cache).

        Field for field the batch ``from_trees`` builds from ``TokenTree.chain(token_lists[b],
        cache_lens[b])``, but from whole-batch tensor ops: prefill chunks, decode steps and block
        verification are all chains, so this is the serving loop's per-step build, and with chains
        every field follows from the row lengths and ``cache_lens`` alone. The int fields reach
        ``device`` in one copy (the trees' tensors are views of it), the mask in a second, and the
        trees skip validation (chains are valid by construction). An empty row (an idle cache
        row) is padding, as in `from_trees`.
        """
        num_seqs = len(token_lists)
        if num_seqs == 0:
            raise ValueError("a forward batch needs at least one sequence")
        use_cache = cache_lens is not None
        lens = torch.as_tensor(cache_lens if use_cache else [0] * num_seqs, dtype=torch.long).cpu()
        if bool((lens < 0).any()):
            raise ValueError(f"cache lengths must be >= 0, got {lens.tolist()}")
        sizes = [len(tokens) for tokens in token_lists]
        num_new = torch.tensor(sizes, dtype=torch.long)
        max_new = max(max(sizes), 1)
        num_slots = max(int((lens + num_new).max()) if use_cache else max_new, 1)

        depth = torch.arange(max_new)
        real = depth < num_new[:, None]  # [num_seqs, max_new] not padding
        slot = lens[:, None] + depth  # [num_seqs, max_new] node j of row b sits at cache_len + j
        positions = slot.masked_fill(~real, 0)  # a chain node's position is its slot
        # A chain node sees the context and the nodes up to itself: every slot up to its own
        # position. Padding sits at position 0, so it sees slot 0 only (as in from_trees).
        mask = torch.arange(num_slots) <= positions[..., None]  # [num_seqs, max_new, num_slots]
        tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
        input_ids = torch.zeros(num_seqs, max_new, dtype=torch.long)
        input_ids[real] = tokens  # row-major boolean indexing: row b's tokens fill its first sizes[b]
        parents = depth.expand(num_seqs, max_new)[real] - 1  # [num_tokens] -1, 0, 1, ... per row
        anchors = lens[:, None].expand(num_seqs, max_new)[real]  # [num_tokens]

        fields = [input_ids, positions, slot.masked_fill(~real, -1), num_new, lens, tokens, parents, anchors]
        # One host->device copy for them all: a pageable copy per small tensor would cost a sync each.
        packed = torch.cat([field.reshape(-1) for field in fields]).to(device)
        ids, positions, write_slots, num_new, lens, tokens, parents, anchors = packed.split(
            [field.numel() for field in fields]
        )
        trees = tuple(
            TokenTree._trusted(*parts)
            for parts in zip(tokens.split(sizes), parents.split(sizes), anchors.split(sizes))
        )
        grid = (num_seqs, max_new)
        return ForwardBatch(
            dense_causal=not use_cache and min(sizes) == max_new,  # no cache: every chain starts at 0
            input_ids=ids.view(grid),
            positions=positions.view(grid),
            mask=mask.to(device),
            write_slots=write_slots.view(grid),
            num_new=num_new,
            trees=trees,
            cache_lens=lens,
        )

    @staticmethod
    def causal(
        token_lists: Sequence[Sequence[int]],
        cache_lens: Sequence[int] | Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Ragged causal chunks: ``token_lists[b]`` appended after ``cache_lens[b]`` tokens."""
        return ForwardBatch.from_chains(token_lists, cache_lens, device)

    @staticmethod
    def dense(input_ids: Tensor) -> "ForwardBatch":
        """A no-cache causal batch of equal-length rows ``[num_seqs, length]`` (training passes)."""
        num_seqs, length = input_ids.shape
        return ForwardBatch(
            input_ids=input_ids,
            positions=torch.arange(length, device=input_ids.device).expand(num_seqs, length),
            mask=torch.ones(1, length, length, dtype=torch.bool, device=input_ids.device).tril(),
            write_slots=torch.full_like(input_ids, -1),
            num_new=torch.full((num_seqs,), length, device=input_ids.device),
            trees=(),
            cache_lens=torch.zeros(num_seqs, dtype=torch.long, device=input_ids.device),
            dense_causal=True,
        )

    def last_index(self) -> Tensor:
        """``[num_seqs]`` index of each sequence's last real new token (for next-token logits)."""
        return (self.num_new - 1).clamp(min=0)
