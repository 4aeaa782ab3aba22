"""`specd bench tp`: what tensor parallelism costs per pass, TP-W against one process, same run.

For each target kind (``tiny`` flavours, random weights) with ``num_seqs`` sequences of
``context_len`` tokens already in the cache, two passes over the cache (not committed, so every
repeat sees the same cache):

- ``decode``:  one new token per sequence;
- ``block``:   ``block`` new tokens per sequence (a verification chain of 16).

Timed three ways, median of ``repeats`` after a warm-up:

- ``one process, T threads`` and ``one process, W*T threads`` (the same cores TP-W uses);
- ``TP-W``: W spawned gloo ranks (`specd.parallel.tensor_parallel`) of T threads each; the ranks
  meet at a barrier before each pass and rank 0's time is reported (its pass ends with the
  LM head's all-gather, so it covers the slowest rank).

The logits' max difference between TP-W and one process is reported too. On a CPU with a tiny
model the collectives' latency (gloo over loopback: two all-reduces per layer plus the head's
all-gather) is not hidden by any saving in matmuls, so TP loses here: this is the cost figure of
the mechanism, not a prediction for NCCL on GPUs, where a rank's share of the weights is what
makes a model fit or a pass memory-bound. The machine is shared: only same-run ratios mean anything.

    specd bench tp [--quick] [--kinds qwen3,qwen3_next,sparse] [--world-size 2] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from specd.batch import ForwardBatch
from specd.models import qwen3, qwen3_next, sparse
from specd.models.loading import load_model, save_model
from specd.parallel import tensor_parallel
from specd.ports import free_port

KINDS = {
    "qwen3": (qwen3.Qwen3ForCausalLM, qwen3.FLAVOURS["tiny"]),
    "qwen3_next": (qwen3_next.Qwen3NextForCausalLM, qwen3_next.FLAVOURS["tiny"]),
    "sparse": (sparse.SparseForCausalLM, sparse.FLAVOURS["tiny"]),
}
PASSES = ("decode", "block")


@dataclass(kw_only=True, slots=True)
class TPSettings:
    kinds: tuple[str, ...] = tuple(KINDS)
    world_size: int = 2
    threads: int = 1
    """Torch threads per process (the one-process baseline also runs with world_size * threads)."""
    num_seqs: int = 4
    context_len: int = 128
    block: int = 16
    repeats: int = 10
    seed: int = 0

    @staticmethod
    def quick() -> TPSettings:
        return TPSettings(context_len=64, repeats=5)


@dataclass(kw_only=True, slots=True)
class TPRow:
    kind: str
    workload: str
    new_tokens: int
    """New tokens per sequence in the pass."""
    seconds_one_process: float
    """One process, ``threads`` threads."""
    seconds_one_process_all_cores: float
    """One process, ``world_size * threads`` threads."""
    seconds_tp: float
    tp_ratio: float
    """seconds_tp / seconds_one_process (> 1: TP is slower)."""
    tp_ratio_all_cores: float
    """seconds_tp / seconds_one_process_all_cores."""
    max_abs_logit_difference: float


@torch.inference_mode()
def time_passes(model: nn.Module, settings: TPSettings, barrier: Callable[[], None] | None = None
                ) -> dict[str, tuple[float, torch.Tensor]]:
    """``{workload: (median seconds, logits)}`` for one model (whole or a shard)."""
    generator = torch.Generator().manual_seed(settings.seed)
    vocab = model.config.vocab_size
    contexts = torch.randint(0, vocab, (settings.num_seqs, settings.context_len), generator=generator).tolist()
    cache = model.new_cache(settings.num_seqs, capacity=settings.context_len + settings.block)
    prefill = ForwardBatch.causal(contexts, cache.lengths.tolist())
    model(prefill, cache)
    cache.commit(prefill, [list(range(settings.context_len))] * settings.num_seqs)
    out = {}
    for workload, new in zip(PASSES, (1, settings.block)):
        tokens = torch.randint(0, vocab, (settings.num_seqs, new), generator=generator).tolist()
        batch = ForwardBatch.causal(tokens, cache.lengths.tolist())  # built once: the pass alone is timed
        times = []
        for _ in range(settings.repeats + 1):  # the first is a warm-up
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            logits = model(batch, cache)
            times.append(time.perf_counter() - start)
        out[workload] = (statistics.median(times[1:]), logits)
    return out


def _rank(rank: int, port: int, directory: Path, settings: TPSettings) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(settings.threads)
    dist.init_process_group("gloo", rank=rank, world_size=settings.world_size)
    results = {}
    for kind in settings.kinds:
        model = tensor_parallel(load_model(directory / kind))
        results[kind] = time_passes(model, settings, barrier=dist.barrier)
    if rank == 0:
        torch.save(results, directory / "tp.pt")
    dist.destroy_process_group()


def measure(settings: TPSettings) -> list[TPRow]:
    with tempfile.TemporaryDirectory(prefix="specd-bench-tp-") as tmp:
        directory = Path(tmp)
        whole: dict[str, dict[int, dict]] = {}
        threads_before = torch.get_num_threads()
        for kind in settings.kinds:
            model_class, config = KINDS[kind]
            torch.manual_seed(settings.seed)
            save_model(model_class(config).eval(), directory / kind)
            model = load_model(directory / kind)
            whole[kind] = {}
            for threads in (settings.threads, settings.world_size * settings.threads):
                torch.set_num_threads(threads)
                whole[kind][threads] = time_passes(model, settings)
        torch.set_num_threads(threads_before)
        mp.start_processes(_rank, args=(free_port(), directory, settings), nprocs=settings.world_size,
                           join=True, start_method="spawn")
        sharded = torch.load(directory / "tp.pt")
    rows = []
    for kind in settings.kinds:
        for workload, new in zip(PASSES, (1, settings.block)):
            one, _ = whole[kind][settings.threads][workload]
            all_cores, logits = whole[kind][settings.world_size * settings.threads][workload]
            tp, tp_logits = sharded[kind][workload]
            rows.append(TPRow(
                kind=kind, workload=workload, new_tokens=new, seconds_one_process=one,
                seconds_one_process_all_cores=all_cores, seconds_tp=tp, tp_ratio=tp / one, tp_ratio_all_cores=tp / all_cores,
                max_abs_logit_difference=float((tp_logits - logits).abs().max()),
            ))
    return rows


def format_table(rows: list[TPRow], settings: TPSettings) -> str:
    w, t = settings.world_size, settings.threads
    header = (f"{'kind':<11} {'pass':<7} {'new':>4} {f'1 proc x{t}t ms':>15} {f'1 proc x{w * t}t ms':>15} "
              f"{f'TP-{w} x{t}t ms':>14} {f'TP / x{t}t':>10} {f'TP / x{w * t}t':>10} {'max |dlogit|':>13}")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.kind:<11} {r.workload:<7} {r.new_tokens:>4} {1000 * r.seconds_one_process:>15.2f} "
            f"{1000 * r.seconds_one_process_all_cores:>15.2f} {1000 * r.seconds_tp:>14.2f} "
            f"{r.tp_ratio:>9.2f}x {r.tp_ratio_all_cores:>9.2f}x {r.max_abs_logit_difference:>13.1e}"
        )
    return "\n".join(lines)


def plot(rows: list[TPRow], settings: TPSettings, path: Path) -> Path:
    """Milliseconds per pass, one bar group per (kind, pass): one process vs TP ranks."""
    from matplotlib.figure import Figure  # object API: no pyplot state, no display backend

    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    labels = [f"{r.kind}\n{r.workload}" for r in rows]
    x = range(len(rows))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [1e3 * r.seconds_one_process for r in rows], width,
           label=f"1 process x{settings.threads} thread(s)")
    ax.bar([i + width / 2 for i in x], [1e3 * r.seconds_tp for r in rows], width,
           label=f"TP-{settings.world_size} x{settings.threads} thread(s) each")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per pass (median)")
    ax.set_title(f"specd bench tp: {settings.num_seqs} sequences x {settings.context_len} cached tokens, same run")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(settings: TPSettings, json_path: Path | None = None, out_dir: Path | None = None) -> list[TPRow]:
    rows = measure(settings)
    print(f"{settings.num_seqs} sequences x {settings.context_len} cached tokens; tiny flavours; median of "
          f"{settings.repeats}; TP-{settings.world_size} over gloo on this CPU")
    print(format_table(rows, settings))
    if out_dir is not None and json_path is None:
        json_path = out_dir / "tp.json"
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"settings": asdict(settings), "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
        print(f"wrote {json_path}")
    if out_dir is not None:
        print(f"wrote {plot(rows, settings, out_dir / 'tp.png')}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a shorter context and fewer repeats")
    parser.add_argument("--kinds", help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--world-size", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--json", help="write the rows as JSON here (default OUT/tp.json)")
    parser.add_argument("--out", default="out/bench", help="directory for tp.json and tp.png")


def run(args: argparse.Namespace) -> int:
    settings = TPSettings.quick() if args.quick else TPSettings()
    settings.world_size, settings.threads = args.world_size, args.threads
    if args.kinds:
        unknown = set(args.kinds.split(",")) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        settings.kinds = tuple(args.kinds.split(","))
    main(settings, Path(args.json) if args.json else None, Path(args.out))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
