"""services/common: config parsing, tensor transport, the gRPC server and channels (auth, tracing,
health, reflection, TLS, deadlines, drain on SIGTERM) and checkpoint transfer, over real sockets."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import Counter

from services.common import wire
from services.common.checkpoints import CheckpointError, fetch_checkpoint, stream_checkpoint
from services.common.config import ServiceConfig, parse_config
from services.common.server import GrpcServer, abort, open_channel, wait_healthy
from services.common.telemetry import get_tracer, setup_tracing, start_metrics_server
from specd._proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from specd.drafters.base import DraftBlock
from specd.models.loading import file_sha256
from specd.sampling import SamplingParams
from specd.tree import TokenTree

REPO = Path(__file__).resolve().parents[2]


# ============================================================================ config
@dataclass(kw_only=True)
class _DrafterLikeConfig(ServiceConfig):
    """A service config with one field of each extra kind."""

    verifiers: list[str] = field(default_factory=list, metadata={"help": "verifier addresses"})
    block_sizes: tuple[int, ...] = field(default=(4, 8), metadata={"help": "allowed block sizes"})
    sample: bool = field(default=False, metadata={"help": "sample drafts"})
    temperature: float = field(default=1.0, metadata={"help": "drafting temperature"})


def test_config_defaults_env_and_flags_in_that_order():
    assert parse_config(_DrafterLikeConfig, [], {}) == _DrafterLikeConfig()
    env = {"SPECD_PORT": "7000", "SPECD_AUTH_TOKEN": "s3cret", "SPECD_VERIFIERS": "a:1, b:2", "SPECD_SAMPLE": "1"}
    from_env = parse_config(_DrafterLikeConfig, [], env)
    assert (from_env.port, from_env.auth_token, from_env.sample) == (7000, "s3cret", True)
    assert from_env.verifiers == ["a:1", "b:2"]
    flags = ["--port", "7001", "--no-sample", "--block-sizes", "2,16", "--verifiers", "", "--drain-seconds", ".5"]
    from_flags = parse_config(_DrafterLikeConfig, flags, env)
    assert from_flags.port == 7001 and from_flags.sample is False  # a flag beats the environment
    assert from_flags.block_sizes == (2, 16) and from_flags.verifiers == [] and from_flags.drain_seconds == 0.5
    assert from_flags.auth_token == "s3cret"  # untouched by flags: the environment's


@pytest.mark.parametrize("text,expected", [("1", True), ("TRUE", True), ("no", False), ("0", False)])
def test_config_env_bools(text: str, expected: bool):
    assert parse_config(_DrafterLikeConfig, [], {"SPECD_SAMPLE": text}).sample is expected


@pytest.mark.parametrize(
    "argv,env,names",
    [
        (["--port", "eighty"], {}, ["--port", "SPECD_PORT", "eighty"]),
        ([], {"SPECD_PORT": "eighty"}, ["--port", "SPECD_PORT", "eighty"]),
        ([], {"SPECD_SAMPLE": "maybe"}, ["--sample", "SPECD_SAMPLE", "maybe"]),
        (["--block-sizes", "4,x"], {}, ["--block-sizes", "SPECD_BLOCK_SIZES", "'x'"]),
        (["--tls-cert", "cert.pem"], {}, ["tls_cert and tls_key go together"]),
        (["--port", "70000"], {}, ["port must be in [0, 65535]"]),
    ],
)
def test_config_bad_values_exit_naming_flag_and_env(argv, env, names, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(_DrafterLikeConfig, argv, env, prog="specd-test")
    assert exited.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("usage: specd-test")
    for name in names:
        assert name in message, message


@dataclass(kw_only=True)
class _NeedsModel(ServiceConfig):
    model_dir: str = field(metadata={"help": "checkpoint directory"})


def test_config_required_field_comes_from_flag_or_env(capsys):
    assert parse_config(_NeedsModel, ["--model-dir", "/a"], {}).model_dir == "/a"
    assert parse_config(_NeedsModel, [], {"SPECD_MODEL_DIR": "/b"}).model_dir == "/b"
    with pytest.raises(SystemExit):
        parse_config(_NeedsModel, [], {})
    assert "missing required settings: --model-dir (or SPECD_MODEL_DIR)" in capsys.readouterr().err


def test_config_help_never_shows_a_secret_from_the_environment(capsys):
    with pytest.raises(SystemExit):
        parse_config(ServiceConfig, ["--help"], {"SPECD_AUTH_TOKEN": "s3cret"})
    text = capsys.readouterr().out
    assert "SPECD_AUTH_TOKEN" in text and "s3cret" not in text


# ============================================================================ wire
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool]
)
def test_tensor_round_trip_is_bit_exact(dtype: torch.dtype):
    source = (torch.randn(3, 5) * 100).to(dtype)
    for t in (source, source.t(), source[1:, ::2], source[0, 0], source[:0]):  # strided, 0-d, empty
        back = wire.tensor_from_proto(wire.tensor_to_proto(t))
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)


@pytest.mark.parametrize(
    "message,needle",
    [
        (common_pb2.Tensor(data=b"\0" * 7, shape=[2], dtype="float32"), "7 bytes but shape [2] of float32 needs 8"),
        (common_pb2.Tensor(data=b"\0" * 4, shape=[1], dtype="float33"), "'float33' is not a torch dtype"),
        (common_pb2.Tensor(data=b"", shape=[1], dtype="Tensor"), "'Tensor' is not a torch dtype"),
        (common_pb2.Tensor(data=b"", shape=[-1, 0], dtype="int8"), "negative dimension"),
    ],
)
def test_tensor_from_proto_refuses_inconsistent_messages(message: common_pb2.Tensor, needle: str):
    with pytest.raises(ValueError) as error:
        wire.tensor_from_proto(message)
    assert needle in str(error.value)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=7, temperature=0.5, top_k=20, top_p=0.75, seed=2**64 - 1, stop_token_ids=(3,)),
        SamplingParams(temperature=1.25, seed=0),
    ],
)
def test_params_round_trip(params: SamplingParams):
    assert wire.params_from_proto(wire.params_to_proto(params)) == params


def test_params_absent_fields_take_defaults():
    params = wire.params_from_proto(common_pb2.SamplingParams(), default_max_tokens=17)
    assert params == SamplingParams(max_tokens=17) and params.greedy
    # Present-and-zero top_k / seed are choices, not absences.
    explicit = wire.params_from_proto(common_pb2.SamplingParams(temperature=0.5, top_k=0, seed=0, max_tokens=3))
    assert (explicit.temperature, explicit.top_k, explicit.seed, explicit.max_tokens) == (0.5, 0, 0, 3)


@pytest.mark.parametrize(
    "message,needle",
    [
        (common_pb2.SamplingParams(temperature=-1.0), "temperature must be >= 0"),
        (common_pb2.SamplingParams(temperature=math.nan), "temperature must be a finite number"),
        (common_pb2.SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (common_pb2.SamplingParams(top_p=math.inf), "top_p must be a finite number"),
        (common_pb2.SamplingParams(top_k=-2), "top_k must be in [0, 2**31 - 1]"),
        (common_pb2.SamplingParams(max_tokens=-5), "max_tokens must be >= 1"),
    ],
)
def test_params_from_proto_refuses_bad_values(message: common_pb2.SamplingParams, needle: str):
    with pytest.raises(ValueError) as error:
        wire.params_from_proto(message)
    assert needle in str(error.value)


def test_block_round_trip_with_and_without_probs():
    probs = torch.rand(3, 11).softmax(-1)
    sampled = DraftBlock(tokens=[4, 1, 9], probs=probs, confidence=[0.75, 0.5, 0.25])
    back = wire.block_from_proto(wire.block_to_proto(sampled))
    assert back.tokens == sampled.tokens and back.confidence == sampled.confidence
    assert back.probs is not None and torch.equal(back.probs, probs)

    greedy = DraftBlock(tokens=[2], probs=None, confidence=[1.0])
    assert wire.block_from_proto(wire.block_to_proto(greedy)) == greedy
    assert wire.block_from_proto(wire.block_to_proto(DraftBlock.empty())) == DraftBlock.empty()
    # bf16 q goes out as the float32 the proto promises.
    bf16 = DraftBlock(tokens=[1], probs=probs[:1].bfloat16(), confidence=[1.0])
    assert wire.block_to_proto(bf16).probs.dtype == "float32"


@pytest.mark.parametrize(
    "message,needle",
    [
        (common_pb2.DraftBlock(tokens=[1, 2], confidence=[1.0]), "one confidence per token"),
        (
            common_pb2.DraftBlock(tokens=[1, 2], confidence=[1.0, 0.5], probs=wire.tensor_to_proto(torch.rand(3, 4))),
            "DraftBlock.probs must be [num_tokens=2, vocab]",
        ),
        (
            common_pb2.DraftBlock(tokens=[1], confidence=[1.0], probs=wire.tensor_to_proto(torch.ones(1, 4).int())),
            "must be float32 probabilities",
        ),
    ],
)
def test_block_from_proto_refuses_malformed_blocks(message: common_pb2.DraftBlock, needle: str):
    with pytest.raises(ValueError) as error:
        wire.block_from_proto(message)
    assert needle in str(error.value)


def test_tree_round_trip():
    tree = TokenTree.from_paths([(3, [5, 6, 7]), (3, [5, 8]), (1, [9])])
    back = wire.tree_from_proto(wire.tree_to_proto(tree))
    for name in ("tokens", "parents", "anchors"):
        assert torch.equal(getattr(back, name), getattr(tree, name)) and getattr(back, name).dtype == torch.long


@pytest.mark.parametrize(
    "message,needle",
    [
        (common_pb2.TokenTree(tokens=[1, 2], parents=[-1], anchors=[0, 0]), "three 1-D tensors of one length"),
        (common_pb2.TokenTree(tokens=[1, 2], parents=[-1, 1], anchors=[0, 0]), "parents[i] < i"),
        (common_pb2.TokenTree(tokens=[1], parents=[-2], anchors=[0]), "-1 <= parents[i]"),
        (common_pb2.TokenTree(tokens=[1, 2], parents=[-1, 0], anchors=[0, 1]), "share its root's anchor"),
    ],
)
def test_tree_from_proto_refuses_malformed_trees(message: common_pb2.TokenTree, needle: str):
    with pytest.raises(ValueError) as error:
        wire.tree_from_proto(message)
    assert needle in str(error.value)


# ============================================================================ gRPC server and channels
ECHO = "test.Echo"


class _SpanLog(InMemorySpanExporter):
    """The SDK's in-memory exporter that also lets a test wait (without sleeping) for a span."""

    def __init__(self) -> None:
        super().__init__()
        self._ended = threading.Condition()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        with self._ended:
            self._ended.notify_all()
        return result

    def wait_for(self, predicate: Callable[[ReadableSpan], bool], timeout: float = 10.0) -> ReadableSpan:
        with self._ended:
            found = self._ended.wait_for(lambda: list(filter(predicate, self.get_finished_spans())), timeout)
        assert found, f"no such span within {timeout}s; finished: {[s.name for s in self.get_finished_spans()]}"
        return found[0]


