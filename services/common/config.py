"""One config dataclass per service; CLI flags and ``SPECD_*`` environment variables derive from it.

A service subclasses `ServiceConfig` (``@dataclass(kw_only=True)``), adds its own fields with
``metadata={"help": ...}``, and calls ``parse_config(MyConfig)`` in ``main``. Every field becomes a
flag ``--kebab-name`` whose default is the environment variable ``SPECD_<UPPER_NAME>`` when set,
else the field default, so a Helm chart can configure a pod through either. Precedence:
flag > environment > field default.

Supported field types: ``int``, ``float``, ``str``, ``bool`` (``--name`` / ``--no-name``;
environment ``1/0/true/false/yes/no``), and ``list[T]`` / ``tuple[T, ...]`` of ``int``, ``float`` or
``str`` written comma-separated (an empty string is the empty list). A subclass that defines
``__post_init__`` must call ``super().__post_init__()`` so the checks below still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

ENV_PREFIX = "SPECD_"
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
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):  # type: ignore[arg-type]
        if item.init:
            _add_field(parser, item, hints[item.name], env)
    values = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
    missing = [name for name, value in values.items() if value is dataclasses.MISSING]
    if missing:
        parser.error(
            "missing required settings: "
            + ", ".join(f"--{name.replace('_', '-')} (or {ENV_PREFIX}{name.upper()})" for name in missing)
        )
    try:
        return cls(**values)
    except ValueError as error:
        parser.error(str(error))


def _add_field(
    parser: argparse.ArgumentParser, item: dataclasses.Field, kind: Any, env: Mapping[str, str]
) -> None:
    flag = "--" + item.name.replace("_", "-")
    env_name = ENV_PREFIX + item.name.upper()
    names = f"flag {flag}, environment variable {env_name}"
    convert = _converter(kind, names, item.name)

    if item.default is not dataclasses.MISSING:
        default = item.default
    elif item.default_factory is not dataclasses.MISSING:
        default = item.default_factory()
    else:
        default = dataclasses.MISSING
    # The help shows the field default, never the environment's value: that may be a secret.
    shown = "required" if default is dataclasses.MISSING else f"default {_show(default)}"
    help_text = f"{item.metadata.get('help', '')} [env {env_name}; {shown}]".replace("%", "%%")
    if env_name in env:
        try:
            default = convert(env[env_name])
        except argparse.ArgumentTypeError as error:
            parser.error(f"argument {flag} (from environment variable {env_name}): {error}")
    # A required field keeps MISSING as its default, so parse_config can name flag and variable.
    options: dict[str, Any] = {"dest": item.name, "help": help_text, "default": default}
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
    else:
        parser.add_argument(flag, type=convert, metavar=item.name.upper(), **options)


def _converter(kind: Any, names: str, field_name: str) -> Callable[[str], Any]:
    """A string -> value function for ``kind`` whose errors name the flag and the env variable."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is bool:
        return lambda text: _parse_bool(text, names)
    if kind in _SCALARS:
        return lambda text: _parse_scalar(kind, text, names)
    if origin is list and len(args) == 1 and args[0] in _SCALARS:
        return lambda text: [_parse_scalar(args[0], part, names) for part in _split(text)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        return lambda text: tuple(_parse_scalar(args[0], part, names) for part in _split(text))
    raise TypeError(
        f"config field {field_name!r} has type {kind!r}; parse_config supports int, float, str, bool and "
        "list[T] / tuple[T, ...] of int, float or str"
    )


_SCALARS: dict[type, str] = {int: "an integer", float: "a number", str: "a string"}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _parse_scalar(kind: type, text: str, names: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {_SCALARS[kind]}, got {text!r} ({names})") from None


def _parse_bool(text: str, names: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise argparse.ArgumentTypeError(
        f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {text!r} ({names})"
    )


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",")] if text.strip() else []


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return repr(",".join(str(part) for part in value))
    return repr(value)
