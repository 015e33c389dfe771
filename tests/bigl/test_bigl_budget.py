"""Device-budget plans and fused runs (wsi_pipeline/bigl/{budget,fused,planned,units}.py).

Exactness: a :class:`BudgetResNet` training step equals plain autograd on the same encoder,
computed in the test, in float64: output, input gradient, every parameter gradient, running
statistics and ``num_batches_tracked`` agree to a relative 1e-10 (of each tensor's largest
value; float64 rounding of two summation orders is ~1e-15). Checked for ResNet-18 and -50 with
batch-statistics (``bn: train``) and running-statistics (``bn: frozen``) BatchNorm, with the
fused prefix ending at every stage boundary (stem only, + layer1, ..., every unit), with chunk
budgets that force row chunks (halos, owned BatchNorm rows) in the first units and checkpoints
both on the "device" and in host buffers; and for the plans the planner picks itself.

bf16: under CPU bf16 autocast a fused step follows plain autocast within the bound
tests/test_bigl_autocast.py derives (2 x D x 2^-8 for the forward output, D = 42 roundings on
ResNet-18's longest path), the image travels in bf16 (half the bytes, counted) and host
checkpoints rest in bf16.

Counts: bytes moved by a fused step equal an independent count from the plain encoder's layer
shapes and the documented passes (whole-sample chunks: no halo rows), and its FLOPs equal the
plain step's plus the recomputed forward convolutions counted on the plain layers; a dry run on
meta tensors counts what a real CPU run does, halo rows included.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from wsi_pipeline.bigl import BudgetResNet, ChunkRunner, bigify, monitor_transfers
from wsi_pipeline.bigl.budget import GB, manual_plan, plan_step, resolve_budget, unit_memory
from wsi_pipeline.bigl.traffic import count_step, dry_budget_step
from wsi_pipeline.bigl.units import UnitGeometry, resnet_units
from wsi_pipeline.models import build_encoder

from bigl_helpers import encoder_step, offloading_budget, perturbed_resnet, rel, state_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

REL = 1e-10


def _check(plain: nn.Module, big: nn.Module, x: torch.Tensor, what: str) -> None:
    torch.manual_seed(5)
    r = torch.randn(x.shape[0], plain.num_features, dtype=x.dtype)
    y_p, gx_p, _ = encoder_step(plain, x, r)
    y_b, gx_b, _ = encoder_step(big, x, r)
    assert rel(y_b, y_p) <= REL, f"{what}: output"
    assert rel(gx_b, gx_p) <= REL, f"{what}: input gradient"
    for (n, p), (_, q) in zip(plain.named_parameters(), big.named_parameters()):
        assert q.grad is not None and rel(q.grad, p.grad) <= REL, f"{what}: grad {n} ({rel(q.grad, p.grad):.2g})"
    for (n, p), (_, q) in zip(plain.named_buffers(), big.named_buffers()):
        assert rel(q, p) <= REL, f"{what}: {n}"


def _stage_ends(name: str) -> list[int]:
    """Fused prefixes ending at the stem and after every residual stage (unit counts)."""
    units = [u.name for u in resnet_units(build_encoder(name))]
    return [1] + [max(i for i, u in enumerate(units) if u.startswith(f"layer{s}.")) + 1 for s in range(1, 5)]


# (name, shape, chunk elements): the chunk budget forces row chunks in the stem and the first blocks
CASES = {"resnet18": ((2, 3, 45, 37), 45_000), "resnet50": ((2, 3, 56, 48), 110_000)}


@pytest.mark.slow
@pytest.mark.parametrize("bn", ["train", "frozen"])
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_fused_prefix_at_every_stage_boundary_equals_plain_float64(name, bn):
    shape, chunk = CASES[name]
    x = torch.randn(*shape, dtype=torch.float64)
    plain = perturbed_resnet(name, bn)
    for k in _stage_ends(name):
        big = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), None, chunk)
        # checkpoints alternate between the device and host buffers, the image on the host
        places = tuple("host" if i % 2 == 0 else "device" for i in range(k))
        big.set_plan(manual_plan(big.plain, shape, k, places, chunk, dtype=torch.float64))
        ref = copy.deepcopy(plain)
        with monitor_transfers() as mon:
            _check(ref, big, x, f"{name} bn={bn} {k} fused units")
        assert big.last_plan.offloaded == k
        rows = [e for e in mon.events if e.kind == "chunk" and e.layer.startswith("stem/")]
        assert any(not e.full for e in rows), "the chunk budget must force row chunks in the stem"
        plain = ref  # the next prefix starts from the stepped weights (and statistics)


def test_planner_picks_plain_or_fused_and_both_are_exact():
    name, shape = "resnet18", (2, 3, 45, 37)
    plain = perturbed_resnet(name, "train")
    x = torch.randn(*shape, dtype=torch.float64)
    full = plan_step(plain, shape, None, dtype=torch.float64)
    assert full.plain
    state = state_bytes(plain, 4)
    seen = set()
    for budget in (full.plain_estimate, full.plain_estimate - 1, offloading_budget(state, full.plain_estimate)):
        big = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), budget, 2**20)
        ref = copy.deepcopy(plain)
        _check(ref, big, x, f"budget {budget}")
        seen.add(big.last_plan.offloaded)
        plain = ref
    assert 0 in seen and len(seen) >= 2, seen


def test_plan_rule_is_the_one_stated():
    """Recompute the rule from the per-unit memory in the test: plain if it fits; else the
    smallest prefix whose checkpoints all stay on the device; the estimate within the budget."""
    name, shape = "resnet18", (8, 3, 64, 64)
    with torch.device("meta"):
        model = build_encoder(name).train()
    mem = unit_memory(model, shape, torch.float32)
    state = 4 * sum(p.numel() * 4 for p in model.parameters())
    image = 8 * 3 * 64 * 64 * 4
    geos, (c, h, w) = [], shape[1:]
    for u in resnet_units(model):
        geos.append(UnitGeometry(u, c, h, w))
        c, h, w = geos[-1].c_out, geos[-1].h_out, geos[-1].w_out

    def chunk_min(j: int) -> int:  # elements of the smallest chunk step of the largest of the first j units
        return max(min(g.sample_elements(), g.row_elements(1)) for g in geos[:j])
    plain = state + image + sum(m.saved for m in mem) + 2 * max(m.largest for m in mem)
    assert plan_step(model, shape, plain).plain and not plan_step(model, shape, plain - 1).plain
    for frac in (0.8, 0.5, 0.3):
        budget = state + int(frac * (plain - state))
        plan = plan_step(model, shape, budget)
        k = plan.offloaded
        assert plan.places == ("device",) * k and plan.estimate <= budget

        def fits(j: int, budget: int = budget) -> bool:  # every checkpoint on the device, beside the smallest chunk step
            rest = mem[j:]
            need = state + sum(m.saved for m in rest) + 2 * max(m.largest for m in rest) + 4 * chunk_min(j)
            return need + image + sum(m.output for m in mem[: j - 1]) <= budget
        assert fits(k) or k == len(mem)
        assert not any(fits(j) for j in range(1, k)), f"budget {frac}: a shorter prefix fits ({k} chosen)"
        assert plan.minimum_bytes() == (image, 0)


def test_unit_memory_matches_shapes_and_a_real_saved_tensor_count():
    """Outputs against forward hooks of the plain layers; saved bytes against storages autograd
    saves in a real CPU forward (distinct data pointers, parameters excluded)."""
    model = build_encoder("resnet18").train()
    shape = (2, 3, 48, 40)
    mem = unit_memory(model, shape, torch.float32)
    outs, saved, seen = [], [], {}
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}  # state, not activations

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(*shape, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        z = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        outs.append(z.numel() * 4)
        saved.append(sum(seen.values()))
        for stage in model.stages():
            for block in stage:
                z = block(z)
                outs.append(z.numel() * 4)
                saved.append(sum(seen.values()))
    assert [m.output for m in mem] == outs
    assert [m.saved for m in mem] == [saved[0]] + [b - a for a, b in zip(saved, saved[1:])]


def _independent_bytes(plain: nn.Module, x: torch.Tensor, k: int, places: tuple[str, ...], bn: str) -> tuple[int, int]:
    """Bytes one step must move, from the plain units' shapes and the documented passes: a unit
    reads its input once per pass (statistics passes, forward, backward-sums passes, backward)
    when it lives on the host, its output gradient once per backward pass when that lives on the
    host, writes its output (forward) and its input gradient (backward) when they live on the host."""
    sizes = [x.numel() * x.element_size()]
    with torch.no_grad():
        z = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))
        sizes.append(z.numel() * z.element_size())
        for stage in plain.stages():
            for block in stage:
                z = block(z)
                sizes.append(z.numel() * z.element_size())
    units = resnet_units(plain)
    h2d = d2h = 0
    minimum = sizes[0] * (1 if places[0] == "device" else 2) + sum(5 * sizes[i] for i in range(1, k) if places[i] == "host")
    if places[0] == "device":
        h2d += sizes[0]  # the image, uploaded once
    for i in range(k):
        levels = max((sum(op.kind == "bn" for op in ops) for ops in (units[i].main, units[i].shortcut or [])), default=0)
        fwd = 1 + (levels if bn == "train" else 0)  # statistics passes + the forward pass
        bwd = 1 + (levels if bn == "train" else 0)  # sums passes + the backward pass
        x_host = places[i] == "host"
        y_host = i + 1 < k and places[i + 1] == "host"
        h2d += (fwd + bwd) * sizes[i] * x_host + bwd * sizes[i + 1] * y_host
        d2h += sizes[i + 1] * y_host + sizes[i] * (x_host and i > 0)
    return h2d, d2h, minimum


@pytest.mark.parametrize("bn", ["frozen", "train"])
def test_step_bytes_equal_an_independent_count(bn):
    name, shape = "resnet18", (2, 3, 32, 32)
    plain = perturbed_resnet(name, bn, torch.float32)
    x = torch.randn(*shape)
    k, places = 5, ("host", "device", "host", "host", "device")
    big = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), None, 10**8)  # whole samples: no halos
    big.set_plan(manual_plan(big.plain, shape, k, places, 10**8))
    t = count_step(big, x)
    assert (t.h2d, t.d2h, t.minimum) == _independent_bytes(plain, x, k, places, bn)
    if bn == "frozen":
        # FLOPs: the plain step's plus the fused units' forward once more (recomputed in backward)
        with FlopCounterMode(display=False) as fc:
            copy.deepcopy(plain)(x).square().mean().backward()
        with FlopCounterMode(display=False) as fw, torch.no_grad():
            z = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))
            for block in [b for s in plain.stages() for b in s][: k - 1]:
                z = block(z)
        assert t.flops == fc.get_total_flops() + fw.get_total_flops()
    else:
        assert t.moved > t.minimum  # the statistics and sums passes re-read host inputs


def test_dry_run_counts_what_a_real_run_moves():
    shape, chunk = (1, 3, 64, 56), 40_000
    plain = perturbed_resnet("resnet18", "train", torch.float32)
    places = ("host", "host", "device")
    real = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), None, chunk)
    real.set_plan(manual_plan(real.plain, shape, 3, places, chunk))
    got = count_step(real, torch.randn(*shape))
    with torch.device("meta"):
        m = build_encoder("resnet18").train()
    dry = BudgetResNet(m, ChunkRunner("meta"), None, chunk)
    dry.set_plan(manual_plan(m, shape, 3, places, chunk))
    want = count_step(dry, torch.empty(*shape, device="meta"))
    assert [(p.layer, p.h2d, p.d2h, p.flops, p.first_h2d, p.last_d2h) for p in want.passes] == \
        [(p.layer, p.h2d, p.d2h, p.flops, p.first_h2d, p.last_d2h) for p in got.passes]
    assert (want.h2d, want.d2h, want.minimum, want.flops) == (got.h2d, got.d2h, got.minimum, got.flops)
    assert got.over_minimum > 1.0  # halo rows and the train-mode passes re-read host inputs


def test_bf16_autocast_follows_plain_autocast_and_moves_half_the_bytes():
    bf16_u, roundings = 2.0**-8, 2 + 8 * (2 + 2 + 1)  # tests/test_bigl_autocast.py's bound
    shape, chunk = (2, 3, 48, 48), 40_000
    plain = perturbed_resnet("resnet18", "frozen", torch.float32)
    torch.manual_seed(1)
    x, r = torch.randn(*shape), torch.randn(2, 512)
    k, places = 3, ("host", "host", "device")
    outs, moved = {}, {}
    for mode in ("fp32", "plain", "fused"):
        m = copy.deepcopy(plain)
        if mode == "fused":
            m = BudgetResNet(m, ChunkRunner("cpu"), None, chunk)
            m.set_plan(manual_plan(m.plain, shape, k, places, chunk, cast=torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"), monitor_transfers() as mon:
            y = m(x)
            (y.float() * r).sum().backward()
        outs[mode] = (y.float(), torch.cat([p.grad.flatten() for p in m.parameters()]))
        moved[mode] = mon.to_device_bytes() + mon.to_host_bytes()
        if mode == "fused":
            assert m.last_plan.transfer_dtype == "bfloat16"
            assert {t.dtype for t in m.runner.buffers._slots.values()} == {torch.bfloat16}  # image and checkpoints
            assert all(p.grad.dtype == torch.float32 for p in m.parameters())

    def rel_norm(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    fwd, grad = roundings * bf16_u, 2 * roundings * bf16_u
    assert rel_norm(outs["plain"][0], outs["fp32"][0]) <= fwd and rel_norm(outs["plain"][1], outs["fp32"][1]) <= grad
    assert rel_norm(outs["fused"][0], outs["plain"][0]) <= 2 * fwd
    assert rel_norm(outs["fused"][1], outs["plain"][1]) <= 2 * grad
    # the same plan in float32 moves twice the bytes
    f32 = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), None, chunk)
    f32.set_plan(manual_plan(f32.plain, shape, k, places, chunk))
    with monitor_transfers() as mon:
        f32(x).square().mean().backward()
    assert mon.to_device_bytes() + mon.to_host_bytes() == 2 * moved["fused"]


def test_host_buffers_are_reused_across_steps():
    shape, chunk = (2, 3, 32, 32), 10**6
    big = BudgetResNet(perturbed_resnet("resnet18", "frozen", torch.float32), ChunkRunner("cpu"), None, chunk)
    big.set_plan(manual_plan(big.plain, shape, 4, ("host",) * 4, chunk))
    ptrs = []
    for _ in range(3):
        big(torch.randn(*shape)).square().mean().backward()
        ptrs.append({k: t.data_ptr() for k, t in big.runner.buffers._slots.items()})
        assert not big.runner.buffers._busy, "a step left a buffer in use"
    assert ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[0]) >= 4


def test_plain_plan_is_the_plain_step_bit_for_bit():
    plain = perturbed_resnet("resnet50", "train", torch.float32)
    big = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), 10 * GB, 2**20)
    x = torch.randn(2, 3, 32, 32)
    with monitor_transfers() as mon:
        y = big(x)
    assert big.last_plan.plain and torch.equal(y, copy.deepcopy(plain)(x))
    assert mon.to_device_bytes() == x.numel() * 4 and mon.to_host_bytes() == 0


def test_budget_option_and_errors():
    assert resolve_budget(None, "cpu") is None and resolve_budget("auto", "cpu") is None  # the host is the device
    assert resolve_budget(8, "cpu") == 8 * GB
    with pytest.raises(ValueError, match="device_budget_gb='big'"):
        resolve_budget("big", "cpu")
    with pytest.raises(ValueError, match="device_budget_gb=-1"):
        resolve_budget(-1, "cpu")
    model = build_encoder("resnet18")
    assert type(bigify(copy.deepcopy(model), 1, 2**20, device="cpu")).__name__ == "BigResNet"  # the contract
    assert type(bigify(copy.deepcopy(model), 1, 2**20, device="cpu", device_budget_gb="auto")).__name__ == "BigResNet"
    big = bigify(copy.deepcopy(model), 1, 2**20, device="cpu", device_budget_gb=0.2)
    assert isinstance(big, BudgetResNet) and big.budget == int(0.2 * GB)
    assert list(big.state_dict()) == list(model.state_dict())  # checkpoints load into the plain encoder
    assert big.conv1.weight is big.plain.conv1.weight
    with pytest.raises(ValueError, match="device budget 0.010 GB is too small"):
        plan_step(model, (4, 3, 64, 64), int(0.01 * GB))
    plain = plan_step(model, (4, 3, 64, 64), None).plain_estimate
    with pytest.raises(ValueError, match=r"max_elements=100 is too small for the fused run stem: .* use max_elements >= \d+"):
        plan_step(model, (4, 3, 64, 64), plain - 1, max_elements=100)
    with pytest.raises(ValueError, match="places="):
        manual_plan(model, (1, 3, 32, 32), 2, ("host",), 1000)


def test_config_key_and_plan_note():
    from wsi_pipeline.config.model import BiglConfig
    from wsi_pipeline.config.pipeline import EncoderConfig, MethodConfig
    from wsi_pipeline.config.schema import build
    from wsi_pipeline.training.strategies import build_strategy

    assert BiglConfig().device_budget_gb == "auto"
    assert build(BiglConfig, {"device_budget_gb": 24}, "bigl").device_budget_gb == 24.0
    assert build(BiglConfig, {"device_budget_gb": None}, "bigl").device_budget_gb is None
    with pytest.raises((TypeError, ValueError), match="bigl.device_budget_gb"):
        build(BiglConfig, {"device_budget_gb": "lots"}, "bigl")
    with pytest.raises(ValueError, match="bigl.device_budget_gb"):
        BiglConfig(device_budget_gb=0)
    method = MethodConfig(name="m", strategy="bigl", encoder=EncoderConfig(name="resnet18"),
                          bigl=BiglConfig(device_budget_gb=0.3))
    strategy = build_strategy(method, 2, "cpu")
    assert isinstance(strategy.encoder, BudgetResNet)

    class Reader:
        def store(self, i):
            return type("S", (), {"tile_size": 64})()

    note = strategy.run_notes(Reader(), [300, 80])["bigl_plan.txt"]
    shape = (method.train.bag_size, 3, 64, 64)
    assert note == strategy.encoder.describe(shape) and "Big-Layers plan (input [256, 3, 64, 64] float32" in note
    assert "fused runs (stem" in note
    fixed = build_strategy(dataclasses.replace(method, bigl=BiglConfig(device_budget_gb=None)), 2, "cpu")
    assert "the fixed plan, the stem and 1 residual stage" in fixed.run_notes(Reader(), [10])["bigl_plan.txt"]


def test_dry_budget_step_meets_the_issue_targets():
    """PCIe 5 at 30 % of an H100's TF32 peak: ResNet-18, 512 tiles of 256 px at 8 GB and an
    8192 px image at 24 GB: step <= 2x the plain step's compute, bytes <= 1.1x the minimum."""
    from wsi_pipeline.bigl.traffic import DeviceModel, predict

    dev = DeviceModel("PCIe5", 50e9, 0.3 * 494.7e12)
    for n, side, budget in ((512, 256, 8), (1, 8192, 24)):
        for bn in ("train", "frozen"):
            t, plan = dry_budget_step("resnet18", n, side, budget * GB, bn=bn, max_elements=1 << 30)
            p, _ = dry_budget_step("resnet18", n, side, None, bn=bn)
            assert not plan.plain and predict(t, dev)[1] <= 2 * p.flops / dev.flop_rate, (n, side, bn)
            assert t.moved <= 1.1 * t.minimum


