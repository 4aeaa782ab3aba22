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
- **Failure.** An RPC that fails with anything but a verdict on the request (UNAVAILABLE,
  DEADLINE_EXCEEDED, a broken stream, ...) marks the replica dead for ``retry_seconds``; its
  sequences move to live replicas and the failed part is retried once there with full contexts.
  When no replica can answer the call raises `DrafterUnavailable` and the engine decodes plain:
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import grpc

from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.common.wire import block_from_proto, params_to_proto
from specd._proto.v1 import drafter_pb2, drafter_pb2_grpc
from specd.drafters.base import DraftBlock, DrafterUnavailable, DraftRequest, SpeculateRequest
from specd.drafters.d3d import Outcome

logger = logging.getLogger(__name__)

T = TypeVar("T")
Request = TypeVar("Request", DraftRequest, SpeculateRequest)


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
    """Times a replica was found dead or failing (any call) and taken out of use for a while."""
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
    checked: bool = False  # its Info answered and agreed
    incompatible: str = ""  # why it can never be used
    dead_until: float = 0.0
    num_seqs: int = 0

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


class RemoteDrafters:
    """The engine's drafter over one or many drafter replicas (see the module docstring)."""

    name = "d3d-remote"
    can_speculate = True

    def __init__(
        self, addresses: Sequence[str], config: ServiceConfig, *, timeout: float = 10.0, retry_seconds: float = 2.0,
        vocab_size: int = 0, max_block: int = 0,
    ) -> None:
        """With ``vocab_size`` and ``max_block`` (what the caller needs: the target's vocabulary
        and its block size) the pool starts even when no replica answers yet — in a cluster,
        drafters may come up after verifiers — and uses each replica once its Info agrees.
        Without them, the first replica to answer defines them and one must answer now."""
        if not addresses:
            raise ValueError("RemoteDrafters needs at least one drafter address (host:port or dns:///name:port)")
        self.addresses = list(addresses)
        self.config = config
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.stats = PoolStats()
        self.version = ""
        """The newest drafter_version seen in an answer."""
        self.vocab_size = vocab_size
        self.max_block = max_block
        self._lock = threading.Lock()  # replicas, sequences, stats
        self._rng = random.Random(secrets.randbits(64))  # placement ties: see the module docstring
        self._replicas: dict[str, _Replica] = {}
        self._resolved: dict[str, list[str]] = {}  # configured address -> replica addresses
        self._resolved_at = float("-inf")
        self._seqs: dict[int, _Sequence] = {}  # engine seq id -> its wire id and replica
        self._steps = itertools.count(1)
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="drafter-pool")
        self._prepare()
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
        """One block per request, in order (parts on different replicas run concurrently)."""
        return self._run(requests, self._draft_part)

    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        """Candidate blocks keyed by outcome (k, c) per request, in order."""
        return self._run(requests, self._speculate_part)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence here and on its replica. Never raises: a replica that
        cannot be told evicts the sequence on its own (LRU)."""
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None or seq.replica is None:
                return
            replica = seq.replica
            replica.num_seqs -= 1
        try:
            with replica.lock:
                if replica.stub is not None:
                    replica.stub.Release(drafter_pb2.ReleaseRequest(seq_ids=[seq.wire_id]), timeout=self.timeout)
        except grpc.RpcError as err:
            self._mark_dead(replica, f"Release failed: {err.code().name}: {err.details()}")

    def close(self) -> None:
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

    # ------------------------------------------------------------------ one call
    def _run(self, requests: list[Request], part_fn: Callable[[_Replica, list[int], list[Request]], dict[int, T]]) -> list[T]:
        """Split by replica, run the parts concurrently, retry failed parts once elsewhere."""
        if not requests:
            return []
        self._prepare()
        results: dict[int, T] = {}
        pending = list(range(len(requests)))
        errors: list[str] = []
        for attempt in range(2):
            parts = self._split(pending, requests, errors)
            if len(parts) == 1:
                ((replica, part),) = parts.items()
                outcomes = [(replica, part, self._attempt(part_fn, replica, part, requests))]
            else:
                futures = [
                    (replica, part, self._executor.submit(self._attempt, part_fn, replica, part, requests))
                    for replica, part in parts.items()
                ]
                outcomes = [(replica, part, future.result()) for replica, part, future in futures]
            pending = []
            for replica, part, outcome in outcomes:
                if isinstance(outcome, ValueError):
                    raise outcome
                if isinstance(outcome, _ReplicaFailed):
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

    def _attempt(self, part_fn, replica: _Replica, part: list[int], requests: list) -> dict | Exception:
        """Run one part; its failure is returned, so every part finishes before the call decides."""
        try:
            return part_fn(replica, part, requests)
        except (ValueError, _ReplicaFailed) as err:
            return err

    def _split(self, indices: list[int], requests: Sequence[Request], errors: list[str]) -> dict[_Replica, list[int]]:
        """Assign unplaced sequences (fewest live sequences first) and group indices by replica."""
        now = time.monotonic()
        parts: dict[_Replica, list[int]] = {}
        with self._lock:
            live = [r for r in self._replicas.values() if r.checked and r.dead_until <= now]
            if not live:
                why = "; ".join(errors) or "every replica is down or not yet checked"
                raise DrafterUnavailable(f"no drafter replica is reachable ({why}); addresses: {', '.join(self.addresses)}")
            for i in indices:
                seq = self._seqs.get(requests[i].seq_id)
                if seq is None:
                    seq = self._seqs[requests[i].seq_id] = _Sequence(wire_id=secrets.randbits(63))
                if seq.replica not in live:
                    if seq.replica is not None:
                        seq.replica.num_seqs -= 1
                    fewest = min(r.num_seqs for r in live)
                    seq.replica = self._rng.choice([r for r in live if r.num_seqs == fewest])
                    seq.replica.num_seqs += 1
                    seq.sent = 0
                parts.setdefault(seq.replica, []).append(i)
        return parts

    def _context(self, replica: _Replica, request: DraftRequest | SpeculateRequest) -> drafter_pb2.SequenceContext:
        """The request's context as a delta from what ``replica`` holds."""
        with self._lock:
            seq = self._seqs[request.seq_id]
            start = seq.sent if seq.replica is replica and seq.sent <= len(request.context) else 0
        return drafter_pb2.SequenceContext(
            seq_id=seq.wire_id, context_start=start, tokens=request.context[start:], params=params_to_proto(request.params)
        )

    def _answered(self, replica: _Replica, sent: Sequence[DraftRequest | SpeculateRequest],
                  response: drafter_pb2.DraftResponse | drafter_pb2.SpeculateResponse, seconds: float) -> list:
        """Record an answer (what the replica now holds, its version, the transport's share of
        the ``seconds`` the call took); returns the requests it wants resent."""
        again = []
        resend = set(response.resend)
        with self._lock:
            self.stats.num_round_trips += 1
            self.stats.server_seconds += response.server_seconds
            self.stats.transport_seconds += max(0.0, seconds - response.server_seconds)
            self.version = response.drafter_version or self.version
            for request in sent:
                seq = self._seqs[request.seq_id]
                if seq.wire_id in resend:
                    seq.sent = 0
                    again.append(request)
                elif seq.replica is replica:
                    seq.sent = len(request.context)
            self.stats.num_resends += len(again)
        return again

    # ------------------------------------------------------------------ parts
    def _draft_part(self, replica: _Replica, part: list[int], requests: Sequence[DraftRequest]) -> dict[int, DraftBlock]:
        def send(batch: list[DraftRequest]) -> tuple[drafter_pb2.DraftResponse, list]:
            message = drafter_pb2.DraftRequest(items=[
                drafter_pb2.DraftItem(context=self._context(replica, r), block_size=r.block_size) for r in batch
            ])
            try:
                response = replica.connect().Draft(message, timeout=self.timeout)
            except grpc.RpcError as err:
                raise _verdict(replica, err) from err
            return response, list(response.blocks)

        with replica.lock:
            return self._exchange(replica, part, requests, send, lambda request, block: _block(replica, block))

    def _speculate_part(
        self, replica: _Replica, part: list[int], requests: Sequence[SpeculateRequest]
    ) -> dict[int, dict[Outcome, DraftBlock]]:
        def send(batch: list[SpeculateRequest]) -> tuple[drafter_pb2.SpeculateResponse, list]:
            message = drafter_pb2.SpeculateRequest(step=next(self._steps), items=[
                drafter_pb2.SpeculateItem(
                    context=self._context(replica, r), block=r.block, block_size=r.block_size, budget=r.budget
                )
                for r in batch
            ])
            if replica.stream is None:
                replica.stream = _SpeculateStream(replica.connect(), replica.address)
            response = replica.stream.exchange(message, self.timeout)
            return response, list(response.sequences)

        with replica.lock:
            try:
                return self._exchange(replica, part, requests, send,
                                      lambda request, sequence: self._candidates(replica, request, sequence))
            except grpc.RpcError as err:
                self._drop_stream(replica)
                raise _verdict(replica, err) from err
            except (_ReplicaFailed, ValueError):
                self._drop_stream(replica)
                raise

    def _exchange(self, replica: _Replica, part: list[int], requests: Sequence, send, convert) -> dict:
        """Send ``part`` of ``requests`` (under the replica's lock) until the replica holds every
        context: what it asks for in ``resend`` goes again, whole; a second ask is a failure.
        ``send(batch) -> (response, answers)`` with one answer per request, ``convert`` maps one."""
        results = {}
        pending = {requests[i].seq_id: i for i in part}
        full = False
        while pending:
            batch = [requests[i] for i in pending.values()]
            sent_at = time.perf_counter()
            response, answers = send(batch)
            if len(answers) != len(batch):
                raise _ReplicaFailed(f"{replica.address}: {len(answers)} answers for {len(batch)} items")
            again = self._answered(replica, batch, response, time.perf_counter() - sent_at)
            resent = {r.seq_id for r in again}
            for request, answer in zip(batch, answers):
                if request.seq_id not in resent:
                    results[pending[request.seq_id]] = convert(request, answer)
            if again and full:
                raise _ReplicaFailed(f"{replica.address}: asked to resend contexts that were sent in full")
            pending = {r.seq_id: pending[r.seq_id] for r in again}
            full = True  # _answered reset `sent`, so a follow-up carries whole contexts
        return results

    def _candidates(
        self, replica: _Replica, request: SpeculateRequest, sequence: drafter_pb2.SequenceCandidates
    ) -> dict[Outcome, DraftBlock]:
        with self._lock:
            wire_id = self._seqs[request.seq_id].wire_id
        if sequence.seq_id != wire_id:
            raise _ReplicaFailed(f"{replica.address}: answered seq {sequence.seq_id} for seq {wire_id}")
        if sequence.base_len != len(request.context):
            return {}  # stale: drafted for another context length
        return {(c.accepted, c.token): _block(replica, c.block) for c in sequence.candidates}

    # ------------------------------------------------------------------ replicas
    def _prepare(self) -> None:
        """Re-resolve names when due, and check (Info) replicas that are due to be tried."""
        now = time.monotonic()
        if now - self._resolved_at >= self.retry_seconds:
            self._refresh_addresses()
            self._resolved_at = now
        with self._lock:
            unchecked = [
                r for r in self._replicas.values() if not r.checked and not r.incompatible and r.dead_until <= now
            ]
        if len(unchecked) == 1:
            self._check(unchecked[0])
        elif unchecked:
            list(self._executor.map(self._check, unchecked))

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

    def _mark_dead(self, replica: _Replica, why: str) -> None:
        """Out of use for ``retry_seconds``; its sequences move (with full contexts) on next use."""
        logger.warning("drafter replica %s is down for %.1fs: %s", replica.address, self.retry_seconds, why)
        with self._lock:
            self.stats.num_replica_failures += 1
            replica.dead_until = time.monotonic() + self.retry_seconds
            replica.checked = False  # Info again before its next use
            self._unplace(replica)
            self._resolved_at = float("-inf")  # re-resolve names on the next call
        with replica.lock:  # never held here by this thread: parts return before failing over
            replica.disconnect()

    def _drop_stream(self, replica: _Replica) -> None:
        if replica.stream is not None:
            replica.stream.close()
            replica.stream = None

    def _unplace(self, replica: _Replica) -> None:
        """Move every sequence off ``replica`` (under the lock)."""
        for seq in self._seqs.values():
            if seq.replica is replica:
                seq.replica, seq.sent = None, 0
        replica.num_seqs = 0


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
