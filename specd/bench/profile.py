"""`specd bench profile`: what a pass costs here, and what the drafter earns — the simulator's input.

A *profile* is a JSON file holding measured (or, for hardware we do not have, stated) costs of
the target verifier's and the D3D drafter's passes, plus what speculation gains per pass. The
discrete-event simulator (`specd.plan.sim`) and `specd plan` read it; `load_profile` checks it.

Measured here single-threaded (``torch.set_num_threads(1)``: the services run pinned to one core
each), so the figures are per replica:

- **target**: seconds of one verification pass (ForwardBatch build + forward + logits, exactly
  what `SpeculativeEngine` times) over ``batch`` cache rows, each with ``tokens`` new tokens after
  ``context`` cached ones. Prefill is a pass of prompt-length tokens, so the grid reaches past
  the block sizes (64, 128 tokens).
- **drafter** (Draft calls) and **speculate** (Speculate calls): seconds of one `D3DDrafter`
  packed pass over ``batch`` rows whose longest row has ``tokens`` new nodes (known tokens + mask
  groups). Two tables, because a Speculate pass also runs the LM head over ``c`` mask groups per
  sequence where a Draft has one. A Draft is ``tail + g`` tokens (``tail`` context tokens the
  drafter has not seen: 2 for a miss, the prompt for a new sequence; ``g`` the mask-group size
  for block ``B``, the smallest of ``group_sizes`` >= B + 1); a Speculate with ``c`` candidates
  is ``B + c * (1 + g)`` (the block under verification, then per outcome a known node and its
  mask group), timed at the profiled block and the extra blocks. ``calls`` records which call
  gave each column.
- **acceptance_per_pos** and **hit_rate**: from a short in-process async engine run on the
  zoo's held-out prompts (`EngineStats.acceptance_per_pos`: P(position i and all before it are
  accepted); `EngineStats.hit_rate`) at ``block_size``, with the engine's adaptive block off so
  every position is counted. ``overhead``: the engine's seconds per step outside target passes
  and blocking drafter calls (``step_seconds`` + ``seq_seconds`` per running sequence).
- **rpc_seconds**: one gRPC round trip's fixed cost (two network hops, serialisation). Not
  measured (the library holds no gRPC): a parameter, ``--rpc-ms``.

The schema, the loader (`load_profile`) and how costs are read are in `specd.plan.profile`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specd import zoo
from specd.batch import ForwardBatch
from specd.bench.decode import heldout_prompts
from specd.drafters.base import Drafter, DraftRequest, SpeculateRequest
from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine
from specd.flags import add_flags
from specd.models.loading import load_model
from specd.plan.profile import (SCHEMA_VERSION, Acceptance, CostTable, DrafterTable, ObservedWorkload, Overhead,
                                Profile, load_profile, parse_profile)
from specd.sampling import SamplingParams
from specd.tree import TokenTree

__all__ = ["Measured", "add_arguments", "load_profile", "measure", "measure_profile", "parse_profile", "run", "write"]

TARGET_BATCHES = (1, 2, 4, 8, 16, 32, 64)
TARGET_TOKENS = (1, 2, 4, 8, 9, 16, 17, 64, 128)
DRAFTER_BUDGETS = (1, 2, 3, 4)
DRAFT_TAILS = (2, 64, 128)


# ====================================================================== measuring
def _typical_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed calls after a warm-up: what a pass typically costs (the
    simulator predicts throughput, which pays for typical passes, not the luckiest one), and,
    unlike a mean, not dragged by one spike from a neighbour on a shared machine."""
    fn()  # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _target_pass(model: nn.Module, cache, new: list[list[int]], context: int, lengths: torch.Tensor,
                 device: torch.device) -> None:
    """What SpeculativeEngine._verify_pass times: trees -> ForwardBatch -> logits; then forget them."""
    trees = [TokenTree.chain(tokens, context) for tokens in new]
    model(ForwardBatch.from_trees(trees, [context] * len(new), device), cache)
    cache.rollback(lengths)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the pass is done when its kernels are, not when they are queued


