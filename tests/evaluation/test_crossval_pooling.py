"""Pooling a cross-validation's out-of-fold predictions (evaluation.crossval), recomputed by hand.

The fold results are hand-written prediction CSVs in the schema `eval` writes (two seeds per fold,
an external test slide that is not an out-of-fold prediction); the pooled table is recomputed here
from those files with scikit-learn and numpy.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score, roc_auc_score

from wsi_pipeline.config.pipeline import config_from_dict
from wsi_pipeline.evaluation.crossval import OOF_COLUMNS, pool_crossval
from wsi_pipeline.export.predictions import endpoint_columns, endpoint_row, predictions_path, write_predictions
from wsi_pipeline.manifests.crossval import assign_crossval, crossval_manifest_path, crossval_manifests
from wsi_pipeline.manifests.folds import fold_config, fold_runs
from wsi_pipeline.manifests.schema import write_manifest

METHODS = ("abmil_frozen", "transmil_frozen")
SEEDS = (0, 1)


def _manifest(tmp, task: str, folds: int, repeats: int):
    rng = np.random.default_rng(4)
    rows = []
    for p in range(26):
        label = int(rng.random() < 0.4)
        for s in range(int(rng.integers(1, 3))):
            rows.append({"slide_id": f"p{p:02d}_{s}", "path": f"/x/p{p:02d}_{s}.svs", "label": label, "split": "",
                         "cohort": "mine", "patient_id": f"P{p:02d}"})
    rows.append({"slide_id": "ext0", "path": "/x/ext0.svs", "label": 1, "split": "test", "cohort": "ext", "patient_id": "E"})
    df = pd.DataFrame(rows)
    if task == "regression":
        df["target"] = df["label"] * 2.0 + rng.normal(0, 0.5, len(df)).round(3)
        df["target"] = df.groupby("patient_id")["target"].transform("first")
        df["label"] = pd.NA
    if task == "survival":
        df["time"] = df.groupby("patient_id")["label"].transform(lambda v: float(rng.uniform(1, 60)))
        df["event"] = df["label"]  # about 40 % events
        df["label"] = pd.NA
    df = assign_crossval(df, folds, repeats=repeats, seed=2)
    m = tmp / "m.csv"
    for r, k, fold_df in crossval_manifests(df):
        write_manifest(fold_df, crossval_manifest_path(m, k, r, repeats))
    write_manifest(df, m)
    return m, df


def _config(tmp, manifest, task: str):
    methods = [{"name": name, "strategy": "frozen", "encoder": {"name": "resnet18"},
                "aggregator": {"name": name.split("_")[0]}} for name in METHODS]
    if task != "classification":
        for m in methods:
            m["task"] = task
    return config_from_dict({
        "name": "cv", "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "tiles"),
                               "n_classes": 2 if task == "classification" else None},
        "eval": {"protocols": ["all"], "seed": 0, "bootstrap": 100}, "seeds": list(SEEDS), "methods": methods,
        "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results"),
    })


def _write_fold_results(config, runs, task: str, rng) -> None:
    """What `eval` writes for each fold: predictions of its test slides (and the external one), per method and seed."""
    for run in runs:
        cfg = fold_config(config, run)
        fold = pd.read_csv(cfg.data.manifest)
        test = fold[fold["split"] == "test"]
        rows = []
        for method in METHODS:
            for seed in SEEDS:
                for _, t in test.iterrows():
                    if task == "classification":
                        # informative but noisy probabilities, different per seed and fold
                        p1 = float(np.clip(0.3 + 0.35 * t["label"] + rng.normal(0, 0.25), 0.01, 0.99))
                        rows.append(endpoint_row(task="classification", slide_id=t["slide_id"], cohort=t["cohort"],
                                                 target=t["label"], scores={"probs": np.array([[1 - p1, p1]])}, n_tiles=9,
                                                 protocol="all", n_repeats=1, method=method, seed=seed))
                    elif task == "survival":
                        risk = np.array([-t["time"] / 20 + rng.normal(0, 1)])
                        rows.append(endpoint_row(task="survival", slide_id=t["slide_id"], cohort=t["cohort"],
                                                 target=(t["time"], t["event"]), scores={"risk": risk}, n_tiles=9,
                                                 protocol="all", n_repeats=1, method=method, seed=seed))
                    else:
                        rows.append(endpoint_row(task="regression", slide_id=t["slide_id"], cohort=t["cohort"],
                                                 target=t["target"], scores={"prediction": np.array([t["target"] + rng.normal(0, 1)])},
                                                 n_tiles=9, protocol="all", n_repeats=1, method=method, seed=seed))
        cols = None if task == "classification" else endpoint_columns(task)
        for cohort in ("mine", "ext"):  # one file per cohort, as `eval` writes them
            write_predictions(predictions_path(f"{config.results_dir}/{cfg.name}", cohort, "all"),
                              [r for r in rows if r["cohort"] == cohort], 2, columns=cols)


def _by_hand(config, runs, task: str):
    """The out-of-fold rows rebuilt from the fold CSVs: seed mean of each test slide's value in its own fold."""
    out = []
    for run in runs:
        cfg = fold_config(config, run)
        fold = pd.read_csv(cfg.data.manifest)
        ids = set(fold.loc[fold[f"cv_fold_r{run.repeat}"] == run.fold, "slide_id"])
        pred = pd.read_csv(predictions_path(f"{config.results_dir}/{cfg.name}", "mine", "all"))
        pred = pred[pred["slide_id"].isin(ids)]
        value, target = {"classification": ("prob_1", "label"), "regression": ("prediction", "target"),
                         "survival": ("risk", "event")}[task]
        extra = {"time": ("time", "first")} if task == "survival" else {}
        g = pred.groupby(["method", "slide_id"]).agg(prob=(value, "mean"), label=(target, "first"), **extra).reset_index()
        out.append(g.assign(repeat=run.repeat, fold=run.fold))
    return pd.concat(out, ignore_index=True)


