"""``train.bf16``: bfloat16 autocast in training, on CUDA and on CPUs with bfloat16 instructions.

The loop holds one autocast region over the whole epoch. Autocast caches its bfloat16 copies of the
weights until its outermost region ends, so without clearing that cache after each optimiser step,
every forward of the epoch would read the weights the epoch began with (the bug this file guards:
the attention-MIL network then diverged on real images, docs/real-data.md). References here are
plain PyTorch loops written in the test, with autocast around each step's forward only, as
PyTorch's autocast guide writes them.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wsi_pipeline import devices
from wsi_pipeline.checkpoints.files import load_run_checkpoint
from wsi_pipeline.config.pipeline import config_from_dict, load_config
from wsi_pipeline.data.bags import Bag, Slide
from wsi_pipeline.data.bags import epoch_plan
from wsi_pipeline.training.loop import train_pipeline

from pipeline_helpers import make_config


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Take this CPU as one with bfloat16 instructions (autocast emulates them where it has none: same results, slower)."""
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)


def _plain_loop(feats, labels, epochs: int, lr: float, per_step: bool) -> dict[str, torch.Tensor]:
    """ABMIL on frozen features, one bag per step, Adam; autocast around each step's forward
    (``per_step``) or one region over each epoch (the stale-cache mistake)."""
    from wsi_pipeline.models import build_aggregator
    from wsi_pipeline.training.loop import _seed_everything

    _seed_everything(0)  # the run's initialisation seed
    agg = build_aggregator("abmil", 512, 2, dropout=0.0)
    opt = torch.optim.Adam(agg.parameters(), lr=lr, weight_decay=1e-4)
    cast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    for epoch in range(epochs):
        with contextlib.nullcontext() if per_step else cast():
            for bags in epoch_plan([len(f) for f in feats], bag_size=8, bags_per_step=1, seed=0, epoch=epoch):
                ((i, idx),) = bags
                with cast() if per_step else contextlib.nullcontext():
                    logits = agg(feats[i][idx]).logits
                    loss = torch.nn.functional.cross_entropy(logits.reshape(1, -1), torch.tensor([labels[i]]))
                with torch.autocast("cpu", enabled=False):
                    loss.backward()
                opt.step()
                opt.zero_grad()
    return {k: v.detach().clone() for k, v in agg.state_dict().items()}


def test_bf16_training_follows_each_steps_weights(tmp_path, store_cohort, bf16_cpu):
    """Frozen features, bf16, one bag per step: the loop's weights after two epochs equal a plain loop's
    with autocast per step, and are far from a loop whose autocast region spans the epoch."""
    from wsi_pipeline.inference.features import features_path, read_features
    from wsi_pipeline.manifests.schema import read_manifest

    method = {"name": "m", "strategy": "frozen", "chunk_size": 32, "aggregator": {"name": "abmil", "options": {"dropout": 0.0}}}
    train = {"epochs": 2, "lr": 1e-2, "batch_bags": 1, "schedule": "none", "bf16": True}
    train_pipeline(load_config(make_config(tmp_path, store_cohort, [method], train=train)), progress=False)

    df = read_manifest(store_cohort)
    rows = df[(df["split"] == "train") & df["label"].notna()]
    feats = [torch.from_numpy(read_features(features_path(tmp_path / "features" / "resnet18", s))[0]) for s in rows["slide_id"]]
    labels = [int(v) for v in rows["label"]]
    ours = load_run_checkpoint(tmp_path / "runs" / "t" / "m" / "seed0" / "last.pt").models["aggregator"]
    fresh = _plain_loop(feats, labels, 2, 1e-2, per_step=True)
    stale = _plain_loop(feats, labels, 2, 1e-2, per_step=False)

    def gap(a: dict, b: dict) -> float:
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())

    # the same operations on the same data in the same order on one CPU: equal, bit for bit
    assert gap(ours, fresh) == 0.0
    # the mistake moves the weights by many Adam steps' worth (each step moves a weight by about lr)
    assert gap(fresh, stale) > 1e-2


