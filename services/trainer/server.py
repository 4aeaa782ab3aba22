"""The SpecOPD trainer service: live traces in, gated drafter versions out.

A loop thread consumes the trace stream (`services.trainer.stream.TraceStream`, a Redis consumer
group) into a `specd.train.online.OnlineLearner`, which decides everything else:

1. an entry that does not parse goes to the dead-letter stream (and is acknowledged); a trace
   already trained into these weights is skipped; about one in ``heldout_every`` is held out;
   the rest queue up into batches;
2. each full batch is one SpecOPD step. The target's side runs on the verifiers
   (`services.trainer.scorer.RemoteScorer`, ``--verifiers``) or on a local target (``--target``).
   No verifier reachable: the batch waits and is retried; the traces stay unacknowledged;
3. every ``steps_per_version`` steps: save the online checkpoint, THEN acknowledge every trace in
   it (never before: a crash in between redelivers traces the checkpoint already holds, and the
   learner skips them; the failpoint ``trainer.after_checkpoint`` sits in that window, so a fault
   test can ``kill -9`` the trainer there: `services.common.failpoints`), then gate the weights
   on the held-out traces. A candidate that passes is written under
   ``checkpoint_dir/versions/<version>``, ``version_key`` is SET to ``{"version", "sha256":
   {file: hex}}`` and a hint is PUBLISHed on ``version_channel``; drafters pull it with
   ``GetCheckpoint``. A refused one is counted.
   With ``--weight-transport broadcast``, before the key is set the version's files are
   broadcast over torch.distributed to the drafter replicas registered for it
   (`services.common.broadcast`: announcement key + hint, a process group for this update only);
   whatever goes wrong there is logged and counted, the key is set all the same, and drafters
   that did not get the files pull them.

SIGTERM: the gRPC server drains, the loop finishes its current step, saves, acknowledges and exits
(through the same `TrainerService.checkpoint`, failpoint included). Each checkpoint records which
trace ids it took in (`specd.train.online.read_ledger` reads that lineage from disk).
One trainer replica owns a lineage of drafter weights; the consumer group is what lets a replaced
pod (a new consumer name) take over its predecessor's unacknowledged traces (``claim_idle_ms``).

``--data-parallel N`` trains the drafter on N ranks with FSDP2 (`specd.train.online_parallel`),
launched as ``torchrun --nproc-per-node N --standalone -m services.trainer --data-parallel N ...``
(each rank on ``cuda:LOCAL_RANK`` with NCCL, or on the CPU with gloo). Rank 0 is everything above;
each step's batch goes to every rank, rank 0 scores all ranks' proposal trees in one call, the
checkpoint is DCP from every rank (traces acknowledged after it), and the gate and publishing use
the full weights gathered on rank 0. The other ranks ignore SIGTERM and leave on rank 0's STOP,
which it sends after its last save (`services.trainer.parallel`). A checkpoint directory keeps
the kind it was started with (one process: ``state.pt``; data-parallel: DCP, any N > 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import prometheus_client
import redis
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.broadcast import (
    ANNOUNCEMENT_KEY,
    REGISTRY_KEY,
    BroadcastError,
    VersionBroadcast,
    live_members,
)
from services.common.checkpoints import stream_checkpoint
from services.common.config import ServiceConfig, parse_config
from services.common.failpoints import configured as configured_failpoints
from services.common.failpoints import failpoint
from services.common.server import MAX_MESSAGE_BYTES, GrpcServer, abort
from services.common.telemetry import start_metrics_server
from services.trainer.parallel import run_follower, start_ranks
from services.trainer.scorer import RemoteScorer, ScoreError
from services.trainer.stream import Entry, TraceStream
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc
from specd.models.d3d import D3DModel
from specd.models.loading import ModelLoadError, load_model
from specd.threads import FairLock
from specd.train.data_parallel import exit_job
from specd.train.online import GateDecision, OnlineConfig, OnlineLearner, Published, Trace
from specd.train.online_parallel import Leader, ParallelOnlineLearner
from specd.train.specopd import LocalScorer, SpecOPDConfig, TreeScorer

logger = logging.getLogger(__name__)

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name  # "specd.v1.Trainer"


def _consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(kw_only=True)
class TrainerConfig(ServiceConfig):
    """The SpecOPD trainer: consumes the trace stream, publishes gated drafter versions."""

    port: int = field(default=50060, metadata={"help": "gRPC port (Status, GetCheckpoint)"})
    redis_url: str = field(metadata={"help": "Redis holding the trace stream and the live-version key, redis://host:6379/0"})
    drafter: str = field(metadata={"help": "initial drafter directory (config.json + model.safetensors)"})
    target: str = field(default="", metadata={"help": "local target directory for scoring; empty = score on --verifiers"})
    verifiers: list[str] = field(default_factory=list, metadata={
        "help": "verifier gRPC addresses for Score (comma list, round-robin with failover); one of --target/--verifiers"})
    top_k: int = field(default=0, metadata={"help": "Score with top-k log-probs instead of full distributions (0 = full)"})
    score_transport: str = field(default="grpc", metadata={
        "help": "grpc: Score answers carry the probabilities; tensor: full distributions come over a torch.distributed "
                "channel per verifier (NCCL with a CUDA --device, else gloo), plain gRPC whenever it fails"})
    score_channel_host: str = field(default="", metadata={
        "help": "address verifiers reach this trainer's Score channel stores on (empty = --host, or this machine's "
                "address when --host is a wildcard; in a pod, its IP)"})
    score_channel_timeout: float = field(default=30.0, metadata={
        "help": "seconds any one Score channel wait (joining, each transfer) may take before that call goes over gRPC"})
    stop_token_ids: list[int] = field(default_factory=list, metadata={
        "help": "the target's stop tokens with --verifiers (a branch supervises up to its first one); "
                "a local --target says its own"})
    checkpoint_dir: str = field(default="specd-trainer", metadata={
        "help": "online checkpoint (online/) and published versions (versions/)"})
    stream: str = field(default="specd:traces", metadata={"help": "Redis stream of request traces"})
    group: str = field(default="specd-trainer", metadata={"help": "consumer group on the trace stream"})
    consumer: str = field(default_factory=_consumer_name, metadata={"help": "consumer name in the group (default hostname-pid)"})
    dead_stream: str = field(default="specd:traces:dead", metadata={"help": "dead-letter stream for unusable entries"})
    claim_idle_ms: int = field(default=30000, metadata={
        "help": "reclaim entries other consumers left unacknowledged this long (XAUTOCLAIM min idle)"})
    max_deliveries: int = field(default=5, metadata={"help": "an entry delivered more often goes to the dead-letter stream"})
    block_ms: int = field(default=1000, metadata={"help": "longest wait for new traces per read (the loop's stop latency)"})
    version_key: str = field(default="specd:drafter:live", metadata={"help": "Redis key holding the live version JSON"})
    version_channel: str = field(default="specd:drafter:updates", metadata={"help": "pub/sub channel for new-version hints"})
    batch_size: int = field(default=4, metadata={"help": "traces per SpecOPD step"})
    steps_per_version: int = field(default=50, metadata={"help": "steps between checkpoints / gated candidate versions"})
    replay_traces: int = field(default=0, metadata={
        "help": "keep the newest N trained traces and, whenever the stream has nothing new, step on a batch drawn "
                "from them instead of waiting (0 = each trace trains once)"})
    heldout_every: int = field(default=20, metadata={"help": "about one trace in N (by trace id hash) is held out for the gate"})
    max_heldout: int = field(default=256, metadata={"help": "held-out traces kept (the newest)"})
    min_heldout: int = field(default=4, metadata={"help": "held-out traces needed before anything is published"})
    block_size: int = field(default=8, metadata={"help": "B: tokens per drafted branch (the block the drafters serve)"})
    anchors_per_seq: int = field(default=8, metadata={"help": "anchors per trace per step"})
    branches_per_anchor: int = field(default=4, metadata={"help": "K: branches sampled per anchor"})
    max_context: int = field(default=4096, metadata={"help": "longest trace trained on (prompt + output)"})
    loss: str = field(default="e2e-tv", metadata={"help": "e2e-tv, kl, tv or hybrid"})
    lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate"})
    seed: int = field(default=0, metadata={"help": "seeds anchors, branches and the gate"})
    device: str = field(default="cpu", metadata={"help": "torch device of the drafter being trained and a local target"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads (0 = torch's default)"})
    weight_transport: str = field(default="pull", metadata={
        "help": "pull: drafters fetch versions with GetCheckpoint; broadcast: also send each version over "
                "torch.distributed (NCCL with a CUDA --device, else gloo) to the replicas registered for it"})
    broadcast_host: str = field(default="", metadata={
        "help": "address drafters reach this trainer's broadcast store on (empty = --host, or this machine's "
                "address when --host is a wildcard; in a pod, its IP)"})
    broadcast_timeout: float = field(default=30.0, metadata={
        "help": "seconds a broadcast waits for the members to join and for each transfer step before "
                "giving up (drafters then pull)"})
    broadcast_registry: str = field(default=REGISTRY_KEY, metadata={
        "help": "Redis sorted set where drafter replicas accepting broadcasts heartbeat"})
    broadcast_key: str = field(default=ANNOUNCEMENT_KEY, metadata={"help": "Redis key of the broadcast announcement"})
    data_parallel: int = field(default=1, metadata={
        "help": "ranks the drafter is trained on (FSDP2, one global batch of --batch-size traces per step); > 1: "
                "launch as torchrun --nproc-per-node N --standalone -m services.trainer --data-parallel N ..., "
                "each rank on cuda:LOCAL_RANK (NCCL) with a CUDA --device, else on the CPU (gloo); rank 0 serves"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_transport not in ("pull", "broadcast"):
            raise ValueError(f"weight_transport must be pull or broadcast, got {self.weight_transport!r}")
        if self.score_transport not in ("grpc", "tensor"):
            raise ValueError(f"score_transport must be grpc or tensor, got {self.score_transport!r}")
        if self.score_transport == "tensor" and (self.top_k or not self.verifiers):
            raise ValueError("--score-transport tensor carries full distributions from --verifiers: it needs --top-k 0 "
                             f"and verifier addresses (got top_k={self.top_k}, verifiers={self.verifiers})")
        if not 0 < self.score_channel_timeout <= 600:
            raise ValueError(f"score_channel_timeout must be in (0, 600] seconds, got {self.score_channel_timeout}")
        if self.data_parallel < 1:
            raise ValueError(f"data_parallel must be >= 1, got {self.data_parallel}")
        if self.data_parallel > 1 and torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"--data-parallel runs on cpu (gloo) or cuda (NCCL), not {self.device!r}")
        if self.data_parallel > self.batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) is below data_parallel ({self.data_parallel}): "
                             "every rank needs a trace per step")
        if self.broadcast_timeout <= 0:
            raise ValueError(f"broadcast_timeout must be > 0 seconds, got {self.broadcast_timeout}")
        if bool(self.target) == bool(self.verifiers):
            raise ValueError("set exactly one of --target (a local target directory) and --verifiers "
                             f"(verifier addresses for Score); got target={self.target!r}, verifiers={self.verifiers}")
        if self.max_deliveries < 1 or self.claim_idle_ms < 0 or self.block_ms < 1:
            raise ValueError(f"max_deliveries and block_ms must be >= 1 and claim_idle_ms >= 0, got {self.max_deliveries}, "
                             f"{self.block_ms} and {self.claim_idle_ms}")
        self.specopd()  # raises on a bad block size, loss, ...
        self.online()

    def specopd(self) -> SpecOPDConfig:
        return SpecOPDConfig(block_size=self.block_size, anchors_per_seq=self.anchors_per_seq,
                             branches_per_anchor=self.branches_per_anchor, max_context=self.max_context,
                             loss=self.loss, lr=self.lr, seed=self.seed)

    def store_host(self) -> str:
        """Where drafters reach the broadcast store (see --broadcast-host)."""
        return self.broadcast_host or self._own_address()

    def channel_host(self) -> str:
        """Where verifiers reach the Score channel stores (see --score-channel-host)."""
        return self.score_channel_host or self._own_address()

    def _own_address(self) -> str:
        if self.host in ("", "0.0.0.0", "::", "[::]"):
            return socket.gethostbyname(socket.gethostname())
        return self.host

    def online(self) -> OnlineConfig:
        return OnlineConfig(batch_size=self.batch_size, steps_per_version=self.steps_per_version,
                            heldout_every=self.heldout_every, max_heldout=self.max_heldout,
                            min_heldout=self.min_heldout, gate_seed=self.seed, replay_traces=self.replay_traces)


class TrainerMetrics:
    """The trainer's Prometheus metrics (vLLM-style names, ``specd:`` prefix) on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.steps = Counter("specd:trainer_steps", "SpecOPD optimizer steps", registry=registry)
        self.traces_consumed = Counter("specd:trainer_traces_consumed", "Traces trained on or held out", registry=registry)
        self.versions_published = Counter("specd:trainer_versions_published", "Drafter versions that passed the gate",
                                          registry=registry)
        self.versions_refused = Counter("specd:trainer_versions_refused", "Candidate versions the gate refused",
                                        registry=registry)
        self.supervised_tokens = Counter("specd:trainer_supervised_tokens", "Branch positions with a target distribution",
                                         registry=registry)
        self.live_version = Gauge("specd:trainer_live_version", "1 for the live drafter version", ["version"],
                                  registry=registry)
        self.dead_letters = Counter("specd:trainer_dead_letters", "Trace entries sent to the dead-letter stream",
                                    registry=registry)
        self.live_tau = Gauge("specd:trainer_live_tau", "Held-out τ of the live drafter at the last gate", registry=registry)
        self.candidate_tau = Gauge("specd:trainer_candidate_tau", "Held-out τ of the last candidate", registry=registry)
        self.broadcasts = Counter("specd:trainer_weight_broadcasts",
                                  "Versions broadcast to the registered drafter replicas", registry=registry)
        self.broadcast_failures = Counter("specd:trainer_weight_broadcast_failures",
                                          "Broadcasts that failed (the drafters pulled instead)", registry=registry)


