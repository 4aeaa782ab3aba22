"""`specd bench recipe`: which training recipe drafts furthest, before a 20-minute drafter build.

A SmolLM2 drafter build trains ~20 minutes on two cores, and the engine's τ needs one built;
this bench asks the cheaper question first, same run: at a short budget, how far does the zoo's
recipe draft with each learning rate (and start from which of the target's layers), and how does
D3D compare with the DFlash-style drafter (which reads the target's hidden states) given the same
answers, recipe and steps?

The target's own responses (the zoo step ``responses-<target>``) are split by index: every 10th
is held out, the rest are trained on. Each variant is the zoo recipe (`zoo.SMOLLM2_DRAFTER`,
`zoo.SMOLLM2_DRAFTER_TRAINING`) with ``--steps`` and its own learning rate or first layers, from
the same seed. It is then scored on the held-out responses that were generated greedily (3 in 4:
`generate_responses`), at ``--anchors`` random anchors per response, by
`specd.train.drafter.block_acceptance`: greedy acceptance per position of a block of ``--block``
against the target's own greedy continuation, and τ = 1 + their sum. These answers were
generated under bf16 autocast where the CPU computes bf16, so the figure is a proxy for the
engine's (fp32 target) τ, good for ranking recipes; `specd bench decode --fixed-block` measures
the real one. The DFlash-style drafter is scored as it serves: the target's (fp32) hidden states
of the context but its last token, and the whole block from the group that token leads.

``--answers-per-domain N`` trains on N answers per domain (the zoo's answer recipe with N prompts a
domain, built once as the zoo step ``responses-<target>-<N>``) instead of the zoo's 1024: a
comparison within a smaller budget, where generating the zoo's answers takes over an hour on an
AVX2 host.

    specd bench recipe [--target smollm2-135m] [--drafters d3d,dflash] [--lrs 5e-4,2e-3,4e-3]
                       [--layers 0-1-2-3,0-1-28-29] [--train-share S] [--answers-per-domain N]
                       [--steps 600] [--block 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure  # object API: no pyplot state, no display backend

from specd import zoo
from specd.data import load_tokenizer
from specd.models.loading import load_model
from specd.train import workers as train_workers
from specd.train.drafter import block_acceptance, read_sequences, train_drafter

HELD_OUT_EVERY = 10  # response i is held out when i % 10 == 9


DRAFTERS = ("d3d", "dflash")


@dataclass(kw_only=True, slots=True)
class RecipeRow:
    lr: float
    layers_from: list[int]
    steps: int
    block: int
    tau: float
    """1 + the mean greedy accepted length of a fixed block (held-out responses)."""
    accept_per_pos: list[float]
    """P(positions 1..i all accepted)."""
    blocks: int
    """Blocks scored."""
    denoise_loss: float
    """Smoothed training denoising loss at the end."""
    train_seconds: float
    train_share: float = 1.0
    """Share of the non-held-out answers trained on."""
    drafter: str = "d3d"
    """``d3d``, or ``dflash``: the same recipe reading the target's hidden states."""
    answers: int = 0
    """Answers trained on."""
    threads: int = field(default_factory=torch.get_num_threads)


