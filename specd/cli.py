"""The ``specd`` command line.

    specd zoo build                    build the tiny zoo (cached; a second call takes seconds)
    specd zoo list [--json]            the zoo's models: name, kind, path, built
    specd zoo path NAME                a built zoo model's directory (for scripts)
    specd generate --model DIR ...     generation: plain, or speculative with --drafter DIR|ngram
    specd train drafter ...            offline D3D / DFlash-style drafter training
    specd train opd ...                on-policy distillation of a D3D drafter (SpecOPD / sequential / offline)
    specd prune --drafter DIR          acceptance-aware layer pruning of a D3D drafter
    specd bench decode [--quick]       speculative vs plain decoding, same run: table, JSON, plots
    specd bench trees [--quick]        one packed tree pass vs its paths one by one, per target kind
    specd bench opd [--quick]          SpecOPD vs sequential OPD vs offline distillation, same run
    specd bench serve [--quick]        end to end through the services: plain vs sync vs async D3D
    specd bench profile [--quick]      pass costs + acceptance as JSON for specd plan
    specd bench gpu [--device cpu --tiny]  CUDA paths checked + Qwen3-8B-shaped pass costs (bench/gpu.sh)
    specd bench tp [--quick]           a decode and a 16-token pass: tensor-parallel ranks vs one process
    specd plan --profile F --gpus N    drafter:verifier split + block length by simulation; Helm override
    specd up [--drafters N] ...        the services on this machine (Redis, trainer, drafters, verifiers)

`specd up`, `specd bench serve` and the calibration in `specd bench profile` come with the
services (`services/`, entry-point group ``specd.commands``: see `Command`); without them,
`specd bench profile` times the passes in this process only.

Errors a user can cause (a missing directory, an unsupported architecture, ids outside the
vocabulary, an empty prompt) print one line saying what was wrong and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import torch
from tokenizers import Tokenizer

from specd import precision, zoo
from specd.bench import gpu as bench_gpu
from specd.bench import opd as bench_opd
from specd.bench import profile as bench_profile
from specd.bench import recipe as bench_recipe
from specd.bench import tp as bench_tp
from specd.bench import trees as bench_trees
from specd.bench.decode import METHODS, DecodeSettings
from specd.bench.decode import main as bench_decode_main
from specd.data import DOMAINS, load_tokenizer
from specd.data.chat import ChatTemplate
from specd.drafters.d3d import D3DDrafter
from specd.drafters.dflash import DFlashDrafter
from specd.drafters.hybrid import LookupHybridDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, check_prompt
from specd.flags import add_flags, from_flags
from specd.models.d3d import D3DModel
from specd.models.gguf_convert import FetchError
from specd.models.loading import ModelLoadError, load_model, save_model
from specd.plan import planner
from specd.sampling import SamplingParams
from specd.train.drafter import (
    DrafterTrainConfig,
    generate_responses,
    init_from_target,
    read_sequences,
    save_drafter,
    train_drafter,
    training_prompts,
    write_sequences,
)
from specd.train.losses import LOSSES
from specd.train.opd import METHODS as OPD_METHODS
from specd.train.opd import OPDResult, mean_tau, open_source, parse_line, train_opd
from specd.train.prune import prune
from specd.train.specopd import SpecOPDConfig, Trajectory


class UsageError(ValueError):
    """Bad input from the command line; reported without a traceback."""


def _load_tokenizer(directory: Path) -> Tokenizer | None:
    """The model directory's tokenizer, or None (then only --prompt-ids works)."""
    path = directory / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def model_dir(name: str) -> Path:
    """A model directory given as a path, or by zoo name (``smollm2-135m``), building it if needed."""
    path = Path(name)
    if path.exists() or name not in {m.name for m in zoo.MODELS}:
        return path
    return zoo.ensure(name)


