"""Byte counts of Big-Layers transfers and of the host's pointwise work against independent counts,
the predictions' arithmetic, and the paper's way of counting Big-Layers.

Independent counts: the tensors a Big-Layers step must move are derived here from the plain
encoder's layer shapes (forward hooks on the plain model) and the algorithm as documented in
wsi_pipeline/bigl (conv: x in, y out; backward x and dy in, dx out unless the input is the
image; BatchNorm in training: statistics sweep x in, normalise x in and y out; backward sums
x and dy in, dx sweep x and dy in and dx out; the hand-off: the last big stage's output to the
device, its gradient back). With a budget that holds whole samples no chunk has halo rows, so
the totals must agree to the byte. Halo rows are checked on one convolution counted by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsi_pipeline.bigl import BigConv2d, ChunkRunner, bigify, monitor_transfers
from wsi_pipeline.bigl.traffic import DeviceModel, PassCost, StepTraffic, count_step, dry_step, module_big_layers, paper_big_layers, predict
from wsi_pipeline.models import build_encoder


pytestmark = pytest.mark.usefixtures("one_thread")


def _independent_bytes(plain: nn.Module, x: torch.Tensor, stages: int) -> tuple[int, int]:
    """(host->device, device->host) bytes of one training step, from the plain model's shapes."""
    shapes: dict[str, tuple[int, int]] = {}  # layer -> (input elements, output elements)
    big_prefixes = ("conv1", "bn1") + tuple(f"layer{i}." for i in range(1, stages + 1))
    hooks = []
    for name, m in plain.named_modules():
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)) and name.startswith(big_prefixes):
            hooks.append(m.register_forward_hook(lambda mod, i, o, name=name: shapes.__setitem__(name, (i[0].numel(), o.numel()))))
    with torch.no_grad():
        # the hand-off tensor: the output of the last big stage (the stem's, with 0 stages)
        z = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))
        for stage in plain.stages()[:stages]:
            z = stage(z)
    for h in hooks:
        h.remove()
    h2d = d2h = 0
    for name, (n_in, n_out) in shapes.items():
        if "conv" in name or "downsample.0" in name:
            h2d += n_in + (n_in + n_out)  # forward x; backward x and dy
            d2h += n_out + (n_in if name != "conv1" else 0)  # forward y; backward dx (not the image's)
        else:  # BatchNorm in training, n_in == n_out
            h2d += 2 * n_in + 4 * n_in
            d2h += n_in + n_in
    h2d += z.numel()  # hand-off forward
    d2h += z.numel()  # its gradient
    return h2d * x.element_size(), d2h * x.element_size()


@pytest.mark.parametrize(("name", "stages"), [("resnet18", 0), ("resnet18", 2), ("resnet50", 1)])
def test_step_bytes_equal_an_independent_count(name, stages):
    torch.manual_seed(0)
    plain = build_encoder(name).train()
    x = torch.randn(2, 3, 32, 32)
    expect = _independent_bytes(copy.deepcopy(plain), x, stages)
    big = bigify(copy.deepcopy(plain), stages=stages, max_elements=10**8, device="cpu").train()
    t = count_step(big, x)
    assert (t.h2d, t.d2h) == expect
    # the same step counted with the monitor directly, and on meta tensors, moves the same bytes
    big2 = bigify(copy.deepcopy(plain), stages=stages, max_elements=10**8, device="cpu").train()
    with monitor_transfers() as mon:
        big2(x).square().mean().backward()
    assert (mon.to_device_bytes(), mon.to_host_bytes()) == expect
    dry = dry_step(name, stages, 32, batch=2, max_elements=10**8)
    assert (dry.h2d, dry.d2h, dry.minimum, dry.flops) == (t.h2d, t.d2h, t.minimum, t.flops)


def test_dry_run_equals_real_run_with_row_chunks():
    torch.manual_seed(0)
    big = bigify(build_encoder("resnet18").train(), stages=1, max_elements=30_000, device="cpu").train()
    real = count_step(big, torch.randn(1, 3, 64, 64))
    dry = dry_step("resnet18", 1, 64, batch=1, max_elements=30_000)
    assert [(p.layer, p.h2d, p.d2h, p.flops) for p in dry.passes] == [(p.layer, p.h2d, p.d2h, p.flops) for p in real.passes]
    assert (dry.h2d, dry.d2h, dry.minimum) == (real.h2d, real.d2h, real.minimum)
    assert real.over_minimum > 1.3  # halo rows and BatchNorm's second sweeps


