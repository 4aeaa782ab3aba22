"""The simulator against `specd bench serve`: the same deployments and loads, side by side.

`specd bench serve` writes ``{"settings": {...}, "rows": [...]}``: per deployment ("plain",
"sync 2:1", "async 1:1", ... — drafters:verifiers, one verifier) and concurrency, the requests
it completed, output tokens/s, TTFT/TPOT percentiles, τ and hit rate. `compare_serve` simulates
every row under the same settings (block size, verifier rows, closed loop of the same
concurrency) on the same workload — the row's ``trace`` of (prompt, output) lengths in the order
the run sent them; older runs without one get the profile's length distributions — averages a
few seeds (acceptance draws), and reports simulated / measured. From the run's JSON come the cores its drafters were
pinned to (``drafter_cores``: two drafter processes on one core take turns on it, each pass
paying its own fixed cost) and, only for a profile of bare drafter passes (``--no-services``), the drafter round
trip's transport time it measured (``transport_ms``, instead of ``rpc_seconds``; a full profile
times the drafter through a replica, transport included). ``use_measured_hits`` takes each row's measured hit
rate instead of the profile's, to tell cost-model error from acceptance error.

What the simulator does not see: CPU cores shared between services and the client (the bench
pins one core per service where it can; on a small machine they still share memory bandwidth),
and the HTTP layer beyond one network hop each way.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specd.plan.profile import Profile
from specd.plan.sim import Lengths, SimConfig, Workload, replayed, simulate

_DEPLOYMENT = re.compile(r"^(sync|async) (\d+):(\d+)$")


@dataclass(kw_only=True, slots=True)
class CompareRow:
    deployment: str
    concurrency: int
    requests: int
    measured_tokens_per_s: float
    simulated_tokens_per_s: float
    measured_tpot_p50: float
    simulated_tpot_p50: float
    measured_ttft_p50: float
    simulated_ttft_p50: float
    measured_tau: float
    simulated_tau: float
    measured_target_ms: float = 0.0
    """Mean target pass in the verifier, as its metrics report it."""
    simulated_target_ms: float = 0.0
    measured_overhead_ms: float = 0.0
    """Verifier loop time per step outside passes and blocking drafter calls."""
    simulated_overhead_ms: float = 0.0
    measured_runs: list[float] = field(default_factory=list)
    """tokens/s of every round of a ``--repeats`` run (the row reports the median round)."""
    calibrated_tokens_per_s: float = 0.0
    """The same deployment at the same concurrency as `specd bench profile` measured it while
    calibrating the verifier service (0: not calibrated there): the same load measured twice, at
    two times — how far apart they are is the machine's drift between the two commands."""

    @property
    def ratio(self) -> float:
        """Simulated over measured tokens/s."""
        return self.simulated_tokens_per_s / self.measured_tokens_per_s if self.measured_tokens_per_s else float("nan")


def deployment_config(name: str, settings: dict) -> SimConfig:
    """A `specd bench serve` deployment name and settings -> the simulated deployment."""
    common = {"max_num_seqs": int(settings.get("max_num_seqs", 16)), "adaptive_block": True}
    if name == "plain":
        return SimConfig(mode="plain", drafters=0, block_size=0, **common)
    match = _DEPLOYMENT.match(name)
    if match is None:
        raise ValueError(f"unknown bench serve deployment {name!r}: expected 'plain' or '<sync|async> D:V'")
    mode, drafters, verifiers = match.group(1), int(match.group(2)), int(match.group(3))
    return SimConfig(mode=mode, drafters=drafters, verifiers=verifiers,
                     block_size=int(settings.get("block_size", 8)), **common)


def calibrated_tokens_per_s(profile: Profile, deployment: str, concurrency: int) -> float:
    """tokens/s of the profile's calibration run of this deployment at this concurrency (0: none)."""
    services = profile.serving  # the `specd bench serve` deployments `specd bench profile` calibrates
    block = {"plain": services.verifier, "async 1:1": services.speculative,
             "sync 1:1": services.speculative_sync}.get(deployment)
    if block is None:
        return 0.0
    for level, tokens_per_s in zip(block.concurrency or [], block.tokens_per_s or []):
        if level == concurrency:
            return float(tokens_per_s)
    return 0.0