def cmd_generate(args: argparse.Namespace) -> int:
    directory = model_dir(args.model)
    model = load_model(directory, dtype=getattr(torch, args.dtype) if args.dtype else None)
    tokenizer = _load_tokenizer(directory)
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as err:
            raise UsageError(f"--prompt-ids must be comma-separated integers: {err}") from err
    else:
        if tokenizer is None:
            raise UsageError(f"{directory} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        text = args.prompt
        if args.chat:
            try:
                text = ChatTemplate.from_dir(directory).render([{"role": "user", "content": text}])
            except ValueError as err:
                raise UsageError(f"--prompt cannot be a chat turn: {err}") from err
        prompt = tokenizer.encode(text).ids
    check_prompt(prompt, model.config.vocab_size)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
        stop_token_ids=() if args.ignore_eos else model.config.stop_token_ids,
    )
    drafter = make_drafter(args.drafter, model, target_dir=directory)
    if args.lookup:
        if drafter is None or isinstance(drafter, NgramDrafter):
            raise UsageError("--lookup puts prompt lookup beside a drafter model: give --drafter DIR")
        drafter = LookupHybridDrafter(drafter)
    start = time.perf_counter()
    if drafter is None and args.drafter == "none":
        engine = SpeculativeEngine(model, None, EngineConfig(max_num_seqs=1, block_size=0))
    else:
        mode = args.mode or ("async" if drafter is not None and drafter.can_speculate else "sync")
        engine = SpeculativeEngine(model, drafter, EngineConfig(max_num_seqs=1, block_size=args.block_size, mode=mode))
    (generation,) = engine.generate([prompt], params)
    engine.close()
    seconds = time.perf_counter() - start
    stats = engine.stats
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=False) if tokenizer else None
    result = {
        "token_ids": generation.token_ids,
        "text": text,
        "finish_reason": generation.finish_reason,
        "num_prompt_tokens": len(prompt),
        "seconds": round(seconds, 4),
        "tokens_per_second": round(len(generation.token_ids) / seconds, 2),
        "drafter": args.drafter,
        "tau": round(stats.tau, 4),
        "num_target_passes": stats.num_target_passes,
        "hit_rate": round(stats.hit_rate, 4),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(text if text is not None else " ".join(map(str, generation.token_ids)))
        print(
            f"\n[{len(generation.token_ids)} tokens in {seconds:.2f} s: "
            f"{result['tokens_per_second']:.1f} tokens/s, finish={generation.finish_reason}, "
            f"drafter={args.drafter}, tau={stats.tau:.2f}, passes={stats.num_target_passes}, "
            f"hit rate={stats.hit_rate:.2f}]",
            file=sys.stderr,
        )
    return 0


def make_drafter(spec: str, target, *, target_dir: Path | None = None, max_num_seqs: int = 1):
    """``none`` | ``ngram`` | a drafter directory -> a drafter for ``target`` (or None)."""
    if spec == "none":
        return None
    if spec == "ngram":
        return NgramDrafter(vocab_size=target.config.vocab_size)
    model = load_model(spec, dtype=precision.drafter_dtype())
    if not isinstance(model, D3DModel):
        raise UsageError(f"{spec} is not a drafter (model_type {model.config.model_type!r}); use a D3D drafter directory, 'ngram' or 'none'")
    if model.config.vocab_size != target.config.vocab_size:
        raise UsageError(
            f"the drafter's vocabulary ({model.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): they must share one tokenizer"
        )
    kind = DFlashDrafter if model.config.target_hidden_size else D3DDrafter
    return kind(model, max_num_seqs=max_num_seqs)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    target_dir, out = Path(args.target), Path(args.out)
    target = load_model(target_dir)
    tokenizer = _load_tokenizer(target_dir)
    if tokenizer is None:
        raise UsageError(f"{target_dir} has no tokenizer.json: the drafter's prompts are text")
    responses = out / "responses.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    if responses.is_file():
        sequences, prompt_lens = read_sequences(responses)
        print(f"reusing {len(sequences)} cached target responses from {responses}")
    else:
        documents = {d: zoo.train_documents(d) for d in DOMAINS}
        prompts = training_prompts(documents, tokenizer, args.prompts_per_domain, seed=0)
        sequences = generate_responses(target, prompts, args.response_tokens)
        prompt_lens = [len(p) for p in prompts]
        write_sequences(responses, sequences, prompt_lens)
    config = zoo.drafter_config(target.config, reads_target=args.kind == "dflash")
    model = D3DModel(config)
    init_from_target(model, target)
    training = DrafterTrainConfig(steps=args.steps)
    stats = train_drafter(model, sequences, prompt_lens, training, out / "work", target=target, description=args.kind)
    save_drafter(model, out, stats)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (target_dir / file).is_file():
            (out / file).write_bytes((target_dir / file).read_bytes())
    print(f"saved {args.kind} drafter to {out} (denoising loss {stats['denoise_loss']:.3f})")
    return 0


def _eval_prompts(args: argparse.Namespace, tokenizer) -> dict[str, list[list[int]]] | None:
    """Held-out prompts for τ: ``--eval-data`` records' prompts, else the zoo's held-out sets if built."""
    count = args.eval_prompts
    if args.eval_data:
        lines = [line for line in Path(args.eval_data).read_text().splitlines() if line.strip()]
        items = [t for t in (parse_line(line, tokenizer) for line in lines) if isinstance(t, Trajectory) and t.prompt]
        return {"eval": [t.prompt[-192:] for t in items[:count]]} if items else None
    if tokenizer is None or not zoo.heldout_path(DOMAINS[0]).is_file():
        return None
    return {domain: [tokenizer.encode(item.prompt).ids[-192:] for item in items[:count]]
            for domain, items in zoo.heldout().items()}


def cmd_train_opd(args: argparse.Namespace) -> int:
    target_dir, drafter_dir, out = Path(args.target), Path(args.drafter), Path(args.out)
    target, drafter = load_model(target_dir), load_model(drafter_dir)
    if not isinstance(drafter, D3DModel) or drafter.config.target_hidden_size:
        raise UsageError(f"{drafter_dir} is not a D3D drafter: on-policy distillation trains D3D drafters")
    tokenizer = _load_tokenizer(target_dir) or _load_tokenizer(drafter_dir)
    source = open_source(args.data, tokenizer)
    config = from_flags(SpecOPDConfig, args, max_context=getattr(target.config, "max_position_embeddings", 4096))
    prompts = _eval_prompts(args, tokenizer) if args.eval_every else None
    if args.eval_every and not prompts:
        print("no held-out prompts (no --eval-data and no built zoo): held-out tau is not measured", file=sys.stderr)
    result: OPDResult = train_opd(
        target, drafter, source, method=args.method, config=config, out=out / "work", steps=args.steps,
        batch_size=args.batch_size, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        eval_prompts=prompts,
    )
    save_model(drafter, out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        source_dir = drafter_dir if (drafter_dir / file).is_file() else target_dir
        if (source_dir / file).is_file():
            (out / file).write_bytes((source_dir / file).read_bytes())
    summary = {"method": args.method, "loss": config.loss, "steps": result.steps, "seconds": result.seconds,
               "num_supervised_tokens": result.num_supervised_tokens, "final_loss": result.losses[-1] if result.losses else None,
               "skipped": result.skipped, "evaluations": result.evaluations}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    last = result.evaluations[-1]["tau"] if result.evaluations else {}
    print(f"saved {args.method} drafter to {out}: {result.steps} steps, {result.num_supervised_tokens} supervised tokens "
          f"in {result.seconds:.1f} s" + (f", held-out tau {mean_tau(last):.3f}" if last else "")
          + (f", skipped {result.skipped}" if result.skipped else ""))
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    settings = DecodeSettings.quick() if args.quick else DecodeSettings()
    settings.target = args.target
    settings.seeded = args.seeded
    settings.fixed_block = args.fixed_block
    if args.draft_headroom is not None:
        settings.draft_headroom = args.draft_headroom or None
    if args.candidate_budget is not None:
        settings.candidate_budget = args.candidate_budget
    if args.methods:
        settings.methods = tuple(args.methods.split(","))
        unknown = sorted(set(settings.methods) - set(METHODS))
        if unknown:
            raise UsageError(f"unknown --methods {','.join(unknown)}: choose from {','.join(METHODS)}")
    if args.max_tokens is not None:
        settings.max_tokens = args.max_tokens
    if args.prompts_per_domain is not None:
        settings.prompts_per_domain = args.prompts_per_domain
    if args.domains:
        settings.domains = tuple(args.domains.split(","))
        unknown = sorted(set(settings.domains) - set(DOMAINS))
        if unknown:
            raise UsageError(f"unknown --domains {','.join(unknown)}: choose from {','.join(DOMAINS)}")
    if args.temperatures is not None:
        settings.temperatures = tuple(float(t) for t in args.temperatures.split(","))
    if args.batch_sizes is not None:
        settings.batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    if args.block_sizes is not None:
        settings.block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
    bench_decode_main(settings, Path(args.out), Path(args.json) if args.json else None)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    target = load_model(args.target or zoo.ensure("qwen3-tiny"))
    drafter = load_model(args.drafter)
    if not isinstance(drafter, D3DModel) or drafter.config.target_hidden_size:
        raise UsageError(f"{args.drafter} is not a D3D drafter")
    tokenizer = load_tokenizer(zoo.tokenizer_dir(), zoo=True)
    prompts = [tokenizer.encode(item.prompt).ids[-160:] for items in zoo.heldout().values() for item in items[: args.prompts_per_domain]]
    pruned, baseline, steps = prune(target, drafter, prompts, tolerance=args.tolerance, block_size=args.block_size)
    print(f"unpruned: {drafter.config.num_hidden_layers} layers, tau {baseline:.3f}")
    print(f"{'removed':>7} {'kept layers':<20} {'tau':>6} {'ratio':>6}  kept?")
    for step in steps:
        print(f"{step.removed:>7} {str(step.kept_layers):<20} {step.tau:>6.3f} {step.tau / baseline:>6.3f}  {'yes' if step.accepted else 'no'}")
    out = Path(args.out or f"{args.drafter.rstrip('/')}-pruned")
    save_model(pruned, out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(args.drafter) / file).is_file():
            (out / file).write_bytes((Path(args.drafter) / file).read_bytes())
    print(f"saved {pruned.config.num_hidden_layers}-layer drafter to {out}")
    return 0


def cmd_zoo_build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    ran = zoo.build(only=args.only)
    print(f"zoo at {zoo.zoo_dir()}: {'built ' + ', '.join(ran) if ran else 'up to date'} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_zoo_list(args: argparse.Namespace) -> int:
    rows = zoo.listing()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<20} {'kind':<8} {'architecture':<12} {'built':<6} path")
    for row in rows:
        print(f"{row['name']:<20} {row['kind']:<8} {row['architecture']:<12} {str(row['built']):<6} {row['path']}")
    return 0


def cmd_zoo_path(args: argparse.Namespace) -> int:
    names = [m.name for m in zoo.MODELS]
    if args.name not in names:
        raise UsageError(f"no zoo model named {args.name!r}; the zoo has: {', '.join(names)}")
    if not zoo.is_built(args.name):
        raise UsageError(f"zoo model {args.name!r} is not built yet: run `specd zoo build`")
    print(zoo.model_path(args.name))
    return 0


COMMANDS_GROUP = "specd.commands"


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand another installed package adds to ``specd``: an entry point of the group
    ``specd.commands`` whose name is the command's path (``up``, ``bench.serve``) and whose object
    is one of these. This is how the services (`services.commands`) give `specd` its `up`,
    `bench serve` and calibrating `bench profile` while the library never imports a service (it
    has no gRPC in it; DESIGN.md). One at a path the library has too (``bench.profile``) takes the
    library's command's place; the others follow the library's commands of their group."""

    help: str
    """The line in the parent's --help ("": the library's own, for a command that replaces one)."""
    module: str
    """Dotted name of a module with ``add_arguments(parser)`` and ``run(args) -> int``. Imported
    only when the command line names this command, so other commands never load it."""


def installed_commands() -> dict[str, Command]:
    """The installed packages' commands, by path (entry-point group ``specd.commands``). One whose
    entry point does not load (a package installed from another checkout, half upgraded) is left
    out with a warning on stderr: the library's own commands must run whatever else is installed."""
    commands = {}
    for point in entry_points(group=COMMANDS_GROUP):
        try:
            command = point.load()
        except (ImportError, AttributeError) as error:
            print(f"specd: warning: skipping the installed command {point.name!r} ({point.value}): {error}; "
                  "reinstall the package that provides it (pip install -e .)", file=sys.stderr)
            continue
        commands[point.name] = command
    return commands


def _add_installed(subparsers, path: str, command: Command, named: list[str] | None, library_help: str = "") -> None:
    sub = subparsers.add_parser(path.rsplit(".", 1)[-1], help=command.help or library_help)
    words = path.split(".")
    if named is None or named[: len(words)] == words:
        module = importlib.import_module(command.module)
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)


def parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. ``argv``: the arguments it will parse; an installed package's
    command (`Command`) gets its flags, and its module is imported, only when ``argv`` names it
    (None: every command's flags)."""
    installed = installed_commands()
    named = None if argv is None else list(itertools.takewhile(lambda word: not word.startswith("-"), argv))

    def add(subparsers, path: str, help: str, add_arguments: Callable, run: Callable) -> None:
        """The library's command at ``path``, or an installed package's in its place."""
        if path in installed:
            _add_installed(subparsers, path, installed.pop(path), named, library_help=help)
            return
        sub = subparsers.add_parser(path.rsplit(".", 1)[-1], help=help)
        add_arguments(sub)
        sub.set_defaults(func=run)

    def add_installed(subparsers, parent: str) -> None:
        """The installed packages' commands under ``parent``, after the library's own."""
        for path in [p for p in installed if p.rpartition(".")[0] == parent]:
            _add_installed(subparsers, path, installed.pop(path), named)

    top = argparse.ArgumentParser(prog="specd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate from a model directory: plain decoding, or speculative "
                                                "with --drafter DIR|ngram")
    gen.add_argument("--model", required=True, help="model directory in Hugging Face layout")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    source.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer needed)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of the chat template")
    add_flags(gen, SamplingParams, ("max_tokens", "temperature", "top_p", "top_k", "seed"), help={
        "max_tokens": "new tokens at most", "temperature": "0 = greedy", "top_p": "nucleus sampling (1 = off)",
        "top_k": "0 = disabled", "seed": "the sampler's seed (default: nondeterministic)"})
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end tokens")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's")
    gen.add_argument("--drafter", default="none", help="a drafter directory, 'ngram' (prompt lookup) or 'none' (plain)")
    gen.add_argument("--lookup", action="store_true",
                     help="with --drafter DIR: prompt lookup beside it, the block expected to go further each step")
    add_flags(gen, EngineConfig, ("block_size",))
    gen.add_argument("--mode", choices=["async", "sync"], default=None,
                     help="draft during verification (default for D3D) or after it")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)

    train = commands.add_parser("train", help="train drafters").add_subparsers(dest="train_command", required=True)
    drafter = train.add_parser("drafter", help="offline D3D (or DFlash-style) drafter training on the target's own responses")
    drafter.add_argument("--target", required=True, help="target model directory (with tokenizer.json)")
    drafter.add_argument("--out", required=True, help="output directory (resumable: checkpoints under OUT/work)")
    drafter.add_argument("--kind", choices=["d3d", "dflash"], default="d3d")
    add_flags(drafter, DrafterTrainConfig, ("steps",), help={"steps": "optimizer steps"})
    drafter.add_argument("--prompts-per-domain", type=int, default=160)
    drafter.add_argument("--response-tokens", type=int, default=96)
    drafter.set_defaults(func=cmd_train_drafter)

    opd = train.add_parser("opd", help="on-policy distillation of a D3D drafter (SpecOPD or its baselines)")
    opd.add_argument("--target", required=True, help="target model directory")
    opd.add_argument("--drafter", required=True, help="starting D3D drafter directory")
    opd.add_argument("--data", required=True, help="JSONL trajectories (prompt_ids/response_ids, prompt/response text, "
                                                   "or prompt_len/ids); live traffic: the trainer service")
    opd.add_argument("--out", required=True, help="output drafter directory (resumable: checkpoints under OUT/work)")
    opd.add_argument("--method", choices=list(OPD_METHODS), default="specopd")
    add_flags(opd, SpecOPDConfig, ("loss",), help={"loss": "(offline always trains with kl)"},
              choices={"loss": list(LOSSES)})
    opd.add_argument("--steps", type=int, default=200)
    opd.add_argument("--eval-every", type=int, default=50, help="steps between held-out tau measurements (0 = never)")
    opd.add_argument("--eval-data", default=None, help="JSONL whose prompts measure tau (default: the zoo's held-out sets)")
    opd.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per domain")
    opd.add_argument("--checkpoint-every", type=int, default=50)
    opd.add_argument("--batch-size", type=int, default=4, help="trajectories per step")
    # The SpecOPDConfig fields: cmd_train_opd builds it from them (`from_flags`).
    add_flags(opd, SpecOPDConfig, ("block_size", "anchors_per_seq", "branches_per_anchor", "lr", "seed"),
              flags={"anchors_per_seq": "--anchors", "branches_per_anchor": "--branches"},
              help={"block_size": "tokens per branch (the block the drafter serves with)",
                    "anchors_per_seq": "anchors per trajectory", "branches_per_anchor": "branches per anchor (K)",
                    "lr": "AdamW learning rate", "seed": "seeds anchors and branch sampling"})
    opd.set_defaults(func=cmd_train_opd)

    pruner = commands.add_parser("prune", help="acceptance-aware layer pruning of a D3D drafter")
    pruner.add_argument("--drafter", required=True, help="D3D drafter directory")
    pruner.add_argument("--target", default=None, help="target directory (default: the zoo's qwen3-tiny)")
    pruner.add_argument("--out", default=None, help="output directory (default DRAFTER-pruned)")
    pruner.add_argument("--tolerance", type=float, default=0.99, help="keep a removal while tau >= this x unpruned tau")
    add_flags(pruner, EngineConfig, ("block_size",))
    pruner.add_argument("--prompts-per-domain", type=int, default=4)
    pruner.set_defaults(func=cmd_prune)

    bench = commands.add_parser("bench", help="benchmarks (tables, JSON and PNG plots)").add_subparsers(dest="bench_command", required=True)
    decode = bench.add_parser("decode", help="speculative vs plain decoding on the zoo, same run")
    decode.add_argument("--quick", action="store_true", help="batch 1, block 8, fewer prompts (minutes)")
    decode.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}")
    decode.add_argument("--target", default="qwen3-tiny", help="zoo target: qwen3-tiny, or smollm2-135m (its drafters are built on first use)")
    decode.add_argument("--max-tokens", type=int, help="new tokens per prompt")
    decode.add_argument("--prompts-per-domain", type=int, help="held-out prompts of each of the four domains")
    decode.add_argument("--domains", help="comma-separated subset of the domains, e.g. agentic or code,math (default: all four)")
    decode.add_argument("--temperatures", help="comma-separated, e.g. 0 or 0,1")
    decode.add_argument("--batch-sizes", help="comma-separated, e.g. 1,4 (the first is the summary's)")
    decode.add_argument("--block-sizes", help="comma-separated draft blocks, e.g. 4,8")
    decode.add_argument("--seeded", action="store_true",
                        help="seed every sampled request: measure keyed sampling, not the rejection sampler")
    decode.add_argument("--fixed-block", action="store_true",
                        help="verify every drafted block at its full length (acceptance), not the cost model's choice")
    decode.add_argument("--draft-headroom", type=int,
                        help="draft the cost model's last chosen length + this many tokens (0: full blocks); default "
                             f"{DecodeSettings().draft_headroom}")
    decode.add_argument("--candidate-budget", type=int,
                        help=f"most outcomes drafted ahead per sequence in async mode; default {DecodeSettings().candidate_budget}")
    decode.add_argument("--out", default="out/bench", help="directory for plots and JSON")
    decode.add_argument("--json", help="JSON path (default OUT/decode.json)")
    decode.set_defaults(func=cmd_bench_decode)
    trees = bench.add_parser("trees", help="a packed tree pass vs its paths one by one, for every target kind")
    bench_trees.add_arguments(trees)
    trees.set_defaults(func=bench_trees.run)
    tp_bench = bench.add_parser("tp", help="a decode and a 16-token pass: tensor-parallel gloo ranks vs one process")
    bench_tp.add_arguments(tp_bench)
    tp_bench.set_defaults(func=bench_tp.run)
    opd_bench = bench.add_parser("opd", help="SpecOPD vs sequential OPD vs offline distillation on the zoo, same run")
    bench_opd.add_arguments(opd_bench)
    opd_bench.set_defaults(func=bench_opd.run)
    add(bench, "bench.recipe", "a drafter recipe's held-out block acceptance per learning rate and first layers, same run",
        bench_recipe.add_arguments, bench_recipe.run)
    add(bench, "bench.profile", "pass costs of the target and D3D drafter, acceptance and hit rate (JSON for specd plan)",
        bench_profile.add_arguments, bench_profile.run)
    gpu_bench = bench.add_parser("gpu", help="on one GPU: kernels vs references, NCCL, Qwen3-8B-shaped pass costs, projected speedup")
    bench_gpu.add_arguments(gpu_bench)
    gpu_bench.set_defaults(func=bench_gpu.run)
    add_installed(bench, "bench")  # the services': `specd bench serve`

    plan_cmd = commands.add_parser("plan", help="drafter:verifier split and block length for a GPU budget, by simulation; writes a Helm values override")
    planner.add_arguments(plan_cmd)
    plan_cmd.set_defaults(func=planner.run)

    zoo_cmd = commands.add_parser("zoo", help="the tiny model zoo").add_subparsers(dest="zoo_command", required=True)
    builder = zoo_cmd.add_parser("build", help="build missing or stale zoo models")
    builder.add_argument("--only", default=None, help="build only this step (and the steps it needs)")
    builder.set_defaults(func=cmd_zoo_build)
    lister = zoo_cmd.add_parser("list", help="list the zoo's models")
    lister.add_argument("--json", action="store_true")
    lister.set_defaults(func=cmd_zoo_list)
    path = zoo_cmd.add_parser("path", help="print a built zoo model's directory")
    path.add_argument("name")
    path.set_defaults(func=cmd_zoo_path)
    add_installed(commands, "")  # the services': `specd up`
    if installed:
        raise ValueError(f"installed commands {sorted(installed)} (entry-point group {COMMANDS_GROUP}) name no command "
                         "group of specd")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ModelLoadError, ValueError, FetchError) as err:
        print(f"specd: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