def test_halo_rows_counted_by_hand():
    # 3x3, stride 1, padding 1 over H = 16 rows, C = C_out = 2, W = 8: a budget of
    # 4 * (C W + C_out W) + 2 C W = 160 elements gives chunks of 4 output rows, reading input
    # rows [0,5), [3,9), [7,13), [11,16): 5 + 6 + 6 + 5 = 22 rows up, 16 output rows down
    torch.manual_seed(0)
    conv = BigConv2d.from_conv(nn.Conv2d(2, 2, 3, padding=1, bias=False), ChunkRunner("cpu"), 160, "c")
    x = torch.randn(1, 2, 16, 8)
    with monitor_transfers() as mon, torch.no_grad():
        conv(x)
    row = 2 * 8 * 4  # bytes of one row of one sample
    assert mon.bytes("h2d") == 22 * row
    assert mon.bytes("d2h") == 16 * row
    assert mon.count("chunk") == 4


def test_plain_step_counts_its_input_once():
    t = dry_step("resnet18", None, 64, batch=2)
    assert (t.h2d, t.d2h, t.minimum) == (2 * 3 * 64 * 64 * 4, 0, 2 * 3 * 64 * 64 * 4)
    assert t.flops > 0


def test_flops_equal_the_plain_step_and_passes_hold_the_big_convolutions():
    plain = dry_step("resnet18", None, 64)
    big = dry_step("resnet18", 1, 64, max_elements=30_000)
    assert big.flops == plain.flops  # Big-Layers recompute nothing
    # conv1 forward: 2 * C_in * k^2 FLOPs per output element, 64 x 32 x 32 outputs
    conv1 = next(p for p in big.passes if p.layer == "conv1/forward")
    assert conv1.flops == 2 * 3 * 7 * 7 * 64 * 32 * 32
    assert all(p.flops == 0 for p in big.passes if "/stats" in p.layer or "/normalize" in p.layer)


def _independent_host_bytes(plain: nn.Module, x: torch.Tensor, stages: int) -> int:
    """Bytes the host's pointwise ops read and write in one step of a fixed plan with pointwise layers on
    the host, from the plain model's shapes and each op's arguments and results: the image copied to
    channels-last (read, write); the stem's in-place ReLU (read, write) and max-pool (read; write the
    output and its int64 indices); backward, the max-pool's (the output's gradient, the input, the
    indices; the input's gradient written) and the ReLU's (its gradient and output read, the input's
    gradient written). Each block of a big stage without a shortcut convolution (ResNet-18's layer1):
    forward ReLU (2), ``out += identity`` (3), ReLU (2); backward two ReLU gradients (3 each) and the
    sum of the two gradients reaching the block's input (3): 16 tensors of the block's size."""
    with torch.no_grad():
        a = plain.relu(plain.bn1(plain.conv1(x)))
        m = plain.maxpool(a)
    f = x.element_size()
    stem = 2 * a.numel() * f + (a.numel() * f + m.numel() * (f + 8)) + (m.numel() * (f + 8) + 2 * a.numel() * f) + 3 * a.numel() * f
    blocks = 0
    z = m
    for stage in plain.stages()[:stages]:
        for block in stage:
            assert block.downsample is None, "the count covers blocks without a shortcut convolution"
            with torch.no_grad():
                z = block(z)
            blocks += 16 * z.numel() * f
    return 2 * x.numel() * f + stem + blocks


@pytest.mark.parametrize("stages", [0, 1])
def test_host_work_equals_an_independent_count(stages):
    """The activations' host work to the byte, plus a part that does not grow with the image: the big
    layers' parameters copied and their gradients and BatchNorm statistics finished on the host (a few
    passes over the parameters, at most four times their bytes)."""
    torch.manual_seed(0)
    plain = build_encoder("resnet18").train()
    big_prefixes = ("conv1", "bn1") + tuple(f"layer{i}." for i in range(1, stages + 1))
    param_bytes = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if n.startswith(big_prefixes))
    rest = set()
    for batch, side in ((2, 32), (1, 64), (2, 64)):
        x = torch.randn(batch, 3, side, side)
        expect = _independent_host_bytes(copy.deepcopy(plain), x, stages)
        dry = dry_step("resnet18", stages, side, batch=batch, max_elements=10**8).host_bytes
        rest.add(dry - expect)
        # with row chunks the passes change, the host's work does not
        assert dry_step("resnet18", stages, side, batch=batch, max_elements=10_000).host_bytes == dry
    assert len(rest) == 1 and 0 < rest.pop() <= 4 * param_bytes
    # a real step on the CPU counts what the dry step counts
    x = torch.randn(2, 3, 32, 32)
    big = bigify(copy.deepcopy(plain), stages=stages, max_elements=10**8, device="cpu").train()
    assert count_step(big, x).host_bytes == dry_step("resnet18", stages, 32, batch=2, max_elements=10**8).host_bytes


