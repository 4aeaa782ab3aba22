"""The tiny zoo: built once (cached), good enough that acceptance figures mean something."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import transformers

from specd import zoo
from specd.batch import ForwardBatch
from specd.data import DOMAINS
from specd.models.loading import load_model

pytestmark = pytest.mark.zoo


@pytest.fixture(scope="module")
def target_dir():
    zoo.build()
    return zoo.model_path("qwen3-tiny")


def test_second_build_is_a_no_op(target_dir):
    start = time.perf_counter()
    assert zoo.build() == []
    assert time.perf_counter() - start < 10


def test_zoo_list_json(target_dir):
    proc = subprocess.run([sys.executable, "-m", "specd.cli", "zoo", "list", "--json"], capture_output=True, text=True, check=True)
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["qwen3-tiny"]["built"] and rows["qwen3-tiny"]["kind"] == "target"
    assert rows["qwen3-tiny"]["path"] == str(target_dir)


def test_heldout_prompt_sets(target_dir):
    for domain in DOMAINS:
        assert len(zoo.heldout()[domain]) >= 50


def test_target_beats_unigram_and_does_not_degenerate(target_dir):
    rows = json.loads((target_dir / "quality.json").read_text())
    assert {r["domain"] for r in rows} == set(DOMAINS)
    for row in rows:
        # A wide margin: at most 60% of the unigram cross-entropy on held-out text.
        assert row["model_loss"] < 0.6 * row["unigram_loss"], row
        # Loops show up as ~10-20 distinct tokens in 96; sampled text is far more varied.
        assert row["distinct_greedy"] >= 25, row
        assert row["distinct_sampled"] >= 40, row


def test_transformers_loads_the_zoo_target_with_the_same_logits(target_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    ours = load_model(target_dir)
    ids = tokenizer("def read_config(path):\n    with open(path) as f:")["input_ids"]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        got = ours(ForwardBatch.causal([ids]))[0]
    assert (got - expected).abs().max().item() < 1e-4


def test_generate_text_from_the_zoo_target(target_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "generate", "--model", str(target_dir), "--chat",
         "--prompt", "What does the `zip` function do?", "--max-tokens", "32", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(proc.stdout)
    assert result["text"] and 1 <= len(result["token_ids"]) <= 32


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "sparse-tiny"])
def test_hybrid_targets_beat_unigram_and_generate(target_dir, name):
    """The linear-hybrid and sparse-linear targets train for far fewer steps than qwen3-tiny
    (see zoo.HYBRID_TRAINING): a looser margin, but clearly better than unigram."""
    directory = zoo.model_path(name)
    for row in json.loads((directory / "quality.json").read_text()):
        assert row["model_loss"] < 0.8 * row["unigram_loss"], row
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "generate", "--model", str(directory), "--chat",
         "--prompt", "What does the `zip` function do?", "--max-tokens", "24", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert 1 <= len(json.loads(proc.stdout)["token_ids"]) <= 24


def test_transformers_loads_the_qwen3_next_target_with_the_same_logits(target_dir):
    directory = zoo.model_path("qwen3-next-tiny")
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ours = load_model(directory)
    ids = tokenizer("def read_config(path):\n    with open(path) as f:")["input_ids"]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        got = ours(ForwardBatch.causal([ids]))[0]
    assert (got - expected).abs().max().item() < 1e-4
