"""What a training step moves and computes, counted without running it; predicted step times.

:func:`count_step` runs one forward + backward of an encoder (the loss ``mean(features^2)``)
under the transfer instrumentation (:mod:`wsi_pipeline.bigl.instrument`) and a FLOP counter
with ``torch.utils.flop_counter``'s formulas (:class:`FlopCount`, the same numbers as
``FlopCounterMode``). On ``meta`` tensors (:func:`dry_step`, :func:`dry_budget_step`) nothing is
allocated or computed, so a 32768 px step is counted in seconds, and the counts are exactly
those of a real run with the same chunk plan (tests check meta counts against CPU runs); a
fused run's chunks of equal shapes are computed once per pass and replayed
(:meth:`~wsi_pipeline.bigl.chunk_loop.ChunkRunner.run`).

Counted:

- ``h2d`` / ``d2h``: bytes host -> device / device -> host: every chunk a Big-Layer pass sends
  and receives (halo rows included; BatchNorm's statistics and backward-sum sweeps included),
  plus the hand-off of the last big stage's output to the device and of its gradient back. For
  a plain encoder: the input, once (the bag reaches the device once; the features' way back is
  negligible and not counted).
- ``minimum``: the bytes the layer plan cannot do without: each Big-Layer (BigConv2d,
  BigBatchNorm2d, and the pointwise layers when on the device) moves its input and output once
  per pass: forward ``x + y``; backward ``x + dy`` in and ``dx`` out (``dx`` only when the input
  needs a gradient: not for the image), plus the hand-off itself. ``h2d + d2h`` over it is 1
  only without halos and without second sweeps (BatchNorm reads ``x`` twice each way).
  For a device-budget plan (:class:`~wsi_pipeline.bigl.planned.BudgetResNet`) the plan's
  minimum (:meth:`~wsi_pipeline.bigl.budget.StepPlan.minimum_bytes`): the image once (kept on
  the device) or once per pass (from the host), every host checkpoint out and in forward, in
  again backward, its gradient out and in; halo rows and the extra passes of batch-statistics
  BatchNorm over host inputs come on top.
- ``flops``: FlopCounterMode's count (convolutions and matrix products, forward and backward,
  recomputation included; BatchNorm, ReLU, pooling and the optimiser step are not counted, as
  FlopCounterMode does not count them), and per pass the FLOPs computed between its start and
  its last chunk.

- ``host_bytes``: the memory traffic of the work a fixed plan leaves on the host. With
  ``pointwise="host"`` (:func:`~wsi_pipeline.bigl.bigify`'s default) the big stages' ReLU,
  max-pool and residual add, forward and backward, run as ordinary ops on host tensors between
  the Big-Layer passes. Counted as every tensor each such op reads and writes (arguments and
  results; views and allocations without a write count nothing), for the ops that run before
  the hand-off to the device stages and after its gradient comes back, outside any pass. Zero
  for a plain encoder and for a device-budget plan (its pointwise layers run on the device).

:func:`predict` turns counts into a step time on a stated device: compute at ``flop_rate``
(FLOP/s actually achieved), copies at ``bandwidth`` bytes/s per direction (PCIe is full
duplex), host work at ``host_rate`` bytes/s. Serial: ``flops / flop_rate + (h2d + d2h) /
bandwidth + host_bytes / host_rate``. Overlapped (the runner's two copy streams): each
Big-Layer pass takes its first chunk's upload and last chunk's download (pipeline fill and
drain) plus ``max(compute, other uploads, other downloads)``; everything else (the device
stages, the hand-off, the host work, which the Python thread does between passes) is serial. A
pass of one chunk cannot overlap at all. BatchNorm's and the device's own memory-bound work is
not modelled, so both are lower bounds for a real step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from wsi_pipeline.bigl import instrument
from wsi_pipeline.bigl.batchnorm import BigBatchNorm2d
from wsi_pipeline.bigl.conv import BigConv2d
from wsi_pipeline.bigl.pointwise import BigAddReLU, BigMaxPool2d, BigReLU
from wsi_pipeline.models.encoders import ResNet

__all__ = ["PassCost", "StepTraffic", "DeviceModel", "HostWork", "count_step", "dry_step", "dry_budget_step", "dry_forward_flops", "predict", "FlopCount",
           "paper_big_layers", "module_big_layers"]

if TYPE_CHECKING:
    from wsi_pipeline.bigl.budget import StepPlan

_BIG = (BigConv2d, BigBatchNorm2d, BigReLU, BigMaxPool2d, BigAddReLU)


@dataclass
class PassCost:
    """One pass of one Big-Layer (e.g. ``layer1.0.bn1/stats``): bytes each way and FLOPs."""

    layer: str
    h2d: int = 0
    d2h: int = 0
    flops: int = 0
    first_h2d: int = 0
    last_d2h: int = 0
    _flops_at_start: int = 0


@dataclass
class StepTraffic:
    """Counts of one training step (bytes, FLOPs); see the module docstring for what is counted."""

    h2d: int
    d2h: int
    minimum: int
    flops: int
    passes: list[PassCost] = field(default_factory=list)
    handoff: int = 0
    host_bytes: int = 0

    @property
    def moved(self) -> int:
        """Bytes both ways."""
        return self.h2d + self.d2h

    @property
    def over_minimum(self) -> float:
        """Moved bytes over the plan's minimum (1.0 when nothing moves twice)."""
        return self.moved / self.minimum if self.minimum else 1.0


