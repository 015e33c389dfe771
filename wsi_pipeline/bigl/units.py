"""A ResNet as a sequence of units, and the row geometry of running a unit chunk by chunk.

A *unit* is the stem (``conv1 -> bn1 -> relu -> maxpool``) or one residual block (BasicBlock:
``conv1 -> bn1 -> relu -> conv2 -> bn2``, Bottleneck: three convolutions; plus the shortcut,
identity or ``downsample`` = 1x1 convolution -> BatchNorm, and the final ``relu(main + shortcut)``).
A fused run (:mod:`wsi_pipeline.bigl.fused`) computes a unit's output rows ``[o0, o1)`` of some
samples from the input rows ``[a, b)`` they depend on, every intermediate tensor existing only as
the rows of that chunk, so only the unit's input and output ever exist whole.

Row ranges are derived backwards from the output, op by op, as for one layer
(:class:`~wsi_pipeline.bigl.plan.Window`): an op's output rows ``[o0, o1)`` need input rows
``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``, clipped to the tensor; the rows clipped away are the
layer's padding, added only at the real borders. Every BatchNorm tensor also gets an *owned*
range per chunk, a partition of its rows over the chunks of a sample: batch statistics and the
constant part of BatchNorm's input gradient are taken over owned rows only, so halo rows (computed
by two chunks) count once. Where owned rows fall outside the rows a chunk needs, the chunk's
range is widened to include them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from wsi_pipeline.bigl.plan import Window
from wsi_pipeline.models.encoders import ResNet

__all__ = ["Op", "Unit", "OpRange", "UnitChunk", "UnitGeometry", "resnet_units", "plan_unit", "conv_padding"]

_HUGE = 1 << 40  # a height no tensor reaches: ranges computed with it are never clipped
_M = TypeVar("_M", bound=nn.Module)


@dataclass(eq=False)
class Op:
    """One layer of a unit: ``kind`` is ``conv``, ``bn``, ``relu`` or ``maxpool``; ``name`` its qualified name."""

    kind: str
    name: str
    module: nn.Module | None = None

    def _pair(self, v: int | tuple[int, ...]) -> tuple[int, int]:
        if isinstance(v, int):
            return v, v
        return v[0], v[1]

    def _module(self, kind: type[_M]) -> _M:
        if not isinstance(self.module, kind):
            raise TypeError(f"{self.name}: a {self.kind} op needs an nn.{kind.__name__}, got {type(self.module).__name__}")
        return self.module

    @property
    def conv(self) -> nn.Conv2d:
        """The module of a ``conv`` op."""
        return self._module(nn.Conv2d)

    @property
    def bn(self) -> nn.BatchNorm2d:
        """The module of a ``bn`` op."""
        return self._module(nn.BatchNorm2d)

    @property
    def pool(self) -> nn.MaxPool2d:
        """The module of a ``maxpool`` op."""
        return self._module(nn.MaxPool2d)

    def geometry(self, axis: int) -> Window:
        """Window of the op along the height (``axis=0``) or the width (``axis=1``)."""
        if self.kind == "conv":
            m = self.conv
            return Window(m.kernel_size[axis], m.stride[axis], conv_padding(m, self.name)[axis], m.dilation[axis])
        if self.kind == "maxpool":
            p = self.pool
            k, s, pad, d = (self._pair(v)[axis] for v in (p.kernel_size, p.stride, p.padding, p.dilation))
            return Window(k, s, pad, d)
        return Window()

    def channels_out(self, c_in: int) -> int:
        return self.conv.out_channels if self.kind == "conv" else c_in


@dataclass(eq=False)
class Unit:
    """The stem or one residual block.

    ``shortcut``: None for the stem (no residual add), ``[]`` for an identity shortcut, else the
    ``downsample`` ops; a residual unit ends with ``relu(main + shortcut)``.
    """

    name: str
    main: list[Op]
    shortcut: list[Op] | None

    @property
    def residual(self) -> bool:
        return self.shortcut is not None

    def ops(self) -> list[Op]:
        return self.main + (self.shortcut or [])

    def parameters(self) -> list[torch.Tensor]:
        """The unit's Parameters in a fixed order (conv weight/bias, BatchNorm weight/bias; None skipped)."""
        out: list[torch.Tensor] = []
        for op in self.ops():
            if op.kind in ("conv", "bn"):
                m: nn.Conv2d | nn.BatchNorm2d = op.conv if op.kind == "conv" else op.bn
                out += [p for p in (m.weight, m.bias) if p is not None]
        return out

    def convs(self) -> list[nn.Conv2d]:
        return [op.conv for op in self.ops() if op.kind == "conv"]


