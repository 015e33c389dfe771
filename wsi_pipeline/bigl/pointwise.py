"""Cheap layers of the big stages (ReLU, MaxPool, residual add) chunked on the device.

By default these run on the host with ordinary autograd ops (the paper's choice: they cost a
pass over memory, less than moving the tensor). With ``pointwise="device"`` :func:`bigify`
uses the partitioned versions here instead; they give identical numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from wsi_pipeline.bigl.conv import GradStitcher, pad_rows
from wsi_pipeline.bigl.plan import RowChunk, Window, plan_rows
from wsi_pipeline.bigl.chunk_loop import ChunkRunner

__all__ = ["BigReLU", "BigMaxPool2d", "BigAddReLU"]


def _elementwise_plan(x: torch.Tensor, max_elements: int, n_in: int, n_out: int, what: str) -> list[RowChunk]:
    n, c, h, w = x.shape
    return plan_rows(n, h, Window(), in_row=c * w, out_row=c * w, max_elements=max_elements,
                     in_factor=n_in, out_factor=n_out, what=what)


def _rows(*ts: torch.Tensor):
    return lambda i, ch: tuple(t[ch.n0 : ch.n1, :, ch.a : ch.b] for t in ts)


class _AddReLUFn(torch.autograd.Function):
    """``relu(a + b)`` (``b`` may be None), chunked; saves only the output."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor | None, runner: ChunkRunner, max_elements: int, name: str):
        y = runner.host_empty(a.shape, a.dtype)
        ins = (a,) if b is None else (a, b)

        def compute(i, ch, chunk):
            out = chunk[0] if b is None else chunk[0] + chunk[1]
            return (torch.relu(out).to(y.dtype),)  # in a's dtype, as plain ``out += identity``

        runner.run(f"{name}/forward", _elementwise_plan(a, max_elements, len(ins), 1, name), _rows(*ins), compute, _rows(y))
        ctx.runner, ctx.max_elements, ctx.name, ctx.two = runner, max_elements, name, b is not None
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        (y,) = ctx.saved_tensors
        runner = ctx.runner
        gx = runner.host_empty(y.shape, y.dtype)

        def compute(i, ch, chunk):
            yc, gc = chunk
            return (torch.where(yc > 0, gc, torch.zeros((), dtype=gc.dtype, device=gc.device)),)

        runner.run(f"{ctx.name}/backward", _elementwise_plan(y, ctx.max_elements, 2, 1, ctx.name), _rows(y, gy), compute, _rows(gx))
        return gx, (gx if ctx.two else None), None, None, None


class BigReLU(nn.ReLU):
    """ReLU over a host tensor, computed on the device in chunks."""

    runner: ChunkRunner
    max_elements: int
    qualname: str

    @classmethod
    def create(cls, runner: ChunkRunner, max_elements: int, qualname: str = "relu") -> BigReLU:
        big = cls()
        big.runner, big.max_elements, big.qualname = runner, int(max_elements), qualname
        return big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AddReLUFn.apply(x, None, self.runner, self.max_elements, self.qualname)


class BigAddReLU(nn.Module):
    """``relu(a + b)`` for the residual connection, on host tensors, chunked on the device."""

    def __init__(self, runner: ChunkRunner, max_elements: int, qualname: str = "add_relu") -> None:
        super().__init__()
        self.runner, self.max_elements, self.qualname = runner, int(max_elements), qualname

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _AddReLUFn.apply(a, b, self.runner, self.max_elements, self.qualname)


class _MaxPoolFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: BigMaxPool2d) -> torch.Tensor:
        n, c, h, w = x.shape
        win_h, (kw, sw, pw, dw) = layer.window_h, layer.geometry_w
        ho, wo = win_h.out_size(h), (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        chunks = plan_rows(n, h, win_h, in_row=c * w, out_row=c * wo, max_elements=layer.max_elements, what=layer.qualname)
        y = layer.runner.host_empty((n, c, ho, wo), x.dtype)

        def compute(i, ch, ins):
            return (layer.pool_chunk(ins[0], ch),)

        layer.runner.run(f"{layer.qualname}/forward", chunks, lambda i, ch: (x[ch.n0 : ch.n1, :, ch.a : ch.b],),
                         compute, lambda i, ch: (y[ch.n0 : ch.n1, :, ch.o0 : ch.o1],))
        ctx.layer = layer
        ctx.save_for_backward(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        (x,) = ctx.saved_tensors
        layer: BigMaxPool2d = ctx.layer
        n, c, h, w = x.shape
        wo = gy.shape[3]
        chunks = plan_rows(n, h, layer.window_h, in_row=c * w, out_row=c * wo, max_elements=layer.max_elements,
                           in_factor=2, halo_factor=1, what=layer.qualname)
        gx = layer.runner.host_empty(x.shape, x.dtype)
        stitch = GradStitcher(chunks, h)
        stitch.zero_gaps(gx)

        def compute(i, ch, ins):
            xc, gc = ins
            # recompute the chunk's pooling to find the argmax of every window (the same one
            # the whole-tensor pooling picks: the windows are identical)
            with torch.enable_grad():
                xg = xc.detach().requires_grad_(True)
                (g_in,) = torch.autograd.grad(layer.pool_chunk(xg, ch), xg, gc)
            return (stitch.take(i, g_in),)

        layer.runner.run(f"{layer.qualname}/backward", chunks,
                         lambda i, ch: (x[ch.n0 : ch.n1, :, ch.a : ch.b], gy[ch.n0 : ch.n1, :, ch.o0 : ch.o1]),
                         compute, lambda i, ch: (stitch.dest(i, ch, gx),))
        return gx, None


class BigMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (floor mode) over a host tensor, computed on the device in row chunks."""

    runner: ChunkRunner
    max_elements: int
    qualname: str

    @classmethod
    def from_pool(cls, pool: nn.MaxPool2d, runner: ChunkRunner, max_elements: int, qualname: str = "maxpool") -> BigMaxPool2d:
        """Wrap ``pool`` (same kernel, stride, padding, dilation)."""
        if pool.ceil_mode or pool.return_indices:
            raise ValueError(f"{qualname}: ceil_mode and return_indices are not supported by Big-Layers")
        big = cls(pool.kernel_size, pool.stride, pool.padding, pool.dilation)
        big.runner, big.max_elements, big.qualname = runner, int(max_elements), qualname
        return big

    @staticmethod
    def _pair(v) -> tuple[int, int]:
        return (v, v) if isinstance(v, int) else tuple(v)

    @property
    def window_h(self) -> Window:
        k, s, p, d = (self._pair(v)[0] for v in (self.kernel_size, self.stride, self.padding, self.dilation))
        return Window(k, s, p, d)

    @property
    def geometry_w(self) -> tuple[int, int, int, int]:
        k, s, p, d = (self._pair(v)[1] for v in (self.kernel_size, self.stride, self.padding, self.dilation))
        return k, s, p, d

    def pool_chunk(self, xc: torch.Tensor, ch: RowChunk) -> torch.Tensor:
        """Pool one chunk on the device (its border rows padded with -inf, as MaxPool pads)."""
        ks, st, dil = self._pair(self.kernel_size), self._pair(self.stride), self._pair(self.dilation)
        pad = self._pair(self.padding)
        if ch.full:
            return F.max_pool2d(xc, ks, st, pad, dil)
        xc = pad_rows(xc, ch.pad_top, ch.pad_bottom, value=float("-inf"))
        return F.max_pool2d(xc, ks, st, (0, pad[1]), dil)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaxPoolFn.apply(x, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_elements={self.max_elements}, device={self.runner.device}"
