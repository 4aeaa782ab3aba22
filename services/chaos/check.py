"""The chaos run's checker: pure functions from what was recorded (`services.chaos.records`) to
`CheckResult`s. Nothing here talks to a service, so each property is unit-tested on synthetic
records that break it (tests/unit/test_chaos_check.py).

The properties (issue 22):

1. ``completed``: every well-formed request whose client did not cancel it completed.
   ``outputs``: each completed one equals in-process plain decoding (greedy and seeded sampled
   alike: with a seed, speculative sampling reproduces plain sampling token for token). gRPC is
   compared by ids; HTTP by text and token count (the API returns text).
2. ``bad requests``: each bad request got its documented status (400 / INVALID_ARGUMENT,
   401 / UNAUTHENTICATED). ``restarts``: the verifier never restarted (no bad request, no fault
   took it down); every other service restarted exactly as often as the run killed it.
3. ``traces``: the verifier's counters account for every finished request
   (completed <= written + dropped <= completed + cancelled: a cancelled request that had already
   finished is traced) and the stream holds every written entry (Redis is append-only and fsyncs;
   an entry whose reply a Redis kill lost counts as dropped yet may be there: at most the drops).
   ``ledger``: every trace the group acknowledged (delivered, no longer pending, not dead-lettered)
   is in exactly one checkpoint's ledger entry, trained or held out, and no id is in two entries.
4. ``rows``: after the load drained the verifier runs no request and every drafter holds no more
   sequences than before the load; the verifier's RSS ends within `RSS_GROWTH` x + 64 MiB of its
   warm figure (`warm_rss`; every service's RSS is reported).
5. ``recovery``: after each fault, p99 latency returns to within 1.5x of its value before it
   (`RecoveryRule`); a fault with too few requests before it, whose recovery the next fault
   overlaps, or whose recovery window outlasts the load, is reported, not failed.
6. ``versions``: each corrupted checkpoint was refused by every drafter that was up, and each
   published version was installed by every drafter that was up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.chaos.records import (
    OK,
    FaultRecord,
    Observations,
    Reference,
    RequestRecord,
)

MIB = 1 << 20
MAX_PROBLEMS = 10
"""Problems listed per check (the count says how many there were)."""


@dataclass(kw_only=True, slots=True)
class CheckResult:
    name: str
    passed: bool
    figures: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """The first `MAX_PROBLEMS` violations, in words."""


def _result(name: str, problems: list[str], figures: dict) -> CheckResult:
    figures = {**figures, "violations": len(problems)}
    return CheckResult(name=name, passed=not problems, figures=figures, problems=problems[:MAX_PROBLEMS])


def _describe(r: RequestRecord) -> str:
    return f"request {r.index} ({r.kind}, {r.transport}, {r.prompt} prompt, stream {r.stream}, at {r.start:.1f}s)"


def _judged(requests: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Well-formed requests their client waited for."""
    return [r for r in requests if r.well_formed and not r.cancelled]


# ---------------------------------------------------------------------- 1. requests and outputs
def check_completed(requests: Sequence[RequestRecord]) -> CheckResult:
    judged = _judged(requests)
    problems = [f"{_describe(r)} ended {r.status}: {r.error[:200]}" for r in judged if r.status != OK]
    by_kind = Counter(f"{r.kind} {r.transport}" for r in judged if r.status == OK)
    return _result("completed", problems, {
        "requests": len(requests), "well_formed": len(judged), "completed": len(judged) - len(problems),
        "cancelled": sum(r.cancelled for r in requests), "by_kind": dict(sorted(by_kind.items())),
    })


def output_matches(record: RequestRecord, reference: Reference) -> str:
    """"" when ``record``'s output is ``reference``'s, else what differs."""
    if record.prompt_tokens and record.prompt_tokens != len(record.prompt_ids):
        return f"the server saw {record.prompt_tokens} prompt tokens, the reference {len(record.prompt_ids)}"
    if record.transport == "grpc":
        if record.tokens != reference.tokens:
            first = next((i for i, (a, b) in enumerate(zip(record.tokens, reference.tokens)) if a != b),
                         min(len(record.tokens), len(reference.tokens)))
            return (f"ids differ from token {first}: got {record.tokens[first:first + 6]}..., plain decoding "
                    f"{reference.tokens[first:first + 6]}... ({len(record.tokens)} vs {len(reference.tokens)} tokens)")
        return ""
    if record.completion_tokens != len(reference.tokens):
        return f"{record.completion_tokens} tokens, plain decoding {len(reference.tokens)}"
    if record.text != reference.text:
        return f"text differs: got {record.text[:60]!r}, plain decoding {reference.text[:60]!r}"
    return ""


