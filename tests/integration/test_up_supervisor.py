"""`specd up` under faults: whatever dies is restarted while the rest keeps serving, and a stop
signal still stops everything within the grace.

Each test runs the command itself (``python -m specd.cli up``, the zoo's tiny models, free ports)
and finds its services' pids in /proc. Greedy decoding is lossless, so every completion streamed
through a fault must equal the one sent before any fault, character for character.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from services.client import stream_completion
from services.common.config import ServiceConfig
from services.common.failpoints import ENVIRONMENT as FAILPOINTS
from services.common.failpoints import LOG_ENVIRONMENT as FAILPOINT_LOG
from services.common.server import open_channel, wait_healthy
from services.up import STOP_MARGIN_SECONDS, Stack, StackConfig, free_port, stack_ports
from specd import zoo
from specd._proto.v1 import drafter_pb2, drafter_pb2_grpc
from specd.train.online import read_ledger

pytestmark = pytest.mark.zoo

DRAIN = 5.0
"""Every service's --drain-seconds here."""
GRACE = DRAIN + STOP_MARGIN_SECONDS
"""What a stop of `specd up` may take: the verifiers' drain, then a few seconds for the rest."""
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def paths():
    return str(zoo.ensure("qwen3-tiny")), str(zoo.ensure("d3d-qwen3-tiny"))


@pytest.fixture(scope="module")
def prompts():
    heldout = zoo.heldout()
    return [heldout[domain][0].prompt for domain in ("code", "dialogue", "math")]


class Up:
    """One `specd up` process; its output (stdout and stderr) is collected line by line, each
    line with the time it arrived."""

    def __init__(self, paths, workdir: Path, *flags: str, drafters: int = 1, trainer: bool = False) -> None:
        self.drafters = drafters
        ports = stack_ports()
        self.http_port, self.grpc_port = ports["verifier_http_port"], ports["verifier_grpc_port"]
        self.drafter_port, self.trainer_port = ports["drafter_port"], ports["trainer_port"]
        command = [sys.executable, "-m", "specd.cli", "up", "--target", paths[0], "--drafter", paths[1],
                   "--drafters", str(drafters), "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                   "--drafter-port", str(self.drafter_port), "--trainer-port", str(self.trainer_port),
                   "--workdir", str(workdir), "--drain-seconds", str(DRAIN), *([] if trainer else ["--no-trainer"]),
                   *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lines: list[tuple[float, str]] = []
        self.seen: set[int] = set()  # every service pid ever found
        self._changed = threading.Condition()
        self._ended = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def address(self, name: str) -> str:
        port = {"verifier-0": self.grpc_port, "trainer": self.trainer_port}.get(name)
        return f"127.0.0.1:{port or self.drafter_port + int(name.removeprefix('drafter-'))}"

    def wait_for(self, text: str, *, after: int = 0, count: int = 1, timeout: float = 180.0) -> float:
        """When the ``count``-th output line from line ``after`` on containing ``text`` arrived."""
        def found() -> float | None:
            times = [at for at, line in self.lines[after:] if text in line]
            return times[count - 1] if len(times) >= count else None

        with self._changed:
            self._changed.wait_for(lambda: found() is not None or self._ended, timeout)
            at = found()
        assert at is not None, f"`specd up` never printed {text!r}; its output:\n{self.output()}"
        return at

    def output(self) -> str:
        with self._changed:
            return "\n".join(line for _, line in self.lines)

    def pids(self) -> dict[str, int]:
        """Its running services' pids by name, from the command lines of its children."""
        names = {str(self.grpc_port): "verifier-0", str(self.trainer_port): "trainer"}
        names |= {str(self.drafter_port + i): f"drafter-{i}" for i in range(self.drafters)}
        found = {}
        for pid in _children(self.process.pid):
            args = _cmdline(pid)
            if args and "redis-server" in args[0]:  # it rewrites its title: "redis-server 127.0.0.1:port"
                found["redis"] = pid
            elif "--port" in args and args[args.index("--port") + 1] in names:  # a fork not yet exec'd has neither
                found[names[args[args.index("--port") + 1]]] = pid
        self.seen |= set(found.values())
        return found

    def stop(self, signum: int = signal.SIGTERM) -> tuple[int, float]:
        """Signal it; its exit code and how long it took to exit."""
        self.pids()
        start = time.monotonic()
        self.process.send_signal(signum)
        code = self.process.wait(GRACE + 30)
        return code, time.monotonic() - start

    def close(self) -> None:
        if self.process.poll() is None:
            self.pids()
            self.process.kill()
            self.process.wait()
        for pid in self.seen:  # a test that failed half-way must not leave services behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:  # exited meanwhile
                continue
            if int(ppid) == parent and state != "Z":
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def start_up(paths, tmp_path):
    started: list[Up] = []

    def start(*flags: str, drafter: str = "", **kwargs) -> Up:
        up = Up((paths[0], drafter or paths[1]), tmp_path / f"stack-{len(started)}", *flags, **kwargs)
        started.append(up)
        up.wait_for("serving")
        return up

    yield start
    for up in started:
        up.close()


def model_name(up: Up) -> str:
    with urllib.request.urlopen(f"{up.http}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def complete(up: Up, model: str, prompt: str, started: threading.Event | None = None) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    on_text = None if started is None else (lambda text: started.set())
    return stream_completion(up.http, "/v1/completions", body, timeout=120, on_text=on_text).text


def through(up: Up, model: str, prompts: list[str], fault) -> list[str]:
    """Stream every prompt at once, call ``fault()`` once each has streamed some text, and return
    the texts; asserts that the fault came while at least one stream was still open."""
    started = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, up, model, p, e) for p, e in zip(prompts, started)]
        for event, future in zip(started, futures):
            if not event.wait(120):
                future.result()  # raises what went wrong
        open_streams = sum(not f.done() for f in futures)
        fault()
        texts = [f.result() for f in futures]
    assert open_streams, "every request had finished before the fault: make them longer (MAX_TOKENS)"
    return texts


