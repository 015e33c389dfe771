"""Helpers the Big-Layers exactness tests share: the CPU checks in tests/bigl and the CUDA checks in
tests/training/test_cuda_float64.py.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

import torch
from torch import nn

from wsi_pipeline.models import build_encoder


def rel(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - ref| / max(max |ref|, floor), in float64 on the CPU (0 for empty tensors).

    ``floor`` measures a tensor that is zero in exact arithmetic against a scale of the caller's
    choosing instead of its own rounding noise.
    """
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if ref.numel() == 0:
        return 0.0
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), floor, 1e-300)


def perturbed_resnet(name: str, bn: str = "train", dtype: torch.dtype = torch.float64) -> nn.Module:
    """A torchvision ResNet from ``build_encoder`` in train mode whose BatchNorm is not the identity.

    Running means ~ N(0, 0.5), running variances ~ U(0.5, 2), scales ~ U(0.5, 1.5), shifts ~
    N(0, 0.2), drawn after ``torch.manual_seed(0)``. ``bn="frozen"`` puts every BatchNorm in eval
    mode (running statistics) while the rest of the network stays in train mode.
    """
    if bn not in ("train", "frozen"):
        raise ValueError(f"bn must be 'train' or 'frozen', got {bn!r}")
    torch.manual_seed(0)
    m = build_encoder(name).to(dtype).train()
    for b in m.modules():
        if isinstance(b, nn.BatchNorm2d):
            with torch.no_grad():
                b.running_mean.normal_(0, 0.5)
                b.running_var.uniform_(0.5, 2.0)
                b.weight.uniform_(0.5, 1.5)
                b.bias.normal_(0, 0.2)
            if bn == "frozen":
                b.eval()
    return m


def encoder_step(model: nn.Module, x: torch.Tensor, r: torch.Tensor,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of sum(model(x) * r) with ``x`` on ``device``.

    Returns the output, the input's gradient and a copy of every parameter's gradient (by name).
    """
    model.zero_grad(set_to_none=True)
    x = x.to(device).clone().requires_grad_(True)
    y = model(x)
    (y * r.to(y.device)).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def state_bytes(model: nn.Module, copies: int) -> int:
    """Bytes of ``copies`` tensors the size of every parameter (1: weights; 4: weights, gradients, Adam's two moments)."""
    return copies * sum(p.numel() * p.element_size() for p in model.parameters())


def offloading_budget(state: int, plain_estimate: int) -> int:
    """A device budget a third of the way from the model's state to the plain step's estimate (bytes).

    Below the plain step's need, so the planner must fuse and offload units; above the state, so a
    plan exists.
    """
    if not 0 < state < plain_estimate:
        raise ValueError(f"need 0 < state < plain_estimate, got state={state} plain_estimate={plain_estimate}")
    return state + (plain_estimate - state) // 3