@pytest.mark.slow
def test_training_logs_and_records_the_plan(tmp_path, store_cohort, caplog):
    """A ``bigl`` method with a device budget below its plain step trains through fused runs and
    writes the plan it printed into its run folder (``bigl_plan.txt``)."""
    import logging

    from pipeline_helpers import make_config
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.training.loop import train_pipeline
    from wsi_pipeline.training.rundir import DONE

    with torch.device("meta"):
        model = build_encoder("resnet18").eval()
    budget = plan_step(model, (8, 3, 32, 32), None).plain_estimate - 1  # the plain step just misses it
    method = {"name": "m", "strategy": "bigl", "bigl": {"device_budget_gb": budget / GB, "max_elements": 2**22}}
    cfg = load_config(make_config(tmp_path, store_cohort, [method], train={"epochs": 1}))
    with caplog.at_level(logging.INFO):
        (run_dir,) = train_pipeline(cfg, progress=False)
    note = (run_dir / "bigl_plan.txt").read_text()
    assert "Big-Layers plan (input [8, 3, 32, 32] float32" in note and "fused runs (stem" in note
    assert any(note.strip() in r.getMessage() for r in caplog.records)
    assert (run_dir / DONE).exists()


def test_batchnorm_calibration_through_a_budget_plan_equals_plain():
    """Calibration (momentum None: a cumulative average) through a plan that offloads units = on the plain encoder.

    Planning runs the encoder on meta tensors, where a cumulative average cannot read its batch
    count; the first CUDA run of the demo (bigl.device_budget_gb: auto) failed there."""
    from wsi_pipeline.models.bn_calibration import calibrate_batchnorm

    name, shape = "resnet18", (2, 3, 45, 37)
    plain = perturbed_resnet(name, "train")
    full = plan_step(plain, shape, None, dtype=torch.float64, grad=False)  # calibration runs without gradient
    state = state_bytes(plain, 1)
    big = BudgetResNet(copy.deepcopy(plain), ChunkRunner("cpu"), offloading_budget(state, full.plain_estimate), 45_000)
    torch.manual_seed(3)
    batches = [torch.randn(*shape, dtype=torch.float64) for _ in range(3)]
    assert calibrate_batchnorm(plain, batches) == calibrate_batchnorm(big, batches) == 3
    assert big.last_plan is not None and big.last_plan.offloaded > 0, "the budget must offload some units"
    for (n, p), (_, q) in zip(plain.named_buffers(), big.named_buffers()):
        assert rel(q, p) <= REL, f"{n}: {rel(q, p):.2g}"
    assert all(m.momentum == 0.1 for m in big.modules() if isinstance(m, nn.BatchNorm2d))
