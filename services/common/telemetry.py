"""Traces (OpenTelemetry, W3C trace context) and metrics (Prometheus) for the services.

Tracing: one global SDK `TracerProvider` per process, named after the service; spans are exported
over OTLP/gRPC when an endpoint is configured (``http://host:4317`` = plaintext, ``https://`` =
TLS) and otherwise only propagate context, so traces stay connected across services that do
export. The first `setup_tracing` call in a process wins: later ones (another server in the same
test process, say) keep the existing provider.

Metrics: each service defines its own `prometheus_client` metrics on the default registry, named
like vLLM's with a ``specd:`` prefix (``specd:spec_decode_num_drafts``, ...), and serves them with
`start_metrics_server`.
"""

from __future__ import annotations

import prometheus_client
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def setup_tracing(service_name: str, otlp_endpoint: str = "") -> None:
    """Install the global tracer provider (idempotent: a no-op once an SDK provider is installed)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if otlp_endpoint:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)


def get_tracer(name: str) -> trace.Tracer:
    """A tracer from the global provider (a no-op one until `setup_tracing` runs)."""
    return trace.get_tracer(name)


def start_metrics_server(port: int) -> int:
    """Serve the default Prometheus registry at ``http://0.0.0.0:<port>/metrics`` from a daemon
    thread; ``port`` 0 picks a free one. Returns the bound port."""
    server, _thread = prometheus_client.start_http_server(port)
    return server.server_port
