"""The gRPC plumbing every specd service shares: a server and outgoing channels.

`GrpcServer` is a ``grpc.server`` with, in order of interception:

- **tracing**: OpenTelemetry's server interceptor continues the caller's W3C trace context (the
  ``traceparent`` metadata) in a SERVER span per call;
- **auth**: with ``auth_token`` set, every call must carry ``authorization: Bearer <token>`` or it
  ends UNAUTHENTICATED. ``grpc.health.v1.Health`` is exempt (Kubernetes' gRPC probes send no
  metadata) and untraced (probes every few seconds would drown the traces);
- **drain gate**: once draining, every new call (health excepted) ends UNAVAILABLE, "retry on
  another replica", while the calls already running go on;
- **health** (``grpc.health.v1``): NOT_SERVING from `start` until the service calls `set_serving`
  (its weights are loaded); the overall status ``""`` and each service name move together;
- **reflection**, so ``grpcurl`` works without the protos;
- **TLS** when ``tls_cert`` and ``tls_key`` are set;
- **drain**: `wait_for_termination` turns SIGTERM into: `draining` (the gate closes), NOT_SERVING,
  the service's ``on_drain()``, then grpc's ``stop(drain_seconds)``, which sends GOAWAY (clients
  reconnect elsewhere at once, which a long-lived channel through a Kubernetes Service needs) and
  gives in-flight calls ``drain_seconds`` to finish. A call that races that GOAWAY ends CANCELLED
  or UNAVAILABLE; both mean "retry on another replica". A second signal stops at once.
  ``drain_seconds`` is the budget of the whole drain (``on_drain`` and grpc's stop together, with
  at least a second left for the stop); the pod's ``terminationGracePeriodSeconds`` must exceed it.

`open_channel` is the client side: TLS when ``tls_ca`` is set, and one interceptor that opens a
CLIENT span per call and injects its W3C context, adds the bearer token, and gives every unary
call without its own deadline ``deadline_seconds``. It is ours rather than OpenTelemetry's
``client_interceptor``: that one turns a server-streaming call into a bare generator (no
``cancel()``, ``code()``, ...) and keeps its span current in the caller's thread for as long as the
stream is open; this one returns grpc's own call objects and ends the span when the call is done.

Messages may be up to `MAX_MESSAGE_BYTES` both ways: Score answers with full distributions are
``rows x vocab`` float32, far above grpc's 4 MiB default. ``SO_REUSEPORT`` is off, so a port that
is taken fails to bind instead of silently sharing traffic with another process.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import filters, server_interceptor

from services.common.config import ServiceConfig
from services.common.health import HealthServicer
from services.common.telemetry import get_tracer, setup_tracing

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"


def _options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


# ---------------------------------------------------------------------------- server side
class _BearerAuth(grpc.ServerInterceptor):
    """Ends every call UNAUTHENTICATED unless its metadata has ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(_HEALTH_PREFIX):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        # The scheme is case-insensitive (RFC 7235), as the HTTP API already takes it.
        scheme, _, token = (presented or "").strip().partition(" ")
        if presented is None:
            problem = "missing bearer token: send metadata 'authorization: Bearer <token>' (the auth_token)"
        elif scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._expected):
            problem = "wrong bearer token: send 'authorization: Bearer <token>' with this service's auth_token"
        else:
            return continuation(handler_call_details)
        return _refusal(continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED, problem)


class _DrainGate(grpc.ServerInterceptor):
    """Ends every new call UNAVAILABLE once ``draining`` is set (health checks still answer)."""

    def __init__(self, draining: threading.Event) -> None:
        self._draining = draining

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if not self._draining.is_set() or handler_call_details.method.startswith(_HEALTH_PREFIX):
            return handler
        return _refusal(handler, grpc.StatusCode.UNAVAILABLE, "draining (shutting down): retry on another replica")


