"""Whole-image execution of :class:`~wsi_pipeline.tissue_seg.model.TissueUNet` in chunks.

Big-Layers (``wsi_pipeline.bigl``) for a network that is not a ResNet: every activation lives in
host memory and the compute device sees row chunks of it, with exact gradients. No full-resolution
float tensor is ever held whole:

* the input stays a uint8 greyscale image on the host; :class:`_InputConvReLU` converts each row
  chunk to the inverted 0..1 float input on the device, applies ``conv1`` (8 x 8, stride 8) and
  ReLU, and in the backward pass recomputes the chunk's input to accumulate the weight gradient
  (the input needs no gradient);
* the 1/8 and 1/32 scale convolutions run as :class:`wsi_pipeline.bigl.conv.BigConv2d` (halo rows
  handled there); ReLU and the additive skips run on the host with ordinary autograd ops, the
  Big-Layers default for pointwise layers;
* the transposed convolutions have kernel = stride, so each output row block depends on one
  input row and :class:`_ConvTransposeNoOverlap` chunks them without halos;
* the last layer (transposed 8 x 8, stride 8, to the full-resolution logit) and the binary
  cross-entropy against the uint8 label are fused in :class:`_HeadBCE`: each chunk's logits are
  made, reduced to a partial loss sum and dropped; the backward pass recomputes them to get
  ``sigmoid(z) - y``.

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
from wsi_pipeline.bigl.runner import ChunkRunner
from wsi_pipeline.tissue_seg.model import MULTIPLE, TissueUNet, prepare_input

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
    """``relu(conv(prepare_input(grey)))`` for a uint8 host image, padding 0, chunked over rows."""

    @staticmethod
    def forward(ctx: Any, grey: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, runner: ChunkRunner,
                max_elements: int, name: str) -> torch.Tensor:
        _, _, h, w = grey.shape
        co, _, k, _ = weight.shape
        s = k  # non-overlapping: kernel = stride
        win = Window(k, s, 0)
        ho, wo = win.out_size(h), (w - k) // s + 1
        # device holds the uint8 chunk, its float copy (2 input-sized) and the output chunk
        chunks = plan_rows(1, h, win, in_row=w, out_row=co * wo, max_elements=max_elements, in_factor=2, what=name)
        y = runner.host_empty((1, co, ho, wo), weight.dtype)

        def compute(i: int, ch: RowChunk, ins):
            x = prepare_input(ins[0], weight.dtype)
            _track(f"{name}/forward", i, x)
            return (F.relu(F.conv2d(x, weight, bias, stride=s)),)

        runner.run(f"{name}/forward", chunks, lambda i, ch: (grey[:, :, ch.a : ch.b],), compute,
                   lambda i, ch: (y[:, :, ch.o0 : ch.o1],))
        ctx.save_for_backward(grey, y, weight, bias)
        ctx.runner, ctx.max_elements, ctx.name, ctx.s = runner, max_elements, name, s
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        grey, y, weight, bias = ctx.saved_tensors
        runner, s, name = ctx.runner, ctx.s, ctx.name
        _, _, h, w = grey.shape
        co, _, k, _ = weight.shape
        wo = y.shape[3]
        chunks = plan_rows(1, h, Window(k, s, 0), in_row=w, out_row=co * wo, max_elements=ctx.max_elements,
                           in_factor=2, out_factor=3, what=name)
        acc: dict[str, torch.Tensor] = {}

        def compute(i: int, ch: RowChunk, ins):
            g, yc, gc = ins
            x = prepare_input(g, weight.dtype)
            gz = gc * (yc > 0)
            _track(f"{name}/backward", i, x, gz)
            _, gw, gb = torch.ops.aten.convolution_backward(
                gz, x, weight, [co], [s, s], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
            acc["w"] = gw if "w" not in acc else acc["w"].add_(gw)
            acc["b"] = gb if "b" not in acc else acc["b"].add_(gb)
            return ()

        runner.run(f"{name}/backward", chunks,
                   lambda i, ch: (grey[:, :, ch.a : ch.b], y[:, :, ch.o0 : ch.o1], gy[:, :, ch.o0 : ch.o1]), compute)
        return None, acc["w"].to(weight.device), acc["b"].to(weight.device), None, None, None


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


class _HeadBCE(torch.autograd.Function):
    """Mean ``BCEWithLogits(conv_transpose(u), label)`` with kernel = stride; logits exist one chunk at a time."""

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, label: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                runner: ChunkRunner, max_elements: int, name: str) -> torch.Tensor:
        _, c, h, w = u.shape
        s = weight.shape[2]
        # per input row: u row in, label rows in; logits, target and loss terms on the device
        chunks = _rows_plan(h, c * w + s * s * w, s * s * w, max_elements, name, out_factor=3)
        total = torch.zeros((), dtype=u.dtype, device=runner.device)

        def compute(i: int, ch: RowChunk, ins):
            z = F.conv_transpose2d(ins[0], weight, bias, stride=s)
            t = ins[1].to(z.dtype)
            _track(f"{name}/forward", i, z, t)
            total.add_(F.binary_cross_entropy_with_logits(z, t, reduction="sum"))
            return ()

        runner.run(f"{name}/forward", chunks,
                   lambda i, ch: (u[:, :, ch.a : ch.b], label[:, :, ch.a * s : ch.b * s]), compute)
        ctx.save_for_backward(u, label, weight, bias)
        ctx.runner, ctx.max_elements, ctx.name, ctx.count = runner, max_elements, name, label.numel()
        return (total / ctx.count).to(u.device)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gl: torch.Tensor):
        u, label, weight, bias = ctx.saved_tensors
        runner, name = ctx.runner, ctx.name
        _, c, h, w = u.shape
        s = weight.shape[2]
        chunks = plan_rows(1, h, Window(), in_row=c * w + s * s * w, out_row=s * s * w, max_elements=ctx.max_elements,
                           in_factor=2, out_factor=3, what=name)
        gu = runner.host_empty(u.shape, u.dtype)
        scale = gl.to(runner.device) / ctx.count
        acc: dict[str, torch.Tensor] = {}

        def compute(i: int, ch: RowChunk, ins):
            uc, lab = ins
            z = F.conv_transpose2d(uc, weight, bias, stride=s)
            gz = (torch.sigmoid(z) - lab.to(z.dtype)) * scale
            _track(f"{name}/backward", i, z, gz)
            del z
            g_in, gw, gb = torch.ops.aten.convolution_backward(
                gz, uc, weight, [1], [s, s], [0, 0], [1, 1], True, [0, 0], 1, [True, True, True])
            acc["w"] = gw if "w" not in acc else acc["w"].add_(gw)
            acc["b"] = gb if "b" not in acc else acc["b"].add_(gb)
            return (g_in,)

        runner.run(f"{name}/backward", chunks,
                   lambda i, ch: (u[:, :, ch.a : ch.b], label[:, :, ch.a * s : ch.b * s]), compute,
                   lambda i, ch: (gu[:, :, ch.a : ch.b],))
        return gu, None, acc["w"].to(weight.device), acc["b"].to(weight.device), None, None, None


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
        self.conv2 = BigConv2d.from_conv(model.conv2, self.runner, me, "tissue.conv2")
        self.conv3 = BigConv2d.from_conv(model.conv3, self.runner, me, "tissue.conv3")
        self.conv4 = BigConv2d.from_conv(model.conv4, self.runner, me, "tissue.conv4")
        self.conv6 = BigConv2d.from_conv(model.conv6, self.runner, me, "tissue.conv6")

    def features(self, grey: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Decoder features ``u`` [1, C, H/8, W/8] (host) of a uint8 greyscale image (H, W)."""
        m, r, me = self.model, self.runner, self.max_elements
        g = _as_image(grey, "image")
        e1 = _InputConvReLU.apply(g, m.conv1.weight, m.conv1.bias, r, me, "tissue.conv1")
        e2 = F.relu(self.conv2(e1))
        b = F.relu(self.conv3(e2))
        b = F.relu(self.conv4(b) + e2)
        u = F.relu(_ConvTransposeNoOverlap.apply(b, m.up5.weight, m.up5.bias, r, me, "tissue.up5") + e1)
        return F.relu(self.conv6(u))

    def loss(self, grey: torch.Tensor | np.ndarray, label: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Mean binary cross-entropy of the whole image against a uint8 {0, 1} label of the same size."""
        g, lab = _as_image(grey, "image"), _as_image(label, "label")
        if g.shape != lab.shape:
            raise ValueError(f"label shape {tuple(lab.shape[2:])} differs from image shape {tuple(g.shape[2:])}")
        u = self.features(grey)
        m = self.model
        return _HeadBCE.apply(u, lab, m.up7.weight, m.up7.bias, self.runner, self.max_elements, "tissue.up7_bce")

    @torch.no_grad()
    def predict_low(self, grey: torch.Tensor | np.ndarray) -> np.ndarray:
        """Tissue probability averaged over each 8 x 8 px block: float32 (H/8, W/8)."""
        u = self.features(grey)
        m, r = self.model, self.runner
        _, c, h, w = u.shape
        s = m.up7.weight.shape[2]
        out = torch.empty((1, 1, h, w), dtype=torch.float32)
        chunks = _rows_plan(h, c * w, s * s * w, self.max_elements, "tissue.up7_predict", out_factor=2)

        def compute(i: int, ch: RowChunk, ins):
            p = torch.sigmoid(F.conv_transpose2d(ins[0], m.up7.weight, m.up7.bias, stride=s))
            return (F.avg_pool2d(p, s).float(),)

        r.run("tissue.up7_predict", chunks, lambda i, ch: (u[:, :, ch.a : ch.b],), compute,
              lambda i, ch: (out[:, :, ch.a : ch.b],))
        return out[0, 0].numpy()
