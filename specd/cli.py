"""The ``specd`` command line.

    specd zoo build                    build the tiny zoo (cached; a second call takes seconds)
    specd zoo list [--json]            the zoo's models: name, kind, path, built
    specd zoo path NAME                a built zoo model's directory (for scripts)
    specd generate --model DIR ...     plain autoregressive generation (the baseline)

Errors a user can cause (a missing directory, an unsupported architecture, ids outside the
vocabulary, an empty prompt) print one line saying what was wrong and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from specd import zoo
from specd.data import format_chat
from specd.engine import autoregressive, check_prompt
from specd.models.loading import ModelLoadError, load_model
from specd.sampling import SamplingParams


class UsageError(ValueError):
    """Bad input from the command line; reported without a traceback."""


def _load_tokenizer(directory: Path) -> Tokenizer | None:
    """The model directory's tokenizer, or None (then only --prompt-ids works)."""
    path = directory / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def cmd_generate(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    model = load_model(model_dir, dtype=getattr(torch, args.dtype) if args.dtype else None)
    tokenizer = _load_tokenizer(model_dir)
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as err:
            raise UsageError(f"--prompt-ids must be comma-separated integers: {err}") from err
    else:
        if tokenizer is None:
            raise UsageError(f"{model_dir} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        text = args.prompt
        if args.chat:
            text = format_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = tokenizer.encode(text).ids
    check_prompt(prompt, model.config.vocab_size)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
        stop_token_ids=() if args.ignore_eos else model.config.stop_token_ids,
    )
    start = time.perf_counter()
    (generation,) = autoregressive(model, [prompt], params)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=False) if tokenizer else None
    result = {
        "token_ids": generation.token_ids,
        "text": text,
        "finish_reason": generation.finish_reason,
        "num_prompt_tokens": len(prompt),
        "seconds": round(seconds, 4),
        "tokens_per_second": round(len(generation.token_ids) / seconds, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(text if text is not None else " ".join(map(str, generation.token_ids)))
        print(
            f"\n[{len(generation.token_ids)} tokens in {seconds:.2f} s: "
            f"{result['tokens_per_second']:.1f} tokens/s, finish={generation.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_zoo_build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    ran = zoo.build()
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


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="specd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="plain autoregressive generation from a model directory")
    gen.add_argument("--model", required=True, help="model directory in Hugging Face layout")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    source.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer needed)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end tokens")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)

    zoo_cmd = commands.add_parser("zoo", help="the tiny model zoo").add_subparsers(dest="zoo_command", required=True)
    zoo_cmd.add_parser("build", help="build missing or stale zoo models").set_defaults(func=cmd_zoo_build)
    lister = zoo_cmd.add_parser("list", help="list the zoo's models")
    lister.add_argument("--json", action="store_true")
    lister.set_defaults(func=cmd_zoo_list)
    path = zoo_cmd.add_parser("path", help="print a built zoo model's directory")
    path.add_argument("name")
    path.set_defaults(func=cmd_zoo_path)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ModelLoadError, ValueError) as err:
        print(f"specd: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