def conv_padding(m: nn.Conv2d, name: str) -> tuple[int, ...]:
    """A convolution's numeric padding (px per axis); fused runs reject ``"same"``/``"valid"``."""
    if isinstance(m.padding, str):
        raise ValueError(f"{name}: fused runs need numeric padding, got {m.padding!r}")
    return m.padding


def _check_conv(m: nn.Conv2d, name: str) -> None:
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        raise ValueError(f"{name}: fused runs need padding_mode='zeros' and numeric padding, got {m.padding_mode!r} / {m.padding!r}")


def _check_pool(m: nn.MaxPool2d, name: str) -> None:
    if m.ceil_mode or m.return_indices:
        raise ValueError(f"{name}: ceil_mode and return_indices are not supported by fused runs")


def resnet_units(model: ResNet) -> list[Unit]:
    """The units of ``model``: the stem, then every residual block in order (``layer1.0``, ...)."""
    _check_conv(model.conv1, "conv1")
    _check_pool(model.maxpool, "maxpool")
    units = [Unit("stem", [Op("conv", "conv1", model.conv1), Op("bn", "bn1", model.bn1), Op("relu", "relu"),
                          Op("maxpool", "maxpool", model.maxpool)], None)]
    for i, stage in enumerate(model.stages(), start=1):
        for k, block in stage.named_children():
            name = f"layer{i}.{k}"
            main: list[Op] = []
            j = 1
            while hasattr(block, f"conv{j}"):
                conv = getattr(block, f"conv{j}")
                _check_conv(conv, f"{name}.conv{j}")
                main += [Op("conv", f"{name}.conv{j}", conv), Op("bn", f"{name}.bn{j}", getattr(block, f"bn{j}"))]
                if hasattr(block, f"conv{j + 1}"):
                    main.append(Op("relu", f"{name}.relu"))
                j += 1
            short: list[Op] = []
            if block.downsample is not None:
                ds = list(block.downsample) if isinstance(block.downsample, nn.Sequential) else [block.downsample]
                if len(ds) != 2 or not isinstance(ds[0], nn.Conv2d) or not isinstance(ds[1], nn.BatchNorm2d):
                    raise TypeError(f"{name}.downsample: expected Conv2d -> BatchNorm2d, got {[type(m).__name__ for m in ds]}")
                _check_conv(ds[0], f"{name}.downsample.0")
                short = [Op("conv", f"{name}.downsample.0", ds[0]), Op("bn", f"{name}.downsample.1", ds[1])]
            units.append(Unit(name, main, short))
    return units


@dataclass(frozen=True)
class OpRange:
    """Input rows ``[a, b)`` one op of one chunk reads, the padding rows it adds above and below,
    whether it may use the layer's own padding (whole tensor), and for BatchNorm the owned rows."""

    a: int
    b: int
    pad_top: int
    pad_bottom: int
    native: bool
    own: tuple[int, int] | None = None


@dataclass(frozen=True)
class UnitChunk:
    """One chunk step of a unit: samples ``[n0, n1)``, output rows ``[o0, o1)``, input rows ``[a, b)``.

    Same fields as :class:`~wsi_pipeline.bigl.plan.RowChunk` (so the runner, the instrumentation
    and :class:`~wsi_pipeline.bigl.conv.GradStitcher` take it), plus the rows every op reads.
    """

    n0: int
    n1: int
    o0: int
    o1: int
    a: int
    b: int
    full: bool
    main: tuple[OpRange, ...] = field(default=())
    shortcut: tuple[OpRange, ...] = field(default=())

    @property
    def samples(self) -> int:
        return self.n1 - self.n0


