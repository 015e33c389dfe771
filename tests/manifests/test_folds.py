"""Cross-validation over a manifest's folds: `train --folds`, `eval --folds`, one pooled report.

The pooled values are checked against numpy applied to each fold's own ``metrics.json``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from wsi_pipeline.cli.main import main
from wsi_pipeline.manifests.assign import assign_splits, fold_manifests
from wsi_pipeline.manifests.folds import fold_manifest_path, fold_numbers
from wsi_pipeline.manifests.schema import read_manifest, write_manifest


def _fold_cohort(tmp, n_folds=2):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    df = read_manifest(make_store_cohort(tmp / "data", n_slides=12, tiles_per_slide=(10, 14), seed=3))
    df["split"] = ""
    df = assign_splits(df, {"train": 0.75, "test": 0.25}, seed=0, folds=n_folds)
    manifest = write_manifest(df, tmp / "data" / "cv.csv")
    for k, fold_df in enumerate(fold_manifests(df)):
        write_manifest(fold_df, fold_manifest_path(manifest, k))
    return manifest, df


def test_fold_numbers_and_their_errors(tmp_path):
    manifest, df = _fold_cohort(tmp_path)
    assert fold_numbers(manifest) == sorted(int(f) for f in set(df["fold"]) if int(f) >= 0) == [0, 1]
    fold_manifest_path(manifest, 1).unlink()
    with pytest.raises(FileNotFoundError, match=r"cv_fold1\.csv.*--folds K"):
        fold_numbers(manifest)
    plain = write_manifest(df.drop(columns=["fold"]), tmp_path / "plain.csv")
    with pytest.raises(ValueError, match=r"plain\.csv: no 'fold' column"):
        fold_numbers(plain)


@pytest.mark.slow
def test_train_and_eval_over_folds_pool_mean_and_std(tmp_path, capsys):
    manifest, df = _fold_cohort(tmp_path)
    raw = {
        "name": "cv",
        "data": {"manifest": str(manifest), "tiles_dir": str(tmp_path / "data" / "tiles"), "n_classes": 2},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2},
        "eval": {"val_protocol": "all", "protocols": ["all"], "seed": 0},
        "seeds": [0],
        "methods": [{"name": "abmil_full", "strategy": "full", "encoder": {"name": "resnet18"},
                     "aggregator": {"name": "abmil"}, "chunk_size": 16}],
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    }
    cfg = tmp_path / "cv.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg), "--folds", "--no-progress"]) == 0
    for k in (0, 1):
        run = tmp_path / "runs" / f"cv_fold{k}" / "abmil_full" / "seed0"
        assert (run / "done").is_file()
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["data"]["manifest"].endswith(f"cv_fold{k}.csv")
    assert main(["eval", "--config", str(cfg), "--folds", "--no-progress", "--no-heatmaps", "--bootstrap", "0"]) == 0
    out = tmp_path / "results" / "cv_cv"
    assert "mean ± std across 2 folds" in capsys.readouterr().out.lower()

    def seed_mean(k, metric):
        recs = json.loads((tmp_path / "results" / f"cv_fold{k}" / "metrics.json").read_text())["records"]
        return {(r["method"], r["cohort"], r["protocol"]): r["value"] for r in recs
                if r["seed"] == "mean" and r["metric"] == metric and "repeat" not in r}

    pooled = json.loads((out / "metrics_folds.json").read_text())["records"]
    compared = 0
    for metric in ("auc", "accuracy"):
        per_fold = [seed_mean(k, metric) for k in (0, 1)]
        assert per_fold[0].keys() == per_fold[1].keys() and per_fold[0]
        for key in per_fold[0]:
            values = np.array([np.nan if f[key] is None else f[key] for f in per_fold], dtype=float)
            got = {r["seed"]: r["value"] for r in pooled
                   if (r["method"], r["cohort"], r["protocol"]) == key and r["metric"] == metric}
            assert [got[0], got[1]] == [per_fold[0][key], per_fold[1][key]]
            if np.isnan(values).any():
                continue
            assert math.isclose(got["mean"], values.mean(), rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(got["std"], values.std(ddof=1), rel_tol=1e-12, abs_tol=1e-15)
            compared += 1
    assert compared >= 2  # accuracy is defined on every fold
    table = pd.read_csv(out / "cv_table.csv", header=[0, 1, 2], index_col=0)
    assert list(table.index) == ["abmil_full"]
    report = (out / "report.html").read_text()
    assert "2-fold cross-validation" in report and "Per fold" in report
