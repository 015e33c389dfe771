"""Whole-image execution of :class:`~wsi_pipeline.tissue_seg.model.TissueUNet` in chunks.

Big-Layers (``wsi_pipeline.bigl``) for a network that is not a ResNet: every activation lives in
host memory and the compute device sees row chunks of it, with exact gradients. No full-resolution
float tensor is ever held whole:

* the input stays a uint8 greyscale image on the host; :class:`_InputConvReLU` applies ``conv1``
  (8 x 8, stride 8) and ReLU to each row chunk on the device. The inversion is folded into the
  weights: ``conv(W, (255 - g) / 255) + b = conv(-W / 255, g) + (b + sum W)``, so the chunk is
  converted to float once and never inverted; the backward pass re-reads the chunk for the weight
  gradient ``dW = db - conv_w(dy, g) / 255`` (the input needs no gradient);
* the 1/8 and 1/32 scale convolutions run as :class:`wsi_pipeline.bigl.conv.BigConv2d` (halo rows
  handled there); ReLU and the additive skips run on the host with ordinary autograd ops, the
  Big-Layers default for pointwise layers;
* the transposed convolution has kernel = stride, so each output row block depends on one input
  row and :class:`_ConvTransposeNoOverlap` chunks it without halos;
* the nearest x8 upsampling of the logit and the binary cross-entropy against the uint8 label are
  fused in :class:`_UpsampleBCE`: a block of ``s*s`` px sharing the logit ``z`` with ``n`` tissue
  px contributes exactly ``s*s*softplus(z) - n*z`` to the summed loss and ``s*s*sigmoid(z) - n`` to
  its gradient, so each label chunk is reduced to per-block counts and the full-resolution logits
  are never formed.

The loss is the mean over all pixels, as ``F.binary_cross_entropy_with_logits``; the tests check
the loss and every parameter gradient against plain autograd in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from wsi_pipeline.bigl import instrument
from wsi_pipeline.bigl.conv import BigConv2d
from wsi_pipeline.bigl.plan import RowChunk, Window, plan_rows
from wsi_pipeline.bigl.chunk_loop import ChunkRunner
from wsi_pipeline.tissue_seg.model import MULTIPLE, TissueUNet

__all__ = ["ChunkedTissueUNet", "DEFAULT_MAX_ELEMENTS"]

#: Default device budget of one chunk step (elements): 64 Mi, i.e. 256 MiB in float32.
DEFAULT_MAX_ELEMENTS = 64 * 1024 * 1024


def _track(layer: str, i: int, *ts: torch.Tensor) -> None:
    """Count device temporaries of a chunk step as resident (instrumentation only)."""
    if instrument.active():
        for t in ts:
            instrument.track("tmp", layer, i, t)


def _rows_plan(h: int, in_row: int, out_row: int, max_elements: int, what: str, out_factor: int = 1) -> list[RowChunk]:
    return plan_rows(1, h, Window(), in_row=in_row, out_row=out_row, max_elements=max_elements, out_factor=out_factor, what=what)


class _InputConvReLU(torch.autograd.Function):
    """``relu(conv(prepare_input(grey)))`` for a uint8 host image, no padding, chunked over rows."""

    @staticmethod
    def forward(ctx: Any, grey: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, runner: ChunkRunner,
                max_elements: int, name: str) -> torch.Tensor:
        _, _, h, w = grey.shape
        co, _, k, _ = weight.shape
        s = k  # kernel = stride, no padding (checked by ChunkedTissueUNet)
        win = Window(k, s, 0)
        ho, wo = win.out_size(h), (w - k) // s + 1
        # device: the uint8 chunk and its float copy (2 input-sized), the output chunk
        chunks = plan_rows(1, h, win, in_row=w, out_row=co * wo, max_elements=max_elements, in_factor=2, what=name)
        y = runner.host_empty((1, co, ho, wo), weight.dtype)
        w_fold = weight / -255.0
        b_fold = bias + weight.sum(dim=(1, 2, 3))

        def compute(i: int, ch: RowChunk, ins):
            g = ins[0].to(weight.dtype)
            _track(f"{name}/forward", i, g)
            return (F.conv2d(g, w_fold, b_fold, stride=s).clamp_min_(0),)

        runner.run(f"{name}/forward", chunks, lambda i, ch: (grey[:, :, ch.a : ch.b],), compute,
                   lambda i, ch: (y[:, :, ch.o0 : ch.o1],))
        ctx.save_for_backward(grey, y, weight)
        ctx.runner, ctx.max_elements, ctx.name, ctx.s = runner, max_elements, name, s
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        grey, y, weight = ctx.saved_tensors
        runner, name, s = ctx.runner, ctx.name, ctx.s
        _, _, h, w = grey.shape
        co, _, k, _ = weight.shape
        wo = y.shape[3]
        chunks = plan_rows(1, h, Window(k, s, 0), in_row=w, out_row=co * wo, max_elements=ctx.max_elements,
                           in_factor=2, out_factor=3, what=name)
        acc: dict[str, torch.Tensor] = {}

        def compute(i: int, ch: RowChunk, ins):
            g8, yc, gc = ins
            g = g8.to(weight.dtype)
            gz = gc * (yc > 0)
            _track(f"{name}/backward", i, g, gz)
            _, gw, gb = torch.ops.aten.convolution_backward(
                gz, g, weight, [co], [s, s], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
            acc["w"] = gw if "w" not in acc else acc["w"].add_(gw)
            acc["b"] = gb if "b" not in acc else acc["b"].add_(gb)
            return ()

        runner.run(f"{name}/backward", chunks,
                   lambda i, ch: (grey[:, :, ch.a : ch.b], y[:, :, ch.o0 : ch.o1], gy[:, :, ch.o0 : ch.o1]), compute)
        gb = acc["b"].to(weight.device)
        # x = 1 - g / 255: dW = sum_b dy (1 - g / 255) = db - conv_w(dy, g) / 255
        gw = gb.view(-1, 1, 1, 1) - acc["w"].to(weight.device) / 255.0
        return None, gw, gb, None, None, None


class _ConvTransposeNoOverlap(torch.autograd.Function):
    """Transposed convolution with kernel = stride (no overlap, no padding), chunked over input rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, runner: ChunkRunner,
                max_elements: int, name: str) -> torch.Tensor:
        _, c, h, w = x.shape
        co, s = weight.shape[1], weight.shape[2]
        chunks = _rows_plan(h, c * w, co * w * s * s, max_elements, name)
        y = runner.host_empty((1, co, h * s, w * s), x.dtype)
        runner.run(f"{name}/forward", chunks, lambda i, ch: (x[:, :, ch.a : ch.b],),
                   lambda i, ch, ins: (F.conv_transpose2d(ins[0], weight, bias, stride=s),),
                   lambda i, ch: (y[:, :, ch.a * s : ch.b * s],))
        ctx.save_for_backward(x, weight, bias)
        ctx.runner, ctx.max_elements, ctx.name = runner, max_elements, name
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        runner, name = ctx.runner, ctx.name
        _, c, h, w = x.shape
        co, s = weight.shape[1], weight.shape[2]
        chunks = plan_rows(1, h, Window(), in_row=c * w, out_row=co * w * s * s, max_elements=ctx.max_elements,
                           in_factor=2, what=name)
        gx = runner.host_empty(x.shape, x.dtype)
        acc: dict[str, torch.Tensor] = {}

        def compute(i: int, ch: RowChunk, ins):
            xc, gc = ins
            g_in, gw, gb = torch.ops.aten.convolution_backward(
                gc, xc, weight, [co], [s, s], [0, 0], [1, 1], True, [0, 0], 1, [True, True, True])
            acc["w"] = gw if "w" not in acc else acc["w"].add_(gw)
            acc["b"] = gb if "b" not in acc else acc["b"].add_(gb)
            return (g_in,)

        runner.run(f"{name}/backward", chunks,
                   lambda i, ch: (x[:, :, ch.a : ch.b], gy[:, :, ch.a * s : ch.b * s]), compute,
                   lambda i, ch: (gx[:, :, ch.a : ch.b],))
        return gx, acc["w"].to(weight.device), acc["b"].to(weight.device), None, None, None


