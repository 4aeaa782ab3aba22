"""`specd bench serve`: end to end through the real services, as a client sees them.

For each deployment — plain decoding, synchronous speculation and asynchronous D3D, with
drafter:verifier ratios 1:1 and 2:1 — it starts the processes (`services.up.Stack`, the machine
split by `services.load.deployment_stack`), then drives the verifier's HTTP API with a
closed loop of C concurrent streaming clients (C in 1, 4, 16, 64), each sending held-out zoo
prompts one after another. It reports output tokens/s, TTFT and TPOT p50/p99 per concurrency,
and every deployment's tokens/s as a ratio to plain decoding at the same concurrency, measured in
the same run (the machine is shared and noisy: only ratios travel).

``--repeats N`` runs every deployment N times, round robin (each round starts every deployment
afresh, so a slow minute on a shared machine lands on one round of each deployment, not on all
rounds of one). A row is then the round whose tokens/s is the median — its τ, pass times and
trace with it — plus every round's tokens/s (``runs``) and their spread; its ratio to plain is
the median over rounds of the ratio within the round.

A table, JSON and PNG plots. ``--quick`` runs fewer levels and requests (minutes).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from tqdm import tqdm

from services.client import metrics
from services.load import clients_off_verifier_cores, deployment_stack, machine_cores, run_level, sender
from services.up import Stack, StackConfig, zoo_model
from specd.engine import tau
from specd.flags import default_of
from specd.plan.compare import spread as round_spread


@dataclass(kw_only=True)
class Deployment:
    name: str
    drafters: int
    mode: str = "async"
    lookup: bool = False
    """Prompt lookup in the verifier (``--prompt-lookup``): beside the drafters, or alone."""


DEPLOYMENTS = (
    Deployment(name="plain", drafters=0),
    Deployment(name="lookup", drafters=0, mode="sync", lookup=True),
    Deployment(name="sync 1:1", drafters=1, mode="sync"),
    Deployment(name="sync 2:1", drafters=2, mode="sync"),
    Deployment(name="async 1:1", drafters=1, mode="async"),
    Deployment(name="async 2:1", drafters=2, mode="async"),
    Deployment(name="sync 1:1 +lookup", drafters=1, mode="sync", lookup=True),
    Deployment(name="async 1:1 +lookup", drafters=1, mode="async", lookup=True),
)
DEFAULT_DEPLOYMENTS = ("plain", "sync 1:1", "sync 2:1", "async 1:1", "async 2:1")
"""What runs without ``--deployments`` (the simulator models these: `specd plan --compare-serve`)."""


@dataclass(kw_only=True)
class ServeSettings:
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    requests_per_level: int = 0
    """Requests per concurrency level (0 = max(4 x concurrency, 16): a level of a few requests
    lasts a second, and its tail, where a few requests finish alone, weighs too much)."""
    max_tokens: int = 64
    max_prompt_tokens: int = 96
    """The last this many tokens of each held-out prompt (rendered in the target's chat template)."""
    temperatures: tuple[float, ...] = (0.0,)
    """Every level runs at each of these (0: greedy; the comparison with the simulator reads
    the greedy rows)."""
    block_size: int = 8
    max_num_seqs: int = 64
    pin: bool = False
    """Async deployments pinned apart, a core per process, instead of sharing the machine."""
    client: str = "http"
    """"http": streaming OpenAI completions; "grpc": the verifier's Generate stream."""
    deployments: tuple[str, ...] = DEFAULT_DEPLOYMENTS
    repeats: int = 1
    """Rounds over every deployment (module docstring); each row reports the median round."""

    def requests(self, concurrency: int) -> int:
        return self.requests_per_level or max(4 * concurrency, 16)


@dataclass(kw_only=True)
class ServeRow:
    deployment: str
    concurrency: int
    temperature: float = 0.0
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    tau: float = 1.0
    hit_rate: float = 0.0
    blocking_drafter_calls: int = 0
    target_passes: int = 0
    drafter_round_trips: int = 0
    transport_ms: float = 0.0
    """Mean time of a drafter round trip spent outside the replica (gRPC, loopback), measured."""
    step_overhead_ms: float = 0.0
    """Verifier loop time per step outside target passes and blocking drafter calls, measured."""
    target_ms: float = 0.0
    """Mean seconds of one target pass in the verifier, measured (ms)."""
    drafter_server_ms: float = 0.0
    """Mean time a replica spent on one round trip (its pass, parsing, queueing), measured."""
    trace: list[list[int]] = field(default_factory=list)
    """[prompt tokens, output tokens, the prompt's index in the pool] of each completed request,
    in the order they were sent: the workload the simulator replays against this row
    (`specd.plan.compare`; the index picks the prompt's own verified blocks from the profile)."""
    drafter_cores: int = 0
    """Distinct CPU cores the drafters were pinned to (0: not pinned): 2:1 on a 2-core machine is
    two drafter processes on one core."""
    speedup: float = 1.0
    """tokens/s over plain decoding's at the same concurrency, this run (with repeats: the median
    over rounds of the ratio within a round)."""
    runs: list[float] = field(default_factory=list)
    """tokens/s of every round, in order (one entry without ``--repeats``)."""
    drafter_free: float = 0.0
    """The speedup this row would have if drafting cost the verifier nothing: τ tokens per
    sequence per step of (its target pass + its step overhead), against plain decoding's step
    (pass + overhead) at the same concurrency, all measured in this run. What separates it from
    ``speedup`` is the drafter's share of the critical path; what separates it from τ is the
    verification pass costing more than a decode pass, and speculation's own step overhead."""
    errors: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def prompts(target: str, max_prompt_tokens: int = 96) -> list[list[int]]:
    """Held-out prompts of every domain, interleaved, as the target's token ids (rendered in its
    own chat template: `specd.bench.profile.zoo_prompts`, which the simulator's profile shares)."""
    from specd.bench.profile import zoo_prompts

    return zoo_prompts(Path(target), max_prompt_tokens)


def bench_serve(settings: ServeSettings, target: str, drafter: str) -> list[ServeRow]:
    pool = prompts(target, settings.max_prompt_tokens)
    chosen = [d for d in DEPLOYMENTS if d.name in settings.deployments]
    if settings.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {settings.repeats}")
    levels = len(settings.concurrency) * len(settings.temperatures)
    progress = tqdm(total=settings.repeats * len(chosen) * levels, desc="bench serve", unit="level")
    rounds: list[list[ServeRow]] = []
    for round_ in range(settings.repeats):
        rows = []
        for deployment in chosen:
            label = f"round {round_ + 1}/{settings.repeats} " if settings.repeats > 1 else ""
            rows += _serve_deployment(settings, deployment, target, drafter, pool, progress, label)
        _ratios_to_plain(rows)
        rounds.append(rows)
    progress.close()
    return _median_rounds(rounds)


def stack_config(settings: ServeSettings, deployment: Deployment, target: str, drafter: str, cores: int) -> StackConfig:
    """One deployment's processes on a machine of ``cores`` cores (`deployment_stack`)."""
    return deployment_stack(target, drafter, drafters=deployment.drafters, mode=deployment.mode,
                            lookup=deployment.lookup, pin=settings.pin, cores=cores, block_size=settings.block_size,
                            max_num_seqs=settings.max_num_seqs, verifier_http_port=18000, verifier_grpc_port=51051,
                            drafter_port=51052)


def _serve_deployment(settings: ServeSettings, deployment: Deployment, target: str, drafter: str,
                      pool: list[list[int]], progress: tqdm, label: str) -> list[ServeRow]:
    """Start one deployment's processes (`stack_config`) and drive every level through it."""
    config = stack_config(settings, deployment, target, drafter, machine_cores())
    rows = []
    with Stack(config) as stack, clients_off_verifier_cores(stack):
        base = stack.verifiers[0].http
        stack.wait_drafting()
        run_level(sender(settings.client, stack, Path(target).name), pool, 1, 2, 8)  # warm up: allocate, fill caches
        for temperature in settings.temperatures:
            send = sender(settings.client, stack, Path(target).name, temperature=temperature)
            for concurrency in settings.concurrency:
                progress.set_postfix_str(f"{label}{deployment.name} c={concurrency} T={temperature:g}")
                before = metrics(base)
                results, seconds, errors = run_level(send, pool, concurrency,
                                                     settings.requests(concurrency), settings.max_tokens)
                after = metrics(base)
                row = _row(deployment, concurrency, results, seconds, errors, before, after)
                row.temperature = temperature
                row.drafter_cores = len({d.core for d in stack.drafters if d.core is not None})
                rows.append(row)
                progress.update()
    return rows


def _ratios_to_plain(rows: list[ServeRow]) -> None:
    """Each row's speedup and drafter-free speedup against plain decoding in the same round."""
    plain = {(r.concurrency, r.temperature): r for r in rows if r.deployment == "plain"}
    for row in rows:
        base = plain.get((row.concurrency, row.temperature))
        if base is not None and base.tokens_per_s:
            row.speedup = row.tokens_per_s / base.tokens_per_s
            step = row.target_ms + row.step_overhead_ms
            if step > 0 and base.target_ms:
                row.drafter_free = row.tau * (base.target_ms + base.step_overhead_ms) / step


def _median_rounds(rounds: list[list[ServeRow]]) -> list[ServeRow]:
    """Per (deployment, concurrency): the round with the median tokens/s (the lower middle one of
    an even count), with every round's tokens/s and the median of the per-round ratios."""
    out = []
    for i, first in enumerate(rounds[0]):
        same = [rows[i] for rows in rounds]
        assert all((r.deployment, r.concurrency, r.temperature) == (first.deployment, first.concurrency, first.temperature)
                   for r in same)
        ordered = sorted(same, key=lambda r: r.tokens_per_s)
        row = ordered[(len(ordered) - 1) // 2]
        row.runs = [r.tokens_per_s for r in same]
        row.speedup = statistics.median(r.speedup for r in same)
        row.drafter_free = statistics.median(r.drafter_free for r in same)
        out.append(row)
    return out


def _row(deployment: Deployment, concurrency: int, results: list, seconds: float, errors: list[str],
         before: dict, after: dict) -> ServeRow:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    tpots = [(r.seconds - r.ttft) / (r.completion_tokens - 1) for r in results
             if r.ttft is not None and r.completion_tokens > 1]
    lookups = delta("specd:spec_decode_num_candidate_lookups_total")
    round_trips = delta("specd:drafter_pool_events_total{event=round_trips}")
    steps = delta("specd:num_target_passes_total")
    return ServeRow(
        deployment=deployment.name, concurrency=concurrency, requests=len(results), output_tokens=tokens,
        seconds=seconds, tokens_per_s=tokens / seconds if seconds else 0.0,
        ttft_p50=_percentile(ttfts, 0.5), ttft_p99=_percentile(ttfts, 0.99),
        tpot_p50=_percentile(tpots, 0.5), tpot_p99=_percentile(tpots, 0.99),
        tau=tau(delta("specd:spec_decode_num_accepted_tokens_total"), delta("specd:num_sequence_passes_total")),
        hit_rate=delta("specd:spec_decode_num_candidate_hits_total") / lookups if lookups else 0.0,
        blocking_drafter_calls=int(delta("specd:num_drafter_blocking_calls_total")),
        target_passes=int(delta("specd:num_target_passes_total")), errors=errors,
        trace=[[r.prompt_tokens, r.completion_tokens, r.prompt_index] for r in results],
        drafter_round_trips=int(round_trips),
        transport_ms=1e3 * delta("specd:drafter_transport_seconds_total") / round_trips if round_trips else 0.0,
        drafter_server_ms=1e3 * delta("specd:drafter_server_seconds_total") / round_trips if round_trips else 0.0,
        target_ms=1e3 * delta("specd:engine_seconds_total{part=target}") / steps if steps else 0.0,
        step_overhead_ms=1e3 * (delta("specd:engine_seconds_total{part=step}") - delta("specd:engine_seconds_total{part=target}")
                                - delta("specd:engine_seconds_total{part=drafter_blocking}")) / steps if steps else 0.0,
    )


def format_table(rows: list[ServeRow]) -> str:
    spread = any(len(r.runs) > 1 for r in rows)
    head = (f"{'deployment':<11}{'conc':>5}{'T':>4}{'reqs':>5}{'tok/s':>8}" + (f"{'spread':>8}" if spread else "")
            + f"{'vs plain':>9}{'no-draft':>9}{'tau':>6}{'hit':>6}"
            f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'errors':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.deployment:<11}{r.concurrency:>5}{r.temperature:>4g}{r.requests:>5}{r.tokens_per_s:>8.1f}"
            + (f"{round_spread(r.runs, r.tokens_per_s):>7.0%} " if spread else "") + f"{r.speedup:>8.2f}x"
            f"{r.drafter_free:>8.2f}x"
            f"{r.tau:>6.2f}{r.hit_rate:>6.0%}{r.ttft_p50 * 1e3:>8.0f}ms{r.ttft_p99 * 1e3:>6.0f}ms"
            f"{r.tpot_p50 * 1e3:>8.1f}ms{r.tpot_p99 * 1e3:>6.1f}ms{len(r.errors):>7}"
        )
    return "\n".join(lines)


def plot(rows: list[ServeRow], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label, name in (("tokens_per_s", "output tokens/s", "serve_throughput.png"),
                                ("speedup", "tokens/s vs plain (same run)", "serve_speedup.png"),
                                ("tpot_p50", "TPOT p50 (s)", "serve_tpot.png")):
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for deployment in dict.fromkeys(r.deployment for r in rows):
            mine = [r for r in rows if r.deployment == deployment]
            ax.plot([r.concurrency for r in mine], [getattr(r, metric) for r in mine], marker="o", label=deployment)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_title(f"specd bench serve: {label}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        paths.append(out_dir / name)
    return paths


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="concurrency 1, 4, 16 and fewer requests (minutes)")
    parser.add_argument("--concurrency", default="", help="comma-separated levels (default 1,4,16,64)")
    parser.add_argument("--deployments", default="", help=f"subset of: {', '.join(d.name for d in DEPLOYMENTS)}")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=default_of(ServeSettings, "max_prompt_tokens"),
                        help="the last this many tokens of each held-out prompt")
    parser.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0 or 0,1 (default 0)")
    parser.add_argument("--target", default="", help="target directory or zoo name, e.g. smollm2-135m (default: the zoo's qwen3-tiny)")
    parser.add_argument("--drafter", default="", help="drafter directory or zoo name, e.g. d3d-smollm2-135m (default: the zoo's d3d-qwen3-tiny)")
    parser.add_argument("--pin", action="store_true",
                        help="async deployments: pin the verifier and each drafter to cores of their own instead of "
                             "sharing the machine (`services.load.deployment_stack`)")
    parser.add_argument("--client", choices=["http", "grpc"], default="http",
                        help="drive the verifier's OpenAI HTTP API (default) or its gRPC Generate stream")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every deployment, round robin; rows report the median round")
    parser.add_argument("--out", default="out/bench", help="directory for plots and JSON")
    parser.add_argument("--json", default=None, help="JSON path (default OUT/serve.json)")


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, e.g. 0,1; got {text!r}") from None
    if any(v < 0 or v != v for v in values):
        raise ValueError(f"{flag} must be >= 0, got {text!r}")
    return values


def run(args) -> int:
    settings = ServeSettings(pin=args.pin, max_tokens=args.max_tokens, client=args.client, repeats=args.repeats,
                             max_prompt_tokens=args.max_prompt_tokens,
                             temperatures=_floats(args.temperatures, "--temperatures"))
    if args.quick:
        settings.concurrency, settings.requests_per_level = (1, 4, 16), 16
    if args.concurrency:
        settings.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    if args.deployments:
        names = tuple(n.strip() for n in args.deployments.split(","))
        unknown = sorted(set(names) - {d.name for d in DEPLOYMENTS})
        if unknown:
            raise ValueError(f"unknown deployments {unknown}; choose from {[d.name for d in DEPLOYMENTS]}")
        settings.deployments = ("plain", *[n for n in names if n != "plain"])  # plain is the baseline
    target = zoo_model(args.target or "qwen3-tiny")
    drafter = zoo_model(args.drafter or "d3d-qwen3-tiny")
    rows = bench_serve(settings, target, drafter)
    print(format_table(rows))
    print("no-draft: the speedup if drafting cost the verifier nothing — tau x plain's step (pass + overhead) "
          "/ this row's, same run; the gap to 'vs plain' is the drafter's share of the critical path")
    out_dir = Path(args.out)
    json_path = Path(args.json) if args.json else out_dir / "serve.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"settings": asdict(settings), "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    for path in plot(rows, out_dir):
        print(f"wrote {path}")
    print(f"wrote {json_path}")
    return 0