@pytest.fixture(scope="module")
def spans() -> _SpanLog:
    setup_tracing("test-services-common")
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    log = _SpanLog()
    provider.add_span_processor(SimpleSpanProcessor(log))
    return log


@dataclass
class _Echo:
    """A raw-bytes service with one method of each kind that records what each call saw."""

    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        self.seen[method] = {
            "metadata": dict(context.invocation_metadata()),
            "time_remaining": context.time_remaining(),
            "span": trace.get_current_span().get_span_context(),
        }

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._record("Unary", context)
        if request == b"block":
            self.release.wait(10)
        if request == b"refuse":
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "refused as asked")
        return b"unary:" + request

    def server_stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._record("ServerStream", context)
        yield from (request, request)

    def client_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self._record("ClientStream", context)
        return b"".join(requests)

    def bidi_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._record("BidiStream", context)
        yield from requests

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            ECHO,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
                "BidiStream": grpc.stream_stream_rpc_method_handler(self.bidi_stream),
            },
        )


def _call(channel: grpc.Channel, method: str, payload: bytes = b"x", **kwargs: Any) -> bytes:
    """Make one call of ``method``'s kind on the echo service; streams are collected."""
    path = f"/{ECHO}/{method}"
    if method == "Unary":
        return channel.unary_unary(path)(payload, **kwargs)
    if method == "ServerStream":
        return b"".join(channel.unary_stream(path)(payload, **kwargs))
    if method == "ClientStream":
        return channel.stream_unary(path)(iter([payload, payload]), **kwargs)
    return b"".join(channel.stream_stream(path)(iter([payload, payload]), **kwargs))


