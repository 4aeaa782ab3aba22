"""The OPD loop: 2N steps == N steps, stop, resume, N more (bit for bit); bad data lines are skipped."""

from __future__ import annotations

import json

import pytest
import torch

from specd.cli import main
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import load_model, save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.train.opd import FileSource, open_source, parse_line, train_opd
from specd.train.specopd import SpecOPDConfig

VOCAB = FLAVOURS["debug"].vocab_size


def make_target():
    torch.manual_seed(2)
    return Qwen3ForCausalLM(FLAVOURS["debug"]).eval()


def make_drafter(seed: int = 4) -> D3DModel:
    torch.manual_seed(seed)
    return D3DModel(D3D_FLAVOURS["debug"])


def write_data(path, num: int = 5, bad: bool = False):
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(num):
        prompt = torch.randint(7, VOCAB, (3 + i,), generator=generator).tolist()
        response = torch.randint(7, VOCAB, (10 + 2 * i,), generator=generator).tolist()
        lines.append(json.dumps({"prompt_ids": prompt, "response_ids": response}) if i % 2 else
                     json.dumps({"prompt_len": len(prompt), "ids": prompt + response}))
    if bad:
        lines[1:1] = ["{not json", json.dumps({"prompt": "text", "response": "no tokenizer"}),
                      json.dumps({"prompt_ids": [1, "x"], "response_ids": [2]}), json.dumps([1, 2]),
                      json.dumps({"prompt_ids": [9, 10], "response_ids": [VOCAB + 5, 11]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(method: str, data_path, out, steps: int, drafter_seed: int = 4):
    target, drafter = make_target(), make_drafter(drafter_seed)
    config = SpecOPDConfig(block_size=4, anchors_per_seq=3, branches_per_anchor=2, lr=3e-3, loss="e2e-tv",
                           seed=7, rollout_tokens=8)
    result = train_opd(target, drafter, FileSource(data_path), method=method, config=config, out=out, steps=steps,
                       batch_size=2, checkpoint_every=2, progress=False)
    return result, drafter


@pytest.mark.parametrize("method", ["specopd", "offline", "sequential"])
def test_resumed_training_equals_uninterrupted_training(method, tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    whole, whole_drafter = run(method, data, tmp_path / "whole", 6)
    first, _ = run(method, data, tmp_path / "split", 3)
    # A fresh process would build a drafter from other weights: the checkpoint must overwrite them.
    resumed, resumed_drafter = run(method, data, tmp_path / "split", 6, drafter_seed=99)
    assert first.losses == resumed.losses[:3] and len(resumed.losses) == 6
    assert whole.losses == resumed.losses, (whole.losses, resumed.losses)
    assert whole.num_supervised_tokens == resumed.num_supervised_tokens > 0
    for (name, a), b in zip(whole_drafter.state_dict().items(), resumed_drafter.state_dict().values()):
        assert torch.equal(a, b), name


def test_bad_lines_are_skipped_counted_and_training_goes_on(tmp_path, caplog):
    data = write_data(tmp_path / "data.jsonl", num=4, bad=True)
    result, _ = run("specopd", data, tmp_path / "out", 4)
    assert result.steps == 4 and all(loss == loss for loss in result.losses)  # no nan: every step trained
    assert result.skipped["invalid_json"] >= 1 and result.skipped["text_without_tokenizer"] >= 1
    assert result.skipped["not_token_ids"] >= 1 and result.skipped["unknown_format"] >= 1
    assert result.skipped["out_of_vocabulary"] >= 1  # parsed, then screened by the trainer
    assert "invalid_json" in caplog.text


def test_parse_formats_and_sources(tmp_path):
    assert parse_line(json.dumps({"prompt_len": 2, "ids": [5, 6, 7]})).response == [7]
    assert parse_line(json.dumps({"prompt_len": 9, "ids": [5, 6, 7]})) == "bad_prompt_len"
    with pytest.raises(ValueError, match="run the trainer service"):
        open_source("redis://localhost:6379/trajectories")
    (tmp_path / "bad.jsonl").write_text("{\n[]\n")
    with pytest.raises(ValueError, match="no usable trajectory"):
        FileSource(tmp_path / "bad.jsonl").next_batch(1)


def test_cli_train_opd_saves_a_drafter_that_loads(tmp_path, capsys):
    save_model(make_target(), tmp_path / "target")
    save_model(make_drafter(), tmp_path / "drafter")
    data = write_data(tmp_path / "data.jsonl")
    argv = ["train", "opd", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "2", "--eval-every", "1",
            "--eval-data", str(data), "--block-size", "4", "--batch-size", "2", "--anchors", "2", "--branches", "2"]
    assert main(argv) == 0
    trained = load_model(tmp_path / "out")
    assert isinstance(trained, D3DModel)
    summary = json.loads((tmp_path / "out" / "training.json").read_text())
    assert summary["steps"] == 2 and len(summary["evaluations"]) == 2
    assert main([*argv[:7], "redis://localhost/stream", *argv[8:]]) == 2
    assert "run the trainer service" in capsys.readouterr().err
