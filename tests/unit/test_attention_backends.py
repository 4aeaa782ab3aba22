"""Every attention backend gives the models the same logits and the same greedy text as SDPA.

On the CPU: "sdpa" (the reference), "flex" (eager FlexAttention with a mask_mod over the step's
mask) and "triton" (the tree-attention kernel in Triton's interpreter). "flash" needs CUDA and
flash-attn, which is not installed here: choosing it must say how to install it, and specd
must import and run without it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from specd.batch import ForwardBatch
from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.kernels.runtime import triton_available
from specd.models.attention import BACKENDS, FLASH_INSTALL_HINT, causal_key_lens, flash_attn_functions, get_backend
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.models.qwen3_next import FLAVOURS as NEXT_FLAVOURS
from specd.models.qwen3_next import Qwen3NextForCausalLM
from specd.models.sparse import FLAVOURS as SPARSE_FLAVOURS
from specd.models.sparse import SparseForCausalLM
from specd.sampling import SamplingParams
from specd.tree import TokenTree

# Eager FlexAttention on the CPU warns (once) that it is unfused: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 256
CPU_BACKENDS = ["sdpa", "flex"] + (["triton"] if triton_available() else [])
OTHERS = [name for name in CPU_BACKENDS if name != "sdpa"]
MODELS = {
    "qwen3": lambda: Qwen3ForCausalLM(dataclasses.replace(FLAVOURS["debug"], vocab_size=VOCAB)),
    "qwen3_next": lambda: Qwen3NextForCausalLM(dataclasses.replace(NEXT_FLAVOURS["debug"], vocab_size=VOCAB)),
    "sparse": lambda: SparseForCausalLM(dataclasses.replace(SPARSE_FLAVOURS["debug"], vocab_size=VOCAB)),
    "d3d": lambda: D3DModel(dataclasses.replace(D3D_FLAVOURS["debug"], vocab_size=VOCAB)),
}
PROMPTS = [[(37 * i + 11) % VOCAB for i in range(14)], [3, 1, 4, 1, 5, 9], [200, 201, 202, 7, 7, 7, 7, 7, 7, 7]]


def make_model(kind: str, backend: str):
    torch.manual_seed(5)
    model = MODELS[kind]().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper random text, as in test_engine
    model.set_attention_backend(backend)
    return model


@torch.no_grad()
def logits_of_three_passes(model) -> list[torch.Tensor]:
    """Ragged prefill into a cache, then a tree verification pass with sibling branches (and,
    for the full-attention models, a branch at an earlier anchor), then a dense causal pass."""
    cache = model.new_cache(len(PROMPTS), capacity=8)  # small: the cache grows during the test
    prefill = ForwardBatch.causal(PROMPTS, cache.lengths.tolist())
    out = [model(prefill, cache)]
    cache.commit(prefill, [list(range(len(p))) for p in PROMPTS])
    lens = [len(p) for p in PROMPTS]
    paths = [[(lens[0], [5, 6, 7]), (lens[0], [5, 9]), (lens[0], [11, 12, 13, 14])],
             [(lens[1], [40])],
             [(lens[2], [1, 2]), (lens[2], [3])]]
    if isinstance(model, (Qwen3ForCausalLM, D3DModel)):
        paths[1].append((2, [77, 78, 79]))  # continues context[:2] only
    trees = [TokenTree.from_paths(p) for p in paths]
    out.append(model(ForwardBatch.from_trees(trees, lens), cache))
    out.append(model(ForwardBatch.dense(torch.tensor([p[:6] for p in PROMPTS]))))
    return out


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_backends_give_sdpa_logits(kind, backend):
    expected = logits_of_three_passes(make_model(kind, "sdpa"))
    got = logits_of_three_passes(make_model(kind, backend))
    diffs = [(g - e).abs().max().item() for g, e in zip(got, expected)]
    print(f"{kind} {backend} vs sdpa (prefill, tree, dense): " + ", ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("backend", OTHERS)
def test_greedy_output_is_identical(backend):
    """Plain greedy with the backend, and speculative greedy (D3D drafter: its passes are
    trees with bidirectional mask groups) with the backend in target AND drafter, both equal
    plain greedy through SDPA, token for token. Sync mode: async drafts on a second thread,
    and Triton's interpreter (unlike a GPU launch) keeps its grid in process-global state."""
    params = SamplingParams(max_tokens=10)
    expected = [g.token_ids for g in autoregressive(make_model("qwen3", "sdpa"), PROMPTS, params)]
    target = make_model("qwen3", backend)
    assert [g.token_ids for g in autoregressive(target, PROMPTS, params)] == expected
    drafter = D3DDrafter(make_model("d3d", backend), max_num_seqs=len(PROMPTS))
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=len(PROMPTS), block_size=3, mode="sync"))
    got = [g.token_ids for g in engine.generate(PROMPTS, params)]
    engine.close()
    assert got == expected


