"""The verifier's drafter: the engine's drafter contract over gRPC, across drafter replicas.

`RemoteDrafters` is what `specd.engine.SpeculativeEngine` gets as its drafter in the verifier
service. Design choices:

- **Replicas.** Each address is one replica, except ``dns:///name:port``, which is resolved
  (``socket.getaddrinfo``) to all its A/AAAA records, so a headless Kubernetes Service yields every
  pod. Names are re-resolved every ``retry_seconds`` and after a failure: new pods join, gone ones
  leave. Each replica gets its own channel (`services.common.server.open_channel`: auth, TLS,
  tracing). A replica is used once its ``Info`` answered and agreed with the others on
  ``vocab_size`` and ``max_block``.
- **Sticky sequences.** A sequence stays on the replica that holds its context and cache; a new
  one goes to the replica with the fewest of this verifier's live sequences, ties broken at
  random: every verifier resolves the same replica list, and with first-in-list tie-breaking the
  first sequence of every verifier would land on the same replica (at one sequence per verifier,
  one drafter would serve the whole cluster). One engine call (every sequence of a
  step) is split by replica and the parts run concurrently: Draft as a unary call, Speculate over
  one bidirectional stream per replica that stays open (a queue feeds it, a reader thread drains
  it), answers paired by ``step``. Results are merged back in request order.
- **Wire ids.** Each engine sequence gets a random 63-bit id on the wire, so sequences of different
  verifiers never collide on a shared replica (engine ids restart at 0 in every engine).
- **Delta contexts.** The pool remembers how much of each context its replica holds and sends
  only the rest; a sequence the replica names in ``resend`` (evicted, restarted) is sent again in
  full in a follow-up message of the same call.
- **Failure: a sick replica costs its own sequences, never the batch.**
  - *Slow or hung.* A call waits for its parts only so long: once a part has run
    ``grace_factor`` times as long as the reference (the slowest part of the call that answered,
    or the pool's typical part time, whichever is longer; at least ``grace_seconds``), the call
    returns without it: its sequences get an empty block (Draft) or no candidates (Speculate),
    i.e. plain decoding this step. The part goes on in the background until its deadline
    (``timeout``); meanwhile its replica is *busy*: calls answer its sequences at once with no
    block rather than queue behind it, and new sequences go elsewhere. A late answer is dropped
    (the pool still records what context the replica now holds); a deadline is a failure. With
    a single usable replica there is no one else to stall, and parts are waited for up to the
    deadline, as is the very first call (no reference yet).
  - *Failed.* An RPC that fails with anything but a verdict on the request (UNAVAILABLE,
    DEADLINE_EXCEEDED, a broken stream, ...) takes the replica out of use; its sequences move to
    live replicas, and the failed part is retried once there, with full contexts. A background
    thread asks the down replica's ``Info`` every ``retry_seconds`` (never a caller: a hung
    replica's Info would hold the step for the whole deadline); it is used again once Info
    answers and agrees. It is logged once as down (WARNING), then as still down at doubling
    intervals (up to 5 minutes), and once as back (INFO).
  - When no replica can answer the call raises `DrafterUnavailable` and the engine decodes plain:
    a request never fails for speed's sake. INVALID_ARGUMENT is the caller's bug: ValueError.
    RESOURCE_EXHAUSTED (more sequences in one call than a replica holds) is DrafterUnavailable.
- Candidates whose ``base_len`` is not the context length are stale and dropped. Blocks drafted
  with older weights are still valid proposals (they carry their own q), so the weight version
  is recorded (`version`) but not used to drop anything.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import secrets
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence, TypeVar

import grpc

from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.common.wire import block_from_proto, params_to_proto
from specd._proto.v1 import drafter_pb2, drafter_pb2_grpc
from specd.drafters.base import DraftBlock, Drafter, DrafterUnavailable, DraftRequest, Outcome, SpeculateRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")
Request = TypeVar("Request", DraftRequest, SpeculateRequest)

MAX_WARNING_INTERVAL = 300.0
"""Longest pause (seconds) between "still down" warnings about one replica."""
TYPICAL_WEIGHT = 0.2
"""Weight of the newest part in the pool's typical part time (an exponential moving average)."""
_GIVEN_UP = object()  # a job's outcome when the caller stopped waiting for it


