"""Big-Layers: every partitioned layer and every bigified ResNet equals plain PyTorch.

References are the ordinary torch layers / the same encoder without Big-Layers, computed in the
test. float64: max abs difference <= 1e-9 (times the largest reference value when that exceeds 1);
float32: a float32 ResNet's error against its float64 twin is bounded by plain PyTorch's (see
test_bigified_resnet18_float32_is_as_accurate_as_plain_float32); :func:`assert_close` keeps a
relative 1e-4 for float32 tensors, which no test here passes any more.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wsi_pipeline.bigl import (
    BigAddReLU,
    BigBatchNorm2d,
    BigConv2d,
    BigMaxPool2d,
    BigReLU,
    BigResNet,
    ChunkRunner,
    bigify,
    monitor_transfers,
)
from wsi_pipeline.models import build_encoder

CPU = ChunkRunner("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert got.shape == ref.shape, what
    got, ref = got.detach().to(ref.device), ref.detach()
    diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    if ref.dtype == torch.float64:
        # absolute 1e-9 for quantities of order 1; large ones (running variances of deep
        # layers reach 1e5) cannot agree better than float64 rounding, ~1e-15 of their size
        assert diff <= 1e-9 * max(1.0, scale), f"{what}: max abs diff {diff:.3g} (max |ref| {scale:.3g})"
    else:
        assert diff <= 1e-4 * max(scale, 1e-12), f"{what}: relative diff {diff / max(scale, 1e-12):.3g}"


def smallest_budget(fn) -> int:
    """Smallest max_elements for which ``fn(max_elements)`` runs, read from the error messages."""
    budget = 1
    for _ in range(50):
        try:
            fn(budget)
            return budget
        except ValueError as e:
            m = re.search(r"use max_elements >= (\d+)", str(e))
            assert m, str(e)
            budget = int(m.group(1))
    raise AssertionError("budget search did not converge")


# ---------------------------------------------------------------- partitioned layers
CONV_CASES = {
    "stride2": dict(cin=4, cout=6, k=3, stride=2, pad=1, dil=1, groups=1, bias=True),
    "dilation2": dict(cin=4, cout=5, k=3, stride=1, pad=2, dil=2, groups=1, bias=True),
    "groups": dict(cin=6, cout=9, k=3, stride=1, pad=1, dil=1, groups=3, bias=True),
    "asymmetric": dict(cin=4, cout=4, k=(5, 3), stride=(2, 1), pad=(2, 1), dil=(1, 2), groups=2, bias=False),
    "stem7x7": dict(cin=3, cout=5, k=7, stride=2, pad=3, dil=1, groups=1, bias=True),
    "1x1stride2": dict(cin=3, cout=8, k=1, stride=2, pad=0, dil=1, groups=1, bias=False),
    "stride>kernel": dict(cin=3, cout=4, k=2, stride=3, pad=0, dil=1, groups=1, bias=True),
}


def conv_pair(c: dict, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Conv2d(c["cin"], c["cout"], c["k"], c["stride"], c["pad"], c["dil"], c["groups"], c["bias"]).double()
    return ref, copy.deepcopy(ref)


def conv_step(conv: nn.Module, x: torch.Tensor, r: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = conv(x)
    (y * r).sum().backward()
    return y, x.grad


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_equals_nn_conv(case):
    c = CONV_CASES[case]
    ref, base = conv_pair(c)
    x = torch.randn(3, c["cin"], 23, 19, dtype=torch.float64)
    y_ref, gx_ref = conv_step(ref, x, r := torch.randn_like(ref(x)))

    def run(budget):
        m = copy.deepcopy(base)
        big = BigConv2d.from_conv(m, CPU, budget, "conv")
        with monitor_transfers() as mon:
            y, gx = conv_step(big, x, r)
        return m, y, gx, mon

    tiny = smallest_budget(run)
    for budget in (tiny, 2 * tiny + 7, 10**9):
        m, y, gx, mon = run(budget)
        assert_close(y, y_ref, f"{case} y @ {budget}")
        assert_close(gx, gx_ref, f"{case} dx @ {budget}")
        assert_close(m.weight.grad, ref.weight.grad, f"{case} dW @ {budget}")
        if c["bias"]:
            assert_close(m.bias.grad, ref.bias.grad, f"{case} db @ {budget}")
        assert mon.max_chunk <= budget
        chunks = [e for e in mon.events if e.kind == "chunk"]
        if budget == tiny:
            assert any(e.rows == 1 and not e.full for e in chunks), "smallest budget must force single-row chunks"
        if budget == 10**9:
            assert all(e.full for e in chunks) and len(chunks) == 2  # one forward + one backward step


def test_conv_without_input_grad_and_frozen_weight():
    ref, base = conv_pair(CONV_CASES["stride2"])
    big = BigConv2d.from_conv(base, CPU, 400, "conv")
    base.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    x = torch.randn(2, 4, 15, 9, dtype=torch.float64)
    r = torch.randn_like(ref(x))
    (ref(x) * r).sum().backward()
    (big(x) * r).sum().backward()
    assert base.weight.grad is None
    assert_close(base.bias.grad, ref.bias.grad, "db")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_train_and_eval_equal_nn_batchnorm(momentum):
    torch.manual_seed(1)
    ref = nn.BatchNorm2d(5, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    base = copy.deepcopy(ref)
    # a large mean offset: the chunked statistics must stay exact (Welford merge)
    xs = [torch.randn(3, 5, 17, 11, dtype=torch.float64) * 3 + 40 for _ in range(2)]
    rs = [torch.randn(3, 5, 17, 11, dtype=torch.float64) for _ in range(2)]
    for budget in (3 * 5 * 11, 4 * 5 * 11 + 13, 10**9):  # single rows / 4 rows, not dividing 17 / whole batch
        bn_ref, bn_base = copy.deepcopy(ref), copy.deepcopy(base)
        big = BigBatchNorm2d.from_bn(bn_base, CPU, budget, "bn")
        for mode in ("train", "train", "eval"):
            for m in (bn_ref, big):
                m.train(mode == "train")
                m.zero_grad()
            outs = []
            for m in (big, bn_ref):
                x = xs[0].clone().requires_grad_(True)
                with monitor_transfers() as mon:
                    y = m(x)
                    (y * rs[0]).sum().backward()
                outs.append((y, x.grad, m.weight.grad, m.bias.grad))
                if m is big:
                    assert mon.max_chunk <= budget
            for got, want, what in zip(outs[0], outs[1], ("y", "dx", "dgamma", "dbeta")):
                assert_close(got, want, f"{mode} {what} @ {budget}")
            for name in ("running_mean", "running_var"):
                assert_close(getattr(bn_base, name), getattr(bn_ref, name), f"{name} @ {budget}")
            assert int(bn_base.num_batches_tracked) == int(bn_ref.num_batches_tracked)
            xs.reverse()
        assert int(bn_base.num_batches_tracked) == 2


@pytest.mark.parametrize("kw", [dict(affine=False), dict(track_running_stats=False)])
def test_batchnorm_variants(kw):
    torch.manual_seed(2)
    ref = nn.BatchNorm2d(4, **kw).double()
    big = BigBatchNorm2d.from_bn(copy.deepcopy(ref), CPU, 4 * 9 * 3, "bn")
    for training in (True, False):
        ref.train(training)
        big.train(training)
        x1 = torch.randn(2, 4, 7, 9, dtype=torch.float64, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_(True)
        r = torch.randn(2, 4, 7, 9, dtype=torch.float64)
        y1, y2 = ref(x1), big(x2)
        (y1 * r).sum().backward()
        (y2 * r).sum().backward()
        assert_close(y2, y1, f"y training={training}")
        assert_close(x2.grad, x1.grad, f"dx training={training}")


def test_batchnorm_needs_more_than_one_value():
    big = BigBatchNorm2d.from_bn(nn.BatchNorm2d(3), CPU, 100, "bn1")
    with pytest.raises(ValueError, match="bn1: expected more than 1 value per channel"):
        big(torch.randn(1, 3, 1, 1))


def test_maxpool_relu_add_on_device_equal_torch():
    torch.manual_seed(3)
    # distinct values: no ties, so the argmax of every window is unique
    x = torch.randperm(2 * 4 * 21 * 17).double().view(2, 4, 21, 17) / 100 - 5
    pool_ref = nn.MaxPool2d(3, 2, 1)

    def pool(budget):
        BigMaxPool2d.from_pool(pool_ref, CPU, budget, "maxpool")(x.clone().requires_grad_(True)).sum().backward()

    tiny = smallest_budget(pool)
    for budget in (tiny, 2 * tiny + 5, 10**9):
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        r = torch.randn(2, 4, 11, 9, dtype=torch.float64)
        (pool_ref(xa) * r).sum().backward()
        big = BigMaxPool2d.from_pool(pool_ref, CPU, budget, "maxpool")
        y = big(xb)
        (y * r).sum().backward()
        assert_close(y, pool_ref(x), "maxpool y")
        assert_close(xb.grad, xa.grad, "maxpool dx")

        a1, b1 = x.clone().requires_grad_(True), x.flip(2).clone().requires_grad_(True)
        a2, b2 = a1.detach().clone().requires_grad_(True), b1.detach().clone().requires_grad_(True)
        r = torch.randn_like(x)
        (F.relu(a1 + b1) * r).sum().backward()
        y = BigAddReLU(CPU, budget, "add")(a2, b2)
        (y * r).sum().backward()
        assert_close(y, F.relu(x + x.flip(2)), "add_relu y")
        assert_close(a2.grad, a1.grad, "add_relu da")
        assert_close(b2.grad, b1.grad, "add_relu db")

        c1, c2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        (F.relu(c1) * r).sum().backward()
        (BigReLU.create(CPU, budget)(c2) * r).sum().backward()
        assert_close(c2.grad, c1.grad, "relu dx")


# ---------------------------------------------------------------- whole encoders
# (name, stages, input shape, max_elements): each budget is (close to) the smallest that fits
# the input, so the binding layer runs single-row chunks and other layers uneven row chunks
MODEL_CASES = [
    ("resnet18", 0, (2, 3, 61, 45), 4_510),
    ("resnet18", 1, (2, 3, 61, 45), 6_950),
    ("resnet18", 2, (2, 3, 61, 45), 6_950),
    ("resnet18", 3, (2, 3, 61, 45), 6_950),
    ("resnet18", 4, (2, 3, 61, 45), 6_950),
    ("resnet50", 0, (2, 3, 37, 41), 4_120),
    ("resnet50", 1, (2, 3, 37, 41), 8_500),
    ("resnet50", 2, (2, 3, 37, 41), 10_650),
]


def input_device(model: nn.Module) -> torch.device:
    """Where the test feeds images: host memory for Big-Layers, the parameters' device otherwise."""
    return torch.device("cpu") if isinstance(model, BigResNet) else next(model.parameters()).device


