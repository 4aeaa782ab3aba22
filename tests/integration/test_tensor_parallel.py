"""Tensor parallelism (`specd.parallel.tensor_parallel`, gloo, real processes): 2 ranks == 1 process.

For each target kind (qwen3, qwen3_next, sparse; random "debug" models saved in Hugging Face
layout), two spawned ranks load the model, shard it, and run one scenario over a cache that both
they and the unsharded model in this process run:

  (a) a prefill of ragged prompts (3, 6 and 11 tokens; the cache starts with 8 slots, so it grows),
  (b) decode steps after it,
  (c) a token tree over the cache: sibling branches at the context's end, one deeper than a Gated
      DeltaNet chunk, one anchored inside the context (indexed state replay, top-k over that
      branch's keys only),
  (d) commit of a path of that tree, then a 2-token chunk and a decode (the tip state, replay).

Every real token's logits must equal the one-process model's within 1e-5 (fp32), and the two
ranks' logits must be identical (the sparse target's top-k must pick the same keys on both).
qwen3 has tied embeddings (the head is untied and sliced), qwen3_next a vocabulary of 509 (not a
multiple of 2: the last rank's head is padded).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawned import run_spawned
from torch.distributed.device_mesh import init_device_mesh

from specd.batch import ForwardBatch
from specd.models import qwen3, qwen3_next, sparse
from specd.models.loading import load_model, save_model
from specd.parallel import tensor_parallel
from specd.ports import free_port
from specd.tree import TokenTree

KINDS = ("qwen3", "qwen3_next", "sparse")
WORLD_SIZE = 2
TIMEOUT_SECONDS = 120
TOLERANCE = 1e-5
PROMPTS = [[(37 * i + 11 * b + 5) % 500 for i in range(n)] for b, n in enumerate((6, 11, 3))]


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(KINDS.index(kind) + 1)
    if kind == "qwen3":
        return qwen3.Qwen3ForCausalLM(qwen3.FLAVOURS["debug"])
    if kind == "qwen3_next":
        return qwen3_next.Qwen3NextForCausalLM(dataclasses.replace(qwen3_next.FLAVOURS["debug"], vocab_size=509))
    return sparse.SparseForCausalLM(sparse.FLAVOURS["debug"])


def real_rows(logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``[num_real_tokens, vocab]``: the padding rows' outputs are never read."""
    return torch.cat([logits[b, :n] for b, n in enumerate(batch.num_new.tolist())])


@torch.no_grad()
def scenario(model) -> dict[str, torch.Tensor]:
    """Logits of every pass of (a)-(d) (see the module docstring), keyed by pass."""
    out = {}
    cache = model.new_cache(len(PROMPTS), capacity=8)

    def run(name: str, batch: ForwardBatch, paths=None) -> None:
        out[name] = real_rows(model(batch, cache), batch)
        if paths is not None:
            cache.commit(batch, paths)

    batch = ForwardBatch.causal(PROMPTS, cache.lengths.tolist())
    run("prefill", batch, [list(range(len(p))) for p in PROMPTS])
    for step in range(3):
        tokens = [[(13 * step + 7 * b + 1) % 500] for b in range(len(PROMPTS))]
        batch = ForwardBatch.causal(tokens, cache.lengths.tolist())
        run(f"decode {step}", batch, [[0]] * len(PROMPTS))
    lengths = cache.lengths.tolist()
    trees = [
        TokenTree.from_paths([(n, [7, 8, 9, 10, 11, 12]), (n, [7, 300, 301]), (n, [99 + b, 98]), (n - 4, [5, 6, 7])])
        for b, n in enumerate(lengths)
    ]
    batch = ForwardBatch.from_trees(trees, cache.lengths)
    # Commit part of the deep branch (a partially accepted block: the tip state must be replayed).
    run("tree", batch, [tree.path(3) for tree in trees])
    batch = ForwardBatch.causal([[3, 4]] * len(PROMPTS), cache.lengths.tolist())
    run("chunk after commit", batch, [[0, 1]] * len(PROMPTS))
    batch = ForwardBatch.causal([[42]] * len(PROMPTS), cache.lengths.tolist())
    run("decode after commit", batch)
    return out


def cache_heads(cache) -> dict[str, int]:
    """Head counts the cache allocated (key/value heads; recurrent-state heads and conv channels)."""
    kv = getattr(cache, "kv", cache)
    heads = {"kv heads": kv.keys[0].shape[1]}
    if hasattr(cache, "recurrent"):
        heads["recurrent heads"] = cache.recurrent.checkpoints[0].shape[2]
        heads["conv channels"] = cache.recurrent.inputs.tensors[0].shape[-1]
    return heads