def restart(up: Up, name: str, signum: int = signal.SIGKILL) -> tuple[float, str]:
    """Signal ``name`` and wait until the supervisor has it back and its health says SERVING;
    returns how long after the signal the supervisor saw it exit, and the line saying how."""
    mark = len(up.lines)
    old = up.pids()[name]
    sent = time.monotonic()
    os.kill(old, signum)
    exited = up.wait_for(f"{name} exited with", after=mark)
    up.wait_for(f"{name} is back", after=mark)
    assert up.pids()[name] != old
    if name == "redis":
        redis.Redis.from_url(_redis_url(up)).ping()  # back on its port
    else:
        wait_healthy(up.address(name), ServiceConfig(), timeout=60)
    line = next(line for _, line in up.lines[mark:] if f"{name} exited with" in line)
    return exited - sent, line


def _redis_url(up: Up) -> str:
    line = next(line for _, line in up.lines if line.strip().startswith("redis "))
    return line.split()[-1]


def assert_stopped(up: Up, code: int, seconds: float) -> None:
    assert code == 0, up.output()
    assert seconds < GRACE, f"`specd up` took {seconds:.1f}s to stop (grace {GRACE:.0f}s):\n{up.output()}"
    assert not [pid for pid in up.seen if _alive(pid)], f"services outlived `specd up`:\n{up.output()}"


# ---------------------------------------------------------------------------- faults
def test_up_restarts_each_service_that_dies_while_requests_stream(start_up, prompts):
    """kill -9 of each drafter, then of the trainer, with completions streaming: none fails, each
    equals its output before any fault, and the killed service comes back healthy. A SIGTERMed
    trainer exits 0 within its drain and comes back too; so do the verifier and Redis (on the
    same port). SIGTERM of `specd up` with streams open: they finish, and so does everything."""
    up = start_up(drafters=2, trainer=True)
    model = model_name(up)
    with ThreadPoolExecutor(len(prompts)) as pool:
        want = list(pool.map(lambda p: complete(up, model, p), prompts))
    assert len(up.pids()) == 5  # redis, two drafters, the verifier, the trainer

    for name in ("drafter-0", "drafter-1", "trainer"):
        assert through(up, model, prompts, lambda: restart(up, name)) == want, name

    # A drain nobody asked for is an exit like any other: restarted; the trainer stops in time.
    seconds, line = restart(up, "trainer", signal.SIGTERM)
    assert "exited with 0" in line and seconds < DRAIN, line

    # The verifier: its own requests die with it (nothing to fail over to), later ones are exact.
    restart(up, "verifier-0")
    assert [complete(up, model, p) for p in prompts] == want
    restart(up, "redis")
    assert [complete(up, model, p) for p in prompts] == want

    codes = []
    assert through(up, model, prompts, lambda: codes.append(up.stop())) == want  # drained, not cut
    assert_stopped(up, *codes[0])


