"""specd's Qwen3 against transformers' Qwen3ForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_reference import assert_greedy_matches_generate

from specd.batch import ForwardBatch
from specd.models.attention import AttentionMetadata
from specd.models.loading import load_model

CONFIGS = {
    "untied-gqa2": dict(head_dim=32, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "tied-mha": dict(head_dim=16, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa4-theta1e6": dict(head_dim=8, num_attention_heads=8, num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mqa-bias": dict(head_dim=24, num_attention_heads=3, num_key_value_heads=1, attention_bias=True),
}


def hf_checkpoint(tmp_path, **overrides):
    config = transformers.Qwen3Config(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=2, **overrides
    )
    reference = transformers.Qwen3ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    return reference, load_model(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ragged_prefill_and_decode_match_transformers(tmp_path, name):
    reference, model = hf_checkpoint(tmp_path, **CONFIGS[name])
    prompts = [[5, 17, 3, 99, 42, 7, 8], [1, 2, 3], [200, 100, 50, 25, 12]]
    cache = model.new_cache(len(prompts), capacity=4)  # small: forces the cache to grow
    batch = ForwardBatch.causal(prompts, cache.lengths.tolist())
    with torch.no_grad():
        logits = model(batch, cache)
    cache.commit(batch, [list(range(len(p))) for p in prompts])
    sequences = [list(p) for p in prompts]
    worst = 0.0
    for b, prompt in enumerate(prompts):
        expected = reference(torch.tensor([prompt])).logits[0]
        worst = max(worst, (logits[b, : len(prompt)] - expected).abs().max().item())
    # 20 incremental decode steps, feeding each sequence a different pseudo-random token.
    for step in range(20):
        tokens = [[(7 * step + 13 * b + 1) % 211] for b in range(len(prompts))]
        batch = ForwardBatch.causal(tokens, cache.lengths.tolist())
        with torch.no_grad():
            logits = model(batch, cache)
        cache.commit(batch, [[0]] * len(prompts))
        for b, token in enumerate(tokens):
            sequences[b] += token
            expected = reference(torch.tensor([sequences[b]])).logits[0, -1]
            worst = max(worst, (logits[b, 0] - expected).abs().max().item())
    print(f"{name}: max |logits - transformers| = {worst:.2e}")
    assert worst < 1e-4


def test_bf16_close_to_fp32(tmp_path):
    _, model = hf_checkpoint(tmp_path, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    half = load_model(tmp_path, dtype=torch.bfloat16)
    batch = ForwardBatch.causal([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        full, low = model(batch), half(batch).float()
    assert low.dtype == torch.float32 and half.lm_head.weight.dtype == torch.bfloat16
    assert (full - low).abs().max() < 0.05 * full.abs().max()


def test_greedy_generation_matches_transformers_generate(tmp_path):
    reference, model = hf_checkpoint(tmp_path, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    assert_greedy_matches_generate(reference, model, [[11, 22, 33, 44], [5, 6]])


def prefilled(model):
    """A cache of four rows holding four ragged prompts (4, 2, 1 and 5 tokens)."""
    prompts = [[5, 17, 3, 99], [1, 2], [8], [200, 100, 50, 25, 12]]
    cache = model.new_cache(len(prompts))
    prefill = ForwardBatch.causal(prompts, cache.lengths.tolist())
    with torch.no_grad():
        model(prefill, cache)
    cache.commit(prefill, [list(range(len(p))) for p in prompts])
    return cache


@pytest.mark.parametrize("chains, real, split", [
    ([[7], [9, 11, 13, 15], [], [21, 22]], [0, 4, 5, 6, 7, 12, 13], None),
    # A prompt prefilled beside decoding rows: attention at width 1, then the long row alone.
    ([[7], list(range(30, 42)), [4], [9]], [0] + list(range(12, 24)) + [24, 36], (1, [1])),
])
def test_padded_pass_computes_its_real_tokens_only(tmp_path, chains, real, split):
    """A verification where some sequences carry a block and others one token (or none: an idle
    row) runs its projections on the real tokens alone, and its attention split where the padded
    grid is mostly padding, with the logits of the padded pass."""
    _, model = hf_checkpoint(tmp_path, **CONFIGS["untied-gqa2"])
    cache = prefilled(model)
    batch = ForwardBatch.from_chains(chains, cache.lengths.tolist())
    assert batch.real_index().tolist() == real
    with torch.no_grad():
        found = AttentionMetadata.from_batch(batch, model.attention_backend).split
    assert (found[0], found[1].tolist()) == split if split else found is None
    rows_seen = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape))
    with torch.no_grad():
        packed = model(batch, cache)
    with torch.enable_grad():  # autograd passes keep the padded products: the reference
        padded = model(batch, cache).detach()
    hook.remove()
    assert rows_seen[0] == (len(real), 48) and rows_seen[1] == (4, max(map(len, chains)), 48)
    for b, chain in enumerate(chains):
        torch.testing.assert_close(packed[b, : len(chain)], padded[b, : len(chain)], rtol=1e-5, atol=1e-5)


def test_a_split_attention_pass_runs_under_bf16_autocast(tmp_path):
    """A ragged pass whose attention is split (a prompt beside decoding rows) under CPU bf16
    autocast, as the zoo generates a drafter's training answers where the CPU computes bf16:
    SDPA answers in bf16 for fp32 queries there, and the split's two halves must land in one
    tensor of that dtype. Close to the fp32 pass."""
    _, model = hf_checkpoint(tmp_path, **CONFIGS["untied-gqa2"])
    chains = [[7], list(range(30, 42)), [4], [9]]
    logits = {}
    for bf16 in (False, True):
        cache = prefilled(model)
        batch = ForwardBatch.from_chains(chains, cache.lengths.tolist())
        with torch.no_grad():
            assert AttentionMetadata.from_batch(batch, model.attention_backend).split is not None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits[bf16] = model(batch, cache).float()
    for b, chain in enumerate(chains):
        full, low = logits[False][b, : len(chain)], logits[True][b, : len(chain)]
        assert (full - low).abs().max() < 0.05 * full.abs().max()