class _ReplicaFailed(Exception):
    """A replica did not answer (or answered nonsense); the call fails over."""


@dataclass(kw_only=True, slots=True)
class PoolStats:
    """Counters of the pool (the verifier exports them as metrics)."""

    num_round_trips: int = 0
    """Draft calls and Speculate messages answered."""
    num_failovers: int = 0
    """Parts of a call moved to another replica after their replica failed."""
    num_replica_failures: int = 0
    """Times a replica went down (a call or its Info failed) and was taken out of use until its
    Info answers again."""
    num_stragglers: int = 0
    """Parts (and Releases) a call stopped waiting for: their replica outlived the grace (module
    docstring), and their sequences got no block."""
    num_resends: int = 0
    """Sequences sent again in full because a replica asked (``resend``)."""
    server_seconds: float = 0.0
    """Time the replicas reported spending on the round trips (their passes, queueing included)."""
    transport_seconds: float = 0.0
    """Round trips' time outside the replica (the call's time minus the replica's
    ``server_seconds``): serialisation, the network, gRPC's threads; / num_round_trips = mean."""


def resolve(address: str) -> list[str]:
    """``dns:///name:port`` (or ``dns:name:port``) -> every "ip:port" it resolves to, sorted;
    any other address as is. socket.gaierror when the name does not resolve."""
    if not address.startswith("dns:"):
        return [address]
    target = address.removeprefix("dns:")
    if target.startswith("//"):  # dns://[authority]/host:port: the authority (a DNS server) is not supported
        target = target[2:].partition("/")[2]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"drafter address {address!r} needs a port: dns:///name:port")
    host = host.strip("[]")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return sorted({f"[{info[4][0]}]:{port}" if ":" in info[4][0] else f"{info[4][0]}:{port}" for info in infos})


class _SpeculateStream:
    """One open Speculate stream: requests go in through a queue, a thread reads the answers."""

    _CLOSE = object()

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, address: str) -> None:
        self.address = address
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Speculate(iter(self._requests.get, self._CLOSE))
        threading.Thread(target=self._read, name=f"speculate-{address}", daemon=True).start()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._answers.put(answer)
            self._answers.put(_ReplicaFailed(f"{self.address}: the Speculate stream ended"))
        except grpc.RpcError as err:
            self._answers.put(err)

    def exchange(self, request: drafter_pb2.SpeculateRequest, timeout: float) -> drafter_pb2.SpeculateResponse:
        """Send one message and wait ``timeout`` seconds for its answer; raises grpc.RpcError or
        _ReplicaFailed (the stream is then unusable: close it)."""
        self._requests.put(request)
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise _ReplicaFailed(f"{self.address}: no Speculate answer within {timeout:.1f}s") from None
        if isinstance(answer, Exception):
            raise answer
        if answer.step != request.step:
            raise _ReplicaFailed(f"{self.address}: Speculate answered step {answer.step} to step {request.step}")
        return answer

    def close(self) -> None:
        self._requests.put(self._CLOSE)  # also unblocks grpc's request-consuming thread
        self._call.cancel()


