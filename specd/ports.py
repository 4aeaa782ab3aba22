"""Free TCP ports for the processes specd starts on one host (`specd up`, benchmarks, tests).

A port the kernel gives for ``bind(0)`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux by default), the range every
outgoing connection also takes its local port from. Between the moment such a port is chosen and
the moment a child process binds it, a gRPC, Redis or gloo connection can take it, and the child
dies with "port taken". So the ports here come from outside that range, are checked by binding
them, and one process never hands the same port out twice. A run of ``span`` consecutive ports is
free as a whole, for services that place replicas at offsets from a base port.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
"""Below this, ports are left to the services a machine runs by convention."""
_TRIES = 2000

_given: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _candidate_range(span: int) -> tuple[int, int]:
    """Bases [low, high) whose runs lie outside the ephemeral range where there is room for it."""
    low, high = _ephemeral_range()
    if low - _LOWEST >= 1000 + span:
        return _LOWEST, low - span + 1
    if 65535 - high >= 1000 + span:
        return high + 1, 65536 - span
    return _LOWEST, 65536 - span  # no room outside it: the bind check still stands


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(span: int = 1, host: str = "127.0.0.1") -> int:
    """A port ``p`` such that ``p .. p + span - 1`` are free on ``host`` now and were not given out
    before by this process. OSError when no such run is found."""
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    low, high = _candidate_range(span)
    with _lock:
        for _ in range(_TRIES):
            base = _random.randrange(low, high)
            ports = range(base, base + span)
            if any(p in _given for p in ports) or not all(_bindable(host, p) for p in ports):
                continue
            _given.update(ports)
            return base
    raise OSError(f"no run of {span} free TCP ports in {low}-{high + span - 1} on {host} after {_TRIES} tries: "
                  "free some ports or pass explicit ones")
