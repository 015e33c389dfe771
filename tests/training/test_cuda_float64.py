"""Big-Layers and exact accumulation on CUDA, in float64, against plain autograd (skipped without a GPU).

The CPU runs of these mechanisms are checked in tests/bigl and tests/training; this module runs
the same comparisons where the kernels, streams, pinned copies and chunk transfers are CUDA's.
Every reference is computed in the test with plain PyTorch (the same encoder without Big-Layers;
one forward and one backward over the whole bag), on the GPU and, for the cross-device check, on
the CPU.

Bound: relative 1e-10 of each tensor's largest value (output, input gradient, every parameter
gradient, running statistics). Rounding argument: two float64 summation orders of n terms differ
by at most about n * 2^-53 relative to the sum of magnitudes; the longest reductions here (a
weight gradient over a bag of 12 tiles of 48 x 40 px) have n < 3 * 10^4, so n * 2^-53 < 4e-12,
and the depth of a ResNet-50 (about 50 roundings in a row) keeps the total well under 1e-10.
cuDNN may pick other convolution algorithms for a chunk than for the whole batch; that is one more
summation order, covered by the same argument.

Each check prints ``CUDA-EXACT <what>: relative <worst>`` (pytest -s shows it) so a GPU run's
figures can be reported.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from wsi_pipeline.bigl import BudgetResNet, ChunkRunner, bigify
from wsi_pipeline.bigl.budget import plan_step
from wsi_pipeline.data.tensors import DeviceTiles, tiles_to_tensor
from wsi_pipeline.models import build_aggregator
from wsi_pipeline.training.accumulate import accumulate_step, full_step

from bigl_helpers import encoder_step, offloading_budget, perturbed_resnet, rel, state_bytes

REL = 1e-10
#: The device under test. ``WSI_CUDA_TEST_DEVICE=cpu`` runs this module's comparisons on the CPU, so
#: that ``make gpu-check``'s dry run checks the tests themselves before device time is spent.
CUDA = torch.device(os.environ.get("WSI_CUDA_TEST_DEVICE", "cuda"))

pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def _worst(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], what: str) -> float:
    """Assert every pair within REL; print and return the worst relative difference.

    A tensor that is zero in exact arithmetic (the gradient of the attention score's bias, which
    the softmax cancels) has only rounding noise as its reference; it is measured against a
    ten-thousandth of the largest reference value of the comparison instead of its own.
    """
    floor = 1e-4 * max((float(ref.detach().abs().max()) for _, _, ref in pairs if ref.numel()), default=0.0)
    worst, name = 0.0, ""
    for n, got, ref in pairs:
        assert got.shape == ref.shape, f"{what}: {n} shape {tuple(got.shape)} != {tuple(ref.shape)}"
        r = rel(got, ref, floor)
        if r >= worst:
            worst, name = r, n
    dry = "" if CUDA.type == "cuda" else f" [dry run: device {CUDA}]"
    print(f"CUDA-EXACT {what}: relative {worst:.2e} (worst: {name}, {len(pairs)} tensors){dry}")
    assert worst <= REL, f"{what}: {name} relative difference {worst:.3g} > {REL:g}"
    return worst


def _compare_encoders(plain: nn.Module, big: nn.Module, x: torch.Tensor, what: str) -> float:
    torch.manual_seed(5)
    r = torch.randn(x.shape[0], plain.num_features, dtype=x.dtype)
    y_p, gx_p, g_p = encoder_step(plain, x, r, CUDA)
    y_b, gx_b, g_b = encoder_step(big, x, r, CUDA)
    assert g_b.keys() == g_p.keys()
    pairs = [("output", y_b, y_p), ("input gradient", gx_b, gx_p)]
    pairs += [(f"grad {n}", g_b[n], g_p[n]) for n in g_p]
    buffers_b = dict(big.named_buffers())
    pairs += [(n, buffers_b[n].to(b.dtype), b) for n, b in plain.named_buffers()]  # running statistics, counts
    return _worst(pairs, what)


@pytest.mark.parametrize(
    "name,stages,max_elements,shape,pointwise,pin",
    [
        ("resnet18", 3, 6_950, (2, 3, 61, 45), "host", True),
        ("resnet18", 3, 6_950, (2, 3, 61, 45), "host", False),
        ("resnet50", 2, 10_650, (2, 3, 37, 41), "device", True),
    ],
    ids=["resnet18-pinned", "resnet18-pageable", "resnet50-pointwise-on-device"],
)
def test_bigified_resnet_on_cuda_equals_plain_autograd(name, stages, max_elements, shape, pointwise, pin):
    plain = perturbed_resnet(name).to(CUDA)
    big = bigify(copy.deepcopy(plain), stages=stages, max_elements=max_elements, device=CUDA, pointwise=pointwise,
                 pin_memory=pin)
    assert big.runner.is_cuda == (CUDA.type == "cuda")
    x = torch.randn(*shape, dtype=torch.float64)
    _compare_encoders(plain, big, x, f"bigl {name} stages={stages} pointwise={pointwise} pinned={pin}")


def test_device_budget_plan_on_cuda_equals_plain_autograd():
    """A budget a third of the way from the state to the plain step's estimate forces fused, offloaded units."""
    shape = (2, 3, 45, 37)
    plain = perturbed_resnet("resnet18").to(CUDA)
    full = plan_step(plain, shape, None, dtype=torch.float64)
    budget = offloading_budget(state_bytes(plain, 4), full.plain_estimate)
    big = BudgetResNet(copy.deepcopy(plain), ChunkRunner(CUDA), budget, 45_000)
    x = torch.randn(*shape, dtype=torch.float64)
    _compare_encoders(plain, big, x, f"bigl device budget {budget} B")
    assert big.last_plan is not None and big.last_plan.offloaded > 0, "the budget must offload some units"


