"""A throwaway `redis-server` on a free loopback port, for tests that need real Redis."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Iterator

import redis

from specd.ports import free_port


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """Start redis-server (nothing persisted) and yield its URL; stop it afterwards."""
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:  # readiness: a PING answered
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"redis-server did not start on port {port} (is it installed? `make setup`)") from None
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)