def test_a_crash_loop_is_reported_each_time_and_backs_off_to_the_cap(start_up, paths, prompts, tmp_path):
    """A drafter whose model directory went away dies right after every start: each exit is
    reported with its log's tail, the backoff doubles up to its cap, the verifier serves (plain)
    meanwhile, and once the directory is back the next restart sticks."""
    drafter = tmp_path / "drafter"
    shutil.copytree(paths[1], drafter)
    up = start_up("--restart-delay", "0.5", "--max-restart-delay", "1", drafter=str(drafter))
    model = model_name(up)
    want = complete(up, model, prompts[0])
    shutil.rmtree(drafter)
    os.kill(up.pids()["drafter-0"], signal.SIGKILL)
    up.wait_for("drafter-0 exited with 1", count=2)  # after the kill -9, two starts that failed
    assert complete(up, model, prompts[0]) == want  # no drafter: decoded plain, the same text
    reports = [i for i, (_, line) in enumerate(up.lines) if "drafter-0 exited" in line]
    delays = [float(re.search(r"restart \d+ in ([\d.]+)s", up.lines[i][1]).group(1)) for i in reports]
    assert delays[:3] == [0.5, 1.0, 1.0], up.output()
    for i in reports[1:3]:  # each crash comes with the log lines that say why
        tail = "\n".join(line for _, line in up.lines[i:i + 20])
        assert "cannot serve --model" in tail and str(drafter) in tail, tail
    shutil.copytree(paths[1], tmp_path / "incoming")
    os.rename(tmp_path / "incoming", drafter)  # at once: a restart never sees half a checkpoint
    up.wait_for("drafter-0 is back", after=reports[-1])
    wait_healthy(up.address("drafter-0"), ServiceConfig(), timeout=60)
    assert complete(up, model, prompts[0]) == want
    assert_stopped(up, *up.stop())


# ---------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("state", ["idle", "backoff", "restarting"])
def test_sigterm_stops_up_within_the_grace(start_up, state):
    """SIGTERM of `specd up`: exit 0 within the grace with every service gone, whether it is idle,
    waiting out a restart backoff (a minute here) or starting a service again."""
    delay = {"idle": "1", "backoff": "60", "restarting": "0"}[state]
    up = start_up("--restart-delay", delay, "--max-restart-delay", "60")
    if state != "idle":
        mark = len(up.lines)
        old = up.pids()["drafter-0"]
        os.kill(old, signal.SIGKILL)
        up.wait_for("drafter-0 exited with -9", after=mark)
        if state == "restarting":
            deadline = time.monotonic() + 30
            while up.pids().get("drafter-0", old) == old:  # the new process, not healthy yet
                assert time.monotonic() < deadline, up.output()
                time.sleep(0.01)
    assert_stopped(up, *up.stop())
    assert "drafter-0 is back" not in up.output()