def check_outputs(requests: Sequence[RequestRecord], references: dict[int, Reference]) -> CheckResult:
    """Every completed well-formed request against its reference (by request index)."""
    problems, compared = [], Counter()
    for r in _judged(requests):
        if r.status != OK:
            continue
        reference = references.get(r.index)
        if reference is None:
            problems.append(f"{_describe(r)}: no reference was computed")
            continue
        compared[r.kind] += 1
        difference = output_matches(r, reference)
        if difference:
            problems.append(f"{_describe(r)} params {r.params}: {difference}")
    return _result("outputs", problems, {"compared": dict(compared), "mismatches": len(problems)})


# ---------------------------------------------------------------------- 2. statuses and restarts
def check_bad_requests(requests: Sequence[RequestRecord]) -> CheckResult:
    bad = [r for r in requests if not r.well_formed]
    problems = [f"{_describe(r)}, bad {r.bad}: got {r.status}, documented {' or '.join(r.expected)}"
                for r in bad if r.status not in r.expected]
    statuses = Counter(f"{r.bad} {r.transport} -> {r.status}" for r in bad)
    return _result("bad requests", problems, {"bad_requests": len(bad), "statuses": dict(sorted(statuses.items()))})


def check_restarts(observations: Observations) -> CheckResult:
    problems = []
    for name, restarts in sorted(observations.restarts.items()):
        kills = observations.kills.get(name, 0)
        if name.startswith("verifier") and restarts:
            problems.append(f"{name} restarted {restarts} times: it must never go down (see its log)")
        elif restarts != kills:
            problems.append(f"{name} restarted {restarts} times but was killed {kills} times")
    return _result("restarts", problems, {"restarts": dict(observations.restarts), "kills": dict(observations.kills)})


