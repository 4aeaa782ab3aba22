"""`specd bench opd`: SpecOPD against its baselines, same run, same target, same starting drafter.

On the zoo's full-attention target (``qwen3-tiny``), from the zoo's D3D drafter, with the zoo's
target responses as reference trajectories:

(a) **Throughput**: supervised tokens per second of SpecOPD and of sequential-rollout OPD, each
    run until it has supervised the same number of tokens (after one warm-up step); the ratio is
    the figure (SpecOPD, arXiv 2611.02846, reports 16.09x).
(b) **Quality per budget**: each method trains a fresh copy of the starting drafter for the same
    wall-clock budget (training time only; evaluation is paused out of it), and τ is measured
    per domain on held-out prompts (greedy, through the engine, sync, block 8, fixed block) at
    a few points along the way. Methods: SpecOPD (E2E-TV), SpecOPD (KL), sequential OPD (E2E-TV,
    so it differs from SpecOPD only in where supervision comes from) and offline distillation
    (teacher-forced, KL); plus the starting drafter's τ.
(c) **Branches per anchor**: SpecOPD (E2E-TV) with K = 1, 2, 4: supervised tokens/s and τ after
    the same budget (the K of (b) is not run twice).

Only same-run ratios mean anything on a shared machine. Output: a table, JSON and PNG plots.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from matplotlib.figure import Figure  # object API: no pyplot state, no display backend
from torch import nn

from specd import zoo
from specd.data import DOMAINS, load_tokenizer
from specd.models.d3d import D3DModel
from specd.models.loading import load_model
from specd.train.drafter import read_sequences
from specd.train.opd import ListSource, heldout_tau, make_trainer, mean_tau
from specd.train.specopd import SpecOPDConfig, Trajectory

# (name, method, loss) of the equal-budget comparison (b).
RUNS = (
    ("specopd-e2e-tv", "specopd", "e2e-tv"),
    ("specopd-kl", "specopd", "kl"),
    ("sequential", "sequential", "e2e-tv"),
    ("offline-kl", "offline", "kl"),
)


@dataclass(kw_only=True, slots=True)
class OPDBenchSettings:
    target: str = "qwen3-tiny"
    drafter: str = "d3d-qwen3-tiny"
    budget_seconds: float = 300.0
    """Training wall-clock seconds per run of (b) and (c)."""
    eval_points: int = 4
    """τ measurements along each run (evenly in training time), besides the starting drafter's."""
    prompts_per_domain: int = 4
    max_tokens: int = 64
    """Tokens generated per held-out prompt when measuring τ."""
    max_prompt_tokens: int = 192
    block_size: int = 8
    batch_size: int = 4
    """Trajectories per step."""
    anchors_per_seq: int = 8
    branches_per_anchor: int = 4
    """K of (b); (c) adds the other values of ``ablation_branches``."""
    ablation_branches: tuple[int, ...] = (1, 2, 4)
    throughput_tokens: int = 8192
    """Supervised tokens each method of (a) produces."""
    lr: float = 3e-4
    threads: int = 2
    seed: int = 0
    domains: tuple[str, ...] = DOMAINS

    @staticmethod
    def quick() -> "OPDBenchSettings":
        # About 5 minutes on 2 cores: 6 runs of 40 s, short evaluations, a smaller (a).
        return OPDBenchSettings(budget_seconds=40.0, eval_points=2, prompts_per_domain=2, max_tokens=32,
                                throughput_tokens=1024)


@dataclass(kw_only=True, slots=True)
class ThroughputRow:
    method: str
    num_supervised_tokens: int
    steps: int
    seconds: float
    tokens_per_second: float


