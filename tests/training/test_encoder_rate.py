"""The encoder's share of the learning rate (``encoder.lr_scale``) and its frozen first epochs
(``encoder.frozen_epochs``): Adam's steps against the hand formula, the loop's schedule, and the
config errors."""

from __future__ import annotations

import pytest
import torch
import yaml

from wsi_pipeline.cli.main import main
from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.training import loop as loop_module
from wsi_pipeline.training.optim import EpochSchedule, build_optimizer
from wsi_pipeline.training.strategies import build_strategy

from pipeline_helpers import make_config


def _method(encoder: dict, strategy: str = "full", **train: object):
    raw = {"name": "t", "data": {"manifest": "m.csv", "tiles_dir": "tiles", "n_classes": 2},
           "train": {"epochs": 3, "lr": 1e-3, "weight_decay": 0.0, "schedule": "none", **train},
           "methods": [{"name": "m", "strategy": strategy, "encoder": encoder,
                        "aggregator": {"name": "abmil", "options": {"projection": False, "dropout": 0.0}}}]}
    return config_from_dict(raw).methods[0]


def _fill_grads(strategy, seed: int) -> dict[int, torch.Tensor]:
    """Give every trainable parameter a gradient from a bag of random tiles (plain autograd); return them by id."""
    gen = torch.Generator().manual_seed(seed)
    tiles = torch.rand(6, 3, 27, 27, generator=gen)
    for p in strategy.parameters():
        p.grad = None
    logits = strategy.aggregator(strategy.encoder(tiles)).logits
    torch.nn.functional.cross_entropy(logits.reshape(1, -1), torch.tensor([1])).backward()
    return {id(p): p.grad.clone() for p in strategy.parameters()}


def test_encoder_rate_share_and_frozen_epochs_follow_adams_formula(float64) -> None:
    """Adam with the same gradient g at both steps has m_hat = g and v_hat = g^2 (bias-corrected), so
    each step moves a weight by rate * g / (|g| + eps): the encoder by 0 in epoch 0 (frozen) and by
    lr * lr_scale in epoch 1; the attention and classifier by lr in both."""
    torch.manual_seed(0)
    method = _method({"name": "ilse_cnn", "lr_scale": 0.25, "frozen_epochs": 1})
    strategy = build_strategy(method, 2, "cpu")
    enc_ids = {id(p) for p in strategy.encoder.parameters()}
    groups = strategy.param_groups()
    assert {id(p) for g in groups if g.get("encoder") for p in g["params"]} == enc_ids
    assert all(g["lr_scale"] == (0.25 if g.get("encoder") else 1.0) for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(strategy.parameters())

    before = {id(p): p.detach().clone() for p in strategy.parameters()}
    optimizer = build_optimizer(groups, method.train, total_steps=2)
    schedule = EpochSchedule(optimizer, method.train, method.encoder.frozen_epochs)
    grads = _fill_grads(strategy, 1)
    eps = optimizer.param_groups[0]["eps"]
    lr = method.train.lr
    for epoch, enc_rate in ((0, 0.0), (1, lr * 0.25)):
        assert schedule.set_epoch(epoch) == lr
        for p in strategy.parameters():
            p.grad = grads[id(p)].clone()
        optimizer.step()
        for p in strategy.parameters():
            g = grads[id(p)]
            enc = id(p) in enc_ids
            moved = (enc_rate if enc else lr) + (0.0 if enc else lr * epoch)  # the total rate over the steps so far
            want = before[id(p)] - moved * g / (g.abs() + eps)
            # float64: each step's rounding is about 1e-16 relative to weights of order 1
            assert torch.allclose(p.detach(), want, rtol=0, atol=1e-12), (epoch, enc, p.shape)
    assert any(not torch.equal(p.detach(), before[id(p)]) for p in strategy.encoder.parameters())


def test_encoder_rate_options_are_checked() -> None:
    with pytest.raises(ValueError, match="encoder.lr_scale"):
        _method({"name": "ilse_cnn", "lr_scale": 0.0})
    with pytest.raises(ValueError, match="encoder.lr_scale"):
        _method({"name": "ilse_cnn", "lr_scale": 2.0})
    with pytest.raises(ValueError, match=r"encoder.frozen_epochs=3 leaves no epoch to train the encoder in \(train.epochs=3\)"):
        build_strategy(_method({"name": "ilse_cnn", "frozen_epochs": 3}), 2, "cpu")
    with pytest.raises(ValueError, match="encoder.lr_scale fine-tunes the encoder, but strategy 'frozen' never trains it"):
        build_strategy(_method({"name": "ilse_cnn", "lr_scale": 0.5}, strategy="frozen"), 2, "cpu")
    with pytest.raises(ValueError, match="encoder.frozen_epochs fine-tunes the encoder, but strategy 'frozen'"):
        build_strategy(_method({"name": "ilse_cnn", "frozen_epochs": 1}, strategy="frozen"), 2, "cpu")
    # one group where the encoder never trains (frozen) or trains at the full rate throughout (as before the settings)
    for strategy in ("frozen", "full"):
        built = build_strategy(_method({"name": "ilse_cnn"}, strategy=strategy), 2, "cpu")
        groups = built.param_groups()
        assert len(groups) == 1 and "encoder" not in groups[0] and groups[0]["params"] == built.parameters()


def test_training_loop_holds_the_encoder_for_its_frozen_epochs(tmp_path, store_cohort, monkeypatch) -> None:
    """Through ``train``: the encoder's rate is 0 in epoch 0 and lr x lr_scale after; the encoder trained."""
    seen: list[tuple[int, list[float]]] = []
    encoder_at: dict[int, list[torch.Tensor]] = {}  # the encoder group's weights at the start of each epoch
    live: list[torch.nn.Parameter] = []

    class Recording(EpochSchedule):
        def set_epoch(self, epoch: int) -> float:
            lr = super().set_epoch(epoch)
            seen.append((epoch, [g["lr"] for g in self.optimizer.param_groups]))
            live[:] = self.optimizer.param_groups[0]["params"]
            encoder_at[epoch] = [p.detach().clone() for p in live]
            return lr

    monkeypatch.setattr(loop_module, "EpochSchedule", Recording)
    method = {"name": "lp", "strategy": "full", "encoder": {"name": "ilse_cnn", "lr_scale": 0.5, "frozen_epochs": 1},
              "aggregator": {"name": "abmil", "options": {"projection": False, "dropout": 0.0}}}
    cfg = make_config(tmp_path, store_cohort, [method], train={"epochs": 2, "lr": 1e-3, "schedule": "none",
                                                                "augment": {"enabled": False}})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    by_epoch = dict(seen)
    assert by_epoch[0] == [0.0, 1e-3] and by_epoch[1] == [5e-4, 1e-3]
    n_encoder = sum(1 for _ in build_strategy(config_from_dict(yaml.safe_load(cfg.read_text())).methods[0], 2, "cpu")
                    .encoder.parameters())
    assert len(live) == n_encoder  # the first group is the encoder's, whole
    assert all(torch.equal(a, b) for a, b in zip(encoder_at[0], encoder_at[1]))  # held in epoch 0
    assert any(not torch.equal(p.detach(), b) for p, b in zip(live, encoder_at[1]))  # trained in epoch 1
