"""`specd plan`: how many drafters per verifier, and which block length, for a GPU budget.

For a budget of ``gpus`` less the trainer's ``trainer_gpus`` (a verifier replica takes
``tensor_parallel`` GPUs, a drafter replica ``gpus_per_drafter``), the planner simulates
(`specd.plan.sim`) every drafter:verifier split
the budget allows — all of them up to 16 verifier replicas, else a list of ratios up to 3:1,
extended (4:1, 6:1, ...) while the best split is the one with the most drafters, or the
``--ratios`` given — at every block length, plus plain decoding on the whole budget, under
the same load. It prints the table and picks the highest tokens/s, optionally among the splits
whose TPOT p99 meets ``--tpot-slo-ms`` (under open-loop arrivals, where every split that keeps
up serves the same tokens/s: the lowest TPOT p99 within 2% of the best). It writes a Helm values
override for the chart (`deploy/k8s/specd`: ``drafter.replicas``, ``verifier.replicas``,
``verifier.tensorParallel``, ``verifier.extraArgs``, and with trainer GPUs ``trainer.dataParallel``)
and a PNG of throughput against the ratio, per block and per load level.

Tensor parallelism. A verifier of N ranks is one replica on N GPUs (``--tensor-parallel``, which
also replaces the older ``--gpus-per-verifier``: a replica's GPUs are its ranks). The profile's
target table is one GPU's; an N-rank pass costs the table times the profile's measured
``tensor_parallel.N.pass_scale`` when it has one, else the table / N (weights and work split
evenly) plus ``tp_allreduce_seconds`` per pass: Megatron-style layers all-reduce twice each (after
attention and after the MLP), and a small all-reduce over NVLink takes ~10 us, so the default
720 us is a 36-layer (Qwen3-8B-class) target's 72 all-reduces. That is latency only: an
all-reduce's bytes grow with rows x tokens x hidden size, which the assumption leaves out, so
large passes come out optimistic; the table says which of the two was used. Drafters stay on one
GPU each. What TP also buys and the planner does not see: KV-cache room for more rows per verifier
(raise ``--max-num-seqs`` yourself if so).

A split uses its GPUs fully where it can: for a ratio r = D/V, V = floor(N / (g_v + r g_d)) and
D takes what is left. Figures are as good as the profile; the planner cannot see what the profile
does not hold (a drafter pass bigger than the table extends linearly, acceptance past the measured
block carries the last conditional rate on).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from specd.flags import add_flags, default_of, from_flags
from specd.plan.compare import compare_serve, format_compare, write_compare
from specd.plan.profile import Profile, bench_acceptance, load_profile, with_acceptance
from specd.plan.sim import Lengths, SimConfig, SimResult, TraceRequest, Workload, load_trace, simulate

DEFAULT_TP_ALLREDUCE_SECONDS = 36 * 2 * 10e-6
"""Assumed all-reduce time per tensor-parallel pass: 36 layers x 2 all-reduces x 10 us (NVLink)."""
DEFAULT_RATIOS = ("1:8", "1:6", "1:4", "1:3", "1:2", "2:3", "1:1", "3:2", "2:1", "3:1")
"""Drafters:verifiers tried when the budget holds more than `ENUMERATE_UP_TO` verifiers."""
FURTHER_RATIOS = ("4:1", "6:1", "8:1", "12:1", "16:1")
"""Tried in turn, past the defaults, while the best split is the one with the most drafters."""
ENUMERATE_UP_TO = 16


@dataclass(kw_only=True, slots=True)
class Split:
    verifiers: int
    drafters: int

    @property
    def ratio(self) -> float:
        return self.drafters / self.verifiers


@dataclass(kw_only=True)
class PlanSettings:
    gpus: int
    """The whole budget, the trainer's GPUs included."""
    tensor_parallel: int = 1
    """Ranks, and so GPUs, per verifier replica (the chart's ``verifier.tensorParallel``)."""
    tp_allreduce_seconds: float = DEFAULT_TP_ALLREDUCE_SECONDS
    """Per-pass all-reduce seconds of a tensor-parallel pass when the profile has no measured scale."""
    trainer_gpus: int = 0
    """GPUs of the data-parallel trainer (``trainer.dataParallel``), off the budget; 0 = none counted."""
    gpus_per_drafter: int = 1
    concurrency: int = 0
    rate: float = 0.0
    trace: list[TraceRequest] | None = None
    """Requests' lengths (and arrival times: then it is the load) from a trace (`load_trace`)."""
    block_sizes: tuple[int, ...] = (2, 4, 8, 16)
    ratios: tuple[str, ...] = ()
    """Drafters:verifiers ("1:2", "0.5"); empty = every split (or `DEFAULT_RATIOS` on big budgets)."""
    mode: str = "async"
    requests: int = 0
    """Requests per simulation (0: 4 x concurrency, at least 256; 1024 for Poisson arrivals)."""
    prompt_tokens: str = ""
    output_tokens: str = ""
    """Length specs (`Lengths.parse`); empty = the profile's observed workload, else 128 / 256."""
    max_num_seqs: int = 64
    """Verifier rows (the chart's ``verifier.config.max_num_seqs``)."""
    adaptive_block: bool = True
    padded_rows: bool | None = None
    tpot_slo: float = 0.0
    """Seconds; TPOT p99 must not exceed it (0 = no SLO)."""
    plain: bool = True
    """Also simulate plain decoding on the whole budget (the baseline, and a valid choice)."""
    seed: int = 0

    @property
    def gpus_per_verifier(self) -> int:
        return self.tensor_parallel

    @property
    def serving_gpus(self) -> int:
        """The budget for verifiers and drafters: what the trainer leaves."""
        return self.gpus - self.trainer_gpus

    def validate(self) -> None:
        tp = self.tensor_parallel
        if tp < 1 or tp & (tp - 1):
            raise ValueError(f"--tensor-parallel must be a power of two >= 1 (the target's heads split evenly over "
                             f"the ranks; the chart's verifier.tensorParallel), got {tp}")
        if self.gpus_per_drafter < 1:
            raise ValueError("--gpus-per-drafter must be >= 1")
        if self.trainer_gpus < 0:
            raise ValueError(f"--trainer-gpus must be >= 0, got {self.trainer_gpus}")
        if self.tp_allreduce_seconds < 0:
            raise ValueError(f"--tp-allreduce-us must be >= 0, got {self.tp_allreduce_seconds * 1e6:g}")
        if self.serving_gpus < tp:
            trainer = f" after the trainer's {self.trainer_gpus}" if self.trainer_gpus else ""
            raise ValueError(f"--gpus {self.gpus} cannot hold one verifier replica ({tp} GPUs at --tensor-parallel "
                             f"{tp}){trainer}: raise --gpus, lower --tensor-parallel"
                             + (" or --trainer-gpus" if self.trainer_gpus else ""))
        timed = self.trace is not None and all(t.arrival_seconds is not None for t in self.trace)
        if sum((self.concurrency > 0, self.rate > 0, timed)) != 1:
            raise ValueError("give the load as exactly one of --concurrency C (closed loop), --rate R (requests/s), "
                             "or --trace FILE with arrival_seconds on every line")
        if not self.block_sizes or min(self.block_sizes) < 1:
            raise ValueError(f"--block-sizes must be positive integers, got {self.block_sizes}")
        if self.tpot_slo < 0:
            raise ValueError(f"--tpot-slo-ms must be >= 0, got {self.tpot_slo * 1000}")

    def workload(self, profile: Profile, load: float | None = None) -> Workload:
        """The load (``load`` overrides the concurrency or rate, for the plot's levels)."""
        observed = profile.workload
        prompt = self.prompt_tokens or (observed.prompt_tokens if observed.prompt_tokens else "128")
        output = self.output_tokens or (observed.output_tokens if observed.output_tokens else "256")
        lengths = {"prompt_tokens": Lengths.parse(prompt), "output_tokens": Lengths.parse(output), "trace": self.trace}
        if self.concurrency:
            concurrency = max(1, round(load if load is not None else self.concurrency))
            return Workload(requests=self.requests or max(4 * concurrency, 256), concurrency=concurrency, **lengths)
        if self.rate:
            return Workload(requests=self.requests or 1024, rate=load if load is not None else self.rate, **lengths)
        return Workload(**lengths)  # the trace's own arrivals


