"""`specd bench chaos`: the real stack under a seeded fault schedule, and a checker (issue 22).

The stack (`services.up.Stack`, supervised: whatever dies is restarted) is Redis with an
append-only file fsynced on every write, the trainer, two drafter replicas and one verifier, all
requiring a bearer token; the tiny zoo by default (``--target smollm2-135m`` for the real
model). Against it, ``--streams`` closed-loop clients (`services.chaos.load`) send mixed greedy
and seeded sampled requests over HTTP and gRPC for ``--seconds``, while `services.chaos.faults`
fires a fault every ``--fault-every MIN,MAX`` seconds, drawn from a schedule seeded by ``--seed``.
A progress line per fault; at the end the load drains, the services' own records are read (their
/metrics, the trace stream and consumer group in one Redis transaction, the trainer's ledger
after it stopped), greedy and sampled outputs are decoded again in this process with plain
decoding, and `services.chaos.check` judges it all. A table, a JSON with every request and fault
(default ``out/bench/chaos.json``) and a plot of p99 latency over time with the faults marked
(the PNG beside the JSON). Exit status 1 when a check fails.

Choices:

- **The verifier's drafter deadline is 1 s** here (``--drafter-timeout``; 10 s by default), so
  a SIGSTOPped drafter (stopped 2.5 s) is a hung peer the pool must route around, not a pause.
- **The trainer checkpoints every 2 steps of 2 traces** (and the stack keeps its consumer name
  across restarts), so a run of a minute sees checkpoints, kills inside the checkpoint-to-ack
  window, and redeliveries of what the killed one held. Its learning rate is 0: the weights stay
  the zoo drafter's, so its gate passes each candidate (not worse) and new versions are published
  all through the run, as in the services' online-loop test; what is checked is the traces'
  bookkeeping, which does not depend on the rate.
- **A reference is plain decoding of the same prompt and params**; a batch computes most of them,
  and one that disagrees with the service is decoded again alone before it counts as a mismatch
  (a batch may round a float sum differently from a single sequence).
- **RSS at the start is read after a warm-up** of one request per stream at once, so that the
  rows the verifier allocates for that many sequences are in it: what the end is compared with
  is the stack at the run's concurrency, not an idle one.
- **Drafters serve /metrics on a free port** (``--metrics-port 0``): the run reads each one's
  port from its log, after every restart.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from matplotlib.figure import Figure

from services.chaos.check import RecoveryRule, check_all, output_matches, percentile
from services.chaos.faults import FAILPOINT, FAILPOINT_SECONDS, KINDS, Injector, schedule
from services.chaos.load import (
    MIN_NEW_TOKENS,
    Client,
    Load,
    PromptPool,
    Recorder,
    completed_latencies,
    draw,
    metrics_url,
    read_metrics,
    rss_bytes,
)
from services.chaos.records import OK, FaultRecord, Ledger, Observations, Reference, RequestRecord
from services.common.config import ServiceConfig
from services.common.server import wait_healthy
from services.up import Stack, StackConfig, StackError, stack_ports, zoo_model
from specd.engine import autoregressive
from specd.models.loading import load_model, read_config
from specd.sampling import SamplingParams
from specd.train.online import read_ledger

TOKEN = "specd-chaos-token"
LATE_SECONDS = 30.0
"""How long the load may outlast ``--seconds`` while delayed faults of the plan still fire."""
DRAFTER_TIMEOUT = 1.0
STREAM, GROUP, DEAD_STREAM = "specd:traces", "specd-trainer", "specd:traces:dead"
"""The verifier's and trainer's defaults, which the chaos stack keeps."""
TRAINER_ARGS = ["--steps-per-version", "2", "--batch-size", "2", "--heldout-every", "3", "--min-heldout", "1",
                "--max-heldout", "4", "--anchors-per-seq", "2", "--branches-per-anchor", "2", "--block-ms", "200",
                "--claim-idle-ms", "5000", "--lr", "0"]


@dataclass(kw_only=True)
class ChaosSettings:
    seconds: float = 120.0
    streams: int = 32
    seed: int = 0
    fault_every: tuple[float, float] = (10.0, 20.0)
    sampled_fraction: float = 0.5
    """Of the well-formed requests, the share sampled with a seed (the rest greedy)."""
    max_num_seqs: int = 0
    """Verifier rows (0: streams + 4, at least 16)."""


def stack_config(settings: ChaosSettings, target: str, drafter: str, workdir: Path) -> StackConfig:
    return StackConfig(
        target=target, drafter=drafter, drafters=2, verifiers=1, trainer=True, restart=True, restart_delay=0.5,
        max_restart_delay=4.0, redis_appendonly=True, auth_token=TOKEN, workdir=str(workdir), drain_seconds=3.0,
        **stack_ports(), max_num_seqs=settings.max_num_seqs or max(16, settings.streams + 4),
        verifier_args=["--drafter-timeout", str(DRAFTER_TIMEOUT)],
        drafter_args=["--metrics-port", "0", "--poll-seconds", "1"], trainer_args=TRAINER_ARGS,
        env={"SPECD_FAILPOINTS": f"{FAILPOINT}=sleep({FAILPOINT_SECONDS:g})",
             "SPECD_FAILPOINT_LOG": str(workdir / "failpoints.jsonl")},
    )


def chaos(settings: ChaosSettings, target: str, drafter: str, workdir: Path) -> dict:
    """One run: everything the JSON holds (module docstring)."""
    pool = PromptPool(target)
    vocab_size = read_config(Path(target))["vocab_size"]
    stack = Stack(stack_config(settings, target, drafter, workdir))
    print(f"starting redis, the trainer, 2 drafters and a verifier of {Path(target).name} (logs in {workdir}) ...",
          flush=True)
    recorder = Recorder()
    with stack:
        stack.wait_drafting()
        verifier = stack.verifiers[0]
        client = Client(verifier.http, verifier.grpc, token=TOKEN, model=Path(target).name, origin=time.monotonic())
        max_model_len = _max_model_len(verifier.http)
        _warm_up(client, pool, settings)
        observations = Observations()
        _snapshot_before(stack, observations)
        plan = schedule(settings.seed, settings.seconds, settings.fault_every, [d.name for d in stack.drafters])
        print(f"load: {settings.streams} streams for {settings.seconds:.0f}s; {len(plan)} faults "
              f"({', '.join(f'{n} {k}' for k, n in sorted(Counter(p.kind for p in plan).items()))}), seed {settings.seed}",
              flush=True)
        client.origin = time.monotonic()
        load = Load(client, pool, recorder, streams=settings.streams, seed=settings.seed,
                    sampled_fraction=settings.sampled_fraction)
        injector = Injector(stack, client, pool, recorder, seed=settings.seed, token=TOKEN,
                            drafter_timeout=DRAFTER_TIMEOUT, failpoint_log=workdir / "failpoints.jsonl",
                            vocab_size=vocab_size, max_model_len=max_model_len,
                            report=lambda fault: _progress(fault, recorder, client.now(), stack, observations))
        load.start()
        injector.start(plan)
        try:
            # A fault that took long (a hang, a publish) delays the rest: the load goes on, up to
            # LATE_SECONDS more, until the plan has fired whole.
            while client.now() < settings.seconds or (injector.running and
                                                      client.now() < settings.seconds + LATE_SECONDS):
                time.sleep(0.2)  # the streams and the injector work in their own threads
        finally:
            injector.stop()
            load.stop()
        print(f"load stopped after {client.now():.1f}s: {len(recorder.records)} requests; draining ...", flush=True)
        _settle(stack, observations)
        _snapshot_after(stack, observations, injector.kills)
        client.close()
    # The trainer saved its last checkpoint on the way out: its ledger is complete now.
    observations.ledger = [Ledger(checkpoint=e.checkpoint, trained=list(e.trained), heldout=list(e.heldout))
                           for e in read_ledger(workdir / "trainer")]
    requests = recorder.snapshot()
    print(f"decoding {sum(r.well_formed and r.status == OK and not r.cancelled for r in requests)} outputs again "
          "in process (plain decoding) ...", flush=True)
    references = compute_references(target, requests, pool)
    results = check_all(requests, injector.faults, observations, references, RecoveryRule())
    return {"settings": asdict(settings), "target": target, "drafter": drafter, "workdir": str(workdir),
            "schedule": [asdict(p) for p in plan], "faults": [asdict(f) for f in injector.faults],
            "checks": [asdict(r) for r in results], "passed": all(r.passed for r in results),
            "observations": asdict(observations), "requests": [asdict(r) for r in requests]}


def _warm_up(client: Client, pool: PromptPool, settings: ChaosSettings) -> None:
    """One request per stream, all at once (not recorded): the verifier's rows for that many
    sequences are allocated before the RSS it starts the load with is read."""
    rng = random.Random(settings.seed)
    records = [draw(rng, pool, 0.0, i) for i in range(settings.streams)]
    for record in records:
        record.transport, record.params["max_tokens"] = "grpc", MIN_NEW_TOKENS
    threads = [threading.Thread(target=client.send, args=(r,), daemon=True) for r in records]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _max_model_len(http: str) -> int:
    request = urllib.request.Request(f"{http}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"][0]["max_model_len"]


def _progress(fault: FaultRecord, recorder: Recorder, now: float, stack: Stack, observations: Observations) -> None:
    observations.rss_samples.append((round(now, 2), {s.name: rss_bytes(s.process.pid) for s in stack.services}))
    records = recorder.snapshot()
    recent = completed_latencies(records, since=now - 10.0)
    what = f"skipped: {fault.skipped}" if fault.skipped else ", ".join(
        f"{k}={v}" for k, v in fault.detail.items() if k in ("pid", "seconds", "inside_window_seconds", "cancelled",
                                                            "published", "version", "refused_by", "installed_by"))
    p99 = f"{percentile(recent, 0.99):.2f}s" if recent else "-"
    verifier = observations.rss_samples[-1][1].get(stack.verifiers[0].name, 0) >> 20
    print(f"{fault.at:7.1f}s {fault.kind:<13}{fault.target:<10} {what}  [{len(records)} requests, p99 {p99} "
          f"over 10s, verifier RSS {verifier} MiB]", flush=True)


# ---------------------------------------------------------------------- the services' records
def _drafter_samples(stack: Stack) -> dict[str, dict[str, float]]:
    return {d.name: samples for d in stack.drafters if (samples := read_metrics(metrics_url(d))) is not None}


def _traces(samples: dict[str, float]) -> tuple[float, float]:
    """The verifier's traces written and dropped (all reasons)."""
    return (samples.get("specd:traces_written_total", 0.0),
            sum(v for k, v in samples.items() if k.startswith("specd:traces_dropped_total")))


