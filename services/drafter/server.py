"""The drafter service: one `D3DDrafter` behind ``specd.v1.Drafter``.

Design choices:

- **Contexts are the service's, caches are the drafter's.** The servicer keeps each sequence's
  committed context (token ids) under its ``seq_id``; a request carries only the new tail
  (``SequenceContext.context_start`` + ``tokens``). When the replica does not hold the first
  ``context_start`` tokens (it never saw the sequence, evicted it, or restarted) it names the
  sequence in ``resend`` and the verifier sends the whole context again. Seq ids are unique
  across verifiers (they draw them at random, 63-bit), so one replica serves many verifiers.
- **At most ``max_num_seqs`` sequences**, least recently used evicted first (its cache row is
  released); an evicted sequence costs one resend, never a failed call.
- **One packed pass at a time.** One lock covers the contexts and the drafter: a Draft call is one
  `D3DDrafter.draft` over all its items, each Speculate message one `D3DDrafter.speculate`.
  Concurrent callers queue on the lock (merging their passes is future work). Each verifier
  keeps one Speculate stream open, which holds one of the server's worker threads. Every pass
  computes on one compute thread whichever request thread asked (`specd.threads`); a Speculate
  pass, which runs beside the verifier's pass, on ``--speculate-threads`` where the two share a
  machine, a Draft (the verifier waits for it) on ``--threads``.
- **Weight swaps without dropping anything.** `DrafterServicer.swap_weights` loads the new
  checkpoint outside the lock, then swaps in a fresh `D3DDrafter` under it. The old drafter's KV
  caches belong to the old weights, so they go; the stored contexts stay, so the next call of each
  sequence re-prefills from its full context transparently (its candidates miss once). A checkpoint
  that does not load, or is not a compatible D3D drafter, is refused and the old weights keep
  serving. `services.drafter.weights.WeightWatcher` drives swaps from the trainer's versions:
  pulled with GetCheckpoint (``--weight-transport pull``, the default), or received from the
  trainer's torch.distributed broadcast with pulling as the fallback (``broadcast``; see
  `services.common.broadcast`).
- **Bad input is INVALID_ARGUMENT** with the item and the reason; the replica keeps serving. Calls
  before the weights are loaded are UNAVAILABLE (health is NOT_SERVING until then).
- **SIGTERM ends the open Speculate streams** (`DrafterServicer.drain`): an idle one at once, one
  answering a message right after that answer. A verifier holds its stream open for good, so
  otherwise every drain would last the full ``drain_seconds`` and then cut the stream wherever it
  was; this way the verifier fails over to another replica at once and the drafter exits as soon
  as its passes are done. A stop signal is a drain from the moment health says SERVING.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import grpc
import prometheus_client
import redis
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.broadcast import ANNOUNCEMENT_KEY, REGISTRY_KEY, Membership, default_replica_id
from services.common.config import ServiceConfig, parse_config
from services.common.server import GrpcServer, abort, open_channel
from services.common.telemetry import get_tracer, start_metrics_server
from services.common.wire import block_to_proto, params_from_proto
from services.drafter.weights import WeightWatcher
from specd import precision
from specd._proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, trainer_pb2_grpc
from specd.drafters.base import DraftRequest, SpeculateRequest, check_block_size
from specd.drafters.d3d import D3DDrafter
from specd.models.attention import BACKENDS
from specd.models.d3d import D3DModel
from specd.models.loading import ModelLoadError, load_model
from specd.sampling import SamplingParams
from specd.threads import ComputeThread, release_pool

logger = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "specd.v1.Drafter"

T = TypeVar("T")


@dataclass(kw_only=True)
class DrafterConfig(ServiceConfig):
    """A D3D drafter replica (flags --kebab-name, environment SPECD_<NAME>)."""

    model: str = field(metadata={"help": "directory of a D3D drafter checkpoint (Hugging Face layout)"})
    port: int = field(default=50052, metadata={"help": "gRPC port (0 = a free one)"})
    max_num_seqs: int = field(
        default=64, metadata={"help": "sequences held at once (cache rows); the least recently used is evicted"}
    )
    max_budget: int = field(default=32, metadata={"help": "most outcomes (k, c) one Speculate item may ask for"})
    device: str = field(default="cpu", metadata={"help": "torch device of the drafter (cpu, cuda, cuda:1, ...)"})
    attention_backend: str = field(default="auto", metadata={
        "help": "how attention runs: auto (flash-attn on CUDA when installed, else sdpa), sdpa, flex, flash, triton"})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads (0 = torch's default, from OMP_NUM_THREADS)"})
    speculate_threads: int = field(default=0, metadata={
        "help": "intra-op threads of a Speculate pass, which runs beside the verifier's pass on a shared machine "
                "(0 = --threads); Draft calls, which the verifier waits for, keep --threads"})
    dtype: str = field(default="auto", metadata={
        "help": "the drafter's dtype: auto (bf16 on a CPU that computes it natively, else the checkpoint's), checkpoint, float32, bfloat16"})
    trainer: str = field(default="", metadata={"help": "trainer address for GetCheckpoint (empty = no weight updates)"})
    redis_url: str = field(
        default="", metadata={"help": "Redis holding the live drafter version, e.g. redis://redis:6379/0 (empty = none)"}
    )
    version: str = field(default="initial", metadata={"help": "version name of the weights in --model"})
    version_key: str = field(
        default="specd:drafter:live", metadata={"help": 'Redis key of the live version: {"version": ..., "sha256": {file: hex}}'}
    )
    version_channel: str = field(
        default="specd:drafter:updates", metadata={"help": "Redis pub/sub channel hinting that the live version changed"}
    )
    poll_seconds: float = field(default=5.0, metadata={"help": "re-read the live version this often (pub/sub is only a hint)"})
    checkpoint_dir: str = field(
        default="",
        metadata={"help": "the drafter's own directory for fetched versions; older ones in it are deleted (empty = a temporary one)"},
    )
    weight_transport: str = field(
        default="pull",
        metadata={"help": "pull: fetch new versions with GetCheckpoint; broadcast: also join the trainer's "
                          "torch.distributed broadcasts (pulling stays the fallback)"},
    )
    replica_id: str = field(
        default_factory=default_replica_id,
        metadata={"help": "this replica's unique id in the broadcast registry (default hostname-pid-random)"},
    )
    broadcast_registry: str = field(
        default=REGISTRY_KEY, metadata={"help": "Redis sorted set where replicas accepting broadcasts heartbeat"}
    )
    broadcast_key: str = field(
        default=ANNOUNCEMENT_KEY, metadata={"help": "Redis key of the trainer's broadcast announcement"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise ValueError("model is empty: give --model DIR (a D3D drafter checkpoint directory)")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_budget < 0:
            raise ValueError(f"max_budget must be >= 0, got {self.max_budget}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        if self.speculate_threads < 0:
            raise ValueError(f"speculate_threads must be >= 0 (0 = --threads), got {self.speculate_threads}")
        if bool(self.trainer) != bool(self.redis_url):
            raise ValueError(
                "weight updates need both --trainer (where to fetch versions) and --redis-url (which "
                f"version is live); got trainer={self.trainer!r}, redis_url={self.redis_url!r}"
            )
        if self.poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be > 0, got {self.poll_seconds}")
        if self.weight_transport not in ("pull", "broadcast"):
            raise ValueError(f"weight_transport must be pull or broadcast, got {self.weight_transport!r}")
        if self.weight_transport == "broadcast" and not self.trainer:
            raise ValueError("--weight-transport broadcast needs --trainer and --redis-url (the registry, the "
                             "announcements, and the pull fallback)")
        if not self.replica_id:
            raise ValueError("replica_id is empty: leave it unset for a generated one, or give a unique name")

    def membership(self) -> Membership | None:
        """How this replica takes part in broadcasts; None when it only pulls."""
        if self.weight_transport != "broadcast":
            return None
        return Membership(replica_id=self.replica_id, device=self.device, registry_key=self.broadcast_registry,
                          announcement_key=self.broadcast_key)


class DrafterMetrics:
    """The drafter's Prometheus metrics (vLLM-style names with a ``specd:`` prefix).

    ``registry`` is the process's default one in ``main``; tests give each servicer its own so
    several servicers can live in one process.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = CollectorRegistry() if registry is None else registry
        self.passes = Counter("specd:drafter_passes", "Packed drafter passes (one per Draft call or Speculate message)", registry=registry)
        self.pass_seconds = Histogram("specd:drafter_pass_seconds", "Seconds per packed drafter pass", registry=registry)
        self.sequences = Gauge("specd:drafter_sequences", "Sequences whose context this replica holds", registry=registry)
        self.weight_version = Gauge(
            "specd:drafter_weight_version", "1 for the weight version this replica serves", ["version"], registry=registry
        )
        self.weight_swaps = Counter("specd:drafter_weight_swaps", "Weight versions swapped in while serving", registry=registry)
        self.weight_refused = Counter(
            "specd:drafter_weight_refused", "Weight versions refused (failed sha256 verification or loading)", registry=registry
        )
        self.weight_pulls = Counter("specd:drafter_weight_pulls", "Weight versions fetched with GetCheckpoint", registry=registry)
        self.weight_broadcasts = Counter(
            "specd:drafter_weight_broadcasts", "Weight versions received by torch.distributed broadcast", registry=registry
        )
        self.weight_broadcast_failures = Counter(
            "specd:drafter_weight_broadcast_failures",
            "Broadcasts this replica joined that did not install (pulled instead), by reason: sha256 or transfer",
            ["reason"], registry=registry,
        )
        self.evictions = Counter("specd:drafter_evictions", "Sequences evicted (least recently used) to make room", registry=registry)
        self.resends = Counter("specd:drafter_resends", "Sequences the verifier was asked to resend in full", registry=registry)