@pytest.mark.parametrize("stream", [False, True], ids=["just-serving", "speculate-stream-open"])
def test_sigterm_drains_a_drafter_within_drain_seconds(paths, tmp_path, stream):
    """A drafter told to stop exits 0 within its drain_seconds: right after it reports SERVING
    (before its drain handlers were in place it died of the signal), and with a verifier's
    Speculate stream open (which used to hold it for the whole drain, then got cut)."""
    port = free_port()
    with (tmp_path / "drafter.log").open("w") as log:
        drafter = subprocess.Popen([sys.executable, "-m", "services.drafter", "--model", paths[1], "--port", str(port),
                                    "--drain-seconds", str(DRAIN)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    channel = open_channel(f"127.0.0.1:{port}", ServiceConfig())
    requests: queue.SimpleQueue = queue.SimpleQueue()
    try:
        wait_healthy(f"127.0.0.1:{port}", ServiceConfig(), timeout=120)
        if stream:
            requests.put(drafter_pb2.SpeculateRequest(step=1))
            call = drafter_pb2_grpc.DrafterStub(channel).Speculate(iter(requests.get, None))
            assert next(call).step == 1  # the stream is open and served; it now waits for step 2
        start = time.monotonic()
        drafter.send_signal(signal.SIGTERM)
        code = drafter.wait(DRAIN + 30)
        seconds = time.monotonic() - start
    finally:
        requests.put(None)
        channel.close()
        if drafter.poll() is None:
            drafter.kill()
            drafter.wait()
    log_text = (tmp_path / "drafter.log").read_text()
    assert code == 0, log_text
    assert seconds < DRAIN, f"the drafter took {seconds:.1f}s to stop (drain_seconds {DRAIN}):\n{log_text}"


# ---------------------------------------------------------------------------- the trainer's records
def test_a_trainer_killed_between_checkpoint_and_ack_in_the_stack_trains_each_trace_into_one_checkpoint(
        paths, prompts, tmp_path):
    """The real stack (Stack, supervised) with the failpoint turned on through StackConfig.env:
    traffic makes traces, the trainer checkpoints and waits in ``trainer.after_checkpoint``, it is
    killed there (kill -9), the supervisor restarts it under the same consumer name, more traffic
    comes; once every trace is acknowledged, each one is in exactly one entry of the ledger."""
    log = tmp_path / "failpoints.jsonl"
    config = StackConfig(
        target=paths[0], drafter=paths[1], drafters=1, verifiers=1, trainer=True, restart=True, restart_delay=0.2,
        **stack_ports(), workdir=str(tmp_path / "stack"), drain_seconds=DRAIN,
        env={FAILPOINTS: "trainer.after_checkpoint=sleep(3)", FAILPOINT_LOG: str(log)},
        # A checkpoint per trace, none held out (the gate never runs): every trace is acknowledged soon.
        trainer_args=["--batch-size", "1", "--steps-per-version", "1", "--heldout-every", str(10**9),
                      "--anchors-per-seq", "2", "--branches-per-anchor", "2", "--block-ms", "100"])
    body = {"model": Path(paths[0]).name, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def traffic(stack: Stack, count: int) -> None:
        for n in range(count):
            stream_completion(stack.verifiers[0].http, "/v1/completions", {**body, "prompt": prompts[n % len(prompts)]},
                              timeout=120)

    def hits() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    with Stack(config) as stack:
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        trainer = stack.service("trainer")
        traffic(stack, 3)
        deadline = time.monotonic() + 180
        while not hits():  # poll: the trainer is inside the window once its hit is written
            assert time.monotonic() < deadline, f"the trainer reached no checkpoint:{_tail(trainer)}"
            time.sleep(0.05)
        assert hits()[0]["pid"] == trainer.process.pid  # the env reached the trainer's process
        stack.kill("trainer")
        assert client.xpending("specd:traces", "specd-trainer")["pending"] >= 1  # saved, never acknowledged
        assert read_ledger(tmp_path / "stack" / "trainer")[0].checkpoint == 1
        traffic(stack, 2)  # while it restarts: the verifier writes traces all the same

        def settled() -> bool:  # every trace written, delivered and acknowledged
            last = client.xrevrange("specd:traces", count=1)
            group = client.xinfo_groups("specd:traces")[0]
            return (client.xlen("specd:traces") == 5 and group["pending"] == 0
                    and bool(last) and group["last-delivered-id"] == last[0][0])

        deadline = time.monotonic() + 240
        while not settled():
            assert time.monotonic() < deadline, f"the restarted trainer did not acknowledge every trace:{_tail(trainer)}"
            time.sleep(0.1)
        assert trainer.restarts == 1
        acknowledged = [fields["trace_id"] for _, fields in client.xrange("specd:traces")]
        client.close()
    ledger = read_ledger(tmp_path / "stack" / "trainer")
    taken = [i for entry in ledger for i in entry.trained + entry.heldout]
    print(f"{len(ledger)} checkpoints, {len(taken)} traces in the ledger, {len(hits())} failpoint hits")
    assert len(taken) == len(set(taken)), f"a trace is in two checkpoints: {ledger}"
    assert sorted(taken) == sorted(acknowledged)
    assert [entry.checkpoint for entry in ledger] == list(range(1, len(ledger) + 1))


def _tail(service) -> str:
    return "\n" + service.log.read_text()[-3000:]