_BYTE_SUM = 0x0101010101010101  # x * this has the sum of x's 8 bytes in its top byte (no carries while it is < 256)


def _block_counts(lab: torch.Tensor, s: int) -> torch.Tensor:
    """Tissue px per ``s`` x ``s`` block of a [1, 1, s*m, s*w] uint8 {0, 1} label: int32 [1, 1, m, w].

    With ``s = 8`` a block row is 8 bytes, read as one int64 whose bytes are summed by one
    multiplication (8 ones at most, so no carries); other ``s`` use a plain sum.
    """
    _, _, h, w = lab.shape
    if s == 8 and lab.is_contiguous() and lab.device.type == "cpu":
        words = lab.reshape(h, w).view(torch.int64)  # [8m, w/8]: one block row per word
        row_sums = ((words * _BYTE_SUM) >> 56) & 0xFF
        return row_sums.view(h // s, s, w // s).sum(dim=1, dtype=torch.int32).view(1, 1, h // s, w // s)
    return lab.reshape(h // s, s, w // s, s).sum(dim=(1, 3), dtype=torch.int32).view(1, 1, h // s, w // s)


class _UpsampleBCE(torch.autograd.Function):
    """Mean ``BCEWithLogits(nearest_upsample(z, s), label)`` over all label px, from per-block counts."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, label: torch.Tensor, s: int, runner: ChunkRunner,
                max_elements: int, name: str) -> torch.Tensor:
        _, _, h, w = z.shape
        # device: the uint8 label rows (s*s px per logit px) and the small count/logit rows
        chunks = plan_rows(1, h, Window(), in_row=(s * s + 1) * w, out_row=w, max_elements=max_elements,
                           in_factor=2, what=name)
        counts = torch.empty((1, 1, h, w), dtype=torch.int32)
        total = torch.zeros((), dtype=z.dtype, device=runner.device)
        area = s * s

        def compute(i: int, ch: RowChunk, ins):
            zc, lab = ins
            n = _block_counts(lab, s)
            _track(f"{name}/forward", i, n)
            # sum over a block of BCE(z, t_j) = sum_j softplus(z) - t_j z = s*s*softplus(z) - n z
            total.add_((area * -F.logsigmoid(-zc) - n * zc).sum())
            return (n,)

        runner.run(f"{name}/forward", chunks, lambda i, ch: (z[:, :, ch.a : ch.b], label[:, :, ch.a * s : ch.b * s]),
                   compute, lambda i, ch: (counts[:, :, ch.a : ch.b],))
        ctx.save_for_backward(z, counts)
        ctx.area, ctx.count = area, label.numel()
        return total.to(z.device) / ctx.count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gl: torch.Tensor):
        z, counts = ctx.saved_tensors
        # a 1/8 scale tensor: held whole, as every other tensor at that scale
        gz = (ctx.area * torch.sigmoid(z) - counts) * (gl.to(z.device) / ctx.count)
        return gz, None, None, None, None, None


def _as_image(t: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
    """(H, W) uint8 array or tensor -> [1, 1, H, W] uint8 host tensor (no copy for a tensor or C-order array)."""
    t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D uint8 image (H, W), got {t.dtype} with shape {tuple(t.shape)}")
    h, w = t.shape
    if h % MULTIPLE or w % MULTIPLE:
        raise ValueError(f"{what}: height and width must be multiples of {MULTIPLE} px, got {h} x {w}")
    return t.reshape(1, 1, h, w)


class ChunkedTissueUNet:
    """Runs a :class:`TissueUNet` (sharing its parameters) on whole images in row chunks.

    Parameters
    ----------
    model
        The network; its parameters live on ``runner.device``.
    runner
        Big-Layers chunk runner (compute device and transfers); default: the parameters' device.
    max_elements
        Budget of one chunk step on the device (elements).
    """

    def __init__(self, model: TissueUNet, runner: ChunkRunner | None = None, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        self.model = model
        self.runner = runner or ChunkRunner(next(model.parameters()).device)
        self.max_elements = int(max_elements)
        me = self.max_elements
        k, st = model.conv1.kernel_size, model.conv1.stride
        if k[0] != k[1] or st != k or any(model.conv1.padding) or model.conv1.in_channels != 1:
            raise ValueError(f"ChunkedTissueUNet needs conv1 with one input channel, a square kernel equal to its stride "
                             f"and no padding; got kernel {k}, stride {st}, padding {model.conv1.padding}")
        self.conv2 = BigConv2d.from_conv(model.conv2, self.runner, me, "tissue.conv2")
        self.conv3 = BigConv2d.from_conv(model.conv3, self.runner, me, "tissue.conv3")
        self.conv4 = BigConv2d.from_conv(model.conv4, self.runner, me, "tissue.conv4")
        self.conv6 = BigConv2d.from_conv(model.conv6, self.runner, me, "tissue.conv6")
        self.conv7 = BigConv2d.from_conv(model.conv7, self.runner, me, "tissue.conv7")

    def low_logits(self, grey: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Logits ``z8`` [1, 1, H/8, W/8] (host) of a uint8 greyscale image (H, W); the model's
        full-resolution logit is ``z8`` upsampled x8 by nearest neighbour."""
        m, r, me = self.model, self.runner, self.max_elements
        g = _as_image(grey, "image")
        e1 = _InputConvReLU.apply(g, m.conv1.weight, m.conv1.bias, r, me, "tissue.conv1")
        e2 = F.relu(self.conv2(e1))
        b = F.relu(self.conv3(e2))
        b = F.relu(self.conv4(b) + e2)
        u = F.relu(_ConvTransposeNoOverlap.apply(b, m.up5.weight, m.up5.bias, r, me, "tissue.up5") + e1)
        u = F.relu(self.conv6(u))
        return self.conv7(u)

    def loss(self, grey: torch.Tensor | np.ndarray, label: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Mean binary cross-entropy of the whole image against a uint8 {0, 1} label of the same size."""
        g, lab = _as_image(grey, "image"), _as_image(label, "label")
        if g.shape != lab.shape:
            raise ValueError(f"label shape {tuple(lab.shape[2:])} differs from image shape {tuple(g.shape[2:])}")
        if int(lab.max()) > 1:
            raise ValueError(f"label must hold 0 (glass) and 1 (tissue) only, found values up to {int(lab.max())}")
        z = self.low_logits(g[0, 0])
        return _UpsampleBCE.apply(z, lab, self.model.OUTPUT_STRIDE, self.runner, self.max_elements, "tissue.upsample_bce")

    @torch.no_grad()
    def predict_low(self, grey: torch.Tensor | np.ndarray) -> np.ndarray:
        """Tissue probability of each 8 x 8 px block (the model's output is constant on them): float32 (H/8, W/8)."""
        return torch.sigmoid(self.low_logits(grey))[0, 0].float().cpu().numpy()