@torch.no_grad()
def measure_target(model: nn.Module, batches: tuple[int, ...], tokens: tuple[int, ...], *, context: int = 128,
                   repeats: int = 3, progress: tqdm | None = None) -> CostTable:
    """Target pass seconds per (batch, tokens) after ``context`` cached tokens (module docstring)."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for batch in batches:
        cache = model.new_cache(batch, capacity=context + max(tokens) + 1)
        prefix = torch.randint(4, vocab, (batch, context), generator=generator).tolist()
        fill = ForwardBatch.causal(prefix, cache.lengths.tolist(), device)
        model(fill, cache)
        cache.commit(fill, [list(range(context))] * batch)
        lengths = cache.lengths.clone()
        row = []
        for count in tokens:
            new = torch.randint(4, vocab, (batch, count), generator=generator).tolist()
            row.append(_typical_seconds(partial(_target_pass, model, cache, new, context, lengths, device), repeats))
            _progress(progress, f"target batch {batch} tokens {count}")
        seconds.append(row)
    return CostTable(batch=list(batches), tokens=list(tokens), seconds=seconds)


@torch.no_grad()
def measure_drafter(model: nn.Module, batches: tuple[int, ...], *, block_size: int = 8,
                    speculate_blocks: tuple[int, ...] = (8,), budgets: tuple[int, ...] = DRAFTER_BUDGETS,
                    tails: tuple[int, ...] = DRAFT_TAILS, context: int = 128, repeats: int = 3,
                    progress: tqdm | None = None,
                    make_drafter: Callable[[int], Drafter] | None = None) -> tuple[CostTable, CostTable, list[dict]]:
    """D3D packed-pass seconds per (batch, tokens per sequence), from real `D3DDrafter` calls.

    Draft table: a fresh block of ``block_size`` after ``tail`` context tokens the drafter has
    not seen (2: a miss; longer: a new sequence's prompt), ``tail + g`` tokens. Speculate table:
    the block under verification and ``c`` outcomes, ``B + c * (1 + g_B)`` tokens, for each block
    in ``speculate_blocks`` and budget in ``budgets``. Returns both and what each column was.

    ``make_drafter(batch)`` gives the drafter to time (default: an in-process `D3DDrafter` with
    ``batch`` rows); `services.calibrate` passes the verifier's client of a drafter replica, so
    the tables hold whole round trips."""
    group = model.config.group_size_for(block_size)
    drafts = [{"call": "draft", "block": block_size, "tail": tail, "tokens": tail + group} for tail in sorted(set(tails))]
    by_tokens: dict[int, dict] = {}
    for block in speculate_blocks:
        for budget in budgets:
            tokens = block + budget * (1 + model.config.group_size_for(block))
            by_tokens.setdefault(tokens, {"call": "speculate", "block": block, "candidates": budget, "tokens": tokens})
    speculates = sorted(by_tokens.values(), key=lambda c: c["tokens"])
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1 << 20)
    draft_seconds, speculate_seconds = [], []
    make_drafter = make_drafter or (lambda batch: D3DDrafter(model, max_num_seqs=batch))
    for batch in batches:
        drafter = make_drafter(batch)
        contexts = {i: torch.randint(4, vocab, (context,), generator=generator).tolist() for i in range(batch)}
        draft = partial(_draft, block_size=block_size, params=params)
        draft(drafter, contexts)  # the drafter holds every context, as in serving
        draft_row, speculate_row = [], []
        # Speculate first: the new-sequence Drafts below leave the rows holding other contexts.
        for call in speculates:
            speculate_row.append(_speculate_seconds(drafter, partial(_draft, block_size=call["block"], params=params),
                                                    contexts, call["block"], call["candidates"], params, repeats))
            _progress(progress, f"drafter batch {batch} speculate B={call['block']} c={call['candidates']}")
        for call in drafts:
            if call["tail"] <= 2:  # a miss: context tokens it has not seen, then a fresh block
                fn = partial(_miss, drafter, draft, contexts, vocab, generator, call["tail"])
            else:  # new sequences: the prompt's prefill and a block
                fn = partial(_new_sequences, drafter, draft, contexts, call["tail"])
            draft_row.append(_typical_seconds(fn, repeats))
            _progress(progress, f"drafter batch {batch} draft tail {call['tail']}")
        for i in contexts:
            drafter.release(i)
        draft_seconds.append(draft_row)
        speculate_seconds.append(speculate_row)
    draft_table = CostTable(batch=list(batches), tokens=[c["tokens"] for c in drafts], seconds=draft_seconds)
    speculate_table = CostTable(batch=list(batches), tokens=[c["tokens"] for c in speculates], seconds=speculate_seconds)
    return draft_table, speculate_table, drafts + speculates


def _progress(progress: tqdm | None, what: str) -> None:
    if progress is not None:
        progress.set_postfix_str(what)
        progress.update()


def _draft(drafter: Drafter, contexts: dict[int, list[int]], prompt: int | None = None, *, block_size: int,
           params: SamplingParams) -> dict[int, list[int]]:
    requests = [DraftRequest(seq_id=i, context=c if prompt is None else c[-prompt:], block_size=block_size,
                             params=params) for i, c in contexts.items()]
    return {r.seq_id: b.tokens for r, b in zip(requests, drafter.draft(requests))}


def _miss(drafter: Drafter, draft: Callable, contexts: dict[int, list[int]], vocab: int,
          generator: torch.Generator, tail: int) -> None:
    for i in contexts:
        contexts[i] += torch.randint(4, vocab, (tail,), generator=generator).tolist()
    draft(drafter, contexts)


def _new_sequences(drafter: Drafter, draft: Callable, contexts: dict[int, list[int]], prompt: int) -> None:
    for i in contexts:
        drafter.release(i)
    draft(drafter, contexts, prompt)


def _speculate_seconds(drafter: Drafter, draft: Callable, contexts: dict[int, list[int]], block_size: int,
                       budget: int, params: SamplingParams, repeats: int) -> float:
    """Speculate alone, in the steady async state: the drafter has just synced the context (a hit,
    or the Draft after a miss) and drafts ahead for the block under verification. Each repeat
    re-drafts first, untimed."""
    times = []
    for attempt in range(repeats + 1):
        blocks = draft(drafter, contexts)
        requests = [SpeculateRequest(seq_id=i, context=contexts[i], block=blocks[i], block_size=block_size,
                                     budget=budget, params=params) for i in contexts]
        start = time.perf_counter()
        drafter.speculate(requests)
        if attempt:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def _block_samples(samples: list[tuple[list[float], int, int]], block_size: int, keep: int = 4096) -> dict:
    """Up to ``keep`` full-length blocks' (confidence per position, accepted length, prompt index),
    drawn evenly."""
    full = [sample for sample in samples if len(sample[0]) == block_size]
    step = max(1, len(full) // keep)
    chosen = full[::step][:keep]
    return {"confidence": [[round(x, 4) for x in c] for c, _, _ in chosen], "accepted": [k for _, k, _ in chosen],
            "prompt": [p for _, _, p in chosen]}


def measure_acceptance(target: nn.Module, drafter_model: nn.Module, prompts: list[list[int]], *, block_size: int,
                       batch: int, max_tokens: int, budget: int = 4) -> dict:
    """One async engine run (greedy, the target's stop tokens, adaptive block off so every
    position is counted): acceptance per position, hit rate, overhead per step, output lengths."""
    drafter = D3DDrafter(drafter_model, max_num_seqs=batch)
    config = EngineConfig(max_num_seqs=batch, block_size=block_size, mode="async", candidate_budget=budget,
                          adaptive_block=False)
    engine = SpeculativeEngine(target, drafter, config)
    engine.stats.block_samples = []
    stop = tuple(getattr(target.config, "stop_token_ids", ()))
    params = [SamplingParams(max_tokens=max_tokens, seed=i, stop_token_ids=stop) for i in range(len(prompts))]
    try:
        generations = engine.generate(prompts, params)
    finally:
        engine.close()
    stats = engine.stats
    return {
        "acceptance_per_pos": [round(a, 4) for a in stats.acceptance_per_pos][:block_size],
        "confidence_per_pos": [round(c, 4) for c in stats.confidence_per_pos][:block_size],
        "block_samples": _block_samples(stats.block_samples, block_size),
        "hit_rate": round(stats.hit_rate, 4), "tau": round(stats.tau, 4),
        "overhead_per_step": stats.overhead_per_step, "batch": batch,
        "output_tokens": [len(g.token_ids) for g in generations],
    }


@torch.no_grad()
def measure_plain_overhead(target: nn.Module, prompts: list[list[int]], *, batch: int, max_tokens: int) -> float:
    """The engine's seconds per step outside target passes when it decodes plain (no drafter):
    what speculation adds per step is the async run's overhead minus this."""
    engine = SpeculativeEngine(target, None, EngineConfig(max_num_seqs=batch, block_size=0))
    stop = tuple(getattr(target.config, "stop_token_ids", ()))
    try:
        engine.generate(prompts, [SamplingParams(max_tokens=max_tokens, stop_token_ids=stop)] * len(prompts))
    finally:
        engine.close()
    return engine.stats.overhead_per_step


@dataclass(kw_only=True, slots=True)
class ProfileSettings:
    batches: tuple[int, ...] = TARGET_BATCHES
    tokens: tuple[int, ...] = TARGET_TOKENS
    budgets: tuple[int, ...] = DRAFTER_BUDGETS
    """Speculate budgets (candidates) timed, at ``block_size`` and each of ``extra_blocks``."""
    tails: tuple[int, ...] = DRAFT_TAILS
    """Unseen context tokens of the timed Drafts: 2 (a miss) and new sequences' prompt lengths."""
    context: int = 128
    """Cached tokens before each timed pass."""
    repeats: int = 5
    """Timed passes per point (the fastest is kept: the machine may be shared)."""
    block_size: int = 8
    extra_blocks: tuple[int, ...] = (4, 16)
    """Further blocks whose acceptance and hit rate go to ``by_block``."""
    acceptance_batches: tuple[int, ...] = (1, 8)
    """Engine runs (the last also gives acceptance); two give the overhead's per-sequence slope."""
    prompts_per_domain: int = 64
    """Held-out prompts per domain, interleaved as `specd bench serve` sends them: its first
    ``4 x 64`` requests (all of them up to concurrency 64) are these prompts, and the block
    samples record which prompt each came from, so the simulator replays each request's own."""
    max_prompt_tokens: int = 96
    max_tokens: int = 64
    rpc_seconds: float = 0.0005
    threads: int = 1
    rounds: int = 1
    """Rounds of the verifier services' calibration (plain, async, sync, each round); per
    level, the median round's figures (`median_rounds`): a slow minute on a shared machine moves
    one round, not the profile."""

    @staticmethod
    def quick() -> ProfileSettings:
        return ProfileSettings(batches=(1, 4, 16), tokens=(1, 9, 17, 64), budgets=(2, 4), tails=(2, 64),
                               repeats=3, extra_blocks=(), acceptance_batches=(4,), prompts_per_domain=2)


def zoo_prompts(target_dir: Path, max_prompt_tokens: int, per_domain: int | None = None) -> list[list[int]]:
    """The zoo's held-out prompts as the target's ids (its chat template and tokenizer,
    `heldout_prompts`), domains interleaved (as `specd bench serve` sends them)."""
    per = heldout_prompts(target_dir, per_domain=per_domain, max_prompt_tokens=max_prompt_tokens).values()
    return [p for group in zip(*per) for p in group]


def measure_profile(target: nn.Module, drafter_model: nn.Module, prompts: list[list[int]],
                    settings: ProfileSettings, *, names: tuple[str, str] = ("", "")) -> Profile:
    """Every measurement of the module docstring, as a profile."""
    if getattr(drafter_model.config, "target_hidden_size", 0):
        raise ValueError("the drafter reads target hidden states (DFlash-style): profile a D3D drafter")
    if drafter_model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter_model.config.vocab_size} != target's {target.config.vocab_size}")
    if not prompts:
        raise ValueError("no prompts for the acceptance run")
    previous = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    speculate_blocks = (settings.block_size, *settings.extra_blocks)
    drafter_columns = len(speculate_blocks) * len(settings.budgets) + len(settings.tails)
    runs = len(settings.acceptance_batches) + len(settings.extra_blocks)
    total = len(settings.batches) * (len(settings.tokens) + drafter_columns) + runs
    try:
        with tqdm(total=total, desc="bench profile", unit="point") as progress:
            target_table = measure_target(target, settings.batches, settings.tokens, context=settings.context,
                                          repeats=settings.repeats, progress=progress)
            draft_table, speculate_table, calls = measure_drafter(
                drafter_model, settings.batches, block_size=settings.block_size, speculate_blocks=speculate_blocks,
                budgets=settings.budgets, tails=settings.tails, context=settings.context, repeats=settings.repeats,
                progress=progress)
            progress.total = progress.n + 2 * len(settings.acceptance_batches) + len(settings.extra_blocks)  # dupes dropped
            runs, plain = [], []
            for batch in settings.acceptance_batches:
                progress.set_postfix_str(f"engine run batch {batch} block {settings.block_size}")
                runs.append(measure_acceptance(target, drafter_model, prompts, block_size=settings.block_size,
                                               batch=batch, max_tokens=settings.max_tokens))
                progress.update()
                progress.set_postfix_str(f"plain engine run batch {batch}")
                plain.append(measure_plain_overhead(target, prompts, batch=batch, max_tokens=settings.max_tokens))
                progress.update()
            by_block: dict[int, Acceptance] = {}
            for block in settings.extra_blocks:
                progress.set_postfix_str(f"engine run block {block}")
                run = measure_acceptance(target, drafter_model, prompts, block_size=block,
                                         batch=settings.acceptance_batches[-1], max_tokens=settings.max_tokens)
                by_block[block] = Acceptance(**{k: run[k] for k in ("acceptance_per_pos", "hit_rate", "tau")})
                progress.update()
    finally:
        torch.set_num_threads(previous)
    main_run = runs[-1]
    by_block[settings.block_size] = Acceptance(**{k: main_run[k] for k in ("acceptance_per_pos", "hit_rate", "tau")})
    # Engine overhead per step = step_seconds + seq_seconds * running sequences (a line through the runs).
    batches = [run["batch"] for run in runs]
    step_seconds, seq_seconds = _line(batches, [run["overhead_per_step"] for run in runs])
    plain_step_seconds, plain_seq_seconds = _line(batches, plain)
    return Profile(
        version=SCHEMA_VERSION,
        machine={"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                 "torch": torch.__version__, "threads": settings.threads, "device": "cpu",
                 "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        notes=("measured by `specd bench profile`: single-threaded passes (one pinned core per service), "
               f"fastest of {settings.repeats}; acceptance from greedy async engine runs on the zoo's held-out "
               "prompts; rpc_seconds is a parameter, not measured"),
        target=CostTable(name=names[0], context=settings.context, **target_table.to_json()),
        drafter=DrafterTable(name=names[1], group_sizes=list(drafter_model.config.group_sizes),
                             calls=[c for c in calls if c["call"] == "draft"], **draft_table.to_json()),
        speculate=CostTable(calls=[c for c in calls if c["call"] == "speculate"], **speculate_table.to_json()),
        block_size=settings.block_size,
        acceptance_per_pos=main_run["acceptance_per_pos"],
        confidence_per_pos=main_run["confidence_per_pos"],
        block_samples=main_run["block_samples"],
        hit_rate=main_run["hit_rate"],
        tau=main_run["tau"],
        candidate_budget=4,
        by_block=dict(sorted(by_block.items())),
        rpc_seconds=settings.rpc_seconds,
        overhead=Overhead(step_seconds=step_seconds, seq_seconds=seq_seconds, plain_step_seconds=plain_step_seconds,
                          plain_seq_seconds=plain_seq_seconds),
        padded_rows=True,
        workload=ObservedWorkload(prompt_tokens=[len(p) for p in prompts], output_tokens=main_run["output_tokens"],
                                  max_tokens=settings.max_tokens),
    )


