"""Pre-training the zoo's tiny targets on the CPU: packed sequences, AdamW, warmup + cosine.

Design choices, all for CPU throughput within a few minutes on 2 cores:

- packed windows of ``seq_len + 1`` tokens sampled uniformly from each domain's token stream
  (documents separated by ``<|endoftext|>``), with the same number of windows per domain in
  every batch, so no domain starves;
- bf16 autocast where the CPU computes bf16 natively (about 2x fp32 there), fp32 elsewhere (an
  AVX2 CPU emulates bf16, far slower): `specd.precision` decides; fp32 master weights and loss;
- the training step runs eager (`PretrainConfig.compile` is off: with torch 2.13 on 2 cores it
  gained nothing, and in fp32 its AVX-512 code corrupts the heap), and attention uses SDPA's fused
  causal path (`ForwardBatch.dense_causal`);
- each batch split over single-threaded processes (`specd.train.workers`: about 1.15x on 2 cores), with
  the same result as one process up to float summation order;
- a fixed number of steps (not a time budget), so a build is reproducible on any machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specd.batch import ForwardBatch
from specd.precision import cpu_autocast, cpu_computes_bf16
from specd.train import workers as train_workers


@dataclass(kw_only=True, slots=True)
class PretrainConfig:
    steps: int = 1200
    """Optimizer steps."""
    seq_len: int = 256
    """Tokens per packed window."""
    windows_per_domain: int = 4
    """Windows of each domain in one batch (batch size = this x number of domains)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 60
    """Linear warmup from 0 to the peak."""
    min_lr_ratio: float = 0.05
    """Cosine decays to peak x this."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    seed: int = 0
    """Seed for initialisation and window sampling."""
    bf16: bool = field(default_factory=cpu_computes_bf16)
    """bf16 autocast for the forward pass (default: where the CPU computes bf16, `specd.precision`)."""
    compile: bool = False
    """torch.compile the loss computation. Off: on 2 cores of an AVX-512/bf16 EPYC (torch 2.13)
    `specd zoo build` trained qwen3-tiny in 448 s compiled and 403 s eager (bf16; the stamp's
    ``seconds``), a one-off timing of 10 steps in fp32 on AVX2 kernels gave 0.79-0.83 s a step
    either way, and in fp32 with AVX-512 kernels on 2 threads the compiled step aborts with a
    corrupted heap in its first steps (glibc ``malloc()`` assertions)."""


def lr_at(step: int, config: PretrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def sample_windows(streams: list[np.ndarray], config: PretrainConfig, rng: np.random.Generator) -> Tensor:
    """``[num_domains * windows_per_domain, seq_len + 1]`` int64 windows."""
    rows = []
    for stream in streams:
        starts = rng.integers(0, len(stream) - config.seq_len - 1, size=config.windows_per_domain)
        rows.extend(stream[s : s + config.seq_len + 1] for s in starts)
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def causal_lm_loss(model: nn.Module, windows: Tensor, bf16: bool) -> Tensor:
    """Mean next-token cross-entropy over ``[num_windows, seq_len + 1]`` windows."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    batch = ForwardBatch.dense(inputs)
    with cpu_autocast(bf16):
        logits = model(batch)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def pretrain(
    model: nn.Module,
    streams: list[np.ndarray],
    config: PretrainConfig,
    *,
    description: str = "train",
    on_step: Callable[[int, float], None] | None = None,
    workers: int | None = None,
) -> dict[str, float]:
    """Train ``model`` in place on per-domain token streams; returns summary figures. Each batch is
    split over ``workers`` processes (default `specd.train.workers.default_workers`); ``on_step``
    (called with each step's loss) needs the training in this process, so it implies one."""
    workers = 1 if on_step is not None else workers or train_workers.default_workers()
    if workers == 1:
        return _train(model, streams, config, description=description, on_step=on_step)
    return train_workers.train(_train, [model], (streams, config), workers, description=description)


def _train(
    model: nn.Module,
    streams: list[np.ndarray],
    config: PretrainConfig,
    *,
    description: str,
    on_step: Callable[[int, float], None] | None = None,
    rank: int = 0,
    world: int = 1,
) -> dict[str, float]:
    """The training loop, as rank ``rank`` of ``world``: every rank draws the whole batch and
    trains on its rows; the summed gradients are the whole batch's."""
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    parameters = list(model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    loss_fn = torch.compile(causal_lm_loss) if config.compile else causal_lm_loss
    model.train()
    start = time.perf_counter()
    tokens_seen = 0
    smoothed = float("nan")
    bar = tqdm(range(config.steps), desc=description, unit="step", dynamic_ncols=True, disable=rank != 0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        windows = sample_windows(streams, config, rng)
        mine = windows[train_workers.rows(len(windows), rank, world)]
        loss = loss_fn(model, mine, config.bf16) * (len(mine) / len(windows))
        loss.backward()
        if world > 1:
            loss = train_workers.sum_gradients(parameters, loss)
        torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += windows.shape[0] * config.seq_len
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        if step % 10 == 0 or step == config.steps - 1:
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{smoothed:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}")
        if on_step is not None:
            on_step(step, value)
    model.eval()
    elapsed = time.perf_counter() - start
    return {"final_loss": smoothed, "tokens_seen": tokens_seen, "seconds": elapsed}
