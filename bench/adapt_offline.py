"""How fast does the SmolLM2 drafter that never saw code learn code, offline, and what does it forget?

Starts from the zoo's `d3d-smollm2-135m-unseen-code` and trains on the first N code answers of
`responses-smollm2-135m` (the target's own answers; every 10th is held out), either by the zoo's
supervised denoising recipe (``sft``) or by SpecOPD with a local target (``e2e-tv`` or ``kl``,
batches of 4 drawn with replacement). Before and after, greedy acceptance of blocks of 4 on 48
held-out greedy code answers and 48 dialogue answers (8 anchors each,
`specd.train.drafter.block_acceptance`): τ = 1 + the sum, per position.

It answers what `specd bench online` cannot in one run: how many distinct new-domain traces a
given gain needs, and how much the old domains lose meanwhile.

    .venv/bin/python bench/adapt_offline.py MODE STEPS LR [N_ANSWERS]
    e.g. bench/adapt_offline.py sft 200 1e-3 800
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specd import zoo
from specd.bench.recipe import random_anchors
from specd.models.loading import load_model
from specd.train.drafter import block_acceptance, read_sequences, train_drafter
from specd.train.specopd import LocalScorer, SpecOPDConfig, SpecOPDTrainer, Trajectory

BLOCK = 4


def main(mode: str, steps: int, lr: float, answers: int = 200) -> None:
    torch.set_num_threads(2)
    sequences, prompt_lens = read_sequences(zoo.zoo_dir() / "responses-smollm2-135m" / "sequences.jsonl")
    domains = zoo.response_domains("smollm2-135m", sequences, prompt_lens)
    code = [i for i, d in enumerate(domains) if d == "code"]
    dialogue = [i for i, d in enumerate(domains) if d == "dialogue"]
    held_code = [i for i in code if i % 10 == 9 and i % 4][:48]  # greedy answers (3 in 4), held out
    held_dialogue = [i for i in dialogue if i % 10 == 9 and i % 4][:48]
    train = [i for i in code if i % 10 != 9][:answers]
    drafter = load_model(zoo.ensure(zoo.UNSEEN_DRAFTER))

    def tau(model, indices):
        kept, anchors = random_anchors([sequences[i] for i in indices], [prompt_lens[i] for i in indices], BLOCK, 8,
                                       seed=1)
        counts, blocks = block_acceptance(model, kept, anchors, BLOCK, bf16=True)
        return round(1 + counts.sum().item() / blocks, 4), [round(c / blocks, 3) for c in counts.tolist()]

    start = time.perf_counter()
    print("start: code", tau(drafter, held_code), "dialogue", tau(drafter, held_dialogue), flush=True)
    if mode == "sft":
        config = replace(zoo.SMOLLM2_DRAFTER_TRAINING, steps=steps, lr=lr, warmup_steps=10)
        work = Path("out/adapt-offline")
        pad_id = load_model(zoo.model_path("smollm2-135m")).config.stop_token_ids[0]  # as the zoo's build pads
        train_drafter(drafter, [sequences[i] for i in train], [prompt_lens[i] for i in train], config, work,
                      pad_id=pad_id, workers=1)
    elif mode in ("e2e-tv", "kl"):
        target = load_model(zoo.model_path("smollm2-135m"))
        trainer = SpecOPDTrainer(LocalScorer(target), drafter, SpecOPDConfig(block_size=BLOCK, lr=lr, loss=mode))
        trajectories = [Trajectory(prompt=sequences[i][: prompt_lens[i]], response=sequences[i][prompt_lens[i]:])
                        for i in train]
        generator = torch.Generator().manual_seed(0)
        for step in range(steps):
            batch = [trajectories[int(j)] for j in torch.randint(len(trajectories), (4,), generator=generator)]
            result = trainer.step(batch)
            if step % 10 == 0:
                print(f"step {step}: loss {result.loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
        drafter = trainer.drafter
    else:
        raise SystemExit(f"MODE is sft, e2e-tv or kl, not {mode!r}")
    drafter.eval()
    print(f"{mode}, {steps} steps at lr {lr:g} on {len(train)} code answers: code", tau(drafter, held_code),
          "dialogue", tau(drafter, held_dialogue), f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
