"""Probability calibration fitted on the validation split (``train.calibrate``), and the paper's
aggregators without the projection layer."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from wsi_pipeline.tasks import Endpoint, get_task
from wsi_pipeline.tasks.calibration import LogitMap, fit_logit_map, smoothed_targets

from pipeline_helpers import make_config


def _reference_platt(s: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Platt's fit by scikit-learn: each slide twice, as class 1 with weight t and as class 0 with weight 1 - t."""
    from sklearn.linear_model import LogisticRegression

    t = smoothed_targets(y)
    x = np.concatenate([s, s])[:, None]
    yy = np.concatenate([np.ones_like(y), np.zeros_like(y)])
    w = np.concatenate([t, 1 - t])
    lr = LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000).fit(x, yy, sample_weight=w)
    return float(lr.coef_[0, 0]), float(lr.intercept_[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_platt_matches_a_weighted_logistic_regression(seed) -> None:
    rng = np.random.default_rng(seed)
    s = rng.normal(0, 3, 30)
    y = (s + rng.normal(0, 3, 30) > 1).astype(int)
    z = np.stack([rng.normal(size=30), np.zeros(30)], 1)
    z[:, 1] = z[:, 0] + s  # log-odds s, whatever the class-0 logit
    fitted = fit_logit_map(z, y, "platt")
    a, b = _reference_platt(s, y)
    assert fitted.method == "platt" and fitted.n_slides == 30
    assert fitted.scale == pytest.approx(a, rel=1e-4, abs=1e-5) and fitted.shift == pytest.approx(b, rel=1e-4, abs=1e-5)
    # the decision at calibrated 0.5 is the threshold -b/a on the model's log-odds
    thr = fitted.raw_threshold()
    p = get_task("classification").scores(Endpoint().calibrated(fitted), z)["probs"][:, 1]
    raw = 1 / (1 + np.exp(-s))
    assert np.array_equal(p >= 0.5, raw >= thr)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-(a * s + b))), rtol=1e-4)


def test_platt_stays_finite_when_the_validation_split_separates() -> None:
    s = np.array([-3.0, -2.0, -1.0, 4.0, 5.0, 6.0])
    y = np.array([0, 0, 0, 1, 1, 1])
    fitted = fit_logit_map(np.stack([np.zeros(6), s], 1), y, "platt")
    a, b = _reference_platt(s, y)
    assert np.isfinite(fitted.scale) and fitted.scale == pytest.approx(a, rel=1e-3)
    assert fitted.shift == pytest.approx(b, rel=1e-3, abs=1e-4)


def test_temperature_keeps_the_arg_max_and_minimises_the_smoothed_nll() -> None:
    rng = np.random.default_rng(3)
    z = rng.normal(0, 4, (40, 3))
    y = rng.integers(0, 3, 40)
    y[:3] = [0, 1, 2]
    fitted = fit_logit_map(z, y, "temperature")
    assert fitted.method == "temperature" and fitted.shift == 0.0
    zc = fitted.apply(z)
    assert np.array_equal(zc.argmax(1), z.argmax(1))
    counts = np.bincount(y, minlength=3)
    soft = np.where(np.eye(3)[y] > 0, (counts + 1) / (counts + 2), 1 / (40 - counts + 2))
    soft = soft / soft.sum(1, keepdims=True)

    def nll(a: float) -> float:
        return float(-(soft * torch.log_softmax(torch.tensor(a * z), 1).numpy()).sum())

    grid = np.linspace(0.01, 3, 3000)
    best = grid[np.argmin([nll(a) for a in grid])]
    assert fitted.scale == pytest.approx(best, abs=2e-3)


@pytest.mark.parametrize("case", ["one_class", "backwards", "none"])
def test_no_calibration_is_the_identity(case) -> None:
    s = np.array([-2.0, -1.0, 1.0, 2.0])
    y = np.array([1, 1, 0, 0]) if case == "backwards" else (np.zeros(4, int) if case == "one_class" else np.array([0, 0, 1, 1]))
    fitted = fit_logit_map(np.stack([np.zeros(4), s], 1), y, "none" if case == "none" else "platt")
    assert (fitted.scale, fitted.shift, fitted.method, fitted.n_slides) == (1.0, 0.0, "none", 4)


def test_an_old_endpoint_state_reads_as_uncalibrated() -> None:
    state = Endpoint().to_state()
    for k in ("calibration", "logit_scale", "logit_shift", "calibrated_on"):
        state.pop(k)
    e = Endpoint.from_state(state)
    assert e.logit_map == LogitMap()
    z = np.array([[0.3, -1.2]])
    np.testing.assert_allclose(e.scores(z)["probs"], torch.softmax(torch.tensor(z), 1).numpy())


