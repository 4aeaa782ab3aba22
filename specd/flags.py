"""Command-line flags from a settings dataclass, so that a default is written once: in the dataclass.

`add_flags` turns a dataclass's fields into ``--kebab-name`` flags whose defaults are the fields'
and whose help is ``metadata={"help": ...}`` (or the caller's text for a dataclass without it);
`from_flags` builds the dataclass back from the parsed namespace. The library's commands
(`specd.cli`, `specd plan`, `specd bench profile`) declare their flags this way, and so does every
service (`services.common.config.parse_config`), which also passes an environment: then each
flag's default is the variable ``SPECD_<UPPER_NAME>`` when it is set, else the field default
(flag > environment > field default), so a Helm chart can configure a pod through either.

A field whose type is itself a dataclass is flattened: its fields become flags of the same level
under their own names (``VerifierConfig.engine: EngineConfig`` gives ``--block-size``, ``--mode``,
...), their defaults taken from the nested field's default instance, so a service can keep its own
defaults for a library config it embeds.

Supported field types: ``int``, ``float``, ``str``, ``bool`` (``--name`` / ``--no-name``;
environment ``1/0/true/false/yes/no``), ``T | None`` of those scalars (``none`` or an empty string
is None; a field's ``metadata["none"]`` names one more spelling of None, e.g. ``0`` for "no
headroom"), and ``list[T]`` / ``tuple[T, ...]`` of ``int``, ``float`` or ``str`` written
comma-separated (an empty string is the empty list).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

T = TypeVar("T")

ENV_PREFIX = "SPECD_"


@dataclass(frozen=True, slots=True)
class _Leaf:
    """One flag's field: a field of the dataclass, or of a dataclass nested in it."""

    item: dataclasses.Field
    kind: Any
    instance: Any
    """The nested field's default instance, which holds this field's default; None at the top."""

    @property
    def default(self) -> Any:
        """Called only for the flags asked for: a default factory may be costly, or may fail."""
        if self.instance is not None:
            return getattr(self.instance, self.item.name)
        return field_default(self.item)


def _leaves(cls: type, instance: Any = None) -> Iterator[_Leaf]:
    """Every init field of ``cls``, nested dataclasses flattened; defaults from ``instance`` if given."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        kind = hints[item.name]
        if dataclasses.is_dataclass(kind):
            default = getattr(instance, item.name) if instance is not None else field_default(item)
            yield from _leaves(kind, None if default is dataclasses.MISSING else default)
        else:
            yield _Leaf(item, kind, instance)


def field_default(item: dataclasses.Field) -> Any:
    """A field's default (its factory called), or ``dataclasses.MISSING`` when it has none."""
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return dataclasses.MISSING


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of ``cls`` (a nested one too), as its flag shows it."""
    for leaf in _leaves(cls):
        if leaf.item.name == name:
            return leaf.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def flag_types(cls: type) -> dict[str, Any]:
    """Each flag's field name -> its type, nested dataclasses flattened (what a Helm schema lists)."""
    return {leaf.item.name: leaf.kind for leaf in _leaves(cls)}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    names: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    help: Mapping[str, str] | None = None,  # noqa: A002 - argparse's word
    flags: Mapping[str, str] | None = None,
    choices: Mapping[str, Sequence[Any]] | None = None,
) -> None:
    """Add a flag to ``parser`` for each of ``names`` (fields of ``cls``, nested ones flattened; in
    this order), or for every init field when ``names`` is None.

    Each flag's destination is its field's name, so `from_flags` finds it. ``help`` gives the text
    of fields without ``metadata["help"]`` (or this command's own), ``flags`` a flag name other
    than ``--kebab-name``, ``choices`` the values a flag accepts. With ``env`` (a mapping such as
    ``os.environ``) a set ``SPECD_<UPPER_NAME>`` is the flag's default; an unparsable value exits
    through ``parser.error`` naming both the flag and the variable.
    """
    by_name: dict[str, _Leaf] = {}
    for leaf in _leaves(cls):
        if leaf.item.name in by_name:  # a nested dataclass's field named like one beside it
            raise TypeError(f"{cls.__name__}: two fields would both be flag --{leaf.item.name.replace('_', '-')}")
        by_name[leaf.item.name] = leaf
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise KeyError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")
    for name in names if names is not None else list(by_name):
        _add_flag(parser, by_name[name], env, (help or {}).get(name), (flags or {}).get(name),
                  (choices or {}).get(name))