class UnitGeometry:
    """Heights, widths and channels of every tensor of a unit for an input of ``[N, C, H, W]``."""

    def __init__(self, unit: Unit, c: int, h: int, w: int) -> None:
        self.unit, self.c_in, self.h_in, self.w_in = unit, c, h, w
        self.main = self._chain(unit.main, c, h, w)
        self.shortcut = self._chain(unit.shortcut or [], c, h, w)
        self.c_out, self.h_out, self.w_out = self.main[-1]
        if unit.residual and self.shortcut[-1] != self.main[-1]:
            raise ValueError(f"{unit.name}: shortcut output {self.shortcut[-1]} differs from the main path's {self.main[-1]}")
        if self.h_out < 1 or self.w_out < 1:
            raise ValueError(f"{unit.name}: input {h}x{w} px is too small (output {self.h_out}x{self.w_out})")

    @staticmethod
    def _chain(ops: list[Op], c: int, h: int, w: int) -> list[tuple[int, int, int]]:
        """``(channels, height, width)`` of the chain's input, then of every op's output."""
        shapes = [(c, h, w)]
        for op in ops:
            c, h, w = op.channels_out(c), op.geometry(0).out_size(h), op.geometry(1).out_size(w)
            shapes.append((c, h, w))
        return shapes

    def in_elements(self) -> int:
        """Elements of one input sample."""
        return self.c_in * self.h_in * self.w_in

    def out_elements(self) -> int:
        """Elements of one output sample."""
        return self.c_out * self.h_out * self.w_out

    # ---- row ranges ---------------------------------------------------------------------------
    def _ranges(self, ops: list[Op], shapes, outs: list[tuple[int, int]], clip: bool) -> tuple[list[list[OpRange]], list[tuple[int, int]]]:
        """Per chunk (output ranges ``outs`` of one sample, in order) the ranges of every op, and
        the chain's input range per chunk."""
        n = len(outs)
        per: list[list[OpRange]] = [[] for _ in range(n)]  # filled from the last op back, reversed at the end
        cur = list(outs)
        for j in range(len(ops) - 1, -1, -1):
            op = ops[j]
            h_in = shapes[j][1] if clip else _HUGE
            h_out = shapes[j + 1][1]
            win = op.geometry(0)
            ins = []
            for o0, o1 in cur:
                r0, r1 = win.in_range(o0, o1)
                a, b = (max(r0, 0), min(r1, h_in)) if clip else (r0, r1)
                ins.append((a, b, r0, r1, o0, o1))
            own: list[tuple[int, int] | None] = [None] * n
            if op.kind == "bn" and clip:
                # owned rows: a partition of [0, H) over the chunks; widen a range that misses them
                starts = [0] + [ins[i - 1][1] for i in range(1, n)] + [h_in]
                for i in range(n):
                    s0, s1 = starts[i], max(starts[i + 1], starts[i])
                    a, b, r0, r1, o0, o1 = ins[i]
                    a, b = min(a, s0), max(b, s1)
                    ins[i] = (a, b, a, b, a, b)
                    own[i] = (s0, s1)
            for i, (a, b, r0, r1, o0, o1) in enumerate(ins):
                native = clip and a == 0 and b == h_in and o0 == 0 and o1 == h_out and r0 == -win.padding and r1 - h_in <= win.padding
                per[i].append(OpRange(a, b, a - r0, r1 - b, native, own[i]))
            cur = [(a, b) for a, b, *_ in ins]
        for ranges in per:
            ranges.reverse()
        return per, cur

    def chunks_for_rows(self, n0: int, n1: int, outs: list[tuple[int, int]], clip: bool = True) -> list[UnitChunk]:
        """Chunks of samples ``[n0, n1)`` with output row ranges ``outs`` (in order, covering the output)."""
        main, main_in = self._ranges(self.unit.main, self.main, outs, clip)
        if self.unit.shortcut:
            short, short_in = self._ranges(self.unit.shortcut, self.shortcut, outs, clip)
        else:
            short, short_in = [[] for _ in outs], list(outs)  # identity: the output rows themselves
        chunks = []
        full = len(outs) == 1 and outs[0] == (0, self.h_out)
        for i, (o0, o1) in enumerate(outs):
            a = min(main_in[i][0], short_in[i][0]) if self.unit.residual else main_in[i][0]
            b = max(main_in[i][1], short_in[i][1]) if self.unit.residual else main_in[i][1]
            chunks.append(UnitChunk(n0, n1, o0, o1, a, b, full, tuple(main[i]), tuple(short[i])))
        return chunks

    # ---- device working set -------------------------------------------------------------------
    def _chain_elements(self, shapes, ranges: tuple[OpRange, ...], ops: list[Op]) -> int:
        tot = 0
        for j, (op, r) in enumerate(zip(ops, ranges)):
            win = op.geometry(0)
            rows = (r.b - r.a + r.pad_top + r.pad_bottom - win.extent) // win.stride + 1
            c, _, w = shapes[j + 1]
            tot += c * w * max(rows, 0)
        return tot

    def working_elements(self, ch: UnitChunk) -> int:
        """Device elements of the chunk's backward step, per the stated estimate: its input, input
        gradient and output gradient, and twice every intermediate tensor (kept by autograd, and its
        gradient)."""
        x = self.c_in * self.w_in * (ch.b - ch.a)
        y = self.c_out * self.w_out * (ch.o1 - ch.o0)
        inter = self._chain_elements(self.main, ch.main, self.unit.main)
        if self.unit.shortcut:
            inter += self._chain_elements(self.shortcut, ch.shortcut, self.unit.shortcut)
        if self.unit.residual:
            inter += 2 * self.c_out * self.w_out * (ch.o1 - ch.o0)  # the sum and its ReLU
        return ch.samples * (2 * x + y + 2 * inter)

    def sample_elements(self) -> int:
        """Working elements of one whole sample."""
        return self.working_elements(self.chunks_for_rows(0, 1, [(0, self.h_out)])[0])

    def row_elements(self, m: int) -> int:
        """Working elements of an interior chunk of ``m`` output rows of one sample (no clipping: an upper bound)."""
        o0 = self.h_out // 2
        return self.working_elements(self.chunks_for_rows(0, 1, [(o0, o0 + m)], clip=False)[0])


