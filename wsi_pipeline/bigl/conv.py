"""Partitioned Conv2d: host input and output, device work in batch/row chunks with halo rows.

Under autocast (for the compute device) the chunks compute in the autocast dtype, forward and
backward, and the output lives in the host in that dtype, as plain autocast would produce it
(:mod:`wsi_pipeline.bigl.precision`); weight and bias gradients are accumulated and returned in
the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from wsi_pipeline.bigl.plan import Chunk, RowChunk, Window, grad_write_plan, plan_rows
from wsi_pipeline.bigl.precision import autocast_dtype
from wsi_pipeline.bigl.chunk_loop import ChunkRunner

__all__ = ["BigConv2d", "pad_rows", "GradStitcher"]


def pad_rows(x: torch.Tensor, top: int, bottom: int, value: float = 0.0) -> torch.Tensor:
    """Add ``top``/``bottom`` rows of ``value`` to ``[N, C, H, W]`` (no copy when both are 0)."""
    if top == 0 and bottom == 0:
        return x
    return F.pad(x, (0, 0, top, bottom), value=value)


@overload
def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...
@overload
def _cast(t: None, dtype: torch.dtype | None) -> None: ...
def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


class GradStitcher:
    """Stitches chunked input gradients: halo rows shared with the next chunk stay on the
    device and are added to that chunk's gradient, the rest is written to the host once."""

    def __init__(self, chunks: Sequence[Chunk], h: int) -> None:
        self.writes, self.gaps = grad_write_plan(chunks, h)
        self._carry: torch.Tensor | None = None

    def zero_gaps(self, host_grad: torch.Tensor) -> None:
        """Zero the host rows no chunk reads (their gradient is 0)."""
        for n0, n1, r0, r1 in self.gaps:
            host_grad[n0:n1, :, r0:r1].zero_()

    def take(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Add the carried halo into chunk ``i``'s gradient ``g`` (rows ``[a, b)``); return the
        part to write (rows ``[a, end)``) and keep the shared rows for chunk ``i + 1``."""
        if self._carry is not None:
            g[:, :, : self._carry.shape[2]] += self._carry
        keep = self.writes[i].keep
        if keep is None:
            self._carry = None
            return g
        self._carry = g[:, :, keep:]
        return g[:, :, :keep]

    def dest(self, i: int, ch: Chunk, host_grad: torch.Tensor) -> torch.Tensor:
        """Host view receiving chunk ``i``'s written rows."""
        return host_grad[ch.n0 : ch.n1, :, ch.a : self.writes[i].end]


class _BigConv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: BigConv2d,
                cast: torch.dtype | None) -> torch.Tensor:
        n, c, h, w = x.shape
        co = weight.shape[0]
        ho, wo = layer.window_h.out_size(h), layer.window_w.out_size(w)
        if ho < 1 or wo < 1:
            raise ValueError(f"{layer.qualname}: input {h}x{w} px is smaller than the kernel {layer.kernel_size}")
        chunks = plan_rows(n, h, layer.window_h, in_row=c * w, out_row=co * wo, max_elements=layer.max_elements, what=layer.qualname)
        y = layer.runner.host_empty((n, co, ho, wo), cast or x.dtype)
        pw = layer.padding[1]
        weight_c, bias_c = _cast(weight, cast), _cast(bias, cast)

        def load(i: int, ch: RowChunk) -> tuple[torch.Tensor]:
            return (x[ch.n0 : ch.n1, :, ch.a : ch.b],)

        def compute(i: int, ch: RowChunk, ins) -> tuple[torch.Tensor]:
            xc = _cast(ins[0], cast)
            weight, bias = weight_c, bias_c
            if ch.full:
                return (F.conv2d(xc, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups),)
            xc = pad_rows(xc, ch.pad_top, ch.pad_bottom)
            return (F.conv2d(xc, weight, bias, layer.stride, (0, pw), layer.dilation, layer.groups),)

        def store(i: int, ch: RowChunk) -> tuple[torch.Tensor]:
            return (y[ch.n0 : ch.n1, :, ch.o0 : ch.o1],)

        layer.runner.run(f"{layer.qualname}/forward", chunks, load, compute, store)
        ctx.layer, ctx.cast = layer, cast
        ctx.save_for_backward(x, weight, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        layer: BigConv2d = ctx.layer
        cast: torch.dtype | None = ctx.cast
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        n, c, h, w = x.shape
        _, co, _, wo = gy.shape
        # a chunk holds x, dy and (when needed) dx plus the halo rows carried to the next chunk
        chunks = plan_rows(
            n, h, layer.window_h, in_row=c * w, out_row=co * wo, max_elements=layer.max_elements,
            in_factor=2 if need_x else 1, halo_factor=1 if need_x else 0, what=layer.qualname,
        )
        runner = layer.runner
        gx = runner.host_empty(x.shape, x.dtype) if need_x else None
        stitch = GradStitcher(chunks, h)
        if gx is not None:
            stitch.zero_gaps(gx)
        acc: dict[str, torch.Tensor | None] = {"w": None, "b": None}
        pw = layer.padding[1]
        bias_sizes = [co] if bias is not None else None
        weight_c = _cast(weight, cast)

        def load(i: int, ch: RowChunk):
            return (x[ch.n0 : ch.n1, :, ch.a : ch.b], gy[ch.n0 : ch.n1, :, ch.o0 : ch.o1])

        def compute(i: int, ch: RowChunk, ins):
            xc, gc = _cast(ins[0], cast), _cast(ins[1], cast)
            if ch.full:
                padding = list(layer.padding)
            else:
                xc = pad_rows(xc, ch.pad_top, ch.pad_bottom)
                padding = [0, pw]
            g_in, g_w, g_b = torch.ops.aten.convolution_backward(
                gc, xc, weight_c, bias_sizes, list(layer.stride), padding, list(layer.dilation),
                False, [0, 0], layer.groups, [need_x, need_w, need_b and bias is not None],
            )
            # parameter gradients in the parameters' dtype (float32 under autocast), as the
            # backward of autocast's cast gives them
            if need_w:
                g_w = g_w.to(weight.dtype)
                acc["w"] = g_w if acc["w"] is None else acc["w"].add_(g_w)
            if need_b and bias is not None:
                g_b = g_b.to(bias.dtype)
                acc["b"] = g_b if acc["b"] is None else acc["b"].add_(g_b)
            if not need_x:
                return ()
            if not ch.full:
                g_in = g_in[:, :, ch.pad_top : g_in.shape[2] - ch.pad_bottom]
            if cast is not None:
                # halo rows are summed in the input's dtype (float32 for the image), then the
                # gradient is stored in the input's dtype, as the cast's backward returns it
                g_in = g_in.to(torch.promote_types(cast, x.dtype))
            return (stitch.take(i, g_in).to(x.dtype),)

        def store(i: int, ch: RowChunk) -> tuple[torch.Tensor, ...]:
            return (stitch.dest(i, ch, gx),) if gx is not None else ()  # gx exists exactly when need_x

        runner.run(f"{layer.qualname}/backward", chunks, load, compute, store)
        return gx, acc["w"], acc["b"], None, None


class BigConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose input and output live in host memory; the device sees chunks.

    Built from an existing convolution with :meth:`from_conv`, sharing its ``weight`` and
    ``bias`` Parameters (same names, so state dicts are interchangeable). Only
    ``padding_mode="zeros"`` and numeric padding are supported.

    Attributes
    ----------
    runner : ChunkRunner
        Compute device and transfer machinery.
    max_elements : int
        Elements one chunk step may hold on the device: ``x`` chunk + ``y`` chunk in the forward
        pass, ``x`` + ``dy`` + ``dx`` chunks + halo rows in the backward pass.
    qualname : str
        Name used in messages and instrumentation.
    """

    runner: ChunkRunner
    max_elements: int
    qualname: str
    #: always numeric here (``from_conv`` turns ``"valid"`` into ``(0, 0)`` and rejects other strings)
    padding: tuple[int, ...]

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, runner: ChunkRunner, max_elements: int, qualname: str = "conv") -> BigConv2d:
        """Wrap ``conv`` (its Parameters are shared, not copied)."""
        if conv.padding_mode != "zeros":
            raise ValueError(f"{qualname}: padding_mode={conv.padding_mode!r} is not supported by Big-Layers; use 'zeros'")
        if isinstance(conv.padding, str) and conv.padding != "valid":
            raise ValueError(f"{qualname}: padding={conv.padding!r} is not supported by Big-Layers; give the padding in px")
        big = cls.__new__(cls)
        nn.Module.__init__(big)
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "dilation", "transposed", "output_padding", "groups", "padding_mode"):
            setattr(big, attr, getattr(conv, attr))
        big.padding = (0, 0) if isinstance(conv.padding, str) else tuple(conv.padding)
        big._reversed_padding_repeated_twice = getattr(conv, "_reversed_padding_repeated_twice", [0, 0, 0, 0])
        big.weight = conv.weight
        if conv.bias is None:
            big.register_parameter("bias", None)
        else:
            big.bias = conv.bias
        big.runner, big.max_elements, big.qualname = runner, int(max_elements), qualname
        return big

    @property
    def window_h(self) -> Window:
        return Window(self.kernel_size[0], self.stride[0], self.padding[0], self.dilation[0])

    @property
    def window_w(self) -> Window:
        return Window(self.kernel_size[1], self.stride[1], self.padding[1], self.dilation[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, C_in, H, W]`` host tensor -> ``[N, C_out, H', W']`` host tensor (channels-last)."""
        if x.dim() != 4:
            raise ValueError(f"{self.qualname}: expected a 4-D input [N, C, H, W], got shape {tuple(x.shape)}")
        if not self.runner.is_host(x):
            x = self.runner.to_host(x)
        cast = autocast_dtype(self.runner.device, x, self.weight, self.bias)
        return _BigConv2dFn.apply(x, self.weight, self.bias, self, cast)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_elements={self.max_elements}, device={self.runner.device}"