# ---------------------------------------------------------------------------- what each rank runs
def refusals() -> dict[str, str]:
    """Error messages: heads that do not divide, and saving a sharded model."""
    messages = {}
    bad = {
        "qwen3": qwen3.Qwen3ForCausalLM(dataclasses.replace(qwen3.FLAVOURS["debug"], num_attention_heads=6,
                                                            num_key_value_heads=3)),
        "qwen3_next": qwen3_next.Qwen3NextForCausalLM(dataclasses.replace(
            qwen3_next.FLAVOURS["debug"], linear_num_key_heads=3, linear_num_value_heads=6)),
    }
    for kind, model in bad.items():
        before = {name: p.shape for name, p in model.named_parameters()}
        try:
            tensor_parallel(model)
        except ValueError as err:
            messages[kind] = str(err)
        after = {name: p.shape for name, p in model.named_parameters()}
        messages[f"{kind} untouched"] = str(before == after and model.tp_size == 1)
    return messages


def worker(rank: int, port: int, root: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        report: dict = {"refusals": refusals()}
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for kind in KINDS:
            # The default group, or (sparse) a 1-D device mesh over the same ranks.
            model = tensor_parallel(load_model(root / kind), mesh if kind == "sparse" else None)
            report[kind] = scenario(model)
            report[f"{kind} cache"] = cache_heads(model.new_cache(1))
            report[f"{kind} q_proj rows"] = model.model.layers[1].self_attn.q_proj.out_features
            try:
                save_model(model, root / f"saved-{kind}-{rank}")
            except ValueError as err:
                report[f"{kind} save"] = str(err)
        torch.save(report, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(root: Path) -> float:
    return run_spawned(worker, (free_port(), root), WORLD_SIZE, TIMEOUT_SECONDS, f"{WORLD_SIZE} tensor-parallel ranks")


# ---------------------------------------------------------------------------- the properties
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tensor_parallel")
    for kind in KINDS:
        save_model(build(kind).eval(), root / kind)
    seconds = run_ranks(root)
    print(f"{WORLD_SIZE} ranks: {seconds:.1f} s wall")
    ranks = [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    whole = {}
    for kind in KINDS:
        model = load_model(root / kind)
        whole[kind] = scenario(model)
        whole[f"{kind} cache"] = cache_heads(model.new_cache(1))
        whole[f"{kind} q_proj rows"] = model.model.layers[1].self_attn.q_proj.out_features
    return {"ranks": ranks, "whole": whole, "root": root}


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_the_one_process_logits(runs, kind):
    whole = runs["whole"][kind]
    worst = {}
    for name, expected in whole.items():
        got = [rank[kind][name] for rank in runs["ranks"]]
        assert got[0].shape == expected.shape, name  # full vocabulary on every rank
        worst[name] = float((got[0] - expected).abs().max())
        torch.testing.assert_close(got[0], expected, atol=TOLERANCE, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(got[0], got[1]), f"{name}: the ranks' logits differ"
    print(kind, {name: f"{value:.1e}" for name, value in worst.items()})


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_holds_half_the_heads_and_caches_only_those(runs, kind):
    whole, rank = runs["whole"], runs["ranks"][0]
    assert rank[f"{kind} q_proj rows"] * WORLD_SIZE == whole[f"{kind} q_proj rows"]
    expected = {name: count // WORLD_SIZE for name, count in whole[f"{kind} cache"].items()}
    assert rank[f"{kind} cache"] == expected


def test_heads_that_do_not_divide_are_refused_with_the_numbers(runs):
    messages = runs["ranks"][0]["refusals"]
    assert "key/value heads = 3 not divisible by 2" in messages["qwen3"]
    assert "one of [1]" in messages["qwen3"]  # the sizes that would work (128 / 3 is no integer)
    assert "linear-attention key heads = 3 not divisible by 2" in messages["qwen3_next"]
    assert messages["qwen3 untouched"] == messages["qwen3_next untouched"] == "True"


@pytest.mark.parametrize("kind", KINDS)
def test_a_sharded_model_is_never_saved(runs, kind):
    message = runs["ranks"][1][f"{kind} save"]
    assert "tensor-parallel (rank 1 of 2)" in message
    assert not (runs["root"] / f"saved-{kind}-1" / "model.safetensors").exists()
