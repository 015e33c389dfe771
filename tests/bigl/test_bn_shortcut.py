"""The bag-statistics BatchNorm shortcut, reproduced on a small generated cohort, and what the project
does about it: training a method whose BatchNorm uses bag statistics warns (``BagStatisticsWarning``),
and the demo's end-to-end methods use frozen, calibrated BatchNorm, which evaluation uses as trained.

The cohort: bags of 32 four-dimensional "tiles" (one tile = one feature vector, so a tiny encoder
stands in for a CNN). Feature 0 carries the lesions: on positive slides 6 tiles are shifted by +4.
Features 1-3 carry a slide-level nuisance (a stain-like offset, N(0, 3^2) per slide, shared by all
its tiles). BatchNorm over the bag removes each slide's offset, so a model trained with bag
statistics never sees it; evaluation runs BatchNorm on running statistics (the average of the
training bags' statistics), where each slide's offset comes back as a shift of several standard
deviations that the model never learned to ignore.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from wsi_pipeline.models import build_aggregator
from wsi_pipeline.training.accumulate import full_step
from wsi_pipeline.config.pipeline import BagStatisticsWarning, bag_statistics_warning, config_from_dict, load_config

from pipeline_helpers import make_config

REPO_ROOT = Path(__file__).resolve().parents[2]

TILES, LESIONS, DIM = 32, 6, 4
LESION_SHIFT, NUISANCE_SD = 4.0, 3.0


def make_cohort(n_bags: int, g: torch.Generator) -> tuple[list[torch.Tensor], list[int]]:
    """``n_bags`` bags (label = index % 2) of ``TILES`` tiles [TILES, DIM] (see the module docstring)."""
    bags, labels = [], []
    for b in range(n_bags):
        label = b % 2
        x = torch.randn(TILES, DIM, generator=g)
        x[:, 1:] += NUISANCE_SD * torch.randn(1, DIM - 1, generator=g)
        if label:
            x[:LESIONS, 0] += LESION_SHIFT
        bags.append(x)
        labels.append(label)
    return bags, labels


def train_and_score(bn: str, seed: int = 0, steps: int = 256) -> dict[str, float]:
    """Train encoder (Linear -> BatchNorm -> ReLU) + the project's ABMIL with ``full_step(bn=...)``,
    one bag per Adam step; return the training loss and test AUCs with running and bag statistics."""
    g = torch.Generator().manual_seed(seed)
    train, test = make_cohort(64, g), make_cohort(40, g)
    torch.manual_seed(seed)
    enc = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU())
    agg = build_aggregator("abmil", 16, 2, dropout=0.0)
    opt = torch.optim.Adam([*enc.parameters(), *agg.parameters()], lr=3e-3)
    enc.train()
    agg.train()
    for step in range(steps):
        i = step % len(train[0])
        opt.zero_grad()
        full_step(enc, agg, train[0][i], train[1][i], bn=bn)  # "chunk": the whole bag is one BatchNorm batch
        opt.step()
    bn_layer = enc[1]

    def probs(bags: list[torch.Tensor], bag_statistics: bool) -> list[float]:
        out = []
        running = (bn_layer.running_mean.clone(), bn_layer.running_var.clone())
        with torch.no_grad():
            for x in bags:
                enc.train(bag_statistics)  # eval mode = running statistics, as validation/evaluation run
                agg.eval()
                out.append(torch.softmax(agg(enc(x)).logits.reshape(-1), 0)[1].item())
        bn_layer.running_mean.copy_(running[0])
        bn_layer.running_var.copy_(running[1])
        enc.eval()
        return out

    p_train = probs(train[0], bag_statistics=(bn == "chunk"))  # the statistics the model trained with
    loss = float(np.mean([-np.log(p if y else 1 - p) for p, y in zip(p_train, train[1])]))
    return {
        "train_loss": loss,
        "auc_running": roc_auc_score(test[1], probs(test[0], bag_statistics=False)),
        "auc_bag": roc_auc_score(test[1], probs(test[0], bag_statistics=True)),
    }


@pytest.mark.slow
def test_bag_statistics_batchnorm_learns_a_model_that_fails_with_running_statistics():
    torch.set_num_threads(1)  # small matrices: one thread is fastest and deterministic
    bag = train_and_score("chunk")
    # trained until the training loss is low, and right when evaluated with bag statistics ...
    assert bag["train_loss"] < 0.35, bag
    assert bag["auc_bag"] >= 0.9, bag
    # ... but evaluation (running statistics) ranks the test slides no better than chance
    assert bag["auc_running"] <= 0.6, bag
    # the same cohort with frozen BatchNorm (the project's default): training and evaluation use
    # the same statistics, and the model learns the lesions
    frozen = train_and_score("frozen")
    assert frozen["train_loss"] < 0.35 and frozen["auc_running"] >= 0.9, frozen


def _method(strategy: str, bn: str) -> dict:
    m = {"name": "m", "strategy": strategy, "encoder": {"bn": bn}}
    if strategy == "bigl":
        m["bigl"] = {"stages": 1, "max_elements": 2**22}
    return m


@pytest.mark.parametrize(
    ("strategy", "bn", "warns"),
    [("bigl", "train", True), ("full", "train", True), ("accumulate", "chunk", True), ("patchgd", "train", True),
     ("bigl", "frozen", False), ("accumulate", "frozen", False), ("frozen", "frozen", False)],
)
def test_bag_statistics_are_named_for_exactly_the_methods_that_use_them(strategy, bn, warns):
    cfg = config_from_dict({"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "t", "n_classes": 2},
                            "methods": [_method(strategy, bn)]})
    msg = bag_statistics_warning(cfg.methods[0])
    assert (msg is not None) == warns
    if warns:
        assert f"encoder.bn={bn!r}" in msg and "running statistics" in msg and "bn: frozen" in msg


def test_training_with_bag_statistics_warns_before_training(tmp_path, store_cohort, caplog):
    from wsi_pipeline.training.preflight import preflight

    cfg = load_config(make_config(tmp_path, store_cohort, [_method("bigl", "train")]))
    with pytest.warns(BagStatisticsWarning, match="validation, evaluation and prediction use running statistics"):
        preflight(cfg, cfg.methods, [0])
    assert any("encoder.bn='train'" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    frozen = load_config(make_config(tmp_path, store_cohort, [_method("bigl", "frozen")], name="f"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", BagStatisticsWarning)
        preflight(frozen, frozen.methods, [0])


def test_the_demo_trains_no_method_with_bag_statistics():
    cfg = load_config(REPO_ROOT / "pipelines" / "demo.yaml")
    assert [bag_statistics_warning(m) for m in cfg.methods] == [None] * len(cfg.methods)
    bigl = next(m for m in cfg.methods if m.strategy == "bigl")
    assert bigl.encoder.bn == "frozen" and bigl.encoder.calibrate_bn > 0 and bigl.encoder.recalibrate_bn
