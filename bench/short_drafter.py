"""The zoo's SmolLM2 D3D drafter recipe (`specd.zoo.SMOLLM2_DRAFTER`, `SMOLLM2_DRAFTER_TRAINING`) at
fewer training steps, into a directory of its own: a drafter of the zoo's shapes and data for
measuring costs where the zoo's 1800 steps do not fit (`bench/draft_rpc.py`, `specd bench serve
--drafter DIR`). Acceptance of such a drafter is not the zoo drafter's.

    .venv/bin/python bench/short_drafter.py --steps 400 --out out/d3d-smollm2-400

It builds the zoo's ``smollm2-135m`` and its answers first if they are missing.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from specd import zoo
from specd.data.tokenizer import load_tokenizer
from specd.models.loading import load_model
from specd.train.drafter import read_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps (the zoo's: 1800)")
    parser.add_argument("--out", required=True, help="directory to write the drafter to")
    args = parser.parse_args()
    zoo.build(only=f"responses-{zoo.SMOLLM2}")
    training = replace(zoo.SMOLLM2_DRAFTER_TRAINING, steps=args.steps)
    torch.manual_seed(training.seed)
    target_dir = zoo.model_path(zoo.SMOLLM2)
    target = load_model(target_dir)
    sequences, prompt_lens = read_sequences(zoo.zoo_dir() / f"responses-{zoo.SMOLLM2}" / "sequences.jsonl")
    model = zoo.new_shared_drafter(target, load_tokenizer(target_dir), zoo.SMOLLM2_DRAFTER, sequences, prompt_lens)
    zoo._train_into(Path(args.out), f"d3d-{zoo.SMOLLM2}-{args.steps}", model, target, sequences, prompt_lens, training,
                    pad_id=target.config.stop_token_ids[0], tokenizer_from=target_dir, split=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
