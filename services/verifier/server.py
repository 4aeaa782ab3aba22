"""The target verifier service: owns each request, batches sequences, verifies blocks and trees.

One process holds the target model and a `ServingEngine` (continuous batching, lossless
speculative verification). Drafting comes from drafter replicas over gRPC (`RemoteDrafters`:
sticky per sequence, balanced by outstanding work, failover, plain decoding when none answers).
The same engine serves

- gRPC `specd.v1.Verifier/Generate` (server streaming) and `Score` (tree supervision for the
  trainer, run between engine steps under the target lock);
- the OpenAI-compatible HTTP API on its own port (`/v1/completions`, `/v1/chat/completions`,
  `/v1/models`, `/health`, `/metrics`);
- one trace per finished request to a Redis stream (`TraceWriter`), when a Redis URL is set.

With ``--tensor-parallel N`` the target is sharded over N processes launched by torchrun
(`specd.parallel.tensor_parallel`): rank 0 does all of the above through a `LockstepTarget`,
the other ranks replay its target calls (`services.verifier.lockstep`).

Metrics (Prometheus, on the HTTP port's `/metrics`) are named like vLLM's, prefixed ``specd:``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from torch import nn

from services.common.config import ServiceConfig, parse_config
from services.common.server import GrpcServer, abort
from services.common.telemetry import get_tracer, setup_tracing
from services.common.wire import params_from_proto
from services.verifier import lockstep
from services.verifier.drafter_pool import RemoteDrafters
from services.verifier.http import build_app, serve_http
from services.verifier.score import ScoreHandler
from services.verifier.traces import TraceWriter
from specd._proto.v1 import verifier_pb2, verifier_pb2_grpc
from specd.data import load_tokenizer
from specd.data.chat import ChatTemplate
from specd.drafters.base import Drafter
from specd.drafters.hybrid import LookupHybridDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig
from specd.models.attention import BACKENDS
from specd.models.loading import ModelLoadError, load_model
from specd.parallel import tensor_parallel
from specd.serving import Delta, EngineStopped, FinishedRequest, QueueFull, ServingEngine

logger = logging.getLogger("specd.verifier")

TTFT = Histogram("specd:time_to_first_token_seconds", "Time from arrival to the first token",
                 buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0))
TPOT = Histogram("specd:time_per_output_token_seconds", "Mean time per output token after the first",
                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0))
E2E = Histogram("specd:e2e_request_latency_seconds", "Time from arrival to the last token",
                buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0))


@dataclass(kw_only=True)
class VerifierConfig(ServiceConfig):
    model: str = field(default="", metadata={"help": "target model directory (config.json, model.safetensors)"})
    tokenizer: str = field(default="", metadata={"help": "tokenizer directory (default: the model directory)"})
    served_model_name: str = field(default="", metadata={"help": "model name of the HTTP API (default: the model directory's name)"})
    drafters: list[str] = field(default_factory=list, metadata={
        "help": "drafter addresses, comma-separated host:port or dns:///name:port (empty = plain decoding)"})
    prompt_lookup: bool = field(default=False, metadata={
        "help": "prompt lookup beside the drafters (per sequence and step, the block expected to go further), "
                "or alone without drafters (n-gram speculation)"})
    http_host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP API binds"})
    http_port: int = field(default=8000, metadata={"help": "port of the OpenAI-compatible HTTP API (-1 = none)"})
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(drafter_retry_seconds=2.0))
    """The serving engine's settings; their flags are the engine's field names (`specd.flags`
    flattens them). Where a service's default is not the library's one-shot default, the factory
    sets it: a failed drafter is retried after 2 s (the library: never). Without drafters the
    engine decodes plain whatever ``block_size`` says (`main`)."""
    max_waiting: int = field(default=256, metadata={
        "help": "requests queued for a free row at most; past it HTTP answers 429 and gRPC RESOURCE_EXHAUSTED (0 = no limit)"})
    max_request_bytes: int = field(default=2 << 20, metadata={"help": "largest HTTP request body (413 above it)"})
    max_model_len: int = field(default=0, metadata={"help": "longest prompt + output (0 = the model's)"})
    drafter_timeout: float = field(default=10.0, metadata={"help": "deadline of one drafter call, seconds"})
    redis_url: str = field(default="", metadata={"help": "Redis for request traces (empty = none)"})
    trace_stream: str = field(default="specd:traces", metadata={"help": "Redis stream of request traces"})
    trace_maxlen: int = field(default=100_000, metadata={"help": "approximate bound of the trace stream"})
    threads: int = field(default=0, metadata={"help": "torch intra-op threads (0 = torch's default)"})
    device: str = field(default="cpu", metadata={"help": "torch device of the target (cpu, cuda, cuda:1, ...)"})
    attention_backend: str = field(default="auto", metadata={
        "help": "how attention runs: auto (flash-attn on CUDA when installed, else sdpa), sdpa, flex, flash, triton"})
    tensor_parallel: int = field(default=1, metadata={
        "help": "ranks the target is sharded over (> 1: launch with torchrun --nproc-per-node N; rank 0 serves)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise ValueError("--model (SPECD_MODEL) is required: the target model directory")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        if self.port == 0:
            self.port = 50051
        if self.max_waiting < 0 or self.max_request_bytes < 1:
            raise ValueError(f"max_waiting must be >= 0 and max_request_bytes >= 1, got {self.max_waiting}, "
                             f"{self.max_request_bytes}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.engine.cuda_graphs:
            raise ValueError("cuda_graphs is not supported with tensor_parallel > 1 (the graph runner drives the "
                             "cache directly, which the other ranks would not replay)")


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: ServingEngine, score: ScoreHandler, stop_token_ids: tuple[int, ...] = ()) -> None:
        self.engine = engine
        self.score = score
        self.stop_token_ids = stop_token_ids
        """The model's end-of-sequence ids: they end every request unless it sets ignore_eos."""
        self.tracer = get_tracer("specd.verifier")

    def Generate(self, request: verifier_pb2.GenerateRequest, context: grpc.ServicerContext):
        try:
            params = params_from_proto(request.params)
            if not request.params.ignore_eos:
                params.stop_token_ids = tuple(dict.fromkeys((*self.stop_token_ids, *params.stop_token_ids)))
            stream = self.engine.submit(list(request.prompt_token_ids), params, request_id=request.request_id or None,
                                        store=not request.HasField("store") or request.store)
        except ValueError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except QueueFull as err:
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except EngineStopped as err:  # shutting down, or the engine died
            abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
        context.add_callback(stream.cancel)  # the client went away: stop decoding for it
        with self.tracer.start_as_current_span("generate") as span:
            span.set_attribute("specd.prompt_tokens", len(request.prompt_token_ids))
            try:
                for delta in stream:
                    if delta.finish_reason == "error":  # this request alone failed; the others go on
                        abort(context, grpc.StatusCode.INTERNAL,
                              f"the request failed in the engine: {delta.error}; retry it, and report it if it repeats")
                    yield _response(stream.request_id, delta)
                    if delta.finish_reason is not None:
                        span.set_attribute("specd.completion_tokens", delta.usage.completion_tokens if delta.usage else 0)
            except EngineStopped as err:  # the engine died while this stream was open
                abort(context, grpc.StatusCode.UNAVAILABLE, f"{err}: retry on another replica")

    def Score(self, request: verifier_pb2.ScoreRequest, context: grpc.ServicerContext) -> verifier_pb2.ScoreResponse:
        with self.tracer.start_as_current_span("score"):
            return self.score(request, context)


