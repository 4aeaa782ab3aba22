"""`specd bench chaos --quick`: the real stack (Redis, trainer, two drafters, a verifier; the tiny
zoo) under a seeded schedule that fires every kind of fault, and the checker over what the
requests and the services recorded. It fails when any check fails: a lost or wrong request, a
bad request with the wrong status, a restart nobody caused, a trace lost between the verifier,
Redis and the trainer's ledger, a leaked row, a latency that does not recover, a corrupted
version installed. The checker's own tests (tests/unit/test_chaos_check.py) show each check
failing on records that break it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.chaos.faults import KINDS
from specd import zoo

pytestmark = pytest.mark.zoo


def test_quick_chaos_run_passes_every_check(tmp_path):
    # The schedule's first runs found a stopped drafter that came back holding the rows of the
    # sequences that finished while it was down: `rows` reports that (the pool now releases them,
    # tests/unit/test_drafter_pool_faults.py), whatever the seed.
    zoo.ensure("qwen3-tiny"), zoo.ensure("d3d-qwen3-tiny")
    report_path = tmp_path / "chaos.json"
    command = [sys.executable, "-m", "specd.cli", "bench", "chaos", "--quick", "--seed", "1",
               "--json", str(report_path), "--workdir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert report_path.exists(), f"no report was written:\n{output[-6000:]}"
    report = json.loads(report_path.read_text())
    failed = {c["name"]: c["problems"] for c in report["checks"] if not c["passed"]}
    assert done.returncode == 0 and not failed, f"checks failed: {failed}\n{output[-6000:]}"
    assert report_path.with_suffix(".png").exists()

    # The run was not vacuous: every kind of fault fired, and there was something to check.
    fired = {f["kind"] for f in report["faults"] if not f["skipped"]}
    assert fired == set(KINDS), f"faults that never fired: {set(KINDS) - fired}; {report['faults']}"
    checks = {c["name"]: c["figures"] for c in report["checks"]}
    assert checks["outputs"]["compared"].get("greedy", 0) >= 10 and checks["outputs"]["compared"].get("sampled", 0) >= 10
    assert checks["bad requests"]["bad_requests"] >= 10
    assert checks["completed"]["cancelled"] >= 1
    assert checks["ledger"]["acknowledged"] >= 4 and checks["ledger"]["checkpoints"] >= 2
    assert report["observations"]["kills"].get("trainer", 0) >= 1
    assert report["observations"]["kills"].get("redis", 0) >= 1
