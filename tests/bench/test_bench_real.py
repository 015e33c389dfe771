"""bench-real's tables: the fold table against scikit-learn per fold, the instance truth of both
constructions against hand-placed nuclei, the dataset config that changes only four keys, each seed's
pooled out-of-fold AUC against scikit-learn on the test slides alone, and the seed ensemble's accuracy before
calibration against the models' own probabilities."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import accuracy_score, roc_auc_score

from benchmarks.real import DATASET_KEYS, dataset_config, instance_truth, method_table, seed_aucs, uncalibrated_accuracy

ROOT = Path(__file__).resolve().parents[2]


def test_method_table_reads_the_crossval_table_per_method() -> None:
    from wsi_pipeline.evaluation.crossval import cv_table

    rng = np.random.default_rng(0)
    rows = []
    for method in ("a", "b"):
        for k in range(3):
            for i in range(8):
                label = int(i % 2)
                rows.append({"slide_id": f"s{k}_{i}", "repeat": 0, "fold": k, "method": method, "label": label,
                             "prob": float(np.clip(0.3 * label + rng.uniform(0, 0.7), 0, 1))})
    oof = pd.DataFrame(rows)
    got = method_table(cv_table(oof, "classification", 2, n_boot=50)).set_index("method")
    for method, d in oof.groupby("method"):
        aucs = [roc_auc_score(f["label"], f["prob"]) for _, f in d.groupby("fold")]
        accs = [accuracy_score(f["label"], f["prob"] >= 0.5) for _, f in d.groupby("fold")]
        assert got.loc[method, "auc"] == pytest.approx(np.mean(aucs))
        assert got.loc[method, "accuracy"] == pytest.approx(np.mean(accs))
        assert got.loc[method, "auc_se"] == pytest.approx(np.std(aucs, ddof=1) / np.sqrt(3))
        assert got.loc[method, "pooled_auc"] == pytest.approx(roc_auc_score(d["label"], d["prob"]))
        lo, hi = got.loc[method, "pooled_auc_ci"]
        assert lo <= got.loc[method, "pooled_auc"] <= hi
        assert got.loc[method, "n_folds"] == 3


def test_instance_truth_of_points_and_grid_tiles() -> None:
    nuclei = pd.DataFrame({"x": [20.4, 50.0, 90.0], "y": [30.6, 10.0, 90.0],
                           "class": ["epithelial", "fibroblast", "epithelial"]})
    # points: 27 px patches centred on the rounded nucleus centres (top-left = round(c) - 13)
    coords = np.array([[round(x) - 13, round(y) - 13] for x, y in zip(nuclei["x"], nuclei["y"])])
    assert instance_truth(coords, 27, nuclei, "points").tolist() == [True, False, True]
    # grid: 32 px tiles; an epithelial centre inside [x0, x0 + 32) x [y0, y0 + 32)
    grid = np.array([[0, 0], [32, 0], [64, 64], [0, 32], [32, 32]])
    assert instance_truth(grid, 32, nuclei, "grid").tolist() == [True, False, True, False, False]


@pytest.mark.parametrize("template", ["pipelines/ilse_colon.yaml", "pipelines/ilse_colon_grid.yaml"])
def test_dataset_config_changes_only_the_four_keys(tmp_path, template) -> None:
    out = dataset_config(ROOT / template, tmp_path / "c.yaml", tmp_path / "d", "other")
    a, b = yaml.safe_load((ROOT / template).read_text()), yaml.safe_load(out.read_text())
    assert b["name"] == "other" and b["data"]["manifest"] == str(tmp_path / "d" / "manifest.csv")
    for key in DATASET_KEYS:
        node_a, node_b = a, b
        *parents, leaf = key.split(".")
        for p in parents:
            node_a, node_b = node_a[p], node_b[p]
        node_a.pop(leaf)
        node_b.pop(leaf)
    assert a == b


def test_the_constructions_run_under_their_templates_names() -> None:
    """The acceptance checks read ``<work>/**/results/ilse_colon_cv/oof_predictions.csv`` (design.md)."""
    import yaml

    from benchmarks.real import CONSTRUCTIONS, pipeline_name

    assert pipeline_name("points") == "ilse_colon" and pipeline_name("grid") == "ilse_colon_grid"
    for construction, (template, _) in CONSTRUCTIONS.items():
        assert pipeline_name(construction) == yaml.safe_load(Path(template).read_text())["name"]


def _fake_cli(tmp_path: Path, codes: list[int]) -> Path:
    """An executable standing in for ``python``: its n-th call (counted under a lock in the working
    folder) exits with ``codes[n]`` (the last code for later calls), after writing its arguments there."""
    import sys

    script = tmp_path / "fake_python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import fcntl, sys, time\n"
        "with open('calls', 'a+') as fh:\n"
        "    fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "    fh.seek(0)\n"
        "    n = len(fh.read().splitlines())\n"
        "    fh.write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"codes = {codes!r}\n"
        "time.sleep(0.2 * (n == 0))\n"
        "sys.exit(codes[min(n, len(codes) - 1)])\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("processes", "codes", "calls", "fails"),
    [
        (2, [0, 0], 2, False),  # both copies finish: no further pass
        (2, [0, 1, 0], 3, False),  # a copy ended on a run the other held: one more pass settles it
        (2, [0, 1, 1], 3, True),  # the further pass fails too: the bench fails, naming the log
        (1, [1, 0], 1, True),  # one process: its failure is the result, never retried
    ],
)
def test_run_cli_settles_runs_held_by_another_copy(tmp_path, monkeypatch, processes, codes, calls, fails) -> None:
    import sys

    from benchmarks.real import run_cli

    monkeypatch.setattr(sys, "executable", str(_fake_cli(tmp_path, codes)))
    log = tmp_path / "commands.log"
    if fails:
        with pytest.raises(RuntimeError, match="commands.log"):
            run_cli(["train", "--folds"], tmp_path, log, processes=processes)
    else:
        times = run_cli(["train", "--folds"], tmp_path, log, processes=processes)
        assert times["wall_s"] >= 0.2 and times["cpu_s"] >= 0.0
    lines = (tmp_path / "calls").read_text().splitlines()
    assert len(lines) == calls and set(lines) == {"-m wsi_pipeline.cli.main train --folds"}
    assert ("once more in one process" in log.read_text()) == (calls > processes)


def test_seed_aucs_pool_each_seed_over_the_folds_test_slides(tmp_path: Path) -> None:
    """Two folds, two methods, three seeds: each seed's AUC over the test slides of both folds; the fold files'
    rows of slides outside the fold's test split (as a fold evaluates its own cohort) are left out."""
    rng = np.random.default_rng(4)
    ids = [f"s{i:02d}" for i in range(16)]
    labels = np.array([0, 1] * 8)
    fold = np.array([0] * 8 + [1] * 8)
    base = {"slide_id": ids, "path": [f"{i}.png" for i in ids], "label": labels, "cohort": "images", "cv_fold_r0": fold}
    pd.DataFrame(base).to_csv(tmp_path / "manifest.csv", index=False)
    (tmp_path / "xv.yaml").write_text(yaml.safe_dump({
        "name": "xv", "data": {"manifest": str(tmp_path / "manifest.csv"), "tiles_dir": str(tmp_path / "tiles"), "n_classes": 2},
        "methods": [{"name": "attention", "strategy": "full", "encoder": {"name": "ilse_cnn"}, "aggregator": {"name": "abmil"}}]}))
    probs = {}
    for k in (0, 1):
        split = np.where(fold == k, "test", np.where(np.arange(16) % 3 == 0, "val", "train"))
        pd.DataFrame({**base, "split": split}).to_csv(tmp_path / f"manifest_fold{k}.csv", index=False)
        rows = []
        for method in ("attention", "mean"):
            for seed in (0, 1, 2):
                p = rng.random(16)
                for i in range(16):  # every slide written; only the fold's test slides count
                    rows.append({"slide_id": ids[i], "label": labels[i], "prob_1": p[i], "method": method, "seed": seed})
                    if fold[i] == k:
                        probs[(method, seed, i)] = p[i]
        out = tmp_path / "results" / f"xv_fold{k}"
        out.mkdir(parents=True)
        pd.DataFrame(rows).to_csv(out / "predictions_images_all.csv", index=False)
    got = seed_aucs(tmp_path, "xv").set_index("method")
    for method in ("attention", "mean"):
        want = [roc_auc_score(labels, [probs[(method, seed, i)] for i in range(16)]) for seed in (0, 1, 2)]
        assert got.loc[method, "pooled_auc_by_seed"] == pytest.approx(want, abs=1e-12)
        assert got.loc[method, "pooled_auc_seed_mean"] == pytest.approx(np.mean(want), abs=1e-12)
    # a fold file without per-class probabilities (not a binary task) gives no row
    for k in (0, 1):
        f = tmp_path / "results" / f"xv_fold{k}" / "predictions_images_all.csv"
        pd.read_csv(f).drop(columns="prob_1").to_csv(f, index=False)
    assert seed_aucs(tmp_path, "xv").empty