def _response(request_id: str, delta: Delta) -> verifier_pb2.GenerateResponse:
    message = verifier_pb2.GenerateResponse(request_id=request_id, token_ids=delta.token_ids)
    if delta.finish_reason is not None:
        message.finish_reason = delta.finish_reason
        if delta.usage is not None:
            message.usage.CopyFrom(verifier_pb2.Usage(
                prompt_tokens=delta.usage.prompt_tokens, completion_tokens=delta.usage.completion_tokens,
                target_passes=delta.usage.target_passes, tokens_per_pass=delta.usage.tokens_per_pass,
            ))
    return message


class EngineCollector:
    """Prometheus view of the engine's counters, read at scrape time (no double bookkeeping)."""

    def __init__(self, engine: ServingEngine, drafters: RemoteDrafters | None) -> None:
        self.engine = engine
        self.drafters = drafters

    def collect(self):
        stats = self.engine.stats
        for name, value, help_text in (
            ("spec_decode_num_drafts", stats.num_drafts, "Verification passes over a drafted block"),
            ("spec_decode_num_draft_tokens", stats.num_draft_tokens, "Drafted tokens verified"),
            ("spec_decode_num_accepted_tokens", stats.num_accepted_tokens, "Drafted tokens accepted"),
            ("spec_decode_num_emitted_tokens", stats.num_emitted_tokens, "Tokens committed"),
            ("spec_decode_num_candidate_lookups", stats.num_candidate_lookups, "Outcomes looked up among candidates"),
            ("spec_decode_num_candidate_hits", stats.num_candidate_hits, "Outcomes that found a ready candidate"),
            ("num_target_passes", stats.num_target_passes, "Target passes"),
            ("num_sequence_passes", stats.num_sequence_passes,
             "Sequences verified, summed over target passes (plain rows included: tau's denominator)"),
            ("num_drafter_calls", stats.num_drafter_calls, "Calls to the drafter"),
            ("num_drafter_blocking_calls", stats.num_drafter_blocking_calls,
             "Drafter round trips the target pass waited for (the critical path)"),
        ):
            yield CounterMetricFamily(f"specd:{name}", help_text, value=value)
        seconds = CounterMetricFamily("specd:engine_seconds", "Serving loop busy time by part (step = all of it)",
                                      labels=["part"])
        for part, value in (("step", stats.seconds_total), ("target", stats.seconds_target),
                            ("drafter_blocking", stats.seconds_drafter_blocking)):
            seconds.add_metric([part], value)
        yield seconds
        per_pos = CounterMetricFamily("specd:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafted tokens accepted at each block position", labels=["position"])
        for position, value in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], value)
        yield per_pos
        yield GaugeMetricFamily("specd:spec_decode_candidate_hit_rate", "Candidate hit rate", value=stats.hit_rate)
        yield GaugeMetricFamily("specd:spec_decode_mean_acceptance_length", "Tau: tokens committed per sequence per target pass",
                                value=stats.tau)
        yield GaugeMetricFamily("specd:num_requests_running", "Requests decoding", value=self.engine.num_running)
        yield GaugeMetricFamily("specd:num_requests_waiting", "Requests queued", value=self.engine.num_waiting)
        if self.drafters is not None:
            yield InfoMetricFamily("specd:drafter_version", "Drafter weight version seen last",
                                   value={"version": self.drafters.version or "unknown"})
            stats = dataclasses.asdict(self.drafters.stats)
            yield CounterMetricFamily("specd:drafter_transport_seconds",
                                      "Drafter round trips' time outside the replica (gRPC, network)",
                                      value=stats.pop("transport_seconds"))
            yield CounterMetricFamily("specd:drafter_server_seconds",
                                      "Drafter round trips' time inside the replica (as it reports it)",
                                      value=stats.pop("server_seconds"))
            pool = CounterMetricFamily("specd:drafter_pool_events", "Drafter pool events", labels=["event"])
            for event, value in stats.items():
                pool.add_metric([event.removeprefix("num_")], value)
            yield pool


