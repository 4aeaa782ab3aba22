"""One config dataclass per service; CLI flags and ``SPECD_*`` environment variables derive from it.

A service subclasses `ServiceConfig` (``@dataclass(kw_only=True)``), adds its own fields with
``metadata={"help": ...}``, and calls ``parse_config(MyConfig)`` in ``main``. Every field becomes a
flag ``--kebab-name`` whose default is the environment variable ``SPECD_<UPPER_NAME>`` when set,
else the field default, so a Helm chart can configure a pod through either. Precedence:
flag > environment > field default. A field whose type is a library settings dataclass (the
verifier's ``engine: EngineConfig``) is flattened: its fields are flags and variables of their own
names. The machinery, and the field types it supports, is the library's (`specd.flags`): the
library's commands derive their flags the same way. A subclass that defines ``__post_init__``
must call ``super().__post_init__()`` so the checks below still run.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TypeVar

from specd.flags import ENV_PREFIX, add_flags, from_flags, missing

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(kw_only=True)
class ServiceConfig:
    """What every specd gRPC service is configured with; the defaults run on a laptop."""

    host: str = field(
        default="127.0.0.1", metadata={"help": "address the gRPC server binds (0.0.0.0 in a pod)"}
    )
    port: int = field(default=0, metadata={"help": "gRPC port (0 = a free one)"})
    metrics_port: int = field(
        default=-1, metadata={"help": "Prometheus /metrics port (-1 = no endpoint, 0 = a free one)"}
    )
    auth_token: str = field(
        default="",
        metadata={
            "help": "bearer token required on every call (health checks exempt) and sent on outgoing "
            "calls; empty = no auth"
        },
    )
    tls_cert: str = field(
        default="", metadata={"help": "server PEM certificate file (with --tls-key: serve TLS)"}
    )
    tls_key: str = field(
        default="", metadata={"help": "server PEM private key file (with --tls-cert: serve TLS)"}
    )
    tls_ca: str = field(
        default="",
        metadata={"help": "PEM CA bundle to trust on outgoing calls; set = outgoing channels use TLS"},
    )
    otlp_endpoint: str = field(
        default="",
        metadata={"help": "OTLP/gRPC collector for traces, e.g. http://otel-collector:4317; empty = no export"},
    )
    drain_seconds: float = field(
        default=10.0,
        metadata={"help": "on SIGTERM: report NOT_SERVING, then this long to finish in-flight calls"},
    )
    deadline_seconds: float = field(
        default=30.0, metadata={"help": "deadline of every outgoing unary call that does not set its own"}
    )
    log_level: str = field(default="info", metadata={"help": f"logging level, one of {', '.join(LOG_LEVELS)}"})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = a free one), got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be in [-1, 65535] (-1 = none, 0 = a free one), got {self.metrics_port}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(
                "tls_cert and tls_key go together: set both to serve TLS, or neither for plaintext "
                f"(got tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r})"
            )
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if self.deadline_seconds <= 0:
            raise ValueError(f"deadline_seconds must be > 0, got {self.deadline_seconds}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
    description: str = "",
) -> T:
    """Build ``cls`` from command-line flags (``argv``, default ``sys.argv[1:]``) over environment
    variables (``env``, default ``os.environ``) over the field defaults.

    A bad value, from a flag or from the environment, exits (status 2) with argparse's usage message
    naming both the flag and the environment variable; so does a ``ValueError`` raised by the
    dataclass's own checks.
    """
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip())
    add_flags(parser, cls, env=env)
    values = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    absent = missing(values)
    if absent:
        parser.error(
            "missing required settings: "
            + ", ".join(f"--{name.replace('_', '-')} (or {ENV_PREFIX}{name.upper()})" for name in absent)
        )
    try:
        return from_flags(cls, values)
    except ValueError as error:
        parser.error(str(error))
