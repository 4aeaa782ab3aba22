"""Packed token trees compute exactly what each root-to-node path computes alone."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_strategies import trees

from specd.batch import ForwardBatch
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.tree import TokenTree

VOCAB = FLAVOURS["debug"].vocab_size


def make_model() -> Qwen3ForCausalLM:
    torch.manual_seed(1)
    return Qwen3ForCausalLM(FLAVOURS["debug"]).eval()


MODEL = make_model()


def alone(context: list[int]) -> torch.Tensor:
    """Logits of a fresh prefill of ``context`` with no cache: the reference."""
    with torch.no_grad():
        return MODEL(ForwardBatch.causal([context]))[0]


@st.composite
def batches(draw):
    contexts = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3))
    return contexts, [draw(trees(len(c), VOCAB)) for c in contexts]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_tree_logits_equal_each_path_alone(data):
    contexts, token_trees = data
    cache = MODEL.new_cache(len(contexts), capacity=8)
    prefill = ForwardBatch.causal(contexts, cache.lengths.tolist())
    with torch.no_grad():
        MODEL(prefill, cache)
    cache.commit(prefill, [list(range(len(c))) for c in contexts])
    batch = ForwardBatch.from_trees(token_trees, cache.lengths)
    with torch.no_grad():
        logits = MODEL(batch, cache)
    worst = 0.0
    for b, (context, tree) in enumerate(zip(contexts, token_trees)):
        for node in range(tree.num_nodes):
            path = tree.path(node)
            sequence = context[: int(tree.anchors[node])] + tree.tokens[path].tolist()
            worst = max(worst, (logits[b, node] - alone(sequence)[-1]).abs().max().item())
    assert worst < 1e-5, worst

    # Commit one root-to-leaf path per sequence (those anchored at the full context), then the
    # next step must see exactly context + path.
    paths = []
    for context, tree in zip(contexts, token_trees):
        full = [leaf for leaf in tree.leaves() if int(tree.anchors[leaf]) == len(context)]
        paths.append(tree.path(full[-1]) if full else [])
    cache.commit(batch, paths)
    step = ForwardBatch.causal([[3]] * len(contexts), cache.lengths.tolist())
    with torch.no_grad():
        after = MODEL(step, cache)
    for b, (context, tree) in enumerate(zip(contexts, token_trees)):
        sequence = context + tree.tokens[paths[b]].tolist() + [3]
        assert (after[b, 0] - alone(sequence)[-1]).abs().max().item() < 1e-5


def test_rollback_then_continue_equals_fresh_prefill():
    context = [1, 2, 3, 4, 5, 6, 7, 8]
    cache = MODEL.new_cache(1)
    batch = ForwardBatch.causal([context], [0])
    with torch.no_grad():
        MODEL(batch, cache)
    cache.commit(batch, [list(range(len(context)))])
    cache.rollback([5])
    step = ForwardBatch.causal([[9, 10]], cache.lengths.tolist())
    with torch.no_grad():
        logits = MODEL(step, cache)
    assert (logits[0] - alone(context[:5] + [9, 10])[-2:]).abs().max() < 1e-5


def test_tree_rejects_malformed_input():
    import pytest

    with pytest.raises(ValueError, match="topological"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="share its root's anchor"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([0, 1]))
    tree = TokenTree.from_paths([(0, [1, 2, 3]), (0, [1, 2, 4]), (1, [5])])
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 1, -1]
    assert tree.positions().tolist() == [0, 1, 2, 2, 1]
    with pytest.raises(ValueError, match="exceeds the cached context"):
        ForwardBatch.from_trees([tree], [0])
