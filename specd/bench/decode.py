"""`specd bench decode`: speculative decoding against plain decoding, side by side, in one run.

On the zoo's held-out prompts of each domain, at temperature 0 and 1, every method runs through
the same `SpeculativeEngine` code path:

- ``ar``         plain autoregressive decoding (the engine with no drafter): the baseline;
- ``ngram``      prompt-lookup drafting (what a drafter gets from the target repeating itself);
- ``dflash``     the DFlash-style drafter that reads target hidden states (sync: it must wait);
- ``d3d-sync``   the D3D drafter drafting after each verification;
- ``d3d-async``  the D3D drafter drafting the next block's candidates *during* verification;
- ``d3d-lookup``, ``d3d-lookup-async``  D3D with prompt lookup beside it, the block expected to
                 go further chosen per sequence and step (`specd.drafters.hybrid`), sync / async;
- ``hf``         the peer a CPU user would otherwise run: `transformers`' ``generate`` (batch 1,
                 same model weights, same threads, no stop token either side);
- ``hf-lookup``  ``generate`` with prompt lookup (``prompt_lookup_num_tokens=8``).

``--target smollm2-135m`` runs the real model, the prompts re-rendered with its own chat template
and tokenizer; its drafters (``d3d-smollm2-135m``, ``dflash-smollm2-135m``) are zoo steps built on
first use (see the README for how long that takes).

Reported per (method, domain, temperature, batch, block): τ (tokens per target pass per
sequence), acceptance per position, candidate hit rate, tokens/s, speedup over ``ar`` at the
same domain/temperature/batch (measured in this run — the machine is shared and noisy, so only
same-run ratios mean anything), and the engine's own overhead per step (time outside target
passes and blocking drafter calls). Output: a table, JSON, and PNG plots.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure  # object API: no pyplot state, no display backend
from tqdm import tqdm

from specd import precision, zoo
from specd.data import DOMAINS, load_tokenizer
from specd.data.chat import ChatTemplate, render_prompt
from specd.drafters.d3d import D3DDrafter
from specd.drafters.dflash import DFlashDrafter
from specd.drafters.hybrid import LookupHybridDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine
from specd.models.loading import load_model
from specd.sampling import SamplingParams

METHODS = ("ar", "ngram", "dflash", "d3d-sync", "d3d-async", "d3d-lookup", "d3d-lookup-async", "hf", "hf-lookup")
PEERS = ("hf", "hf-lookup")  # transformers' generate: batch 1 only
DRAFTERS = ("dflash", "d3d-sync", "d3d-async", "d3d-lookup", "d3d-lookup-async")  # need the target's zoo drafters
ASYNC = ("d3d-async", "d3d-lookup-async")  # draft during verification: half the cores each


@dataclass(kw_only=True, slots=True)
class DecodeSettings:
    target: str = "qwen3-tiny"
    prompts_per_domain: int = 8
    max_tokens: int = 96
    max_prompt_tokens: int = 192
    temperatures: tuple[float, ...] = (0.0, 1.0)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    block_sizes: tuple[int, ...] = (4, 8, 16)
    methods: tuple[str, ...] = METHODS
    domains: tuple[str, ...] = DOMAINS
    threads: int = 2
    """Intra-op threads of every method (the machine's cores; the async methods share them, `async_threads`)."""
    seeded: bool = False
    """Give every sampled request a seed (request i: seed i), so rows measure keyed sampling
    (`specd.sampling.verify_keyed`) instead of the rejection sampler unseeded traffic takes."""
    fixed_block: bool = False
    """Verify every drafted block at its full length, every step (acceptance by position at that
    block), instead of the cost model's choice of length and of whether to draft at all."""
    draft_headroom: int | None = None
    """`EngineConfig.draft_headroom`: draft the cost model's last chosen length plus this many
    tokens (None: the full block)."""
    candidate_budget: int = 4
    """`EngineConfig.candidate_budget`: most outcomes drafted ahead per sequence (async)."""
    async_threads: int = 1
    """The async methods' `EngineConfig.async_target_threads`: the target pass and the drafter's
    candidate pass run at the same time, so each gets this many threads instead of both fighting
    for all the cores; a step the cost model runs plain gets all ``threads``."""

    @staticmethod
    def quick() -> "DecodeSettings":
        return DecodeSettings(prompts_per_domain=4, max_tokens=64, batch_sizes=(1,), block_sizes=(8,))


@dataclass(kw_only=True, slots=True)
class DecodeRow:
    method: str
    domain: str
    temperature: float
    batch: int
    block: int
    """The longest block the engine may verify (its cost model picks each step's, down to 0)."""
    tau: float
    acceptance_per_pos: list[float]
    hit_rate: float
    tokens: int
    seconds: float
    tokens_per_second: float
    overhead_ms_per_step: float
    target_passes: int
    threads: int
    verified_block: float = 0.0
    """Mean drafted tokens verified per sequence per pass, plain steps as 0 (what the cost model chose)."""
    drafted: float = 0.0
    """Share of sequence passes that verified a drafted block (the rest the cost model ran plain)."""
    fixed_block: bool = False
    """Every block verified at full length (``--fixed-block``), not the cost model's choice."""
    target_ms_per_pass: float = 0.0
    """Mean seconds of a target pass (ms), at this row's threads: what a verification costs."""
    blocking_ms_per_step: float = 0.0
    """Mean ms per step the target waited for the drafter (blocking drafts, an unfinished candidate pass)."""
    lookup_share: float = 0.0
    """For the hybrids: the share of freshly drafted blocks that prompt lookup supplied."""
    speedup: float = field(default=1.0)
    full_batch_tok_s: float = 0.0
    """Tokens/s of the steps in which every row was busy (`EngineStats.full_batch_rate`): what a
    server at this concurrency sustains while requests keep coming, without the drain at the end
    of a finite batch (speculation drains unevenly: its sequences finish at different steps)."""
    full_batch_share: float = 0.0
    """Share of the run's seconds spent in full-batch steps."""
    full_batch_speedup: float = float("nan")
    """``full_batch_tok_s`` over ar's in the same case."""


class _Models:
    """Loads each model the run's methods need, once for the whole run."""

    def __init__(self, target: str, methods: tuple[str, ...]) -> None:
        self.target_dir = zoo.ensure(target)
        self.target = load_model(self.target_dir)
        # Drafters in bf16 where the CPU computes it (`precision.drafter_dtype`), both kinds alike.
        dtype = precision.drafter_dtype()
        self.d3d = load_model(zoo.ensure(f"d3d-{target}"), dtype=dtype) if set(DRAFTERS[1:]) & set(methods) else None
        self.dflash = load_model(zoo.ensure(f"dflash-{target}"), dtype=dtype) if "dflash" in methods else None
        self.hf = None
        if set(PEERS) & set(methods):
            try:
                import transformers
            except ImportError as error:
                raise ValueError("the hf and hf-lookup rows need transformers: pip install 'specd[test]' "
                                 "(or drop them with --methods)") from error
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()

    def drafter(self, method: str, batch: int):
        if method == "ar":
            return None
        if method == "ngram":
            return NgramDrafter(vocab_size=self.target.config.vocab_size)
        if method == "dflash":
            return DFlashDrafter(self.dflash, max_num_seqs=batch)
        if method in ("d3d-lookup", "d3d-lookup-async"):
            return LookupHybridDrafter(D3DDrafter(self.d3d, max_num_seqs=batch))
        return D3DDrafter(self.d3d, max_num_seqs=batch)


def domain_prompts(settings: DecodeSettings, target_dir: Path | None = None) -> dict[str, list[list[int]]]:
    """The held-out prompts of the run's domains as the target's token ids (`heldout_prompts`)."""
    return heldout_prompts(target_dir or zoo.model_path(settings.target), per_domain=settings.prompts_per_domain,
                           max_prompt_tokens=settings.max_prompt_tokens, domains=settings.domains)


def heldout_prompts(target_dir: Path, *, per_domain: int | None = None, max_prompt_tokens: int = 192,
                    domains: tuple[str, ...] = DOMAINS) -> dict[str, list[list[int]]]:
    """The zoo's held-out prompts of each domain (the first ``per_domain``; None: all) as the
    target's token ids: a chat prompt re-rendered with the target's own template (SmolLM2 adds
    its system turn), any other text as it is; the last ``max_prompt_tokens`` of each."""
    tokenizer = load_tokenizer(target_dir)
    template = ChatTemplate.from_dir(target_dir)
    prompts = {}
    for domain, items in zoo.heldout().items():
        if domain not in domains:
            continue
        prompts[domain] = [tokenizer.encode(render_prompt(item.prompt, template)).ids[-max_prompt_tokens:]
                           for item in items[:per_domain]]
    return prompts


def run_case(models: _Models, method: str, prompts: list[list[int]], *, temperature: float, batch: int,
             block: int, max_tokens: int, threads: int, seeded: bool = False, fixed_block: bool = False,
             draft_headroom: int | None = None, candidate_budget: int = 4, async_threads: int = 1) -> DecodeRow:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_case(models, method, prompts, temperature=temperature, batch=batch, block=block,
                         max_tokens=max_tokens, threads=threads, seeded=seeded, fixed_block=fixed_block,
                         draft_headroom=draft_headroom, candidate_budget=candidate_budget,
                         async_threads=async_threads)
    finally:
        torch.set_num_threads(previous_threads)


def _run_peer(models: _Models, method: str, prompts: list[list[int]], *, temperature: float,
              max_tokens: int, threads: int) -> DecodeRow:
    """transformers' ``generate``, one prompt at a time, exactly ``max_tokens`` new tokens."""
    from transformers import GenerationConfig

    lookup = {"prompt_lookup_num_tokens": 8} if method == "hf-lookup" else {}
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        # No EOS: every method generates the same number of tokens (specd runs without stop tokens).
        config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, **sampling, **lookup)
        torch.manual_seed(i)
        start = time.perf_counter()
        with torch.inference_mode():
            out = models.hf.generate(torch.tensor([prompt]), generation_config=config)
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - len(prompt)
    return DecodeRow(
        method=method, domain="", temperature=temperature, batch=1, block=0, tau=float("nan"), acceptance_per_pos=[],
        hit_rate=float("nan"), tokens=tokens, seconds=seconds, tokens_per_second=tokens / seconds,
        overhead_ms_per_step=float("nan"), target_passes=0, threads=threads,
    )