class TrainerService:
    """The online trainer: learner + trace stream + publishing (module docstring).

    `poll` is one round of the loop (tests drive it directly); `run` repeats it until `stop`.
    Construction loads the models and the online checkpoint: ValueError (ModelLoadError for a
    model directory) with what to fix when one of them cannot be used. With ``leader`` (rank 0 of
    a data-parallel trainer) the drafter trains on every rank (`ParallelOnlineLearner`).
    """

    def __init__(self, config: TrainerConfig, *, client: redis.Redis | None = None,
                 metrics: TrainerMetrics | None = None, leader: Leader | None = None) -> None:
        self.config = config
        if configured_failpoints():  # a malformed SPECD_FAILPOINTS raises here (a ValueError), not at a checkpoint
            logger.warning("failpoints active: %s", configured_failpoints())
        self.client = client or redis.Redis.from_url(config.redis_url, decode_responses=True)
        self.metrics = metrics or TrainerMetrics(CollectorRegistry())
        drafter = _load_drafter(config.drafter, config.device)
        self.scorer = self._scorer(config, drafter)
        live, directory = _load_drafter(config.drafter, config.device), Path(config.checkpoint_dir)
        options = {"config": config.specopd(), "online": config.online()}
        if leader is None:
            self.learner = OnlineLearner(self.scorer, drafter, live, directory, **options)
        else:
            self.learner = ParallelOnlineLearner(self.scorer, drafter, live, directory, leader=leader, **options)
        if self.learner.load():
            logger.info("resumed the online checkpoint at step %d (live version %r)",
                        self.learner.num_steps, self.learner.counters.live_version or "initial")
        self._adopt_announced()
        self.stream = TraceStream(self.client, stream=config.stream, group=config.group, consumer=config.consumer,
                                  claim_idle_ms=config.claim_idle_ms, max_deliveries=config.max_deliveries,
                                  dead_stream=config.dead_stream)
        self.stream.ensure_group()
        self._queued: list[Entry] = []  # entries of the learner's queued batch, in order
        self._to_ack: list[str] = []  # entries whose effect the next checkpoint holds
        # The learner's models: the loop vs offer(). FIFO: the loop holds it for a step (and a
        # checkpoint, gate and publish when a version is due) and asks again at once; with a plain
        # lock it took it straight back, and an Offer waited past its deadline on a loaded host.
        self._lock = FairLock()
        self._stop = threading.Event()
        if self.learner.counters.live_version:
            self.metrics.live_version.labels(self.learner.counters.live_version).set(1)

    @staticmethod
    def _scorer(config: TrainerConfig, drafter: D3DModel) -> TreeScorer:
        if config.target:
            return LocalScorer(load_model(config.target, device=config.device))
        if not config.stop_token_ids:
            logger.warning("no --stop-token-ids: branches are supervised past the target's stop tokens")
        return RemoteScorer(config.verifiers, config, config.top_k, vocab_size=drafter.config.vocab_size,
                            stop_token_ids=config.stop_token_ids, transport=config.score_transport,
                            channel_host=config.channel_host() if config.score_transport == "tensor" else "",
                            channel_timeout=config.score_channel_timeout, device=config.device)

    def _adopt_announced(self) -> None:
        """After a crash between publishing a version and saving the checkpoint that records it,
        the key names a version this trainer wrote but does not know as live: take it back."""
        raw = self.client.get(self.config.version_key)
        if raw is None:
            return
        try:
            version = json.loads(raw)["version"]
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning("ignoring the malformed live-version key %s: %.200s", self.config.version_key, raw)
            return
        if version != self.learner.counters.live_version and self.learner.adopt(version):
            logger.info("adopted announced version %s written before the last checkpoint", version)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Poll until `stop`; Redis or verifier outages are waited out, not raised. On the way out,
        the traces trained since the last checkpoint are saved and acknowledged."""
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self.poll()
                self.learner.idle()
                backoff = 1.0
            except (redis.ConnectionError, redis.TimeoutError, ScoreError) as error:
                logger.warning("%s; retrying in %.0fs", error, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
        if self._to_ack or self.learner.num_steps > self.learner.steps_at_version:
            self.checkpoint()

    def stop(self) -> None:
        """Ask `run` to return after its current step (it saves and acknowledges first)."""
        self._stop.set()

    def poll(self, block_ms: int | None = None) -> None:
        """One round: read entries, hand them to the learner, step on each full batch, and
        checkpoint, acknowledge, gate and publish when a version is due."""
        with self._lock:
            if self.learner.ready:  # a batch whose step failed (verifiers unreachable): retry it first
                self._step()
                return
        count = self.config.batch_size - len(self._queued)
        held = [e.id for e in self._queued] + self._to_ack
        entries = self.stream.read(count, self.config.block_ms if block_ms is None else block_ms, held)
        with self._lock:
            for entry in entries:
                self._take(entry)
            if self.learner.ready:
                self._step()
            elif not entries and self.learner.can_replay:  # nothing new: train on kept traces meanwhile
                self._step(replay=True)

    def _take(self, entry: Entry) -> None:
        try:
            trace = Trace.from_fields(entry.fields)
        except ValueError as error:
            self._dead_letter(entry, str(error))
            return
        outcome = self.learner.add(trace)
        if outcome == "train":
            self._queued.append(entry)
        else:
            self._to_ack.append(entry.id)
        if outcome != "duplicate":
            self.metrics.traces_consumed.inc()

    def _dead_letter(self, entry: Entry, reason: str) -> None:
        self.stream.dead_letter(entry, reason)
        self.learner.count_dead_letter()
        self.metrics.dead_letters.inc()

    def _step(self, replay: bool = False) -> None:
        try:
            result = self.learner.replay_step() if replay else self.learner.step()
        except ScoreError as error:
            if error.code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise  # unreachable verifiers, auth, deadlines: the batch stays queued; `run` retries it
            if replay:  # kept traces the verifiers refuse now: nothing is queued, nothing to dead-letter
                logger.warning("the verifiers refused a replayed batch: %s", error)
                return
            # The verifiers refuse this batch's data: retrying cannot help.
            for entry in self._queued:
                self._dead_letter(entry, f"the verifiers refused to score its batch: {error}")
            self.learner.batch.clear()
            self._queued.clear()
            return
        if not replay:  # a replay step trained no queued entry: a partial batch stays queued, unacknowledged
            self._to_ack.extend(entry.id for entry in self._queued)
            self._queued.clear()
        self.metrics.steps.inc()
        self.metrics.supervised_tokens.inc(result.num_supervised_tokens)
        logger.info("step %d%s: loss %.4f, %d supervised tokens", self.learner.num_steps, " (replay)" * replay,
                    result.loss, result.num_supervised_tokens)
        if self.learner.version_due:
            self.checkpoint()
            decision = self.learner.judge()
            self._record(decision)
            if decision.passed:
                self._publish(None, decision)

    def checkpoint(self) -> None:
        """Save the online checkpoint, then acknowledge every trace whose effect it holds."""
        self.learner.save()
        failpoint("trainer.after_checkpoint")  # saved, not acknowledged: where a fault test kills us
        self.stream.ack(self._to_ack)
        logger.info("checkpoint at step %d; acknowledged %d traces", self.learner.num_steps, len(self._to_ack))
        self._to_ack = []

    # ------------------------------------------------------------------ gating and publishing
    def offer(self, candidate: D3DModel) -> bool:
        """Gate ``candidate`` against the live drafter on the held-out traces; publish it iff it
        passes. (The loop does this with its own weights every ``steps_per_version`` steps.)"""
        return self.judge_and_publish(candidate).passed

    def judge_and_publish(self, candidate: D3DModel) -> GateDecision:
        """`offer`, returning the gate's decision with both τ estimates and its reason."""
        with self._lock:
            decision = self.learner.judge(candidate)
            self._record(decision)
            if decision.passed:
                self._publish(candidate, decision)
            return decision

    def publish_checkpoint(self, directory: str | Path) -> bool:
        """`offer` the drafter saved in ``directory`` (config.json + model.safetensors)."""
        return self.offer(_load_drafter(directory))

    def _record(self, decision: GateDecision) -> None:
        logger.info("gate %s: %s", "passed" if decision.passed else "refused", decision.reason)
        if not math.isnan(decision.candidate_tau):
            self.metrics.candidate_tau.set(decision.candidate_tau)
        if not math.isnan(decision.live_tau):
            self.metrics.live_tau.set(decision.live_tau)
        if not decision.passed:
            self.metrics.versions_refused.inc()

    def _publish(self, candidate: D3DModel | None, decision: GateDecision) -> None:
        published = self.learner.write(candidate)
        if self.config.weight_transport == "broadcast":
            self._broadcast(published)
        self.learner.serve(published)  # fetchable before anything names it
        announcement = published.announcement()
        # The key first: it is the truth; the message is only a hint to re-read it.
        self.client.set(self.config.version_key, announcement)
        self.client.publish(self.config.version_channel, announcement)
        previous = self.learner.counters.live_version
        self.learner.make_live(published, decision, candidate)
        if previous:
            self.metrics.live_version.remove(previous)
        self.metrics.live_version.labels(published.version).set(1)
        self.metrics.versions_published.inc()
        logger.info("published drafter version %s", published.version)

    def _broadcast(self, published: Published) -> None:
        """Send ``published`` to the registered drafters (before the live key names it). Never
        raises for the transfer: a failed broadcast means the drafters pull, as without one."""
        config = self.config
        members = live_members(self.client, config.broadcast_registry)
        if not members:
            logger.info("no drafter replica registered for broadcasts: they pull %s", published.version)
            return
        try:
            with VersionBroadcast(published.directory, published.version, published.sha256, members,
                                  host=config.store_host(), timeout=config.broadcast_timeout, device=config.device) as update:
                announcement = update.announcement.to_json()
                # Expires on its own should this process die mid-update; deleted when the update ends.
                self.client.set(config.broadcast_key, announcement, ex=math.ceil(4 * config.broadcast_timeout) + 10)
                self.client.publish(config.version_channel, announcement)
                try:
                    result = update.send()
                finally:
                    self.client.delete(config.broadcast_key)
        except (BroadcastError, OSError) as error:  # OSError: no port for the store, a file gone
            self.metrics.broadcast_failures.inc()
            logger.warning("broadcast of drafter version %s failed: %s; the drafters pull it with GetCheckpoint instead",
                           published.version, error)
            return
        self.metrics.broadcasts.inc()
        for member, reason in result.refused.items():
            logger.warning("drafter replica %s did not install broadcast version %s (%s); it pulls it instead",
                           member, published.version, reason)
        logger.info("broadcast drafter version %s to %d of %d replicas over %s", published.version,
                    len(result.received), len(members), update.backend)

    # ------------------------------------------------------------------ what the servicer reads
    def status(self) -> trainer_pb2.StatusResponse:
        counters = self.learner.counters
        return trainer_pb2.StatusResponse(
            live_version=counters.live_version, steps=self.learner.num_steps, traces_consumed=counters.traces_consumed,
            versions_published=counters.versions_published, versions_refused=counters.versions_refused,
            live_tau=counters.live_tau, last_candidate_tau=counters.last_candidate_tau,
            last_gate_live_tau=counters.last_gate_live_tau, replay_steps=counters.replay_steps,
            supervised_tokens=self.learner.trainer.num_supervised_tokens,
        )

    def version_dir(self, version: str) -> Path | None:
        """The directory of published ``version`` ("" = the live one), None when unknown."""
        return self.learner.version_dir(version or self.learner.counters.live_version)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """``specd.v1.Trainer`` over a `TrainerService` (UNAVAILABLE until one is attached)."""

    def __init__(self, service: TrainerService | None = None, *, default_chunk_bytes: int = 1 << 20) -> None:
        self.service = service
        self.default_chunk_bytes = default_chunk_bytes

    def _ready(self, context: grpc.ServicerContext) -> TrainerService:
        if self.service is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "the trainer is still loading its weights; retry shortly")
        return self.service

    def Status(self, request: trainer_pb2.StatusRequest, context: grpc.ServicerContext) -> trainer_pb2.StatusResponse:
        return self._ready(context).status()

    def GetCheckpoint(self, request: trainer_pb2.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> Iterator[trainer_pb2.CheckpointChunk]:
        service = self._ready(context)
        version = request.version or service.learner.counters.live_version
        if not version:
            abort(context, grpc.StatusCode.NOT_FOUND, "no drafter version has been published yet")
        directory = service.version_dir(version)
        if directory is None:
            abort(context, grpc.StatusCode.NOT_FOUND,
                  f"unknown drafter version {version!r}: never published by this trainer, or pruned (it keeps the "
                  f"newest {service.learner.online.keep_versions}); the live-version key names the current one")
        chunk_bytes = request.chunk_bytes or self.default_chunk_bytes
        if chunk_bytes > MAX_MESSAGE_BYTES // 2:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"chunk_bytes {chunk_bytes} is above {MAX_MESSAGE_BYTES // 2}")
        try:
            yield from stream_checkpoint(directory, version, chunk_bytes)
        except FileNotFoundError as error:
            abort(context, grpc.StatusCode.NOT_FOUND, f"{error} (pruned since; read the live key again)")


    def Offer(self, request: trainer_pb2.OfferRequest, context: grpc.ServicerContext) -> trainer_pb2.OfferResponse:
        service = self._ready(context)
        try:
            candidate = _load_drafter(request.directory)
        except (ModelLoadError, OSError) as error:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"cannot load a drafter from {request.directory!r}: {error}")
        if candidate.config.vocab_size != service.learner.trainer.drafter.config.vocab_size:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"the offered drafter's vocabulary ({candidate.config.vocab_size}) differs from the live one's")
        decision = service.judge_and_publish(candidate)
        return trainer_pb2.OfferResponse(
            published=decision.passed, version=service.learner.counters.live_version,
            candidate_tau=decision.candidate_tau, live_tau=decision.live_tau, reason=decision.reason,
        )


