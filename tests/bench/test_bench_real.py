"""bench-real's tables: the fold table against scikit-learn per fold, the instance truth of both
constructions against hand-placed nuclei, and the dataset config that changes only four keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import accuracy_score, roc_auc_score

from wsi_pipeline.bench.real import DATASET_KEYS, dataset_config, fold_table, instance_truth

ROOT = Path(__file__).resolve().parents[2]


def test_fold_table_matches_per_fold_sklearn_and_the_pooled_auc() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for r in range(2):
        for k in range(3):
            for i in range(8):
                label = int(i % 2)
                rows.append({"slide_id": f"s{k}_{i}", "repeat": r, "fold": k, "method": "m", "label": label,
                             "prob": float(np.clip(0.3 * label + rng.uniform(0, 0.7), 0, 1))})
    oof = pd.DataFrame(rows)
    got = fold_table(oof).iloc[0]
    aucs, accs = [], []
    for (_, _), f in oof.groupby(["repeat", "fold"]):
        aucs.append(roc_auc_score(f["label"], f["prob"]))
        accs.append(accuracy_score(f["label"], f["prob"] >= 0.5))
    assert got["n_folds"] == 6 and got["n_slides"] == 24
    assert got["auc"] == pytest.approx(np.mean(aucs)) and got["accuracy"] == pytest.approx(np.mean(accs))
    assert got["auc_se"] == pytest.approx(np.std(aucs, ddof=1) / np.sqrt(6))
    pooled = np.mean([roc_auc_score(d["label"], d["prob"]) for _, d in oof.groupby("repeat")])
    assert got["pooled_auc"] == pytest.approx(pooled)


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