@pytest.mark.parametrize("repeats", [1, 2])
def test_pooled_table_equals_sklearn_on_the_fold_predictions(tmp_path, repeats):
    manifest, df = _manifest(tmp_path, "classification", folds=3, repeats=repeats)
    config = _config(tmp_path, manifest, "classification")
    runs = fold_runs(manifest)
    assert len(runs) == 3 * repeats
    _write_fold_results(config, runs, "classification", np.random.default_rng(0))
    out = pool_crossval(config, runs)
    assert out == tmp_path / "results" / "cv_cv"

    oof = pd.read_csv(out / "oof_predictions.csv")
    assert tuple(oof.columns) == OOF_COLUMNS
    n_cv = int((df["cv_fold_r0"] >= 0).sum())
    assert n_cv == len(df) - 1 and "ext0" not in set(oof["slide_id"])  # the external test slide is not out-of-fold
    assert len(oof) == n_cv * len(METHODS) * repeats
    assert not oof.duplicated(["slide_id", "repeat", "method"]).any()
    hand = _by_hand(config, runs, "classification")
    merged = oof.merge(hand, on=["slide_id", "repeat", "fold", "method"], suffixes=("", "_hand"), validate="1:1")
    assert len(merged) == len(oof)
    np.testing.assert_allclose(merged["prob"], merged["prob_hand"], rtol=0, atol=1e-12)
    assert (merged["label"] == merged["label_hand"]).all()

    table = pd.read_csv(out / "cv_table.csv").set_index(["method", "metric"])
    fns = {"accuracy": lambda y, p: accuracy_score(y, p > 0.5), "precision": lambda y, p: precision_score(y, p > 0.5, zero_division=0),
           "recall": lambda y, p: recall_score(y, p > 0.5), "f1": lambda y, p: f1_score(y, p > 0.5),
           "auc": roc_auc_score}
    for method in METHODS:
        h = hand[hand["method"] == method]
        for metric, fn in fns.items():
            per_fold = {(r, k): fn(s["label"], s["prob"]) for (r, k), s in h.groupby(["repeat", "fold"])}
            per_repeat = np.array([np.mean([v for (r, _), v in per_fold.items() if r == rr]) for rr in range(repeats)])
            sd_folds = np.mean([np.std([v for (r, _), v in per_fold.items() if r == rr], ddof=1) for rr in range(repeats)])
            if repeats > 1:
                se = per_repeat.std(ddof=1) / math.sqrt(repeats)
            else:
                se = np.std(list(per_fold.values()), ddof=1) / math.sqrt(len(per_fold))
            row = table.loc[(method, metric)]
            assert row["mean"] == pytest.approx(per_repeat.mean(), abs=1e-12)
            assert row["se"] == pytest.approx(se, abs=1e-12)
            assert row["sd_folds"] == pytest.approx(sd_folds, abs=1e-12)
            assert row["pooled"] == pytest.approx(fn(h["label"], h["prob"]), abs=1e-12)
            assert row["n_repeats"] == repeats and row["n_folds"] == 3 and row["n_slides"] == n_cv
        auc = table.loc[(method, "auc")]
        assert auc["ci_low"] < auc["pooled"] < auc["ci_high"]
    report = (out / "report.html").read_text()
    assert "3-fold cross-validation × " + str(repeats) in report and "<svg" in report


