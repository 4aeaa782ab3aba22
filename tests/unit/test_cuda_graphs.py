"""The CUDA-graph runner's static pass (padded rows bucket, full-capacity mask, padding written to
the scratch slot) against the plain pass. On the CPU the runner runs that static pass eagerly, so
everything but the capture itself is checked here; `specd bench gpu` checks capture and replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specd.batch import ForwardBatch
from specd.cuda_graphs import GraphRunner
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.models.qwen3_next import FLAVOURS as NEXT_FLAVOURS
from specd.models.qwen3_next import Qwen3NextForCausalLM
from specd.sampling import SamplingParams
from specd.tree import TokenTree


def target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(dataclasses.replace(FLAVOURS["debug"], tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked greedy choices: equal outputs mean equal logits
    return model


def filled_cache(model, rows: int, lengths: list[int]):
    cache = model.new_cache(rows, capacity=64)
    generator = torch.Generator().manual_seed(1)  # the same prompts in every cache
    prompts = [torch.randint(4, 512, (n,), generator=generator).tolist() for n in lengths]
    fill = ForwardBatch.causal(prompts, cache.lengths[: len(lengths)].tolist())
    model(fill, cache)
    cache.commit(fill, [list(range(n)) for n in lengths])
    return cache


@pytest.mark.parametrize("tokens", [1, 5])
@torch.no_grad()
def test_the_static_pass_gives_the_plain_pass_logits_and_cache(tokens):
    model = target()
    lengths = [7, 3, 12]  # 3 rows: padded to the bucket of 4
    plain_cache, static_cache = filled_cache(model, 6, lengths), filled_cache(model, 6, lengths)
    new = [torch.randint(4, 512, (tokens,)).tolist() for _ in lengths]
    trees = [TokenTree.chain(t, n) for t, n in zip(new, lengths)]
    batch = ForwardBatch.from_trees(trees, lengths)
    want = model(batch, plain_cache)
    runner = GraphRunner(model, static_cache, tokens=(1, 5))
    got = runner(ForwardBatch.from_trees(trees, lengths))
    diff = (got - want).abs().max().item()
    print(f"tokens {tokens}: max |static - plain| = {diff:.2e}")
    assert got.shape == want.shape and diff < 1e-5
    assert runner.num_replays == 1 and runner.num_fallbacks == 0
    # The cache holds the same keys in every slot a later pass can read.
    for layer in range(len(plain_cache.keys)):
        for row, n in enumerate(lengths):
            end = n + tokens
            assert torch.allclose(static_cache.keys[layer][row, :, :end], plain_cache.keys[layer][row, :, :end], atol=1e-6)


@torch.no_grad()
def test_shapes_outside_the_buckets_fall_back_to_the_plain_pass():
    model = target()
    cache = filled_cache(model, 4, [5, 5])
    runner = GraphRunner(model, cache, tokens=(1,))
    trees = [TokenTree.chain([9, 9, 9], 5), TokenTree.chain([9, 9, 9], 5)]  # 3 new tokens: not a graph shape
    runner(ForwardBatch.from_trees(trees, [5, 5]))
    assert runner.num_fallbacks == 1 and runner.num_replays == 0
    near_end = filled_cache(model, 1, [62])  # capacity 64: its writes would reach the scratch slot
    runner = GraphRunner(model, near_end, tokens=(1,))
    runner(ForwardBatch.from_trees([TokenTree.chain([9], 62)], [62]))
    assert runner.num_fallbacks == 1


def test_greedy_output_with_graphs_equals_plain_decoding():
    model = target()
    prompts = [torch.randint(4, 512, (n,)).tolist() for n in (5, 9, 3, 14, 7)]
    params = SamplingParams(max_tokens=12)
    want = [g.token_ids for g in autoregressive(model, prompts, params)]
    engine = SpeculativeEngine(model, None, EngineConfig(max_num_seqs=4, block_size=0, cuda_graphs=True))
    try:
        got = [g.token_ids for g in engine.generate(prompts, params)]
    finally:
        engine.close()
    assert got == want
    assert engine._graphs.num_replays > 0  # decode steps went through the static pass


def test_a_hybrid_target_is_refused_with_a_reason():
    model = Qwen3NextForCausalLM(NEXT_FLAVOURS["debug"]).eval()
    with pytest.raises(ValueError, match="plain KV cache"):
        SpeculativeEngine(model, None, EngineConfig(max_num_seqs=2, block_size=0, cuda_graphs=True))
