"""Values of the viewer's requests: numbers from the query string and the path, checked before use.

A value that is missing, not a number, not finite or out of range is a :class:`BadRequest` (a 400 on the page)
naming the parameter, the value and the range expected: never an ``OverflowError`` from ``int(float("inf"))``
deep in a reader.
"""

from __future__ import annotations

import math

__all__ = ["BadRequest", "integer", "number"]


class BadRequest(ValueError):
    """A request value the viewer cannot use (400); the message names it and what is expected."""


def number(query: dict[str, str], name: str, lo: float, hi: float, default: float | None = None) -> float:
    """The finite number ``query[name]`` in ``[lo, hi]`` (``default`` when absent, if given)."""
    raw = query.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"{name} missing: expected a number in [{lo:g}, {hi:g}]")
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{name}={raw[:40]!r} is not a number: expected a number in [{lo:g}, {hi:g}]") from None
    if not math.isfinite(value):
        raise BadRequest(f"{name}={raw[:40]!r} is not a finite number: expected a number in [{lo:g}, {hi:g}]")
    if not lo <= value <= hi:
        raise BadRequest(f"{name}={raw[:40]!r} outside the range: expected a number in [{lo:g}, {hi:g}]")
    return value


def integer(raw: str | None, name: str, lo: int, hi: int, default: int | None = None) -> int:
    """The integer ``raw`` (a query value or a path part) in ``[lo, hi]`` (``default`` when None, if given)."""
    if raw is None:
        if default is None:
            raise BadRequest(f"{name} missing: expected an integer in [{lo}, {hi}]")
        return default
    text = raw.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit() and len(text) <= 20):
        raise BadRequest(f"{name}={raw[:40]!r} is not an integer: expected an integer in [{lo}, {hi}]")
    value = int(text)
    if not lo <= value <= hi:
        raise BadRequest(f"{name}={value} outside the range: expected an integer in [{lo}, {hi}]")
    return value
