"""Instrumentation of Big-Layer chunk transfers (used by the budget test and for profiling).

Every chunk step of a Big-Layer reports its transfers to the registered hooks:
``h2d`` (a tensor sent to the compute device), ``d2h`` (a result sent back to host memory),
``chunk`` (one chunk step finished: ``numel`` is everything it moved, inputs plus outputs) and
``free`` (a chunk tensor on the device was released), and ``handoff`` (the whole tensor where
the Big-Layer stages end: ``handoff/forward`` moves it to the device, ``handoff/backward`` moves
its gradient back to the host; not a chunk, so outside the chunk budget). ``resident`` is the
number of elements of chunk tensors alive on the device right after the event. Every event
carries its bytes (``nbytes``); ``start`` opens each pass (before its first chunk) and ``end``
closes it (after its last chunk's results are stored). Hooks cost nothing when none is registered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["TransferEvent", "TransferMonitor", "register_transfer_hook", "monitor_transfers"]


@dataclass(frozen=True)
class TransferEvent:
    """One chunk transfer.

    Attributes
    ----------
    kind
        ``"h2d"``, ``"d2h"``, ``"chunk"``, ``"free"``, ``"handoff"``, ``"start"`` or ``"end"``.
    layer
        Qualified name of the Big-Layer and its pass, e.g. ``"layer1.0.conv1/forward"``.
    chunk
        Index of the chunk step within the pass (-1 for ``free``).
    numel
        Elements moved (``chunk``: inputs plus outputs of the step; ``free``: elements released).
    resident
        Elements of chunk tensors alive on the compute device after this event.
    samples, rows, full
        ``chunk`` events only: samples and output rows of the step, and whether it held whole
        samples (0, 0, False otherwise).
    nbytes
        Bytes of ``numel`` (``h2d``/``d2h``/``free``: the tensor's; ``chunk``: everything the step
        moved, each tensor at its own element size).
    """

    kind: str
    layer: str
    chunk: int
    numel: int
    resident: int
    samples: int = 0
    rows: int = 0
    full: bool = False
    nbytes: int = 0


_hooks: dict[int, Callable[[TransferEvent], None]] = {}
_next_id = 0
_lock = threading.Lock()
_resident = 0


class _Handle:
    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        _hooks.pop(self._key, None)


def register_transfer_hook(fn: Callable[[TransferEvent], None]) -> _Handle:
    """Call ``fn(event)`` for every Big-Layer transfer; returns a handle with ``.remove()``."""
    global _next_id
    with _lock:
        key = _next_id
        _next_id += 1
        _hooks[key] = fn
    return _Handle(key)


def active() -> bool:
    """Whether any hook is registered (the runner skips all bookkeeping otherwise)."""
    return bool(_hooks)


def _emit(kind: str, layer: str, chunk: int, numel: int, samples: int = 0, rows: int = 0, full: bool = False,
          nbytes: int = 0) -> None:
    event = TransferEvent(kind, layer, chunk, numel, _resident, samples, rows, full, nbytes)
    for fn in list(_hooks.values()):
        fn(event)


def _released(layer: str, numel: int, nbytes: int) -> None:
    global _resident
    with _lock:
        _resident -= numel
    if _hooks:
        _emit("free", layer, -1, numel, nbytes=nbytes)


def track(kind: str, layer: str, chunk: int, t: torch.Tensor) -> None:
    """Report tensor ``t`` (a chunk on the device) and count it resident until it is freed."""
    global _resident
    n = t.numel()
    nbytes = n * t.element_size()
    with _lock:
        _resident += n
    # the finaliser fires when the last Python reference to this chunk tensor goes away
    weakref.finalize(t, _released, layer, n, nbytes)
    _emit(kind, layer, chunk, n, nbytes=nbytes)


def handoff(layer: str, t: torch.Tensor) -> None:
    """Report the whole-tensor move where the Big-Layer stages end (``layer``: ``handoff/forward``
    host -> device, ``handoff/backward`` device -> host)."""
    _emit("handoff", layer, 0, t.numel(), nbytes=t.numel() * t.element_size())


class _FlopProbe:
    counter = None  # an object with ``total`` (FLOPs so far), set while a step is counted


def set_flop_counter(counter) -> None:
    """Let dry runs read and add FLOPs (``counter.total``) while ``counter`` counts a step; None to stop."""
    _FlopProbe.counter = counter


def flop_total() -> int:
    """FLOPs counted so far by the registered counter (0 without one)."""
    return 0 if _FlopProbe.counter is None else _FlopProbe.counter.total


def add_flops(n: int) -> None:
    """Add ``n`` FLOPs to the registered counter (a dry run replaying a chunk it did not compute)."""
    if _FlopProbe.counter is not None:
        _FlopProbe.counter.total += n


def report(kind: str, layer: str, chunk: int, numel: int, nbytes: int) -> None:
    """Report a transfer of ``numel`` elements (``nbytes``) without a tensor (a replayed dry-run chunk)."""
    _emit(kind, layer, chunk, numel, nbytes=nbytes)


def pass_start(layer: str) -> None:
    """Report the start of a pass (before its first chunk is loaded)."""
    _emit("start", layer, 0, 0)


def pass_end(layer: str) -> None:
    """Report the end of a pass (its last chunk's results stored, or the pass stopped by an error)."""
    _emit("end", layer, 0, 0)


def chunk_done(layer: str, chunk: int, numel: int, samples: int, rows: int, full: bool, nbytes: int = 0) -> None:
    """Report the end of one chunk step that moved ``numel`` elements (``nbytes`` bytes) in and out."""
    _emit("chunk", layer, chunk, numel, samples, rows, full, nbytes)


@dataclass
class TransferMonitor:
    """Collects events; see :func:`monitor_transfers`.

    Attributes
    ----------
    events
        Every event in order.
    max_transfer
        Largest single tensor sent to the device (elements).
    max_chunk
        Largest chunk step, inputs plus outputs (elements).
    peak_resident
        Most elements of chunk tensors alive on the device at once.
    """

    events: list[TransferEvent] = field(default_factory=list)
    max_transfer: int = 0
    max_chunk: int = 0
    peak_resident: int = 0

    def __call__(self, e: TransferEvent) -> None:
        self.events.append(e)
        if e.kind == "h2d":
            self.max_transfer = max(self.max_transfer, e.numel)
        elif e.kind == "chunk":
            self.max_chunk = max(self.max_chunk, e.numel)
        if e.kind not in ("start", "end"):  # a pass's ends: earlier chunks may not be collected yet
            self.peak_resident = max(self.peak_resident, e.resident)

    def count(self, kind: str) -> int:
        """Number of events of one kind."""
        return sum(e.kind == kind for e in self.events)

    def bytes(self, kind: str) -> int:
        """Bytes moved by the events of one kind (``"h2d"``: host to device, ``"d2h"``: back)."""
        return sum(e.nbytes for e in self.events if e.kind == kind)

    def to_device_bytes(self) -> int:
        """Every byte sent host -> device: chunk inputs plus the forward hand-off."""
        return self.bytes("h2d") + sum(e.nbytes for e in self.events if e.kind == "handoff" and e.layer.endswith("/forward"))

    def to_host_bytes(self) -> int:
        """Every byte sent device -> host: chunk results plus the hand-off's gradient."""
        return self.bytes("d2h") + sum(e.nbytes for e in self.events if e.kind == "handoff" and e.layer.endswith("/backward"))


@contextmanager
def monitor_transfers() -> Iterator[TransferMonitor]:
    """Record Big-Layer transfers inside a ``with`` block.

    Examples
    --------
    >>> with monitor_transfers() as mon:            # doctest: +SKIP
    ...     big(x).sum().backward()
    >>> mon.max_chunk <= max_elements               # doctest: +SKIP
    """
    mon = TransferMonitor()
    handle = register_transfer_hook(mon)
    try:
        yield mon
    finally:
        handle.remove()