def observe_latency(finished: FinishedRequest) -> None:
    E2E.observe(finished.finish_time - finished.arrival_time)
    if finished.first_token_time is not None:
        TTFT.observe(finished.first_token_time - finished.arrival_time)
        if len(finished.output) > 1:
            TPOT.observe((finished.finish_time - finished.first_token_time) / (len(finished.output) - 1))


def load_target(config: VerifierConfig, ranks: lockstep.Ranks | None) -> nn.Module:
    """The target: whole, or (``--tensor-parallel N``) this rank's shard; rank 0 gets it wrapped
    in `LockstepTarget`. A shard is loaded whole on the CPU, sliced, then moved to the device, so
    a device never holds more than its share."""
    if ranks is None:
        return load_model(config.model, device=config.device, attention_backend=config.attention_backend)
    model = load_model(config.model, device="cpu", attention_backend=config.attention_backend)
    model = tensor_parallel(model).to(ranks.device)
    return lockstep.LockstepTarget(model) if ranks.rank == 0 else model


def engine_drafter(drafters: RemoteDrafters | None, config: VerifierConfig, vocab_size: int) -> Drafter | None:
    """What the engine drafts with: the drafter services, with prompt lookup beside them
    (`LookupHybridDrafter`) or alone (`NgramDrafter`) under ``--prompt-lookup``; None: plain."""
    if not config.prompt_lookup:
        return drafters
    if drafters is not None:
        return LookupHybridDrafter(drafters)
    return NgramDrafter(vocab_size=vocab_size, max_block=max(1, config.engine.block_size))


