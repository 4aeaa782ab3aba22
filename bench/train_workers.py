"""Seconds a training step takes in one process against two single-threaded ones (`specd.train.workers`).

Trains the zoo's drafter recipes for a few steps, alternating 1, 2, 1, 2 processes, and prints one
JSON row per run: ``d3d-qwen3-tiny`` on its zoo answers, and SmolLM2's D3D drafter
(`zoo.SMOLLM2_DRAFTER`, `zoo.SMOLLM2_DRAFTER_TRAINING`) on random token windows (a step's cost does
not depend on the tokens, so the answers step is not needed). In one process ``seconds`` is the
whole call; in two, ``loop_seconds`` is the steps alone and ``seconds`` adds the ranks' start-up.
`bench/results/train-workers-epyc-avx512.json` holds a run (fp32 with ``SPECD_CPU_BF16=0``).

    .venv/bin/python bench/train_workers.py [--model tiny|smollm2] [--steps N] [--json FILE]

It needs the zoo's ``qwen3-tiny`` and ``responses-qwen3-tiny`` (tiny) or ``smollm2-135m``. Run it
alone: it times steps on a machine whose cores it assumes are idle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from specd import zoo
from specd.data.tokenizer import load_tokenizer
from specd.models.d3d import D3DModel
from specd.models.loading import load_model
from specd.train.drafter import init_from_target, read_sequences, train_drafter


def _tiny(steps: int):
    target = load_model(zoo.model_path("qwen3-tiny"))
    sequences, prompt_lens = read_sequences(zoo.zoo_dir() / "responses-qwen3-tiny" / "sequences.jsonl")

    def drafter() -> D3DModel:
        model = D3DModel(zoo.drafter_config(target.config, reads_target=False))
        init_from_target(model, target)
        return model

    config = dataclasses.replace(zoo.DRAFTER_TRAINING, steps=steps, warmup_steps=2)
    return target, drafter, sequences, prompt_lens, config, zoo.SPECIAL_TOKENS.index(zoo.PAD)


def _smollm2(steps: int):
    target_dir = zoo.model_path(zoo.SMOLLM2)
    target = load_model(target_dir)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, target.config.vocab_size, (256,), generator=generator).tolist() for _ in range(512)]
    prompt_lens = [64] * len(sequences)
    tokenizer = load_tokenizer(target_dir)

    def drafter() -> D3DModel:
        return zoo.new_shared_drafter(target, tokenizer, zoo.SMOLLM2_DRAFTER, sequences, prompt_lens)

    config = dataclasses.replace(zoo.SMOLLM2_DRAFTER_TRAINING, steps=steps, warmup_steps=2)
    return target, drafter, sequences, prompt_lens, config, target.config.stop_token_ids[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 30 tiny, 12 smollm2)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    steps = args.steps or (30 if args.model == "tiny" else 12)
    target, drafter, sequences, prompt_lens, config, pad_id = (_tiny if args.model == "tiny" else _smollm2)(steps)
    rows = []
    for workers in (1, 2, 1, 2):
        with tempfile.TemporaryDirectory() as work:
            stats = train_drafter(drafter(), sequences, prompt_lens, config, Path(work), target=target, pad_id=pad_id,
                                  description=f"{args.model} x{workers}", workers=workers)
        loop = stats.get("loop_seconds")
        row = {"workers": workers, "steps": steps, "loop_seconds": loop, "seconds": stats["seconds"],
               "seconds_per_step": round((loop if loop is not None else stats["seconds"]) / steps, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":  # the ranks are spawned: they import this module
    main()