def train_step(model: nn.Module, x: torch.Tensor, r: torch.Tensor, lr: float = 0.05):
    """Forward + backward + SGD step; returns output, input gradient, parameter gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    x = x.to(input_device(model)).clone().requires_grad_(True)
    y = model(x)
    (y * r.to(y.device)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return y.detach(), x.grad, grads


def compare_models(plain: nn.Module, big: nn.Module, x: torch.Tensor, steps: int = 1) -> None:
    torch.manual_seed(5)
    # loss = mean(y * r): an ordinary mean-reduced loss, gradients of order 1
    r = torch.randn(x.shape[0], plain.num_features, dtype=x.dtype) / (x.shape[0] * plain.num_features)
    for step in range(steps):
        y_p, gx_p, g_p = train_step(plain, x, r)
        y_b, gx_b, g_b = train_step(big, x, r)
        assert_close(y_b, y_p, f"step {step} output")
        assert_close(gx_b, gx_p, f"step {step} input gradient")
        assert g_b.keys() == g_p.keys()
        for name in g_p:
            assert_close(g_b[name], g_p[name], f"step {step} grad {name}")
        sd_p, sd_b = plain.state_dict(), big.state_dict()
        assert list(sd_b) == list(sd_p)
        for name in sd_p:  # parameters after the step, running stats, num_batches_tracked
            assert_close(sd_b[name].to(sd_p[name].dtype), sd_p[name], f"step {step} {name}")
    # eval mode. Running statistics after one step are far from the batch's (large eval
    # outputs), so first make them the batch statistics: momentum=None after a reset gives the
    # cumulative average over one batch
    for model in (plain, big):
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = None
                m.reset_running_stats()
        with torch.no_grad():
            model.train()
            model(x.to(input_device(model)))
    sd_p, sd_b = plain.state_dict(), big.state_dict()
    for name in sd_p:
        assert_close(sd_b[name].to(sd_p[name].dtype), sd_p[name], f"cumulative {name}")
    plain.eval()
    big.eval()
    xs = [x.to(input_device(m)).clone().requires_grad_(True) for m in (plain, big)]
    ys = [m(xi) for m, xi in zip((plain, big), xs)]
    for y in ys:
        (y * r.to(y.device)).sum().backward()
    assert_close(ys[1], ys[0], "eval output")
    assert_close(xs[1].grad, xs[0].grad, "eval input gradient")


def check_bigified(name: str, stages: int, shape: tuple[int, ...], budget: int, dtype: torch.dtype, single_rows: bool = True) -> None:
    torch.manual_seed(0)
    plain = build_encoder(name).to(dtype)
    big = bigify(copy.deepcopy(plain), stages=stages, max_elements=budget, device="cpu")
    x = torch.randn(*shape, dtype=dtype)
    with monitor_transfers() as mon:
        compare_models(plain, big, x)
    chunks = [e for e in mon.events if e.kind == "chunk"]
    assert mon.max_chunk <= budget
    if single_rows:
        assert any(e.rows == 1 and not e.full for e in chunks), "the budget must force single-row chunks somewhere"
    # some pass splits a height into chunks that do not divide it (a shorter last chunk)
    by_pass: dict[str, set[int]] = {}
    for e in chunks:
        if not e.full:
            by_pass.setdefault(e.layer, set()).add(e.rows)
    assert any(len(rows) > 1 for rows in by_pass.values())


@pytest.mark.parametrize(("name", "stages", "shape", "budget"), MODEL_CASES, ids=[f"{c[0]}-stages{c[1]}" for c in MODEL_CASES])
def test_bigified_resnet_equals_plain_float64(name, stages, shape, budget):
    check_bigified(name, stages, shape, budget, torch.float64)


def test_bigified_resnet18_float32_is_as_accurate_as_plain_float32():
    """float32 on an odd size: Big-Layers against the float64 truth is as accurate as plain PyTorch.

    Exactness is checked in float64 above. In float32 no fixed bound holds on every CPU: the
    rounding of each conv (sums of up to 4608 products) depends on the kernels the CPU runs, and
    where a ReLU input lies within rounding of 0 its sign, and with it a BatchNorm bias gradient,
    can flip (~1 %; plain PyTorch NCHW vs channels-last differ by 5 %, measured). So both float32
    computations are compared with the same model in float64: Big-Layers' relative error may be
    at most 4 x plain PyTorch's plus 16 units of float32 rounding (2**-24 each), since it runs the
    same operations in another order and chunking; a wrong halo, stitch or statistic is an
    O(1) relative error.
    """
    torch.manual_seed(0)
    truth = build_encoder("resnet18").double()
    plain = copy.deepcopy(truth).float()
    big = bigify(copy.deepcopy(truth).float(), stages=4, max_elements=23_200, device="cpu")
    x = torch.randn(3, 3, 97, 131, dtype=torch.float64)
    torch.manual_seed(5)
    r = torch.randn(3, truth.num_features, dtype=torch.float64) / (3 * truth.num_features)
    ref = train_step(truth, x, r)
    got_p = train_step(plain, x.float(), r.float())
    got_b = train_step(big, x.float(), r.float())
    floor = 16 * 2.0**-24

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.detach().double() - b.detach()).abs().max().item() / max(b.detach().abs().max().item(), 1e-30)

    pairs = [("output", got_b[0], got_p[0], ref[0]), ("input gradient", got_b[1], got_p[1], ref[1])]
    assert got_b[2].keys() == ref[2].keys()
    pairs += [(f"grad {n}", got_b[2][n], got_p[2][n], ref[2][n]) for n in ref[2]]
    sd_t, sd_p, sd_b = truth.state_dict(), plain.state_dict(), big.state_dict()
    pairs += [(n, sd_b[n], sd_p[n], sd_t[n]) for n in sd_t if sd_t[n].is_floating_point()]
    for what, b, p_, t in pairs:
        assert b.dtype == torch.float32, what
        e_big, e_plain = rel(b, t), rel(p_, t)
        assert e_big <= 4 * e_plain + floor, f"{what}: Big-Layers error {e_big:.3g}, plain PyTorch {e_plain:.3g}"


def test_bigified_pointwise_on_device_two_steps():
    torch.manual_seed(0)
    plain = build_encoder("resnet18").double()
    big = bigify(copy.deepcopy(plain), stages=2, max_elements=12_000, device="cpu", pointwise="device")
    assert isinstance(big.maxpool, BigMaxPool2d) and isinstance(big.relu, BigReLU)
    compare_models(plain, big, torch.randn(2, 3, 53, 47, dtype=torch.float64), steps=2)


@pytest.mark.slow
def test_bigified_resnet18_bag_256px():
    check_bigified("resnet18", 2, (2, 3, 256, 256), 150_000, torch.float64, single_rows=False)


def test_state_dict_round_trip_and_sharing():
    plain = build_encoder("resnet18")
    big = bigify(plain, stages=3, max_elements=50_000, device="cpu")
    assert list(big.state_dict()) == list(build_encoder("resnet18").state_dict())
    fresh = build_encoder("resnet18")
    fresh.load_state_dict(big.state_dict())  # strict
    other = build_encoder("resnet18")
    big.load_state_dict(other.state_dict())  # strict, and in place into the shared tensors
    assert torch.equal(plain.layer2[0].conv1.weight, other.layer2[0].conv1.weight)
    assert big.layer2[0].conv1.weight is plain.layer2[0].conv1.weight
    assert big.num_features == 512


def test_bigify_rejects_bad_arguments():
    model = build_encoder("resnet18")
    with pytest.raises(ValueError, match="stages=5 is out of range"):
        bigify(model, stages=5, max_elements=10_000, device="cpu")
    with pytest.raises(ValueError, match="max_elements=0 must be a positive int"):
        bigify(model, stages=1, max_elements=0, device="cpu")
    with pytest.raises(TypeError, match="bigify expects a ResNet"):
        bigify(nn.Linear(2, 2), stages=1, max_elements=10_000, device="cpu")
    big = bigify(model, stages=1, max_elements=1_000, device="cpu")
    with pytest.raises(ValueError, match=r"max_elements=1000 is too small for conv1: .* use max_elements >= \d+"):
        big(torch.randn(1, 3, 64, 64))


# ---------------------------------------------------------------- the budget
def test_budget_holds_and_device_residency_does_not_grow_with_input():
    budget = 40_000
    torch.manual_seed(0)
    plain = build_encoder("resnet18")
    stats = {}
    for label, shape in (("small", (1, 3, 96, 96)), ("4x batch", (4, 3, 96, 96)), ("4x area", (1, 3, 192, 192))):
        big = bigify(copy.deepcopy(plain), stages=2, max_elements=budget, device="cpu")
        with monitor_transfers() as mon:
            big(torch.randn(*shape)).sum().backward()
        moved = sum(e.numel for e in mon.events if e.kind in ("h2d", "d2h"))
        stats[label] = (mon.max_transfer, mon.max_chunk, mon.peak_resident, moved)
        assert mon.max_transfer <= budget, label
        assert mon.max_chunk <= budget, label
        # the runner holds the current chunk and prefetches the next: at most two chunk steps
        assert mon.peak_resident <= 2 * budget, label
    small_peak, small_moved = stats["small"][2], stats["small"][3]
    for label in ("4x batch", "4x area"):
        peak, moved = stats[label][2], stats[label][3]
        assert moved > 3.5 * small_moved, f"{label}: the input did not grow ({stats})"
        assert peak <= small_peak, f"{label}: resident elements grew from {small_peak} to {peak}"


# ---------------------------------------------------------------- the benchmark's fit
def test_power_law_fit_recovers_known_curve():
    from benchmarks.bigl import fit_power_law

    a, b, c = 3e-7, 1.3, 0.05
    areas = [s * s for s in (256, 384, 512, 768, 1024, 1536)]
    times = [a * A**b + c for A in areas]
    fit = fit_power_law(areas, times)
    assert fit.n == 6
    assert fit.b == pytest.approx(b, abs=1e-3)
    assert fit.a == pytest.approx(a, rel=1e-2)
    assert fit.c == pytest.approx(c, abs=1e-4)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    a_med = sorted(areas)[2] / 2 + sorted(areas)[3] / 2  # median of an even count
    assert fit.f_dbl == pytest.approx((a * (2 * a_med) ** b + c) / (a * a_med**b + c), rel=1e-3)
    with pytest.raises(ValueError, match="need at least 3 sizes"):
        fit_power_law(areas[:2], times[:2])


# ---------------------------------------------------------------- CUDA (skipped without a GPU)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_bigified_equals_plain(pin_memory):
    torch.manual_seed(0)
    plain = build_encoder("resnet18").double().cuda()
    big = bigify(copy.deepcopy(plain), stages=3, max_elements=6_950, device="cuda", pin_memory=pin_memory)
    assert big.runner.is_cuda and big.runner.pin_memory == pin_memory
    compare_models(plain, big, torch.randn(2, 3, 61, 45, dtype=torch.float64), steps=2)


@cuda
def test_cuda_pointwise_on_device_equals_plain():
    torch.manual_seed(0)
    plain = build_encoder("resnet50").double().cuda()
    big = bigify(copy.deepcopy(plain), stages=2, max_elements=10_650, device="cuda", pointwise="device")
    compare_models(plain, big, torch.randn(2, 3, 37, 41, dtype=torch.float64))


@cuda
def test_cuda_peak_memory_does_not_grow_with_input():
    torch.manual_seed(0)
    budget = 1 << 20
    big = bigify(build_encoder("resnet18"), stages=4, max_elements=budget, device="cuda")
    peaks = []
    for side in (512, 1024):  # 4x the area
        x = torch.randn(1, 3, side, side)
        big.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with monitor_transfers() as mon:
            big(x).square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert mon.max_chunk <= budget
    param_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    # gradients plus a few chunks and convolution workspaces (the bound is loose on purpose)
    assert peaks[1] <= 1.25 * peaks[0] + (1 << 20), peaks
    assert peaks[1] <= 2 * param_bytes + 64 * budget * 4, (peaks, param_bytes)
