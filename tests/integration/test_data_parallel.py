"""Data-parallel SpecOPD (FSDP2, gloo, real processes): W ranks train exactly like one rank.

Three jobs of the launcher's code, spawned as separate processes on the CPU:

- W=1: the gradient of a first batch, then `main` (the CLI) for STEPS steps;
- W=2: the same gradient (and two wrong variants of it), then STEPS_AT_2 steps, checkpointed;
- W=1: `main` again on W=2's output directory: it resumes the 2-rank DCP checkpoint, goes on to
  STEPS, and must end where the uninterrupted 1-rank run ended.

The data (7 trajectories, batches of 4) has an out-of-vocabulary trajectory at items 1 and 3, so
at W=2 rank 1 has nothing usable on the first step and rank 0 nothing on the third (their dummy
passes keep FSDP's collectives in step), and a short response at item 5 with fewer anchors, so
on the second step the ranks hold different numbers of branches (the gradient check's batch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spawned import run_spawned

from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.ports import free_port
from specd.train import data_parallel
from specd.train.data_parallel import DataParallelSpecOPD

VOCAB = 256
STEPS, STEPS_AT_2, BATCH = 6, 4, 4
TIMEOUT_SECONDS = 150


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data_parallel")
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(dataclasses.replace(FLAVOURS["debug"], vocab_size=VOCAB, tie_word_embeddings=False,
                                                  eos_token_id=2))
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # peaked p, so a wrong context or weight shows in the loss
    save_model(target.eval(), root / "target")
    torch.manual_seed(1)
    save_model(D3DModel(dataclasses.replace(D3D_FLAVOURS["debug"], vocab_size=VOCAB)).eval(), root / "drafter")
    generator = torch.Generator().manual_seed(3)
    lines = []
    for i in range(7):
        prompt = torch.randint(7, VOCAB, (3 + i,), generator=generator).tolist()
        response = torch.randint(7, VOCAB, (2 if i == 5 else 10 + 2 * i,), generator=generator).tolist()
        if i in (1, 3):
            response[-1] = VOCAB + 5  # out of the vocabulary: skipped by the trainer's screen
        lines.append(json.dumps({"prompt_ids": prompt, "response_ids": response}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


def argv(root: Path, out: str, steps: int) -> list[str]:
    return ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--data", str(root / "data.jsonl"),
            "--out", str(root / out), "--steps", str(steps), "--batch-size", str(BATCH), "--checkpoint-every", "1",
            "--block-size", "4", "--anchors", "3", "--branches", "3", "--lr", "3e-3", "--seed", "7",
            "--grad-clip", "0.02"]  # below the gradient norms here (~0.08): the clip acts


# ---------------------------------------------------------------------------- what each rank runs
def full_gradients(trainer: DataParallelSpecOPD, batch) -> dict[str, torch.Tensor]:
    """The gradient of ``batch`` summed over ranks, unsharded, and its global norm as clipping sees it."""
    trainer.backward(batch)
    grads = {name: p.grad.full_tensor().clone() for name, p in trainer.drafter.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(trainer.drafter.parameters(), float("inf"))
    grads["<norm>"] = norm.full_tensor().reshape(1)
    return grads


def gradient_variants(args, ranks) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name in ("summed", "averaged", "local_mean"):
        trainer, source = data_parallel.build_trainer(args, ranks, sum_gradients=name != "averaged")
        if name == "local_mean":  # each rank's own mean: a mean of means, wrong when counts differ
            trainer.local_loss = lambda sup, local, _, t=trainer: DataParallelSpecOPD.local_loss(t, sup, local, local)
        source.next_batch(BATCH)  # the first batch leaves rank 1 idle at W=2: take the second
        out[name] = full_gradients(trainer, source.next_batch(BATCH))
    return out


def worker(rank: int, world_size: int, port: int, job: str, root: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = data_parallel.init_distributed("cpu")  # gloo even where there is a GPU: two ranks, one device
    if job == "resume":  # the CLI on a copy of the 2-rank run's directory: resumes its checkpoint
        data_parallel.main(argv(root, "resumed", STEPS))
        return
    args = data_parallel.parse_args(argv(root, "one" if world_size == 1 else "two", STEPS))
    grads = gradient_variants(args, ranks)
    if rank == 0:
        torch.save(grads, root / f"grads{world_size}.pt")
    if world_size == 2:  # the CLI: STEPS_AT_2 steps, checkpointed and exported
        data_parallel.main(argv(root, "two", STEPS_AT_2))
        return
    # One rank, uninterrupted: export after STEPS_AT_2 steps, then go on in memory to STEPS.
    trainer, source = data_parallel.build_trainer(args, ranks)
    curve = data_parallel.train(trainer, source, out=root / "one_early" / "work", steps=STEPS_AT_2, batch_size=BATCH)
    data_parallel.export_drafter(trainer.drafter, root / "one_early", ranks)
    curve += data_parallel.train(trainer, source, out=root / "one" / "work", steps=STEPS, batch_size=BATCH)
    data_parallel.export_drafter(trainer.drafter, root / "one", ranks)
    (root / "one" / "training.json").write_text(json.dumps({"losses": curve}))


def run_ranks(world_size: int, job: str, root: Path) -> float:
    return run_spawned(worker, (world_size, free_port(), job, root), world_size, TIMEOUT_SECONDS,
                       f"{job} at {world_size} ranks")


# ---------------------------------------------------------------------------- the properties
@pytest.fixture(scope="module")
def runs(workdir):
    seconds = {"1 rank": run_ranks(1, "train", workdir), "2 ranks": run_ranks(2, "train", workdir)}
    shutil.copytree(workdir / "two" / "work", workdir / "resumed" / "work")
    seconds["resume at 1 rank"] = run_ranks(1, "resume", workdir)
    print("wall seconds:", {k: round(v, 1) for k, v in seconds.items()})
    return workdir


def losses(directory: Path) -> list[float]:
    return json.loads((directory / "training.json").read_text())["losses"]


def max_relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


# Adam steps by m / (sqrt(v) + eps): an embedding row seen once has a near-zero gradient whose
# float noise (packing differs between W=1 and W=2) moves it by ~1e-6; a wrong step moves weights
# by ~lr = 3e-3.
WEIGHT_TOLERANCE = 5e-5


def max_weight_difference(a: Path, b: Path) -> float:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys()
    return max(float((left[k] - right[k]).abs().max()) for k in left)


def test_two_ranks_give_the_one_rank_loss_curve(runs):
    one, two = losses(runs / "one")[:STEPS_AT_2], losses(runs / "two")
    difference = max_weight_difference(runs / "one_early", runs / "two")
    moved = max_weight_difference(runs / "drafter", runs / "two")
    print(f"1 rank : {one}\n2 ranks: {two}\nmax relative loss difference {max_relative(one, two):.2e}; "
          f"weights after {STEPS_AT_2} steps: max |diff| {difference:.2e} (moved {moved:.2e} from the start)")
    assert max_relative(one, two) < 1e-5
    assert difference < WEIGHT_TOLERANCE and moved > 1e-3
    assert len(set(one)) == len(one)  # the loss moves: the curve says something


def test_two_rank_checkpoint_resumes_at_one_rank_exactly(runs):
    one, resumed = losses(runs / "one"), losses(runs / "resumed")
    difference = max_weight_difference(runs / "one", runs / "resumed")
    print(f"uninterrupted 1 rank: {one}\n2 ranks then 1 rank : {resumed}\n"
          f"max relative loss difference {max_relative(one, resumed):.2e}; final weights max |diff| {difference:.2e}")
    assert json.loads((runs / "resumed" / "training.json").read_text())["world_size"] == 1
    assert max_relative(one, resumed) < 1e-5
    assert difference < WEIGHT_TOLERANCE
    assert (runs / "resumed" / "model.safetensors").is_file() and (runs / "resumed" / "config.json").is_file()


def test_gradients_are_the_one_rank_gradients_and_wrong_scalings_are_not(runs):
    one, two = torch.load(runs / "grads1.pt"), torch.load(runs / "grads2.pt")

    def worst(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in b)

    figures = {name: worst(two[name], one["summed"]) for name in ("summed", "averaged", "local_mean")}
    print("max relative gradient difference from 1 rank:", {k: f"{v:.2e}" for k, v in figures.items()},
          f"global norm 1 rank {float(one['summed']['<norm>']):.5f}, 2 ranks {float(two['summed']['<norm>']):.5f}")
    assert figures["summed"] < 1e-5  # includes the global norm that clipping uses
    assert figures["averaged"] > 0.4  # FSDP's default mean over ranks: half the gradient
    assert figures["local_mean"] > 1e-2  # a mean of per-rank means
    # At one rank, every variant is the same computation.
    assert max(worst(one[name], one["summed"]) for name in ("averaged", "local_mean")) < 1e-6


def test_bad_arguments_are_refused_with_the_reason(workdir, capsys):
    for change, reason in (({"--steps": "0"}, "--steps must be >= 1"),
                           ({"--target": str(workdir / "nothing")}, "is not a model directory"),
                           ({"--data": str(workdir / "nothing.jsonl")}, "is not a file")):
        args = argv(workdir, "unused", STEPS)
        for flag, value in change.items():
            args[args.index(flag) + 1] = value
        with pytest.raises(SystemExit):
            data_parallel.parse_args(args)
        assert reason in capsys.readouterr().err