def main(argv: list[str] | None = None) -> None:
    config = parse_config(VerifierConfig, argv, prog="specd-verifier",
                          description="The specd target verifier: gRPC Generate/Score and the OpenAI HTTP API.")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    ranks = None
    if config.tensor_parallel > 1:
        try:
            ranks = lockstep.init_ranks(config.tensor_parallel, config.device)
        except RuntimeError as err:
            sys.exit(f"specd-verifier: {err}")
        if ranks.rank != 0:  # a follower: no servers, it replays rank 0's target calls
            try:
                shard = load_target(config, ranks)
            except (ModelLoadError, OSError, ValueError, RuntimeError) as err:
                sys.exit(f"specd-verifier rank {ranks.rank}: cannot load the target: {err}")
            lockstep.run_follower(shard, ranks)
            return
    setup_tracing("specd-verifier", config.otlp_endpoint)
    # Every open Generate stream holds a server thread until it ends (queued requests too): room
    # for many more than the engine's rows, or streams would wait for a thread before the queue.
    grpc_server = GrpcServer("verifier", config, max_workers=max(256, 4 * config.engine.max_num_seqs))
    try:
        target = load_target(config, ranks)
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        chat_template = ChatTemplate.from_dir(config.tokenizer or config.model)
    except (ModelLoadError, OSError, ValueError, RuntimeError) as err:
        sys.exit(f"specd-verifier: cannot load the target: {err}")

    drafters = None
    if config.drafters:
        try:
            drafters = RemoteDrafters(config.drafters, config, timeout=config.drafter_timeout,
                                      retry_seconds=config.engine.drafter_retry_seconds,
                                      vocab_size=target.config.vocab_size, max_block=config.engine.block_size)
        except ValueError as err:
            sys.exit(f"specd-verifier: {err}")
    traces = TraceWriter(config.redis_url, config.trace_stream, maxlen=config.trace_maxlen) if config.redis_url else None

    def on_finish(finished: FinishedRequest) -> None:
        observe_latency(finished)
        if traces is not None and finished.store:
            traces(finished)

    def on_death(error: BaseException) -> None:
        # A verifier whose engine is gone must not look healthy: NOT_SERVING at once, then the
        # same drain as SIGTERM, and a non-zero exit so that its supervisor restarts it.
        logger.critical("the serving engine died (%r): reporting NOT_SERVING and exiting", error)
        grpc_server.set_serving(False)
        os.kill(os.getpid(), signal.SIGTERM)

    drafter = engine_drafter(drafters, config, target.config.vocab_size)
    engine = ServingEngine(
        target, drafter,
        config.engine if drafter else dataclasses.replace(config.engine, block_size=0),
        max_model_len=config.max_model_len or None,
        drafter_version=(lambda: drafters.version) if drafters else (lambda: ""),
        on_finish=on_finish,
        max_waiting=config.max_waiting or None,
        on_death=on_death,
    )
    REGISTRY.register(EngineCollector(engine, drafters))
    stop_ids = tuple(getattr(target.config, "stop_token_ids", ()) or ())
    score = ScoreHandler(target, engine.target_lock, max_model_len=engine.max_model_len)
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, score, stop_ids), grpc_server.server)
    port = grpc_server.start(["specd.v1.Verifier"])

    http = None
    if config.http_port >= 0:
        app = build_app(engine, tokenizer, model_name=config.served_model_name or Path(config.model).name,
                        auth_token=config.auth_token, is_ready=lambda: not grpc_server.draining,
                        default_stop_token_ids=stop_ids, max_request_bytes=config.max_request_bytes,
                        chat_template=chat_template)
        http = serve_http(app, config.http_host, config.http_port)
    grpc_server.set_serving()
    http_note = f", HTTP on {config.http_host}:{config.http_port}" if http else ""
    drafting = []
    if drafters:
        drafting.append(f"drafters {','.join(config.drafters)}")
    if config.prompt_lookup:
        drafting.append("prompt lookup")
    print(f"verifier serving gRPC on {config.host}:{port}{http_note} ({' + '.join(drafting) or 'plain decoding'})",
          flush=True)

    def drain() -> None:
        # Running and queued requests finish (new ones are refused), within the drain budget.
        engine.shutdown(drain=True, timeout=config.drain_seconds)

    grpc_server.wait_for_termination(on_drain=drain)
    if http is not None:
        http[0].should_exit = True
        http[1].join(timeout=config.drain_seconds)
    score.close()  # the trainers' tensor channels
    if drafters is not None:
        drafters.close()
    if traces is not None:
        traces.close()
    if isinstance(target, lockstep.LockstepTarget):  # drained: the followers may go
        target.stop()
        dist.destroy_process_group()
    if engine.error is not None:
        sys.exit(f"specd-verifier: the serving engine died ({engine.error!r}); exiting so that it is restarted")


if __name__ == "__main__":
    main()