def split(num: int) -> tuple[list[int], list[int]]:
    """(trained, held out) response indices; held out: greedy ones only (index % 4 != 0)."""
    held = [i for i in range(num) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    trained = [i for i in range(num) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return trained, [i for i in held if i % 4]


def random_anchors(sequences: list[list[int]], prompt_lens: list[int], block: int, per_seq: int,
                   seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(sequences, anchors): ``per_seq`` anchors drawn in each response, of which those with a
    whole block after them are kept; a sequence left with none is left out."""
    rng = np.random.default_rng(seed)
    kept, anchors = [], []
    for seq, prompt_len in zip(sequences, prompt_lens):
        drawn = rng.integers(prompt_len, max(prompt_len + 1, len(seq) - block), size=per_seq)
        fitting = sorted(int(a) for a in drawn if a + block <= len(seq))
        if fitting:
            kept.append(seq)
            anchors.append(fitting)
    return kept, anchors


def run_variant(target, tokenizer, sequences, prompt_lens, *, lr: float, layers_from: list[int], steps: int,
                block: int, anchors_per_seq: int, work: Path, train_share: float = 1.0,
                drafter: str = "d3d") -> RecipeRow:
    spec = {**zoo.SMOLLM2_DRAFTER, "num_hidden_layers": len(layers_from), "layers_from": layers_from}
    training = replace(zoo.SMOLLM2_DRAFTER_TRAINING, steps=steps, lr=lr)
    reads_target = drafter == "dflash"
    trained, held = split(len(sequences))
    trained = trained[: max(1, round(len(trained) * train_share))]  # the held-out set does not change
    train_seqs, train_lens = [sequences[i] for i in trained], [prompt_lens[i] for i in trained]
    torch.manual_seed(training.seed)
    model = zoo.new_shared_drafter(target, tokenizer, spec, train_seqs, train_lens, reads_target=reads_target)
    start = time.perf_counter()
    stats = train_drafter(model, train_seqs, train_lens, training, work, target=target,
                          pad_id=target.config.stop_token_ids[0], workers=train_workers.default_workers(split=False),
                          description=f"{drafter} lr {lr:g} layers {layers_from}")
    seconds = time.perf_counter() - start
    held_seqs, anchors = random_anchors([sequences[i] for i in held], [prompt_lens[i] for i in held], block,
                                        anchors_per_seq, seed=1)
    counts, blocks = block_acceptance(model, held_seqs, anchors, block, bf16=training.bf16,
                                      target=target if reads_target else None)
    accept = (counts.double() / max(blocks, 1)).tolist()
    return RecipeRow(lr=lr, layers_from=layers_from, steps=steps, block=block, tau=1 + sum(accept),
                     accept_per_pos=accept, blocks=blocks, denoise_loss=stats["denoise_loss"], train_seconds=seconds,
                     train_share=train_share, drafter=drafter, answers=len(train_seqs))


def format_table(rows: list[RecipeRow]) -> str:
    lines = ["| drafter | lr | layers from | steps | answers | τ (block %d) | acceptance at positions 1-4 "
             "| vs first row | train s |" % rows[0].block, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        accept = " ".join(f"{a:.3f}" for a in row.accept_per_pos[:4])
        lines.append(f"| {row.drafter} | {row.lr:g} | {'-'.join(map(str, row.layers_from))} | {row.steps} "
                     f"| {row.answers} ({row.train_share:.0%}) "
                     f"| {row.tau:.3f} | {accept} "
                     f"| {row.tau / rows[0].tau:.3f}x | {row.train_seconds:.0f} |")
    return "\n".join(lines)


def plot(rows: list[RecipeRow], path: Path) -> None:
    """Acceptance per block position, one line per variant."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for row in rows:
        ax.plot(range(1, row.block + 1), row.accept_per_pos, marker="o",
                label=f"{row.drafter}, lr {row.lr:g}, layers {'-'.join(map(str, row.layers_from))}: τ {row.tau:.2f}")
    ax.set_xlabel("block position")
    ax.set_ylabel("P(accepted through this position)")
    ax.set_title(f"held-out greedy acceptance, {rows[0].steps} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=zoo.SMOLLM2, help="zoo target with shared-layer drafters (smollm2-135m)")
    parser.add_argument("--drafters", default="d3d",
                        help="comma-separated drafters to train on the same answers: d3d, "
                             "dflash (reads the target's hidden states)")
    parser.add_argument("--lrs", default="5e-4,2e-3,4e-3", help="comma-separated peak learning rates")
    parser.add_argument("--layers", default="0-1-2-3",
                        help="comma-separated target layers to start from, each as i-j-k-l (e.g. 0-1-2-3,0-1-28-29)")
    parser.add_argument("--steps", type=int, default=600, help="training steps per variant")
    parser.add_argument("--block", type=int, default=16, help="fixed block scored")
    parser.add_argument("--anchors", type=int, default=8, help="anchors per held-out response")
    parser.add_argument("--train-share", type=float, default=1.0,
                        help="train on this share of the non-held-out answers (how much more data would help)")
    parser.add_argument("--answers-per-domain", type=int,
                        help="generate this many answers per domain for this bench (cached) instead of the zoo's 1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="out/bench", help="directory for the JSON and the work directories")
    parser.add_argument("--json", help="JSON path (default OUT/recipe.json; the plot beside it as .png)")


def answers(target: str, per_domain: int | None) -> tuple[list[list[int]], list[int]]:
    """The target's answers to train and score on: the zoo's (``per_domain`` None), or its recipe
    with ``per_domain`` prompts a domain (`zoo.responses_step`, built once and stamped like the zoo's)."""
    if per_domain is None:
        zoo.build(only=f"responses-{target}")
        directory = zoo.zoo_dir() / f"responses-{target}"
    else:
        directory = zoo.build_step(zoo.responses_step(target, {**zoo.SMOLLM2_RESPONSES, "per_domain": per_domain}))
    return read_sequences(directory / "sequences.jsonl")


def run(args: argparse.Namespace) -> int:
    if args.target != zoo.SMOLLM2:
        raise ValueError(f"bench recipe trains the shared-layer drafter recipe of {zoo.SMOLLM2}, not {args.target!r}")
    try:
        lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        raise ValueError(f"--lrs takes comma-separated learning rates such as 5e-4,2e-3, not {args.lrs!r}") from None
    try:
        layer_sets = [[int(i) for i in item.split("-")] for item in args.layers.split(",")]
    except ValueError:
        raise ValueError(f"--layers takes comma-separated target layer lists such as 0-1-2-3,0-1-28-29, "
                         f"not {args.layers!r}") from None
    if not 0 < args.train_share <= 1:
        raise ValueError(f"--train-share is a share of the answers in (0, 1], not {args.train_share}")
    drafters = args.drafters.split(",")
    if not drafters or any(d not in DRAFTERS for d in drafters):
        raise ValueError(f"--drafters takes a comma-separated list of {', '.join(DRAFTERS)}, not {args.drafters!r}")
    if args.answers_per_domain is not None and args.answers_per_domain < HELD_OUT_EVERY:
        raise ValueError(f"--answers-per-domain must be at least {HELD_OUT_EVERY} (one in {HELD_OUT_EVERY} is held "
                         f"out), not {args.answers_per_domain}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    sequences, prompt_lens = answers(args.target, args.answers_per_domain)
    target = load_model(zoo.model_path(args.target))
    tokenizer = load_tokenizer(zoo.model_path(args.target))
    rows = []
    for drafter in drafters:
        for layers_from in layer_sets:
            for lr in lrs:
                name = (f"{drafter}-lr{lr:g}-layers{'-'.join(map(str, layers_from))}-steps{args.steps}"
                        f"-share{args.train_share:g}-answers{len(sequences)}")
                rows.append(run_variant(target, tokenizer, sequences, prompt_lens, lr=lr, layers_from=layers_from,
                                        steps=args.steps, block=args.block, anchors_per_seq=args.anchors,
                                        work=out / "recipe-work" / name, train_share=args.train_share,
                                        drafter=drafter))
                print(format_table(rows), flush=True)
    path = Path(args.json) if args.json else out / "recipe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    path.write_text(json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