AGGREGATORS = [("abmil", {}), ("transmil", {"dim": 32, "num_landmarks": 8}), ("dtfd", {"ipg": 2, "n_groups": 3})]


def _agg_kwargs(name: str) -> dict:
    # DTFD draws random pseudo-bags: every step must see the same split
    return {"generator": torch.Generator().manual_seed(3)} if name == "dtfd" else {}


def _grads(*modules: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for m in modules for n, p in m.named_parameters()]


@pytest.mark.parametrize("name,opts", AGGREGATORS, ids=[a for a, _ in AGGREGATORS])
def test_accumulation_on_cuda_equals_plain_autograd(name, opts):
    """accumulate_step on CUDA (host bag, chunks moved one at a time) = one plain backward over the whole bag.

    References: the plain whole-bag backward on the GPU, and the same on the CPU (cross-device).
    """
    n, label = 12, 1
    enc_cpu = perturbed_resnet("resnet18")
    torch.manual_seed(1)
    agg_cpu = build_aggregator(name, enc_cpu.num_features, 2, dropout=0.0, **opts).double()
    enc, agg = copy.deepcopy(enc_cpu).to(CUDA), copy.deepcopy(agg_cpu).to(CUDA)
    torch.manual_seed(2)
    tiles = torch.randn(n, 3, 48, 40, dtype=torch.float64)

    refs = []
    for device, (e, a) in ((CUDA, (enc, agg)), (torch.device("cpu"), (enc_cpu, agg_cpu))):
        e.eval()  # bn='frozen': running statistics, one forward and one backward over the whole bag
        out = a(e(tiles.to(device)), **_agg_kwargs(name), **({"label": label} if name == "dtfd" else {}))
        loss = nn.functional.cross_entropy(out.logits[None], torch.tensor([label], device=device))
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + out.aux_loss
        loss.backward()
        refs.append((float(loss.detach()), _grads(e, a)))
        e.train()
        e.zero_grad(set_to_none=True)
        a.zero_grad(set_to_none=True)

    (ref_loss, ref), (cpu_loss, cpu) = refs
    assert abs(ref_loss - cpu_loss) <= REL * abs(cpu_loss)
    _worst([(n_, g, c) for (n_, g), (_, c) in zip(ref, cpu)], f"plain autograd {name}: cuda against cpu")
    for chunk in (1, 5, n):
        enc.zero_grad(set_to_none=True)
        agg.zero_grad(set_to_none=True)
        loss = accumulate_step(enc, agg, tiles, label, chunk, aggregator_kwargs=_agg_kwargs(name))
        assert abs(loss - ref_loss) <= REL * abs(ref_loss), (loss, ref_loss)
        got = _grads(enc, agg)
        _worst([(n_, g, r) for (n_, g), (_, r) in zip(got, ref)], f"accumulate {name} chunk={chunk} on cuda")
        _worst([(n_, g, c) for (n_, g), (_, c) in zip(got, cpu)], f"accumulate {name} chunk={chunk}: cuda against cpu")
    assert all(m.training for m in enc.modules())


def test_accumulation_from_uint8_tiles_on_the_device_equals_the_whole_bag():
    """The training path for a uint8 bag on the GPU: each chunk converted there (DeviceTiles) = the converted whole bag."""
    enc = perturbed_resnet("resnet18").to(CUDA)
    torch.manual_seed(1)
    agg = build_aggregator("abmil", enc.num_features, 2, dropout=0.0).double().to(CUDA)
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (10, 40, 40, 3), dtype=torch.uint8, generator=g)
    full_step(enc, agg, tiles_to_tensor(raw, dtype=torch.float64, device=CUDA), 0)
    ref = _grads(enc, agg)
    for chunk in (3, 10):
        enc.zero_grad(set_to_none=True)
        agg.zero_grad(set_to_none=True)
        accumulate_step(enc, agg, DeviceTiles(raw.to(CUDA), CUDA, dtype=torch.float64), 0, chunk)
        _worst([(n, a, b) for (n, a), (_, b) in zip(_grads(enc, agg), ref)], f"accumulate uint8 on device chunk={chunk}")


def test_bigl_strategy_step_on_cuda_equals_plain_autograd():
    """BiglStrategy's step: full_step through a bigified encoder (host bag) = full_step through the plain one on the GPU."""
    plain = perturbed_resnet("resnet18").to(CUDA)
    torch.manual_seed(1)
    agg = build_aggregator("abmil", plain.num_features, 2, dropout=0.0).double().to(CUDA)
    big = bigify(copy.deepcopy(plain), stages=2, max_elements=20_000, device=CUDA)
    agg_b = copy.deepcopy(agg)
    torch.manual_seed(2)
    tiles = torch.randn(6, 3, 64, 56, dtype=torch.float64)
    for bn in ("frozen", "chunk"):
        for m in (plain, big, agg, agg_b):
            m.zero_grad(set_to_none=True)
        loss_p = full_step(plain, agg, tiles.to(CUDA), 1, bn=bn)
        loss_b = full_step(big, agg_b, tiles, 1, bn=bn)
        assert abs(loss_b - loss_p) <= REL * abs(loss_p)
        pairs = [(n, a, b) for (n, a), (_, b) in zip(_grads(big, agg_b), _grads(plain, agg))]
        buffers_b = dict(big.named_buffers())
        pairs += [(n, buffers_b[n].to(b.dtype), b) for n, b in plain.named_buffers()]
        _worst(pairs, f"bigl strategy step bn={bn}")
