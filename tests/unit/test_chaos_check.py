"""The chaos checker on synthetic records: each check passes on a run where its property holds
and fails, naming the violation, when one thing breaks it (a lost request, a mismatched output,
a trace acknowledged but in no ledger entry, an id in two entries, a wrong status, a leaked row,
a restart, an unrecovered latency, a corrupted version installed)."""

from __future__ import annotations

import copy

import pytest

from services.chaos.check import (
    MIB,
    RecoveryRule,
    acknowledged,
    check_all,
    check_bad_requests,
    check_completed,
    check_ledger,
    check_outputs,
    check_recovery,
    check_restarts,
    check_rows,
    check_traces,
    check_versions,
)
from services.chaos.faults import KINDS, schedule
from services.chaos.records import BAD, CANCEL, GREEDY, SAMPLED, FaultRecord, Ledger, Observations, Reference, RequestRecord


def request(index: int, start: float, latency: float = 0.5, **overrides) -> RequestRecord:
    fields = dict(index=index, stream=index % 4, kind=GREEDY, transport="grpc", prompt="ids", prompt_ids=[1, 2, 3],
                  params={"max_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None},
                  start=start, end=start + latency, tokens=[5, 6, 7, 8], completion_tokens=4, prompt_tokens=3,
                  finish_reason="length")
    return RequestRecord(**{**fields, **overrides})


@pytest.fixture
def run():
    """A healthy run: 60 s of requests every 0.1 s (HTTP and gRPC, greedy and sampled), a burst
    of bad ones, a cancelled one, one fault of each kind, and services' records that agree."""
    requests = []
    for i in range(600):
        transport = ("grpc", "http", "http-stream")[i % 3]
        extra = {"transport": transport}
        if transport != "grpc":
            extra |= {"tokens": [], "text": "abcd"}
        if i % 2:
            extra |= {"kind": SAMPLED, "params": {"max_tokens": 4, "temperature": 0.9, "top_k": 20, "top_p": 0.9,
                                                  "seed": i}}
        requests.append(request(i, i * 0.1, **extra))
    n = len(requests)
    requests += [
        request(n, 30.0, kind=BAD, bad="vocab", status="INVALID_ARGUMENT", expected=("INVALID_ARGUMENT",), tokens=[]),
        request(n + 1, 30.0, kind=BAD, bad="token", transport="http", status="401", expected=("401",), tokens=[]),
        request(n + 2, 30.0, kind=CANCEL, cancelled=True, tokens=[5]),
    ]
    references = {r.index: Reference(tokens=[5, 6, 7, 8], text="abcd") for r in requests}
    faults = [FaultRecord(kind=kind, target="drafter-0", at=15.0 + 5 * i, end=15.0 + 5 * i) for i, kind in enumerate(KINDS)]
    faults[-2].detail = {"published": True, "version": "v1", "drafters": ["drafter-0", "drafter-1"],
                         "installed_by": ["drafter-0", "drafter-1"]}
    faults[-1].detail = {"version": "v1", "drafters": ["drafter-0", "drafter-1"],
                         "refused_by": ["drafter-0", "drafter-1"], "installed_by": []}
    entries = [(f"{1000 + i}-0", f"{i:032x}") for i in range(n)]
    observations = Observations(
        kills={"drafter-0": 2, "redis": 1, "trainer": 1},
        restarts={"verifier-0": 0, "drafter-0": 2, "drafter-1": 0, "redis": 1, "trainer": 1},
        verifier_before={"specd:traces_written_total": 10.0, "specd:num_requests_running": 0.0},
        verifier_after={"specd:traces_written_total": 10.0 + n - 3,
                        "specd:traces_dropped_total{reason=redis_unavailable}": 3.0, "specd:num_requests_running": 0.0},
        drafters_before={"drafter-0": {"specd:drafter_sequences": 1.0}, "drafter-1": {"specd:drafter_sequences": 0.0}},
        drafters_after={"drafter-0": {"specd:drafter_sequences": 0.0}, "drafter-1": {"specd:drafter_sequences": 0.0}},
        stream_length_before=10, stream_entries=[(f"{i}-0", f"{i:032x}f") for i in range(10)] + entries[: n - 3],
        last_delivered=entries[n - 10][0], pending=[entries[n - 12][0]], dead_sources=[entries[0][0]],
        ledger=[Ledger(checkpoint=1, trained=[t for _, t in entries[1:200]], heldout=[]),
                Ledger(checkpoint=2, trained=[t for _, t in entries[200:400]], heldout=[]),
                Ledger(checkpoint=3, trained=[t for _, t in entries[400:n - 30]],
                       heldout=[t for _, t in entries[n - 30:n - 3]]),
                Ledger(checkpoint=4, trained=[], heldout=[f"{i:032x}f" for i in range(10)])],
        rss_start={"verifier-0": 300 * MIB, "drafter-0": 200 * MIB},
        rss_end={"verifier-0": 320 * MIB, "drafter-0": 210 * MIB},
    )
    return requests, faults, observations, references


def failed(results):
    return {r.name: r.problems for r in results if not r.passed}


def test_a_healthy_run_passes_every_check(run):
    results = check_all(*run)
    assert failed(results) == {}
    ledger = next(r for r in results if r.name == "ledger")
    assert ledger.figures["acknowledged"] > 500 and ledger.figures["lost"] == 0


def test_a_lost_request_fails_completed(run):
    requests = run[0]
    requests[7].status, requests[7].error = "UNAVAILABLE", "no drafter"
    result = check_completed(requests)
    assert not result.passed and "request 7" in result.problems[0] and "UNAVAILABLE" in result.problems[0]


def test_a_cancelled_request_is_not_required_to_complete(run):
    requests = run[0]
    requests[-1].status = "CANCELLED"
    assert check_completed(requests).passed


@pytest.mark.parametrize("index", [0, 1, 2], ids=["grpc ids", "http text", "http-stream token count"])
def test_a_mismatched_output_fails_outputs(run, index):
    requests, references = run[0], run[3]
    if index == 0:
        requests[0].tokens = [5, 6, 9, 8]
    elif index == 1:
        requests[1].text = "abce"
    else:
        requests[2].completion_tokens = 5
    result = check_outputs(requests, references)
    assert not result.passed and f"request {index}" in result.problems[0]


def test_a_sampled_output_from_the_wrong_seed_fails_outputs(run):
    requests, references = run[0], run[3]
    references[3] = Reference(tokens=[5, 6, 7, 1], text="abc!")  # what seed 3 gives
    result = check_outputs(requests, references)
    assert not result.passed and "request 3 (sampled" in result.problems[0]


def test_a_wrong_status_fails_bad_requests(run):
    requests = run[0]
    bad = next(r for r in requests if r.bad == "token")
    bad.status = "200"
    result = check_bad_requests(requests)
    assert not result.passed and "got 200, documented 401" in result.problems[0]


def test_a_verifier_restart_or_an_unexplained_restart_fails_restarts(run):
    observations = run[2]
    down = copy.deepcopy(observations)
    down.restarts["verifier-0"] = 1
    assert "verifier-0 restarted 1 times" in check_restarts(down).problems[0]
    extra = copy.deepcopy(observations)
    extra.restarts["drafter-1"] = 1  # never killed
    assert "killed 0 times" in check_restarts(extra).problems[0]


def test_a_trace_the_counters_miss_or_the_stream_lost_fails_traces(run):
    requests, observations = run[0], run[2]
    uncounted = copy.deepcopy(observations)
    uncounted.verifier_after["specd:traces_dropped_total{reason=redis_unavailable}"] = 0.0
    assert not check_traces(requests, uncounted).passed
    lost = copy.deepcopy(observations)
    del lost.stream_entries[-3:]  # written, acknowledged by Redis, gone after its restart
    result = check_traces(requests, lost)
    assert not result.passed and "entries were lost" in result.problems[0]


def test_a_trace_acknowledged_but_in_no_ledger_entry_fails_ledger(run):
    observations = run[2]
    entry, trace = acknowledged(observations)[50]
    for ledger in observations.ledger:
        ledger.trained = [t for t in ledger.trained if t != trace]
        ledger.heldout = [t for t in ledger.heldout if t != trace]
    result = check_ledger(observations)
    assert not result.passed and trace in result.problems[0] and result.figures["lost"] == 1


def test_pending_and_dead_lettered_traces_need_no_ledger_entry(run):
    observations = run[2]
    pending, dead = observations.pending[0], observations.dead_sources[0]
    assert pending not in {e for e, _ in acknowledged(observations)}
    assert dead not in {e for e, _ in acknowledged(observations)}
    assert check_ledger(observations).passed


def test_an_id_in_two_ledger_entries_fails_ledger(run):
    observations = run[2]
    twice = observations.ledger[0].trained[3]
    observations.ledger[2].heldout.append(twice)
    result = check_ledger(observations)
    assert not result.passed and f"trace {twice} is in the ledger of checkpoints [1, 3]: taken in twice (trained, held out)" in result.problems[0]
    assert result.figures["double_trained"] == 1


def test_a_leaked_row_or_a_growing_verifier_fails_rows(run):
    observations = run[2]
    leaked = copy.deepcopy(observations)
    leaked.verifier_after["specd:num_requests_running"] = 1.0
    assert "still runs 1 requests" in check_rows(leaked).problems[0]
    drafter = copy.deepcopy(observations)
    drafter.drafters_after["drafter-1"]["specd:drafter_sequences"] = 2.0
    assert "drafter-1 holds 2 sequences" in check_rows(drafter).problems[0]
    grown = copy.deepcopy(observations)
    grown.rss_end["verifier-0"] = 600 * MIB
    assert "RSS grew" in check_rows(grown).problems[0]
    # Warming up is not a leak: grown early in the run and no further, it passes; growing on, it fails.
    warming = copy.deepcopy(observations)
    warming.rss_samples = [(10.0 * i, {"verifier-0": (300 + 200 * (i >= 1)) * MIB}) for i in range(9)]
    warming.rss_end["verifier-0"] = 520 * MIB
    assert check_rows(warming).passed and check_rows(warming).figures["rss"]["verifier-0"]["warm_mib"] == 500.0
    leaking = copy.deepcopy(warming)
    leaking.rss_samples = [(10.0 * i, {"verifier-0": (300 + 60 * i) * MIB}) for i in range(9)]
    leaking.rss_end["verifier-0"] = 840 * MIB
    assert "a leak" in check_rows(leaking).problems[0]
    assert check_rows(observations).figures["rss"]["drafter-0"] == {"start_mib": 200.0, "end_mib": 210.0}


def test_latency_that_stays_high_after_a_fault_fails_recovery(run):
    requests, faults = run[0], run[1]
    lone = [faults[0]]  # at 15 s; nothing else fires near it
    assert check_recovery(requests, lone).figures["outcomes"] == {"recovered": 1}
    for r in requests:
        if r.start >= 15.0:
            r.end = r.start + 2.0  # 4x the 0.5 s baseline, for good
    result = check_recovery(requests, lone)
    assert not result.passed and "drafter_kill drafter-0 at 15.0s" in result.problems[0]
    # The same with another fault inside its recovery window: overlapped, reported, not failed;
    # and one whose recovery window outlasts the load: cut short, reported, not failed.
    overlapped = check_recovery(requests, faults[:2])
    assert overlapped.figures["outcomes"]["overlapped"] >= 1
    for r in requests:
        if r.start >= 50.0:
            r.end = r.start + 8.0
    late = FaultRecord(kind="drafter_kill", target="drafter-0", at=50.0, end=50.0)
    assert check_recovery(requests, [late]).figures["outcomes"] == {"cut short": 1}


def test_recovery_time_is_when_latency_is_back(run):
    requests = run[0]
    for r in requests:
        if 15.0 <= r.start < 19.0:
            r.end = r.start + 3.0
    result = check_recovery(requests, [FaultRecord(kind="redis_kill", target="redis", at=15.0, end=15.0)],
                            RecoveryRule(window_seconds=1.0))
    assert result.passed and result.figures["faults"][0]["recovery_seconds"] == 4.0


def test_a_fault_with_too_few_requests_before_it_is_reported_not_failed(run):
    result = check_recovery(run[0], [FaultRecord(kind="redis_slow", target="redis", at=0.2, end=0.2)])
    assert result.passed and result.figures["outcomes"] == {"thin": 1}


def test_a_corrupted_version_installed_or_not_refused_fails_versions(run):
    faults = run[1]
    installed = copy.deepcopy(faults)
    installed[-1].detail["installed_by"] = ["drafter-1"]
    assert not check_versions(installed).passed
    silent = copy.deepcopy(faults)
    silent[-1].detail["refused_by"] = ["drafter-0"]
    assert "every drafter up" in check_versions(silent).problems[0]
    missed = copy.deepcopy(faults)
    missed[-2].detail["installed_by"] = ["drafter-0"]
    assert "installed by ['drafter-0'] only" in check_versions(missed).problems[0]


def test_the_schedule_is_seeded_and_hits_every_kind():
    plan = schedule(3, 40.0, (2.5, 4.0), ["drafter-0", "drafter-1"])
    assert plan == schedule(3, 40.0, (2.5, 4.0), ["drafter-0", "drafter-1"])
    assert plan != schedule(4, 40.0, (2.5, 4.0), ["drafter-0", "drafter-1"])
    kinds = [p.kind for p in plan]
    assert set(kinds) == set(KINDS) and kinds.index("publish") < kinds.index("corrupt")
    gaps = [b.at - a.at for a, b in zip(plan, plan[1:])]
    assert all(2.5 <= g <= 4.0 + 1e-6 for g in gaps) and plan[-1].at <= 40.0 - 2.5
    assert {p.target for p in plan if p.kind.startswith("drafter")} <= {"drafter-0", "drafter-1"}
