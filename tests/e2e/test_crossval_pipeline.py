"""Cross-validation end to end on a tiny synthetic store cohort: `manifest split --crossval 3` ->
`train --folds` -> `eval --folds`, then the pooled table recomputed from the folds' prediction files."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import accuracy_score, roc_auc_score

from wsi_pipeline.cli.main import main
from wsi_pipeline.evaluation.crossval import OOF_COLUMNS
from wsi_pipeline.manifests.schema import read_manifest

pytestmark = pytest.mark.slow


def test_crossval_manifest_train_eval_pools_out_of_fold_predictions(tmp_path, capsys):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    manifest = make_store_cohort(tmp_path / "data", n_slides=12, tile_size=16, tiles_per_slide=(6, 9), seed=1)
    cv = tmp_path / "data" / "cv.csv"
    assert main(["manifest", "split", "--manifest", str(manifest), "--crossval", "3", "--seed", "0", "--out", str(cv)]) == 0
    raw = {
        "name": "xv",
        "data": {"manifest": str(cv), "tiles_dir": str(tmp_path / "data" / "tiles"),
                 "features_dir": str(tmp_path / "features"), "n_classes": 2},
        "train": {"epochs": 2, "bag_size": 8, "batch_bags": 2},
        "eval": {"val_protocol": "all", "protocols": ["sub4x2"], "seed": 0, "bootstrap": 50},  # "all" is added for the OOF
        "seeds": [0],
        "methods": [{"name": "abmil_frozen", "strategy": "frozen", "encoder": {"name": "resnet18"},
                     "aggregator": {"name": "abmil"}, "chunk_size": 16}],
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    }
    cfg = tmp_path / "xv.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg), "--folds", "--no-progress", "--quiet"]) == 0
    for k in range(3):
        assert (tmp_path / "runs" / f"xv_fold{k}" / "abmil_frozen" / "seed0" / "done").is_file()
    args = ["eval", "--config", str(cfg), "--folds", "--no-progress", "--quiet", "--no-heatmaps"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0  # resumable: every fold is already evaluated
    assert capsys.readouterr().out.count("already evaluated") == 3

    out = tmp_path / "results" / "xv_cv"
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert tuple(oof.columns) == OOF_COLUMNS and len(oof) == 12  # one row per slide (one method, one repeat)
    assert sorted(oof["slide_id"]) == sorted(read_manifest(cv)["slide_id"])
    # by hand: each slide's all-tiles prediction in the fold that tests it
    main_df = read_manifest(cv).set_index("slide_id")
    per_fold = []
    for k in range(3):
        pred = pd.read_csv(tmp_path / "results" / f"xv_fold{k}" / "predictions_synthetic_all.csv")
        pred = pred[pred["slide_id"].map(main_df["cv_fold_r0"]) == k]
        assert len(pred) == int((main_df["cv_fold_r0"] == k).sum())
        per_fold.append(pred)
    hand = pd.concat(per_fold).set_index("slide_id")
    got = oof.set_index("slide_id")
    np.testing.assert_allclose(got.loc[hand.index, "prob"], hand["prob_1"], rtol=0, atol=1e-12)
    table = pd.read_csv(out / "cv_table.csv").set_index("metric")
    acc = [accuracy_score(p["label"], p["pred"]) for p in per_fold]
    assert table.loc["accuracy", "mean"] == pytest.approx(np.mean(acc), abs=1e-12)
    assert table.loc["accuracy", "se"] == pytest.approx(np.std(acc, ddof=1) / math.sqrt(3), abs=1e-12)
    assert table.loc["auc", "pooled"] == pytest.approx(roc_auc_score(hand["label"], hand["prob_1"]), abs=1e-12)
    assert "3-fold cross-validation" in (out / "report.html").read_text()
