"""The stack's own Redis under faults: with ``redis_appendonly`` a ``kill -9`` and the supervised
restart lose no write Redis acknowledged (stream entries, the consumer group's acknowledgements);
``DEBUG SLEEP`` is accepted from loopback there (a slow Redis) and refused without it; a
SIGSTOPped Redis is a hung one, not a dead one, and `Stack.stop` still stops it cleanly. A stack
of Redis alone: no models, seconds. (``StackConfig.env`` reaching a service is checked where it
matters, the trainer's failpoint: tests/integration/test_up_supervisor.py.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import redis

from services.up import Stack, StackConfig


def redis_stack(workdir: Path, **overrides) -> Stack:
    config = StackConfig(target="unused", drafter="", trainer=False, verifiers=0, restart=True, restart_delay=0.1,
                         workdir=str(workdir), drain_seconds=1.0, **overrides)
    return Stack(config).start(timeout=30)


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:  # refused (down), LOADING (reading its file), timed out (stopped)
        return False


def wait_restarted(stack: Stack, old_pid: int, client: redis.Redis, timeout: float = 30.0) -> None:
    service = stack.service("redis")
    deadline = time.monotonic() + timeout
    while not (service.restarts >= 1 and service.process.pid != old_pid and answers(client)):
        assert time.monotonic() < deadline, f"redis was not restarted within {timeout:.0f}s"
        time.sleep(0.05)


@pytest.fixture
def stacks():
    started: list[Stack] = []
    yield started
    for stack in started:
        stack.stop()


def test_an_appendonly_redis_comes_back_from_kill_9_with_every_acknowledged_write(stacks, tmp_path):
    stack = redis_stack(tmp_path / "stack", redis_appendonly=True)
    stacks.append(stack)
    service = stack.service("redis")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True, socket_timeout=5)
    ids = [client.xadd("specd:traces", {"trace_id": f"{n:x}", "n": str(n)}) for n in range(3)]
    client.xgroup_create("specd:traces", "specd-trainer", id="0")
    client.xreadgroup("specd-trainer", "trainer", {"specd:traces": ">"})
    client.xack("specd:traces", "specd-trainer", ids[0])  # one acknowledged, two still pending
    client.set("specd:drafter:live", "v1")
    old = service.process.pid
    stack.kill("redis")
    wait_restarted(stack, old, client)

    assert [entry_id for entry_id, _ in client.xrange("specd:traces")] == ids
    assert client.xrange("specd:traces")[2][1] == {"trace_id": "2", "n": "2"}
    pending = client.xpending_range("specd:traces", "specd-trainer", min="-", max="+", count=10)
    assert [p["message_id"] for p in pending] == ids[1:]  # the acknowledgement survived too
    assert client.get("specd:drafter:live") == "v1"
    assert (tmp_path / "stack" / "redis").is_dir()

    start = time.monotonic()
    assert client.execute_command("DEBUG", "SLEEP", "0.2")  # a slow Redis, on loopback
    assert time.monotonic() - start >= 0.2
    client.close()


def test_without_appendonly_redis_restarts_empty_and_refuses_debug(stacks, tmp_path):
    stack = redis_stack(tmp_path / "stack")
    stacks.append(stack)
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True, socket_timeout=5)
    client.xadd("specd:traces", {"n": "0"})
    with pytest.raises(redis.ResponseError, match="DEBUG"):
        client.execute_command("DEBUG", "SLEEP", "0")
    old = stack.service("redis").process.pid
    stack.kill("redis")
    wait_restarted(stack, old, client)
    assert client.xlen("specd:traces") == 0  # nothing persisted, as documented
    client.close()


def test_a_sigstopped_redis_hangs_without_a_restart_and_still_stops_cleanly(stacks, tmp_path):
    stack = redis_stack(tmp_path / "stack", redis_appendonly=True)
    stacks.append(stack)
    service = stack.service("redis")
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=0.5)
    stack.signal("redis", signal.SIGSTOP)
    assert not answers(client)  # hung: the PING times out
    assert service.process.poll() is None and service.restarts == 0
    stack.signal("redis", signal.SIGCONT)
    assert answers(client) and service.restarts == 0
    with pytest.raises(KeyError, match="no service 'drafter-0'"):
        stack.signal("drafter-0", signal.SIGSTOP)

    stack.signal("redis", signal.SIGSTOP)  # stopped when the stack stops: it must still exit on SIGTERM
    start = time.monotonic()
    stack.stop(timeout=10)
    assert service.process.returncode == 0, "redis was killed instead of exiting on SIGTERM"
    assert time.monotonic() - start < 10
    with pytest.raises(ProcessLookupError, match="exited"):
        stack.signal("redis", signal.SIGCONT)
    client.close()
