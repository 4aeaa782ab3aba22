"""Prompt-lookup (n-gram) drafting: the training-free baseline (vLLM's ``ngram`` method,
"prompt lookup decoding").

For a context c of length L, try n = max_ngram down to min_ngram: find the most recent earlier
occurrence of the last n tokens, c[j-n:j] == c[L-n:L] with j < L, and propose what followed it,
c[j], c[j+1], ... The longest n that matches wins, and within it the most recent occurrence.

Design choices:

- **Incremental index.** Each sequence (by ``seq_id``) keeps, for every n, a map from n-gram to
  the positions j of the tokens that followed its occurrences (increasing). A call indexes only
  the tokens appended since the last call, so a step costs O(new tokens · number of n's) plus
  one prefix comparison, not a scan of the context. A context that is not an extension of the
  cached one (a new request reusing the id) rebuilds the index. ``release(seq_id)`` drops it;
  at most ``max_seqs`` indices are kept (least recently used dropped first).
- **Copying past the end.** When the match is so recent that its continuation runs into the
  end of the context, the proposal keeps copying with the same period (c[j+i] for j+i >= L is
  the proposal's own token i - (L - j)): "a b a b" proposes "a b a b ...", not just "a b".
- **Confidence.** Among the most recent ``num_confidence_matches`` occurrences of the matched
  n-gram, the Laplace-smoothed fraction whose continuation agrees with the proposal at position
  i, given it agreed before i; its running product is the estimate that position i is accepted.
- The draft is deterministic (``probs=None``): the sampler treats q as one-hot, which is
  lossless at any temperature.
"""

from __future__ import annotations

from collections import OrderedDict

from specd.drafters.base import DraftBlock, Drafter, DraftRequest, check_block_size


class _SeqIndex:
    """The n-gram index of one sequence's context."""

    __slots__ = ("context", "min_ngram", "followers")

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.context: list[int] = []
        self.min_ngram = min_ngram
        # followers[n - min_ngram][ngram] = positions j (increasing) with context[j-n:j] == ngram
        self.followers: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(min_ngram, max_ngram + 1)]

    def extends(self, context: list[int]) -> bool:
        cached = len(self.context)
        return len(context) >= cached and context[:cached] == self.context

    def extend(self, context: list[int]) -> None:
        """Index the tokens of ``context`` (an extension of the cached one) beyond the cached ones."""
        start = len(self.context)
        self.context.extend(int(t) for t in context[start:])
        ctx, length = self.context, len(self.context)
        for offset, table in enumerate(self.followers):
            n = self.min_ngram + offset
            first = max(start, n)
            # Column i holds ctx[j - n + i] for j in [first, length): zipped, the n-gram before j.
            columns = [ctx[first - n + i : length - n + i] for i in range(n)]
            for j, ngram in zip(range(first, length), zip(*columns)):
                table.setdefault(ngram, []).append(j)

    def lookup(self, suffix: list[int] = ()) -> tuple[int, list[int]] | None:
        """(n, positions that followed earlier occurrences of the last n tokens) for the longest n.

        With ``suffix``: of the context followed by those (unindexed) tokens — a context the
        sequence may reach, looked up without indexing it; matches are among indexed positions."""
        ctx = self.context + list(suffix) if suffix else self.context
        for offset in range(len(self.followers) - 1, -1, -1):
            n = self.min_ngram + offset
            if n >= len(ctx):
                continue
            positions = self.followers[offset].get(tuple(ctx[len(ctx) - n :]))
            if positions:
                return n, positions
        return None


class NgramDrafter(Drafter):
    """Prompt-lookup drafter (see the module docstring). It has no `speculate`: whatever the
    engine's mode, it drafts each block after the verification before it."""

    name = "ngram"

    def __init__(
        self,
        *,
        vocab_size: int,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_block: int = 64,
        max_seqs: int = 4096,
        num_confidence_matches: int = 32,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_block < 1 or max_seqs < 1 or num_confidence_matches < 1:
            raise ValueError("max_block, max_seqs and num_confidence_matches must be >= 1")
        self.vocab_size = vocab_size
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_block = max_block
        self.max_seqs = max_seqs
        self.num_confidence_matches = num_confidence_matches
        self._indices: OrderedDict[int, _SeqIndex] = OrderedDict()

    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        for request in requests:
            check_block_size(request.block_size, self.max_block)
        return [self._draft_one(request) for request in requests]

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's index."""
        self._indices.pop(seq_id, None)

    def _index(self, seq_id: int, context: list[int]) -> _SeqIndex:
        index = self._indices.get(seq_id)
        if index is None or not index.extends(context):
            index = _SeqIndex(self.min_ngram, self.max_ngram)
            self._indices[seq_id] = index
        self._indices.move_to_end(seq_id)
        while len(self._indices) > self.max_seqs:
            self._indices.popitem(last=False)
        index.extend(context)
        return index

    def _draft_one(self, request: DraftRequest) -> DraftBlock:
        index = self._index(request.seq_id, request.context)
        return self._propose(index, [], request.block_size)

    def draft_after(self, seq_id: int, context: list[int], suffix: list[int], block_size: int) -> DraftBlock:
        """The block this drafter would propose after ``context + suffix``, with only ``context``
        indexed (the suffix is a verification outcome not yet committed: `speculate`'s use)."""
        check_block_size(block_size, self.max_block)
        return self._propose(self._index(seq_id, context), list(suffix), block_size)

    def _propose(self, index: _SeqIndex, suffix: list[int], block_size: int) -> DraftBlock:
        match = index.lookup(suffix)
        if match is None:
            return DraftBlock.empty()
        _, positions = match
        ctx = index.context + suffix if suffix else index.context
        length = len(ctx)
        start = positions[-1]  # the most recent occurrence
        tokens: list[int] = []
        for i in range(block_size):
            # Past the end of the context keep copying with period length - start.
            tokens.append(ctx[start + i] if start + i < length else tokens[start + i - length])
        return DraftBlock(tokens=tokens, probs=None, confidence=self._confidence(ctx, positions, tokens))

    def _confidence(self, ctx: list[int], positions: list[int], tokens: list[int]) -> list[float]:
        length = len(ctx)
        recent = positions[-self.num_confidence_matches :]
        # agree[i]: occurrences whose continuation equals tokens[:i + 1]; seen[i]: those that
        # agreed before i and have a token at i (an occurrence near the end has no data past it).
        agree = [0] * len(tokens)
        seen = [0] * len(tokens)
        for start in recent:
            i = 0
            while i < len(tokens) and start + i < length:
                seen[i] += 1
                if ctx[start + i] != tokens[i]:
                    break
                agree[i] += 1
                i += 1
        confidence, running = [], 1.0
        for i in range(len(tokens)):
            running *= (agree[i] + 1) / (seen[i] + 2)
            confidence.append(running)
        return confidence
