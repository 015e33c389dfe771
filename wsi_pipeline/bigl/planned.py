"""A ResNet whose step follows a device-budget plan (:mod:`wsi_pipeline.bigl.budget`).

Per input shape (and dtype, autocast dtype, gradient mode, BatchNorm modes) the plan says how
many units run as fused runs (:mod:`wsi_pipeline.bigl.fused`) and where their checkpoints live;
:class:`BudgetResNet` executes it: the image is converted once into a reused host buffer (in the
autocast dtype when the first convolution computes in it: half the bytes; pinned on CUDA) and,
when the plan keeps it on the device, uploaded once; each fused run reads its input from the
device or the host and writes its output where the plan keeps it; the rest of the network runs
as plain layers on the device. With nothing to offload, the step is the plain encoder's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wsi_pipeline.bigl import instrument
from wsi_pipeline.bigl.budget import StepPlan, plan_step
from wsi_pipeline.bigl.fused import FusedRun
from wsi_pipeline.bigl.precision import autocast_dtype
from wsi_pipeline.bigl.chunk_loop import ChunkRunner
from wsi_pipeline.bigl.units import resnet_units
from wsi_pipeline.models.encoders import ResNet

__all__ = ["BudgetResNet"]


class _Upload(torch.autograd.Function):
    """``x.to(device)`` of the whole image, reported to the instrumentation (``image/forward``; its
    gradient ``image/backward``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        ctx.host = x.device
        y = x.to(device)  # blocking: the host buffer is free for the next step once this returns
        if instrument.active():
            instrument.handoff("image/forward", y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        g = g.to(ctx.host)
        if instrument.active():
            instrument.handoff("image/backward", g)
        return g, None


class _IntoBuffer(torch.autograd.Function):
    """Copy ``x`` into the host buffer ``buf`` (another dtype or layout); differentiable in ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        buf.copy_(x)
        return buf.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g.to(ctx.dtype), None


class BudgetResNet(nn.Module):
    """A ResNet trained within a device memory budget: plain when the step fits, else fused runs.

    Children, Parameters and buffers are the wrapped encoder's, under the same names (its
    ``state_dict`` is the plain encoder's; training one trains the other).

    Parameters
    ----------
    model
        A ResNet from :func:`wsi_pipeline.models.build_encoder` (moved to the runner's device).
    runner
        Compute device and transfer machinery.
    budget
        Device bytes a step may use (None: no budget, every step plain).
    max_elements
        Most working elements of one chunk step.
    stages
        The fixed Big-Layers plan's stage count (``bigl.stages``), kept for the inference
        fallback (:class:`~wsi_pipeline.bigl.embed.EmbeddingEncoder`).

    Attributes
    ----------
    last_plan : StepPlan | None
        The plan of the last call.
    """

    host_input = True
    #: the wrapped encoder (not a submodule: its state is this module's, under the same names)
    _plain: ResNet

    def __init__(self, model: ResNet, runner: ChunkRunner, budget: int | None, max_elements: int, *, stages: int = 1) -> None:
        super().__init__()
        for name, m in model.named_children():
            self.add_module(name, m)
        object.__setattr__(self, "_plain", model)
        self.runner = runner
        self.budget = budget
        self.max_elements = int(max_elements)
        self.big_stages = int(stages)
        self.num_features = model.num_features
        self.units = resnet_units(model)
        self._plans: dict[tuple, StepPlan] = {}
        self._runs: dict[tuple[int, int], FusedRun] = {}
        self.last_plan: StepPlan | None = None
        self.training = model.training  # the children keep their own modes (e.g. frozen BatchNorm)

    @property
    def plain(self) -> ResNet:
        """The wrapped plain encoder (shares every Parameter and buffer with this module)."""
        return self._plain

    def stages(self) -> list[nn.Sequential]:
        return self._plain.stages()

    #: dry runs only: count as under autocast to this dtype (meta tensors have no autocast)
    dry_cast: torch.dtype | None = None

    def _cast(self, x: torch.Tensor) -> torch.dtype | None:
        if self.dry_cast is not None:
            return self.dry_cast
        return autocast_dtype(self.runner.device, x, self._plain.conv1.weight)

    def _key(self, shape, dtype: torch.dtype, cast: torch.dtype | None, grad: bool) -> tuple:
        modes = tuple(m.training for m in self.modules() if isinstance(m, nn.BatchNorm2d))
        return (tuple(int(s) for s in shape), dtype, cast, bool(grad), modes)

    def set_plan(self, plan: StepPlan) -> None:
        """Use ``plan`` for steps on its input (shape, dtype, autocast dtype, gradient mode) in the
        current BatchNorm modes (a plan made by :func:`~wsi_pipeline.bigl.budget.manual_plan`, for
        experiments and tests)."""
        dtype = getattr(torch, plan.dtype)
        cast = None if plan.transfer_dtype == plan.dtype else getattr(torch, plan.transfer_dtype)
        self._plans[self._key(plan.shape, dtype, cast, plan.grad)] = plan

    def plan_for(self, shape, dtype: torch.dtype = torch.float32, *, cast: torch.dtype | None = None,
                 grad: bool = True) -> StepPlan:
        """The plan of a step on ``shape`` (cached per shape, dtypes, gradient mode and BatchNorm modes)."""
        key = self._key(shape, dtype, cast, grad)
        if key not in self._plans:
            self._plans[key] = plan_step(self._plain, key[0], self.budget, dtype=dtype, cast=cast, grad=grad,
                                         max_elements=self.max_elements)
        return self._plans[key]

    def _run(self, i: int, elements: int) -> FusedRun:
        key = (i, int(elements))
        if key not in self._runs:
            self._runs[key] = FusedRun(self.units[i], self.runner, elements)
        return self._runs[key]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Last-stage feature map on the device, as ``ResNet.forward_features``."""
        cast = self._cast(x)
        grad = torch.is_grad_enabled()
        plan = self.plan_for(tuple(x.shape), x.dtype, cast=cast, grad=grad)
        self.last_plan = plan
        runner = self.runner
        if plan.plain:
            return self._plain.forward_features(_Upload.apply(x, runner.device) if runner.is_host(x) else x)
        if not runner.is_host(x):
            x = x.to(runner.host_device)
        buf = runner.buffers.acquire("image", tuple(x.shape), cast or x.dtype)
        img = _IntoBuffer.apply(x, buf)
        if plan.places[0] == "device":
            img = _Upload.apply(img, runner.device).contiguous(memory_format=torch.channels_last)
            if not runner.buffers.owns(img):
                runner.buffers.release(buf)  # uploaded: the host copy is free (the stem releases it otherwise)
        t = img
        k = plan.offloaded
        for i in range(k):
            x_res = plan.places[i] == "device"
            y_res = i == k - 1 or plan.places[i + 1] == "device"
            t = self._run(i, plan.chunk_elements)(t, cast=cast, x_resident=x_res, y_resident=y_res)
        blocks = [b for stage in self._plain.stages() for b in stage]
        for block in blocks[k - 1 :]:
            t = block(t)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` (host tensors) -> features ``[B, num_features]`` on the device."""
        return torch.flatten(self._plain.avgpool(self.forward_features(x)), 1)

    def describe(self, shape, dtype: torch.dtype = torch.float32, *, cast: torch.dtype | None = None, grad: bool = True) -> str:
        """The plan of a step on ``shape``, in words (for the log and the run folder)."""
        return self.plan_for(shape, dtype, cast=cast, grad=grad).describe()