def compare_serve(profile: Profile, serve: dict, *, seeds: int = 3, use_measured_hits: bool = False) -> list[CompareRow]:
    """Simulate every row of a `specd bench serve` JSON (module docstring)."""
    if not isinstance(serve, dict) or not isinstance(serve.get("rows"), list) or "settings" not in serve:
        raise ValueError("not a `specd bench serve` JSON: expected {\"settings\": {...}, \"rows\": [...]}")
    settings = serve["settings"]
    max_tokens = int(settings.get("max_tokens", 64))
    observed = profile.workload
    prompts = Lengths.parse(observed.prompt_tokens or 96)
    outputs = Lengths.parse([min(n, max_tokens) for n in observed.output_tokens] if observed.output_tokens
                            else max_tokens)
    out = []
    for row in serve["rows"]:
        if not row.get("requests"):
            continue  # a level that completed nothing has nothing to compare
        if row.get("temperature", 0.0) or "lookup" in row["deployment"]:
            continue  # the profile's acceptance is greedy and the model's: nothing to compare with
        config = deployment_config(row["deployment"], settings)
        if row.get("drafter_cores"):
            # Drafter processes pinned to fewer cores than there are processes take turns on them.
            config.drafter_devices = min(config.drafters, int(row["drafter_cores"]))
        if row.get("transport_ms") and not profile.serving.drafter_round_trips:
            # Bare passes in the profile: the round trip's transport as the run measured it.
            config.rpc_seconds = float(row["transport_ms"]) / 1e3
        if use_measured_hits and config.mode == "async":
            config.hit_rate = float(row.get("hit_rate", 0.0))
        trace = None
        if row.get("trace"):
            # The run's own requests, in the order it sent them: greedy output is the same in every
            # deployment (lossless), so the workload is an input here, not a result. Where the
            # run recorded each request's prompt, its steps draw that prompt's verified blocks.
            trace = replayed(row["trace"])
        results = []
        for seed in range(seeds):
            config.seed = seed
            workload = Workload(requests=int(row["requests"]), concurrency=int(row["concurrency"]),
                                prompt_tokens=prompts, output_tokens=outputs, trace=trace)
            results.append(simulate(profile, config, workload))
        mean = {name: float(np.mean([getattr(r, name) for r in results]))
                for name in ("tokens_per_s", "tpot_p50", "ttft_p50", "tau", "target_seconds_per_pass",
                             "overhead_seconds_per_step")}
        out.append(CompareRow(
            deployment=row["deployment"], concurrency=int(row["concurrency"]), requests=int(row["requests"]),
            measured_tokens_per_s=float(row["tokens_per_s"]), simulated_tokens_per_s=mean["tokens_per_s"],
            measured_tpot_p50=float(row["tpot_p50"]), simulated_tpot_p50=mean["tpot_p50"],
            measured_ttft_p50=float(row["ttft_p50"]), simulated_ttft_p50=mean["ttft_p50"],
            measured_tau=float(row.get("tau", 1.0)), simulated_tau=mean["tau"],
            measured_target_ms=float(row.get("target_ms", 0.0)), simulated_target_ms=1e3 * mean["target_seconds_per_pass"],
            measured_overhead_ms=float(row.get("step_overhead_ms", 0.0)),
            simulated_overhead_ms=1e3 * mean["overhead_seconds_per_step"],
            measured_runs=[float(x) for x in row.get("runs", [])],
            calibrated_tokens_per_s=calibrated_tokens_per_s(profile, row["deployment"], int(row["concurrency"])),
        ))
    if not out:
        raise ValueError("the bench serve JSON has no rows with completed requests")
    return out


def spread(runs: list[float], median: float) -> float:
    """(max - min) / median of a row's rounds' tokens/s — how far the machine moved under the
    row (0 for a single round). `specd bench serve` prints it too."""
    return (max(runs) - min(runs)) / median if len(runs) > 1 and median else 0.0


