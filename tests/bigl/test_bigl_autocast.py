"""Big-Layers under autocast follow plain autocast's precision policy, forward and backward.

Policy (exact checks): under ``torch.autocast("cpu", dtype=torch.bfloat16)`` every convolution
and convolution backward that a Big-Layers ResNet runs is in bfloat16, as in the plain ResNet
under the same autocast (recorded at the ATen level with a dispatch mode); every conv / BN
layer's output has the plain layer's dtype; parameter gradients are float32. float64 models are
left alone by autocast, and so by Big-Layers: exact to 1e-9 as without autocast.

Numerics (tolerance from a rounding argument, the one that also bounds plain bf16 vs fp32):
bfloat16 keeps 8 significant bits, unit roundoff u = 2^-8. A forward pass rounds the output of
every conv, BN and residual add on the network's longest path to bfloat16: D roundings
(ResNet-18: stem conv + BN, then 8 blocks x (2 conv + 2 BN + 1 add) = 42). To first order, with
each (normalised) layer passing a relative perturbation on unamplified, the forward output's
relative error (Frobenius norm) is <= D u, and the gradients' (forward and backward roundings)
<= 2 D u. float32 (u = 2^-24) is exact at this scale, so plain bf16 vs plain fp32 must meet
these bounds (checked); Big-Layers and plain autocast are two such evaluations, each within the
bound of the exact result, so they differ by at most twice the bound. Gradients are compared
with BatchNorm on running statistics (the project's default ``bn: frozen``): with batch
statistics of a few values per channel (layer4 at 2 x 2 px) BN's backward is ill-conditioned and
no first-order bound holds for plain bf16 either; there the forward output is compared.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wsi_pipeline.bigl import bigify
from wsi_pipeline.models import build_encoder

BF16_U = 2.0**-8
RESNET18_ROUNDINGS = 2 + 8 * (2 + 2 + 1)
CONV_OPS = {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}


pytestmark = pytest.mark.usefixtures("one_thread")


class _ConvDtypes(TorchDispatchMode):
    """Records the dtypes of the floating tensor arguments of every convolution (forward, backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in CONV_OPS:
            self.calls += 1
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _model(train: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = build_encoder("resnet18").to(dtype)
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):  # running statistics that are not the identity
            bn.running_mean.normal_(0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m.train(train)


def _step(model: nn.Module, x: torch.Tensor, r: torch.Tensor, autocast: bool, train: bool):
    """Output, all parameter gradients (one vector), conv dtypes and per-layer output dtypes."""
    model.zero_grad(set_to_none=True)
    model.train(train)
    out_dtypes: dict[str, torch.dtype] = {}
    hooks = [
        m.register_forward_hook(lambda mod, i, o, name=name: out_dtypes.__setitem__(name, o.dtype))
        for name, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))
    ]
    rec = _ConvDtypes()
    try:
        with rec, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
            (y.to(r.dtype) * r).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return y, grads, rec, out_dtypes


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("train", [False, True], ids=["bn-running", "bn-batch"])
def test_bf16_autocast_policy_and_numerics_match_plain_autocast(train):
    plain = _model(train)
    fp32 = copy.deepcopy(plain)
    big = bigify(copy.deepcopy(plain), stages=2, max_elements=20_000, device="cpu")
    torch.manual_seed(1)
    x, r = torch.randn(2, 3, 48, 48), torch.randn(2, 512)

    y32, g32, rec32, _ = _step(fp32, x, r, autocast=False, train=train)
    yp, gp, recp, dtp = _step(plain, x, r, autocast=True, train=train)
    yb, gb, recb, dtb = _step(big, x, r, autocast=True, train=train)

    # the policy: every convolution, forward and backward, in bfloat16 in both; fp32 without autocast
    assert rec32.dtypes == {torch.float32}
    assert recp.dtypes == {torch.bfloat16} and recp.calls > 0
    assert recb.dtypes == {torch.bfloat16} and recb.calls > recp.calls  # chunked: more, smaller calls
    assert dtb == dtp and set(dtp.values()) == {torch.bfloat16}
    assert yb.dtype == yp.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in gb + gp)

    fwd_bound = RESNET18_ROUNDINGS * BF16_U
    assert _rel(yp, y32) <= fwd_bound, "plain bf16 vs fp32 exceeds the derived bound: the argument is wrong"
    assert _rel(yb, yp) <= 2 * fwd_bound
    if not train:
        grad_bound = 2 * RESNET18_ROUNDINGS * BF16_U
        gp_, gb_, g32_ = (torch.cat([g.flatten() for g in gs]) for gs in (gp, gb, g32))
        assert _rel(gp_, g32_) <= grad_bound, "plain bf16 vs fp32 exceeds the derived bound: the argument is wrong"
        assert _rel(gb_, gp_) <= 2 * grad_bound


def test_float64_under_autocast_stays_exact():
    # autocast never casts float64, so neither may Big-Layers
    plain = _model(True, torch.float64)
    big = bigify(copy.deepcopy(plain), stages=2, max_elements=20_000, device="cpu")
    torch.manual_seed(1)
    x, r = torch.randn(2, 3, 40, 40, dtype=torch.float64), torch.randn(2, 512, dtype=torch.float64)
    yp, gp, recp, _ = _step(plain, x, r, autocast=True, train=True)
    yb, gb, recb, _ = _step(big, x, r, autocast=True, train=True)
    assert recp.dtypes == recb.dtypes == {torch.float64}
    assert (yb - yp).abs().max().item() <= 1e-9
    for a, b in zip(gb, gp):
        assert a.dtype == torch.float64
        assert (a - b).abs().max().item() <= 1e-9 * max(1.0, b.abs().max().item())
    for (name, a), b in zip(big.named_buffers(), plain.buffers()):
        assert (a.double() - b.double()).abs().max().item() <= 1e-9 * max(1.0, b.double().abs().max().item()), name


def test_float32_without_autocast_runs_float32():
    plain = _model(False)
    big = bigify(copy.deepcopy(plain), stages=1, max_elements=20_000, device="cpu")
    torch.manual_seed(1)
    x, r = torch.randn(1, 3, 40, 40), torch.randn(1, 512)
    yp, _, recp, dtp = _step(plain, x, r, autocast=False, train=False)
    yb, _, recb, dtb = _step(big, x, r, autocast=False, train=False)
    assert recb.dtypes == recp.dtypes == {torch.float32}
    assert dtb == dtp and set(dtb.values()) == {torch.float32}
    # float32 rounding of two summation orders: relative 1e-4 of the output scale (tests/test_bigl.py)
    assert (yb - yp).abs().max().item() <= 1e-4 * yp.abs().max().item()
