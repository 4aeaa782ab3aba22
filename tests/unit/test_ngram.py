"""Prompt-lookup drafting proposes what followed the most recent, longest match, and its
incremental per-sequence index gives exactly what a search from scratch gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.drafters import DraftBlock, Drafter, DraftRequest, NgramDrafter
from specd.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.7)


def reference(context: list[int], block_size: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The definition, from scratch: the longest n, its most recent earlier occurrence, then copy."""
    length = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = context[length - n :]
        for start in range(length - n - 1, -1, -1):
            if n < length and context[start : start + n] == suffix:
                extended = list(context)
                for i in range(block_size):  # what followed, copied on past the end
                    extended.append(extended[start + n + i])
                return extended[length:]
    return []


def draft(drafter: NgramDrafter, context: list[int], block_size: int = 4, seq_id: int = 0) -> DraftBlock:
    [block] = drafter.draft([DraftRequest(seq_id=seq_id, context=context, block_size=block_size, params=PARAMS)])
    return block


def test_proposes_the_continuation_of_the_most_recent_match():
    drafter = NgramDrafter(vocab_size=16, max_ngram=3)
    block = draft(drafter, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], block_size=4)
    assert block.tokens == [7, 8, 5, 1]
    assert block.probs is None and len(block.confidence) == 4


def test_the_longest_ngram_is_preferred():
    context = [5, 3, 8, 0, 4, 3, 6, 1, 5, 3]  # "5 3" was followed by 8; the latest "3" by 6
    assert draft(NgramDrafter(vocab_size=16, max_ngram=2), context).tokens[0] == 8
    assert draft(NgramDrafter(vocab_size=16, max_ngram=1), context).tokens[0] == 6
    # Too short to match at min_ngram=2: nothing, although a 1-gram would match.
    assert draft(NgramDrafter(vocab_size=16, min_ngram=2, max_ngram=2), [4, 3, 6, 1, 3]).tokens == []


def test_empty_when_nothing_matches():
    drafter = NgramDrafter(vocab_size=16)
    for context in ([1, 2, 3, 4, 5], [7], []):
        block = draft(drafter, context, seq_id=len(context))
        assert block.tokens == [] and block.confidence == [] and block.probs is None


def test_a_recent_match_is_copied_on_past_the_end():
    assert draft(NgramDrafter(vocab_size=16), [1, 2, 1, 2, 1, 2], block_size=5).tokens == [1, 2, 1, 2, 1]
    assert draft(NgramDrafter(vocab_size=16), [0, 4, 4, 4], block_size=6).tokens == [4] * 6


def test_block_size_is_respected():
    drafter = NgramDrafter(vocab_size=16, max_block=8)
    context = [1, 2, 3, 4] * 10
    for block_size in range(1, 9):
        assert draft(drafter, context, block_size).tokens == reference(context, block_size, 1, 4)
        assert len(draft(drafter, context, block_size).tokens) == block_size
    for bad in (0, 9):
        with pytest.raises(ValueError, match="block_size"):
            draft(drafter, context, bad)


def test_confidence_follows_how_often_the_match_was_right():
    drafter = NgramDrafter(vocab_size=16)
    often = draft(drafter, [7, 8, 9, 0] * 10 + [7, 8], seq_id=1)
    once = draft(drafter, [1, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8], seq_id=2)
    assert often.tokens[0] == once.tokens[0] == 9
    assert often.confidence[0] > 0.9 > 0.7 > once.confidence[0] > 0.5
    for block in (often, once):
        assert all(0 < c <= 1 for c in block.confidence)
        assert block.confidence == sorted(block.confidence, reverse=True)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    alphabet=st.integers(2, 6),
    min_ngram=st.integers(1, 3),
    extra_ngram=st.integers(0, 3),
)
def test_incremental_index_equals_a_search_from_scratch(data, alphabet, min_ngram, extra_ngram):
    max_ngram = min_ngram + extra_ngram
    incremental = NgramDrafter(vocab_size=alphabet, min_ngram=min_ngram, max_ngram=max_ngram, max_block=8)
    contexts = {0: [], 1: []}
    for _ in range(data.draw(st.integers(1, 25))):
        seq_id = data.draw(st.sampled_from([0, 1]))
        if data.draw(st.integers(0, 9)) == 0:
            contexts[seq_id] = contexts[seq_id][: data.draw(st.integers(0, len(contexts[seq_id])))]  # not an extension
        contexts[seq_id] = contexts[seq_id] + data.draw(st.lists(st.integers(0, alphabet - 1), max_size=12))
        block_size = data.draw(st.integers(1, 8))
        context = contexts[seq_id]
        block = draft(incremental, context, block_size, seq_id)
        assert block.tokens == reference(context, block_size, min_ngram, max_ngram)
        fresh = NgramDrafter(vocab_size=alphabet, min_ngram=min_ngram, max_ngram=max_ngram, max_block=8)
        assert block == draft(fresh, context, block_size, seq_id)  # confidence too


def test_is_a_drafter_and_forgets_sequences():
    drafter = NgramDrafter(vocab_size=16, max_seqs=2)
    assert isinstance(drafter, Drafter) and drafter.name == "ngram"
    for seq_id in range(3):
        draft(drafter, [1, 2, 1, 2], seq_id=seq_id)
    assert list(drafter._indices) == [1, 2]  # least recently used dropped
    drafter.release(2)
    assert list(drafter._indices) == [1]


def test_draft_block_checks_its_shapes():
    with pytest.raises(ValueError, match="one confidence per token"):
        DraftBlock(tokens=[1, 2], probs=None, confidence=[0.5])
    with pytest.raises(ValueError, match="probs must be"):
        DraftBlock(tokens=[1, 2], probs=torch.zeros(3, 16), confidence=[0.5, 0.4])
