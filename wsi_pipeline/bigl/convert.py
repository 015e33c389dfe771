"""``bigify``: run the stem and the first residual stages of a ResNet as Big-Layers (the fixed
plan), or, with a device budget, only what does not fit (:mod:`wsi_pipeline.bigl.planned`)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from wsi_pipeline.bigl import instrument
from wsi_pipeline.bigl.batchnorm import BigBatchNorm2d
from wsi_pipeline.bigl.budget import resolve_budget
from wsi_pipeline.bigl.conv import BigConv2d
from wsi_pipeline.bigl.planned import BudgetResNet
from wsi_pipeline.bigl.pointwise import BigAddReLU, BigMaxPool2d, BigReLU
from wsi_pipeline.bigl.chunk_loop import ChunkRunner
from wsi_pipeline.models.encoders import ResNet

__all__ = ["bigify", "BigResNet", "BigBlock"]

POINTWISE = ("host", "device")


class _Handoff(torch.autograd.Function):
    """``x.to(device)`` where the big stages end, reported to the transfer instrumentation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        ctx.host = x.device
        y = x.to(device, non_blocking=True)
        if instrument.active():
            instrument.handoff("handoff/forward", y)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.to(ctx.host)
        if instrument.active():
            instrument.handoff("handoff/backward", g)
        return g, None


class _Converter:
    def __init__(self, runner: ChunkRunner, max_elements: int, pointwise: str) -> None:
        self.runner, self.max_elements, self.pointwise = runner, max_elements, pointwise

    def conv(self, m: nn.Conv2d, name: str) -> BigConv2d:
        return BigConv2d.from_conv(m, self.runner, self.max_elements, name)

    def bn(self, m: nn.BatchNorm2d, name: str) -> BigBatchNorm2d:
        return BigBatchNorm2d.from_bn(m, self.runner, self.max_elements, name)

    def relu(self, m: nn.Module, name: str) -> nn.Module:
        return m if self.pointwise == "host" else BigReLU.create(self.runner, self.max_elements, name)

    def module(self, m: nn.Module, name: str) -> nn.Module:
        """Big version of one layer of a big stage (recursing into ``downsample``)."""
        if isinstance(m, nn.Conv2d):
            return self.conv(m, name)
        if isinstance(m, nn.BatchNorm2d):
            return self.bn(m, name)
        if isinstance(m, nn.ReLU):
            return self.relu(m, name)
        if isinstance(m, nn.Sequential):
            return nn.Sequential(*(self.module(c, f"{name}.{k}") for k, c in m.named_children()))
        raise TypeError(f"{name}: {type(m).__name__} has no Big-Layer version; only Conv2d, BatchNorm2d, ReLU, MaxPool2d")


class BigBlock(nn.Module):
    """A residual block (Basic or Bottleneck) whose layers are Big-Layers.

    Same children names as the wrapped block (``conv1, bn1, ..., relu, downsample``); computes
    ``relu(bn_k(conv_k(...relu(bn1(conv1(x)))...)) + shortcut(x))`` on host tensors.
    """

    # children set by name from the wrapped block (declared for the type checker)
    relu: nn.Module
    downsample: nn.Module | None

    def __init__(self, block: nn.Module, conv: _Converter, name: str) -> None:
        super().__init__()
        for child, m in block.named_children():
            setattr(self, child, conv.module(m, f"{name}.{child}"))
        if "downsample" not in self._modules:
            self.downsample = None
        self._pairs = [(f"conv{j}", f"bn{j}") for j in (1, 2, 3) if hasattr(block, f"conv{j}")]
        self._add_relu = BigAddReLU(conv.runner, conv.max_elements, f"{name}.add_relu") if conv.pointwise == "device" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = x
        last = len(self._pairs) - 1
        for j, (c, b) in enumerate(self._pairs):
            out = getattr(self, b)(getattr(self, c)(out))
            if j < last:
                out = self.relu(out)
        if self._add_relu is not None:
            return self._add_relu(out, identity)
        out += identity  # the BN output is not saved for backward, so in place is safe
        return self.relu(out)


