"""The tree-attention Triton kernel equals its plain-torch reference (SDPA with the boolean mask).

Masks come from real `TokenTree`s appended after cache lengths (`ForwardBatch.from_trees`):
branches at earlier anchors, ragged trees (padding rows), GQA and not, key counts that are not
a multiple of the key block. On the CPU the kernel runs in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``). Deliberately wrong kernels must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from specd.batch import ForwardBatch
from specd.kernels.runtime import triton_available
from specd.tree import TokenTree

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

if triton_available():
    from specd.kernels.tree_attention import tree_attention, tree_attention_reference

TOLERANCE = 1e-5


def random_tree(generator: torch.Generator, num_nodes: int, cache_len: int) -> TokenTree:
    """A random tree: each node hangs under a random earlier node or off the context; roots
    start at the cache length or, one time in three, at a random earlier anchor."""
    parents, anchors = [], []
    for i in range(num_nodes):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            anchor = anchors[parent]
        elif int(torch.randint(0, 3, (1,), generator=generator)) == 0:
            anchor = int(torch.randint(0, cache_len + 1, (1,), generator=generator))
        else:
            anchor = cache_len
        parents.append(parent)
        anchors.append(anchor)
    tokens = torch.randint(0, 100, (num_nodes,), generator=generator)
    return TokenTree(tokens, torch.tensor(parents), torch.tensor(anchors))


def tree_mask(seed: int, cache_lens: list[int], sizes: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    trees = [random_tree(generator, n, c) for n, c in zip(sizes, cache_lens)]
    return ForwardBatch.from_trees(trees, cache_lens).mask  # [num_seqs, max_new, num_keys]


def qkv(num_seqs, num_heads, num_kv_heads, max_new, num_keys, head_dim, dtype=torch.float32):
    q = torch.randn(num_seqs, num_heads, max_new, head_dim, dtype=dtype)
    k = torch.randn(num_seqs, num_kv_heads, num_keys, head_dim, dtype=dtype)
    v = torch.randn(num_seqs, num_kv_heads, num_keys, head_dim, dtype=dtype)
    return q, k, v


def max_diff(q, k, v, mask, **kwargs) -> float:
    got = tree_attention(q, k, v, mask, **kwargs)
    assert torch.isfinite(got).all()
    return (got - tree_attention_reference(q, k, v, mask)).abs().max().item()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_tree_masks_after_cache_match_reference(num_heads, num_kv_heads, head_dim):
    cache_lens, sizes = [0, 13, 29], [5, 11, 7]  # ragged: padding rows in sequences 0 and 2
    mask = tree_mask(head_dim + num_heads, cache_lens, sizes)
    num_seqs, max_new, num_keys = mask.shape
    assert num_keys % 16 and num_keys > 32  # several key blocks, the last one partial
    diff = max_diff(*qkv(num_seqs, num_heads, num_kv_heads, max_new, num_keys, head_dim), mask)
    print(f"tree attention vs reference (heads {num_heads}/{num_kv_heads}, d {head_dim}): {diff:.2e}")
    assert diff < TOLERANCE


def test_trees_without_cache_and_head_dim_not_a_power_of_two():
    mask = tree_mask(7, [0, 0], [19, 12])  # keys are the new tokens themselves
    diff = max_diff(*qkv(2, 4, 2, 19, 19, 24), mask)
    print(f"tree attention without cache, d 24: {diff:.2e}")
    assert diff < TOLERANCE


def test_causal_and_broadcast_mask_match_reference():
    q, k, v = qkv(2, 4, 2, 37, 37, 16)
    causal = max_diff(q, k, v, None)  # indices, no mask tensor
    dense = ForwardBatch.dense(torch.zeros(2, 37, dtype=torch.long)).mask  # [1, 37, 37]: batch stride 0
    broadcast = max_diff(q, k, v, dense)
    print(f"causal: {causal:.2e}, broadcast mask: {broadcast:.2e}")
    assert causal < TOLERANCE and broadcast < TOLERANCE
    assert (tree_attention(q, k, v, None) - tree_attention(q, k, v, dense)).abs().max() < TOLERANCE


def test_cache_slices_with_padding_are_read_in_place():
    """k/v as a KV cache hands them over: the first rows and slots of a larger buffer."""
    cache_k = torch.randn(5, 2, 64, 32)
    cache_v = torch.randn(5, 2, 64, 32)
    mask = tree_mask(11, [9, 30, 2], [4, 6, 1])
    k, v = cache_k[:3, :, : mask.shape[2]], cache_v[:3, :, : mask.shape[2]]
    assert not k.is_contiguous()
    q = torch.randn(3, mask.shape[1], 6, 32).transpose(1, 2)  # [seqs, heads, new, d], as the models make it
    diff = max_diff(q, k, v, mask)
    print(f"strided q and cache slices: {diff:.2e}")
    assert diff < TOLERANCE


def test_rows_that_see_nothing_are_zero_like_sdpa():
    mask = tree_mask(5, [10, 20], [6, 6])
    mask[0, 2] = False  # a query that may see no key at all
    q, k, v = qkv(2, 4, 2, 6, mask.shape[2], 16)
    out = tree_attention(q, k, v, mask)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert (out - tree_attention_reference(q, k, v, mask)).abs().max() < TOLERANCE


def test_half_precision_matches_reference():
    mask = tree_mask(3, [17, 4], [8, 5])
    q, k, v = qkv(2, 4, 2, 8, mask.shape[2], 32, dtype=torch.float16)
    got = tree_attention(q, k, v, mask).float()
    want = tree_attention_reference(q.float(), k.float(), v.float(), mask)
    diff = (got - want).abs().max().item()
    print(f"fp16 kernel vs fp32 reference: {diff:.2e}")
    assert diff < 5e-3


@pytest.mark.parametrize("bug", ["no_rescale", "no_mask"])
def test_wrong_kernels_are_caught(bug):
    """Skipping FlashAttention's rescale of the running sum, or ignoring the mask, must fail."""
    mask = tree_mask(2, [0, 13, 29], [5, 11, 7])
    q, k, v = qkv(3, 4, 2, mask.shape[1], mask.shape[2], 16)
    correct, wrong = max_diff(q, k, v, mask), max_diff(q, k, v, mask, bug=bug)
    print(f"correct kernel: {correct:.2e}, bug {bug!r}: {wrong:.2e}")
    assert correct < TOLERANCE
    assert wrong > 100 * TOLERANCE


def test_wrapper_says_what_is_wrong(monkeypatch):
    q, k, v = qkv(2, 4, 2, 3, 9, 16)
    mask = torch.ones(2, 3, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match="bool"):
        tree_attention(q, k, v, mask.float())
    with pytest.raises(ValueError, match=r"\[2 or 1, 3, 9\]"):
        tree_attention(q, k, v, mask[:, :, :8])
    with pytest.raises(ValueError, match="stride"):
        tree_attention(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, mask)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tree_attention(q[:, :3], k, v, mask)
    with pytest.raises(ValueError, match="num_keys == max_new"):
        tree_attention(q, k, v, None)
    with pytest.raises(ValueError, match="dtypes differ"):
        tree_attention(q.half(), k, v, mask)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: say what to do
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tree_attention(q, k, v, mask)