def _load_drafter(directory: str | Path, device: str = "cpu") -> D3DModel:
    model = load_model(directory, device=device)
    if not isinstance(model, D3DModel):
        raise ModelLoadError(f"{directory} holds a {type(model).__name__}, not a D3D drafter (model_type specd_d3d)")
    return model


def main(argv: Sequence[str] | None = None) -> None:
    """Train until SIGTERM (health NOT_SERVING until the weights are loaded)."""
    config = parse_config(TrainerConfig, argv, prog="python -m services.trainer")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    leader = None
    if config.data_parallel > 1:
        try:
            ranks = start_ranks(config.data_parallel, config.device)
        except RuntimeError as error:
            raise SystemExit(f"trainer: {error}") from None
        config = dataclasses.replace(config, device=str(ranks.device))
        if not ranks.is_main:  # no server, no Redis: this rank applies rank 0's commands
            exit_job(run_follower(config.drafter, ranks))
        leader = Leader(ranks)
    servicer = TrainerServicer()
    server = GrpcServer("specd-trainer", config)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.server)
    port = server.start([SERVICE_NAME])
    if config.metrics_port >= 0:
        logger.info("metrics on :%d/metrics", start_metrics_server(config.metrics_port))
    try:
        service = TrainerService(config, metrics=TrainerMetrics(prometheus_client.REGISTRY), leader=leader)
    except BaseException as error:
        server.stop(None)
        if leader is not None:  # the other ranks wait for rank 0's word: let them go
            leader.close()
        if isinstance(error, (ValueError, redis.RedisError)):
            raise SystemExit(f"trainer: cannot start: {error}") from None
        raise
    servicer.service = service
    failure: list[BaseException] = []

    def loop() -> None:
        try:
            service.run()
        except BaseException as error:  # the loop is the service: when it dies, the process exits
            logger.exception("the training loop failed")
            failure.append(error)
            server.stop(None)

    thread = threading.Thread(target=loop, name="specd-trainer-loop")
    thread.start()

    def drain() -> None:
        service.stop()  # only asks: the loop saves, acknowledges and exits on its own
        server.stop(config.drain_seconds)

    def drain_early(signum: int, frame: object) -> None:
        threading.Thread(target=drain, name="specd-trainer-drain").start()

    # From SERVING until wait_for_termination installs its handlers, a stop signal drains too:
    # Python's default would kill the loop before its last checkpoint.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, drain_early)
    server.set_serving()
    print(f"trainer serving on {config.host}:{port} (live version {service.learner.counters.live_version or 'initial'})",
          flush=True)
    server.wait_for_termination(on_drain=service.stop)
    service.stop()
    thread.join()
    service.learner.close()  # after the last save and its acknowledgements: the other ranks may go
    message = f"trainer: the training loop failed: {failure[0]!r}" if failure else ""
    if leader is not None:
        if message:
            print(message, file=sys.stderr)
        exit_job(1 if message else 0, destroy=leader.state == "closed")
    if message:
        raise SystemExit(message)