def _snapshot_before(stack: Stack, o: Observations, timeout: float = 30.0) -> None:
    """The services' records as the load begins: the stream's length is read between two reads
    of the verifier's counters that agree (the warm-up's traces are being written meanwhile)."""
    client, deadline = redis.Redis.from_url(stack.redis_url), time.monotonic() + timeout
    while True:
        first = read_metrics(stack.verifiers[0].http) or {}
        o.stream_length_before = client.xlen(STREAM)
        o.verifier_before = read_metrics(stack.verifiers[0].http) or {}
        idle = not o.verifier_before.get("specd:num_requests_running", 1.0)
        if (idle and _traces(first) == _traces(o.verifier_before)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # the trace writer is still at the warm-up's traces
    o.drafters_before = _drafter_samples(stack)
    o.rss_start = {s.name: rss_bytes(s.process.pid) for s in stack.services}


def _settle(stack: Stack, o: Observations, timeout: float = 90.0) -> None:
    """Until every service is up and healthy, the verifier runs nothing, the drafters hold no
    more sequences than before the load, and the trace counters stand still (``timeout``: then
    the checks report what is left)."""
    deadline = time.monotonic() + timeout
    client, last = redis.Redis.from_url(stack.redis_url, socket_timeout=2), None
    while True:
        waiting = [s.name for s in stack.services if s.process.poll() is not None]
        try:
            client.ping()
        except redis.RedisError:
            waiting.append("redis")
        try:
            wait_healthy(stack.trainer.grpc, ServiceConfig(auth_token=TOKEN), timeout=1.0)
        except TimeoutError:
            waiting.append("trainer")
        verifier = read_metrics(stack.verifiers[0].http) or {}
        if verifier.get("specd:num_requests_running", 1.0):
            waiting.append("verifier rows")
        drafters = _drafter_samples(stack)
        for d in stack.drafters:
            before = o.drafters_before.get(d.name, {}).get("specd:drafter_sequences", 0.0)
            if drafters.get(d.name, {}).get("specd:drafter_sequences", before + 1) > before:
                waiting.append(f"{d.name} rows")
        traces = _traces(verifier)
        if not waiting and traces == last:
            return
        last = traces
        if time.monotonic() > deadline:
            print(f"still waiting after {timeout:.0f}s for: {', '.join(waiting) or 'the trace counters'}; checking "
                  "as it is", flush=True)
            return
        time.sleep(1.0)  # the trace counters must stand still over a second


def _snapshot_after(stack: Stack, o: Observations, kills: dict[str, int]) -> None:
    o.kills = dict(kills)
    o.restarts = {s.name: s.restarts for s in stack.services}
    o.verifier_after = read_metrics(stack.verifiers[0].http) or {}
    o.drafters_after = _drafter_samples(stack)
    o.rss_end = {s.name: rss_bytes(s.process.pid) for s in stack.services}
    # One transaction: the stream, the group and its pending list as of one instant.
    pipe = redis.Redis.from_url(stack.redis_url, decode_responses=True).pipeline(transaction=True)
    pipe.xrange(STREAM)
    pipe.xinfo_groups(STREAM)
    pipe.xpending_range(STREAM, GROUP, "-", "+", 1 << 30)
    pipe.xrange(DEAD_STREAM)
    entries, groups, pending, dead = pipe.execute()
    o.stream_entries = [(entry_id, fields.get("trace_id", "")) for entry_id, fields in entries]
    group = next((g for g in groups if g["name"] == GROUP), None)
    o.last_delivered = group["last-delivered-id"] if group else "0-0"
    o.pending = [p["message_id"] for p in pending]
    o.dead_sources = [fields["dead_source_id"] for _, fields in dead if "dead_source_id" in fields]


# ---------------------------------------------------------------------- plain decoding, in process
def sampling_params(record: RequestRecord, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    p = record.params
    return SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_k=p["top_k"],
                          top_p=p["top_p"], seed=p["seed"], stop_token_ids=stop_token_ids)


def compute_references(target: str, requests: list[RequestRecord], pool: PromptPool,
                       batch_size: int = 16) -> dict[int, Reference]:
    """Plain decoding of every completed well-formed request (module docstring: batched, and a
    disagreeing one decoded again alone)."""
    model = load_model(target).eval()
    stop = tuple(model.config.stop_token_ids)
    todo = [r for r in requests if r.well_formed and not r.cancelled and r.status == OK]
    keys = {r.index: (tuple(r.prompt_ids), tuple(sorted(r.params.items()))) for r in todo}
    unique = list(dict.fromkeys(keys.values()))
    first = {}
    for r in todo:
        first.setdefault(keys[r.index], r)

    def decode(batch: list[RequestRecord]) -> list[Reference]:
        generations = autoregressive(model, [r.prompt_ids for r in batch], [sampling_params(r, stop) for r in batch])
        return [Reference(tokens=g.token_ids, text=pool.decode(g.token_ids[:-1] if g.finish_reason == "stop"
                                                                else g.token_ids)) for g in generations]

    by_key = {}
    for start in range(0, len(unique), batch_size):
        batch = [first[key] for key in unique[start:start + batch_size]]
        by_key.update(zip(unique[start:start + batch_size], decode(batch)))
    references = {r.index: by_key[keys[r.index]] for r in todo}
    for r in todo:
        if output_matches(r, references[r.index]):
            references[r.index] = decode([r])[0]
    return references


# ---------------------------------------------------------------------- reporting
def format_table(report: dict) -> str:
    lines = [f"{'check':<14}{'':<6}figures", "-" * 78]
    for check in report["checks"]:
        figures = {k: v for k, v in check["figures"].items() if k not in ("faults", "rss", "by_kind", "statuses")}
        lines.append(f"{check['name']:<14}{'pass' if check['passed'] else 'FAIL':<6}"
                     + ", ".join(f"{k} {v}" for k, v in figures.items()))
        lines += [f"{'':<20}{problem}" for problem in check["problems"]]
    faults = Counter((f["kind"], "skipped" if f["skipped"] else "done") for f in report["faults"])
    lines.append("faults: " + ", ".join(f"{kind} {faults[(kind, 'done')]}" + (
        f" (+{faults[(kind, 'skipped')]} skipped)" if faults[(kind, "skipped")] else "") for kind in KINDS))
    recovery = next(c for c in report["checks"] if c["name"] == "recovery")["figures"]["faults"]
    lines.append("recovery (s): " + ", ".join(
        f"{r['kind']}@{r['at']:.0f}s {r['recovery_seconds'] if r['recovery_seconds'] is not None else r['outcome']}"
        for r in recovery))
    rss = next(c for c in report["checks"] if c["name"] == "rows")["figures"]["rss"]
    lines.append("RSS MiB start -> end: " + ", ".join(f"{n} {v['start_mib']:.0f} -> {v['end_mib']:.0f}"
                                                      for n, v in rss.items()))
    return "\n".join(lines)


def plot(report: dict, path: Path, window: float = 3.0) -> None:
    """p99 latency of the requests that ended in the trailing ``window`` seconds, every half
    second, with each fault marked."""
    done = [r for r in report["requests"] if r["kind"] != "bad" and not r["cancelled"] and r["status"] == OK]
    end = max((r["end"] for r in done), default=0.0)
    times = [i * 0.5 for i in range(int(end / 0.5) + 1)]
    p99 = [percentile([r["end"] - r["start"] for r in done if t - window <= r["end"] < t], 0.99) for t in times]
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    ax.plot(times, p99, color="black", linewidth=1, label=f"p99 latency (trailing {window:.0f}s)")
    colours = dict(zip(KINDS, ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8")))
    for kind in KINDS:
        ats = [f["at"] for f in report["faults"] if f["kind"] == kind and not f["skipped"]]
        for i, at in enumerate(ats):
            ax.axvline(at, color=colours[kind], alpha=0.6, linestyle="--", label=kind if i == 0 else None)
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("request latency p99 (s)")
    ax.set_title(f"specd bench chaos: {Path(report['target']).name}, {report['settings']['streams']} streams, "
                 f"seed {report['settings']['seed']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="load duration (default 120; --quick 30)")
    parser.add_argument("--streams", type=int, default=None, help="concurrent client streams (default 32; --quick 6)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule and the requests")
    parser.add_argument("--fault-every", default=None,
                        help="MIN,MAX seconds between faults, drawn uniformly (default 10,20; --quick 2,3)")
    parser.add_argument("--sampled", type=float, default=0.5, help="share of seeded sampled requests (default 0.5)")
    parser.add_argument("--target", default="qwen3-tiny", help="target: a directory or a zoo name (default qwen3-tiny)")
    parser.add_argument("--drafter", default="", help="D3D drafter (default: the zoo's d3d-TARGET)")
    parser.add_argument("--workdir", default="", help="logs, Redis' files, checkpoints (default: a new temporary one)")
    parser.add_argument("--quick", action="store_true", help="a short run: 30 s, 6 streams, a fault every 2-3 s")
    parser.add_argument("--json", default="out/bench/chaos.json", help="where the report goes (the plot beside it)")


def settings_from(args: argparse.Namespace) -> ChaosSettings:
    quick = args.quick
    every = args.fault_every or ("2,3" if quick else "10,20")
    try:
        low, high = (float(x) for x in every.split(","))
    except ValueError:
        raise SystemExit(f"--fault-every takes MIN,MAX seconds (e.g. 10,20), got {every!r}") from None
    settings = ChaosSettings(seconds=args.seconds or (30.0 if quick else 120.0),
                             streams=args.streams or (6 if quick else 32), seed=args.seed, fault_every=(low, high),
                             sampled_fraction=args.sampled)
    if settings.streams < 1 or settings.seconds <= 0 or not 0 <= settings.sampled_fraction <= 1:
        raise SystemExit("--streams must be >= 1, --seconds > 0 and --sampled in [0, 1]")
    return settings


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    try:
        target = zoo_model(args.target)
        drafter = zoo_model(args.drafter or f"d3d-{Path(target).name}")
    except StackError as error:
        print(f"specd bench chaos: {error}", file=sys.stderr)
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="specd-chaos-"))
    try:
        report = chaos(settings, target, drafter, workdir)
    except StackError as error:
        print(f"specd bench chaos: the stack did not start: {error}", file=sys.stderr)
        return 1
    print(format_table(report))
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}; logs in {workdir}")
    print("every check passed" if report["passed"] else
          "a check FAILED: see the problems above, the JSON, and the services' logs", flush=True)
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specd bench chaos", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