def parse_ratio(text: str) -> Fraction:
    """"D:V" (drafters:verifiers) or a number D/V; ValueError for anything else."""
    text = text.strip()
    try:
        if ":" in text:
            drafters, verifiers = (int(p) for p in text.split(":"))
            if verifiers < 1:
                raise ZeroDivisionError
            ratio = Fraction(drafters, verifiers)
        else:
            ratio = Fraction(text).limit_denominator(64)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"bad ratio {text!r}: write drafters:verifiers (1:2, 2:1) or a number (0.5), "
                         "with at least one verifier") from None
    if ratio < 0 or ratio > 64:
        raise ValueError(f"bad ratio {text!r}: drafters per verifier must be in [0, 64]")
    return ratio


def splits(settings: PlanSettings) -> list[Split]:
    """Drafter:verifier splits of the budget, each with at least one verifier and one drafter."""
    gpus, gv, gd = settings.serving_gpus, settings.gpus_per_verifier, settings.gpus_per_drafter
    if settings.ratios:
        ratios = [parse_ratio(r) for r in settings.ratios]
    elif gpus // gv <= ENUMERATE_UP_TO:
        out = [Split(verifiers=v, drafters=(gpus - v * gv) // gd) for v in range(1, gpus // gv + 1)]
        return [s for s in out if s.drafters >= 1]
    else:
        ratios = [parse_ratio(r) for r in DEFAULT_RATIOS]
    out: list[Split] = []
    for ratio in ratios:
        split = split_for_ratio(settings, ratio)
        if split is not None and split not in out:
            out.append(split)
    return out


def split_for_ratio(settings: PlanSettings, ratio: Fraction) -> Split | None:
    """The split of the budget at drafters:verifiers ``ratio`` (module docstring), or None where
    the ratio is plain decoding (0) or leaves no whole verifier next to a drafter."""
    gpus, gv, gd = settings.serving_gpus, settings.gpus_per_verifier, settings.gpus_per_drafter
    if ratio == 0:
        return None  # plain decoding: its own row
    verifiers = int(gpus / (gv + float(ratio) * gd))
    verifiers = min(verifiers, (gpus - gd) // gv)  # room for at least one drafter
    if verifiers < 1:
        return None
    return Split(verifiers=verifiers, drafters=(gpus - verifiers * gv) // gd)


@dataclass(kw_only=True, slots=True)
class PlanRow:
    split: Split
    block_size: int
    mode: str
    result: SimResult
    meets_slo: bool = True


@dataclass(kw_only=True)
class Plan:
    rows: list[PlanRow]
    best: PlanRow
    plain: PlanRow | None
    levels: dict[float, list[PlanRow]] = field(default_factory=dict)
    """Load level -> rows at the best block (for the plot)."""
    notes: list[str] = field(default_factory=list)
    """What the figures assume beyond the profile (printed above the table)."""


def tensor_parallel_profile(profile: Profile, ranks: int, allreduce_seconds: float) -> tuple[Profile, str]:
    """``profile`` with the target pass of a verifier of ``ranks`` GPUs, and how it was scaled.

    The measured ``tensor_parallel[ranks]`` pass scale when the profile has one; else the ideal
    split plus a fixed all-reduce time per pass (module docstring)."""
    if ranks == 1:
        return profile, ""
    table = profile.target
    if ranks in profile.tensor_parallel:
        scale = profile.tensor_parallel[ranks].pass_scale
        seconds = [[s * scale for s in row] for row in table.seconds]
        how = f"target pass x {scale:g} (the profile's measured pass_scale)"
    else:
        seconds = [[s / ranks + allreduce_seconds for s in row] for row in table.seconds]
        how = (f"target pass = one GPU's / {ranks} + {allreduce_seconds * 1e6:.0f} us of all-reduces (assumed: an even "
               f"split, latency-bound all-reduces; no measured tensor_parallel.{ranks}.pass_scale in the profile)")
    target = table.with_seconds(seconds)
    return (profile.model_copy(update={"target": target}),
            f"verifiers: tensor parallel {ranks} ({ranks} GPUs each), {how}")


def _config(settings: PlanSettings, split: Split, block: int, mode: str) -> SimConfig:
    return SimConfig(mode=mode, verifiers=split.verifiers, drafters=split.drafters if mode != "plain" else 0,
                     block_size=block if mode != "plain" else 0, max_num_seqs=settings.max_num_seqs,
                     adaptive_block=settings.adaptive_block,
                     padded_rows=settings.padded_rows, seed=settings.seed)


def plan(profile: Profile, settings: PlanSettings, *, levels: tuple[float, ...] = (), progress: bool = True) -> Plan:
    """Simulate every candidate; the best by tokens/s (under the SLO when one is set)."""
    settings.validate()
    profile, tp_note = tensor_parallel_profile(profile, settings.tensor_parallel, settings.tp_allreduce_seconds)
    notes = [tp_note] if tp_note else []
    if settings.trainer_gpus:
        notes.append(f"trainer: {settings.trainer_gpus} GPUs (data parallel) off the {settings.gpus}, "
                     f"{settings.serving_gpus} for verifiers and drafters")
    groups = sorted(profile.drafter.group_sizes)
    if groups and max(settings.block_sizes) > groups[-1] - 1:
        raise ValueError(f"block {max(settings.block_sizes)} is above the drafter's largest block "
                         f"{groups[-1] - 1} (its mask groups: {groups}): lower --block-sizes")
    candidates = splits(settings)
    plain_split = Split(verifiers=settings.serving_gpus // settings.gpus_per_verifier, drafters=0)
    if settings.ratios and not candidates and any(parse_ratio(r) > 0 for r in settings.ratios):
        raise ValueError(f"none of the ratios {', '.join(settings.ratios)} fits in {settings.serving_gpus} GPUs "
                         f"({settings.gpus_per_verifier} per verifier, {settings.gpus_per_drafter} per drafter)")
    if not candidates and not settings.plain:
        raise ValueError(f"{settings.serving_gpus} GPUs leave no room for a drafter next to a verifier "
                         f"({settings.gpus_per_verifier} + {settings.gpus_per_drafter} GPUs) and plain decoding is off")
    jobs = [(split, block, settings.mode) for split in candidates for block in settings.block_sizes]
    if settings.plain:
        jobs.insert(0, (plain_split, 0, "plain"))
    workload = settings.workload(profile)

    def simulated(jobs: list[tuple[Split, int, str]], desc: str) -> list[PlanRow]:
        out = []
        for split, block, mode in tqdm(jobs, desc=desc, unit="sim", disable=not progress):
            result = simulate(profile, _config(settings, split, block, mode), workload)
            meets = not settings.tpot_slo or result.tpot_p99 <= settings.tpot_slo
            out.append(PlanRow(split=split, block_size=block, mode=mode, result=result, meets_slo=meets))
        return out

    rows = simulated(jobs, "specd plan")
    if not settings.ratios and settings.serving_gpus // settings.gpus_per_verifier > ENUMERATE_UP_TO:
        rows, candidates = _extend_past_the_edge(settings, rows, candidates, simulated, notes)
    eligible = [r for r in rows if r.meets_slo]
    if not eligible:
        fastest = min(rows, key=lambda r: r.result.tpot_p99)
        raise ValueError(f"no split meets TPOT p99 <= {settings.tpot_slo * 1000:.1f} ms (the best is "
                         f"{fastest.result.tpot_p99 * 1000:.1f} ms): relax --tpot-slo-ms, lower the load, or add GPUs")
    best = max(eligible, key=lambda r: r.result.tokens_per_s)
    if not settings.concurrency:
        # Open loop: every split that keeps up serves the offered load, so tokens/s barely differ;
        # among those within 2% of the best, the lowest TPOT p99 wins.
        keeping_up = [r for r in eligible if r.result.tokens_per_s >= 0.98 * best.result.tokens_per_s]
        best = min(keeping_up, key=lambda r: r.result.tpot_p99)
    plain_row = rows[0] if settings.plain else None
    result = Plan(rows=rows, best=best, plain=plain_row, notes=notes)
    if levels:
        level_jobs = [(load, split) for load in levels for split in candidates]
        for load, split in tqdm(level_jobs, desc="specd plan: load levels", unit="sim", disable=not progress):
            mode = settings.mode if best.mode != "plain" else "async"
            block = best.block_size or max(settings.block_sizes)
            res = simulate(profile, _config(settings, split, block, mode), settings.workload(profile, load))
            result.levels.setdefault(load, []).append(PlanRow(split=split, block_size=block, mode=mode, result=res))
    return result


def _extend_past_the_edge(settings: PlanSettings, rows: list[PlanRow], candidates: list[Split], simulated,
                          notes: list[str]) -> tuple[list[PlanRow], list[Split]]:
    """While the fastest split is the one with the most drafters (the edge of the ratios tried),
    try the next of `FURTHER_RATIOS`: at high batch the drafters' work grows with sequences x
    candidates and the optimum can lie past 3:1. Stops when a step no longer gains, or no split
    with more drafters fits."""
    tried = []
    for text in FURTHER_RATIOS:
        spec = [r for r in rows if r.mode != "plain" and r.meets_slo]
        if not spec:
            break
        best = max(spec, key=lambda r: r.result.tokens_per_s)
        if best.split.drafters < max(c.drafters for c in candidates):
            break
        split = split_for_ratio(settings, parse_ratio(text))
        if split is None:
            break
        if split in candidates:
            continue
        candidates = [*candidates, split]
        tried.append(f"{split.drafters}:{split.verifiers}")
        rows = rows + simulated([(split, block, settings.mode) for block in settings.block_sizes],
                                f"specd plan: past the edge, {text}")
    if tried:
        notes.append(f"the best split had the most drafters of the ratios tried, so the plan went on to "
                     f"{', '.join(tried)} (drafters:verifiers) until one no longer gained")
    return rows, candidates


# ====================================================================== output
def format_table(result: Plan) -> str:
    head = (f"{'':1}{'ratio D:V':>10}{'verif':>6}{'draft':>6}{'block':>6}{'tok/s':>10}{'vs plain':>9}{'tau':>6}"
            f"{'hit':>5}{'TTFT p50':>10}{'TPOT p50':>10}{'p99':>8}{'drafter':>8}{'slo':>4}")
    lines = [*result.notes, head, "-" * len(head)]
    plain = result.plain.result.tokens_per_s if result.plain else float("nan")
    for row in result.rows:
        r = row.result
        ratio = f"{row.split.drafters}:{row.split.verifiers}" if row.mode != "plain" else "plain"
        lines.append(
            f"{'*' if row is result.best else ' '}{ratio:>10}{row.split.verifiers:>6}{row.split.drafters:>6}"
            f"{row.block_size:>6}{r.tokens_per_s:>10.1f}{r.tokens_per_s / plain:>8.2f}x{r.tau:>6.2f}{r.hit_rate:>5.0%}"
            f"{r.ttft_p50 * 1e3:>8.1f}ms{r.tpot_p50 * 1e3:>8.2f}ms{r.tpot_p99 * 1e3:>6.2f}ms"
            f"{r.drafter_utilisation:>8.0%}{'' if row.meets_slo else 'no':>4}")
    return "\n".join(lines)


def values_override(result: Plan, settings: PlanSettings, profile_path: str) -> str:
    """The Helm values override for the chosen split (YAML; lists in flow style)."""
    best = result.best
    args = []
    if best.mode != "plain":
        args += ["--block-size", str(best.block_size)]
        if best.mode != "async":
            args += ["--mode", best.mode]
    args += ["--max-num-seqs", str(settings.max_num_seqs)]
    load = (f"concurrency {settings.concurrency}" if settings.concurrency
            else f"{settings.rate} requests/s" if settings.rate else "a trace")
    r = best.result
    lines = [
        f"# specd plan: {settings.gpus} GPUs, {load}, profile {profile_path}",
        *(f"# {note}" for note in result.notes),
        (f"# chosen: {best.split.verifiers} verifiers + {best.split.drafters} drafters, "
         f"{'plain decoding' if best.mode == 'plain' else f'block {best.block_size}, {best.mode}'}: "
         f"{r.tokens_per_s:.1f} tokens/s, TPOT p50 {r.tpot_p50 * 1e3:.2f} ms, p99 {r.tpot_p99 * 1e3:.2f} ms (simulated)"),
        "drafter:",
        f"  replicas: {best.split.drafters}",
        "verifier:",
        f"  replicas: {best.split.verifiers}",
        f"  tensorParallel: {settings.tensor_parallel}",
        f"  extraArgs: {json.dumps(args)}",
    ]
    if settings.trainer_gpus:
        # The budget counted these GPUs for the trainer: give it them (one per data-parallel rank;
        # the chart requests dataParallel GPUs for a role with a GPU entry) and train on them.
        lines += ["trainer:", f"  dataParallel: {settings.trainer_gpus}",
                  f"  resources: {{limits: {{nvidia.com/gpu: {settings.trainer_gpus}}}}}",
                  "  config: {device: cuda}"]
    return "\n".join([*lines, ""])


def plot(result: Plan, settings: PlanSettings, path: Path) -> Path:
    fig = Figure(figsize=(11, 4))
    by_block, by_level = fig.subplots(1, 2)
    load_name = "concurrency" if settings.concurrency else "requests/s"
    for block in settings.block_sizes:
        mine = sorted((r for r in result.rows if r.block_size == block and r.mode != "plain"), key=lambda r: r.split.ratio)
        if mine:
            by_block.plot([r.split.ratio for r in mine], [r.result.tokens_per_s for r in mine], marker="o", label=f"block {block}")
    if result.plain is not None:
        by_block.axhline(result.plain.result.tokens_per_s, color="grey", linestyle="--", label="plain")
    by_block.set_title(f"{settings.gpus} GPUs, " + (f"{load_name} {settings.concurrency or settings.rate}"
                                                     if settings.concurrency or settings.rate else "trace"))
    for load, rows in sorted(result.levels.items()):
        mine = sorted(rows, key=lambda r: r.split.ratio)
        by_level.plot([r.split.ratio for r in mine], [r.result.tokens_per_s for r in mine], marker="o",
                      label=f"{load_name} {load:g}")
    by_level.set_title(f"by load, block {result.levels and next(iter(result.levels.values()))[0].block_size}")
    for ax in (by_block, by_level):
        ax.set_xlabel("drafters per verifier")
        ax.set_ylabel("output tokens/s (simulated)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not result.levels:
        by_level.set_axis_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ====================================================================== command line
# Help of the flags that are `PlanSettings` fields: their defaults are the dataclass's.
_HELP = {
    "concurrency": "closed loop of C concurrent clients",
    "rate": "Poisson arrivals, requests per second",
    "block_sizes": "block lengths to try (comma-separated)",
    "ratios": "drafters:verifiers to try, e.g. 1:4,1:2,1:1,2:1 (default: every split)",
    "trainer_gpus": "GPUs of the data-parallel trainer, taken off --gpus (written as trainer.dataParallel)",
    "gpus_per_drafter": "GPUs per drafter replica",
    "mode": "how the verifiers use drafters",
    "max_num_seqs": "verifier rows (its --max-num-seqs; the chart's 64)",
    "prompt_tokens": "N, uniform:LO:HI or geometric:MEAN[:MAX] (default: the profile's)",
    "output_tokens": "as --prompt-tokens (default: the profile's, else 256)",
    "requests": "requests per simulation (0: 4 x C, at least 256; 1024 for --rate)",
    "seed": "seed of the simulation",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="profile JSON (`specd bench profile`, or hand-written)")
    parser.add_argument("--gpus", type=int, default=0,  # PlanSettings.gpus has no default: run() says it is needed
                        help="GPU budget: verifier and drafter replicas together (and the trainer's --trainer-gpus)")
    load = parser.add_mutually_exclusive_group()
    add_flags(load, PlanSettings, ("concurrency", "rate"), help=_HELP)
    parser.add_argument("--trace", default="", help="JSONL of requests (arrival_seconds, prompt/output lengths or "
                        "ids): its arrivals are the load; without arrival_seconds, its lengths replayed by "
                        "--concurrency or --rate")
    add_flags(parser, PlanSettings, ("block_sizes", "ratios"), help=_HELP)
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="ranks (GPUs) per verifier replica, a power of two (default 1); passes scale by the "
                        "profile's tensor_parallel.N.pass_scale, else 1/N + --tp-allreduce-us")
    parser.add_argument("--gpus-per-verifier", type=int, default=None, metavar="N",
                        help="the older name of --tensor-parallel: a verifier's GPUs are its ranks")
    parser.add_argument("--tp-allreduce-us", type=float, default=default_of(PlanSettings, "tp_allreduce_seconds") * 1e6,
                        help="all-reduce microseconds per tensor-parallel pass, without a measured pass_scale "
                        "(default: 36 layers x 2 all-reduces x 10 us on NVLink)")
    add_flags(parser, PlanSettings, ("trainer_gpus", "gpus_per_drafter", "mode", "max_num_seqs", "prompt_tokens",
                                     "output_tokens", "requests"), help=_HELP, choices={"mode": ("async", "sync")})
    parser.add_argument("--tpot-slo-ms", type=float, default=0.0, help="pick only splits with TPOT p99 at or under this")
    parser.add_argument("--fixed-block", action="store_true", help="verifiers run with --adaptive-block off")
    parser.add_argument("--rows", choices=("profile", "padded", "running"), default="profile",
                        help="busy rows padded to the longest (specd's engine) or packed tokens (default: the profile's)")
    parser.add_argument("--no-plain", action="store_true", help="do not consider plain decoding")
    parser.add_argument("--levels", default="0.25,1,4", help="load multipliers for the plot's second panel ('' = none)")
    parser.add_argument("--out", default="values-override.yaml", help="Helm values override to write")
    parser.add_argument("--plot", default="", help="PNG path (default: beside --out, plan.png)")
    parser.add_argument("--json", default="", help="also write every row as JSON here")
    add_flags(parser, PlanSettings, ("seed",), help=_HELP)
    parser.add_argument("--compare-serve", default="", metavar="SERVE_JSON",
                        help="instead of planning: simulate the rows of a `specd bench serve` JSON and compare "
                             "(writes SERVE_compare.json and .png beside it)")
    parser.add_argument("--measured-hits", action="store_true", help="with --compare-serve: use each row's measured hit rate")
    parser.add_argument("--acceptance-from", default="", metavar="DECODE_JSON",
                        help="a projection: the profile's costs with the acceptance per position a `specd bench "
                             "decode` JSON measured (its --fixed-block rows where it has them, mean of the domains)")
    parser.add_argument("--acceptance-method", default="d3d-async",
                        help="with --acceptance-from: the method whose rows to read (d3d-async, d3d-sync, dflash, ngram)")
    parser.add_argument("--acceptance-temperature", type=float, default=0.0,
                        help="with --acceptance-from: the rows of this temperature")


def _projected(profile: Profile, args: argparse.Namespace) -> Profile:
    """The profile with the acceptance `specd bench decode` measured (``--acceptance-from``)."""
    path = Path(args.acceptance_from)
    if not path.is_file():
        raise ValueError(f"no bench decode JSON at {path}: run `specd bench decode --fixed-block --out DIR` "
                         "and pass DIR/decode.json")
    measured = bench_acceptance(json.loads(path.read_text()), method=args.acceptance_method,
                                temperature=args.acceptance_temperature, source=str(path))
    label = (f"of {args.acceptance_method} at T={args.acceptance_temperature:g}, block {measured['block_size']}, "
             f"batch {measured['batch']}{' (fixed block)' if measured['fixed_block'] else ''}, mean of "
             f"{', '.join(measured['domains'])}, from {path}")
    print(f"PROJECTION, not a measurement: the costs of {args.profile} with the acceptance {label}\n"
          f"  acceptance per position: {' '.join(f'{a:.2f}' for a in measured['acceptance_per_pos'])} "
          f"(tau {measured['tau']:.2f})")
    return with_acceptance(profile, measured, label=label)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.acceptance_from:
        profile = _projected(profile, args)
    if args.compare_serve:
        path = Path(args.compare_serve)
        if not path.is_file():
            raise ValueError(f"no bench serve JSON at {path}: run `specd bench serve --json {path}` first")
        rows = compare_serve(profile, json.loads(path.read_text()), use_measured_hits=args.measured_hits)
        print(format_compare(rows))
        for written in write_compare(rows, path.with_name(f"{path.stem}_compare.json")):
            print(f"wrote {written}")
        return 0
    if args.gpus < 1:
        raise ValueError("--gpus N is required (the GPU budget), with --concurrency C or --rate R")
    given = {n for n in (args.tensor_parallel, args.gpus_per_verifier) if n is not None}
    if len(given) > 1:
        raise ValueError(f"--tensor-parallel {args.tensor_parallel} and --gpus-per-verifier {args.gpus_per_verifier} "
                         "disagree: they are one setting (a verifier's GPUs are its ranks); give --tensor-parallel")
    # The flags named like PlanSettings fields come across as they are (`from_flags`); these are
    # the ones whose flag says it another way.
    settings = from_flags(
        PlanSettings, args, tensor_parallel=given.pop() if given else 1,
        tp_allreduce_seconds=args.tp_allreduce_us / 1e6,
        ratios=tuple(r for r in args.ratios if r),
        adaptive_block=not args.fixed_block,
        padded_rows={"profile": None, "padded": True, "running": False}[args.rows],
        trace=load_trace(args.trace) if args.trace else None,
        tpot_slo=args.tpot_slo_ms / 1000, plain=not args.no_plain,
    )
    if args.concurrency < 0 or args.rate < 0:
        raise ValueError("--concurrency and --rate must be positive")
    if settings.trace is not None and not (settings.concurrency or settings.rate):
        args.levels = ""  # a trace's own arrivals have no load to scale
    try:
        levels = tuple(float(v) * (settings.concurrency or settings.rate) for v in args.levels.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--levels takes comma-separated load multipliers like 0.25,1,4, got {args.levels!r}") from None
    if any(level <= 0 for level in levels):
        raise ValueError(f"--levels must be positive multipliers, got {args.levels!r}")
    result = plan(profile, settings, levels=levels)
    print(format_table(result))
    best = result.best
    print(f"\nchosen: {best.split.verifiers} verifiers"
          + (f" of {settings.tensor_parallel} GPUs" if settings.tensor_parallel > 1 else "")
          + f" + {best.split.drafters} drafters"
          + (f", block {best.block_size}" if best.mode != "plain" else ", plain decoding")
          + f": {best.result.tokens_per_s:.1f} tokens/s"
          + (f" ({best.result.tokens_per_s / result.plain.result.tokens_per_s:.2f}x plain)" if result.plain else ""))
    if max(settings.block_sizes) > profile.block_size and profile.block_size not in profile.by_block:
        print(f"note: acceptance was measured at block {profile.block_size}; longer blocks extrapolate it")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(values_override(result, settings, args.profile))
    print(f"wrote {out}")
    png = plot(result, settings, Path(args.plot) if args.plot else out.with_name("plan.png"))
    print(f"wrote {png}")
    if args.json:
        rows = [{"verifiers": r.split.verifiers, "drafters": r.split.drafters, "block_size": r.block_size,
                 "mode": r.mode, "meets_slo": r.meets_slo, **asdict(r.result)} for r in result.rows]
        Path(args.json).write_text(json.dumps({"settings": asdict(settings), "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0