def _wait(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def echo_server() -> Callable[..., tuple[str, _Echo, GrpcServer]]:
    """Starts an echo GrpcServer (SERVING) with the given config; stopped after the test."""
    servers: list[tuple[GrpcServer, _Echo]] = []

    def start(config: ServiceConfig, *, serving: bool = True) -> tuple[str, _Echo, GrpcServer]:
        echo = _Echo()
        server = GrpcServer("echo", config, max_workers=8)
        server.server.add_generic_rpc_handlers((echo.handler(),))
        port = server.start([ECHO])
        if serving:
            server.set_serving()
        servers.append((server, echo))
        return f"127.0.0.1:{port}", echo, server

    yield start
    for server, echo in servers:
        echo.release.set()
        server.stop(0)


METHODS = ["Unary", "ServerStream", "ClientStream", "BidiStream"]


@pytest.mark.parametrize("method", METHODS)
def test_auth_refuses_missing_and_wrong_tokens_on_every_kind_of_call(echo_server, method: str):
    address, echo, _ = echo_server(ServiceConfig(auth_token="s3cret"))
    for token, problem in (("", "missing bearer token"), ("guess", "wrong bearer token")):
        with open_channel(address, ServiceConfig(auth_token=token)) as channel:
            with pytest.raises(grpc.RpcError) as error:
                _call(channel, method)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED and problem in error.value.details()
    assert method not in echo.seen  # the servicer never ran
    with open_channel(address, ServiceConfig(auth_token="s3cret")) as channel:
        assert _call(channel, method, b"ab") in (b"unary:ab", b"abab")
    assert echo.seen[method]["metadata"]["authorization"] == "Bearer s3cret"


def test_lowercase_bearer_scheme_is_accepted_over_grpc_as_over_http(echo_server):
    # The auth scheme is case-insensitive (RFC 7235); HTTP took "bearer", gRPC refused it.
    address, echo, _ = echo_server(ServiceConfig(auth_token="s3cret"))
    with grpc.insecure_channel(address) as channel:
        unary = channel.unary_unary(f"/{ECHO}/Unary")
        for scheme in ("bearer", "BEARER", "Bearer"):
            assert unary(b"ab", metadata=[("authorization", f"{scheme} s3cret")], timeout=10) == b"unary:ab"
        with pytest.raises(grpc.RpcError) as error:
            unary(b"ab", metadata=[("authorization", "Basic s3cret")], timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_is_exempt_from_auth_and_reflection_lists_the_services(echo_server):
    address, _, server = echo_server(ServiceConfig(auth_token="s3cret"), serving=False)
    with grpc.insecure_channel(address) as bare:  # no token, like a Kubernetes probe
        stub = health_pb2_grpc.HealthStub(bare)

        def status(service: str) -> int:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        assert status("") == status(ECHO) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.set_serving()
        assert status("") == status(ECHO) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            _call(bare, "Unary")
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED

    with open_channel(address, ServiceConfig(auth_token="s3cret")) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        listed = {service.name for answer in answers for service in answer.list_services_response.service}
    assert listed == {ECHO, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_wait_healthy_returns_when_serving_and_times_out_naming_the_address(echo_server):
    address, _, server = echo_server(ServiceConfig(), serving=False)
    with pytest.raises(TimeoutError, match=f"{address} did not become healthy.*NOT_SERVING"):
        wait_healthy(address, ServiceConfig(), timeout=0.5)
    threading.Timer(0.2, server.set_serving).start()  # the server becomes ready while we watch
    started = time.monotonic()
    wait_healthy(address, ServiceConfig(), timeout=10, service=ECHO)
    assert time.monotonic() - started < 5


def test_unary_calls_get_the_default_deadline_and_streams_do_not(echo_server):
    address, echo, _ = echo_server(ServiceConfig())
    config = ServiceConfig(deadline_seconds=3.0)
    with open_channel(address, config) as channel:
        for method in METHODS:
            _call(channel, method)
        # the server sees the 3 s deadline less the time in flight; grpc's header rounding can add a few ms
        assert 2.0 < echo.seen["Unary"]["time_remaining"] <= 3.1
        for method in ("ServerStream", "ClientStream", "BidiStream"):
            assert echo.seen[method]["time_remaining"] > 1e6, method  # grpc's "infinite" deadline
        _call(channel, "Unary", timeout=60)
        assert echo.seen["Unary"]["time_remaining"] > 30  # a call's own deadline wins

    with open_channel(address, ServiceConfig(deadline_seconds=0.3)) as channel:
        with pytest.raises(grpc.RpcError) as error:
            _call(channel, "Unary", b"block")
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_trace_context_crosses_the_call(echo_server, spans: _SpanLog):
    address, echo, _ = echo_server(ServiceConfig())
    with open_channel(address, ServiceConfig()) as channel:
        with get_tracer("test").start_as_current_span("request") as root:
            _call(channel, "Unary")
            stream = channel.unary_stream(f"/{ECHO}/ServerStream")(b"s")
            assert list(stream) == [b"s", b"s"] and stream.code() == grpc.StatusCode.OK  # grpc's call object

    trace_id = root.get_span_context().trace_id
    for method in ("Unary", "ServerStream"):
        client = spans.wait_for(lambda s: s.name == f"{ECHO}/{method}" and s.kind == trace.SpanKind.CLIENT)
        server = spans.wait_for(lambda s: s.name == f"/{ECHO}/{method}" and s.kind == trace.SpanKind.SERVER
                                and s.context.trace_id == trace_id)
        assert client.parent.span_id == root.get_span_context().span_id and client.context.trace_id == trace_id
        assert server.parent.span_id == client.context.span_id and server.parent.is_remote
        assert echo.seen[method]["span"].span_id == server.context.span_id  # the handler ran inside it

    with open_channel(address, ServiceConfig()) as channel, pytest.raises(grpc.RpcError):
        _call(channel, "Unary", b"refuse")
    invalid_argument = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    refused = spans.wait_for(
        lambda s: s.kind == trace.SpanKind.CLIENT and s.attributes.get("rpc.grpc.status_code") == invalid_argument
    )
    assert refused.status.status_code == trace.StatusCode.ERROR and "refused as asked" in refused.status.description


def test_bind_conflict_and_double_start_are_clear_errors(echo_server):
    address, _, server = echo_server(ServiceConfig())
    with pytest.raises(RuntimeError, match="already called"):
        server.start([ECHO])
    taken = int(address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot bind gRPC address 127.0.0.1:{taken}"):
        GrpcServer("second", ServiceConfig(port=taken)).start([ECHO])


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test certificate")
def test_tls_with_auth(echo_server, tmp_path: Path):
    cert, key = _self_signed(tmp_path)
    address, _, _ = echo_server(ServiceConfig(tls_cert=str(cert), tls_key=str(key), auth_token="s3cret"))
    with open_channel(address, ServiceConfig(tls_ca=str(cert), auth_token="s3cret")) as channel:
        assert _call(channel, "Unary", b"t") == b"unary:t"
    with open_channel(address, ServiceConfig(auth_token="s3cret")) as plaintext:
        with pytest.raises(grpc.RpcError) as error:
            _call(plaintext, "Unary", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_metrics_endpoint_serves_the_default_registry():
    counter = Counter("specd:test_services_common_calls", "calls counted by the services/common test")
    counter.inc(3)
    port = start_metrics_server(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "specd:test_services_common_calls_total 3.0" in text


# ---------------------------------------------------------------------------- drain on SIGTERM
_DRAIN_SERVER = """
import sys, threading
from services.common.config import ServiceConfig
from services.common.server import GrpcServer
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc

server = GrpcServer("drain-test", ServiceConfig(drain_seconds=float(sys.argv[1])))
drain_began = threading.Event()

class Trainer(trainer_pb2_grpc.TrainerServicer):
    def Status(self, request, context):
        return trainer_pb2.StatusResponse(live_version="v1")

    def GetCheckpoint(self, request, context):
        yield trainer_pb2.CheckpointChunk(file="before")
        drain_began.wait(30)  # an in-flight call that is still running when SIGTERM arrives
        yield trainer_pb2.CheckpointChunk(file="after")

trainer_pb2_grpc.add_TrainerServicer_to_server(Trainer(), server.server)
port = server.start(["specd.v1.Trainer"])
server.set_serving()
print(port, flush=True)
def on_drain():
    drain_began.set()
    sys.stdin.readline()  # the test says when the drain may go on to stop the server

server.wait_for_termination(on_drain=on_drain)
print("stopped", flush=True)
"""


def test_sigterm_drains_in_flight_calls_then_exits_zero():
    drain_seconds = 5.0
    with subprocess.Popen(
        [sys.executable, "-c", _DRAIN_SERVER, str(drain_seconds)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            line = process.stdout.readline()
            if not line:
                pytest.fail(f"the drain-test server died before listening:\n{process.stderr.read()}")
            address = f"127.0.0.1:{int(line)}"
            wait_healthy(address, ServiceConfig(), timeout=30, service="specd.v1.Trainer")
            with open_channel(address, ServiceConfig()) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                stub = trainer_pb2_grpc.TrainerStub(channel)
                assert stub.Status(trainer_pb2.StatusRequest()).live_version == "v1"
                in_flight = stub.GetCheckpoint(trainer_pb2.GetCheckpointRequest(), timeout=30)
                assert next(in_flight).file == "before"

                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert [chunk.file for chunk in in_flight] == ["after"]  # finished, not cut
                with pytest.raises(grpc.RpcError) as error:  # while on_drain runs, before grpc's stop
                    stub.Status(trainer_pb2.StatusRequest(), timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in error.value.details()
                process.stdin.write("go on\n")
                process.stdin.flush()
                watch.cancel()  # the last open call: the server may now stop before the grace ends

            assert process.wait(timeout=drain_seconds + 10) == 0, process.stderr.read()
            assert time.monotonic() - signalled < drain_seconds
            assert process.stdout.read().strip() == "stopped"
        finally:
            if process.poll() is None:  # a failure above: never leave the server running
                process.kill()


# ============================================================================ checkpoints
_Damage = Callable[[trainer_pb2.CheckpointChunk], object]


class _CheckpointTrainer(trainer_pb2_grpc.TrainerServicer):
    """Serves directories under ``root`` by version ("" = ``live``), optionally damaging a chunk."""

    def __init__(self, root: Path, live: str, damage: _Damage | None = None) -> None:
        self.root, self.live, self.damage = root, live, damage

    def GetCheckpoint(
        self, request: trainer_pb2.GetCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_pb2.CheckpointChunk]:
        version = request.version or self.live
        for chunk in stream_checkpoint(self.root / version, version, request.chunk_bytes or 7):
            if self.damage is not None:
                self.damage(chunk)
            yield chunk


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "published" / "v2"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(os.urandom(100))  # 15 chunks of 7 bytes
    (directory / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (directory / "empty.txt").write_bytes(b"")
    (directory / "ignored-subdirectory").mkdir()
    return directory


@pytest.fixture
def trainer(checkpoint_dir: Path) -> Callable[..., trainer_pb2_grpc.TrainerStub]:
    started: list[tuple[GrpcServer, grpc.Channel]] = []

    def start(damage: _Damage | None = None) -> trainer_pb2_grpc.TrainerStub:
        server = GrpcServer("trainer-test", ServiceConfig(), max_workers=4)
        servicer = _CheckpointTrainer(checkpoint_dir.parent, "v2", damage)
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.server)
        channel = open_channel(f"127.0.0.1:{server.start(['specd.v1.Trainer'])}", ServiceConfig())
        started.append((server, channel))
        return trainer_pb2_grpc.TrainerStub(channel)

    yield start
    for server, channel in started:
        channel.close()
        server.stop(0)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}


def _digests(directory: Path) -> dict[str, str]:
    return {name: file_sha256(directory / name) for name in _files(directory)}


def test_stream_checkpoint_chunks_and_hashes(checkpoint_dir: Path):
    chunks = list(stream_checkpoint(checkpoint_dir, "v2", chunk_bytes=7))
    assert [c.file for c in chunks if c.sha256] == ["config.json", "empty.txt", "model.safetensors"]
    model = [c for c in chunks if c.file == "model.safetensors"]
    assert len(model) == 15 and [c.offset for c in model] == list(range(0, 100, 7))
    assert not any(c.sha256 for c in model[:-1]) and model[-1].total_bytes == 100
    assert model[-1].sha256 == file_sha256(checkpoint_dir / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no directory"):
        next(stream_checkpoint(checkpoint_dir / "missing", "v9"))


def test_fetch_checkpoint_round_trip(trainer, checkpoint_dir: Path, tmp_path: Path):
    expected = _digests(checkpoint_dir)
    destination = fetch_checkpoint(trainer(), "", tmp_path / "drafter" / "v2", expected_sha256=expected)
    assert _files(destination) == _files(checkpoint_dir)
    assert sorted(path.name for path in destination.parent.iterdir()) == ["v2"]  # no staging left behind
    with pytest.raises(FileExistsError, match="already exists"):
        fetch_checkpoint(trainer(), "v2", destination)


def _flip_first_bit(chunk: trainer_pb2.CheckpointChunk) -> None:
    if chunk.data:
        chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]


@pytest.mark.parametrize(
    "expected_sha256,damage,needle",
    [
        ({"config.json": "0" * 64}, None, "file 'config.json': sha256"),
        (None, _flip_first_bit, "corrupted in transit"),
        (None, lambda chunk: setattr(chunk, "file", "../escape"), "refusing checkpoint file name '../escape'"),
        (None, lambda chunk: setattr(chunk, "offset", chunk.offset and chunk.offset + 1), "chunks lost or reordered"),
        (None, lambda chunk: setattr(chunk, "version", "v1"), "a chunk belongs to 'v1'"),
    ],
)
def test_fetch_checkpoint_refuses_a_bad_transfer_and_leaves_nothing(
    trainer, checkpoint_dir, tmp_path, expected_sha256, damage, needle
):
    if expected_sha256 is not None:  # every other digest right
        expected_sha256 = _digests(checkpoint_dir) | expected_sha256
    destination = tmp_path / "drafter" / "v2"
    with pytest.raises(CheckpointError) as error:
        fetch_checkpoint(trainer(damage), "v2", destination, expected_sha256=expected_sha256)
    assert needle in str(error.value)
    assert not destination.exists() and list(destination.parent.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_many_health_watchers_leaving_as_the_server_turns_serving_do_not_freeze_it(echo_server):
    """Every `wait_healthy` caller (a supervisor, a fault injector, a peer) watches health and
    hangs up on SERVING. grpcio's health servicer sent each watcher its update while holding its
    lock, waiting for the write, while the server's one event thread ran a leaving watcher's close
    callback, which takes that lock: the server froze, every call on it hung, and the process kept
    running (a restarted trainer, in a chaos run). 24 watchers on an 8-thread server: a Watch
    holding a pool thread (grpcio's blocking mode) would not let them all register either."""
    address, _, server = echo_server(ServiceConfig(), serving=False)
    watchers = [threading.Thread(target=wait_healthy, args=(address, ServiceConfig()), kwargs={"timeout": 30})
                for _ in range(24)]
    for watcher in watchers:
        watcher.start()
    registry = server._health._watchers
    assert _wait(lambda: len(registry.get("", ())) == len(watchers), 20), "the watchers never registered"
    turned = threading.Thread(target=server.set_serving, daemon=True)
    turned.start()
    turned.join(10)
    assert not turned.is_alive(), "set_serving froze (health servicer deadlock)"
    for watcher in watchers:
        watcher.join(10)
        assert not watcher.is_alive()
    with open_channel(address, ServiceConfig()) as channel:  # and the server still answers
        assert _call(channel, "Unary", b"alive", timeout=5) == b"unary:alive"
