"""`specd up`: the whole system on one machine, one process per service, as a cluster would run it.

`Stack` starts Redis (its own ``redis-server`` on a free port unless a URL is given), the trainer,
N drafter replicas and M verifiers, each as its own process with the zoo's models (or given
directories), waits until every one is healthy, and stops them all cleanly: SIGTERM in the order
traffic flows (verifiers drain first, then drafters, trainer, Redis), SIGKILL only for a process
that outlives its drain. Integration tests and `specd bench serve` use the same class.

Default ports, each overridable: verifier HTTP 8000 (+i for verifier i), verifier gRPC 50051
(further verifiers 50071, 50072, ...), drafters from 50052, trainer 50060; plain-decoding
verifiers for comparisons (``plain_verifiers``) on HTTP 8100+i and gRPC 50081+i. ``pin`` gives each
service process its own CPU core where the machine has enough (verifiers first).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import ServiceConfig
from services.common.server import open_channel, wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    trainer: bool = True
    redis_url: str = ""
    """Use this Redis instead of starting one."""
    verifier_http_port: int = 8000
    verifier_grpc_port: int = 50051
    drafter_port: int = 50052
    trainer_port: int = 50060
    host: str = "127.0.0.1"
    auth_token: str = ""
    block_size: int = 8
    mode: str = "async"
    max_num_seqs: int = 16
    pin: bool = False
    """Pin each process to its own core (when there are enough cores)."""
    verifier_args: list[str] = field(default_factory=list)
    drafter_args: list[str] = field(default_factory=list)
    trainer_args: list[str] = field(default_factory=list)
    workdir: str = ""
    """Where logs and trainer checkpoints go ("" = a fresh temporary directory)."""


@dataclass(kw_only=True)
class Service:
    name: str
    process: subprocess.Popen
    grpc: str = ""
    http: str = ""
    log: Path | None = None
    core: int | None = None
    """The CPU core it is pinned to (None: not pinned)."""


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

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 180.0) -> "Stack":
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        c = self.config
        if not self.redis_url:
            self._start_redis()
        client = ServiceConfig(auth_token=c.auth_token)
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
                args = ["--model", c.drafter, "--port", str(port), "--host", c.host, *c.drafter_args]
                if c.trainer:
                    args += ["--trainer", f"{c.host}:{c.trainer_port}", "--redis-url", self.redis_url]
                self._spawn(f"drafter-{i}", "services.drafter", args, grpc=address)
                drafter_addresses.append(address)
        for i, (grpc_port, http_port) in enumerate(verifier_ports):
            args = ["--model", c.target, "--port", str(grpc_port), "--host", c.host,
                    "--http-port", str(http_port), "--http-host", c.host, "--redis-url", self.redis_url,
                    "--drafters", ",".join(drafter_addresses), "--block-size", str(c.block_size),
                    "--mode", c.mode, "--max-num-seqs", str(c.max_num_seqs), *c.verifier_args]
            self._spawn(f"verifier-{i}", "services.verifier", args, grpc=f"{c.host}:{grpc_port}",
                        http=f"http://{c.host}:{http_port}", core=cores[("verifier", i)])
        for i in range(c.plain_verifiers):
            grpc_port, http_port = c.verifier_grpc_port + 30 + i, c.verifier_http_port + 100 + i
            args = ["--model", c.target, "--port", str(grpc_port), "--host", c.host, "--http-port", str(http_port),
                    "--http-host", c.host, "--max-num-seqs", str(c.max_num_seqs), *c.verifier_args]
            self._spawn(f"plain-{i}", "services.verifier", args, grpc=f"{c.host}:{grpc_port}",
                        http=f"http://{c.host}:{http_port}")
        if c.trainer and c.drafter:
            args = ["--port", str(c.trainer_port), "--host", c.host, "--redis-url", self.redis_url,
                    "--drafter", c.drafter, "--verifiers", ",".join(s.grpc for s in self.verifiers),
                    "--checkpoint-dir", str(self.workdir / "trainer"), "--block-size", str(c.block_size),
                    "--stop-token-ids", ",".join(map(str, _stop_token_ids(c.target))), *c.trainer_args]
            self._spawn("trainer", "services.trainer", args, grpc=f"{c.host}:{c.trainer_port}")
        deadline = time.monotonic() + timeout
        for service in self.services:
            self._wait(service, client, deadline)

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
        log = self.workdir / "redis.log"
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        self.services.append(Service(name="redis", process=process, log=log))
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise StackError(f"redis-server did not start on port {port}: {_tail(log)}")

    def _spawn(self, name: str, module: str, args: list[str], *, grpc: str = "", http: str = "",
               core: int | None = None) -> Service:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECD_AUTH_TOKEN": self.config.auth_token,
               "PYTHONUNBUFFERED": "1"}
        if core is None:
            core = self._core()
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log.open("w"),
                                   stderr=subprocess.STDOUT, env=env)
        if core is not None:
            os.sched_setaffinity(process.pid, {core})
        service = Service(name=name, process=process, grpc=grpc, http=http, log=log, core=core)
        self.services.append(service)
        return service

    def _wait(self, service: Service, client: ServiceConfig, deadline: float) -> None:
        if not service.grpc:
            return
        while True:
            if service.process.poll() is not None:
                raise StackError(f"{service.name} exited with {service.process.returncode}: {_tail(service.log)}")
            try:
                wait_healthy(service.grpc, client, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise StackError(f"{service.name} was not healthy in time: {_tail(service.log)}") from None
        if service.http:
            while True:
                try:
                    with urllib.request.urlopen(f"{service.http}/health", timeout=2) as response:
                        if response.status == 200:
                            return
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(f"{service.name}'s HTTP API was not healthy in time: {_tail(service.log)}")
                time.sleep(0.1)

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
        client = ServiceConfig(auth_token=self.config.auth_token)
        deadline = time.monotonic() + timeout
        for verifier in self.verifiers:
            channel = open_channel(verifier.grpc, client)
            stub = verifier_pb2_grpc.VerifierStub(channel)
            request = verifier_pb2.GenerateRequest(prompt_token_ids=[1, 1, 1],
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

    def kill(self, name: str) -> None:
        """For fault tests: SIGKILL one service."""
        service = next(s for s in self.services if s.name == name)
        service.process.kill()
        service.process.wait()

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM in traffic order (verifiers, drafters, trainer, Redis); SIGKILL stragglers."""
        order = {"verifier": 0, "plain": 0, "drafter": 1, "trainer": 2, "redis": 3}
        for service in sorted(self.services, key=lambda s: order[s.name.split("-")[0]]):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
                try:
                    service.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    service.process.kill()
                    service.process.wait()

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