def format_compare(rows: list[CompareRow]) -> str:
    rounds = max((len(r.measured_runs) for r in rows), default=0)
    calibrated = any(r.calibrated_tokens_per_s for r in rows)
    head = (f"{'deployment':<11}{'conc':>5}{'reqs':>5}{'tok/s meas':>11}" + (f"{'spread':>7}" if rounds > 1 else "")
            + (f"{'profile':>8}" if calibrated else "") + f"{'sim':>9}{'sim/meas':>9}"
            f"{'TPOT meas':>10}{'sim':>8}{'TTFT meas':>10}{'sim':>8}{'tau meas':>9}{'sim':>6}"
            f"{'pass meas':>10}{'sim':>8}{'ovh meas':>9}{'sim':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.deployment:<11}{r.concurrency:>5}{r.requests:>5}{r.measured_tokens_per_s:>11.1f}"
            + (f"{spread(r.measured_runs, r.measured_tokens_per_s):>6.0%} " if rounds > 1 else "")
            + ((f"{r.calibrated_tokens_per_s:>8.1f}" if r.calibrated_tokens_per_s else f"{'-':>8}") if calibrated else "")
            + f"{r.simulated_tokens_per_s:>9.1f}{r.ratio:>8.2f}x{r.measured_tpot_p50 * 1e3:>8.1f}ms"
            f"{r.simulated_tpot_p50 * 1e3:>6.1f}ms{r.measured_ttft_p50 * 1e3:>8.0f}ms{r.simulated_ttft_p50 * 1e3:>6.0f}ms"
            f"{r.measured_tau:>9.2f}{r.simulated_tau:>6.2f}"
            f"{r.measured_target_ms:>8.2f}ms{r.simulated_target_ms:>6.2f}ms"
            f"{r.measured_overhead_ms:>7.2f}ms{r.simulated_overhead_ms:>5.2f}ms")
    ratios = [r.ratio for r in rows]
    lines.append(f"tokens/s sim/meas: median {np.median(ratios):.2f}, worst {max(ratios, key=lambda x: abs(x - 1)):.2f}; "
                 f"within 15%: {sum(abs(x - 1) <= 0.15 for x in ratios)}/{len(ratios)}")
    if rounds > 1:
        lines.append(f"measured: the median of {rounds} rounds per row; spread = (max - min) / median of the rounds' "
                     "tokens/s, how far the machine moved under the row")
    if calibrated:
        drift = [r.calibrated_tokens_per_s / r.measured_tokens_per_s for r in rows if r.calibrated_tokens_per_s]
        lines.append(f"profile: the same deployment and load as `specd bench profile` measured it while calibrating; "
                     f"profile/meas {min(drift):.2f} to {max(drift):.2f} — the same load measured twice")
    return "\n".join(lines)


def write_compare(rows: list[CompareRow], json_path: Path) -> list[Path]:
    """The rows as JSON and a plot of simulated against measured tokens/s (measured rounds as
    error bars), per deployment, over concurrency."""
    import json

    from matplotlib.figure import Figure

    json_path.parent.mkdir(parents=True, exist_ok=True)
    ratios = [r.ratio for r in rows]
    json_path.write_text(json.dumps({
        "rows": [{**asdict(r), "ratio": r.ratio} for r in rows],
        "median_ratio": float(np.median(ratios)), "worst_ratio": max(ratios, key=lambda x: abs(x - 1)),
        "within_15_percent": sum(abs(x - 1) <= 0.15 for x in ratios), "rows_compared": len(ratios),
    }, indent=1) + "\n")
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, deployment in enumerate(dict.fromkeys(r.deployment for r in rows)):
        mine = [r for r in rows if r.deployment == deployment]
        color = f"C{i}"
        x = [r.concurrency for r in mine]
        low = [r.measured_tokens_per_s - min(r.measured_runs or [r.measured_tokens_per_s]) for r in mine]
        high = [max(r.measured_runs or [r.measured_tokens_per_s]) - r.measured_tokens_per_s for r in mine]
        ax.errorbar(x, [r.measured_tokens_per_s for r in mine], yerr=[low, high], color=color, marker="o",
                    capsize=3, label=f"{deployment} measured")
        ax.plot(x, [r.simulated_tokens_per_s for r in mine], color=color, marker="x", linestyle="--",
                label=f"{deployment} simulated")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title("simulator vs specd bench serve")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return [json_path, png]
