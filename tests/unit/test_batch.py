"""`ForwardBatch.from_chains` builds exactly the batch `from_trees` builds from chain trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specd.batch import ForwardBatch
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.tree import TokenTree

VOCAB = FLAVOURS["debug"].vocab_size
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TENSOR_FIELDS = ("input_ids", "positions", "mask", "write_slots", "num_new", "cache_lens")


def reference(token_lists, cache_lens, device="cpu") -> ForwardBatch:
    """The per-tree build `from_chains` replaces."""
    starts = list(cache_lens) if cache_lens is not None else [0] * len(token_lists)
    trees = [TokenTree.chain(tokens, start) for tokens, start in zip(token_lists, starts)]
    return ForwardBatch.from_trees(trees, cache_lens, device)


def assert_same_batch(fast: ForwardBatch, slow: ForwardBatch) -> None:
    for name in TENSOR_FIELDS:
        got, want = getattr(fast, name), getattr(slow, name)
        assert got.dtype == want.dtype and got.device == want.device, name
        assert torch.equal(got, want), f"{name}: {got} != {want}"
    assert fast.dense_causal == slow.dense_causal
    assert fast.scratch_slot == slow.scratch_slot
    assert len(fast.trees) == len(slow.trees)
    for got, want in zip(fast.trees, slow.trees):
        for name in ("tokens", "parents", "anchors"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name
        assert got.is_chain()


# Rows of 0-9 new tokens after no, short or long cached contexts.
rows = st.lists(st.integers(0, VOCAB - 1), max_size=9)
cache_len = st.one_of(st.just(0), st.integers(0, 20), st.integers(300, 5000))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(rows, cache_len), min_size=1, max_size=8), st.booleans(), st.sampled_from(DEVICES))
@example([([], 0)], False, "cpu")  # a lone empty row
@example([([], 4000), ([1, 2, 3], 0)], True, "cpu")  # an idle long row beside a fresh one
def test_from_chains_equals_from_trees(data, as_tensor, device):
    token_lists = [tokens for tokens, _ in data]
    lens = [length for _, length in data]
    cache_lens = torch.tensor(lens) if as_tensor else lens
    assert_same_batch(ForwardBatch.from_chains(token_lists, cache_lens, device), reference(token_lists, lens, device))


@settings(max_examples=60, deadline=None)
@given(st.lists(rows, min_size=1, max_size=6))
@example([[1, 2, 3], [4, 5, 6]])  # equal lengths without a cache: dense_causal
def test_no_cache_chains_equal_from_trees(token_lists):
    fast = ForwardBatch.causal(token_lists)
    assert_same_batch(fast, reference(token_lists, None))
    assert fast.dense_causal == (len({len(t) for t in token_lists}) == 1 and len(token_lists[0]) > 0)


def test_bad_batches_are_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        ForwardBatch.from_chains([], [])
    with pytest.raises(ValueError, match=">= 0"):
        ForwardBatch.from_chains([[1]], [-1])


def test_user_built_trees_are_still_validated():
    with pytest.raises(ValueError, match="topological"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="anchors"):
        TokenTree.chain([1, 2], -1)
    tree = TokenTree.chain([7, 8, 9], 5).to("cpu")
    assert torch.equal(tree.parents, torch.tensor([-1, 0, 1])) and torch.equal(tree.anchors, torch.full((3,), 5))


def test_model_pass_over_from_chains_equals_from_trees():
    """Prefill, then a ragged verify step with an idle row: logits and the committed cache agree."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    contexts = [[5, 17, 3, 99, 42, 7, 8], [1, 2, 3], [200, 100, 50, 25, 12], [9]]
    blocks = [[11, 12, 13, 14], [], [21], [31, 32, 33, 34, 35, 36]]
    caches, logits = [], []
    for build in (ForwardBatch.from_chains, reference):
        cache = model.new_cache(len(contexts), capacity=4)  # small: forces the cache to grow
        with torch.no_grad():
            prefill = build(contexts, cache.lengths.tolist())
            prefill_logits = model(prefill, cache)
            cache.commit(prefill, [list(range(len(c))) for c in contexts])
            step = build(blocks, cache.lengths)
            step_logits = model(step, cache)
            cache.commit(step, [list(range(len(b) // 2)) for b in blocks])
        caches.append(cache)
        logits.append((prefill_logits, step_logits))
    (fast_prefill, fast_step), (slow_prefill, slow_step) = logits
    assert torch.equal(fast_prefill, slow_prefill) and torch.equal(fast_step, slow_step)
    fast, slow = caches
    assert torch.equal(fast.lengths, slow.lengths)
    for layer in range(len(fast.keys)):
        assert torch.equal(fast.keys[layer], slow.keys[layer]) and torch.equal(fast.values[layer], slow.values[layer])
    with torch.no_grad():  # and without a cache
        assert torch.equal(model(ForwardBatch.causal(contexts)), model(reference(contexts, None)))
