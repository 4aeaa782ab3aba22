"""`specd.ports.free_port`: runs of free ports outside the ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from specd import ports
from specd.ports import free_port


def test_runs_are_free_distinct_and_outside_the_ephemeral_range():
    low, high = ports._ephemeral_range()
    given: list[range] = []
    for span in (1, 1, 5, 40, 108, 1):
        base = free_port(span=span)
        run = range(base, base + span)
        assert all(p < low or p > high for p in run), (run, low, high)
        assert not any(set(run) & set(other) for other in given), "a port was handed out twice"
        for port in run:  # every port of the run binds
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        given.append(run)


def test_a_port_in_use_is_never_given(monkeypatch):
    with socket.socket() as busy, socket.socket() as idle:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        idle.bind(("127.0.0.1", 0))
        taken, free = busy.getsockname()[1], idle.getsockname()[1]
        idle.close()
        candidates = iter([taken, taken, free])
        monkeypatch.setattr(ports._random, "randrange", lambda low, high: next(candidates))
        assert free_port() == free


def test_no_free_run_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda host, port: False)
    with pytest.raises(OSError, match="no run of 3 free TCP ports"):
        free_port(span=3)