def _run_case(models: _Models, method: str, prompts: list[list[int]], *, temperature: float, batch: int,
              block: int, max_tokens: int, threads: int, seeded: bool = False, fixed_block: bool = False,
              draft_headroom: int | None = None, candidate_budget: int = 4, async_threads: int = 1) -> DecodeRow:
    if method in PEERS:
        return _run_peer(models, method, prompts, temperature=temperature, max_tokens=max_tokens, threads=threads)
    drafter = models.drafter(method, batch)
    mode = "async" if method in ASYNC else "sync"
    config = EngineConfig(max_num_seqs=batch, block_size=0 if method == "ar" else block, mode=mode,
                          adaptive_block=not fixed_block, draft_headroom=draft_headroom,
                          candidate_budget=candidate_budget,
                          async_target_threads=async_threads if mode == "async" else None)
    engine = SpeculativeEngine(models.target, drafter, config)
    # Unseeded by default: a sampled request without a seed is verified by the rejection sampler, as
    # most traffic is; ``seeded`` measures the keyed path (`specd.sampling.verify_keyed`:
    # reproducible whatever drafts). Greedy rows ignore seeds.
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if seeded else None)
              for i in range(len(prompts))]
    start = time.perf_counter()
    generations = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    engine.close()
    stats = engine.stats
    tokens = sum(len(g.token_ids) for g in generations)
    chosen = drafter.num_chosen if isinstance(drafter, LookupHybridDrafter) else None
    return DecodeRow(
        method=method, domain="", temperature=temperature, batch=batch, block=block if method != "ar" else 0,
        tau=stats.tau, acceptance_per_pos=stats.acceptance_per_pos, hit_rate=stats.hit_rate, tokens=tokens,
        seconds=seconds, tokens_per_second=tokens / seconds, overhead_ms_per_step=1000 * stats.overhead_per_step,
        target_passes=stats.num_target_passes, threads=threads,
        verified_block=stats.num_draft_tokens / stats.num_sequence_passes if stats.num_sequence_passes else 0.0,
        drafted=stats.num_drafts / stats.num_sequence_passes if stats.num_sequence_passes else 0.0,
        fixed_block=fixed_block,
        lookup_share=chosen["lookup"] / max(sum(chosen.values()), 1) if chosen else 0.0,
        target_ms_per_pass=1000 * stats.seconds_target / max(stats.num_target_passes, 1),
        blocking_ms_per_step=1000 * stats.seconds_drafter_blocking / max(stats.num_steps, 1),
        full_batch_tok_s=stats.full_batch_rate, full_batch_share=stats.full_batch_seconds / seconds,
    )