# ---------------------------------------------------------------------- 3. traces and the ledger
def _delta(after: dict[str, float], before: dict[str, float], prefix: str) -> float:
    """The change of every sample whose name starts with ``prefix`` (all label values summed)."""
    def total(samples: dict[str, float]) -> float:
        return sum(v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{"))
    return total(after) - total(before)


def check_traces(requests: Sequence[RequestRecord], observations: Observations) -> CheckResult:
    o = observations
    completed = sum(1 for r in _judged(requests) if r.status == OK and (r.tokens or r.completion_tokens))
    cancelled = sum(r.cancelled for r in requests)
    written = _delta(o.verifier_after, o.verifier_before, "specd:traces_written_total")
    dropped = _delta(o.verifier_after, o.verifier_before, "specd:traces_dropped_total")
    entries = len(o.stream_entries) - o.stream_length_before
    problems = []
    if not completed <= written + dropped <= completed + cancelled:
        problems.append(f"{completed} requests completed ({cancelled} more cancelled) but the verifier counted "
                        f"{written:.0f} traces written + {dropped:.0f} dropped")
    if not written <= entries <= written + dropped:
        problems.append(f"the stream gained {entries} entries but the verifier wrote {written:.0f} "
                        f"(and dropped {dropped:.0f}): {'entries were lost' if entries < written else 'unexplained entries'}")
    return _result("traces", problems, {"completed": completed, "cancelled": cancelled, "written": written,
                                        "dropped": dropped, "stream_entries": entries})


def _entry_key(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def acknowledged(observations: Observations) -> list[tuple[str, str]]:
    """(entry id, trace id) of every entry the group acknowledged: delivered, not pending, not
    sent to the dead-letter stream."""
    o = observations
    pending, dead, last = set(o.pending), set(o.dead_sources), _entry_key(o.last_delivered)
    return [(entry, trace) for entry, trace in o.stream_entries
            if _entry_key(entry) <= last and entry not in pending and entry not in dead]


def check_ledger(observations: Observations) -> CheckResult:
    entries_of: dict[str, list[int]] = {}
    sides: dict[str, list[str]] = {}  # per trace, "trained" / "held out" in each entry it is in
    for entry in observations.ledger:
        for side, trace_ids in (("trained", entry.trained), ("held out", entry.heldout)):
            for trace_id in trace_ids:
                entries_of.setdefault(trace_id, []).append(entry.checkpoint)
                sides.setdefault(trace_id, []).append(side)
    acked = acknowledged(observations)
    problems = [f"trace {trace} (entry {entry}) was acknowledged but is in no checkpoint's ledger: lost to training"
                for entry, trace in acked if trace not in entries_of]
    twice = {t: c for t, c in entries_of.items() if len(c) > 1}
    problems += [f"trace {t} is in the ledger of checkpoints {c}: taken in twice ({', '.join(sides[t])})"
                 for t, c in twice.items()]
    return _result("ledger", problems, {
        "acknowledged": len(acked), "pending": len(observations.pending), "dead_letters": len(observations.dead_sources),
        "checkpoints": len(observations.ledger), "lost": sum(t not in entries_of for _, t in acked),
        "double_trained": len(twice),
        "trained": sum(len(e.trained) for e in observations.ledger),
        "heldout": sum(len(e.heldout) for e in observations.ledger),
    })


# ---------------------------------------------------------------------- 4. rows and memory
RSS_GROWTH = 1.25
"""How much a verifier's RSS may grow from warm to the end of the run. Warm is the largest of the
start's figure and the samples of the run's first third: the start is taken before the load has
grown the rows, the caches and the allocator's arenas to its size (a run's JSON has the
samples: ``observations.rss_samples``), so a start-to-end ratio mistakes warming up for a leak,
while a leak keeps growing after the first third."""


def warm_rss(observations: Observations, name: str) -> int:
    """``name``'s RSS once warm (see `RSS_GROWTH`), in bytes."""
    samples = [sample.get(name, 0) for _, sample in observations.rss_samples]
    return max([observations.rss_start.get(name, 0), *samples[: max(1, len(samples) // 3)]])


def check_rows(observations: Observations) -> CheckResult:
    o = observations
    problems = []
    running = o.verifier_after.get("specd:num_requests_running", 0.0)
    if running:
        problems.append(f"the verifier still runs {running:.0f} requests after the load drained: leaked rows")
    for name, after in sorted(o.drafters_after.items()):
        before = o.drafters_before.get(name, {}).get("specd:drafter_sequences", 0.0)
        now = after.get("specd:drafter_sequences", 0.0)
        if now > before:
            problems.append(f"{name} holds {now:.0f} sequences after the load drained, {before:.0f} before: leaked rows")
    rss = {name: {"start_mib": round(o.rss_start[name] / MIB, 1), "end_mib": round(o.rss_end.get(name, 0) / MIB, 1)}
           for name in sorted(o.rss_start)}
    for name, start in o.rss_start.items():
        if not name.startswith("verifier"):  # the others restart under the faults: reported only
            continue
        warm, end = warm_rss(o, name), o.rss_end.get(name, 0)
        rss[name]["warm_mib"] = round(warm / MIB, 1)
        if end > warm * RSS_GROWTH + 64 * MIB:
            problems.append(f"{name}'s RSS grew from {warm / MIB:.0f} MiB (warm, in the run's first third) to "
                            f"{end / MIB:.0f} MiB at the end (allowed: {RSS_GROWTH}x + 64 MiB): a leak")
    return _result("rows", problems, {"verifier_running": running, "rss": rss, "drafter_sequences": {
        name: after.get("specd:drafter_sequences", 0.0) for name, after in sorted(o.drafters_after.items())}})


# ---------------------------------------------------------------------- 5. recovery
@dataclass(kw_only=True, slots=True)
class RecoveryRule:
    before_seconds: float = 10.0
    """The pre-fault window: requests that started and ended in it give the baseline p99."""
    within_seconds: float = 10.0
    """Latency must be back within this long after the fault."""
    window_seconds: float = 3.0
    """The p99 at d seconds after a fault is that of the requests that started in [d, d + window)."""
    step_seconds: float = 0.5
    factor: float = 1.5
    min_samples: int = 5
    """Fewer requests in a window than this: too thin to judge."""


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def recovery_times(requests: Sequence[RequestRecord], faults: Sequence[FaultRecord],
                   rule: RecoveryRule) -> list[dict]:
    """Per fault: its baseline p99, when latency was back (seconds after the fault ended) and
    the outcome: "recovered", "not recovered", "thin" (too few requests before it),
    "overlapped" (not back before the next fault's effect could be in the window) or "cut short"
    (not back before the load ended)."""
    done = sorted((r for r in _judged(requests) if r.status == OK), key=lambda r: r.start)
    starts = [f.at for f in faults if not f.skipped]
    last_start = done[-1].start if done else 0.0
    out = []
    for fault in faults:
        if fault.skipped:
            continue
        t, over = fault.at, max(fault.end, fault.at)  # a hang lasts: recovery counts from its end
        before = [r.latency for r in done if t - rule.before_seconds <= r.start and r.end < t]
        row = {"kind": fault.kind, "target": fault.target, "at": round(t, 2), "baseline_p99": None,
               "recovery_seconds": None, "outcome": "thin"}
        if len(before) < rule.min_samples:
            out.append(row)
            continue
        baseline = percentile(before, 0.99)
        row["baseline_p99"] = round(baseline, 4)
        d = 0.0
        while d <= rule.within_seconds + 1e-9:
            window = [r.latency for r in done if over + d <= r.start < over + d + rule.window_seconds]
            if len(window) >= rule.min_samples and percentile(window, 0.99) <= rule.factor * baseline:
                row["recovery_seconds"], row["outcome"] = round(d, 2), "recovered"
                break
            d += rule.step_seconds
        else:
            horizon = over + rule.within_seconds + rule.window_seconds
            if horizon > last_start:
                row["outcome"] = "cut short"  # the load ended before the recovery window did
            elif any(t < s < horizon for s in starts):
                row["outcome"] = "overlapped"
            else:
                row["outcome"] = "not recovered"
        out.append(row)
    return out


def check_recovery(requests: Sequence[RequestRecord], faults: Sequence[FaultRecord],
                   rule: RecoveryRule | None = None) -> CheckResult:
    rule = rule or RecoveryRule()
    rows = recovery_times(requests, faults, rule)
    problems = [f"{r['kind']} {r['target']} at {r['at']}s: p99 latency was not back within {rule.factor}x of its "
                f"{r['baseline_p99']}s baseline {rule.within_seconds:.0f}s later" for r in rows
                if r["outcome"] == "not recovered"]
    times = [r["recovery_seconds"] for r in rows if r["recovery_seconds"] is not None]
    return _result("recovery", problems, {
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "max_recovery_seconds": max(times) if times else None, "faults": rows,
    })


# ---------------------------------------------------------------------- 6. drafter versions
def check_versions(faults: Sequence[FaultRecord]) -> CheckResult:
    """From the injectors' evidence: a corrupted checkpoint refused by every drafter that was up,
    a published version installed by every drafter that was up."""
    problems, counts = [], Counter()
    for fault in faults:
        if fault.skipped or fault.kind not in ("corrupt", "publish"):
            continue
        counts[fault.kind] += 1
        expected = set(fault.detail.get("drafters", []))
        if fault.kind == "corrupt":
            refused = set(fault.detail.get("refused_by", []))
            installed = set(fault.detail.get("installed_by", []))
            if installed or not expected <= refused:
                problems.append(f"corrupted version {fault.detail.get('version')} at {fault.at:.1f}s: refused by "
                                f"{sorted(refused)}, installed by {sorted(installed)}; every drafter up "
                                f"({sorted(expected)}) must refuse it")
        elif fault.detail.get("published"):
            installed = set(fault.detail.get("installed_by", []))
            if not expected <= installed:
                problems.append(f"published version {fault.detail.get('version')} at {fault.at:.1f}s was installed by "
                                f"{sorted(installed)} only, of the drafters up {sorted(expected)}")
    return _result("versions", problems, {"checked": dict(counts)})


def check_all(requests: Sequence[RequestRecord], faults: Sequence[FaultRecord], observations: Observations,
              references: dict[int, Reference], rule: RecoveryRule | None = None) -> list[CheckResult]:
    return [
        check_completed(requests), check_outputs(requests, references), check_bad_requests(requests),
        check_restarts(observations), check_traces(requests, observations), check_ledger(observations),
        check_rows(observations), check_recovery(requests, faults, rule), check_versions(faults),
    ]
