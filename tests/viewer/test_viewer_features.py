"""The viewer on the predictions of a model of precomputed feature files (issue 52): no slide file, no tile store,
only ``heatmaps/<slide_id>_scores.csv``: a white canvas the size of the scored tiles, the attention drawn on it."""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pandas as pd
from conftest import serving
from PIL import Image

from wsi_pipeline.export.scores import tile_scores_frame, write_tile_scores
from wsi_pipeline.viewer import build_catalog
from wsi_pipeline.viewer.tiles import TILE, max_zoom


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def test_a_heatmap_without_slide_or_store_is_viewed_on_a_blank_canvas(tmp_path) -> None:
    pred = tmp_path / "pred"
    (pred / "heatmaps").mkdir(parents=True)
    coords = np.array([[c * 512, r * 512] for r in range(2) for c in range(3)], np.int64)  # TRIDENT-like level-0 px
    grid = coords // 512
    attention = np.linspace(0.1, 0.9, len(coords))
    write_tile_scores(pred / "heatmaps" / "f1_scores.csv", tile_scores_frame(coords, grid, 512.0, attention))
    pd.DataFrame([{"slide_id": "f1", "pred": 1, "prob_0": 0.3, "prob_1": 0.7}]).to_csv(pred / "predictions.csv", index=False)
    with serving(build_catalog(predictions=pred)) as server:
        info = json.loads(_get(server.url + "api/slide/f1"))
        assert "error" not in info, info
        assert tuple(info["dimensions"]) == (3 * 512, 2 * 512) and "heatmap" in info["overlays"]
        assert info["source"].startswith("heatmap only")
        zmax = max_zoom((3 * 512, 2 * 512))
        tile = np.asarray(Image.open(io.BytesIO(_get(server.url + f"tile/f1/{zmax}/0/0.jpg"))).convert("RGB"))
        assert tile.shape == (TILE, TILE, 3) and tile.min() > 240  # white: there are no pixels
        over = np.asarray(Image.open(io.BytesIO(_get(server.url + f"overlay/f1/heatmap/{zmax}/0/0.png"))))
        assert over[..., 3].max() > 0  # the attention of the first tile is drawn on it
