"""specd's Llama against transformers' LlamaForCausalLM on tiny random checkpoints.

Hugging Face initialises RMSNorm weights to 1 and biases to 0, which would hide a norm or a
bias that is dropped on loading; every reference here draws them at random before saving.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from hf_reference import assert_greedy_matches_generate
from hypothesis import HealthCheck, given, settings
from spawned import run_spawned
from test_hybrid_trees import VOCAB as TREE_VOCAB
from test_hybrid_trees import batches, check_tree_exactness

from specd.batch import ForwardBatch
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.llama import FLAVOURS, LlamaConfig, LlamaForCausalLM
from specd.models.loading import ModelLoadError, load_model, save_model
from specd.parallel import tensor_parallel
from specd.ports import free_port
from specd.sampling import SamplingParams
from specd.tree import TokenTree

VOCAB = 211
CONFIGS = {
    "untied-gqa2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "tied-mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),  # head_dim 48/4
    "tied-gqa3-bias-theta1e5": dict(
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    ),
    "untied-mqa-attention-bias": dict(
        num_attention_heads=3, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False, attention_bias=True,
    ),
}


def randomise_norms_and_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.3)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)


def hf_checkpoint(directory: Path, **overrides) -> tuple[transformers.LlamaForCausalLM, LlamaForCausalLM]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, rms_norm_eps=1e-5, **overrides
    )
    reference = transformers.LlamaForCausalLM(config).eval()
    randomise_norms_and_biases(reference)
    reference.save_pretrained(directory)
    return reference, load_model(directory)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ragged_prefill_and_decode_match_transformers(tmp_path, name):
    reference, model = hf_checkpoint(tmp_path, **CONFIGS[name])
    assert isinstance(model, LlamaForCausalLM)
    prompts = [[5, 17, 3, 99, 42, 7, 8], [1, 2, 3], [200, 100, 50, 25, 12]]
    cache = model.new_cache(len(prompts), capacity=4)  # small: forces the cache to grow
    sequences: list[list[int]] = [[] for _ in prompts]
    worst = 0.0

    def step(chunks: list[list[int]]) -> None:
        """One pass over ragged chunks appended to the cache, checked against a full HF pass."""
        nonlocal worst
        batch = ForwardBatch.causal(chunks, cache.lengths.tolist())
        with torch.no_grad():
            logits = model(batch, cache)
        cache.commit(batch, [list(range(len(c))) for c in chunks])
        for b, chunk in enumerate(chunks):
            sequences[b] += chunk
            with torch.no_grad():
                expected = reference(torch.tensor([sequences[b]])).logits[0, -len(chunk):]
            worst = max(worst, (logits[b, : len(chunk)] - expected).abs().max().item())

    step(prompts)  # ragged prefill
    for i in range(12):  # decode, a different pseudo-random token per sequence
        step([[(7 * i + 13 * b + 1) % VOCAB] for b in range(len(prompts))])
    step([[9, 10], [11, 12, 13], [14]])  # ragged verification-sized chunks
    print(f"{name}: max |logits - transformers| = {worst:.2e}")
    assert worst < 1e-4


def test_greedy_generation_matches_transformers_generate(tmp_path):
    reference, model = hf_checkpoint(tmp_path, **CONFIGS["tied-gqa3-bias-theta1e5"])
    assert_greedy_matches_generate(reference, model, [[11, 22, 33, 44], [5, 6], [100, 3, 3, 3, 3, 7, 1]])


def test_greedy_stops_at_the_checkpoint_eos_as_transformers_does(tmp_path):
    """``config.stop_token_ids`` comes from the checkpoint's eos_token_id (here one greedy hits)."""
    reference, _ = hf_checkpoint(tmp_path / "probe", **CONFIGS["untied-gqa2"])
    prompt = [11, 22, 33, 44]
    free_run = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    eos = free_run[5]
    reference.config.eos_token_id = eos
    reference.save_pretrained(tmp_path / "eos")
    model = load_model(tmp_path / "eos")
    assert model.config.stop_token_ids == (eos,)
    (ours,) = autoregressive(model, [prompt], SamplingParams(max_tokens=12, stop_token_ids=model.config.stop_token_ids))
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.token_ids == expected == free_run[: free_run.index(eos) + 1]
    assert ours.finish_reason == "stop"


# ---------------------------------------------------------------------------------- trees
def debug_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(1)
    model = LlamaForCausalLM(dataclasses.replace(FLAVOURS["debug"], **overrides)).eval()
    randomise_norms_and_biases(model)
    return model


TREE_MODEL = debug_model(attention_bias=True, mlp_bias=True)
assert TREE_MODEL.config.vocab_size >= TREE_VOCAB  # the shared strategy draws tokens below TREE_VOCAB


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_tree_logits_equal_each_path_alone(data):
    check_tree_exactness(TREE_MODEL, data)


def test_greedy_speculative_decoding_equals_plain_greedy():
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7, 9, 8, 7, 9, 8], [5] * 6]
    params = SamplingParams(max_tokens=16)
    plain = autoregressive(TREE_MODEL, prompts, params)
    config = EngineConfig(max_num_seqs=2, mode="sync", block_size=5, adaptive_block=False)
    drafter = NgramDrafter(vocab_size=TREE_MODEL.config.vocab_size)
    speculative = SpeculativeEngine(TREE_MODEL, drafter, config).generate(prompts, params)
    assert [g.token_ids for g in speculative] == [g.token_ids for g in plain]


