"""Failpoints: a listed one records its hit before it sleeps; an unlisted one costs nothing; a
malformed setting is refused with a message that says what the form is."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from services.common.failpoints import ENVIRONMENT, LOG_ENVIRONMENT, FailpointError, configured, failpoint, parse


def test_a_listed_failpoint_logs_its_hit_then_sleeps(monkeypatch, tmp_path):
    log = tmp_path / "failpoints.jsonl"
    monkeypatch.setenv(ENVIRONMENT, " trainer.after_checkpoint=sleep(0.3), other=sleep(0) ")
    monkeypatch.setenv(LOG_ENVIRONMENT, str(log))
    before = time.time()
    start = time.monotonic()
    failpoint("trainer.after_checkpoint")
    assert time.monotonic() - start >= 0.3
    failpoint("other")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["trainer.after_checkpoint", "other"]
    assert all(line["pid"] == os.getpid() and before <= line["time"] <= time.time() for line in lines)


def test_the_hit_is_on_disk_while_the_failpoint_still_sleeps(monkeypatch, tmp_path):
    """What a fault test relies on: once it reads the line, the process is inside the window."""
    log = tmp_path / "failpoints.jsonl"
    monkeypatch.setenv(ENVIRONMENT, "window=sleep(3)")
    monkeypatch.setenv(LOG_ENVIRONMENT, str(log))
    sleeper = threading.Thread(target=failpoint, args=("window",))
    sleeper.start()
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().endswith("\n")):  # poll the file, as a fault test does
        assert time.monotonic() < deadline, "the failpoint never wrote its hit"
        time.sleep(0.01)
    assert sleeper.is_alive(), "the line appeared only after the sleep"
    assert json.loads(log.read_text())["name"] == "window"
    sleeper.join()


def test_an_unlisted_failpoint_is_a_no_op(monkeypatch, tmp_path):
    log = tmp_path / "failpoints.jsonl"
    monkeypatch.setenv(LOG_ENVIRONMENT, str(log))
    monkeypatch.setenv(ENVIRONMENT, "elsewhere=sleep(30)")
    start = time.monotonic()
    failpoint("trainer.after_checkpoint")
    assert time.monotonic() - start < 5 and not log.exists()
    monkeypatch.delenv(ENVIRONMENT)
    calls = 100_000
    start = time.perf_counter()
    for _ in range(calls):
        failpoint("trainer.after_checkpoint")
    per_call = (time.perf_counter() - start) / calls
    print(f"an inactive failpoint costs {per_call * 1e9:.0f} ns a call")
    assert per_call < 20e-6 and not log.exists()
    assert configured() == {}


@pytest.mark.parametrize(("value", "words"), [
    ("trainer.after_checkpoint", "name=sleep(SECONDS)"),
    ("trainer.after_checkpoint=kill()", "name=sleep(SECONDS)"),
    ("trainer.after_checkpoint=sleep(soon)", "must be a number"),
    ("trainer.after_checkpoint=sleep(-1)", "finite and >= 0"),
    ("trainer.after_checkpoint=sleep(inf)", "finite and >= 0"),
    ("a=sleep(1),a=sleep(2)", "listed twice"),
    ("a=sleep(1);b=sleep(2)", "name=sleep(SECONDS)"),
])
def test_a_malformed_setting_is_refused_at_the_first_call(monkeypatch, value, words):
    monkeypatch.setenv(ENVIRONMENT, value)
    with pytest.raises(FailpointError, match=ENVIRONMENT) as caught:
        failpoint("trainer.after_checkpoint")
    assert words in str(caught.value)
    with pytest.raises(ValueError):  # a FailpointError is a ValueError: a service's start-up refuses it
        configured()


def test_parse():
    assert parse("") == {} and parse(" , ") == {}
    assert parse("a.b=sleep(2.5),c:d-e_f=sleep(0)") == {"a.b": 2.5, "c:d-e_f": 0.0}