def test_no_host_work_without_host_pointwise_layers():
    from wsi_pipeline.bigl.traffic import dry_budget_step

    assert dry_step("resnet18", None, 64).host_bytes == 0  # plain: everything on the device
    torch.manual_seed(0)
    plain = build_encoder("resnet18").train()
    x = torch.randn(2, 3, 32, 32)
    on_host = count_step(bigify(copy.deepcopy(plain), stages=1, max_elements=10**8, device="cpu").train(), x).host_bytes
    on_device = count_step(bigify(copy.deepcopy(plain), stages=1, max_elements=10**8, device="cpu", pointwise="device").train(),
                           x).host_bytes
    # pointwise layers on the device leave on the host the image's channels-last copy, the parameter-sized
    # work and, in each block, autograd's sum of the two gradients that reach its input (read 2, write 1)
    with torch.no_grad():
        block_bytes = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x)))).numel() * 4  # layer1 keeps the shape
    activations = _independent_host_bytes(copy.deepcopy(plain), x, 1) - 2 * x.numel() * 4
    assert on_device == on_host - activations + len(plain.layer1) * 3 * block_bytes
    traffic, plan = dry_budget_step("resnet18", 1, 1024, 2**28)  # a budget that offloads fused units
    assert not plan.plain
    assert traffic.host_bytes == 0


def test_predict_arithmetic():
    dev = DeviceModel("d", bandwidth=10.0, flop_rate=100.0)
    passes = [PassCost("a/forward", h2d=40, d2h=20, flops=1000, first_h2d=10, last_d2h=5),
              PassCost("b/forward", h2d=10, d2h=10, flops=0, first_h2d=10, last_d2h=10)]
    t = StepTraffic(h2d=50 + 6, d2h=30 + 6, minimum=80, flops=1500, passes=passes, handoff=12)
    serial, overlap = predict(t, dev)
    assert serial == pytest.approx(1500 / 100 + 92 / 10)
    # outside passes 500 FLOPs and the 12-byte hand-off; pass a: fill 10 + drain 5, then
    # max(1000/100, 30/10, 15/10) = 10; pass b: one chunk, fill 10 + drain 10, nothing left
    assert overlap == pytest.approx(5 + 1.2 + (1.5 + 10) + 2.0)
    assert predict(StepTraffic(100, 0, 100, 300), dev, plain=True) == (pytest.approx(13.0), pytest.approx(13.0))
    # host work is serial in both: 70 bytes at 7 bytes/s add 10 s; without a host rate it is not counted
    t.host_bytes = 70
    assert predict(t, dev) == (pytest.approx(serial), pytest.approx(overlap))
    hosted = DeviceModel("d", bandwidth=10.0, flop_rate=100.0, host_rate=7.0)
    assert predict(t, hosted) == (pytest.approx(serial + 10), pytest.approx(overlap + 10))


@pytest.mark.parametrize(("name", "paper", "ours"), [
    ("resnet18", [2, 6, 10, 14], [2, 10, 20, 30, 40]),
    ("resnet50", [2, 11, 23, 41, 50], [2, 22, 48, 86, 106]),
])
def test_paper_big_layer_counts(name, paper, ours):
    # ``paper``: the labels of the Big-Layers paper's Table 4 (ResNet-18 was run to 3 stages)
    counts = []
    for stages in range(5):
        with torch.device("meta"):
            model = build_encoder(name)
        big = bigify(model, stages=stages, max_elements=10**6, device="meta")
        counts.append((paper_big_layers(big), module_big_layers(big)))
    assert [c[0] for c in counts[: len(paper)]] == paper
    assert [c[1] for c in counts] == ours