def test_uncalibrated_accuracy_maps_each_seed_back_through_its_own_calibration(tmp_path: Path) -> None:
    """Each seed's calibrated probability goes back through its own run's Platt map (one run has none: the
    identity); the seeds' own probabilities are averaged per slide and thresholded at 0.5, per fold."""
    import json

    rng = np.random.default_rng(7)
    n = 20
    ids = [f"s{i:02d}" for i in range(n)]
    labels = np.array([0, 1] * (n // 2))
    fold = np.array([0] * (n // 2) + [1] * (n // 2))
    base = {"slide_id": ids, "path": [f"{i}.png" for i in ids], "label": labels, "cohort": "images", "cv_fold_r0": fold}
    pd.DataFrame(base).to_csv(tmp_path / "manifest.csv", index=False)
    (tmp_path / "xv.yaml").write_text(yaml.safe_dump({
        "name": "xv", "data": {"manifest": str(tmp_path / "manifest.csv"), "tiles_dir": str(tmp_path / "tiles"), "n_classes": 2},
        "methods": [{"name": "attention", "strategy": "full", "encoder": {"name": "ilse_cnn"}, "aggregator": {"name": "abmil"}}]}))
    want: dict[str, list[float]] = {"attention": [], "mean": []}
    for k in (0, 1):
        split = np.where(fold == k, "test", "train")
        pd.DataFrame({**base, "split": split}).to_csv(tmp_path / f"manifest_fold{k}.csv", index=False)
        rows = []
        for method in ("attention", "mean"):
            # the models' own probabilities, near 0.5 as a short run's are (their map stretches them), with each
            # slide's seed mean at least 0.01 from 0.5 so that the predictions' rounding to 1e-5 cannot flip it
            own = 0.5 + rng.uniform(-0.08, 0.08, (3, n))
            while np.any(np.abs(own.mean(0) - 0.5) < 0.01):
                own = 0.5 + rng.uniform(-0.08, 0.08, (3, n))
            for seed in (0, 1, 2):
                q = own[seed]
                a, b = (1.0, 0.0) if (k, method, seed) == (1, "mean", 2) else (rng.uniform(3, 40), rng.uniform(-6, 6))
                if (a, b) != (1.0, 0.0):
                    run = tmp_path / "runs" / f"xv_fold{k}" / method / f"seed{seed}"
                    run.mkdir(parents=True)
                    (run / "calibration.json").write_text(json.dumps({"method": "platt", "scale": a, "shift": b}))
                cal = 1.0 / (1.0 + np.exp(-(a * np.log(q / (1 - q)) + b)))
                for i in range(n):
                    rows.append({"slide_id": ids[i], "label": labels[i], "prob_1": round(float(cal[i]), 5), "method": method,
                                 "seed": seed})
            test = fold == k
            want[method].append(float(np.mean((own[:, test].mean(0) >= 0.5) == (labels[test] == 1))))
        out = tmp_path / "results" / f"xv_fold{k}"
        out.mkdir(parents=True)
        pd.DataFrame(rows).to_csv(out / "predictions_images_all.csv", index=False)
    got = uncalibrated_accuracy(tmp_path, "xv").set_index("method")
    for method, accs in want.items():
        assert got.loc[method, "accuracy_uncalibrated"] == pytest.approx(np.mean(accs), abs=1e-12)
        assert got.loc[method, "accuracy_uncalibrated_se"] == pytest.approx(np.std(accs, ddof=1) / np.sqrt(2), abs=1e-12)
    assert len(set(want["attention"]) | set(want["mean"])) > 1  # the folds differ: the test sees the per-fold grouping