@dataclass(kw_only=True, slots=True)
class _Item:
    """One checked item of a Draft or Speculate request (the context still a delta)."""

    seq_id: int
    context_start: int
    tokens: list[int]  # the context from context_start on
    params: SamplingParams
    block_size: int
    block: list[int] = field(default_factory=list)  # Speculate: the block under verification
    budget: int = 0  # Speculate: outcomes to draft for


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specd.v1.Drafter`` over one `D3DDrafter` (see the module docstring).

    Weights are installed with `swap_weights` (the first call loads them; until then every call is
    UNAVAILABLE).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int = 64,
        max_budget: int = 32,
        device: str | torch.device = "cpu",
        attention_backend: str = "auto",
        dtype: str = "checkpoint",
        metrics: DrafterMetrics | None = None,
        speculate_threads: int = 0,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_budget = max_budget
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        self.dtype = precision.resolve_drafter_dtype(dtype, self.device)  # raises on a bad setting
        self.metrics = metrics or DrafterMetrics()
        self.drafter: D3DDrafter | None = None
        self.version = ""
        self._contexts: OrderedDict[int, list[int]] = OrderedDict()  # seq_id -> context, least recent first
        self._lock = threading.Lock()
        # Open Speculate streams -> whether one is answering a message now (`drain` ends them).
        self._streams: dict[grpc.ServicerContext, bool] = {}
        self._streams_lock = threading.Lock()
        self._draining = False
        self._tracer = get_tracer(__name__)
        # Passes arrive on many request threads but compute on this one: one OpenMP pool per
        # process keeps its workers spinning between ops (`specd.threads`).
        self._compute = ComputeThread("specd-drafter-compute")
        # A Speculate pass runs beside the verifier's pass; where the two share a machine it gets
        # its share of the cores, and a Draft (the verifier waits for it) the process's threads.
        self._speculate_threads = speculate_threads
        self._draft_threads = torch.get_num_threads()

    # ------------------------------------------------------------------ weights
    def swap_weights(self, directory: str | Path, version: str) -> None:
        """Serve the D3D checkpoint in ``directory`` as ``version`` from the next pass on.

        Loading happens outside the lock (passes go on meanwhile); the swap itself drops the old
        drafter's caches but keeps every sequence's context (module docstring). ModelLoadError
        (a ValueError), logged and counted as refused, when the checkpoint does not load or does
        not fit the weights being served; the old weights then stay.
        """
        try:
            model = load_model(directory, device=self.device, attention_backend=self.attention_backend,
                               dtype=self.dtype)
            self._check_compatible(model, directory)
            drafter = D3DDrafter(model, max_num_seqs=self.max_num_seqs, device=self.device)
        except ModelLoadError as err:
            self.metrics.weight_refused.inc()
            logger.error("refusing drafter version %r from %s: %s; still serving %r", version, directory, err, self.version)
            raise
        finally:
            release_pool()  # loading computed on this thread: only the compute thread keeps a pool
        with self._lock:
            first = self.drafter is None
            self.drafter, self.version = drafter, version
        self.metrics.weight_version.clear()
        self.metrics.weight_version.labels(version=version).set(1)
        if not first:
            self.metrics.weight_swaps.inc()
        logger.info("drafter serving version %r from %s", version, directory)

    def _check_compatible(self, model: object, directory: str | Path) -> None:
        if not isinstance(model, D3DModel) or model.config.target_hidden_size:
            raise ModelLoadError(
                f"{directory} holds a {type(model).__name__}, not a D3D drafter (a D3DModel that reads no "
                "target hidden states): point the drafter service at a D3D checkpoint"
            )
        current = self.drafter
        if current is None:
            return
        new_max_block = max(model.config.group_sizes) - 1
        if (model.config.vocab_size, new_max_block) != (current.vocab_size, current.max_block):
            raise ModelLoadError(
                f"{directory}: vocab_size {model.config.vocab_size} / max_block {new_max_block} differ from the "
                f"served {current.vocab_size} / {current.max_block}; verifiers rely on both, so a new version must keep them"
            )

    @property
    def num_sequences(self) -> int:
        """Sequences whose context this replica holds."""
        with self._lock:
            return len(self._contexts)

    # ------------------------------------------------------------------ RPCs
    def Draft(self, request: drafter_pb2.DraftRequest, context: grpc.ServicerContext) -> drafter_pb2.DraftResponse:
        received = time.perf_counter()
        drafter = self._serving(context)
        with _bad_input_is_invalid_argument(context):
            items = [
                self._parse(i, item.context if item.HasField("context") else None, item.block_size, drafter)
                for i, item in enumerate(request.items)
            ]
        self._check_batch(items, context)
        with self._lock:
            drafter = self._serving(context)
            contexts = self._admit(items)
            live = [(item, tokens) for item, tokens in zip(items, contexts) if tokens is not None]
            requests = [
                DraftRequest(seq_id=item.seq_id, context=tokens, block_size=item.block_size, params=item.params)
                for item, tokens in live
            ]
            drafted = self._pass("draft", lambda: drafter.draft(requests), len(requests)) if requests else []
            blocks = iter(drafted)
            version = self.version
        return drafter_pb2.DraftResponse(
            blocks=[block_to_proto(next(blocks)) if tokens is not None else common_pb2.DraftBlock() for tokens in contexts],
            resend=[item.seq_id for item, tokens in zip(items, contexts) if tokens is None],
            drafter_version=version, server_seconds=time.perf_counter() - received,
        )

    def Speculate(
        self, request_iterator: Iterator[drafter_pb2.SpeculateRequest], context: grpc.ServicerContext
    ) -> Iterator[drafter_pb2.SpeculateResponse]:
        with self._streams_lock:
            if self._draining:
                return  # opened just before the drain gate closed: end it like the others
            self._streams[context] = False
        try:
            for request in request_iterator:
                with self._streams_lock:
                    self._streams[context] = True
                yield self._speculate(request, context)  # resumes once the answer is sent
                with self._streams_lock:
                    self._streams[context] = False
                    if self._draining:
                        return
        finally:
            with self._streams_lock:
                self._streams.pop(context, None)

    def drain(self) -> None:
        """Shutting down: end every open Speculate stream, an idle one now (cancelled: its
        verifier fails over), a busy one once its current answer is sent (module docstring)."""
        with self._streams_lock:
            self._draining = True
            idle = [context for context, busy in self._streams.items() if not busy]
        for context in idle:
            context.cancel()  # wakes the handler waiting for the next message

    def _speculate(self, request: drafter_pb2.SpeculateRequest, context: grpc.ServicerContext) -> drafter_pb2.SpeculateResponse:
        received = time.perf_counter()
        drafter = self._serving(context)
        with _bad_input_is_invalid_argument(context):
            items = []
            for i, message in enumerate(request.items):
                item = self._parse(i, message.context if message.HasField("context") else None, message.block_size, drafter)
                item.block, item.budget = list(message.block), message.budget
                self._check_block(i, item, drafter)
                items.append(item)
        self._check_batch(items, context)
        with self._lock:
            drafter = self._serving(context)
            contexts = self._admit(items)
            requests = [
                SpeculateRequest(
                    seq_id=item.seq_id, context=tokens, block=item.block, block_size=item.block_size,
                    budget=item.budget, params=item.params,
                )
                for item, tokens in zip(items, contexts)
                if tokens is not None
            ]
            speculated = self._pass("speculate", lambda: drafter.speculate(requests), len(requests)) if requests else []
            results = iter(speculated)
            version = self.version
        response = drafter_pb2.SpeculateResponse(step=request.step, drafter_version=version)
        for item, tokens in zip(items, contexts):
            sequence = response.sequences.add(seq_id=item.seq_id)
            if tokens is None:
                response.resend.append(item.seq_id)
                continue
            sequence.base_len = len(tokens)
            for (accepted, token), block in next(results).items():
                sequence.candidates.add(accepted=accepted, token=token, block=block_to_proto(block))
        response.server_seconds = time.perf_counter() - received
        return response

    def Release(self, request: drafter_pb2.ReleaseRequest, context: grpc.ServicerContext) -> drafter_pb2.ReleaseResponse:
        with self._lock:
            for seq_id in request.seq_ids:
                self._forget(seq_id)
            self.metrics.sequences.set(len(self._contexts))
        return drafter_pb2.ReleaseResponse()

    def Info(self, request: drafter_pb2.InfoRequest, context: grpc.ServicerContext) -> drafter_pb2.InfoResponse:
        with self._lock:
            drafter = self._serving(context)
            return drafter_pb2.InfoResponse(
                vocab_size=drafter.vocab_size, max_block=drafter.max_block,
                drafter_version=self.version, max_num_seqs=self.max_num_seqs,
            )

    # ------------------------------------------------------------------ helpers
    def _serving(self, context: grpc.ServicerContext) -> D3DDrafter:
        drafter = self.drafter
        if drafter is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "the drafter is still loading its weights: wait for health SERVING")
        return drafter

    def _parse(
        self, index: int, sequence: drafter_pb2.SequenceContext | None, block_size: int, drafter: D3DDrafter
    ) -> _Item:
        """Check one item's context and block size; ValueError saying which item and what is wrong."""
        if sequence is None:
            raise ValueError(f"item {index} has no context: every item needs a SequenceContext")
        where = f"item {index} (seq {sequence.seq_id})"
        if not sequence.HasField("params"):
            raise ValueError(f"{where} has no params: send the request's SamplingParams with every item")
        tokens = list(sequence.tokens)
        if sequence.context_start == 0 and not tokens:
            raise ValueError(f"{where}: the context is empty; send at least the prompt's tokens")
        _check_ids(tokens, drafter.vocab_size, f"{where}: context")
        try:
            check_block_size(block_size, drafter.max_block)
            params = params_from_proto(sequence.params)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        return _Item(
            seq_id=sequence.seq_id, context_start=sequence.context_start, tokens=tokens, params=params, block_size=block_size
        )

    def _check_block(self, index: int, item: _Item, drafter: D3DDrafter) -> None:
        where = f"item {index} (seq {item.seq_id})"
        if len(item.block) > drafter.max_block:
            raise ValueError(f"{where}: the block under verification has {len(item.block)} tokens, above max_block {drafter.max_block}")
        _check_ids(item.block, drafter.vocab_size, f"{where}: block")
        if item.budget > self.max_budget:
            raise ValueError(f"{where}: budget {item.budget} is above this replica's max_budget {self.max_budget}")

    def _check_batch(self, items: Sequence[_Item], context: grpc.ServicerContext) -> None:
        seen: set[int] = set()
        for item in items:
            if item.seq_id in seen:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"seq {item.seq_id} appears twice in one request: send each sequence once")
            seen.add(item.seq_id)
        if len(items) > self.max_num_seqs:
            abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"one request names {len(items)} sequences but this replica holds at most {self.max_num_seqs}: "
                "split the request over replicas or raise --max-num-seqs",
            )

    def _admit(self, items: Sequence[_Item]) -> list[list[int] | None]:
        """Each item's full context, or None when it must be resent; stores the contexts (LRU).

        Called under the lock. Evicts the least recently used sequences not in this request
        until everything fits in ``max_num_seqs``.
        """
        contexts: list[list[int] | None] = []
        for item in items:
            held = self._contexts.get(item.seq_id)
            if item.context_start == 0:
                contexts.append(item.tokens)
            elif held is not None and len(held) >= item.context_start:
                contexts.append(held[: item.context_start] + item.tokens)
            else:
                contexts.append(None)
        wanted = {item.seq_id for item, tokens in zip(items, contexts) if tokens is not None}
        num_new = len(wanted - self._contexts.keys())
        while len(self._contexts) + num_new > self.max_num_seqs:
            victim = next(seq_id for seq_id in self._contexts if seq_id not in wanted)
            self._forget(victim)
            self.metrics.evictions.inc()
        for item, tokens in zip(items, contexts):
            if tokens is not None:
                self._contexts[item.seq_id] = tokens
                self._contexts.move_to_end(item.seq_id)
        num_resend = len(items) - len(wanted)
        if num_resend:
            self.metrics.resends.inc(num_resend)
        self.metrics.sequences.set(len(self._contexts))
        return contexts

    def _forget(self, seq_id: int) -> None:
        """Drop a sequence's context and its drafter cache row (under the lock)."""
        self._contexts.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.release(seq_id)

    def _pass(self, kind: str, run: Callable[[], T], num_seqs: int) -> T:
        span = self._tracer.start_as_current_span(f"drafter.{kind}", attributes={"specd.num_seqs": num_seqs})
        threads = self._speculate_threads if kind == "speculate" and self._speculate_threads else self._draft_threads

        def on_threads() -> T:  # on the compute thread, the only one computing: the setting is its own
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            return run()

        with span, self.metrics.pass_seconds.time():
            result = self._compute.run(on_threads)
        self.metrics.passes.inc()
        return result