def _add_flag(parser, leaf: _Leaf, env: Mapping[str, str] | None, help_text: str | None, flag: str | None,
              choices: Sequence[Any] | None) -> None:
    name, kind, default = leaf.item.name, leaf.kind, leaf.default
    flag = flag or "--" + name.replace("_", "-")
    env_name = ENV_PREFIX + name.upper()
    names = f"flag {flag}, environment variable {env_name}" if env is not None else f"flag {flag}"
    none = leaf.item.metadata.get("none")
    convert = _converter(kind, names, name, none)
    # The help shows the field default, never the environment's value: that may be a secret.
    shown = "required" if default is dataclasses.MISSING else f"default {_show(default, none)}"
    text = help_text if help_text is not None else leaf.item.metadata.get("help", "")
    if env is not None:
        text = f"{text} [env {env_name}; {shown}]"
    elif default not in ("", None, (), []):  # an empty default says nothing; the help text says what it means
        text = f"{text} [{shown}]"
    options: dict[str, Any] = {"dest": name, "help": text.replace("%", "%%").lstrip()}
    if env is not None and env_name in env:
        try:
            default = convert(env[env_name])
        except argparse.ArgumentTypeError as error:
            parser.error(f"argument {flag} (from environment variable {env_name}): {error}")
    # A required field keeps MISSING as its default, so that the caller can name what is missing.
    options["default"] = default
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
    else:
        # With choices, argparse's usage lists them ({async,sync}) where the metavar would go.
        metavar = None if choices else flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(flag, type=convert, metavar=metavar, choices=choices, **options)


def missing(namespace: argparse.Namespace) -> list[str]:
    """The destinations of required flags that were not given (their value is still MISSING)."""
    return [name for name, value in vars(namespace).items() if value is dataclasses.MISSING]


def from_flags(cls: type[T], namespace: argparse.Namespace | Mapping[str, Any], **values: Any) -> T:
    """``cls`` built from ``values`` and, for every other init field (nested ones flattened), the
    namespace's attribute of its name when there is one; a field absent from both keeps its default
    (for a nested dataclass: its default instance's value)."""
    given = dict(vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace)
    return _build(cls, given, values, None)


def _build(cls: type[T], given: Mapping[str, Any], values: Mapping[str, Any], instance: Any) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        if item.name in values:
            kwargs[item.name] = values[item.name]
        elif dataclasses.is_dataclass(hints[item.name]):
            default = getattr(instance, item.name) if instance is not None else field_default(item)
            kwargs[item.name] = _build(hints[item.name], given, {},
                                       None if default is dataclasses.MISSING else default)
        elif item.name in given:
            kwargs[item.name] = given[item.name]
        elif instance is not None:
            kwargs[item.name] = getattr(instance, item.name)
    return cls(**kwargs)


# ---------------------------------------------------------------------- parsing one value
_SCALARS: dict[type, str] = {int: "an integer", float: "a number", str: "a string"}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")
_NONE = ("", "none")


def _converter(kind: Any, names: str, field_name: str, none: Any = None) -> Callable[[str], Any]:
    """A string -> value function for ``kind`` whose errors name the flag (and the variable)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is bool:
        return lambda text: _parse_bool(text, names)
    if kind in _SCALARS:
        return lambda text: _parse_scalar(kind, text, names)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        if inner in _SCALARS:
            spellings = (*_NONE, str(none)) if none is not None else _NONE
            return lambda text: None if text.strip().lower() in spellings else _parse_scalar(inner, text, names)
    if origin is list and len(args) == 1 and args[0] in _SCALARS:
        return lambda text: [_parse_scalar(args[0], part, names) for part in _split(text)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        return lambda text: tuple(_parse_scalar(args[0], part, names) for part in _split(text))
    raise TypeError(
        f"settings field {field_name!r} has type {kind!r}; flags support int, float, str, bool, T | None "
        "and list[T] / tuple[T, ...] of int, float or str"
    )


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


def _show(value: Any, none: Any = None) -> str:
    if value is None and none is not None:
        return repr(none)
    if isinstance(value, (list, tuple)):
        return repr(",".join(str(part) for part in value))
    return repr(value)
