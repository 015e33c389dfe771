"""The accumulation strategy with the ABMIL-ACC paper's BatchNorm (``encoder.bn: chunk``): a
pipeline config selects it and it trains; it is the paper's setting, not exact.

Reference: plain autograd over the whole bag in one batch (``full_step``), computed here.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from wsi_pipeline.data.bags import Bag, Slide
from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.training.accumulate import full_step
from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.training.strategies import AccumulateStrategy, build_strategy


def _method(chunk: int):
    raw = {
        "name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
        "methods": [{"name": "abmil_acc_paper", "strategy": "accumulate", "chunk_size": chunk,
                     "encoder": {"name": "resnet18", "bn": "chunk"}, "aggregator": {"name": "abmil"}}],
    }
    return config_from_dict(raw).methods[0]


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])


def test_chunk_batchnorm_is_selectable_runs_and_is_not_exact():
    torch.set_num_threads(1)
    method = _method(chunk=4)
    assert method.encoder.bn == "chunk"
    torch.manual_seed(0)
    strategy = build_strategy(method, 2, "cpu")
    assert isinstance(strategy, AccumulateStrategy) and strategy._bn() == "chunk"
    rng = np.random.default_rng(0)
    tiles = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    bag = Bag(Slide("s", 1, None), np.arange(12), tiles)  # type: ignore[arg-type]
    twin = copy.deepcopy(strategy.encoder), copy.deepcopy(strategy.aggregator)
    bn = next(m for m in strategy.encoder.modules() if isinstance(m, torch.nn.BatchNorm2d))
    before = bn.running_mean.clone()
    strategy.train()
    torch.manual_seed(2)  # the same dropout draws on both sides
    loss = strategy.bag_step(bag, 1.0)  # three chunks of 4 tiles, train-mode BatchNorm per chunk
    assert np.isfinite(loss)
    assert not torch.equal(bn.running_mean, before)  # statistics are trained, once per bag
    got = _grads(strategy.encoder)
    assert torch.isfinite(got).all()

    # not exact: plain autograd over the whole bag with train-mode BatchNorm (bag statistics) differs
    enc, agg = twin
    enc.train()
    agg.train()
    torch.manual_seed(2)
    full_step(enc, agg, tiles_to_tensor(tiles), 1, bn="chunk")
    ref = _grads(enc)
    rel = float((got - ref).norm() / ref.norm())
    # float32: an exact method would agree to ~1e-5 relative (round-off over a ResNet-18 backward);
    # per-chunk statistics of 4 random tiles against those of 12 are far off
    assert rel > 1e-2, f"chunk statistics unexpectedly matched the bag's ({rel:.2e})"


def test_one_chunk_covering_the_bag_is_the_whole_bag_batchnorm():
    """With chunk_size >= bag size the per-chunk statistics are the bag's: plain autograd, to float32 round-off."""
    torch.set_num_threads(1)
    method = _method(chunk=16)
    torch.manual_seed(1)
    strategy = build_strategy(method, 2, "cpu")
    tiles = np.random.default_rng(1).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    twin = copy.deepcopy(strategy.encoder), copy.deepcopy(strategy.aggregator)
    strategy.train()
    torch.manual_seed(2)  # the same dropout draws on both sides
    strategy.bag_step(Bag(Slide("s", 0, None), np.arange(6), tiles), 1.0)  # type: ignore[arg-type]
    enc, agg = twin
    enc.train()
    agg.train()
    torch.manual_seed(2)
    full_step(enc, agg, tiles_to_tensor(tiles), 0, bn="chunk")
    got, ref = _grads(strategy.encoder), _grads(enc)
    # same operations on the same batch, evaluated in another order (embed without grad, then
    # re-embed with grad): float32 round-off, ~1e-6 relative per op over a few hundred ops
    assert float((got - ref).norm() / ref.norm()) < 1e-4