def _check_ids(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        raise ValueError(f"{what} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


@contextmanager
def _bad_input_is_invalid_argument(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except ValueError as err:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))


# ---------------------------------------------------------------------- process entry point
def main(argv: Sequence[str] | None = None) -> None:
    """Serve one drafter replica until SIGTERM (health NOT_SERVING until the weights are loaded)."""
    config = parse_config(DrafterConfig, argv, prog="python -m services.drafter")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    servicer = DrafterServicer(
        max_num_seqs=config.max_num_seqs, max_budget=config.max_budget, device=config.device,
        attention_backend=config.attention_backend, dtype=config.dtype, metrics=DrafterMetrics(prometheus_client.REGISTRY),
        speculate_threads=config.speculate_threads,
    )
    # Each open Speculate stream (one per verifier) holds a worker thread for its lifetime.
    server = GrpcServer("specd-drafter", config, max_workers=256)  # also sets up tracing
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server.server)
    port = server.start([SERVICE_NAME])
    if config.metrics_port >= 0:
        logger.info("metrics on :%d/metrics", start_metrics_server(config.metrics_port))
    try:
        servicer.swap_weights(config.model, config.version)
    except ModelLoadError as err:
        server.stop(None)
        raise SystemExit(f"drafter: cannot serve --model {config.model}: {err}") from None
    with tempfile.TemporaryDirectory(prefix="specd-drafter-") as scratch:
        watcher = None
        if config.trainer:
            watcher = WeightWatcher(
                servicer,
                redis.Redis.from_url(config.redis_url),
                trainer_pb2_grpc.TrainerStub(open_channel(config.trainer, config)),
                directory=Path(config.checkpoint_dir or scratch),
                key=config.version_key,
                channel=config.version_channel,
                poll_seconds=config.poll_seconds,
                refused=servicer.metrics.weight_refused,
                broadcast=config.membership(),
                pulls=servicer.metrics.weight_pulls,
                broadcasts=servicer.metrics.weight_broadcasts,
                broadcast_failures=servicer.metrics.weight_broadcast_failures,
            )
            watcher.start()

        def on_drain() -> None:
            servicer.drain()
            if watcher is not None:
                watcher.stop()

        def drain() -> None:  # as wait_for_termination's: one drain_seconds budget in all
            start = time.monotonic()
            on_drain()
            server.stop(max(1.0, config.drain_seconds - (time.monotonic() - start)))

        # From SERVING until wait_for_termination installs its handlers, a stop signal drains too:
        # Python's default would kill the process under its callers.
        def drain_early(signum: int, frame: object) -> None:
            threading.Thread(target=drain, name="specd-drafter-drain").start()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, drain_early)
        server.set_serving()
        print(f"drafter serving on {config.host}:{port} (version {servicer.version})", flush=True)
        server.wait_for_termination(on_drain=on_drain)
        if watcher is not None:
            watcher.stop()