@dataclass(kw_only=True, slots=True)
class TrainRow:
    name: str
    method: str
    loss: str
    branches_per_anchor: int
    steps: int
    seconds: float
    """Training seconds (evaluation excluded)."""
    num_supervised_tokens: int
    tokens_per_second: float
    tau: dict[str, float]
    """τ per domain at the end of the budget."""
    tau_mean: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(training seconds, mean τ over domains), the start included."""


@dataclass(kw_only=True, slots=True)
class OPDReport:
    throughput: list[ThroughputRow]
    throughput_ratio: float
    """SpecOPD / sequential OPD supervised tokens per second."""
    start_tau: dict[str, float]
    runs: list[TrainRow]
    ablation: list[TrainRow]


def _config(settings: OPDBenchSettings, target: nn.Module, loss: str, branches: int) -> SpecOPDConfig:
    return SpecOPDConfig(block_size=settings.block_size, anchors_per_seq=settings.anchors_per_seq,
                         branches_per_anchor=branches, loss=loss, lr=settings.lr, seed=settings.seed,
                         max_context=getattr(target.config, "max_position_embeddings", 4096))


def measure_throughput(target: nn.Module, start: D3DModel, trajectories: list[Trajectory], method: str,
                       settings: OPDBenchSettings) -> ThroughputRow:
    """Supervised tokens/s of ``method`` until it has supervised at least ``throughput_tokens`` tokens
    (whole steps, so a method can overshoot by up to one step's tokens; the rate is what is compared)."""
    trainer = make_trainer(method, target, copy.deepcopy(start), _config(settings, target, "e2e-tv", settings.branches_per_anchor))
    data = ListSource(trajectories)
    trainer.step(data.next_batch(settings.batch_size))  # warm-up: first-call allocations
    tokens, steps = 0, 0
    begin = time.perf_counter()
    while tokens < settings.throughput_tokens:
        tokens += trainer.step(data.next_batch(settings.batch_size)).num_supervised_tokens
        steps += 1
    seconds = time.perf_counter() - begin
    return ThroughputRow(method=method, num_supervised_tokens=tokens, steps=steps, seconds=seconds,
                         tokens_per_second=tokens / seconds)


def train_for_budget(target: nn.Module, start: D3DModel, trajectories: list[Trajectory],
                     prompts: dict[str, list[list[int]]], name: str, method: str, loss: str, branches: int,
                     settings: OPDBenchSettings, start_tau: dict[str, float]) -> TrainRow:
    """Train a fresh copy of ``start`` for ``budget_seconds`` training seconds, measuring τ along the way."""
    drafter = copy.deepcopy(start)
    trainer = make_trainer(method, target, drafter, _config(settings, target, loss, branches))
    data = ListSource(trajectories)
    curve = [(0.0, mean_tau(start_tau))]
    marks = [settings.budget_seconds * (i + 1) / settings.eval_points for i in range(settings.eval_points)]
    seconds, tau = 0.0, dict(start_tau)
    while marks:
        begin = time.perf_counter()
        trainer.step(data.next_batch(settings.batch_size))
        seconds += time.perf_counter() - begin
        if seconds >= marks[0]:
            while marks and seconds >= marks[0]:
                marks.pop(0)
            tau = heldout_tau(target, drafter, prompts, block_size=settings.block_size, max_tokens=settings.max_tokens)
            curve.append((seconds, mean_tau(tau)))
    return TrainRow(name=name, method=method, loss=trainer.config.loss, branches_per_anchor=branches,
                    steps=trainer.num_steps, seconds=seconds, num_supervised_tokens=trainer.num_supervised_tokens,
                    tokens_per_second=trainer.num_supervised_tokens / seconds, tau=tau, tau_mean=mean_tau(tau),
                    curve=curve)


def run_bench(settings: OPDBenchSettings, target: nn.Module, start: D3DModel, trajectories: list[Trajectory],
              prompts: dict[str, list[list[int]]], log=print) -> OPDReport:
    """(a), (b) and (c) of the module docstring on given models and data (the zoo's in `main`)."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        log("(a) supervised-token throughput")
        throughput = [measure_throughput(target, start, trajectories, m, settings) for m in ("specopd", "sequential")]
        ratio = throughput[0].tokens_per_second / throughput[1].tokens_per_second
        start_tau = heldout_tau(target, start, prompts, block_size=settings.block_size, max_tokens=settings.max_tokens)
        runs = []
        for name, method, loss in RUNS:
            log(f"(b) {name}: {settings.budget_seconds:.0f} s")
            runs.append(train_for_budget(target, start, trajectories, prompts, name, method, loss,
                                         settings.branches_per_anchor, settings, start_tau))
        ablation = []
        for branches in settings.ablation_branches:
            if branches == settings.branches_per_anchor:
                ablation.append(replace(runs[0], name=f"specopd-k{branches}"))
                continue
            log(f"(c) specopd K={branches}: {settings.budget_seconds:.0f} s")
            ablation.append(train_for_budget(target, start, trajectories, prompts, f"specopd-k{branches}", "specopd",
                                             "e2e-tv", branches, settings, start_tau))
    finally:
        torch.set_num_threads(previous_threads)
    return OPDReport(throughput=throughput, throughput_ratio=ratio, start_tau=start_tau, runs=runs, ablation=ablation)


# ---------------------------------------------------------------------------- the zoo's models and data
def zoo_inputs(settings: OPDBenchSettings) -> tuple[nn.Module, D3DModel, list[Trajectory], dict[str, list[list[int]]]]:
    target = load_model(zoo.ensure(settings.target))
    start = load_model(zoo.ensure(settings.drafter))
    sequences, prompt_lens = read_sequences(zoo.zoo_dir() / f"responses-{settings.target}" / "sequences.jsonl")
    trajectories = [Trajectory(prompt=s[:n], response=s[n:]) for s, n in zip(sequences, prompt_lens)]
    tokenizer = load_tokenizer(zoo.tokenizer_dir(), zoo=True)
    prompts = {domain: [tokenizer.encode(item.prompt).ids[-settings.max_prompt_tokens :]
                        for item in items[: settings.prompts_per_domain]]
               for domain, items in zoo.heldout().items() if domain in settings.domains}
    return target, start, trajectories, prompts


# ---------------------------------------------------------------------------- output
def format_report(report: OPDReport) -> str:
    lines = ["(a) supervised tokens per second, same number of tokens",
             f"{'method':<12} {'tokens':>7} {'steps':>6} {'seconds':>8} {'tok/s':>9}"]
    for r in report.throughput:
        lines.append(f"{r.method:<12} {r.num_supervised_tokens:>7} {r.steps:>6} {r.seconds:>8.1f} {r.tokens_per_second:>9.1f}")
    lines.append(f"SpecOPD / sequential OPD = {report.throughput_ratio:.2f}x (goal >= 16x)")
    domains = list(report.start_tau)
    head = f"{'run':<16} {'K':>2} {'steps':>6} {'tok/s':>8} " + " ".join(f"{d:>9}" for d in domains) + f" {'mean':>6}"
    lines += ["", "(b) tau per domain after the same training budget (greedy, block 8)", head, "-" * len(head)]
    lines.append(f"{'start':<16} {'':>2} {'':>6} {'':>8} " + " ".join(f"{report.start_tau[d]:>9.3f}" for d in domains)
                 + f" {mean_tau(report.start_tau):>6.3f}")
    for r in [*report.runs, *[a for a in report.ablation if a.branches_per_anchor != report.runs[0].branches_per_anchor]]:
        k = str(r.branches_per_anchor) if r.method == "specopd" else "-"
        lines.append(f"{r.name:<16} {k:>2} {r.steps:>6} {r.tokens_per_second:>8.1f} "
                     + " ".join(f"{r.tau[d]:>9.3f}" for d in domains) + f" {r.tau_mean:>6.3f}")
    lines.append(format_goals(report))
    return "\n".join(lines)


def format_goals(report: OPDReport) -> str:
    by_name = {r.name: r for r in report.runs}
    specopd, offline = by_name["specopd-e2e-tv"], by_name["offline-kl"]
    ratios = {d: specopd.tau[d] / offline.tau[d] for d in specopd.tau}
    best = max(ratios, key=ratios.get)
    return (f"goals: tau SpecOPD(E2E-TV) / offline(KL): best domain {best} {ratios[best]:.3f} (>= 1.41), "
            f"mean {specopd.tau_mean / offline.tau_mean:.3f} (>= 1.20)")


def plot(report: OPDReport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for r in report.runs:
        ax.plot(*zip(*r.curve), marker="o", label=r.name)
    for r in report.ablation:
        if r.branches_per_anchor != report.runs[0].branches_per_anchor:
            ax.plot(*zip(*r.curve), marker=".", linestyle="--", label=r.name)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("held-out tau (mean over domains)")
    ax.set_title("tau vs training time, same starting drafter")
    ax.legend()
    paths = [_save(fig, out_dir / "opd_tau_vs_time.png")]
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    domains = list(report.start_tau)
    series = [("start", report.start_tau), *[(r.name, r.tau) for r in report.runs]]
    width = 0.8 / len(series)
    for i, (name, tau) in enumerate(series):
        ax.bar([j + i * width for j in range(len(domains))], [tau[d] for d in domains], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
    ax.set_ylabel("tau (tokens / target pass)")
    ax.set_title("tau per domain after the same training budget")
    ax.legend()
    paths.append(_save(fig, out_dir / "opd_tau_per_domain.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write(report: OPDReport, settings: OPDBenchSettings, out_dir: Path, json_path: Path | None) -> list[Path]:
    json_path = json_path or out_dir / "opd.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"settings": asdict(settings), "report": asdict(report)}, indent=2) + "\n")
    return [json_path, *plot(report, out_dir)]


def main(settings: OPDBenchSettings, out_dir: Path, json_path: Path | None) -> OPDReport:
    torch.manual_seed(settings.seed)
    report = run_bench(settings, *zoo_inputs(settings))
    print(format_report(report))
    for path in write(report, settings, out_dir, json_path):
        print(f"wrote {path}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="40 s per run, fewer prompts (about 5 minutes)")
    parser.add_argument("--budget", type=float, help="training seconds per run (overrides the default)")
    parser.add_argument("--out", default="out/bench", help="directory for plots and JSON")
    parser.add_argument("--json", help="JSON path (default OUT/opd.json)")


def run(args: argparse.Namespace) -> int:
    settings = OPDBenchSettings.quick() if args.quick else OPDBenchSettings()
    if args.budget:
        settings.budget_seconds = args.budget
    main(settings, Path(args.out), Path(args.json) if args.json else None)
    return 0
