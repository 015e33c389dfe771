"""A ``task: multilabel`` method end to end through the command line (issue 52, item 3).

A tiny synthetic store cohort split for 3-fold cross-validation gets two binary target columns,
``a`` (the slides' class) and ``b`` (another split of the slides), each with an empty cell (that
target masked for that slide), calibrated per target (``train.calibrate: platt``). ``train --folds`` -> ``eval --folds`` must write
``oof_predictions.csv`` with ``prob_a``, ``prob_b`` beside ``slide_id, repeat, fold, method`` and a
pooled table whose per-target AUCs equal scikit-learn's on those rows (masked entries left out);
then ``predict --model RUN --slides DIR`` scores a folder of stores, exits 0 and prints each
target's probability.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import roc_auc_score

from wsi_pipeline.cli.main import main

pytestmark = pytest.mark.slow


def test_multilabel_cross_validation_and_predict_through_the_cli(tmp_path, capsys):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    manifest = make_store_cohort(tmp_path / "data", n_slides=12, tile_size=16, tiles_per_slide=(6, 9), seed=1)
    df = pd.read_csv(manifest)
    df["a"] = df["label"].astype(float)
    df["b"] = [float(i % 2) for i in range(len(df))]
    df.loc[0, "a"] = np.nan  # slide 0 has no value of a: trained and scored on b only
    df.loc[5, "b"] = np.nan
    df.to_csv(manifest, index=False)
    cv = tmp_path / "data" / "cv.csv"
    assert main(["manifest", "split", "--manifest", str(manifest), "--crossval", "3", "--seed", "0", "--out", str(cv)]) == 0
    raw = {
        "name": "ml",
        "data": {"manifest": str(cv), "tiles_dir": str(tmp_path / "data" / "tiles"),
                 "features_dir": str(tmp_path / "features")},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2},
        "eval": {"val_protocol": "all", "protocols": ["all"], "seed": 0, "bootstrap": 20},
        "seeds": [0],
        "methods": [{"name": "m", "strategy": "frozen", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"},
                     "chunk_size": 16, "task": "multilabel", "targets": ["a", "b"],
                     "train": {"calibrate": "platt"}}],
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    }
    cfg = tmp_path / "ml.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg), "--folds", "--no-progress", "--quiet"]) == 0
    run = tmp_path / "runs" / "ml_fold0" / "m" / "seed0"
    history = pd.read_csv(run / "history.csv")
    assert {"val_loss", "val_auc", "val_auc_a", "val_auc_b", "val_balanced_accuracy_b"} <= set(history.columns)
    calibration = json.loads((run / "calibration.json").read_text())  # a Platt map per target
    assert {"scale_a", "shift_a", "scale_b", "threshold_on_model_probability_b"} <= set(calibration)
    assert main(["eval", "--config", str(cfg), "--folds", "--no-progress", "--quiet", "--no-heatmaps"]) == 0

    out = tmp_path / "results" / "ml_cv"
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert list(oof.columns) == ["slide_id", "repeat", "fold", "method", "a", "b", "prob_a", "prob_b"]
    assert len(oof) == 12 and oof[["prob_a", "prob_b"]].notna().all().all()
    got = oof.set_index("slide_id")
    assert math.isnan(got.loc[df.loc[0, "slide_id"], "a"]) and math.isnan(got.loc[df.loc[5, "slide_id"], "b"])
    table = pd.read_csv(out / "cv_table.csv").set_index("metric")
    want = {}
    for c in ("a", "b"):
        seen = oof[c].notna()
        want[c] = roc_auc_score(oof.loc[seen, c].astype(int), oof.loc[seen, f"prob_{c}"])
        assert table.loc[f"auc_{c}", "pooled"] == pytest.approx(want[c], abs=1e-12)
    assert table.loc["auc", "pooled"] == pytest.approx((want["a"] + want["b"]) / 2, abs=1e-12)
    assert {"balanced_accuracy", "balanced_accuracy_a", "balanced_accuracy_b"} <= set(table.index)
    # each fold's predictions CSV carries the targets and their probabilities
    pred = pd.read_csv(tmp_path / "results" / "ml_fold0" / "predictions_synthetic_all.csv")
    assert list(pred.columns[:6]) == ["slide_id", "cohort", "a", "b", "prob_a", "prob_b"]
    assert (tmp_path / "results" / "ml_fold0" / "report.html").is_file()

    new = tmp_path / "new"
    for sid in df["slide_id"][:2]:
        shutil.copytree(tmp_path / "data" / "tiles" / f"{sid}.zarr", new / f"{sid}.zarr")
    capsys.readouterr()
    rc = main(["predict", "--model", str(run), "--slides", str(new), "--out", str(tmp_path / "pred"), "--no-progress",
               "--no-heatmaps", "--device", "cpu", "--workers", "0"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "Traceback" not in printed.err
    scored = pd.read_csv(tmp_path / "pred" / "predictions.csv")
    assert {"prob_a", "prob_b"} <= set(scored.columns) and len(scored) == 2
    assert scored[["prob_a", "prob_b"]].apply(lambda v: v.between(0, 1)).all().all()
    head = next(ln for ln in printed.out.splitlines() if ln.split()[:1] == ["slide_id"])
    assert "prob_a" in head.split() and "prob_b" in head.split()
    assert "Predicted 2 slide(s)" in printed.out