def test_backward_outside_autocast_keeps_the_forwards_dtypes():
    """A float32 graph's gradients under ``autocast_off`` inside a CPU autocast region equal those with no
    autocast at all; a backward left inside the region re-casts its matrix products to bfloat16."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(256, 32)

    def grad(ctx, off: bool) -> torch.Tensor:
        wl = w.clone().requires_grad_(True)
        y = torch.tanh(x @ wl).sum()
        with ctx, devices.autocast_off() if off else contextlib.nullcontext():
            y.backward()
        return wl.grad

    plain = grad(contextlib.nullcontext(), False)
    assert torch.equal(grad(torch.autocast("cpu", dtype=torch.bfloat16), True), plain)
    inside = grad(torch.autocast("cpu", dtype=torch.bfloat16), False)
    # bfloat16 keeps 8 significant bits: a relative error of order 2^-9 per product, not float32's 2^-24
    assert float((inside - plain).norm() / plain.norm()) > 2.0**-16


def test_cpu_bf16_is_read_from_the_flags(tmp_path):
    flags = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {}\n\nprocessor\t: 1\n"
    for extra, want in (("avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx512_vnni", False)):
        path = tmp_path / f"cpuinfo_{extra.split()[0]}"
        path.write_text(flags.format(extra))
        assert devices.cpu_has_bf16(str(path)) is want
    assert devices.cpu_has_bf16(str(tmp_path / "absent")) is False


def test_bf16_autocast_casts_where_the_device_runs_bfloat16(monkeypatch):
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: True)
    with devices.bf16_autocast(True, "cpu"):
        assert lin(x).dtype == torch.bfloat16
    with devices.bf16_autocast(False, "cpu"):
        assert lin(x).dtype == torch.float32
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    with devices.bf16_autocast(True, "cpu"):  # no bfloat16 instructions: float32, not a slow emulation
        assert lin(x).dtype == torch.float32
    assert not devices.bf16_active(True, "cpu") and not devices.bf16_active(True, "mps")


def test_bf16_on_a_cpu_without_it_trains_in_float32_and_says_so(tmp_path, store_cohort, monkeypatch, caplog):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    method = {"name": "m", "strategy": "frozen", "chunk_size": 32, "aggregator": {"name": "abmil", "options": {"dropout": 0.0}}}
    train = {"epochs": 1, "batch_bags": 1, "bf16": True}
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.training.loop"):
        train_pipeline(load_config(make_config(tmp_path, store_cohort, [method], train=train)), progress=False)
    assert any("train.bf16 is set" in r.getMessage() and "training in float32" in r.getMessage() for r in caplog.records)


class _ConvDtypes(TorchDispatchMode):
    """The dtypes of the floating arguments of every convolution, forward and backward (ATen level)."""

    OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: dict[object, set[torch.dtype]] = {op: set() for op in self.OPS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.dtypes:
            self.dtypes[func] |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def test_bigl_step_in_the_loops_bf16_region_runs_bfloat16_within_the_rounding_bound(bf16_cpu, one_thread):
    """A Big-Layers step (strategy ``bigl``: ResNet-18 in host chunks, BatchNorm on running statistics,
    ABMIL) inside the loop's epoch-long bf16 region, backward outside autocast as the strategies run it:
    every convolution, forward and backward (pass 3 re-runs each chunk), computes in bfloat16, and the
    parameter gradients stay within the first-order rounding bound of the same step in float32.

    Bound (the argument of tests/bigl/test_bigl_autocast.py): bfloat16's unit roundoff u = 2^-8; the
    longest path rounds D times (ResNet-18: 42; ABMIL's attention, softmax-weighted sum and classifier
    add 4), forward and backward: relative error (Frobenius norm, all gradients as one vector) <= 2 D u.
    """
    from wsi_pipeline.training.strategies import build_strategy

    method = {"name": "m", "strategy": "bigl", "chunk_size": 3, "encoder": {"name": "resnet18", "bn": "frozen"},
              "aggregator": {"name": "abmil", "options": {"dropout": 0.0}}, "bigl": {"stages": 1, "max_elements": 20_000}}
    cfg = config_from_dict({"name": "t", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2}, "methods": [method]})
    torch.manual_seed(0)
    strategy = build_strategy(cfg.methods[0], 2, "cpu")
    strategy.train()
    rng = np.random.default_rng(0)
    bag = Bag(Slide("s0", 1, Path("x")), np.arange(7), rng.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8))

    def grads(bf16: bool) -> tuple[torch.Tensor, _ConvDtypes]:
        for p in strategy.parameters():
            p.grad = None
        rec = _ConvDtypes()
        with rec, devices.bf16_autocast(bf16, "cpu"):
            strategy.bag_step(bag, 1.0)
        return torch.cat([p.grad.double().flatten() for p in strategy.parameters() if p.grad is not None]), rec

    g32, rec32 = grads(False)
    g16, rec16 = grads(True)
    assert all(d == {torch.float32} for d in rec32.dtypes.values())
    assert all(d == {torch.bfloat16} for d in rec16.dtypes.values()), rec16.dtypes
    assert g16.numel() == g32.numel() == sum(p.numel() for p in strategy.parameters())
    rel = float((g16 - g32).norm() / g32.norm())
    assert rel <= 2 * (42 + 4) * 2.0**-8
    assert rel > 2.0**-16  # bfloat16 did run: float32's own differences are of order 2^-24