def test_regression_out_of_fold_predictions_and_rmse(tmp_path):
    manifest, df = _manifest(tmp_path, "regression", folds=4, repeats=1)
    config = _config(tmp_path, manifest, "regression")
    runs = fold_runs(manifest)
    _write_fold_results(config, runs, "regression", np.random.default_rng(1))
    out = pool_crossval(config, runs, n_boot=0)
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert tuple(oof.columns) == OOF_COLUMNS and len(oof) == (len(df) - 1) * len(METHODS)
    hand = _by_hand(config, runs, "regression")
    table = pd.read_csv(out / "cv_table.csv").set_index(["method", "metric"])
    for method in METHODS:
        h = hand[hand["method"] == method]
        per_fold = [math.sqrt(np.mean((s["label"] - s["prob"]) ** 2)) for _, s in h.groupby("fold")]
        assert table.loc[(method, "rmse"), "mean"] == pytest.approx(np.mean(per_fold), abs=1e-12)
        assert table.loc[(method, "rmse"), "pooled"] == pytest.approx(math.sqrt(np.mean((h["label"] - h["prob"]) ** 2)), abs=1e-12)
        assert math.isnan(table.loc[(method, "rmse"), "ci_low"])  # n_boot=0: no interval


def test_a_method_missing_from_a_fold_is_left_out_and_named(tmp_path, caplog):
    manifest, df = _manifest(tmp_path, "classification", folds=3, repeats=1)
    config = _config(tmp_path, manifest, "classification")
    runs = fold_runs(manifest)
    _write_fold_results(config, runs, "classification", np.random.default_rng(0))
    path = predictions_path(f"{config.results_dir}/{fold_config(config, runs[1]).name}", "mine", "all")
    pred = pd.read_csv(path)
    pred[pred["method"] != METHODS[1]].to_csv(path, index=False)  # fold 1 evaluated for the first method only
    with caplog.at_level("WARNING", logger="wsi_pipeline.evaluation.crossval"):
        out = pool_crossval(config, runs, n_boot=0)
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert set(oof["method"]) == {METHODS[0]} and len(oof) == len(df) - 1  # every slide once, out of fold
    assert METHODS[1] in caplog.text and "not evaluated on every fold" in caplog.text
    assert set(pd.read_csv(out / "cv_table.csv")["method"]) == {METHODS[0]}


def test_a_fold_without_results_is_named(tmp_path):
    manifest, _ = _manifest(tmp_path, "classification", folds=3, repeats=1)
    config = _config(tmp_path, manifest, "classification")
    with pytest.raises(FileNotFoundError, match=r"cv_fold0.*repeat 0 fold 0.*eval --config"):
        pool_crossval(config, fold_runs(manifest))


def _harrell(time, event, risk) -> float:
    """Harrell's C by its definition: pairs where i has the event before j's time; ties in risk count 1/2."""
    num = den = 0.0
    for i in range(len(time)):
        for j in range(len(time)):
            if event[i] and (time[j] > time[i]):
                den += 1
                num += 1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0
    return num / den