def bench_decode(settings: DecodeSettings) -> list[DecodeRow]:
    torch.manual_seed(0)
    if settings.target not in {m.name for m in zoo.MODELS if m.kind == "target"}:
        raise ValueError(f"no zoo target named {settings.target!r}: use one of `specd zoo list`")
    if set(DRAFTERS) & set(settings.methods) and not any(m.name == f"d3d-{settings.target}" for m in zoo.MODELS):
        raise ValueError(f"the zoo has no drafters for {settings.target}: choose --methods from ar,ngram,hf,hf-lookup")
    models = _Models(settings.target, settings.methods)
    prompts = domain_prompts(settings, models.target_dir)
    # Warm up every code path once (allocations, first-call overheads).
    for method in settings.methods:
        run_case(models, method, prompts[settings.domains[0]][:1], temperature=0.0, batch=1,
                 block=min(settings.block_sizes), max_tokens=16, threads=settings.threads)
    cases = [
        (domain, temperature, batch, block, method)
        for domain in settings.domains
        for temperature in settings.temperatures
        for batch in settings.batch_sizes
        for block in settings.block_sizes
        for method in settings.methods
        # Plain decoding and the peers have no block; the peers run batch 1 only.
        if not (method in ("ar", *PEERS) and block != settings.block_sizes[0])
        and not (method in PEERS and batch != 1)
    ]
    rows = []
    for domain, temperature, batch, block, method in tqdm(cases, desc="bench decode", unit="case"):
        # Repeat prompts so every batch size sees at least two full batches of work.
        work = (prompts[domain] * (2 * batch // len(prompts[domain]) + 1))[: max(len(prompts[domain]), 2 * batch)]
        row = run_case(models, method, work, temperature=temperature, batch=batch, block=block,
                       max_tokens=settings.max_tokens, threads=settings.threads, seeded=settings.seeded,
                       fixed_block=settings.fixed_block, draft_headroom=settings.draft_headroom,
                       candidate_budget=settings.candidate_budget, async_threads=settings.async_threads)
        row.domain = domain
        rows.append(row)
    # Speedup: over specd's own plain decoding in this run (a peer's row too: < 1 means specd is faster).
    baseline = {(r.domain, r.temperature, r.batch): r.tokens_per_second for r in rows if r.method == "ar"}
    full = {(r.domain, r.temperature, r.batch): r.full_batch_tok_s for r in rows if r.method == "ar"}
    for row in rows:  # without an ar row for its case (--methods left it out): no speedup
        plain = baseline.get((row.domain, row.temperature, row.batch))
        row.speedup = row.tokens_per_second / plain if plain else float("nan")
        plain_full = full.get((row.domain, row.temperature, row.batch))
        if plain_full and row.full_batch_tok_s:
            row.full_batch_speedup = row.full_batch_tok_s / plain_full
    return rows


def summary(rows: list[DecodeRow], *, batch: int, block: int, temperature: float) -> dict[str, dict[str, float]]:
    """Per method, averaged over domains: tau, speedup, tokens/s, hit rate."""
    out = {}
    for method in METHODS:
        chosen = [r for r in rows if r.method == method and r.batch == batch and r.temperature == temperature
                  and (r.block == block or method in ("ar", *PEERS))]
        if chosen:
            mean = lambda key: sum(getattr(r, key) for r in chosen) / len(chosen)  # noqa: E731
            out[method] = {k: mean(k) for k in ("tau", "speedup", "tokens_per_second", "hit_rate", "overhead_ms_per_step",
                                                "full_batch_speedup")}
    return out


def format_table(rows: list[DecodeRow]) -> str:
    head = (f"{'method':<16} {'domain':<9} {'T':>3} {'thr':>3} {'batch':>5} {'block':>5} {'used':>5} {'drft':>5} {'tau':>6} {'hit':>5} "
            f"{'tok/s':>8} {'speedup':>8} {'full x':>7} {'ovh ms':>7} {'pass ms':>7} {'wait ms':>7}  acceptance/pos")
    lines = [head, "-" * len(head)]
    for r in rows:
        acceptance = " ".join(f"{a:.2f}" for a in r.acceptance_per_pos[:8])
        lines.append(
            f"{r.method:<16} {r.domain:<9} {r.temperature:>3.1f} {r.threads:>3} {r.batch:>5} {r.block:>5} {r.verified_block:>5.2f} "
            f"{r.drafted:>5.2f} "
            f"{r.tau:>6.2f} {r.hit_rate:>5.2f} "
            f"{r.tokens_per_second:>8.1f} {r.speedup:>7.2f}x {r.full_batch_speedup:>6.2f}x {r.overhead_ms_per_step:>7.2f} {r.target_ms_per_pass:>7.1f} "
            f"{r.blocking_ms_per_step:>7.1f}  {acceptance}"
        )
    return "\n".join(lines)


def format_summary(rows: list[DecodeRow], settings: DecodeSettings) -> str:
    """Per batch size and temperature, the means over domains, then how the run compares with
    the goals a user would check: the best D3D mode against plain decoding and against
    transformers' prompt lookup, async against sync, and at batch > 1 no method below plain."""
    block = 8 if 8 in settings.block_sizes else settings.block_sizes[0]
    d3d_modes = ("d3d-sync", "d3d-async", "d3d-lookup", "d3d-lookup-async")
    lines = []
    for batch in settings.batch_sizes:
        for temperature in settings.temperatures:
            goals = summary(rows, batch=batch, block=block, temperature=temperature)
            if not goals:
                continue
            lines.append(f"\nmean over domains, batch {batch}, block {block}, temperature {temperature}:")
            lines.append(f"{'method':<16} {'tau':>6} {'speedup':>8} {'tok/s':>8} {'hit':>5} {'ovh ms':>7} {'full batch':>10}")
            for method, s in goals.items():
                lines.append(f"{method:<16} {s['tau']:>6.2f} {s['speedup']:>7.2f}x {s['tokens_per_second']:>8.1f} "
                             f"{s['hit_rate']:>5.2f} {s['overhead_ms_per_step']:>7.2f} {s['full_batch_speedup']:>9.2f}x")
            rate = lambda m: goals[m]["tokens_per_second"]  # noqa: E731
            checks = []
            if {"hf", "ar"} <= goals.keys():
                checks.append(f"specd plain / transformers plain = {rate('ar') / rate('hf'):.2f}x (>= 1.0)")
            modes = [m for m in d3d_modes if m in goals]
            if modes and batch == 1:
                best = max(modes, key=rate)
                checks.append(f"best D3D mode ({best}) / ar = {goals[best]['speedup']:.2f}x (>= 1.5)")
                if "hf-lookup" in goals:
                    checks.append(f"{best} / transformers prompt lookup = {rate(best) / rate('hf-lookup'):.2f}x (>= 1.2)")
                if {"d3d-async", "d3d-sync"} <= goals.keys():
                    checks.append(f"D3D async / sync = {rate('d3d-async') / rate('d3d-sync'):.2f}x (>= 1.1)")
            if batch > 1:
                worst = min((m for m in goals if m != "ar"), key=lambda m: goals[m]["speedup"], default=None)
                if worst is not None:
                    checks.append(f"slowest speculative method ({worst}) / ar = {goals[worst]['speedup']:.2f}x (>= 0.95)")
                # (nan: a row without a full-batch step, or its case without an ar row)
                measured = [m for m in goals if m != "ar" and not math.isnan(goals[m]["full_batch_speedup"])]
                steady = min(measured, key=lambda m: goals[m]["full_batch_speedup"], default=None)
                if steady is not None:
                    checks.append(f"at full batch (every row busy): slowest ({steady}) / ar = "
                                  f"{goals[steady]['full_batch_speedup']:.2f}x (>= 0.95)")
            if {"d3d-sync", "dflash"} <= goals.keys():
                checks.append(f"D3D tau / DFlash-style tau = {goals['d3d-sync']['tau'] / goals['dflash']['tau']:.2f}")
            lines.extend(f"  {check}" for check in checks)
    return "\n".join(lines)


def plot(rows: list[DecodeRow], settings: DecodeSettings, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    batch, block = settings.batch_sizes[0], 8 if 8 in settings.block_sizes else settings.block_sizes[0]
    paths = []
    # tau per domain, per method (batch 1, temperature 0).
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    methods = [m for m in settings.methods if m != "ar"]
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        taus = [next((r.tau for r in rows if r.method == method and r.domain == d and r.batch == batch
                      and r.block == block and r.temperature == 0.0), 0.0) for d in settings.domains]
        ax.bar([j + i * width for j in range(len(settings.domains))], taus, width, label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(settings.domains))], settings.domains)
    ax.set_ylabel("tau (tokens / target pass)")
    ax.set_title(f"tau per domain (batch {batch}, block {block}, T=0)")
    ax.legend()
    paths.append(_save(fig, out_dir / "tau_per_domain.png"))
    # Acceptance per position.
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for method in methods:
        chosen = [r.acceptance_per_pos for r in rows if r.method == method and r.batch == batch and r.block == block and r.temperature == 0.0]
        if chosen:
            length = min(len(c) for c in chosen)
            ax.plot(range(1, length + 1), [sum(c[i] for c in chosen) / len(chosen) for i in range(length)], marker="o", label=method)
    ax.set_xlabel("block position")
    ax.set_ylabel("P(accepted)")
    ax.set_title(f"acceptance per position (batch {batch}, block {block}, T=0)")
    ax.legend()
    paths.append(_save(fig, out_dir / "acceptance_per_position.png"))
    # Speedup vs batch: only where the run has plain decoding to divide by (``--methods`` with ar).
    if not any(r.method == "ar" for r in rows):
        return paths
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for method in methods:
        points = []
        for b in settings.batch_sizes:
            chosen = [r.speedup for r in rows if r.method == method and r.batch == b and r.block == block
                      and r.temperature == 0.0 and not math.isnan(r.speedup)]
            if chosen:
                points.append((b, sum(chosen) / len(chosen)))
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over AR (same run)")
    ax.set_title(f"speedup vs batch (block {block}, T=0)")
    ax.legend()
    paths.append(_save(fig, out_dir / "speedup_vs_batch.png"))
    return paths


def _json_row(row: DecodeRow) -> dict:
    """A row as JSON, with the short names dashboards use beside the long ones: ``tok_s``,
    ``accept_per_pos``, and ``mean_verified_block`` (``block`` is the most a pass may verify)."""
    out = asdict(row)
    out.update(tok_s=row.tokens_per_second, accept_per_pos=row.acceptance_per_pos,
               mean_verified_block=row.verified_block)
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(settings: DecodeSettings, out_dir: Path, json_path: Path | None) -> list[DecodeRow]:
    rows = bench_decode(settings)
    print(format_table(rows))
    print(format_summary(rows, settings))
    payload = {"settings": asdict(settings), "rows": [_json_row(r) for r in rows]}
    json_path = json_path or out_dir / "decode.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    for path in plot(rows, settings, out_dir):
        print(f"wrote {path}")
    print(f"wrote {json_path}")
    return rows