def median_rounds(rounds: list[dict]) -> dict:
    """Rounds of `services.calibrate.measure_verifier_serving` as one: per level, each figure's
    median over the rounds (the trace is the same in every round: greedy, the same prompts in
    the same order); ``rounds_target_seconds`` keeps every round's mean pass seconds."""
    first = rounds[0]
    out = {"concurrency": list(first["concurrency"]), "trace": first["trace"]}
    for name, values in first.items():
        if name in out:
            continue
        out[name] = [statistics.median(r[name][i] for r in rounds) for i in range(len(values))]
    out["requests"] = [int(n) for n in out["requests"]]
    out["passes"] = [int(n) for n in out["passes"]]
    out["rounds_target_seconds"] = [[r["target_seconds"][i] for r in rounds] for i in range(len(first["concurrency"]))]
    return out


def add_scales(bare, columns: dict, prompt_lengths, outputs, *, mode: str = "async") -> None:
    """Per level of a `services.calibrate.measure_verifier_serving` run: ``target_scale``, its mean
    in-service pass over the simulator's mean pass for the same requests, replayed in the same
    order by the same closed loop (prefills included) — plain, or speculating with the block fixed
    at the measured mean verified length (``tokens_per_row``), so the ratio is the pass's, not the
    block choice's; speculating, also ``draft_scale``, its mean wait for a blocking Draft over the
    simulator's in that replay."""
    from specd.plan.sim import SimConfig, Workload, replayed, simulate

    scales, drafts = [], []
    for i, (concurrency, trace) in enumerate(zip(columns["concurrency"], columns["trace"])):
        requests = replayed(trace)
        if "tokens_per_row" in columns:
            block = max(1, round(columns["tokens_per_row"][i] - 1))
            config = SimConfig(mode=mode, drafters=1, block_size=block, adaptive_block=False, max_num_seqs=64)
        else:
            config = SimConfig(mode="plain", drafters=0, block_size=0, max_num_seqs=64)
        simulated = simulate(bare, config, Workload(requests=len(requests), concurrency=concurrency, trace=requests,
                                                    prompt_tokens=prompt_lengths, output_tokens=outputs))
        scales.append(round(columns["target_seconds"][i] / simulated.target_seconds_per_pass, 4))
        if "draft_seconds" in columns:
            wait = simulated.draft_wait_seconds_per_call
            drafts.append(round(columns["draft_seconds"][i] / wait, 4) if wait and columns["draft_seconds"][i] else 1.0)
    columns["target_scale"] = scales
    if "draft_seconds" in columns:
        columns["draft_scale"] = drafts


