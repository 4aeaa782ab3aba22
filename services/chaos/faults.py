"""The chaos run's faults: a seeded schedule, and one injector per kind.

`schedule` draws the gaps between faults uniformly from ``every`` and the kinds in seeded rounds:
each round is every kind once, shuffled, so that even a short run (``--quick``) hits each kind;
in the first round a published version comes before the first corrupted one (which needs a
version besides the live one to announce). Drafter faults pick a replica at random.

`Injector.run` fires them one after the other from its own thread (a fault that takes longer than
its gap delays the next); each returns a `FaultRecord` with its evidence:

- ``drafter_kill``: ``kill -9`` of a drafter; the supervisor restarts it.
- ``drafter_stop``: ``SIGSTOP`` of a drafter for longer than the verifier's drafter deadline
  (a hung peer, not a dead one), then ``SIGCONT``.
- ``redis_kill``: ``kill -9`` of Redis; the supervisor restarts it, and its append-only file
  (fsynced on every write) brings back everything it acknowledged.
- ``redis_slow``: ``DEBUG SLEEP 1``: a Redis that answers nobody for a second.
- ``trainer_kill``: ``kill -9`` of the trainer between saving a checkpoint and acknowledging its
  traces: the trainer runs with the failpoint ``trainer.after_checkpoint=sleep(3)`` logging to
  ``failpoints.jsonl``; the injector waits for the trainer's next line there and kills it inside
  the window. (No checkpoint in time: skipped.)
- ``disconnect``: an HTTP stream and a gRPC stream whose clients go away after two chunks.
- ``bad_burst``: ids outside the vocabulary, max_tokens <= 0, a prompt longer than the context,
  a wrong bearer token, on both transports; each one's status is recorded.
- ``publish``: a copy of the live drafter weights offered to the trainer (``Offer``: the gate
  passes weights equal to the live ones, so this publishes a new version the way the trainer's
  own loop does: version key, hint, ``GetCheckpoint``); evidence: which drafters installed it.
- ``corrupt``: the version key names a version the trainer serves, with a sha256 map its files do
  not match; every drafter must refuse it (``specd:drafter_weight_refused``) and keep serving.
  Then the key is put back (unless the trainer published meanwhile).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from services.chaos.load import Client, PromptPool, Recorder, metrics_url, read_metrics
from services.chaos.records import FaultRecord, RequestRecord
from services.common.config import ServiceConfig
from services.common.server import open_channel, wait_healthy
from services.up import Stack
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc
from specd.train.online import VERSION_NAME

KINDS = ("drafter_kill", "drafter_stop", "redis_kill", "redis_slow", "trainer_kill", "disconnect", "bad_burst",
         "publish", "corrupt")
VERSION_KEY, VERSION_CHANNEL = "specd:drafter:live", "specd:drafter:updates"
"""The trainer's defaults (`services.trainer.server.TrainerConfig`), which the chaos stack keeps."""
FAILPOINT = "trainer.after_checkpoint"
FAILPOINT_SECONDS = 3.0
"""How long the trainer sleeps between its checkpoint and the acknowledgement (the kill window)."""


@dataclass(kw_only=True, slots=True)
class Planned:
    at: float
    """Seconds after the load began."""
    kind: str
    target: str = ""


def schedule(seed: int, seconds: float, every: tuple[float, float], drafters: Sequence[str],
             kinds: Sequence[str] = KINDS) -> list[Planned]:
    """The faults of a run of ``seconds`` (module docstring); none in the last ``every[0]``
    seconds, so that the last one's recovery is seen."""
    if not 0 < every[0] <= every[1]:
        raise ValueError(f"--fault-every MIN,MAX needs 0 < MIN <= MAX, got {every}")
    rng = random.Random(seed)
    plan: list[Planned] = []
    pending: list[str] = []
    first_round = True
    t = rng.uniform(*every)
    while t <= seconds - every[0]:
        if not pending:
            pending = rng.sample(list(kinds), len(kinds))
            if first_round and "publish" in pending and "corrupt" in pending:
                i, j = pending.index("publish"), pending.index("corrupt")
                if j < i:
                    pending[i], pending[j] = pending[j], pending[i]
            first_round = False
        kind = pending.pop(0)
        target = {"drafter_kill": None, "drafter_stop": None}.get(kind, "")
        if target is None:
            target = rng.choice(list(drafters))
        elif kind.startswith("redis"):
            target = "redis"
        elif kind == "trainer_kill":
            target = "trainer"
        plan.append(Planned(at=round(t, 3), kind=kind, target=target))
        t += rng.uniform(*every)
    return plan


