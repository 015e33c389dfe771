"""A folder of PNG images with point annotations through manifest folder -> tile --points -> train -> eval
-> predict: point stores train (frozen and end to end) and evaluate, their heatmap files place each tile
at its point, and predict reads a folder of new PNG images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image


def _image_with_nuclei(rng: np.random.Generator, n: int, dark: bool) -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    img = np.full((72, 80, 3), 235, np.uint8)
    pts = []
    for _ in range(n):
        x, y = float(rng.uniform(0, 80)), float(rng.uniform(0, 72))
        cls = "epithelial" if dark and rng.random() < 0.5 else "fibroblast"
        colour = (60, 20, 120) if cls == "epithelial" else (200, 120, 180)
        yy, xx = np.ogrid[:72, :80]
        img[(xx - x) ** 2 + (yy - y) ** 2 <= 9] = colour
        pts.append((x, y, cls))
    return img, pts


SPLITS = ["train"] * 4 + ["val", "val", "test", "test"]


@pytest.mark.slow
def test_point_stores_train_and_evaluate(tmp_path: Path, monkeypatch) -> None:
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.data.store import open_store

    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    labels, points = [], []
    for i in range(8):
        label = i % 2
        img, pts = _image_with_nuclei(rng, 6, dark=bool(label))
        Image.fromarray(img).save(tmp_path / "images" / f"im{i}.png", dpi=(72, 72))
        labels.append({"slide_id": f"im{i}", "label": label, "mpp": 0.5, "split": SPLITS[i]})
        points += [{"image": f"im{i}", "class": c, "x": x, "y": y} for x, y, c in pts]
    pd.DataFrame(labels).to_csv(tmp_path / "labels.csv", index=False)
    pd.DataFrame(points).to_csv(tmp_path / "nuclei.csv", index=False)
    assert main(["manifest", "folder", "--slides", str(tmp_path / "images"), "--labels", str(tmp_path / "labels.csv"),
                 "--out", str(tmp_path / "m.csv")]) == 0
    assert main(["tile", "--manifest", str(tmp_path / "m.csv"), "--out", str(tmp_path / "tiles"), "--points",
                 str(tmp_path / "nuclei.csv"), "--tile-size", "27", "--workers", "0", "--qc", "off"]) == 0
    st = open_store(tmp_path / "tiles" / "im1.zarr")
    assert len(st) == 6 and st.attrs["mpp_source"] == "manifest" and st.attrs["metadata_mpp_source"] == "ignored-dpi:72"
    raw = {
        "name": "pts", "seeds": [0], "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results"),
        "data": {"manifest": str(tmp_path / "m.csv"), "tiles_dir": str(tmp_path / "tiles"), "features_dir": str(tmp_path / "f"),
                 "n_classes": 2, "tiling": {"tile_size": 27}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2, "lr": 1e-4},
        "eval": {"protocols": ["all"], "bootstrap": 0},
        "methods": [{"name": "e2e", "strategy": "full", "chunk_size": 16, "encoder": {"bn": "frozen"}},
                    {"name": "fz", "strategy": "frozen", "chunk_size": 16}],
    }
    (tmp_path / "pts.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(tmp_path / "pts.yaml"), "--device", "cpu"]) == 0
    assert main(["eval", "--config", str(tmp_path / "pts.yaml"), "--device", "cpu"]) == 0
    results = tmp_path / "results" / "pts"
    preds = list(results.glob("predictions_*.csv"))
    assert preds and all(np.isfinite(pd.read_csv(p)["prob_1"]).all() for p in preds)
    scores = sorted(results.rglob("im6_scores.csv"))
    assert scores, sorted(str(p) for p in results.rglob("*"))
    df = pd.read_csv(scores[0])
    test_store = open_store(tmp_path / "tiles" / "im6.zarr")
    assert len(df) == len(test_store)  # one row per point tile, in store order
    np.testing.assert_array_equal(df[["x", "y"]].to_numpy(), test_store.coords)  # centred on the points
    np.testing.assert_array_equal(df[["col", "row"]].to_numpy(), test_store.grid)
    np.testing.assert_array_equal(test_store.coords + 13, np.floor(test_store.array("point_xy")).astype(np.int64))
    # predict reads a folder of new images (no points: the model's 27 px tiles on the grid)
    (tmp_path / "new").mkdir()
    for i in (6, 7):  # tissue all over (the grid's tissue rule keeps whole tiles of it)
        Image.fromarray(rng.integers(60, 200, (72, 80, 3), dtype=np.uint8)).save(tmp_path / "new" / f"new{i}.png")
    assert main(["predict", "--model", str(tmp_path / "runs" / "pts" / "fz" / "seed0"), "--slides", str(tmp_path / "new"),
                 "--out", str(tmp_path / "pred"), "--device", "cpu", "--no-heatmaps"]) == 0
    pred = pd.read_csv(tmp_path / "pred" / "predictions.csv")
    assert sorted(pred["slide_id"]) == ["new6", "new7"] and np.isfinite(pred["prob_1"]).all()
    new6 = open_store(tmp_path / "pred" / "tiles" / "new6.zarr")
    assert new6.attrs["tile_size"] == 27 and len(new6) == (72 // 27) * (80 // 27)