def _line(batches: list[int], seconds: list[float]) -> tuple[float, float]:
    """(per step, per running sequence) through two engine runs' overhead per step (first, last)."""
    if len(batches) < 2 or batches[-1] == batches[0]:
        return seconds[-1], 0.0
    per_seq = max((seconds[-1] - seconds[0]) / (batches[-1] - batches[0]), 0.0)
    return max(seconds[0] - per_seq * batches[0], 0.0), per_seq


def format_profile(profile: Profile) -> str:
    """The cost tables in milliseconds, and what speculation earns."""
    lines = []
    for table, what in ((profile.target, "target pass: columns = new tokens per row"),
                        (profile.drafter, "drafter Draft: columns = unseen context tokens + mask group"),
                        (profile.speculate, "drafter Speculate: columns = B<block>c<candidates>:tokens")):
        if table is None:
            continue
        heads = [str(t) for t in table.tokens]
        if table is profile.speculate and table.calls:
            heads = [f"B{c.block}c{c.candidates}:{c.tokens}" for c in table.calls]
        lines.append(f"\n{what} (ms; rows = batch)")
        width = max(8, *(len(h) + 1 for h in heads))
        lines.append(f"{'batch':>6}" + "".join(f"{h:>{width}}" for h in heads))
        for batch, row in zip(table.batch, table.seconds):
            lines.append(f"{batch:>6}" + "".join(f"{1000 * s:>{width}.2f}" for s in row))
    nan = float("nan")
    lines.append(f"\nblock {profile.block_size}: acceptance/pos "
                 + " ".join(f"{a:.2f}" for a in profile.acceptance_per_pos)
                 + f"  hit rate {profile.hit_rate:.2f}  tau {nan if profile.tau is None else profile.tau:.2f}")
    for block, entry in profile.by_block.items():
        lines.append(f"block {block}: tau {nan if entry.tau is None else entry.tau:.2f}  hit rate {entry.hit_rate:.2f}")
    services = profile.serving
    for columns, what in ((services.verifier, "plain"), (services.speculative, "speculating, async"),
                          (services.speculative_sync, "speculating, sync")):
        if columns is None:
            continue
        lines.append(f"\nverifier service ({what}, HTTP streams): rows, step time outside the pass, pass vs table, tok/s")
        for rows, overhead, scale, tokens_per_s in zip(columns.rows, columns.overhead_seconds, columns.target_scale,
                                                       columns.tokens_per_s or [nan] * len(columns.rows)):
            lines.append(f"  rows {rows:5.1f}: overhead {1000 * overhead:6.2f} ms/step, pass x{scale:.2f}, "
                         f"{tokens_per_s:.1f} tok/s")
        if columns.draft_scale:
            lines.append("  blocking Draft wait vs table: " + ", ".join(f"x{d:.2f}" for d in columns.draft_scale))
    overhead = profile.overhead
    if overhead.plain_step_seconds is not None:
        lines.append(f"engine overhead decoding plain: {1000 * overhead.plain_step_seconds:.2f} ms/step + "
                     f"{1000 * (overhead.plain_seq_seconds or 0.0):.3f} ms/sequence")
    lines.append(f"engine overhead: {1000 * overhead.step_seconds:.2f} ms/step + "
                 f"{1000 * overhead.seq_seconds:.3f} ms/sequence; rpc {1000 * profile.rpc_seconds:.2f} ms")
    return "\n".join(lines)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a coarse grid and a short engine run (minutes)")
    parser.add_argument("--target", default="", help="target model directory (default: the zoo's qwen3-tiny)")
    parser.add_argument("--drafter", default="", help="D3D drafter directory (default: the zoo's d3d-qwen3-tiny)")
    add_flags(parser, ProfileSettings, ("block_size", "context"),
              help={"block_size": "block the acceptance and Speculate calls use",
                    "context": "cached tokens before each timed pass"})
    parser.add_argument("--batches", default="", help=f"comma-separated batch sizes (default {','.join(map(str, TARGET_BATCHES))})")
    parser.add_argument("--tokens", default="", help=f"target tokens per sequence (default {','.join(map(str, TARGET_TOKENS))})")
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats per point (the fastest is kept; default 5, quick 3)")
    parser.add_argument("--rpc-ms", type=float, default=None,
                        help="network time one drafter round trip adds, ms (default 0 when the drafter is timed "
                             "through a replica, which includes loopback gRPC; 0.5 with --no-services)")
    add_flags(parser, ProfileSettings, ("rounds",),
              help={"rounds": "rounds of the verifier services' calibration; per level the median round"})
    parser.add_argument("--no-services", action="store_true",
                        help="time passes in this process only: skip the drafter round trips through a replica and "
                             "the verifier service's serving costs (services.calibrate)")
    parser.add_argument("--out", default="out/bench", help="directory for the JSON")
    parser.add_argument("--json", default=None, help="profile path (default OUT/profile.json)")