def _refusal(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code`` without reading a
    request (an unknown method gets a unary one)."""

    def refuse(request_or_iterator: Any, context: grpc.ServicerContext) -> NoReturn:
        abort(context, code, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class GrpcServer:
    """A grpc.server with interceptors (bearer auth, OpenTelemetry W3C tracing), grpc.health.v1 and
    reflection, TLS when configured, and SIGTERM drain (see the module docstring).

    Usage: ``add_XxxServicer_to_server(servicer, grpc_server.server)``, then ``start([names])``,
    load weights, ``set_serving()``, and ``wait_for_termination()`` from the main thread. The
    Prometheus endpoint is the service's to start (`telemetry.start_metrics_server`).
    """

    def __init__(self, name: str, config: ServiceConfig, *, max_workers: int = 32) -> None:
        self.name = name
        self.config = config
        setup_tracing(name, config.otlp_endpoint)
        interceptors: list[grpc.ServerInterceptor] = [
            server_interceptor(filter_=filters.negate(filters.health_check()))
        ]
        if config.auth_token:
            interceptors.append(_BearerAuth(config.auth_token))
        self._draining = threading.Event()
        interceptors.append(_DrainGate(self._draining))
        self.server: grpc.Server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{name}-grpc"),
            interceptors=interceptors,
            options=[*_options(), ("grpc.so_reuseport", 0)],
        )
        self._health = HealthServicer()  # grpcio's froze under leaving watchers (services.common.health)
        self._health_names: tuple[str, ...] = ()

    def start(self, service_names: Sequence[str]) -> int:
        """Register health and reflection for ``service_names`` (full names, e.g.
        "specd.v1.Drafter"), bind ``host:port`` (TLS when configured), start serving with health
        NOT_SERVING, and return the bound port."""
        if self._health_names:
            raise RuntimeError(f"{self.name}: GrpcServer.start was already called; call it once")
        self._health_names = (health.OVERALL_HEALTH, *service_names)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflected = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(reflected, self.server)
        self.set_serving(False)

        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.tls_cert:
                key, cert = Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes()
                port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                port = self.server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(
                f"{self.name}: cannot bind gRPC address {address} (port taken or host not local?): "
                "choose another --port / --host"
            ) from error
        self.server.start()
        security = "TLS" if self.config.tls_cert else "plaintext"
        logger.info("%s: gRPC on %s:%d (%s)", self.name, self.config.host, port, security)
        return port

    def set_serving(self, serving: bool = True) -> None:
        """Health SERVING / NOT_SERVING for "" and every service name; ignored once draining."""
        statuses = health_pb2.HealthCheckResponse
        status = statuses.SERVING if serving else statuses.NOT_SERVING
        for service in self._health_names:
            self._health.set(service, status)

    @property
    def draining(self) -> bool:
        """True from the first SIGTERM/SIGINT (or `stop`) on: new calls are refused UNAVAILABLE,
        and a long-running servicer (a stream) may use it to wind down early."""
        return self._draining.is_set()

    def stop(self, grace: float | None = None) -> None:
        """Draining and NOT_SERVING for good, then stop: new calls are refused and in-flight ones
        get ``grace`` seconds (None: cancelled now). Returns when the server has stopped."""
        self._draining.set()
        self._health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def wait_for_termination(self, on_drain: Callable[[], None] | None = None) -> None:
        """Block until the server stops. Call from the main thread: it installs SIGTERM/SIGINT
        handlers. On the first signal: `draining`, NOT_SERVING, ``on_drain()`` (e.g. stop pulling
        work from Redis), then `stop` with ``drain_seconds`` of grace; a second signal cancels
        in-flight calls at once. The previous handlers are restored on return."""

        def drain() -> None:
            # One budget for the whole drain: what on_drain spent (a verifier finishing its
            # requests) is not given to grpc's stop again, which then only lets the calls that
            # on_drain ended send their last message.
            start = time.monotonic()
            if on_drain is not None:
                on_drain()
            self.stop(max(1.0, self.config.drain_seconds - (time.monotonic() - start)))

        def on_signal(signum: int, frame: object) -> None:
            if self.draining:
                logger.warning("%s: second %s: stopping now", self.name, signal.Signals(signum).name)
                self.server.stop(None)
                return
            name, grace = signal.Signals(signum).name, self.config.drain_seconds
            logger.info("%s: %s: draining for up to %.1fs", self.name, name, grace)
            self._draining.set()
            self._health.enter_graceful_shutdown()
            # The drain runs on its own thread: a signal handler must return for the main thread
            # to keep waiting (and to see a second signal).
            drainer.start()

        drainer = threading.Thread(target=drain, name=f"{self.name}-drain")
        previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.server.wait_for_termination()
            if drainer.is_alive():
                drainer.join()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


# ---------------------------------------------------------------------------- client side
@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


_Details = grpc.ClientCallDetails
_Continuation = Callable[[_Details, Any], Any]


class _OutgoingCalls(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds to every outgoing call a CLIENT span (its W3C context in the metadata), the bearer
    token, and the default deadline of unary calls."""

    def __init__(self, config: ServiceConfig) -> None:
        self._token = config.auth_token
        self._deadline = config.deadline_seconds
        self._tracer = get_tracer(__name__)

    def _call(self, continuation: _Continuation, details: _Details, request: Any, *, unary: bool) -> Any:
        metadata = list(details.metadata or ())
        if self._token:
            metadata.append(("authorization", f"Bearer {self._token}"))
        timeout = self._deadline if unary and details.timeout is None else details.timeout
        span = None
        if not details.method.startswith(_HEALTH_PREFIX):
            service, _, method = details.method.lstrip("/").partition("/")
            span = self._tracer.start_span(
                details.method.lstrip("/"),
                kind=trace.SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
            )
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            metadata.extend(carrier.items())
        new_details = _CallDetails(
            method=details.method,
            timeout=timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
            compression=details.compression,
        )
        call = continuation(new_details, request)
        if span is not None:
            call.add_done_callback(lambda done: _end_span(span, done))
        return call

    # grpc's four interceptor interfaces; only a unary call gets the default deadline.
    def intercept_unary_unary(self, continuation: _Continuation, details: _Details, request: Any) -> Any:
        return self._call(continuation, details, request, unary=True)

    def intercept_unary_stream(self, continuation: _Continuation, details: _Details, request: Any) -> Any:
        return self._call(continuation, details, request, unary=False)

    def intercept_stream_unary(self, continuation: _Continuation, details: _Details, requests: Any) -> Any:
        return self._call(continuation, details, requests, unary=False)

    def intercept_stream_stream(self, continuation: _Continuation, details: _Details, requests: Any) -> Any:
        return self._call(continuation, details, requests, unary=False)


def _end_span(span: trace.Span, call: grpc.Call) -> None:
    code = call.code()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {call.details()}"))
    span.end()


def open_channel(address: str, config: ServiceConfig) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or "dns:///name:port"; the latter with round-robin
    over the resolved addresses, e.g. a headless Kubernetes Service): TLS when ``config.tls_ca`` is
    set, and every call traced, authenticated and (unary) given a deadline (module docstring)."""
    options: list[tuple[str, Any]] = [*_options(), ("grpc.lb_policy_name", "round_robin")]
    if config.tls_ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(config.tls_ca).read_bytes())
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _OutgoingCalls(config))


def wait_healthy(address: str, config: ServiceConfig, *, timeout: float = 60.0, service: str = "") -> None:
    """Return once ``address`` reports SERVING for ``service`` ("" = the whole server).

    Watches grpc.health.v1 (the server pushes each change) and waits for the connection rather
    than polling, so it returns as soon as the server is ready. TimeoutError, naming the address
    and the last status seen, when that does not happen within ``timeout`` seconds.
    """
    end = time.monotonic() + timeout
    last = "no answer (not listening yet?)"
    with open_channel(address, config) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := end - time.monotonic()) > 0:
            try:
                for response in stub.Watch(
                    health_pb2.HealthCheckRequest(service=service), timeout=remaining, wait_for_ready=True
                ):
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise RuntimeError(
                        f"{address} does not serve grpc.health.v1: is it a specd service?"
                    ) from error
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The server went away mid-watch (restart, drain): watch again; wait_for_ready
                    # waits for the reconnection, so this does not spin.
                    last = f"{error.code().name}: {error.details()}"
    raise TimeoutError(
        f"{address} did not become healthy (SERVING for service {service!r}) within {timeout:.1f}s; "
        f"last status: {last}"
    )


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with ``code`` and ``message`` (typed NoReturn, unlike ``context.abort``)."""
    context.abort(code, message)
    raise AssertionError("grpc.ServicerContext.abort returned instead of raising")