@dataclass(frozen=True)
class DeviceModel:
    """A device for predictions: copy bandwidth per direction (bytes/s), achieved FLOP/s, and the rate
    (bytes read plus written per second) of the host's pointwise work; ``inf``: host work not counted."""

    name: str
    bandwidth: float
    flop_rate: float
    host_rate: float = math.inf


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FlopCount(TorchDispatchMode):
    """FLOPs with ``torch.utils.flop_counter``'s formulas (convolutions and matrix products,
    forward and backward), as ``FlopCounterMode`` counts them, without its per-module bookkeeping
    (several times faster on the many small ops of a chunked dry run)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

    def get_total_flops(self) -> int:
        return self.total


#: Ops that move no tensor data: allocations without a write, and aliases.
_NO_TRAFFIC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias"})


class HostWork(TorchDispatchMode):
    """Bytes read and written by ops on host memory between Big-Layer passes (``host_bytes`` of
    :class:`StepTraffic`). :func:`count_step` switches :attr:`on_host` at the hand-off events and
    :attr:`in_pass` at each pass's ``start`` and ``end``; an op counts the bytes of its tensor
    arguments and results, unless it is a view or in :data:`_NO_TRAFFIC`."""

    def __init__(self, on_host: bool) -> None:
        super().__init__()
        self.on_host = on_host
        self.in_pass = False
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on_host and not self.in_pass and not func.is_view and func._overloadpacket.__name__ not in _NO_TRAFFIC:
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            self.total += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        return out


def count_step(model: nn.Module, x: torch.Tensor) -> StepTraffic:
    """Count one forward + backward of ``model`` on ``x`` (loss ``mean(features^2)``).

    ``model`` is a :class:`~wsi_pipeline.bigl.BigResNet` (its transfers are counted) or a plain
    encoder (then ``h2d`` is ``x``'s bytes). Gradients are left in ``.grad`` (zero them before
    counting a second step); BatchNorm running statistics are updated as in a real step.
    """
    big_modules = [m for m in model.modules() if isinstance(m, _BIG)]
    minimum = 0

    def hook(m: nn.Module, inputs, out) -> None:
        nonlocal minimum
        ins = [t for t in inputs if isinstance(t, torch.Tensor)]
        in_b = sum(_nbytes(t) for t in ins)
        minimum += in_b + _nbytes(out)  # forward: inputs in, output out
        if out.requires_grad:
            # backward: inputs and dy in, dx out for the inputs that need a gradient
            minimum += in_b + _nbytes(out) + sum(_nbytes(t) for t in ins if t.requires_grad)

    passes: dict[str, PassCost] = {}
    last_chunk: dict[str, tuple[int, int]] = {}  # pass -> (chunk index, its d2h bytes)
    hand = {"forward": 0, "backward": 0}
    # a fixed plan's big stages hold their activations on the host until the hand-off (bigify); a
    # device-budget plan has no Big-Layer modules and runs its pointwise layers on the device
    with FlopCount() as fc, HostWork(on_host=bool(big_modules)) as host:

        def on_event(e: instrument.TransferEvent) -> None:
            if e.kind in ("start", "end"):
                host.in_pass = e.kind == "start"
            if e.kind == "handoff":
                way = e.layer.rsplit("/", 1)[-1]
                hand[way] += e.nbytes
                if e.layer.startswith("handoff/"):  # bigify's: the device stages start / the host's resume
                    host.on_host = way == "backward"
                return
            if e.kind not in ("h2d", "d2h", "chunk", "start"):
                return
            p = passes.get(e.layer)
            if p is None:  # a pass starts with its start event: FLOPs from here on are its own
                p = passes[e.layer] = PassCost(e.layer, _flops_at_start=fc.get_total_flops())
            if e.kind == "start":
                return
            if e.kind == "h2d":
                p.h2d += e.nbytes
                if e.chunk == 0:
                    p.first_h2d += e.nbytes
            elif e.kind == "d2h":
                p.d2h += e.nbytes
                i, b = last_chunk.get(e.layer, (-1, 0))
                last_chunk[e.layer] = (e.chunk, (b if i == e.chunk else 0) + e.nbytes)
            else:  # a chunk step finished: everything computed so far in this pass is its own
                p.flops = fc.get_total_flops() - p._flops_at_start

        handles = [m.register_forward_hook(hook) for m in big_modules]
        ev = instrument.register_transfer_hook(on_event)
        instrument.set_flop_counter(fc)
        try:
            y = model(x)
            y.float().square().mean().backward()
        finally:
            instrument.set_flop_counter(None)
            ev.remove()
            for h in handles:
                h.remove()
        flops = fc.get_total_flops()
    host_bytes = host.total if big_modules else 0
    plan: StepPlan | None = getattr(model, "last_plan", None)  # a BudgetResNet's (see bigl.planned)
    planned = plan is not None
    if not big_modules and not planned:
        return StepTraffic(_nbytes(x), 0, _nbytes(x), flops)
    plist = list(passes.values())
    for p in plist:
        p.last_d2h = last_chunk.get(p.layer, (0, 0))[1]
    handoff = hand["forward"] + hand["backward"]
    h2d = sum(p.h2d for p in plist) + hand["forward"]
    d2h = sum(p.d2h for p in plist) + hand["backward"]
    if plan is not None:  # a device-budget plan: its minimum is the plan's (the image, the host checkpoints)
        minimum = sum(plan.minimum_bytes(x.requires_grad))
        return StepTraffic(h2d, d2h, minimum, flops, plist, handoff)
    return StepTraffic(h2d, d2h, minimum + handoff, flops, plist, handoff, host_bytes)


def dry_step(name: str, stages: int | None, side: int, batch: int = 1, max_elements: int = 2**27,
             dtype: torch.dtype = torch.float32, pointwise: str = "host") -> StepTraffic:
    """Count a training step of encoder ``name`` on ``[batch, 3, side, side]`` on meta tensors.

    ``stages=None``: the plain encoder; else :func:`~wsi_pipeline.bigl.bigify` with that many
    Big-Layer stages, chunk budget ``max_elements`` (elements) and its ReLU, max-pool and residual
    add on the ``pointwise`` side (``host`` or ``device``).
    """
    from wsi_pipeline.bigl.convert import bigify
    from wsi_pipeline.models import build_encoder

    with torch.device("meta"):
        model = build_encoder(name).to(dtype)
    model.train()
    if stages is not None:
        model = bigify(model, stages=stages, max_elements=max_elements, device="meta", pointwise=pointwise).train()
    x = torch.empty(batch, 3, side, side, dtype=dtype, device="meta")
    return count_step(model, x)


def _meta_encoder(name: str, dtype: torch.dtype, bn: str) -> nn.Module:
    from wsi_pipeline.models import build_encoder

    if bn not in ("train", "frozen"):
        raise ValueError(f"bn={bn!r}; expected 'train' (batch statistics) or 'frozen' (running statistics)")
    with torch.device("meta"):
        model = build_encoder(name).to(dtype)
    model.train()
    if bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
    return model


def dry_budget_step(name: str, batch: int, side: int, budget: int | None, *, bn: str = "train",
                    dtype: torch.dtype = torch.float32, cast: torch.dtype | None = None,
                    max_elements: int = 2**27) -> tuple[StepTraffic, StepPlan]:
    """Count a training step of encoder ``name`` on ``[batch, 3, side, side]`` under a device budget
    (bytes; None: plain), on meta tensors; returns the counts and the plan.

    ``bn``: ``train`` (batch statistics) or ``frozen`` (running statistics, parameters trained);
    ``cast``: count as under autocast to this dtype (activations, checkpoints and the image in it).
    """
    from wsi_pipeline.bigl.planned import BudgetResNet
    from wsi_pipeline.bigl.chunk_loop import ChunkRunner

    encoder = _meta_encoder(name, dtype, bn)
    if not isinstance(encoder, ResNet):
        raise TypeError(f"encoder {name!r}: device-budget plans need a ResNet encoder, got {type(encoder).__name__}")
    model = BudgetResNet(encoder, ChunkRunner("meta"), budget, max_elements)
    model.dry_cast = cast
    x = torch.empty(batch, 3, side, side, dtype=dtype, device="meta")
    traffic = count_step(model, x)
    if model.last_plan is None:
        raise RuntimeError(f"internal error: the dry step of {name!r} made no device-budget plan")
    return traffic, model.last_plan


def dry_forward_flops(name: str, batch: int, side: int, *, dtype: torch.dtype = torch.float32) -> int:
    """FLOPs of a forward pass without gradient of encoder ``name`` on ``[batch, 3, side, side]`` (meta)."""
    model = _meta_encoder(name, dtype, "frozen")
    x = torch.empty(batch, 3, side, side, dtype=dtype, device="meta")
    with FlopCount() as fc, torch.no_grad():
        model(x)
    return fc.get_total_flops()


def predict(t: StepTraffic, device: DeviceModel, *, plain: bool = False) -> tuple[float, float]:
    """Predicted step time (s) without and with copy-compute overlap; see the module docstring.

    ``plain``: ``t`` counts a plain encoder (its input upload cannot overlap its own compute:
    both numbers are ``flops / flop_rate + h2d / bandwidth``).
    """
    compute = t.flops / device.flop_rate
    host = t.host_bytes / device.host_rate
    serial = compute + t.moved / device.bandwidth + host
    if plain or not t.passes:
        return serial, serial
    in_passes = sum(p.flops for p in t.passes)
    overlapped = (t.flops - in_passes) / device.flop_rate + t.handoff / device.bandwidth + host
    for p in t.passes:
        # fill: the first chunk's upload; drain: the last chunk's download; in between the
        # compute stream and both copy streams run at once, the slowest of the three sets the pace
        steady = max(p.flops / device.flop_rate, (p.h2d - p.first_h2d) / device.bandwidth, (p.d2h - p.last_d2h) / device.bandwidth)
        overlapped += (p.first_h2d + p.last_d2h) / device.bandwidth + steady
    return serial, min(serial, overlapped)


def module_big_layers(model: nn.Module) -> int:
    """Big-Layers as this project counts them: every BigConv2d and BigBatchNorm2d module
    (shortcut/downsample ones included)."""
    return sum(isinstance(m, (BigConv2d, BigBatchNorm2d)) for m in model.modules())


def paper_big_layers(model: nn.Module) -> int:
    """Big-Layers as the Big-Layers paper's Table 4 counts them.

    The paper labels ResNet-18 with 0..3 big stages 2/6/10/14 and ResNet-50 with 0..4 big
    stages 2/11/23/41/50. Both series equal 2 for the stem (its conv1 and bn1) plus one per
    convolution on the main path of every converted residual block (a convolution and its
    BatchNorm count once; the 1x1 downsample shortcut is not counted): ResNet-18 adds
    2 blocks x 2 = 4 per stage, ResNet-50 3 x 3 = 9, 4 x 3 = 12, 6 x 3 = 18, 3 x 3 = 9.
    """
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, BigConv2d) and "downsample" not in name.split("."):
            n += 1
    return n + 1 if n else 0  # the stem's conv1 and bn1 are 2