@dataclass(eq=False, kw_only=True)
class _Replica:
    address: str
    config: ServiceConfig
    lock: threading.Lock = field(default_factory=threading.Lock)  # one exchange at a time (streams pair in order)
    channel: grpc.Channel | None = None
    stub: drafter_pb2_grpc.DrafterStub | None = None
    stream: _SpeculateStream | None = None
    checked: bool = False  # its Info answered and agreed (and nothing failed since): usable
    incompatible: str = ""  # why it can never be used
    num_stragglers: int = 0  # jobs a call stopped waiting for, still running: > 0 is "busy"
    probing: bool = False  # a background thread asks its Info
    down_since: float | None = None  # monotonic time it went down (None: up, or never answered yet)
    warn_at: float = 0.0  # when down: the next "still down" warning is due
    warn_every: float = 0.0
    num_seqs: int = 0
    orphans: set[int] = field(default_factory=set)
    """Wire ids of sequences the pool no longer places here but this replica may still hold (it
    was down, busy or lagging when they left or finished): released once it can be told."""

    def connect(self) -> drafter_pb2_grpc.DrafterStub:
        if self.stub is None:
            self.channel = open_channel(self.address, self.config)
            self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        return self.stub

    def disconnect(self) -> None:
        """Close the stream and the channel (a fresh channel later skips grpc's reconnect backoff)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.channel is not None:
            self.channel.close()
        self.channel = self.stub = None


@dataclass(kw_only=True, slots=True)
class _Sequence:
    wire_id: int
    replica: _Replica | None = None
    sent: int = 0  # context tokens the replica holds, as far as we know


class RemoteDrafters(Drafter):
    """The engine's drafter over one or many drafter replicas (see the module docstring)."""

    name = "d3d-remote"
    can_speculate = True

    def __init__(
        self, addresses: Sequence[str], config: ServiceConfig, *, timeout: float = 10.0, retry_seconds: float = 2.0,
        vocab_size: int = 0, max_block: int = 0, grace_seconds: float = 0.25, grace_factor: float = 4.0,
    ) -> None:
        """With ``vocab_size`` and ``max_block`` (what the caller needs: the target's vocabulary
        and its block size) the pool starts even when no replica answers yet — in a cluster,
        drafters may come up after verifiers — and uses each replica once its Info agrees.
        Without them, the first replica to answer defines them and one must answer now (the
        replicas' Info is asked here, on the caller's thread; later only in the background).

        ``timeout`` is every RPC's deadline; ``grace_seconds`` and ``grace_factor`` bound how long
        a call waits for a lagging part (module docstring: Failure)."""
        if not addresses:
            raise ValueError("RemoteDrafters needs at least one drafter address (host:port or dns:///name:port)")
        if grace_seconds <= 0 or grace_factor < 1:
            raise ValueError(f"need grace_seconds > 0 and grace_factor >= 1, got {grace_seconds} and {grace_factor}")
        self.addresses = list(addresses)
        self.config = config
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.grace_seconds = grace_seconds
        self.grace_factor = grace_factor
        self.stats = PoolStats()
        self.version = ""
        """The newest drafter_version seen in an answer."""
        self.vocab_size = vocab_size
        self.max_block = max_block
        self._lock = threading.Lock()  # replicas' state, sequences, stats (no replica's lock is taken under it)
        self._rng = random.Random(secrets.randbits(64))  # placement ties: see the module docstring
        self._replicas: dict[str, _Replica] = {}
        self._resolved: dict[str, list[str]] = {}  # configured address -> replica addresses
        self._resolved_at = float("-inf")
        self._seqs: dict[int, _Sequence] = {}  # engine seq id -> its wire id and replica
        self._steps = itertools.count(1)
        self._typical: float | None = None  # seconds a part takes (moving average of those waited for)
        self._closed = threading.Event()  # stops the background probes
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="drafter-pool")
        self._prepare(wait=True)
        incompatible = [r.incompatible for r in self._replicas.values() if r.incompatible]
        if incompatible:
            self.close()
            raise ValueError("drafter replicas disagree: " + "; ".join(incompatible))
        if not self.vocab_size:
            self.close()
            raise DrafterUnavailable(f"no drafter replica answered Info: {', '.join(self.addresses)}")
        if not any(r.checked for r in self._replicas.values()):
            logger.warning("no drafter replica answers yet (%s): decoding plain until one does", ", ".join(self.addresses))

    # ------------------------------------------------------------------ the drafter contract
    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        """One block per request, in order (parts on different replicas run concurrently); an
        empty block for a sequence whose replica is busy or lagging (module docstring)."""
        return self._run(requests, self._draft_part, DraftBlock.empty)

    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        """Candidate blocks keyed by outcome (k, c) per request, in order (none: busy or lagging)."""
        return self._run(requests, self._speculate_part, dict)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence here and on its replica. Never raises, never waits on a busy
        or down replica, and on a lagging one only as a call does. A replica that cannot be told
        now is told when it answers again (its ``orphans``, with the sequences moved off it):
        a replica that only hung still holds their rows, and no LRU pressure comes once the
        load stops."""
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None or seq.replica is None:
                return
            replica = seq.replica
            replica.num_seqs -= 1
            replica.orphans.add(seq.wire_id)
            if not replica.checked or replica.num_stragglers:
                return  # told once it answers again (`_release_orphans`)
            wire_ids, replica.orphans = sorted(replica.orphans), set()
        self._release(replica, wire_ids)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for replica in self._replicas.values():
                replica.disconnect()
        self._executor.shutdown(wait=False)

    def replica_of(self, seq_id: int) -> str | None:
        """The address of the replica that holds a sequence (None: not placed)."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            return seq.replica.address if seq is not None and seq.replica is not None else None

    def assigned(self) -> dict[str, int]:
        """Live sequences per replica address."""
        with self._lock:
            return {address: replica.num_seqs for address, replica in self._replicas.items()}

    def states(self) -> dict[str, str]:
        """Each replica's state: "live"; "busy" (a call stopped waiting for it and it has not
        answered yet); "down" (failed, or not answered yet: probed in the background); or
        "incompatible" (never used)."""
        with self._lock:
            return {address: _state(replica) for address, replica in self._replicas.items()}

    # ------------------------------------------------------------------ one call
    def _run(
        self, requests: list[Request], part_fn: Callable[..., dict[int, T]], empty: Callable[[], T]
    ) -> list[T]:
        """Split by replica, run the parts concurrently, retry failed parts once elsewhere;
        ``empty()`` for the sequences of busy replicas and of parts given up on."""
        if not requests:
            return []
        self._prepare()
        seqs: list[_Sequence | None] = [None] * len(requests)  # filled by _split: a released one stays valid
        results: dict[int, T] = {}
        pending = list(range(len(requests)))
        errors: list[str] = []
        for attempt in range(2):
            parts, skipped = self._split(pending, requests, seqs, errors)
            results.update((i, empty()) for i in skipped)
            jobs = [(replica, partial(part_fn, replica, part, requests, seqs)) for replica, part in parts.items()]
            outcomes = self._wait(jobs, learn=True)
            pending = []
            for (replica, part), outcome in zip(parts.items(), outcomes):
                if isinstance(outcome, (ValueError, DrafterUnavailable)):
                    raise outcome
                if outcome is _GIVEN_UP:
                    results.update((i, empty()) for i in part)
                elif isinstance(outcome, _ReplicaFailed):
                    errors.append(str(outcome))
                    self._mark_dead(replica, str(outcome))
                    pending += part
                    if attempt == 0:
                        with self._lock:
                            self.stats.num_failovers += 1
                else:
                    results.update(outcome)
            if not pending:
                return [results[i] for i in range(len(requests))]
        raise DrafterUnavailable(f"drafter replicas failed twice in one call: {'; '.join(errors)}")

    def _wait(self, jobs: list[tuple[_Replica, Callable[[], object]]], *, learn: bool) -> list[object]:
        """Run one job per replica concurrently and return their outcomes in order: a result, the
        error it raised (ValueError, DrafterUnavailable, _ReplicaFailed), or _GIVEN_UP when it
        outlived the grace (it goes on in the background; `_late` sees how it ends). ``learn``:
        the jobs' times feed the typical part time."""
        start = time.monotonic()
        with self._lock:
            typical = self._typical
            # One usable replica: a lag stalls only its own sequences, so wait for it (to the deadline).
            bounded = sum(r.checked for r in self._replicas.values()) > 1
        if len(jobs) == 1 and not bounded:
            # Nothing to run beside it and no grace to keep: on the caller's thread, which saves
            # the step two thread hand-offs (the RPC's deadline still bounds it).
            outcome = _attempt(jobs[0][1])
            if learn and not isinstance(outcome, Exception):
                self._learn(time.monotonic() - start)
            return [outcome]
        futures = {self._executor.submit(_attempt, job): i for i, (_, job) in enumerate(jobs)}
        outcomes: list[object] = [_GIVEN_UP] * len(jobs)
        slowest: float | None = None  # the slowest job of this call that answered
        running = set(futures)
        while running:
            # The grace scales with what answering takes (this call's answers, recent calls'): a part
            # far slower than its peers runs on alone rather than hold every sequence of the step.
            reference = max((t for t in (typical, slowest) if t is not None), default=None)
            timeout = None
            if bounded and reference is not None:
                grace = max(self.grace_seconds, self.grace_factor * reference)
                timeout = max(0.0, start + grace - time.monotonic())
            done, running = wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:
                break  # the grace is over
            seconds = time.monotonic() - start
            for future in done:
                outcomes[futures[future]] = outcome = future.result()
                if not isinstance(outcome, Exception):
                    slowest = seconds
                    if learn:
                        self._learn(seconds)
        for future in running:
            replica = jobs[futures[future]][0]
            with self._lock:
                replica.num_stragglers += 1
                self.stats.num_stragglers += 1
            logger.info("drafter replica %s lags (no answer in %.2fs): its sequences get no block until it answers",
                        replica.address, time.monotonic() - start)
            future.add_done_callback(partial(self._late, replica))
        return outcomes

    def _learn(self, seconds: float) -> None:
        """A part answered in ``seconds``: fold it into the typical part time."""
        with self._lock:
            last = self._typical
            self._typical = seconds if last is None else last + TYPICAL_WEIGHT * (seconds - last)

    def _late(self, replica: _Replica, future: Future) -> None:
        """A job the call stopped waiting for has ended: its answer is dropped (the pool already
        recorded what context the replica holds), its failure takes the replica out of use."""
        with self._lock:
            replica.num_stragglers -= 1
        outcome = None if future.cancelled() else future.result()
        if isinstance(outcome, _ReplicaFailed):
            self._mark_dead(replica, str(outcome))
            return
        if isinstance(outcome, Exception):
            logger.warning("a drafter call to %s that was not waited for failed: %s", replica.address, outcome)
        if not self._closed.is_set():
            self._executor.submit(self._release_orphans, replica)  # not on the late job's own thread
        else:
            logger.info("drafter replica %s answered late (answer dropped); using it again", replica.address)

    def _split(
        self, indices: list[int], requests: Sequence[Request], seqs: list[_Sequence | None], errors: list[str]
    ) -> tuple[dict[_Replica, list[int]], list[int]]:
        """Assign unplaced sequences (fewest live sequences first, never to a busy replica) and
        group indices by replica; also returns the indices left without a replica that can
        answer now (they get no block)."""
        parts: dict[_Replica, list[int]] = {}
        skipped: list[int] = []
        with self._lock:
            usable = [r for r in self._replicas.values() if r.checked]
            if not usable:
                why = "; ".join(errors) or "every replica is down or not yet checked"
                raise DrafterUnavailable(f"no drafter replica is reachable ({why}); addresses: {', '.join(self.addresses)}")
            free = [r for r in usable if not r.num_stragglers]
            for i in indices:
                seq = self._seqs.get(requests[i].seq_id)
                if seq is None:
                    seq = self._seqs[requests[i].seq_id] = _Sequence(wire_id=secrets.randbits(63))
                seqs[i] = seq
                if seq.replica not in usable:
                    if seq.replica is not None:
                        seq.replica.num_seqs -= 1
                        seq.replica.orphans.add(seq.wire_id)
                        seq.replica = None
                    if free:
                        fewest = min(r.num_seqs for r in free)
                        seq.replica = self._rng.choice([r for r in free if r.num_seqs == fewest])
                        seq.replica.num_seqs += 1
                        seq.replica.orphans.discard(seq.wire_id)  # it is sent its whole context again
                    seq.sent = 0
                if seq.replica is None or seq.replica.num_stragglers:
                    skipped.append(i)
                else:
                    parts.setdefault(seq.replica, []).append(i)
        return parts, skipped

    def _context(
        self, replica: _Replica, request: DraftRequest | SpeculateRequest, seq: _Sequence
    ) -> drafter_pb2.SequenceContext:
        """The request's context as a delta from what ``replica`` holds."""
        with self._lock:
            start = seq.sent if seq.replica is replica and seq.sent <= len(request.context) else 0
        return drafter_pb2.SequenceContext(
            seq_id=seq.wire_id, context_start=start, tokens=request.context[start:], params=params_to_proto(request.params)
        )

    def _answered(
        self, replica: _Replica, batch: list[int], seqs: Sequence[_Sequence], sent: Sequence[drafter_pb2.SequenceContext],
        response: drafter_pb2.DraftResponse | drafter_pb2.SpeculateResponse, seconds: float,
    ) -> list[int]:
        """Record an answer (what the replica now holds: what was ``sent``, not the request's
        context, which a Draft shares with the engine and may have grown by a late answer; its
        version; the transport's share of the ``seconds`` the call took); returns the indices it
        wants resent."""
        again = []
        resend = set(response.resend)
        with self._lock:
            self.stats.num_round_trips += 1
            self.stats.server_seconds += response.server_seconds
            self.stats.transport_seconds += max(0.0, seconds - response.server_seconds)
            self.version = response.drafter_version or self.version
            for i, context in zip(batch, sent):
                seq = seqs[i]
                if seq.wire_id in resend:
                    seq.sent = 0
                    again.append(i)
                elif seq.replica is replica:
                    seq.sent = context.context_start + len(context.tokens)
            self.stats.num_resends += len(again)
        return again

    # ------------------------------------------------------------------ parts
    def _draft_part(
        self, replica: _Replica, part: list[int], requests: Sequence[DraftRequest], seqs: Sequence[_Sequence]
    ) -> dict[int, DraftBlock]:
        def send(batch: list[int]) -> tuple[drafter_pb2.DraftRequest, drafter_pb2.DraftResponse, list]:
            message = drafter_pb2.DraftRequest(items=[
                drafter_pb2.DraftItem(
                    context=self._context(replica, requests[i], seqs[i]), block_size=requests[i].block_size
                )
                for i in batch
            ])
            try:
                response = replica.connect().Draft(message, timeout=self.timeout)
            except grpc.RpcError as err:
                raise _verdict(replica, err) from err
            return message, response, list(response.blocks)

        with replica.lock:
            return self._exchange(replica, part, seqs, send, lambda i, block: _block(replica, block))

    def _speculate_part(
        self, replica: _Replica, part: list[int], requests: Sequence[SpeculateRequest], seqs: Sequence[_Sequence]
    ) -> dict[int, dict[Outcome, DraftBlock]]:
        def send(batch: list[int]) -> tuple[drafter_pb2.SpeculateRequest, drafter_pb2.SpeculateResponse, list]:
            message = drafter_pb2.SpeculateRequest(step=next(self._steps), items=[
                drafter_pb2.SpeculateItem(
                    context=self._context(replica, requests[i], seqs[i]), block=requests[i].block,
                    block_size=requests[i].block_size, budget=requests[i].budget,
                )
                for i in batch
            ])
            if replica.stream is None:
                replica.stream = _SpeculateStream(replica.connect(), replica.address)
            response = replica.stream.exchange(message, self.timeout)
            return message, response, list(response.sequences)

        def convert(i: int, sequence: drafter_pb2.SequenceCandidates) -> dict[Outcome, DraftBlock]:
            if sequence.seq_id != seqs[i].wire_id:
                raise _ReplicaFailed(f"{replica.address}: answered seq {sequence.seq_id} for seq {seqs[i].wire_id}")
            if sequence.base_len != len(requests[i].context):
                return {}  # stale: drafted for another context length
            return {(c.accepted, c.token): _block(replica, c.block) for c in sequence.candidates}

        with replica.lock:
            try:
                return self._exchange(replica, part, seqs, send, convert)
            except grpc.RpcError as err:
                self._drop_stream(replica)
                raise _verdict(replica, err) from err
            except (_ReplicaFailed, ValueError):
                self._drop_stream(replica)
                raise

    def _exchange(self, replica: _Replica, part: list[int], seqs: Sequence[_Sequence], send, convert) -> dict:
        """Send ``part`` of ``requests`` (under the replica's lock) until the replica holds every
        context: what it asks for in ``resend`` goes again, whole; a second ask is a failure.
        ``send(indices) -> (message, response, answers)`` with one answer per index, ``convert(i, answer)``."""
        results = {}
        pending = list(part)
        full = False
        while pending:
            sent_at = time.perf_counter()
            message, response, answers = send(pending)
            if len(answers) != len(pending):
                raise _ReplicaFailed(f"{replica.address}: {len(answers)} answers for {len(pending)} items")
            sent = [item.context for item in message.items]
            again = self._answered(replica, pending, seqs, sent, response, time.perf_counter() - sent_at)
            resent = set(again)
            for i, answer in zip(pending, answers):
                if i not in resent:
                    results[i] = convert(i, answer)
            if again and full:
                raise _ReplicaFailed(f"{replica.address}: asked to resend contexts that were sent in full")
            pending = again
            full = True  # _answered reset `sent`, so a follow-up carries whole contexts
        return results

    def _release(self, replica: _Replica, wire_ids: list[int]) -> None:
        """Tell ``replica`` to forget ``wire_ids``, waiting as a call does; ids it was not told are
        its orphans again, for the next time it answers."""
        (outcome,) = self._wait([(replica, partial(self._release_on, replica, wire_ids))], learn=False)
        if outcome is not True:
            with self._lock:
                replica.orphans.update(wire_ids)
        if isinstance(outcome, _ReplicaFailed):
            self._mark_dead(replica, str(outcome))

    def _release_orphans(self, replica: _Replica) -> None:
        """Release what ``replica`` was not told while it was down or busy, now that it answers
        (a hung replica that comes back, unlike a restarted one, still holds those rows)."""
        with self._lock:
            if not replica.orphans or not replica.checked or replica.num_stragglers:
                return
            wire_ids, replica.orphans = sorted(replica.orphans), set()
        self._release(replica, wire_ids)

    def _release_on(self, replica: _Replica, wire_ids: list[int]) -> bool:
        with replica.lock:
            if replica.stub is None:
                return False
            try:
                replica.stub.Release(drafter_pb2.ReleaseRequest(seq_ids=wire_ids), timeout=self.timeout)
            except grpc.RpcError as err:
                raise _ReplicaFailed(f"{replica.address}: Release failed: {err.code().name}: {err.details()}") from err
        return True

    # ------------------------------------------------------------------ replicas
    def _prepare(self, *, wait: bool = False) -> None:
        """Re-resolve names when due, and check (Info) replicas never checked: on this thread
        when ``wait`` (at start), else in the background. Replicas that failed have their probe."""
        now = time.monotonic()
        if now - self._resolved_at >= self.retry_seconds:
            self._refresh_addresses()
            self._resolved_at = now
        with self._lock:
            unchecked = [
                r for r in self._replicas.values() if not r.checked and not r.incompatible and not r.probing
            ]
            if not wait:
                for replica in unchecked:
                    replica.probing = True
        if wait:
            list(self._executor.map(self._check, unchecked))
        else:
            for replica in unchecked:
                self._start_probe(replica, 0.0)

    def _refresh_addresses(self) -> None:
        for address in self.addresses:
            try:
                self._resolved[address] = resolve(address)
            except OSError as err:  # socket.gaierror: keep what we had
                logger.warning("cannot resolve drafter address %s (%s); keeping %s", address, err, self._resolved.get(address, []))
        wanted = {a for addresses in self._resolved.values() for a in addresses}
        with self._lock:
            for address in sorted(wanted - self._replicas.keys()):
                self._replicas[address] = _Replica(address=address, config=self.config)
                logger.info("drafter replica %s joined", address)
            for address in self._replicas.keys() - wanted:
                replica = self._replicas.pop(address)
                self._unplace(replica)
                replica.disconnect()
                logger.info("drafter replica %s left", address)

    def _check(self, replica: _Replica) -> None:
        """Ask a replica's Info; it is used once it answers and agrees with the pool."""
        try:
            with replica.lock:
                info = replica.connect().Info(drafter_pb2.InfoRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            self._mark_dead(replica, f"Info failed: {err.code().name}: {err.details()}")  # takes replica.lock
            return
        with self._lock:
            if not self.vocab_size:
                self.vocab_size, self.max_block = info.vocab_size, info.max_block
            if info.vocab_size != self.vocab_size or info.max_block < self.max_block:
                replica.incompatible = (
                    f"{replica.address} has vocab_size {info.vocab_size} / max_block {info.max_block}, the pool "
                    f"needs {self.vocab_size} / at least {self.max_block}: serve one drafter checkpoint family "
                    f"(sharing the target's tokenizer) on every replica"
                )
                logger.error("not using drafter replica: %s", replica.incompatible)
                return
            replica.checked = True
            self.version = self.version or info.drafter_version
            down_since, replica.down_since = replica.down_since, None
        if down_since is not None:
            logger.info("drafter replica %s is back after %.1fs", replica.address, time.monotonic() - down_since)
        self._release_orphans(replica)

    def _start_probe(self, replica: _Replica, delay: float) -> None:
        """A thread that asks ``replica``'s Info after ``delay``, then every ``retry_seconds``, until
        it is usable (or incompatible, or gone, or the pool closes). The caller set ``probing``."""
        def probe() -> None:
            pause = delay
            while True:
                self._closed.wait(pause)
                if self._probe_done(replica):
                    return
                self._check(replica)
                if self._probe_done(replica):
                    return
                pause = self.retry_seconds

        threading.Thread(target=probe, name=f"drafter-probe-{replica.address}", daemon=True).start()

    def _probe_done(self, replica: _Replica) -> bool:
        """Whether the probe can end (``probing`` is then cleared under the same lock, so a
        failure after this starts a new probe rather than count on this one)."""
        with self._lock:
            done = (replica.checked or bool(replica.incompatible) or self._closed.is_set()
                    or self._replicas.get(replica.address) is not replica)
            replica.probing = not done
            return done

    def _mark_dead(self, replica: _Replica, why: str) -> None:
        """Out of use until a background Info answers (started here); its sequences move (with
        full contexts) on next use. Logged as down once, then with backoff (module docstring)."""
        if self._closed.is_set():
            return
        now = time.monotonic()
        with self._lock:
            replica.checked = False  # Info again before its next use
            self._unplace(replica)
            self._resolved_at = float("-inf")  # re-resolve names on the next call
            if replica.down_since is None:  # it just went down
                replica.down_since, replica.warn_every = now, self.retry_seconds
                replica.warn_at = now + replica.warn_every
                self.stats.num_replica_failures += 1
                level = None
            elif now >= replica.warn_at:  # still down: warnings back off exponentially, not one every retry
                replica.warn_every = min(2 * replica.warn_every, MAX_WARNING_INTERVAL)
                replica.warn_at = now + replica.warn_every
                level = logging.WARNING
            else:
                level = logging.DEBUG
            probe, replica.probing = not replica.probing, True
            down_for = now - replica.down_since
        if level is None:
            logger.warning("drafter replica %s is down (%s): its sequences move to the others, its Info is asked "
                           "every %.1fs in the background", replica.address, why, self.retry_seconds)
        else:
            logger.log(level, "drafter replica %s is still down after %.0fs: %s", replica.address, down_for, why)
        with replica.lock:  # never held here by this thread: jobs return before their failure is handled
            replica.disconnect()
        if probe:
            self._start_probe(replica, self.retry_seconds)

    def _drop_stream(self, replica: _Replica) -> None:
        if replica.stream is not None:
            replica.stream.close()
            replica.stream = None

    def _unplace(self, replica: _Replica) -> None:
        """Move every sequence off ``replica`` (under the lock)."""
        for seq in self._seqs.values():
            if seq.replica is replica:
                seq.replica, seq.sent = None, 0
                replica.orphans.add(seq.wire_id)
        replica.num_seqs = 0


def _attempt(job: Callable[[], object]) -> object:
    """Run one job; its failure is returned, so every job finishes before the call decides."""
    try:
        return job()
    except (ValueError, DrafterUnavailable, _ReplicaFailed) as err:
        return err


def _state(replica: _Replica) -> str:
    if replica.incompatible:
        return "incompatible"
    if not replica.checked:
        return "down"
    return "busy" if replica.num_stragglers else "live"


def _verdict(replica: _Replica, err: grpc.RpcError) -> Exception:
    """What an RPC error means for the call: the caller's bug, no room, or a failed replica."""
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"drafter {replica.address} refused the request: {err.details()}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return DrafterUnavailable(f"drafter {replica.address}: {err.details()}")
    return _ReplicaFailed(f"{replica.address}: {code.name}: {err.details()}")


def _block(replica: _Replica, message) -> DraftBlock:
    try:
        return block_from_proto(message)
    except ValueError as err:
        raise _ReplicaFailed(f"{replica.address} sent a malformed block: {err}") from None
