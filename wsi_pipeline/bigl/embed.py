"""Inference for a Big-Layers encoder: the plain encoder on the device when a call fits a budget.

Validation and evaluation embed tiles without gradient, ``batch_size`` tiles per call. Such a
call needs far less memory than a training step (nothing is saved for backward), so for tile
bags the plain encoder almost always fits on the device, and Big-Layers would only add a
device -> host -> device round trip per layer. :class:`EmbeddingEncoder` decides per call:

- the plain encoder runs on the device when the call's estimated activation memory,
  ``input + 3 x largest activation`` (bytes, see :func:`inference_activation_bytes`), is at
  most ``budget_bytes``;
- otherwise the input goes through the Big-Layers version (host activations, device chunks of
  at most ``max_elements`` elements), built on first use and sharing every Parameter and buffer.

Both paths compute the same function (same outputs up to floating-point rounding; exact in
float64 to round-off), so the choice changes memory and speed, never the embedding.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from wsi_pipeline.bigl.convert import BigResNet, bigify
from wsi_pipeline.models.encoders import ResNet

__all__ = ["EmbeddingEncoder", "inference_activation_bytes", "inference_budget_bytes"]

#: Share of the CUDA device's total memory a plain inference call may use by default.
CUDA_BUDGET_FRACTION = 0.5


def inference_budget_bytes(device: torch.device) -> int | None:
    """Default budget: half the CUDA device's total memory; None (no limit) on other devices.

    On the CPU the Big-Layers path would keep the same activations in the same (host) memory,
    so it can never save memory there and the plain encoder always runs.
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * CUDA_BUDGET_FRACTION)
    return None


def inference_activation_bytes(model: nn.Module, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
    """Estimated peak activation memory (bytes) of a no-grad forward of ``model`` on ``shape``.

    ``input + 3 x the largest output of any leaf layer``, all at ``dtype``'s element size: a
    no-grad forward of a residual network holds the caller's input, a block's input (the
    identity), the block's running intermediate and the output of the layer being computed
    (Bottleneck: identity, conv3 output, bn3 output). Shapes come from a forward on meta
    tensors (no memory, no arithmetic); the model is not changed.
    """
    largest = 0

    def hook(_m: nn.Module, _i, out) -> None:
        nonlocal largest
        if isinstance(out, torch.Tensor):
            largest = max(largest, out.numel())

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(hook) for m in leaves]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # inference: BatchNorm on running statistics (any batch size)
    try:
        meta = {k: torch.empty_like(v, device="meta") for k, v in itertools.chain(model.named_parameters(), model.named_buffers())}
        x = torch.empty(tuple(shape), dtype=dtype, device="meta")
        with torch.no_grad():
            torch.func.functional_call(model, meta, (x,))
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.training = mode
    n_in = 1
    for s in shape:
        n_in *= int(s)
    return (n_in + 3 * largest) * torch.empty((), dtype=dtype).element_size()


class EmbeddingEncoder(nn.Module):
    """A ResNet for inference that runs plain on the device when a call fits, Big-Layers when not.

    Its children *are* the plain encoder's (same names), so its ``state_dict`` is the plain
    encoder's and a ``bigl`` checkpoint loads into it strictly.

    Parameters
    ----------
    plain
        The encoder (a ResNet from :func:`wsi_pipeline.models.build_encoder`).
    stages, max_elements, pointwise
        The Big-Layers conversion used when a call does not fit (see :func:`bigify`).
    budget_bytes
        Device memory a plain call may use (bytes); ``None``: :func:`inference_budget_bytes` of
        the encoder's device at call time (half a CUDA device's memory; no limit on the CPU).
    big
        An existing Big-Layers version of ``plain`` to use instead of building one (the
        training encoder, during validation).

    Attributes
    ----------
    last_path : str
        ``"plain"`` or ``"bigl"``: what the last call used (for logs and tests).
    """

    # not submodules (their state is this module's, under the same names); set in __init__
    _plain: ResNet
    _big: BigResNet | None

    def __init__(
        self,
        plain: ResNet,
        *,
        stages: int,
        max_elements: int,
        budget_bytes: int | None = None,
        big: BigResNet | None = None,
        pointwise: str = "host",
    ) -> None:
        super().__init__()
        if not isinstance(plain, ResNet):
            raise TypeError(f"EmbeddingEncoder expects a ResNet from wsi_pipeline.models.build_encoder, got {type(plain).__name__}")
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or budget_bytes < 0):
            raise ValueError(f"budget_bytes={budget_bytes!r}; expected bytes >= 0 or None (the device default)")
        for name, m in plain.named_children():
            self.add_module(name, m)
        object.__setattr__(self, "_plain", plain)
        object.__setattr__(self, "_big", big)
        self.num_features = plain.num_features
        self.stages, self.max_elements, self.pointwise = int(stages), int(max_elements), pointwise
        self.budget_bytes = budget_bytes
        self.last_path = ""
        self._estimates: dict[tuple, int] = {}

    @classmethod
    def from_big(cls, big: BigResNet, budget_bytes: int | None = None) -> EmbeddingEncoder:
        """The inference encoder of a training Big-Layers encoder (shares it and its plain encoder)."""
        return cls(big.plain, stages=big.big_stages, max_elements=big.max_elements, budget_bytes=budget_bytes, big=big)

    def _apply(self, fn, recurse: bool = True):
        # a device or dtype change: the Big-Layers version is rebuilt on the next call that needs it
        object.__setattr__(self, "_big", None)
        return super()._apply(fn, recurse)

    def device(self) -> torch.device:
        """Where the parameters (and the plain path) live."""
        return next(self._plain.parameters()).device

    def budget(self) -> int | None:
        """The budget in bytes this call applies (None: no limit)."""
        return self.budget_bytes if self.budget_bytes is not None else inference_budget_bytes(self.device())

    def needs_bytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Estimated activation bytes of a plain call on ``shape`` (cached per shape and dtype)."""
        key = (tuple(int(s) for s in shape), dtype)
        if key not in self._estimates:
            self._estimates[key] = inference_activation_bytes(self._plain, key[0], dtype)
        return self._estimates[key]

    def fits(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> bool:
        """Whether a call on ``shape`` runs the plain encoder on the device."""
        budget = self.budget()
        return budget is None or self.needs_bytes(shape, dtype) <= budget

    def big_model(self) -> BigResNet:
        """The Big-Layers version (built on the parameters' device on first use)."""
        big = self._big
        if big is None:
            big = bigify(self._plain, self.stages, self.max_elements, device=self.device(), pointwise=self.pointwise)
            object.__setattr__(self, "_big", big)
        return big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` -> features ``[B, num_features]`` on the parameters' device."""
        if self.fits(x.shape, x.dtype):
            self.last_path = "plain"
            self._plain.train(self.training)
            return self._plain(x.to(self.device(), non_blocking=True))
        self.last_path = "bigl"
        big = self.big_model()
        before = big.training
        big.train(self.training)
        try:
            return big(x)
        finally:
            big.train(before)
