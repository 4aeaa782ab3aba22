"""specd's Qwen3-Next against transformers' Qwen3NextForCausalLM (plain-torch path) on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_reference import assert_greedy_matches_generate

from specd.batch import ForwardBatch
from specd.cli import main
from specd.models.loading import ModelLoadError, load_model

VOCAB = 211
CONFIGS = {
    # Qwen3-Next's own pattern (3 linear + 1 full), grouped value heads, chunks of 4.
    "gva2-chunk4": dict(
        num_hidden_layers=4, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        num_experts=0, linear_chunk_size=4,
    ),
    # An MoE config whose mlp_only_layers covers every layer (dense), biases, tied embeddings,
    # half rotary, conv kernel 3, one value head per key head, linear first and last.
    "dense-moe-config-bias-tied": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        head_dim=8, num_attention_heads=6, num_key_value_heads=3, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=3, num_experts=4, mlp_only_layers=[0, 1, 2], linear_chunk_size=8,
    ),
}


def hf_checkpoint(tmp_path, **overrides):
    config = transformers.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, **overrides)
    reference = transformers.Qwen3NextForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    return reference, load_model(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ragged_prefill_and_decode_match_transformers(tmp_path, name):
    reference, model = hf_checkpoint(tmp_path, **CONFIGS[name])
    prompts = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11, 12], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3]]
    cache = model.new_cache(len(prompts), capacity=4)  # small: forces the cache to grow
    batch = ForwardBatch.causal(prompts, cache.lengths.tolist())
    with torch.no_grad():
        logits = model(batch, cache)
        cache.commit(batch, [list(range(len(p))) for p in prompts])
        worst = max(
            (logits[b, : len(p)] - reference(torch.tensor([p])).logits[0]).abs().max().item()
            for b, p in enumerate(prompts)
        )
        sequences = [list(p) for p in prompts]
        for step in range(20):
            tokens = [[(7 * step + 13 * b + 1) % VOCAB] for b in range(len(prompts))]
            batch = ForwardBatch.causal(tokens, cache.lengths.tolist())
            logits = model(batch, cache)
            cache.commit(batch, [[0]] * len(prompts))
            for b, token in enumerate(tokens):
                sequences[b] += token
                expected = reference(torch.tensor([sequences[b]])).logits[0, -1]
                worst = max(worst, (logits[b, 0] - expected).abs().max().item())
    print(f"{name}: max |logits - transformers| = {worst:.2e}")
    assert worst < 1e-4


def test_greedy_generation_matches_transformers_generate(tmp_path):
    reference, model = hf_checkpoint(tmp_path, **CONFIGS["gva2-chunk4"])
    assert_greedy_matches_generate(reference, model, [[11, 22, 33, 44, 55, 66], [5, 6]])


def test_mixture_of_experts_checkpoints_are_rejected_clearly(tmp_path, capsys):
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, mlp_only_layers=[0],
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ModelLoadError, match="mixture-of-experts MLPs are not implemented.*num_experts=4 on 1 of 2"):
        load_model(tmp_path)
    # The CLI says the same in one line and exits 2.
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2"]) == 2
    assert "mixture-of-experts MLPs are not implemented" in capsys.readouterr().err


def test_bad_layer_types_are_rejected(tmp_path):
    config = transformers.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_experts=0)
    hf = config.to_dict()
    hf["layer_types"] = ["linear_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match="unsupported layer types"):
        load_model(tmp_path)


def test_bf16_close_to_fp32_with_cache(tmp_path):
    _, model = hf_checkpoint(tmp_path, **CONFIGS["gva2-chunk4"])
    half = load_model(tmp_path, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    full = model(ForwardBatch.causal([prompt])).detach()
    cache = half.new_cache(1)
    with torch.no_grad():
        low = half(ForwardBatch.causal([prompt[:5]], [0]), cache)
        cache.commit(ForwardBatch.causal([prompt[:5]], [0]), [list(range(5))])
        rest = half(ForwardBatch.causal([prompt[5:]], [5]), cache)
    low = torch.cat([low[0], rest[0]]).float()
    assert (full[0] - low).abs().max() < 0.05 * full.abs().max()


def test_transformers_loads_what_specd_saves(tmp_path):
    from specd.models.loading import save_model
    from specd.models.qwen3_next import FLAVOURS, Qwen3NextForCausalLM

    torch.manual_seed(0)
    ours = Qwen3NextForCausalLM(FLAVOURS["debug"]).eval()
    for module in ours.modules():  # non-trivial norms, so a wrong norm convention would show
        if "RMSNorm" in type(module).__name__:
            torch.nn.init.normal_(module.weight, std=0.1)
    save_model(ours, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = [7, 300, 12, 5, 99, 41, 8, 8, 3]
    with torch.no_grad():
        worst = (ours(ForwardBatch.causal([ids]))[0] - reference(torch.tensor([ids])).logits[0]).abs().max().item()
    assert worst < 1e-4, worst