class BigResNet(nn.Module):
    """A ResNet whose stem and first ``stages`` residual stages run as Big-Layers.

    Activations of the big part live in host memory (channels-last; pinned on CUDA); every
    convolution and BatchNorm there runs on the device in chunks of at most ``max_elements``
    elements. After the last big stage the (by then downsampled) tensor moves to the device,
    where the remaining stages and the pooling run as ordinary layers.

    Parameter and buffer names are those of the wrapped ResNet, so ``state_dict()`` loads into
    a plain encoder and back. Parameters, buffers and the unconverted stages are *shared* with
    the wrapped model (not copied): training one trains the other.

    Attributes
    ----------
    num_features : int
        Output width D, as the wrapped encoder.
    big_stages : int
        Number of residual stages converted (0 = stem only).
    runner : ChunkRunner
        The compute device and transfer machinery.
    host_input : bool
        True: the first layer takes its input from host memory, chunk by chunk. Callers keep the
        images on the host (``full_step`` does): sending them to the device first would only
        make a whole-bag round trip (device -> host again before the first chunk).
    plain : ResNet
        The wrapped encoder (same Parameters and buffers), e.g. for inference on the device
        when its activations fit (:class:`~wsi_pipeline.bigl.embed.EmbeddingEncoder`).
    """

    host_input = True
    # the stages, added by name in __init__, and the wrapped encoder (not a submodule)
    layer1: nn.Module
    layer2: nn.Module
    layer3: nn.Module
    layer4: nn.Module
    _plain: ResNet

    def __init__(self, model: ResNet, stages: int, runner: ChunkRunner, max_elements: int, pointwise: str) -> None:
        super().__init__()
        conv = _Converter(runner, max_elements, pointwise)
        self.conv1 = conv.conv(model.conv1, "conv1")
        self.bn1 = conv.bn(model.bn1, "bn1")
        self.relu = conv.relu(model.relu, "relu")
        self.maxpool = model.maxpool if pointwise == "host" else BigMaxPool2d.from_pool(model.maxpool, runner, max_elements, "maxpool")
        for i, stage in enumerate(model.stages(), start=1):
            name = f"layer{i}"
            if i <= stages:
                stage = nn.Sequential(*(BigBlock(b, conv, f"{name}.{k}") for k, b in stage.named_children()))
            self.add_module(name, stage)
        self.avgpool = model.avgpool
        self.num_features = model.num_features
        self.big_stages = stages
        self.max_elements = max_elements
        self.runner = runner
        # not a submodule: its state is this module's state under the same names
        object.__setattr__(self, "_plain", model)
        self.train(model.training)

    @property
    def plain(self) -> ResNet:
        """The wrapped plain encoder (shares every Parameter and buffer with this module)."""
        return self._plain

    def stages(self) -> list[nn.Module]:
        """The four residual stages ``[layer1, layer2, layer3, layer4]``."""
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Last-stage feature map on the compute device, as ``ResNet.forward_features``."""
        x = self.runner.to_host(x)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        stages = self.stages()
        for stage in stages[: self.big_stages]:
            x = stage(x)
        # the tensor is small enough now: the rest of the network runs on the device
        x = _Handoff.apply(x, self.runner.device)
        for stage in stages[self.big_stages :]:
            x = stage(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` -> features ``[B, num_features]`` on the device.

        Pass host tensors (:attr:`host_input`): a device tensor is first copied back to the host.
        """
        return torch.flatten(self.avgpool(self.forward_features(x)), 1)


@overload
def bigify(model: nn.Module, stages: int, max_elements: int, device: torch.device | str | None = None, *,
           pointwise: str = "host", pin_memory: bool = True, device_budget_gb: None = None) -> BigResNet: ...
@overload
def bigify(model: nn.Module, stages: int, max_elements: int, device: torch.device | str | None = None, *,
           pointwise: str = "host", pin_memory: bool = True,
           device_budget_gb: float | str | None = None) -> BigResNet | BudgetResNet: ...
def bigify(
    model: nn.Module,
    stages: int,
    max_elements: int,
    device: torch.device | str | None = None,
    *,
    pointwise: str = "host",
    pin_memory: bool = True,
    device_budget_gb: float | str | None = None,
) -> BigResNet | BudgetResNet:
    """Convert the stem and the first ``stages`` residual stages of a ResNet to Big-Layers.

    Parameters
    ----------
    model
        A ResNet encoder from :func:`wsi_pipeline.models.build_encoder`.
    stages
        Residual stages to convert, 0..4 (0 = only the stem's conv1 + bn1, the paper's
        "0 stages (2 Big-Layers)").
    max_elements
        Elements one chunk step may hold on the device (inputs plus outputs of the step).
        Must fit one output row of one sample of every big layer (the error says how much).
    device
        Compute device; ``None``: CUDA when available, else CPU. ``model`` is moved there
        (parameters are small; activations of the big part stay in host memory).
    pointwise
        ``"host"`` (default): ReLU, MaxPool and the residual add run on the host;
        ``"device"``: they are chunked on the device too.
    pin_memory
        CUDA only: keep the host activations in pinned memory (fastest transfers; PyTorch's
        pinned allocator rounds blocks up to a power of two). ``False``: pageable activations,
        each chunk staged through a chunk-sized pinned buffer.
    device_budget_gb
        None (default): the fixed plan above, every layer of the big stages offloaded (the
        paper's). A number of GB (10^9 bytes) or ``"auto"`` (the CUDA device's free memory minus
        a margin; no budget on the CPU, which then keeps the fixed plan): a
        :class:`~wsi_pipeline.bigl.planned.BudgetResNet`, plain when the step fits, else the
        units that do not fit as fused runs (:mod:`wsi_pipeline.bigl.budget` states the rule);
        ``stages`` is then kept for the inference fallback only and ``max_elements`` caps a
        chunk step's working elements.

    Returns
    -------
    BigResNet or BudgetResNet
        Computes the same function as ``model`` (same outputs, gradients and BatchNorm
        running statistics up to floating-point rounding); shares its parameters and buffers.
    """
    if not isinstance(model, ResNet):
        raise TypeError(f"bigify expects a ResNet from wsi_pipeline.models.build_encoder, got {type(model).__name__}")
    if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= 4:
        raise ValueError(f"stages={stages!r} is out of range; use 0 (stem only) to 4 (every residual stage)")
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"max_elements={max_elements!r} must be a positive int (elements per device chunk)")
    if pointwise not in POINTWISE:
        raise ValueError(f"pointwise={pointwise!r}; choose one of {POINTWISE}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ChunkRunner(device, pin_memory=pin_memory)
    model.to(runner.device)
    budget = resolve_budget(device_budget_gb, runner.device)
    if budget is not None:
        return BudgetResNet(model, runner, budget, max_elements, stages=stages)
    return BigResNet(model, stages, runner, max_elements, pointwise)
