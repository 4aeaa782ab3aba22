"""Bad input gets one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specd.cli import main
from specd.models.loading import save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("debug-model")
    torch.manual_seed(0)
    save_model(Qwen3ForCausalLM(FLAVOURS["debug"]), directory)
    return directory


def run(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generate_prompt_ids_json(model_dir, capsys):
    status, out, _ = run(["generate", "--model", str(model_dir), "--prompt-ids", "1,2,3", "--max-tokens", "5", "--json"], capsys)
    result = json.loads(out)
    assert status == 0 and len(result["token_ids"]) == 5 and result["text"] is None
    assert all(0 <= t < FLAVOURS["debug"].vocab_size for t in result["token_ids"])


def test_sampling_is_seeded(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", "4,5", "--max-tokens", "12",
            "--temperature", "1.0", "--top-p", "0.9", "--top-k", "50", "--seed", "7", "--json"]
    first = json.loads(run(argv, capsys)[1])["token_ids"]
    second = json.loads(run(argv, capsys)[1])["token_ids"]
    other = json.loads(run(argv[:-2] + ["8", "--json"], capsys)[1])["token_ids"]
    assert first == second and first != other


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
        (["--prompt-ids", "-1"], "outside the vocabulary"),
        (["--prompt-ids", ""], "prompt is empty"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt", "hello"], "no tokenizer.json"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1", "--lookup"], "--lookup puts prompt lookup beside a drafter model"),
        (["--prompt-ids", "1", "--drafter", "ngram", "--lookup"], "give --drafter DIR"),
    ],
)
def test_bad_generate_input(model_dir, capsys, argv_tail, message):
    status, _, err = run(["generate", "--model", str(model_dir), *argv_tail], capsys)
    assert status == 2 and message in err and "Traceback" not in err


def test_missing_model_directory(tmp_path, capsys):
    status, _, err = run(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"], capsys)
    assert status == 2 and "does not exist" in err


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    status, _, err = run(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys)
    assert status == 2 and "unsupported architecture" in err and "gpt2" in err


def test_console_script_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "does not exist" in proc.stderr


@pytest.mark.parametrize("flag, value, message", [("--domains", "code,poetry", "unknown --domains poetry"),
                                                  ("--methods", "ar,magic", "unknown --methods magic")])
def test_bench_decode_refuses_an_unknown_domain_or_method(capsys, flag, value, message):
    status, _, err = run(["bench", "decode", flag, value, "--out", "/nonexistent"], capsys)
    assert status == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--target", "qwen3-tiny"], "not 'qwen3-tiny'"),
    (["--lrs", "fast"], "--lrs"),
    (["--layers", "0-x"], "--layers"),
    (["--train-share", "1.5"], "--train-share"),
    (["--drafters", "d3d,medusa"], "--drafters"),
    (["--answers-per-domain", "3"], "--answers-per-domain"),
])
def test_bench_recipe_refuses_what_it_cannot_train(capsys, args, message):
    """Refused before anything is built or trained, with what to pass instead."""
    status, _, err = run(["bench", "recipe", *args, "--out", "/nonexistent"], capsys)
    assert status == 2 and message in err and "Traceback" not in err