@dataclass(kw_only=True, slots=True)
class Measured:
    """The in-process profile with what was measured for it: the services' calibration
    (`services.calibrate`) adds to ``profile`` from here before `write`."""

    profile: Profile
    settings: ProfileSettings
    target_dir: Path
    drafter_dir: Path
    drafter: nn.Module
    pool: list[list[int]]
    """Every held-out prompt, in the order `specd bench serve` sends them."""


def measure(args: argparse.Namespace, *, services: bool = False) -> Measured:
    """The in-process part of `specd bench profile`, from its flags. ``services``: the services'
    calibration follows (then the drafter is timed through a replica, loopback gRPC included,
    and ``--rpc-ms`` defaults to 0)."""
    settings = ProfileSettings.quick() if args.quick else ProfileSettings()
    settings.block_size, settings.context = args.block_size, args.context
    if args.block_size < 1 or args.context < 1:
        raise ValueError(f"--block-size and --context must be >= 1, got {args.block_size} and {args.context}")
    settings.extra_blocks = tuple(b for b in settings.extra_blocks if b != args.block_size)
    if args.batches:
        settings.batches = _ints(args.batches, "--batches")
    if args.tokens:
        settings.tokens = _ints(args.tokens, "--tokens")
    if args.repeats:
        settings.repeats = args.repeats
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    settings.rounds = args.rounds
    rpc_ms = args.rpc_ms if args.rpc_ms is not None else (0.0 if services else 0.5)
    if rpc_ms < 0:
        raise ValueError(f"--rpc-ms must be >= 0, got {rpc_ms}")
    settings.rpc_seconds = rpc_ms / 1000
    target_dir = Path(args.target) if args.target else zoo.ensure("qwen3-tiny")
    drafter_dir = Path(args.drafter) if args.drafter else zoo.ensure("d3d-qwen3-tiny")
    target, drafter = load_model(target_dir), load_model(drafter_dir)
    max_block = max(drafter.config.group_sizes) - 1
    if settings.block_size > max_block:
        raise ValueError(f"--block-size {settings.block_size} is above the drafter's max_block {max_block}")
    settings.extra_blocks = tuple(b for b in settings.extra_blocks if b <= max_block)
    prompts = zoo_prompts(target_dir, settings.max_prompt_tokens, settings.prompts_per_domain)
    profile = measure_profile(target, drafter, prompts, settings, names=(target_dir.name, drafter_dir.name))
    pool = zoo_prompts(target_dir, settings.max_prompt_tokens)  # every held-out prompt, as bench serve sends them
    profile.workload.prompt_tokens = [len(p) for p in pool]
    return Measured(profile=profile, settings=settings, target_dir=target_dir, drafter_dir=drafter_dir,
                    drafter=drafter, pool=pool)


def write(profile: Profile, args: argparse.Namespace) -> int:
    """Check ``profile`` loads, print its tables, write it where ``--json`` / ``--out`` say."""
    parse_profile(profile.to_json(), source="the measured profile")  # what we write must load
    print(format_profile(profile))
    json_path = Path(args.json) if args.json else Path(args.out) / "profile.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    print(f"wrote {json_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """`specd bench profile` with no services installed: the in-process part only. The services
    register their own `bench profile` (`services.calibrate.run`, entry-point group
    ``specd.commands``), which takes this one's place and adds their calibration to this part."""
    if not args.no_services:
        print("specd bench profile: the services are not installed (no `bench.profile` in the entry-point group "
              "specd.commands), so their calibration is skipped: passes are timed in this process only, as with "
              "--no-services", file=sys.stderr)
    return write(measure(args).profile, args)