def test_auto_is_sdpa_on_the_cpu():
    expected = logits_of_three_passes(make_model("qwen3", "sdpa"))
    got = logits_of_three_passes(make_model("qwen3", "auto"))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_flash_without_flash_attn_says_how_to_install():
    if flash_attn_functions() is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(RuntimeError, match="pip install flash-attn --no-build-isolation"):
        get_backend("flash")
    model = make_model("qwen3", "sdpa")
    with pytest.raises(RuntimeError, match="CUDA only"):
        model.set_attention_backend("flash")
    assert model.attention_backend.name == "sdpa"  # a failed choice changes nothing


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(ValueError, match="'flashinfer'.*auto, sdpa, flex, flash, triton"):
        get_backend("flashinfer")
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_model("d3d", "sdpa").set_attention_backend("xformers")
    assert sorted(BACKENDS) == ["auto", "flash", "flex", "sdpa", "triton"]


def test_specd_imports_and_runs_without_flash_attn_or_triton():
    """With flash_attn and triton unimportable, the models import, build and run on "auto";
    choosing either backend then names what to install. Importing specd loads neither."""
    script = f"""
import sys
sys.modules["flash_attn"] = None  # any import of it raises ImportError
sys.modules["triton"] = None
import torch
import specd.models.qwen3 as qwen3
from specd.batch import ForwardBatch
model = qwen3.Qwen3ForCausalLM(qwen3.FLAVOURS["debug"])
model(ForwardBatch.causal([[1, 2, 3]]))
for name, hint in (("flash", {FLASH_INSTALL_HINT!r}), ("triton", "pip install 'triton")):
    try:
        model.set_attention_backend(name)
    except RuntimeError as err:
        assert hint in str(err), err
    else:
        raise AssertionError(name + " was chosen without its package")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    probe = ("import sys, specd.models.qwen3, specd.models.sparse, specd.models.d3d; "
             "print(sorted(m for m in ('triton', 'flash_attn', 'specd.kernels.tree_attention') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "[]", loaded.stderr


def test_causal_key_lens_finds_exactly_the_causal_steps():
    """What "flash" relies on to use flash_attn_with_kvcache: found for decode and equal causal
    chunks after a cache, not for trees, earlier anchors or ragged chunks."""
    decode = ForwardBatch.causal([[4], [5], [6]], [7, 0, 3])
    assert causal_key_lens(decode).tolist() == [8, 1, 4]
    chunks = ForwardBatch.causal([[1, 2, 3], [4, 5, 6]], [5, 2])
    assert causal_key_lens(chunks).tolist() == [8, 5]
    assert causal_key_lens(ForwardBatch.causal([[1, 2, 3], [4]], [5, 2])) is None  # ragged: padding rows
    tree = TokenTree.from_paths([(5, [1, 2]), (5, [1, 3])])
    assert causal_key_lens(ForwardBatch.from_trees([tree], [5])) is None
    assert causal_key_lens(ForwardBatch.from_trees([TokenTree.chain([1, 2], 3)], [5])) is None  # anchor 3 < 5