class Injector:
    """Fires a `schedule` at a running `Stack` (module docstring); ``kills`` counts the kill -9s
    each service took, which its restart count must equal."""

    def __init__(self, stack: Stack, client: Client, pool: PromptPool, recorder: Recorder, *, seed: int,
                 token: str, drafter_timeout: float, failpoint_log: Path, vocab_size: int, max_model_len: int,
                 report: Callable[[FaultRecord], None]) -> None:
        self.stack, self.client, self.pool, self.recorder = stack, client, pool, recorder
        self.rng = random.Random(seed + 1)
        self.drafter_timeout = drafter_timeout
        self.failpoint_log = failpoint_log
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.report = report
        self.redis = redis.Redis.from_url(stack.redis_url, decode_responses=True, socket_timeout=10,
                                          socket_connect_timeout=2)
        self.config = ServiceConfig(auth_token=token)
        self.trainer = trainer_pb2_grpc.TrainerStub(open_channel(stack.trainer.grpc, self.config))
        self.trainer_dir = stack.workdir / "trainer"
        self.offers = stack.workdir / "chaos-offers"
        self.kills: dict[str, int] = {}
        self.faults: list[FaultRecord] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self, plan: Sequence[Planned]) -> None:
        self._thread = threading.Thread(target=self._run, args=(list(plan),), name="chaos-faults", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Faults of the plan are still to fire (or one is in progress)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """No further faults; waits for the one in progress (a stopped drafter is continued)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, plan: list[Planned]) -> None:
        for planned in plan:
            if self._stop.wait(max(0.0, planned.at - self.client.now())):
                return
            record = self.inject(planned)
            self.faults.append(record)
            self.report(record)

    def inject(self, planned: Planned) -> FaultRecord:
        record = FaultRecord(kind=planned.kind, target=planned.target, at=self.client.now())
        try:
            getattr(self, "_" + planned.kind)(record)
        except (redis.RedisError, grpc.RpcError, OSError, TimeoutError) as error:
            # The fault could not be completed (a service it needed was down, from an earlier fault).
            record.skipped = record.skipped or f"{type(error).__name__}: {error}"
        record.end = self.client.now()
        return record

    # ------------------------------------------------------------------ processes
    def _alive(self, name: str) -> bool:
        return next(s for s in self.stack.services if s.name == name).process.poll() is None

    def _pid(self, name: str) -> int:
        return next(s for s in self.stack.services if s.name == name).process.pid

    def _kill(self, record: FaultRecord) -> None:
        # A process already down (still in its restart backoff) is not killed again: the supervisor
        # would not count a second restart for it.
        if not self._alive(record.target):
            record.skipped = f"{record.target} is down (restarting)"
            return
        record.detail["pid"] = self._pid(record.target)
        self.stack.kill(record.target)
        self.kills[record.target] = self.kills.get(record.target, 0) + 1

    _drafter_kill = _kill
    _redis_kill = _kill

    def _drafter_stop(self, record: FaultRecord) -> None:
        if not self._alive(record.target):
            record.skipped = f"{record.target} is down (restarting)"
            return
        seconds = 2 * self.drafter_timeout + 0.5
        record.detail |= {"pid": self._pid(record.target), "seconds": seconds}
        self.stack.signal(record.target, signal.SIGSTOP)
        try:
            self._stop.wait(seconds)  # a stop request cuts the hang short; SIGCONT comes either way
        finally:
            self.stack.signal(record.target, signal.SIGCONT)

    def _wait_up(self, *names: str, timeout: float = 60.0) -> None:
        """Until Redis answers and the trainer is healthy (those of ``names``), an earlier fault's
        restart being over; the fault is skipped (an error) when they are not within ``timeout``
        (a minute: on two cores shared with other work a restarted trainer took over 20 s to
        import torch and load its weights)."""
        deadline = time.monotonic() + timeout
        if "redis" in names:
            while True:
                try:
                    self.redis.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)  # Redis is restarting: it answers PING once its file is read
        if "trainer" in names:
            wait_healthy(self.stack.trainer.grpc, self.config, timeout=max(0.1, deadline - time.monotonic()))

    def _redis_slow(self, record: FaultRecord) -> None:
        self._wait_up("redis")
        record.detail["seconds"] = 1
        self.redis.execute_command("DEBUG", "SLEEP", "1")

    def _trainer_kill(self, record: FaultRecord) -> None:
        seen = self._failpoint_lines()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and not self._stop.is_set():
            lines = self._failpoint_lines()
            pid = self._pid("trainer")
            fresh = [line for line in lines[len(seen):] if line["pid"] == pid and line["name"] == FAILPOINT]
            if fresh and self._alive("trainer"):
                self.stack.kill("trainer")
                self.kills["trainer"] = self.kills.get("trainer", 0) + 1
                record.detail |= {"pid": pid, "inside_window_seconds": round(time.time() - fresh[-1]["time"], 3),
                                  "window_seconds": FAILPOINT_SECONDS}
                return
            time.sleep(0.05)  # the trainer appends to the log; nothing to poll but the file
        record.skipped = f"the trainer reached no checkpoint ({FAILPOINT} in {self.failpoint_log}) within 30 s"

    def _failpoint_lines(self) -> list[dict]:
        if not self.failpoint_log.exists():
            return []
        lines = []
        for text in self.failpoint_log.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:  # a line being written
                break
        return lines

    # ------------------------------------------------------------------ clients
    def _send_all(self, items: Sequence[tuple[RequestRecord, dict]]) -> list[RequestRecord]:
        threads = [threading.Thread(target=self.client.send, args=(r,), kwargs=kw, daemon=True) for r, kw in items]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [self.recorder.add(r) for r, _ in items]

    def _disconnect(self, record: FaultRecord) -> None:
        sent = self._send_all([(r, {"cancel_after": 2}) for r in self.client.cancelled(self.pool, self.rng)])
        record.detail["cancelled"] = {r.transport: r.cancelled for r in sent}

    def _bad_burst(self, record: FaultRecord) -> None:
        sent = [self.recorder.add(self.client.send(r, wrong_token=wrong))
                for r, wrong in self.client.bad(self.vocab_size, self.max_model_len)]
        record.detail["statuses"] = [f"{r.transport} {r.bad}: {r.status}" for r in sent]

    # ------------------------------------------------------------------ versions
    def _drafter_versions(self) -> dict[str, dict[str, float]]:
        """Every drafter whose /metrics answers: its samples."""
        out = {}
        for drafter in self.stack.drafters:
            samples = read_metrics(metrics_url(drafter))
            if samples is not None and drafter.process.poll() is None:
                out[drafter.name] = samples
        return out

    @staticmethod
    def _serves(samples: dict[str, float]) -> str:
        return next((k.split("version=", 1)[1].rstrip("}") for k, v in samples.items()
                     if k.startswith("specd:drafter_weight_version{") and v == 1.0), "")

    def _live(self) -> tuple[str | None, str]:
        raw = self.redis.get(VERSION_KEY)
        return raw, json.loads(raw)["version"] if raw else ""

    def _publish(self, record: FaultRecord) -> None:
        self._wait_up("redis", "trainer")
        _, live = self._live()
        source = self.trainer_dir / "versions" / live if live else Path(self.stack.config.drafter)
        copy = self.offers / f"offer-{len(self.faults)}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(source, copy)
        pids = {d.name: d.process.pid for d in self.stack.drafters}
        decision = self.trainer.Offer(trainer_pb2.OfferRequest(directory=str(copy)), timeout=120)
        record.detail |= {"published": decision.published, "version": decision.version, "from": live or "initial",
                          "reason": decision.reason}
        if not decision.published:
            return
        installed = self._wait_drafters(lambda s: self._serves(s) == decision.version, pids)
        record.detail |= {"installed_by": installed, "drafters": self._steady(pids)}

    def _corrupt(self, record: FaultRecord) -> None:
        self._wait_up("redis", "trainer")
        raw, live = self._live()
        version = self._servable(live)
        if version is None:
            self._publish(FaultRecord(kind="publish"))  # a second version to announce
            raw, live = self._live()
            version = self._servable(live)
        if version is None:
            record.skipped = "the trainer serves no version besides the live one"
            return
        directory = self.trainer_dir / "versions" / version
        sha256 = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
                  for path in sorted(directory.iterdir()) if path.is_file()}
        sha256["model.safetensors"] = hashlib.sha256(b"not these bytes").hexdigest()
        tampered = json.dumps({"version": version, "sha256": sha256}, sort_keys=True)
        pids = {d.name: d.process.pid for d in self.stack.drafters}
        before = {name: s.get("specd:drafter_weight_refused_total", 0.0) for name, s in self._drafter_versions().items()}
        self.redis.set(VERSION_KEY, tampered)
        self.redis.publish(VERSION_CHANNEL, tampered)
        try:
            refused = self._wait_drafters(
                lambda s, name: s.get("specd:drafter_weight_refused_total", 0.0) > before.get(name, 0.0), pids,
                by_name=True)
        finally:
            if self.redis.get(VERSION_KEY) == tampered:  # the trainer has not published since
                if raw is None:
                    self.redis.delete(VERSION_KEY)
                else:
                    self.redis.set(VERSION_KEY, raw)
                    self.redis.publish(VERSION_CHANNEL, raw)
        serving = {name: self._serves(s) for name, s in self._drafter_versions().items()}
        record.detail |= {"version": version, "live": live, "refused_by": refused, "drafters": self._steady(pids),
                          "installed_by": sorted(name for name, v in serving.items() if v == version)}

    def _servable(self, live: str) -> str | None:
        """The newest version the trainer serves that is not the live one (None: there is none)."""
        versions = self.trainer_dir / "versions"
        names = sorted((p.name for p in versions.iterdir() if VERSION_NAME.fullmatch(p.name) and p.name != live),
                       reverse=True) if versions.is_dir() else []
        for name in names:
            try:
                call = self.trainer.GetCheckpoint(trainer_pb2.GetCheckpointRequest(version=name), timeout=10)
                next(call)  # its first chunk: the trainer knows the version
                call.cancel()
                return name
            except grpc.RpcError:  # pruned, or written after the trainer's last checkpoint: not served
                continue
        return None

    def _wait_drafters(self, done: Callable, pids: dict[str, int], *, by_name: bool = False,
                       timeout: float = 20.0) -> list[str]:
        """The drafters for which ``done(samples)`` (or ``done(samples, name)``) came true within
        ``timeout``, waiting for all that stay up."""
        deadline = time.monotonic() + timeout
        while True:
            current = self._drafter_versions()
            hits = sorted(name for name, s in current.items() if (done(s, name) if by_name else done(s)))
            steady = self._steady(pids)
            if set(steady) <= set(hits) or time.monotonic() > deadline or self._stop.is_set():
                return hits
            time.sleep(0.2)  # the drafters act on the key's hint within their poll

    def _steady(self, pids: dict[str, int]) -> list[str]:
        """The drafters still on the process they had when the fault began, and up."""
        return sorted(d.name for d in self.stack.drafters if d.process.pid == pids.get(d.name)
                      and d.process.poll() is None)