# ---------------------------------------------------------------------------------- configs
def write_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("rope_type", ["llama3", "linear", "dynamic", "yarn"])
@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_scaling_is_refused(tmp_path, key, rope_type):
    hf_checkpoint(tmp_path, **CONFIGS["tied-mha"])
    scaling = {"rope_type": rope_type, "factor": 8.0, "rope_theta": 5e5}
    write_config(tmp_path, **{key: scaling})
    with pytest.raises(ModelLoadError, match=f"rope type '{rope_type}' is not supported"):
        load_model(tmp_path)
    legacy = {"type": rope_type, "factor": 2.0}  # transformers 4's spelling
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        LlamaConfig.from_hf({"model_type": "llama", "rope_scaling": legacy})


def test_legacy_config_with_null_rope_scaling_loads(tmp_path):
    """SmolLM2's config.json (transformers 4): ``rope_theta`` at the top, ``rope_scaling: null``."""
    reference, _ = hf_checkpoint(tmp_path, **CONFIGS["tied-gqa3-bias-theta1e5"])
    write_config(tmp_path, rope_parameters=..., rope_theta=1e5, rope_scaling=None, dtype=..., torch_dtype="float32")
    model = load_model(tmp_path)
    assert model.config.rope_theta == 1e5
    tokens = [5, 17, 3, 99, 42, 7, 8, 1, 2, 3]
    with torch.no_grad():
        worst = (model(ForwardBatch.causal([tokens]))[0] - reference(torch.tensor([tokens])).logits[0]).abs().max()
    print(f"legacy config: max |logits - transformers| = {worst:.2e}")
    assert worst < 1e-4
    write_config(tmp_path, rope_scaling=..., rope_theta=...)  # absent: transformers' default 10000
    assert load_model(tmp_path).config.rope_theta == 10000.0


def test_other_architectures_are_refused_clearly(tmp_path):
    hf_checkpoint(tmp_path, **CONFIGS["tied-mha"])
    write_config(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture model_type='mistral'.*'llama'"):
        load_model(tmp_path)
    write_config(tmp_path, model_type="llama", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ModelLoadError, match="do not include 'LlamaForCausalLM'"):
        load_model(tmp_path)
    write_config(tmp_path, architectures=["LlamaForCausalLM"], hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="model_type 'mistral' is not 'llama'"):
        LlamaConfig.from_hf({"model_type": "mistral"})


def test_smollm2_flavour_has_the_real_shapes_and_names():
    """134.5M parameters (DESIGN.md) under exactly the names transformers gives them."""
    config = FLAVOURS["smollm2-135m"]
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf()))
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    assert LlamaConfig.from_hf(theirs.config.to_dict()) == config
    assert config.stop_token_ids == (2,)


def test_saved_model_loads_in_transformers(tmp_path):
    model = debug_model(attention_bias=True, tie_word_embeddings=False)
    save_model(model, tmp_path)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        worst = (model(ForwardBatch.causal([tokens]))[0] - reference(torch.tensor([tokens])).logits[0]).abs().max()
    assert worst < 1e-4, worst
    assert load_model(tmp_path).config == model.config


# ---------------------------------------------------------------------------------- tensor parallel
WORLD_SIZE = 2


@torch.no_grad()
def tp_scenario(model) -> list[torch.Tensor]:
    """Logits of a ragged prefill, a decode step and a token tree, real rows only."""
    cache = model.new_cache(2, capacity=4)
    out = []
    for chunks in ([[5, 6, 7, 8, 9], [10, 11]], [[12], [13]]):
        batch = ForwardBatch.causal(chunks, cache.lengths.tolist())
        logits = model(batch, cache)
        cache.commit(batch, [list(range(len(c))) for c in chunks])
        out += [logits[b, : len(c)] for b, c in enumerate(chunks)]
    trees = [TokenTree.from_paths([(n, [7, 8, 9]), (n, [7, 300]), (n - 2, [5, 6])]) for n in cache.lengths.tolist()]
    batch = ForwardBatch.from_trees(trees, cache.lengths)
    logits = model(batch, cache)
    return out + [logits[b, : t.num_nodes] for b, t in enumerate(trees)]


def tp_worker(rank: int, port: int, root: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        model = tensor_parallel(load_model(root))
        torch.save({"logits": tp_scenario(model), "kv heads": model.new_cache(1).keys[0].shape[1]},
                   root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_give_the_one_process_logits(tmp_path):
    """Biases on every projection: a row-parallel bias must be added once, after the all-reduce."""
    model = debug_model(attention_bias=True, mlp_bias=True)
    save_model(model, tmp_path)
    run_spawned(tp_worker, (free_port(), tmp_path), WORLD_SIZE, 120, f"{WORLD_SIZE} tensor-parallel Llama ranks")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    whole = tp_scenario(load_model(tmp_path))
    worst = max((got - expected).abs().max().item() for got, expected in zip(ranks[0]["logits"], whole))
    print(f"tensor parallel x{WORLD_SIZE}: max |logits - one process| = {worst:.2e}")
    assert worst < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]))
    assert ranks[0]["kv heads"] == model.config.num_key_value_heads // WORLD_SIZE