def plan_unit(geo: UnitGeometry, n: int, max_elements: int) -> list[UnitChunk]:
    """Chunks of a unit over ``n`` samples within ``max_elements`` working elements each.

    Whole samples, as many per chunk as fit; else single-sample chunks of the most output rows
    that fit (the same count for every chunk, the last one shorter).

    Raises
    ------
    ValueError
        When one output row of one sample does not fit (the message gives the elements needed).
    """
    per_sample = geo.sample_elements()
    if per_sample <= max_elements:
        step = max(1, min(n, max_elements // per_sample))
        out = []
        for n0 in range(0, n, step):
            out += geo.chunks_for_rows(n0, min(n, n0 + step), [(0, geo.h_out)])
        return out
    need = geo.row_elements(1)
    if need > max_elements:
        raise ValueError(
            f"max_elements={max_elements} is too small for {geo.unit.name}: one output row of one sample needs "
            f"{need} elements; use max_elements >= {need}"
        )
    lo, hi = 1, geo.h_out  # largest m with row_elements(m) <= max_elements
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if geo.row_elements(mid) <= max_elements:
            lo = mid
        else:
            hi = mid - 1
    m = lo
    outs = [(o0, min(geo.h_out, o0 + m)) for o0 in range(0, geo.h_out, m)]
    chunks = []
    for i in range(n):
        chunks += geo.chunks_for_rows(i, i + 1, outs)
    return chunks
