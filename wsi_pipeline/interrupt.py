"""Ctrl-C that is never lost.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be; when that is
a finalizer (``__del__``, a weakref callback: a closing file, store or thread pool), the exception
is printed as "ignored" and the work goes on, so a long run would not stop. The command line
installs :func:`install`'s handler, which also records the request, and the long loops call
:func:`check` between units of work (a bag, an epoch, a slide), which raises the interrupt again.
Without the handler (library use), :func:`check` does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["check", "install", "requested"]

_requested = threading.Event()


def _handler(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    raise KeyboardInterrupt


def install() -> Callable[[], None]:
    """Handle SIGINT by recording it and raising ``KeyboardInterrupt``; returns a function that puts
    the previous handler back. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _requested.clear()
    previous: Any = signal.signal(signal.SIGINT, _handler)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()

    return restore


def requested() -> bool:
    """Whether Ctrl-C was pressed since :func:`install`."""
    return _requested.is_set()


def check() -> None:
    """Raise ``KeyboardInterrupt`` when Ctrl-C was pressed (even if its first raise was swallowed)."""
    if _requested.is_set():
        raise KeyboardInterrupt
