"""`specd bench trees`: one packed tree pass against running its paths one by one, same run.

For each target kind (full attention, Qwen3-Next's linear hybrid, the sparse-linear hybrid) with
its ``tiny`` flavour (random weights: speed does not depend on them) and a context of
``context_len`` tokens already in the cache, two workloads:

- ``verify``:   ``branches`` sibling branches of ``depth`` tokens at the end of the context
  (a verification tree);
- ``proposal``: ``anchors`` anchors spread over the second half of the context (inside GDN
  chunks: their states come from indexed state replay) with ``branches`` branches each (a
  SpecOPD proposal tree whose trunk is already prefilled).

Methods, all scoring the same branch tokens:

- ``tree``          one pass over the packed tree (the cache holds the context);
- ``paths-cached``  one pass per branch from the same cache (a one-branch tree at its anchor);
- ``paths-fresh``   one cache-less pass per branch over ``context[:anchor] + branch``.

Reported: passes, seconds (median of ``repeats``), branch tokens scored per second, and the
speedup of ``tree`` over each. The machine is shared: only same-run ratios mean anything.

    specd bench trees [--quick] [--kinds qwen3,qwen3_next,sparse] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specd.batch import ForwardBatch
from specd.models import qwen3, qwen3_next, sparse
from specd.tree import TokenTree

KINDS = {
    "qwen3": (qwen3.Qwen3ForCausalLM, qwen3.FLAVOURS["tiny"]),
    "qwen3_next": (qwen3_next.Qwen3NextForCausalLM, qwen3_next.FLAVOURS["tiny"]),
    "sparse": (sparse.SparseForCausalLM, sparse.FLAVOURS["tiny"]),
}


@dataclass(kw_only=True, slots=True)
class TreeSettings:
    kinds: tuple[str, ...] = tuple(KINDS)
    context_len: int = 256
    anchors: int = 8
    branches: int = 4
    depth: int = 8
    repeats: int = 3
    seed: int = 0

    @staticmethod
    def quick() -> "TreeSettings":
        return TreeSettings(context_len=128, anchors=4, branches=4, depth=6, repeats=2)


@dataclass(kw_only=True, slots=True)
class TreeRow:
    kind: str
    workload: str
    method: str
    passes: int
    branch_tokens: int
    seconds: float
    tokens_per_second: float
    tree_speedup: float  # time of this method / time of the tree pass


def _branches(settings: TreeSettings, workload: str, generator: torch.Generator, vocab: int) -> list[tuple[int, list[int]]]:
    length = settings.context_len
    if workload == "verify":
        anchors = [length]
    else:  # spread over the second half, off chunk boundaries (odd positions), and the end
        step = max(1, length // (2 * settings.anchors))
        anchors = [length // 2 + 1 + i * step for i in range(settings.anchors - 1)] + [length]
    return [
        (anchor, torch.randint(0, vocab, (settings.depth,), generator=generator).tolist())
        for anchor in anchors for _ in range(settings.branches)
    ]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def bench_kind(kind: str, settings: TreeSettings) -> list[TreeRow]:
    model_class, config = KINDS[kind]
    torch.manual_seed(settings.seed)
    model: nn.Module = model_class(config).eval()
    generator = torch.Generator().manual_seed(settings.seed)
    context = torch.randint(0, config.vocab_size, (settings.context_len,), generator=generator).tolist()
    cache = model.new_cache(1, capacity=settings.context_len + settings.anchors * settings.branches * settings.depth)
    prefill = ForwardBatch.causal([context], [0])
    model(prefill, cache)
    cache.commit(prefill, [list(range(len(context)))])
    rows = []
    for workload in ("verify", "proposal"):
        branches = _branches(settings, workload, generator, config.vocab_size)
        num_tokens = sum(len(tokens) for _, tokens in branches)
        tree = TokenTree.from_paths(branches)
        single = [TokenTree.chain(tokens, anchor) for anchor, tokens in branches]

        def tree_pass():
            model(ForwardBatch.from_trees([tree], cache.lengths), cache)

        def paths_cached():
            for path in single:
                model(ForwardBatch.from_trees([path], cache.lengths), cache)

        def paths_fresh():
            for anchor, tokens in branches:
                model(ForwardBatch.causal([context[:anchor] + tokens]))

        timings = {
            "tree": (1, _median_seconds(tree_pass, settings.repeats)),
            "paths-cached": (len(single), _median_seconds(paths_cached, settings.repeats)),
            "paths-fresh": (len(branches), _median_seconds(paths_fresh, settings.repeats)),
        }
        tree_seconds = timings["tree"][1]
        for method, (passes, seconds) in timings.items():
            rows.append(TreeRow(
                kind=kind, workload=workload, method=method, passes=passes, branch_tokens=num_tokens,
                seconds=seconds, tokens_per_second=num_tokens / seconds, tree_speedup=seconds / tree_seconds,
            ))
    return rows


def format_table(rows: list[TreeRow]) -> str:
    lines = [f"{'kind':<11} {'workload':<9} {'method':<13} {'passes':>6} {'tokens':>6} {'ms':>9} {'tokens/s':>10} {'tree speedup':>13}"]
    for r in rows:
        lines.append(
            f"{r.kind:<11} {r.workload:<9} {r.method:<13} {r.passes:>6} {r.branch_tokens:>6} "
            f"{1000 * r.seconds:>9.1f} {r.tokens_per_second:>10.0f} {r.tree_speedup:>12.1f}x"
        )
    return "\n".join(lines)


def main(settings: TreeSettings, json_path: Path | None = None) -> list[TreeRow]:
    rows = [row for kind in settings.kinds for row in bench_kind(kind, settings)]
    print(f"context {settings.context_len} tokens; verify: {settings.branches} branches x {settings.depth} at the end; "
          f"proposal: {settings.anchors} anchors x {settings.branches} branches x {settings.depth} "
          f"(torch threads: {torch.get_num_threads()})")
    print(format_table(rows))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"settings": asdict(settings), "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a shorter context and a smaller tree")
    parser.add_argument("--kinds", help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, help="torch threads (1 gives steadier figures on a busy machine)")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = TreeSettings.quick() if args.quick else TreeSettings()
    if args.kinds:
        unknown = set(args.kinds.split(",")) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        settings.kinds = tuple(args.kinds.split(","))
    main(settings, Path(args.json) if args.json else None)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