@pytest.mark.parametrize("name", ["abmil", "mean", "max"])
def test_without_projection_the_paper_operators_act_on_the_embeddings(name) -> None:
    from wsi_pipeline.models import build_aggregator

    torch.manual_seed(0)
    opts = {"gated": False, "attn_dim": 16, "dropout": 0.0} if name == "abmil" else {"dropout": 0.0}
    agg = build_aggregator(name, 12, 2, projection=False, **opts).eval()
    h = torch.randn(7, 12)
    out = agg(h)
    w, c = agg.classifier.weight, agg.classifier.bias
    if name == "abmil":  # a = softmax(w^T tanh(V h))
        a = torch.softmax(agg.attn_score(torch.tanh(agg.attn_tanh[0](h))).squeeze(-1), 0)
        pooled = a @ h
        torch.testing.assert_close(out.attention, a)
    else:
        pooled = h.mean(0) if name == "mean" else h.max(0).values
    torch.testing.assert_close(out.logits, pooled @ w.T + c)
    assert sum(p.numel() for p in agg.parameters()) == (
        (12 * 16 + 16 + 16 + 1 if name == "abmil" else 0) + 12 * 2 + 2)


@pytest.mark.slow
def test_training_calibrates_best_and_eval_reports_calibrated_probabilities(tmp_path, store_cohort) -> None:
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.checkpoints.files import load_run_checkpoint
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.inference.trained import load_trained_model

    methods = [{"name": "att", "strategy": "frozen", "encoder": {"name": "ilse_cnn"},
                "aggregator": {"name": "abmil", "options": {"gated": False, "attn_dim": 16, "projection": False}}}]
    cfg = make_config(tmp_path, store_cohort, methods, train={"epochs": 3, "lr": 1e-3, "calibrate": "platt"},
                      eval={"protocols": ["all"], "val_protocol": "all", "bootstrap": 10},
                      results_dir=str(tmp_path / "results"))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "att" / "seed0"
    record = json.loads((run / "calibration.json").read_text())
    manifest = pd.read_csv(store_cohort)
    val = manifest[manifest["split"] == "val"]
    assert record["validation_slides"] == len(val)
    ep = load_run_checkpoint(run / "best.pt").endpoint_spec()
    assert ep.calibrated_on == len(val) and ep.calibration == record["method"]
    # the calibration is Platt's fit of the best model's own log-odds on all tiles of the validation slides
    tm = load_trained_model(run, which="best")

    def log_odds(sid: str) -> float:
        store = open_store(next((store_cohort.parent / "tiles").glob(f"{sid}.zarr")))
        with torch.no_grad():
            z = tm.aggregator(tm.encoder(tiles_to_tensor(store.read()))).logits.double().reshape(-1)
        return float(z[1] - z[0])

    s = np.array([log_odds(sid) for sid in val["slide_id"]])
    if ep.calibration == "platt":
        a, b = _reference_platt(s, val["label"].to_numpy())
        assert ep.logit_scale == pytest.approx(a, rel=1e-3, abs=1e-4) and ep.logit_shift == pytest.approx(b, rel=1e-3, abs=1e-4)
    assert main(["eval", "--config", str(cfg), "--no-progress"]) == 0
    preds = pd.concat(pd.read_csv(p) for p in (tmp_path / "results" / "t").rglob("predictions_*_all.csv"))
    test = preds[preds["slide_id"].isin(manifest[manifest["split"] == "test"]["slide_id"])].drop_duplicates("slide_id")
    s_test = np.array([log_odds(sid) for sid in test["slide_id"]])
    expected = 1 / (1 + np.exp(-(ep.logit_scale * s_test + ep.logit_shift)))
    np.testing.assert_allclose(test["prob_1"].to_numpy(), expected, rtol=1e-4, atol=1e-6)


def test_bag_size_all_puts_every_tile_of_a_slide_in_its_bag() -> None:
    from wsi_pipeline.config.schema import build
    from wsi_pipeline.config.train import ALL_TILES, TrainConfig
    from wsi_pipeline.data.bags import epoch_plan

    tc = build(TrainConfig, {"bag_size": "all", "batch_bags": 1}, "train")
    n_tiles = [5, 796, 1, 230]
    plan = epoch_plan(n_tiles, bag_size=tc.bag_size, bags_per_step=tc.bags_per_step, seed=0, epoch=3)
    bags = {i: idx for step in plan for i, idx in step}
    assert sorted(bags) == [0, 1, 2, 3]
    for i, n in enumerate(n_tiles):
        assert np.array_equal(np.sort(bags[i]), np.arange(n))
    with pytest.raises(Exception, match="or 'all'"):
        build(TrainConfig, {"bag_size": "every"}, "train")
    # 'all' as a run's config.yaml and checkpoint store it reads back as 'all' (eval, predict, resume)
    from wsi_pipeline.config.pipeline import config_from_dict, config_to_dict, load_config

    cfg = load_config("pipelines/ilse_colon_grid.yaml")
    again = config_from_dict(config_to_dict(cfg))
    assert [m.train.bag_size for m in again.methods] == [m.train.bag_size for m in cfg.methods] == [ALL_TILES] * len(cfg.methods)
    with pytest.raises(ValueError, match="<= 1000000"):
        build(TrainConfig, {"bag_size": ALL_TILES - 1}, "train")
