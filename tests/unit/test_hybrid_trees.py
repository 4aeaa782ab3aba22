"""Packed token trees == each path alone, for the linear (Qwen3-Next) and sparse-linear targets.

The debug flavours use GDN chunks (and state checkpoints) of 4 tokens and, for sparse attention,
top-4 key selection, so random trees have anchors inside prefilled chunks (branches replayed
from a checkpoint), paths deeper than a chunk, and queries whose top-k excludes some keys.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_strategies import trees

from specd.batch import ForwardBatch
from specd.cli import main
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models import qwen3_next, sparse
from specd.models.loading import save_model
from specd.sampling import SamplingParams
from specd.tree import TokenTree


def make(kind: str):
    torch.manual_seed(1)
    if kind == "qwen3_next":
        return qwen3_next.Qwen3NextForCausalLM(qwen3_next.FLAVOURS["debug"]).eval()
    return sparse.SparseForCausalLM(sparse.FLAVOURS["debug"]).eval()


MODELS = {kind: make(kind) for kind in ("qwen3_next", "sparse")}
VOCAB = 512


@st.composite
def batches(draw):
    contexts = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=13), min_size=1, max_size=3))
    splits = [draw(st.integers(0, len(c))) for c in contexts]  # prefill in two passes
    return contexts, splits, [draw(trees(len(c), VOCAB)) for c in contexts]


@torch.no_grad()
def alone(model, tokens: list[int]) -> torch.Tensor:
    """Logits of a fresh prefill of ``tokens`` with no cache: the reference."""
    return model(ForwardBatch.causal([tokens]))[0]


@torch.no_grad()
def prefill(model, contexts, splits=None):
    """A cache holding ``contexts``, committed in two passes (so checkpoints come from both)."""
    cache = model.new_cache(len(contexts), capacity=8)
    splits = splits or [len(c) for c in contexts]
    for part in range(2):
        pieces = [c[:k] if part == 0 else c[k:] for c, k in zip(contexts, splits)]
        batch = ForwardBatch.causal(pieces, cache.lengths.tolist())
        model(batch, cache)
        cache.commit(batch, [list(range(len(p))) for p in pieces])
    return cache


def check_tree_exactness(model, data):
    contexts, splits, token_trees = data
    cache = prefill(model, contexts, splits)
    batch = ForwardBatch.from_trees(token_trees, cache.lengths)
    with torch.no_grad():
        logits = model(batch, cache)
    worst = 0.0
    for b, (context, tree) in enumerate(zip(contexts, token_trees)):
        for node in range(tree.num_nodes):
            sequence = context[: int(tree.anchors[node])] + tree.tokens[tree.path(node)].tolist()
            worst = max(worst, (logits[b, node] - alone(model, sequence)[-1]).abs().max().item())
    assert worst < 1e-5, worst

    # Commit one path per sequence (anchored at the full context; it may end inside the tree),
    # then the next step must see exactly context + path.
    paths = []
    for context, tree in zip(contexts, token_trees):
        full = [node for node in range(tree.num_nodes) if int(tree.anchors[node]) == len(context)]
        paths.append(tree.path(full[len(full) // 2]) if full else [])
    cache.commit(batch, paths)
    step = ForwardBatch.causal([[3, 4]] * len(contexts), cache.lengths.tolist())
    with torch.no_grad():
        after = model(step, cache)
    for b, (context, tree) in enumerate(zip(contexts, token_trees)):
        sequence = context + tree.tokens[paths[b]].tolist() + [3, 4]
        assert (after[b] - alone(model, sequence)[-2:]).abs().max().item() < 1e-5


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_qwen3_next_tree_logits_equal_each_path_alone(data):
    check_tree_exactness(MODELS["qwen3_next"], data)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_sparse_tree_logits_equal_each_path_alone(data):
    check_tree_exactness(MODELS["sparse"], data)


CONTEXT = [(29 * i + 5) % VOCAB for i in range(11)]
# Sibling branches at the end of the context and inside it, one deeper than a GDN chunk.
TREE = TokenTree.from_paths([(11, [7, 8, 9, 10, 11, 12]), (11, [7, 300, 301]), (11, [99, 98, 97]), (6, [5, 6, 7])])


def tree_pass(model, tree=TREE):
    cache = prefill(model, [CONTEXT])
    batch = ForwardBatch.from_trees([tree], cache.lengths)
    with torch.no_grad():
        return batch, cache, model(batch, cache)[0]


def path_logits(model, tree=TREE) -> torch.Tensor:
    rows = [alone(model, CONTEXT[: int(tree.anchors[n])] + tree.tokens[tree.path(n)].tolist())[-1] for n in range(tree.num_nodes)]
    return torch.stack(rows)


def test_tree_mask_alone_is_wrong_for_gated_deltanet():
    """Attention layers get the tree mask, but the GDN layers scan the packed nodes in order."""
    model = MODELS["qwen3_next"]
    batch, _, exact = tree_pass(model)
    naive_batch = dataclasses.replace(batch, trees=(TokenTree.chain(TREE.tokens, len(CONTEXT)),))
    cache = prefill(model, [CONTEXT])
    with torch.no_grad():
        naive = model(naive_batch, cache)[0]
    expected = path_logits(model)
    assert (exact - expected).abs().max() < 1e-5
    errors = (naive - expected).abs().amax(dim=-1)
    print(f"tree-mask-only GDN: max error {errors.max():.3f} (exact: {(exact - expected).abs().max():.1e})")
    assert errors[0] < 1e-5  # the first node has no packed predecessor: nothing to go wrong
    assert errors.max() > 1e-2


def test_top_k_before_masking_is_wrong_for_sparse_attention(monkeypatch):
    """Selecting the top-k over every key of the pass, then masking, lets siblings take places."""
    model = MODELS["sparse"]
    expected = path_logits(model)
    _, _, exact = tree_pass(model)

    def select_then_mask(self, scores, visible, positions):
        everything = torch.ones_like(visible.expand_as(scores))
        return sparse.select_top_k(scores, everything, positions, self.top_k) & visible

    monkeypatch.setattr(sparse.SparseAttention, "select", select_then_mask)
    _, _, naive = tree_pass(model)
    assert (exact - expected).abs().max() < 1e-5
    errors = (naive - expected).abs().amax(dim=-1)
    print(f"top-k-then-mask: max error {errors.max():.3f} (exact: {(exact - expected).abs().max():.1e})")
    assert errors.max() > 1e-2


def test_sparse_selection_is_active_in_these_tests():
    """Top-4 must differ from attending to every visible key, or the sparse tests test nothing."""
    model = MODELS["sparse"]
    sequence = CONTEXT + [1, 2, 3, 4, 5]
    top_4 = alone(model, sequence)
    layers = [m for m in model.modules() if isinstance(m, sparse.SparseAttention)]
    for layer in layers:
        layer.top_k = 10_000
    try:
        dense = alone(model, sequence)
    finally:
        for layer in layers:
            layer.top_k = model.config.index_topk
    assert (top_4[:4] - dense[:4]).abs().max() < 1e-6  # up to 4 keys: nothing to select
    assert (top_4 - dense).abs().max() > 1e-2


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_rollback_then_continue_equals_fresh_prefill(kind):
    model = MODELS[kind]
    context = [(13 * i + 1) % VOCAB for i in range(14)]
    cache = prefill(model, [context])
    for length in (9, 4, 0):  # inside a chunk, on a chunk boundary, everything
        cache.rollback([length])
        step = ForwardBatch.causal([[9, 10, 11]], cache.lengths.tolist())
        with torch.no_grad():
            logits = model(step, cache)
        assert (logits[0] - alone(model, context[:length] + [9, 10, 11])[-3:]).abs().max() < 1e-5
        cache.commit(step, [[0, 1, 2]])
        context = context[:length] + [9, 10, 11] + [20 + length]
        step = ForwardBatch.causal([[20 + length]], cache.lengths.tolist())
        with torch.no_grad():
            logits = model(step, cache)
        cache.commit(step, [[0]])
        assert (logits[0, 0] - alone(model, context)[-1]).abs().max() < 1e-5


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_partial_block_commit_then_continue(kind):
    """Speculative decoding's pattern: verify a chain block, keep a prefix, feed the correction."""
    model = MODELS[kind]
    cache = prefill(model, [CONTEXT])
    sequence = list(CONTEXT)
    for block, keep in (([1, 2, 3, 4, 5, 6], 2), ([7, 8, 9], 3), ([10, 11, 12, 13, 14], 0)):
        batch = ForwardBatch.causal([block], cache.lengths.tolist())
        with torch.no_grad():
            logits = model(batch, cache)
        assert (logits[0] - alone(model, sequence + block)[-len(block):]).abs().max() < 1e-5
        cache.commit(batch, [list(range(keep))])
        sequence += block[:keep]
    with torch.no_grad():
        logits = model(ForwardBatch.causal([[42]], cache.lengths.tolist()), cache)
    assert (logits[0, 0] - alone(model, sequence + [42])[-1]).abs().max() < 1e-5


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_specd_generate_runs_every_kind(kind, tmp_path, capsys):
    """`specd generate --model DIR` loads either kind from its config.json and decodes greedily."""
    save_model(MODELS[kind], tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (expected,) = autoregressive(MODELS[kind], [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=10))
    assert result["token_ids"] == expected.token_ids


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_speculative_decoding_equals_plain_greedy(kind):
    """Blocks verified as chains, prefixes committed, rows reused after rollback: lossless."""
    model = MODELS[kind]
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7, 9, 8, 7, 9, 8], [5] * 6, [11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(max_tokens=20)
    plain = autoregressive(model, prompts, params)
    config = EngineConfig(max_num_seqs=3, mode="sync", block_size=6, adaptive_block=False)
    speculative = SpeculativeEngine(model, NgramDrafter(vocab_size=VOCAB), config).generate(prompts, params)
    assert [g.token_ids for g in speculative] == [g.token_ids for g in plain]
