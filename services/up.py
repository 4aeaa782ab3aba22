"""`specd up`: the whole system on one machine, one process per service, as a cluster would run it.

`Stack` starts Redis (its own ``redis-server`` on a free port unless a URL is given), the trainer,
N drafter replicas and M verifiers, each as its own process with the zoo's models (or given
directories), waits until every one is healthy, and stops them all cleanly: SIGTERM in the order
traffic flows (verifiers drain first, then drafters, trainer, Redis; a tier at a time), SIGKILL
only for a process that outlives its drain. Integration tests and `specd bench serve` use the same
class.

**Supervision** (``StackConfig.restart``; `specd up` turns it on). One thread per service watches
its process. When one exits while the stack is not stopping (a crash, the OOM killer, ``kill -9``,
even a clean exit nobody asked for), it is reported with its exit code and the tail of its log,
and started again with the same command line after a backoff: ``restart_delay``, doubled for each
further exit within `STABLE_SECONDS` of a start, capped at ``max_restart_delay``. A service that
keeps dying right after it starts is reported (with its log) each time, never given up on. The
same ports mean nothing has to be told: a verifier's drafter pool fails over to the live replicas
meanwhile (or decodes plain; the output is the same either way) and takes the restarted one back
once its Info answers; Redis comes back on its port, empty (nothing is persisted) unless
``redis_appendonly`` keeps an append-only file fsynced on every write, from which it comes back
with every write it acknowledged. The trainer has a fixed consumer name (``trainer``), so a
restarted one reads its own unacknowledged backlog at once instead of waiting to reclaim it. Only `stop`
(Ctrl-C, SIGTERM) ends the stack. A service that does not start the first time fails `start`
instead: that is a configuration to fix, not a crash to ride out. Off by default: a benchmark
wants a dead service to stay dead rather than skew what it measures.

Default ports, each overridable: verifier HTTP 8000 (+i for verifier i), verifier gRPC 50051
(further verifiers 50071, 50072, ...), drafters from 50052, trainer 50060; plain-decoding
verifiers for comparisons (``plain_verifiers``) on HTTP 8100+i and gRPC 50081+i. ``pin`` gives each
service process its own CPU core where the machine has enough (verifiers first).

**Faults on purpose**: `Stack.kill` and `Stack.signal` (SIGKILL, SIGSTOP/SIGCONT, ...) reach a
service's current process; ``StackConfig.env`` reaches every service's environment (how a fault
test turns on `services.common.failpoints`); ``redis_appendonly`` also lets a client on loopback
send ``DEBUG SLEEP`` (a slow Redis).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.common.config import ServiceConfig
from services.common.server import open_channel, wait_healthy
from specd.engine import EngineConfig, tau
from specd.flags import default_of
from specd.ports import free_port

STABLE_SECONDS = 60.0
"""A service that ran this long before it exited was not crash-looping: its backoff starts over."""
STOP_MARGIN_SECONDS = 10.0
"""What `Stack.stop` allows each tier beyond ``drain_seconds`` before SIGKILL: the service's own
``on_drain`` (the trainer's last step and checkpoint) and the interpreter's exit."""
_STOP_ORDER = {"verifier": 0, "plain": 0, "drafter": 1, "trainer": 2, "redis": 3}
"""The tiers `Stack.stop` signals one after the other: drafters serve while verifiers drain."""


def stack_ports(replicas: int = 8) -> dict[str, int]:
    """`StackConfig`'s four base ports, each free together with every offset from it that a stack
    of up to ``replicas`` services of each role uses (the defaults' layout in the module docstring)."""
    return {"verifier_grpc_port": free_port(span=30 + replicas), "verifier_http_port": free_port(span=100 + replicas),
            "drafter_port": free_port(span=replicas), "trainer_port": free_port()}


@dataclass(kw_only=True)
class StackConfig:
    target: str
    """Target model directory."""
    drafter: str = ""
    """D3D drafter directory ("" = no drafters, plain decoding)."""
    drafters: int = 1
    verifiers: int = 1
    plain_verifiers: int = 0
    """Extra verifiers with no drafters (plain decoding), for side-by-side comparisons."""
    prompt_lookup: bool = False
    """The (speculative) verifiers also draft by prompt lookup (``--prompt-lookup``): beside the
    drafters, or alone where there are none. The plain verifiers never do."""
    trainer: bool = True
    redis_url: str = ""
    """Use this Redis instead of starting one."""
    verifier_http_port: int = 8000
    verifier_grpc_port: int = 50051
    drafter_port: int = 50052
    trainer_port: int = 50060
    host: str = "127.0.0.1"
    auth_token: str = ""
    block_size: int = default_of(EngineConfig, "block_size")
    mode: str = default_of(EngineConfig, "mode")
    max_num_seqs: int = 16
    pin: bool = False
    """Pin each process to its own core (when there are enough cores)."""
    drain_seconds: float = 10.0
    """How long each service may finish its in-flight calls after SIGTERM (its ``--drain-seconds``);
    `Stack.stop` waits that plus `STOP_MARGIN_SECONDS` per tier before SIGKILL."""
    restart: bool = False
    """Supervise: restart any service that exits until `Stack.stop` (module docstring)."""
    restart_delay: float = 1.0
    """Seconds before restarting a service that exited; doubled for each further exit within
    `STABLE_SECONDS` of its last start."""
    max_restart_delay: float = 30.0
    """The longest backoff between two restarts of one service."""
    verifier_args: list[str] = field(default_factory=list)
    drafter_args: list[str] = field(default_factory=list)
    trainer_args: list[str] = field(default_factory=list)
    workdir: str = ""
    """Where logs and trainer checkpoints go ("" = a fresh temporary directory)."""
    redis_appendonly: bool = False
    """The stack's own redis-server keeps an append-only file under ``<workdir>/redis``, fsynced on
    every write, so a ``kill -9`` and its supervised restart lose no acknowledged write; it also
    accepts ``DEBUG`` commands from loopback (``DEBUG SLEEP``: a slow Redis, for fault tests)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every service process (Redis included), over the stack's own
    (e.g. ``SPECD_FAILPOINTS`` and ``SPECD_FAILPOINT_LOG`` for `services.common.failpoints`)."""

    def __post_init__(self) -> None:
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if not 0 <= self.restart_delay <= self.max_restart_delay:
            raise ValueError(f"need 0 <= restart_delay <= max_restart_delay, got {self.restart_delay} and "
                             f"{self.max_restart_delay}")


@dataclass(kw_only=True)
class Service:
    name: str
    process: subprocess.Popen
    """The running process (a new one after each restart)."""
    command: list[str] = field(default_factory=list)
    """What (re)starts it."""
    env: dict[str, str] | None = None
    grpc: str = ""
    http: str = ""
    log: Path | None = None
    core: int | None = None
    """The CPU core it is pinned to (None: not pinned)."""
    started_at: float = 0.0
    """time.monotonic() of the process's start."""
    restarts: int = 0
    """Times the supervisor has started it again."""


class StackError(RuntimeError):
    """A service did not start; the message names it and ends with its log's tail."""


class Stack:
    """The processes of one specd deployment on localhost (module docstring)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.services: list[Service] = []
        self.redis_url = config.redis_url
        self.workdir = Path(config.workdir or tempfile.mkdtemp(prefix="specd-up-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._next_core = 0
        self._shared_from = 0  # cores before this index are dedicated to verifiers
        self._client = ServiceConfig(auth_token=config.auth_token)
        self._start_timeout = 180.0
        self._redis_port = 0  # the one we started (its restarts come back on it)
        # Held while a process is launched, and by `stop` when it sets _stopping: once that is
        # set no supervisor starts anything, so `stop` sees every process there will be.
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisors: list[threading.Thread] = []

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 180.0) -> "Stack":
        """Start every service and wait until each is healthy (``timeout`` seconds in all, and for
        each restart); then supervise them if ``config.restart``. StackError when one does not start."""
        self._start_timeout = timeout
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        if self.config.restart:
            for service in self.services:
                thread = threading.Thread(target=self._supervise, args=(service,), name=f"supervise-{service.name}",
                                          daemon=True)
                thread.start()
                self._supervisors.append(thread)
        return self

    def _start(self, timeout: float) -> None:
        c = self.config
        if not self.redis_url:
            self._start_redis()
        drain = ["--drain-seconds", str(c.drain_seconds)]
        verifier_ports = [(c.verifier_grpc_port if i == 0 else c.verifier_grpc_port + 19 + i,
                           c.verifier_http_port + i) for i in range(c.verifiers)]
        drafter_addresses = []
        # Verifiers are pinned first: the target pass is the critical path.
        cores = {("verifier", i): self._core() for i in range(c.verifiers)}
        # Drafters (and the rest) share the cores the verifiers left, or all of them if none is left.
        self._shared_from = self._next_core if self._next_core < len(self._cores) else 0
        if c.drafter:
            for i in range(c.drafters):
                port = c.drafter_port + i
                address = f"{c.host}:{port}"
                args = ["--model", c.drafter, "--port", str(port), "--host", c.host, *drain, *c.drafter_args]
                if c.trainer:
                    args += ["--trainer", f"{c.host}:{c.trainer_port}", "--redis-url", self.redis_url]
                self._spawn(f"drafter-{i}", "services.drafter", args, grpc=address)
                drafter_addresses.append(address)
        for i, (grpc_port, http_port) in enumerate(verifier_ports):
            args = ["--model", c.target, "--port", str(grpc_port), "--host", c.host,
                    "--http-port", str(http_port), "--http-host", c.host, "--redis-url", self.redis_url,
                    "--drafters", ",".join(drafter_addresses), "--block-size", str(c.block_size),
                    "--mode", c.mode, "--max-num-seqs", str(c.max_num_seqs), *drain,
                    *(["--prompt-lookup"] if c.prompt_lookup else []), *c.verifier_args]
            self._spawn(f"verifier-{i}", "services.verifier", args, grpc=f"{c.host}:{grpc_port}",
                        http=f"http://{c.host}:{http_port}", core=cores[("verifier", i)])
        for i in range(c.plain_verifiers):
            grpc_port, http_port = c.verifier_grpc_port + 30 + i, c.verifier_http_port + 100 + i
            args = ["--model", c.target, "--port", str(grpc_port), "--host", c.host, "--http-port", str(http_port),
                    "--http-host", c.host, "--max-num-seqs", str(c.max_num_seqs), *drain, *c.verifier_args]
            self._spawn(f"plain-{i}", "services.verifier", args, grpc=f"{c.host}:{grpc_port}",
                        http=f"http://{c.host}:{http_port}")
        if c.trainer and c.drafter:
            args = ["--port", str(c.trainer_port), "--host", c.host, "--redis-url", self.redis_url,
                    "--drafter", c.drafter, "--verifiers", ",".join(s.grpc for s in self.verifiers),
                    "--checkpoint-dir", str(self.workdir / "trainer"), "--block-size", str(c.block_size),
                    "--consumer", "trainer",  # the same name after a restart: it reads its own backlog at once
                    "--stop-token-ids", ",".join(map(str, _stop_token_ids(c.target))), *drain, *c.trainer_args]
            self._spawn("trainer", "services.trainer", args, grpc=f"{c.host}:{c.trainer_port}")
        deadline = time.monotonic() + timeout
        for service in self.services:
            self._wait(service, deadline)

    def _core(self) -> int | None:
        """The next core to pin to: verifiers take one each first; the others cycle over the rest."""
        if not self.config.pin or not self._cores:
            return None
        pool = self._cores[self._shared_from:]
        core = pool[(self._next_core - self._shared_from) % len(pool)]
        self._next_core += 1
        return core

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server is not installed: run `make setup` (it installs it) or pass --redis-url")
        port = free_port()
        # A restart reuses this command line, so Redis comes back on the port everyone was given.
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        if self.config.redis_appendonly:
            (self.workdir / "redis").mkdir(exist_ok=True)
            command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir / "redis"),
                        "--enable-debug-command", "local"]
        else:
            command += ["--appendonly", "no"]
        self._add("redis", command, env={**os.environ, **self.config.env} if self.config.env else None)
        self._redis_port = port
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self._wait(self.services[-1], time.monotonic() + 10)

    def computing_processes(self) -> int:
        """Processes of this stack that run model passes (Redis does not)."""
        c = self.config
        drafters = c.drafters if c.drafter else 0
        return c.verifiers + c.plain_verifiers + drafters + (1 if c.trainer and c.drafter else 0)

    def service_env(self) -> dict[str, str]:
        """Every service's environment: this process's, the stack's own settings, then
        ``config.env``. Where several processes compute on one machine they take turns on its
        cores, so OpenMP's workers stop spinning soon after a pass (`specd.threads.shared_machine_env`)."""
        # Imported here, not at the top: imported with this module (as `specd bench serve`'s tests
        # collect it), the in-process drafter replicas of tests/unit/test_drafter_pool_faults.py
        # later answered their first Speculate past its 0.25 s grace, every run; why is not known.
        from specd.threads import shared_machine_env

        shared = shared_machine_env(os.environ) if self.computing_processes() > 1 else {}
        return {**os.environ, "OMP_NUM_THREADS": "1", "SPECD_AUTH_TOKEN": self.config.auth_token,
                "PYTHONUNBUFFERED": "1", **shared, **self.config.env}

    def _spawn(self, name: str, module: str, args: list[str], *, grpc: str = "", http: str = "",
               core: int | None = None) -> Service:
        env = self.service_env()
        return self._add(name, [sys.executable, "-m", module, *args], env=env, grpc=grpc, http=http,
                         core=self._core() if core is None else core)

    def _add(self, name: str, command: list[str], *, env: dict[str, str] | None = None, grpc: str = "",
             http: str = "", core: int | None = None) -> Service:
        log = self.workdir / f"{name}.log"
        log.write_text("")
        service = Service(name=name, process=self._popen(command, env, log, core), command=command, env=env,
                          grpc=grpc, http=http, log=log, core=core, started_at=time.monotonic())
        self.services.append(service)
        return service

    @staticmethod
    def _popen(command: list[str], env: dict[str, str] | None, log: Path, core: int | None) -> subprocess.Popen:
        # Its own process group: Ctrl-C in the terminal reaches `specd up` alone, which then stops
        # the services in traffic order instead of all of them draining at once.
        with log.open("a") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0)
        if core is not None:
            os.sched_setaffinity(process.pid, {core})
        return process

    def _wait(self, service: Service, deadline: float) -> None:
        """Until ``service`` is healthy: its gRPC health says SERVING and its HTTP /health answers
        200 (Redis: it accepts connections). StackError when it exits, the deadline passes or the
        stack is stopping."""
        grpc_ready = not service.grpc
        while True:
            if service.process.poll() is not None:
                raise StackError(f"{service.name} exited with {_exit_status(service.process.returncode)}: "
                                 f"{_tail(service.log)}")
            if self._stopping.is_set():
                raise StackError(f"{service.name}: the stack is stopping")
            if not grpc_ready:
                try:  # returns as soon as health says SERVING
                    wait_healthy(service.grpc, self._client, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                    grpc_ready = True
                except TimeoutError:
                    pass
            elif (service.name == "redis" and not _redis_ready(self._redis_port)) or (
                    service.http and not _http_healthy(service.http)):
                time.sleep(0.05)
            else:
                return
            if time.monotonic() > deadline:
                what = "'s HTTP API" if grpc_ready and service.http else ""
                raise StackError(f"{service.name}{what} was not healthy in time: {_tail(service.log)}")

    # ------------------------------------------------------------------ supervise
    def _supervise(self, service: Service) -> None:
        """Restart ``service`` each time its process exits, with backoff, until `stop` (module docstring)."""
        crashes = 0  # exits in a row, each within STABLE_SECONDS of a start
        while True:
            while service.process.poll() is None:
                if self._stopping.wait(0.2):
                    return
            if self._stopping.is_set():
                return
            lived = time.monotonic() - service.started_at
            crashes = crashes + 1 if lived < STABLE_SECONDS else 1
            delay = min(self.config.restart_delay * 2 ** min(crashes - 1, 20), self.config.max_restart_delay)
            again = f" ({crashes} exits in a row, each within {STABLE_SECONDS:.0f}s of a start)" if crashes > 1 else ""
            _report(f"{service.name} exited with {_exit_status(service.process.returncode)} after {lived:.1f}s; "
                    f"restart {service.restarts + 1} in {delay:.1f}s{again}. The end of its log:{_tail(service.log)}")
            if self._stopping.wait(delay) or not self._relaunch(service):
                return
            try:
                self._wait(service, time.monotonic() + self._start_timeout)
            except StackError as err:
                if service.process.poll() is None and not self._stopping.is_set():
                    _report(f"{err}; killing it to start it again")
                    service.process.kill()
                continue  # an exit is reported (with the log) at the top
            _report(f"{service.name} is back: pid {service.process.pid}, healthy "
                    f"{time.monotonic() - service.started_at:.1f}s after restart {service.restarts}")

    def _relaunch(self, service: Service) -> bool:
        """Start ``service``'s command again (False, starting nothing, once the stack is stopping)."""
        with self._lock:
            if self._stopping.is_set():
                return False
            with service.log.open("a") as out:
                out.write(f"\n----- specd up: restart {service.restarts + 1} of {service.name} -----\n")
            service.process = self._popen(service.command, service.env, service.log, service.core)
            service.started_at = time.monotonic()
            service.restarts += 1
        return True

    # ------------------------------------------------------------------ use
    def _named(self, prefix: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(prefix)]

    @property
    def verifiers(self) -> list[Service]:
        return self._named("verifier-")

    @property
    def drafters(self) -> list[Service]:
        return self._named("drafter-")

    @property
    def plain(self) -> list[Service]:
        return self._named("plain-")

    @property
    def trainer(self) -> Service | None:
        found = self._named("trainer")
        return found[0] if found else None

    def endpoints(self) -> list[tuple[str, str]]:
        rows = []
        for s in self.services:
            if s.name == "redis":
                rows.append((s.name, self.redis_url))
            else:
                rows.append((s.name, "  ".join(x for x in (f"grpc {s.grpc}" if s.grpc else "",
                                                           f"http {s.http}/v1" if s.http else "") if x)))
        return rows

    def wait_drafting(self, timeout: float = 60.0) -> None:
        """Send tiny requests until every verifier has drafted: a verifier that came up before its
        drafters decodes plain until its pool has checked them (a few seconds)."""
        from services.client import metrics
        from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

        if not self.drafters:
            return
        deadline = time.monotonic() + timeout
        for verifier in self.verifiers:
            channel = open_channel(verifier.grpc, self._client)
            stub = verifier_pb2_grpc.VerifierStub(channel)
            request = verifier_pb2.GenerateRequest(prompt_token_ids=[1, 1, 1], store=False,  # not traffic: no trace
                                                   params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            try:
                while metrics(verifier.http).get("specd:spec_decode_num_draft_tokens_total", 0) == 0:
                    if time.monotonic() > deadline:
                        raise StackError(f"{verifier.name} never drafted: see the drafters' logs {_tail(verifier.log)}")
                    for _ in stub.Generate(request, timeout=30):
                        pass
                    time.sleep(0.2)
            finally:
                channel.close()

    def service(self, name: str) -> Service:
        """The service called ``name`` ("redis", "trainer", "drafter-0", "verifier-0", ...)."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service {name!r} in this stack; it has {[s.name for s in self.services]}")

    def kill(self, name: str) -> None:
        """For fault tests: SIGKILL one service and reap it (supervised, it is restarted)."""
        service = self.service(name)
        service.process.kill()
        service.process.wait()

    def signal(self, name: str, signum: int) -> None:
        """For fault tests: send ``signum`` (SIGSTOP, SIGCONT, SIGKILL, ...) to ``name``'s current
        process without waiting for it. ProcessLookupError when that process has already exited
        (between a crash and its restart there is none to signal)."""
        process = self.service(name).process
        if process.poll() is not None:
            raise ProcessLookupError(f"{name} (pid {process.pid}) has exited with "
                                     f"{_exit_status(process.returncode)}; nothing to signal until it is restarted")
        process.send_signal(signum)

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float | None = None) -> None:
        """End supervision, then SIGTERM a tier at a time in traffic order (verifiers, drafters,
        trainer, Redis) and SIGKILL what outlives ``timeout`` seconds per tier (default
        ``drain_seconds`` + `STOP_MARGIN_SECONDS`). A service in its restart backoff stays down;
        one still starting gets the SIGTERM like the rest."""
        with self._lock:  # after this, no supervisor launches anything
            self._stopping.set()
        timeout = self.config.drain_seconds + STOP_MARGIN_SECONDS if timeout is None else timeout
        for tier in sorted(set(_STOP_ORDER.values())):
            running = [s.process for s in self.services
                       if _STOP_ORDER[s.name.split("-")[0]] == tier and s.process.poll() is None]
            for process in running:
                process.send_signal(signal.SIGTERM)
                process.send_signal(signal.SIGCONT)  # one a fault test stopped (SIGSTOP) drains too
            deadline = time.monotonic() + timeout
            for process in running:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for thread in self._supervisors:  # each notices _stopping within one health poll
            thread.join(timeout=5.0)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_token_ids(model_directory: str) -> list[int]:
    """The target's end-of-sequence ids (config.json ``eos_token_id``: one id or a list)."""
    from specd.models.loading import read_config

    eos = read_config(Path(model_directory)).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.exists():
        return "(no log)"
    text = log.read_text(errors="replace").strip().splitlines()
    return "\n" + "\n".join(text[-lines:]) + f"\n(full log: {log})"


def _exit_status(code: int) -> str:
    """A Popen returncode as a person reads it: -9 is "-9 (SIGKILL)"."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def _http_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _redis_ready(port: int) -> bool:
    """Whether Redis on loopback ``port`` answers PING (not LOADING: its append-only file is read)."""
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _report(message: str) -> None:
    print(f"specd up: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the command
DEFAULT_TARGET = "smollm2-135m"
"""What `specd up` serves by default: the zoo's real pretrained model."""
DEMO_PROMPT = ("A shop sells pens for 3 dollars each. Ana buys 7 pens and pays with a 50 dollar note. "
               "How much change does she get?")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops `specd up`: Ctrl-C, a process manager's SIGTERM, the terminal going away."""


def add_arguments(parser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"target model: a directory or a zoo name (default: {DEFAULT_TARGET}; qwen3-tiny for the tiny zoo)")
    parser.add_argument("--drafter", default="",
                        help="D3D drafter: a directory or a zoo name (default: the zoo's d3d-TARGET where the zoo has one, "
                             "else none: plain decoding)")
    parser.add_argument("--drafters", type=int, default=1, help="drafter replicas")
    parser.add_argument("--verifiers", type=int, default=1, help="verifier replicas")
    parser.add_argument("--no-trainer", action="store_true", help="no online distillation")
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    parser.add_argument("--http-port", type=int, default=8000, help="first verifier's HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50051, help="first verifier's gRPC port")
    parser.add_argument("--drafter-port", type=int, default=50052, help="first drafter's port")
    parser.add_argument("--trainer-port", type=int, default=50060)
    parser.add_argument("--block-size", type=int, default=StackConfig.block_size,
                        help="most drafted tokens verified per sequence per pass")
    parser.add_argument("--mode", choices=["async", "sync"], default=StackConfig.mode)
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="the verifiers also draft by prompt lookup (alone where there is no drafter)")
    parser.add_argument("--auth-token", default="", help="bearer token every service requires")
    parser.add_argument("--pin", action="store_true",
                        help="async: pin each service to a core of its own where possible, instead of sharing the "
                             "machine (sync and plain services take turns and always get every core)")
    parser.add_argument("--workdir", default="", help="logs and trainer checkpoints (default: a temporary directory)")
    parser.add_argument("--drain-seconds", type=float, default=10.0,
                        help="how long each service finishes in-flight calls when the stack stops")
    parser.add_argument("--restart-delay", type=float, default=1.0,
                        help="seconds before restarting a service that died; doubled for each crash right after a start")
    parser.add_argument("--max-restart-delay", type=float, default=30.0, help="the longest restart backoff")
    parser.add_argument("--demo", action="store_true",
                        help="stream one chat completion through the HTTP API, compare with plain decoding, stop")


def _interrupt(signum, frame) -> None:
    _ignore_stop_signals()  # a second signal must not cut the drain short
    raise KeyboardInterrupt


def _ignore_stop_signals() -> None:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def machine_cores() -> int:
    """The cores this process may run on (its affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_split(mode: str, drafters: int, cores: int, *, pin: bool = False) -> tuple[list[str], list[str], bool]:
    """How one verifier and ``drafters`` drafter replicas share a machine of ``cores`` cores: the
    verifier's extra flags, each drafter's, and whether to pin each process to a core of its own.

    Processes that never compute at once (plain decoding, lookup alone, sync mode: the verifier
    waits for its drafter) each get the whole machine: unpinned, a thread per core, as a user
    without speculation would run plain decoding. In async mode a drafter drafts the next block
    beside verification, so the cores are shared only then: the verifier has them all for a
    step without a candidate pass and ``cores - drafters x drafter threads`` (at least 1) for a
    step with one (``--async-target-threads``; its cost model measures which way a step pays,
    `CostModel.should_overlap`), and each drafter an equal share for the candidate pass beside it
    (``--speculate-threads``; a Draft the verifier waits for has every core). With ``pin``,
    async processes are pinned apart instead, a core each (the planner's single-threaded
    profile assumes that split)."""
    if mode == "sync" or drafters == 0:
        return ["--threads", str(cores)], ["--threads", str(cores)], False
    if pin:
        return [], [], True
    drafter_threads = max(1, cores // (drafters + 1))
    beside = max(1, cores - drafters * drafter_threads)
    return (["--threads", str(cores), "--async-target-threads", str(beside)],
            # A blocking Draft (a miss, or a step drafted after verification) has the machine to itself.
            ["--threads", str(cores), "--speculate-threads", str(drafter_threads)], False)


def zoo_model(name: str) -> str:
    """A directory as it is, or a zoo model's directory (it must be built)."""
    from specd import zoo

    if Path(name).exists() or name not in {m.name for m in zoo.MODELS}:
        return name
    if not zoo.is_built(name):
        raise StackError(f"zoo model {name!r} is not built: run `specd zoo build` (or pass a directory)")
    return str(zoo.model_path(name))


def _default_drafter(target: str) -> str:
    """The zoo's D3D drafter for a zoo target where it is built; "" (plain decoding) otherwise,
    with a hint where the zoo can build one (SmolLM2's is on demand: it takes minutes to train)."""
    from specd import zoo

    name = f"d3d-{Path(target).name}"
    if name not in {m.name for m in zoo.MODELS}:
        return ""
    if not zoo.is_built(name):
        print(f"specd up: the zoo's drafter {name} is not built, so no drafter runs; "
              f"`specd zoo build --only {name}` builds it", file=sys.stderr)
        return ""
    return str(zoo.model_path(name))


def run(args) -> int:
    """`specd up`: start the stack, supervise it (a service that dies is restarted) until Ctrl-C,
    SIGTERM or SIGHUP, then stop it; 0 after a stop, 1 when it did not start."""
    try:
        target = zoo_model(args.target or DEFAULT_TARGET)
        drafter = zoo_model(args.drafter) if args.drafter else _default_drafter(target)
    except StackError as err:
        print(f"specd up: {err}", file=sys.stderr)
        return 1
    # Each verifier (with its drafters) gets its share of the machine; --demo's plain verifier
    # computes only while the speculative one waits.
    cores = max(1, machine_cores() // max(1, args.verifiers))
    verifier_args, drafter_args, pin = machine_split(args.mode, args.drafters if drafter else 0, cores, pin=args.pin)
    config = StackConfig(
        target=target, drafter=drafter, verifier_args=verifier_args, drafter_args=drafter_args,
        drafters=args.drafters, verifiers=args.verifiers, trainer=not args.no_trainer,
        redis_url=args.redis_url, verifier_http_port=args.http_port, verifier_grpc_port=args.grpc_port,
        drafter_port=args.drafter_port, trainer_port=args.trainer_port, block_size=args.block_size,
        mode=args.mode, prompt_lookup=args.prompt_lookup, auth_token=args.auth_token, workdir=args.workdir, pin=pin,
        plain_verifiers=1 if args.demo and (drafter or args.prompt_lookup) else 0,
        drain_seconds=args.drain_seconds, restart=True,
        restart_delay=args.restart_delay, max_restart_delay=args.max_restart_delay,
    )
    stack = Stack(config)
    drafting = (f"{'trainer, ' if config.trainer else ''}{config.drafters} drafter(s), " if drafter
                else "no drafter, prompt lookup, " if config.prompt_lookup
                else "no drafter for this target (plain decoding), ")
    print(f"starting redis, {drafting}{config.verifiers} verifier(s) of {Path(target).name} ... "
          f"(logs in {stack.workdir})", flush=True)
    # From the first child on, a stop signal stops the stack (while starting, too: no orphans).
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _interrupt)
    try:
        stack.start()
        for name, endpoint in stack.endpoints():
            print(f"  {name:<12} {endpoint}")
        if args.demo:
            return _demo(stack, args.auth_token)
        print("serving (a service that dies is restarted); Ctrl-C stops everything", flush=True)
        while True:
            # The supervisor's threads do the work; a stop signal raises KeyboardInterrupt here. Not
            # signal.pause(): the kernel may deliver the signal to a busy supervisor thread, and
            # pause() in the main thread then never returns to run the handler (seen: SIGTERM
            # during a restart was never acted on). A short sleep runs it within half a second.
            time.sleep(0.5)
    except StackError as err:
        print(f"specd up: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _ignore_stop_signals()
        print("stopping ...", flush=True)
        stack.stop()


def _demo(stack: Stack, token: str) -> int:
    """Stream one chat answer through the speculative verifier, then the same request through the
    plain one; print both rates with τ and the candidate hit rate side by side. 1 when the greedy
    outputs differ (they must not: verification is lossless)."""
    from services.client import metrics, stream_completion

    body = {"model": Path(stack.config.target).name, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": DEMO_PROMPT}]}
    if not stack.plain:  # no drafter and no prompt lookup: one plain verifier, nothing to compare with
        url = stack.verifiers[0].http
        stream_completion(url, "/v1/chat/completions", {**body, "max_tokens": 4}, token=token)  # warm up
        print(f"\nuser: {DEMO_PROMPT}\nassistant ({body['model']}, plain decoding): ", end="", flush=True)
        result = stream_completion(url, "/v1/chat/completions", body, token=token,
                                   on_text=lambda text: print(text, end="", flush=True))
        rate = result.completion_tokens / result.seconds if result.seconds else 0.0
        print(f"\n\n{result.completion_tokens} tokens in {result.seconds:.2f} s ({rate:.1f} tok/s) through the "
              f"OpenAI-compatible API; `specd up --demo --prompt-lookup` shows speculative decoding")
        return 0
    config = stack.config
    how = " + ".join(["D3D"] * bool(config.drafter) + ["prompt lookup"] * config.prompt_lookup)
    how += f", {config.mode} drafting" if config.drafter else ""
    speculative, plain = stack.verifiers[0].http, stack.plain[0].http
    stream_completion(plain, "/v1/chat/completions", {**body, "max_tokens": 4}, token=token)  # warm up both
    stream_completion(speculative, "/v1/chat/completions", {**body, "max_tokens": 4}, token=token)
    before = metrics(speculative)
    print(f"\nuser: {DEMO_PROMPT}\nassistant ({body['model']}; {how}): ", end="", flush=True)
    spec = stream_completion(speculative, "/v1/chat/completions", body, token=token,
                             on_text=lambda text: print(text, end="", flush=True))
    after = metrics(speculative)
    base = stream_completion(plain, "/v1/chat/completions", body, token=token)
    print()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    measured_tau = tau(delta("specd:spec_decode_num_accepted_tokens_total"), delta("specd:num_sequence_passes_total"))
    lookups = delta("specd:spec_decode_num_candidate_lookups_total")
    hit_rate = f"{delta('specd:spec_decode_num_candidate_hits_total') / lookups:.0%}" if lookups else "-"
    rates = [r.completion_tokens / r.seconds if r.seconds else 0.0 for r in (base, spec)]
    width = max(len(how), len("plain decoding")) + 2
    print(f"\n{'':<{width}}{'tokens':>8}{'seconds':>10}{'tok/s':>9}{'tau':>7}{'hit rate':>10}")
    print(f"{'plain decoding':<{width}}{base.completion_tokens:>8}{base.seconds:>10.2f}{rates[0]:>9.1f}{1.0:>7.2f}{'-':>10}")
    print(f"{how:<{width}}{spec.completion_tokens:>8}{spec.seconds:>10.2f}{rates[1]:>9.1f}{measured_tau:>7.2f}"
          f"{hit_rate:>10}")
    same = spec.text == base.text
    speedup = rates[1] / rates[0] if rates[0] else 0.0
    print(f"\nspeedup {speedup:.2f}x over plain decoding; greedy outputs "
          f"{'identical' if same else 'DIFFERENT (a bug: greedy output must match)'}")
    return 0 if same else 1