# ---------------------------------------------------------------------- the command
DEMO_PROMPT = ("A shop sells pens for 3 dollars each. Ana buys 7 pens and pays with a 50 dollar note. "
               "How much change does she get?")


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="", help="target model directory (default: the zoo's qwen3-tiny)")
    parser.add_argument("--drafter", default="", help="D3D drafter directory (default: the zoo's d3d-qwen3-tiny)")
    parser.add_argument("--drafters", type=int, default=1, help="drafter replicas")
    parser.add_argument("--verifiers", type=int, default=1, help="verifier replicas")
    parser.add_argument("--no-trainer", action="store_true", help="no online distillation")
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    parser.add_argument("--http-port", type=int, default=8000, help="first verifier's HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50051, help="first verifier's gRPC port")
    parser.add_argument("--drafter-port", type=int, default=50052, help="first drafter's port")
    parser.add_argument("--trainer-port", type=int, default=50060)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--auth-token", default="", help="bearer token every service requires")
    parser.add_argument("--pin", action="store_true", help="pin each service to its own core where possible")
    parser.add_argument("--workdir", default="", help="logs and trainer checkpoints (default: a temporary directory)")
    parser.add_argument("--demo", action="store_true",
                        help="stream one chat completion through the HTTP API, compare with plain decoding, stop")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _zoo_model(name: str) -> str:
    from specd import zoo

    if not zoo.is_built(name):
        raise StackError(f"zoo model {name!r} is not built: run `specd zoo build` (or pass a directory)")
    return str(zoo.model_path(name))


def run(args) -> int:
    config = StackConfig(
        target=args.target or _zoo_model("qwen3-tiny"), drafter=args.drafter or _zoo_model("d3d-qwen3-tiny"),
        drafters=args.drafters, verifiers=args.verifiers, trainer=not args.no_trainer,
        redis_url=args.redis_url, verifier_http_port=args.http_port, verifier_grpc_port=args.grpc_port,
        drafter_port=args.drafter_port, trainer_port=args.trainer_port, block_size=args.block_size,
        mode=args.mode, auth_token=args.auth_token, pin=args.pin or args.demo, workdir=args.workdir,
        plain_verifiers=1 if args.demo else 0,
    )
    stack = Stack(config)
    print(f"starting redis, {'trainer, ' if config.trainer else ''}{config.drafters} drafter(s), "
          f"{config.verifiers} verifier(s) ... (logs in {stack.workdir})", flush=True)
    try:
        stack.start()
    except StackError as err:
        print(f"specd up: {err}", file=sys.stderr)
        return 1
    try:
        for name, endpoint in stack.endpoints():
            print(f"  {name:<12} {endpoint}")
        if args.demo:
            return _demo(stack, args.auth_token)
        print("serving; Ctrl-C stops everything", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C
        while True:
            for service in stack.services:
                if service.process.poll() is not None:
                    print(f"specd up: {service.name} exited with {service.process.returncode}: {_tail(service.log)}",
                          file=sys.stderr)
                    return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...", flush=True)
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the drain short
            signal.signal(signum, signal.SIG_IGN)
        stack.stop()


def _demo(stack: Stack, token: str) -> int:
    from services.client import metrics, stream_completion

    body = {"model": Path(stack.config.target).name, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": DEMO_PROMPT}]}
    speculative, plain = stack.verifiers[0].http, stack.plain[0].http
    stream_completion(plain, "/v1/chat/completions", {**body, "max_tokens": 4}, token=token)  # warm up both
    stream_completion(speculative, "/v1/chat/completions", {**body, "max_tokens": 4}, token=token)
    before = metrics(speculative)
    print(f"\nuser: {DEMO_PROMPT}\nassistant (D3D, asynchronous drafting): ", end="", flush=True)
    spec = stream_completion(speculative, "/v1/chat/completions", body, token=token,
                             on_text=lambda text: print(text, end="", flush=True))
    after = metrics(speculative)
    base = stream_completion(plain, "/v1/chat/completions", body, token=token)
    print()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("specd:spec_decode_num_drafts_total")
    tau = delta("specd:spec_decode_num_accepted_tokens_total") / drafts + 1 if drafts else 1.0
    lookups = delta("specd:spec_decode_num_candidate_lookups_total")
    hit_rate = delta("specd:spec_decode_num_candidate_hits_total") / lookups if lookups else 0.0
    same = "identical" if spec.text == base.text else "DIFFERENT (a bug: greedy output must match)"
    print(f"\n{'':<28}{'tokens':>8}{'seconds':>10}{'tok/s':>9}")
    for name, result in (("plain decoding", base), ("speculative (D3D, async)", spec)):
        rate = result.completion_tokens / result.seconds if result.seconds else 0.0
        print(f"{name:<28}{result.completion_tokens:>8}{result.seconds:>10.2f}{rate:>9.1f}")
    speedup = (spec.completion_tokens / spec.seconds) / (base.completion_tokens / base.seconds) if base.seconds and spec.seconds else 0.0
    print(f"\ntau {tau:.2f} tokens per target pass, candidate hit rate {hit_rate:.0%}, "
          f"speedup {speedup:.2f}x over plain decoding; outputs {same}")
    return 0 if spec.text == base.text else 1
