"""Chunk plans: which samples and rows of a host tensor one device step handles.

A sliding-window layer (convolution, pooling; ``kernel=1`` for pointwise layers) is split along
the batch and the height. Output rows ``[o0, o1)`` need input rows
``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``; rows outside the image are padding, added only at
the real borders, so a chunk computes exactly the rows the whole layer would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Window", "Chunk", "RowChunk", "plan_rows", "grad_write_plan"]


@dataclass(frozen=True)
class Window:
    """Row geometry of a sliding window (kernel, stride, padding, dilation along the height)."""

    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    @property
    def extent(self) -> int:
        """Input rows one output row reads: ``d*(k-1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, h: int) -> int:
        """Output rows for ``h`` input rows (floor mode, as ``nn.Conv2d``)."""
        return (h + 2 * self.padding - self.extent) // self.stride + 1

    def in_range(self, o0: int, o1: int) -> tuple[int, int]:
        """Unclipped input rows ``[r0, r1)`` read by output rows ``[o0, o1)``."""
        return o0 * self.stride - self.padding, (o1 - 1) * self.stride - self.padding + self.extent

    @property
    def halo(self) -> int:
        """Input rows shared by two consecutive row chunks (0 when windows do not overlap)."""
        return max(0, self.extent - self.stride)


class Chunk(Protocol):
    """What the chunk loop, the gradient stitching and the instrumentation read of one chunk step:
    samples ``[n0, n1)``, output rows ``[o0, o1)``, input rows ``[a, b)``, whole samples or not
    (:class:`RowChunk`, and :class:`~wsi_pipeline.bigl.units.UnitChunk` for fused runs)."""

    @property
    def n0(self) -> int: ...
    @property
    def n1(self) -> int: ...
    @property
    def o0(self) -> int: ...
    @property
    def o1(self) -> int: ...
    @property
    def a(self) -> int: ...
    @property
    def b(self) -> int: ...
    @property
    def full(self) -> bool: ...
    @property
    def samples(self) -> int: ...


@dataclass(frozen=True)
class RowChunk:
    """One device step: samples ``[n0, n1)``, output rows ``[o0, o1)``, input rows ``[a, b)``.

    ``full`` chunks hold whole samples (all input rows) and use the layer's own padding;
    the others hold one sample and ``pad_top``/``pad_bottom`` rows of padding to add on the
    device (only at the image borders).
    """

    n0: int
    n1: int
    o0: int
    o1: int
    a: int
    b: int
    pad_top: int
    pad_bottom: int
    full: bool

    @property
    def samples(self) -> int:
        return self.n1 - self.n0


def plan_rows(
    n: int,
    h: int,
    window: Window,
    *,
    in_row: int,
    out_row: int,
    max_elements: int,
    in_factor: int = 1,
    out_factor: int = 1,
    halo_factor: int = 0,
    what: str = "layer",
) -> list[RowChunk]:
    """Split a layer over ``n`` samples of ``h`` rows into chunks within ``max_elements``.

    Parameters
    ----------
    n, h
        Batch size and input height (px).
    window
        Row geometry of the layer.
    in_row, out_row
        Elements of one input row and one output row of one sample (channels x width).
    max_elements
        Budget of one chunk step: ``in_factor`` input-sized plus ``out_factor`` output-sized
        tensors plus ``halo_factor`` halo-sized tensors (elements).
    what
        Layer name for the error message.

    Returns
    -------
    list of RowChunk
        Whole samples grouped while they fit, else single-sample row ranges, in order
        (samples ascending, rows ascending).

    Raises
    ------
    ValueError
        When one output row of one sample does not fit in ``max_elements``.
    """
    h_out = window.out_size(h)
    if h_out < 1:
        raise ValueError(f"{what}: input height {h} px is too small for kernel {window.kernel} with padding {window.padding}")
    per_sample = in_factor * in_row * h + out_factor * out_row * h_out
    chunks: list[RowChunk] = []
    if per_sample <= max_elements:
        step = max(1, min(n, max_elements // per_sample))
        for n0 in range(0, n, step):
            chunks.append(RowChunk(n0, min(n, n0 + step), 0, h_out, 0, h, 0, 0, True))
        return chunks
    # cost(m output rows) = A*m + B, with (m-1)*s + extent input rows
    slope = in_factor * in_row * window.stride + out_factor * out_row
    offset = in_factor * in_row * (window.extent - window.stride) + halo_factor * in_row * window.halo
    m = (max_elements - offset) // slope
    if m < 1:
        need = slope + offset
        raise ValueError(
            f"max_elements={max_elements} is too small for {what}: one output row of one sample "
            f"needs {need} elements; use max_elements >= {need}"
        )
    m = min(m, h_out)
    for i in range(n):
        for o0 in range(0, h_out, m):
            o1 = min(h_out, o0 + m)
            r0, r1 = window.in_range(o0, o1)
            a, b = max(r0, 0), min(r1, h)
            chunks.append(RowChunk(i, i + 1, o0, o1, a, b, a - r0, max(0, r1 - h), False))
    return chunks


@dataclass(frozen=True)
class GradWrite:
    """Where one chunk's input gradient goes: host rows ``[a, end)``; rows from ``keep`` on
    (relative to ``a``) are carried to the next chunk, which overlaps them (halo rows)."""

    end: int
    keep: int | None


def grad_write_plan(chunks: Sequence[Chunk], h: int) -> tuple[list[GradWrite], list[tuple[int, int, int, int]]]:
    """How chunked input gradients are stitched without reading the host tensor back.

    Consecutive row chunks of a sample overlap in ``halo`` input rows. Each chunk's gradient
    for the rows it shares with the next chunk stays on the device and is added to the next
    chunk's gradient (the overlap is summed there); the rest is written once to the host.

    Returns
    -------
    writes
        One :class:`GradWrite` per chunk.
    gaps
        ``(n0, n1, r0, r1)`` host regions no chunk reads (stride larger than the window, or
        rows below the last window): their gradient is zero.
    """
    writes: list[GradWrite] = []
    gaps: list[tuple[int, int, int, int]] = []
    for i, c in enumerate(chunks):
        nxt = chunks[i + 1] if i + 1 < len(chunks) else None
        same = nxt if nxt is not None and not c.full and nxt.n0 == c.n0 else None  # next chunk, same sample
        if same is not None and same.a < c.b:
            writes.append(GradWrite(same.a, same.a - c.a))
        else:
            writes.append(GradWrite(c.b, None))
        if i == 0 or chunks[i - 1].n0 != c.n0:  # first chunk of its samples
            if c.a > 0:
                gaps.append((c.n0, c.n1, 0, c.a))
        if same is not None:
            if same.a > c.b:
                gaps.append((c.n0, c.n1, c.b, same.a))
        elif c.b < h:
            gaps.append((c.n0, c.n1, c.b, h))
    return writes, gaps
