"""Training on the CPU in several single-threaded processes instead of one multi-threaded one.

One training step of the tiny targets is a few thousand small ops; one process spreads each op
over the cores, and much of a step (softmax, norms, elementwise ops, autograd's bookkeeping)
scales poorly across threads. Measured on 2 cores of an AVX2 EPYC (fp32, the qwen3-tiny step:
16 windows of 256 tokens): one process on 2 threads 1.37 s a step; two processes on 1 thread,
each on half the batch, 1.12 s a step (1.22x), where one process on 1 thread takes 2.05 s for
the whole batch. In the zoo's own steps, alternated on that host, the split gave about 1.15x
for the target and 1.09x for the D3D drafter (the README has the figures). So the zoo's training
splits each batch over `default_workers` processes.

Wide models are the other way round: the step of SmolLM2's D3D drafter (576 wide, a 8192-token
drafting head, 8 windows of 256 tokens) is a few large matmuls that two threads share well. On 2
cores of an AVX-512/bf16 EPYC, alternated, one process took 1.56 / 1.69 s a step under bf16
autocast and 2.9 s in fp32; two took 1.81 / 2.09 s and 3.08 / 3.76 s, plus ~15 s of start-up (each
rank loads the target). The same host's d3d-qwen3-tiny step: 0.68 / 0.67 s in one process, 0.61 /
0.60 s in two (`bench/train_workers.py`; `bench/results/train-workers-epyc-avx512.json`). So the zoo trains SmolLM2's
drafters in one process (``default_workers(split=False)``).

How: ranks are spawned (`torch.multiprocessing`, start method ``spawn``: no forked OpenMP
state) and meet through a file store in a temporary directory (no port to pick). Every rank
draws the same whole batch from the same seeded stream and takes its rows ``rank::world``; its
loss is scaled by its share of the rows, so the summed gradients (`sum_gradients`, one gloo
all-reduce of a flat buffer) are the whole batch's, and every rank's optimizer step is then
identical: the ranks stay equal without a broadcast. Rank 0 writes the result for the parent.
Results equal one process's up to float summation order (`tests/unit/test_train_workers.py`).

``SPECD_TRAIN_WORKERS=N`` overrides the default (``1``: train in this process). As with any
``spawn``, each rank imports the caller's main module: a script that trains must guard its entry
point (``if __name__ == "__main__":``), as ``specd``'s CLI and pytest do.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ENV_VAR = "SPECD_TRAIN_WORKERS"


def default_workers(split: bool = True) -> int:
    """Training processes for this machine: 2 where torch runs at least 2 threads (measured on 2
    cores only: see the module docstring), else 1, and 1 without ``split`` (a wide model's step);
    ``SPECD_TRAIN_WORKERS`` overrides either."""
    forced = os.environ.get(ENV_VAR, "")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{ENV_VAR} must be a whole number of processes, 1 or more; got {forced!r}")
        return int(forced)
    return 2 if split and torch.get_num_threads() >= 2 else 1


@contextmanager
def run(worker: Callable, args: Sequence, world: int) -> Iterator[Path]:
    """Run ``worker(rank, world, threads, init_file, out_dir, *args)`` in ``world`` spawned ranks,
    each on its share of this process's threads, then yield ``out_dir`` holding rank 0's results
    (removed on leaving the ``with``). A failing rank raises here with its traceback, and the
    others are stopped."""
    threads = max(1, torch.get_num_threads() // world)
    with tempfile.TemporaryDirectory(prefix="specd-train-") as scratch:
        init_file, out_dir = Path(scratch) / "rendezvous", Path(scratch) / "out"
        out_dir.mkdir()
        mp.start_processes(worker, args=(world, threads, str(init_file), out_dir, *args), nprocs=world,
                           join=True, start_method="spawn")
        yield out_dir


def train(train_fn: Callable[..., dict], modules: Sequence[nn.Module | None], args: Sequence, world: int,
          **kwargs) -> dict:
    """Run ``train_fn(*modules, *args, rank=r, world=world, **kwargs)`` in ``world`` spawned ranks
    on copies of ``modules`` (sent as bytes: spawn would share their tensors between the ranks),
    load rank 0's weights of ``modules[0]`` back into it, and return rank 0's figures with
    ``loop_seconds`` (its steps) and ``seconds`` (with the ranks' few seconds of start-up)."""
    start = time.perf_counter()
    blobs = []
    for module in modules:
        blob = io.BytesIO()
        torch.save(module, blob)
        blobs.append(blob.getvalue())
    with run(_train_rank, (train_fn, blobs, args, kwargs), world) as out:
        modules[0].load_state_dict(torch.load(out / "model.pt"))
        stats = json.loads((out / "stats.json").read_text())
    modules[0].eval()
    return {**stats, "loop_seconds": stats["seconds"], "seconds": time.perf_counter() - start, "workers": world}


def _train_rank(rank: int, world: int, threads: int, init_file: str, out: Path, train_fn: Callable[..., dict],
                blobs: list[bytes], args: Sequence, kwargs: dict) -> None:
    join(rank, world, threads, init_file)
    modules = [torch.load(io.BytesIO(blob), weights_only=False) for blob in blobs]
    stats = train_fn(*modules, *args, rank=rank, world=world, **kwargs)
    if rank == 0:
        torch.save(modules[0].state_dict(), out / "model.pt")
        (out / "stats.json").write_text(json.dumps(stats))
    leave()


def join(rank: int, world: int, threads: int, init_file: str) -> None:
    """A spawned rank's set-up: its thread count, then the gloo group over the file store."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def leave() -> None:
    dist.destroy_process_group()


def sum_gradients(parameters: Sequence[nn.Parameter], extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Sum every rank's gradients in place (one all-reduce of one flat buffer; a parameter with no
    gradient counts as zeros) and, when given, a small tensor riding along (the loss); returns
    that tensor summed."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    pieces = grads + ([extra.detach().reshape(-1).float()] if extra is not None else [])
    flat = _flatten_dense_tensors(pieces)
    dist.all_reduce(flat)
    summed = _unflatten_dense_tensors(flat, pieces)
    for parameter, grad in zip(parameters, summed):
        if parameter.grad is None:
            parameter.grad = grad.clone()
        else:
            parameter.grad.copy_(grad)
    return summed[-1].reshape(extra.shape) if extra is not None else None


def summed(tensor: torch.Tensor) -> torch.Tensor:
    """A small tensor summed over the ranks (a copy; e.g. a loss's denominators)."""
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total


def rows(total: int, rank: int, world: int) -> slice:
    """This rank's rows of a batch of ``total`` (strided, so domains stay mixed on every rank)."""
    return slice(rank, total, world)
