"""The generic builder: a YAML mapping -> a frozen dataclass, every error naming the field's path.

:func:`build` checks a mapping against a dataclass's annotations: unknown keys, missing required
keys, values of the wrong type and values outside a field's choices or range raise
``ValueError``/``TypeError`` naming the path (``methods[2].train.lr: expected a number, got str
'x'``). Dataclass fields may carry metadata made by :func:`spec`:

- ``parse``: a function ``(value, where) -> typed value`` for a field whose YAML form differs from
  its dataclass form (e.g. a protocol written ``sub256x100``);
- ``choices``: the allowed values, or a function returning them (a registry's names), checked
  after the type;
- ``gt`` / ``ge`` / ``lt`` / ``le``: numeric bounds (None values pass); every user count and size has a
  lower and an upper bound, and an error about either names the whole allowed range;
- ``check``: a function ``(value, where) -> Any`` raising ``ValueError`` naming ``where`` for a value
  no bound or choice list describes (e.g. a device name, ``cuda:<index>``).

The choices, bounds and ``check`` of a field are applied to values read from YAML by :func:`build`
and to every directly constructed section by :class:`Checked`: the one place a value is checked.

Annotations understood: ``bool``, ``int``, ``float`` (ints and YAML-1.1 strings such as ``1e-4``
accepted), ``str``, ``Literal[...]``, ``X | None``, ``tuple[X, ...]``, ``tuple[X, Y]``,
``dict[str, Any]``, ``Any`` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast
from wsi_pipeline.config.io import short_repr
from wsi_pipeline.failures import ConfigTypeError

__all__ = ["Checked", "build", "check_fields", "coerce", "positive", "spec", "type_name"]

Choices = Sequence[Any] | Callable[[], Sequence[Any]]
T = TypeVar("T")


def spec(
    *,
    parse: Callable[[Any, str], Any] | None = None,
    choices: Choices | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    check: Callable[[Any, str], Any] | None = None,
) -> dict[str, Any]:
    """Field metadata for :func:`build` and :class:`Checked`: ``field(default=..., metadata=spec(gt=0))``."""
    out: dict[str, Any] = {}
    for key, value in (("parse", parse), ("choices", choices), ("gt", gt), ("ge", ge), ("lt", lt), ("le", le), ("check", check)):
        if value is not None:
            out[key] = value
    return out


def type_name(tp: Any) -> str:
    """How an annotation reads in an error message (``a number``, ``one of 'a', 'b'``, ...)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {type_name(args[0])}"
        return f"a list of {len(args)} values ({', '.join(type_name(a) for a in args)})"
    if origin in (dict, Mapping) or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` (from YAML) against the annotation ``tp``; return the typed value."""
    origin = typing.get_origin(tp)
    wrong = ConfigTypeError(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {short_repr(value)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise wrong
        others = [a for a in args if a is not type(None)]
        for arg in others:
            try:
                return coerce(value, arg, where)
            except (TypeError, ValueError) as e:
                last = e
        if len(others) == 1 and isinstance(last, ValueError):
            raise last  # the type fits, the value does not (e.g. outside a Literal's choices)
        raise wrong
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{where}={short_repr(value)}; expected {type_name(tp)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise wrong
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise wrong
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise wrong
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if tp is float:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads `1e-4` (no dot) as a string; accept it as the number it spells.
            try:
                return float(value)
            except ValueError:
                raise wrong from None
        raise wrong
    if tp is str:
        if not isinstance(value, str):
            raise wrong
        return value
    raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a bug in a section, not in the YAML


_BOUND_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_BOUND_TESTS: dict[str, Callable[[Any, Any], bool]] = {
    "gt": lambda v, b: v > b, "ge": lambda v, b: v >= b, "lt": lambda v, b: v < b, "le": lambda v, b: v <= b}


def _range(meta: Mapping[str, Any]) -> str:
    """`` (allowed: >= 1 and <= 100000)`` for a field bounded on both sides, else empty: the whole range in one error."""
    low = [k for k in ("gt", "ge") if k in meta]
    high = [k for k in ("lt", "le") if k in meta]
    if not (low and high):
        return ""
    return f" (allowed: {_BOUND_SIGNS[low[0]]} {meta[low[0]]} and {_BOUND_SIGNS[high[0]]} {meta[high[0]]})"


def _check(value: Any, meta: Mapping[str, Any], where: str) -> None:
    """The ``choices``, bounds and ``check`` of a field's :func:`spec` (None passes)."""
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None:
        allowed = list(choices() if callable(choices) else choices)
        if value not in allowed:
            raise ValueError(f"{where}={short_repr(value)}; expected one of {allowed}")
    for key, holds in _BOUND_TESTS.items():
        if key in meta and not holds(value, meta[key]):
            raise ValueError(f"{where}={short_repr(value)}; expected a value {_BOUND_SIGNS[key]} {meta[key]}{_range(meta)}")
    if "check" in meta:
        meta["check"](value, where)


def check_fields(obj: Any) -> None:
    """Check every field of dataclass instance ``obj`` against its :func:`spec` choices and bounds.

    The same check :func:`build` applies to YAML, run on the constructed object, so a section made
    directly in code (``StoreSettings(tile_size=-1)``) is refused as one read from a file is; the error
    names ``Class.field``.
    """
    cls_name = type(obj).__name__
    for f in dataclasses.fields(obj):
        if f.metadata:
            _check(getattr(obj, f.name), f.metadata, f"{cls_name}.{f.name}")


class Checked:
    """Base of every config dataclass: :func:`check_fields` runs after construction.

    A subclass with its own ``__post_init__`` calls ``super().__post_init__()`` first.
    """

    def __post_init__(self) -> None:
        check_fields(self)


def build(cls: type[T], raw: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from mapping ``raw``; ``where`` is the section's path (``""``: top level).

    Raises ``ValueError`` for an unknown key (naming it, its section and the valid keys), a missing
    required key or a value outside its choices or bounds; ``TypeError`` for a value of the wrong
    type (naming the field's path and the expected type).
    """
    declared = dataclasses.fields(cast(Any, cls))  # cls is a dataclass (T stays the caller's type)
    if not isinstance(raw, Mapping):
        raise ConfigTypeError(f"{where or 'config'}: expected a mapping with keys {[f.name for f in declared]}, got {type(raw).__name__} {short_repr(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in declared}
    section = where or "top level"
    for key in raw:
        if key not in fields:
            raise ValueError(f"unknown key {key!r} in section {section!r}; valid keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        sub = f"{where}.{name}" if where else name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing required key {name!r} in section {section!r}")
            continue
        parse = f.metadata.get("parse")
        value = parse(raw[name], sub) if parse else coerce(raw[name], hints[name], sub)
        _check(value, f.metadata, sub)
        kwargs[name] = value
    return cls(**kwargs)


def positive(where: str, value: float) -> None:
    """``ValueError`` naming ``where`` unless ``value > 0`` (checks in a section's ``__post_init__``)."""
    if not value > 0:
        raise ValueError(f"{where}={value}; expected a value > 0")