def test_survival_out_of_fold_risks_and_c_index(tmp_path):
    manifest, df = _manifest(tmp_path, "survival", folds=3, repeats=1)
    config = _config(tmp_path, manifest, "survival")
    runs = fold_runs(manifest)
    _write_fold_results(config, runs, "survival", np.random.default_rng(2))
    out = pool_crossval(config, runs, n_boot=0)
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert tuple(oof.columns) == (*OOF_COLUMNS, "time") and len(oof) == (len(df) - 1) * len(METHODS)
    hand = _by_hand(config, runs, "survival")
    table = pd.read_csv(out / "cv_table.csv").set_index(["method", "metric"])
    for method in METHODS:
        h = hand[hand["method"] == method]
        per_fold = [_harrell(s["time"].to_numpy(), s["label"].to_numpy(), s["prob"].to_numpy()) for _, s in h.groupby("fold")]
        assert table.loc[(method, "c_index"), "mean"] == pytest.approx(np.mean(per_fold), abs=1e-12)
        pooled = _harrell(h["time"].to_numpy(), h["label"].to_numpy(), h["prob"].to_numpy())
        assert table.loc[(method, "c_index"), "pooled"] == pytest.approx(pooled, abs=1e-12)


def test_three_classes_macro_metrics_and_the_extra_columns(tmp_path):
    rng = np.random.default_rng(5)
    df = pd.DataFrame({"slide_id": [f"s{i:02d}" for i in range(30)], "path": "/x", "label": np.arange(30) % 3,
                       "split": "", "cohort": "mine"})
    df = assign_crossval(df, 3, seed=0)
    m = tmp_path / "m.csv"
    for r, k, fold_df in crossval_manifests(df):
        write_manifest(fold_df, crossval_manifest_path(m, k, r, 1))
    write_manifest(df, m)
    base = _config(tmp_path, m, "classification")
    config = dataclasses.replace(base, data=dataclasses.replace(base.data, n_classes=3))
    runs = fold_runs(m)
    for run in runs:
        cfg = fold_config(config, run)
        fold = pd.read_csv(cfg.data.manifest)
        rows = []
        for method in METHODS:
            for seed in SEEDS:
                for _, t in fold[fold["split"] == "test"].iterrows():
                    logits = rng.normal(0, 1, 3)
                    logits[int(t["label"])] += 1.0
                    p = np.exp(logits) / np.exp(logits).sum()
                    rows.append(endpoint_row(task="classification", slide_id=t["slide_id"], cohort="mine", target=t["label"],
                                             scores={"probs": p[None]}, n_tiles=9, protocol="all", n_repeats=1,
                                             method=method, seed=seed))
        write_predictions(predictions_path(f"{config.results_dir}/{cfg.name}", "mine", "all"), rows, 3)
    out = pool_crossval(config, runs, n_boot=0)
    oof = pd.read_csv(out / "oof_predictions.csv")
    assert tuple(oof.columns) == (*OOF_COLUMNS, "pred", "prob_0", "prob_1", "prob_2") and len(oof) == 30 * len(METHODS)
    probs = oof[["prob_0", "prob_1", "prob_2"]].to_numpy()
    np.testing.assert_allclose(oof["prob"], probs[np.arange(len(oof)), oof["pred"]], rtol=0, atol=1e-12)
    table = pd.read_csv(out / "cv_table.csv").set_index(["method", "metric"])
    for method in METHODS:
        h = oof[oof["method"] == method]
        pred = h[["prob_0", "prob_1", "prob_2"]].to_numpy().argmax(1)
        assert table.loc[(method, "f1"), "pooled"] == pytest.approx(f1_score(h["label"], pred, average="macro"), abs=1e-12)
        assert table.loc[(method, "accuracy"), "pooled"] == pytest.approx(accuracy_score(h["label"], pred), abs=1e-12)
        assert table.loc[(method, "auc"), "pooled"] == pytest.approx(
            roc_auc_score(h["label"], h[["prob_0", "prob_1", "prob_2"]].to_numpy(), multi_class="ovr"), abs=1e-9)
