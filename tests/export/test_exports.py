import json
import math
import tracemalloc

import cv2
import numpy as np
import pandas as pd
import pytest
import tifffile
from PIL import Image

from wsi_pipeline.export.geojson import write_geojson
from wsi_pipeline.export.heatmap import normalise_scores, render_heatmap
from wsi_pipeline.export.metrics_json import MetricRecord, read_metrics_json, summary_table, validate_records, write_metrics_json
from wsi_pipeline.export.predictions import endpoint_row, prediction_columns, predictions_path, read_predictions, write_predictions
from wsi_pipeline.export.slide_outputs import write_slide_outputs
from wsi_pipeline.export.thumbnail import StoreThumbnail, slide_thumbnail, thumbnail_shape
from wsi_pipeline.data.store import StoreWriter, open_store
from wsi_pipeline.synthetic.slides import make_slide


def _grid(cols, rows):
    return np.stack(np.meshgrid(np.arange(cols), np.arange(rows)), -1).reshape(-1, 2)


def test_predictions_csv_schema(tmp_path):
    rows = [
        # the task's row (Classification.prediction_row): two repeats averaging [0.2, 0.3, 0.5], sd 0.03 of class 2
        endpoint_row(task="classification", slide_id="a", cohort="c1", target=1,
                     scores={"probs": np.array([[0.2, 0.3, 0.47], [0.2, 0.3, 0.53]])}, n_tiles=40, protocol="sub8x5",
                     n_repeats=5, method="abmil", seed=0),
        endpoint_row(task="classification", slide_id="b", cohort="c1", target=None, scores={"probs": np.array([[0.6, 0.3, 0.1]])},
                     n_tiles=3, protocol="sub8x5", n_repeats=1, method="abmil", seed=0),
    ]
    path = write_predictions(predictions_path(tmp_path, "c1", "sub8x5"), rows, 3)
    assert path.name == "predictions_c1_sub8x5.csv"
    raw = pd.read_csv(path)
    assert list(raw.columns) == [
        "slide_id", "cohort", "label", "pred", "prob_0", "prob_1", "prob_2",
        "n_tiles", "protocol", "n_repeats", "prob_std", "method", "seed", "patient_id",
    ] == prediction_columns(3)
    df = read_predictions(path)
    assert df["pred"].tolist() == [2, 0]  # argmax of the probabilities
    assert df["label"].iloc[0] == 1 and pd.isna(df["label"].iloc[1])  # unlabelled slide: empty label
    assert df["prob_std"].tolist() == pytest.approx([0.03, 0.0])  # std of the predicted class
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write leaves no temp file


def test_metrics_json_schema_and_aggregates(tmp_path):
    recs = [MetricRecord("abmil", s, "c1", "test", "all", "auc", v) for s, v in enumerate([0.8, 0.9, 0.85])]
    recs.append(MetricRecord("abmil", 0, "c2", "external", "all", "auc", float("nan")))
    path = write_metrics_json(tmp_path / "metrics.json", recs)
    obj = json.loads(path.read_text())  # strict JSON: nan written as null
    assert set(obj) == {"records"}
    for r in obj["records"]:
        assert set(r) == {"method", "seed", "cohort", "split", "protocol", "metric", "value"}
    agg = {(r["seed"], r["cohort"]): r["value"] for r in obj["records"] if r["seed"] in ("mean", "std")}
    assert agg[("mean", "c1")] == pytest.approx(np.mean([0.8, 0.9, 0.85]))
    assert agg[("std", "c1")] == pytest.approx(np.std([0.8, 0.9, 0.85], ddof=1))
    assert agg[("mean", "c2")] is None and agg[("std", "c2")] is None
    back = read_metrics_json(path)
    assert len(back) == len(obj["records"]) and math.isnan(back[3].value)
    with pytest.raises(ValueError, match="record 0 must have exactly the keys"):
        validate_records({"records": [{"method": "x"}]})
    with pytest.raises(ValueError, match="seed must be an integer, 'mean' or 'std'"):
        validate_records({"records": [{**obj["records"][0], "seed": "best"}]})


def test_metrics_json_per_repeat_records(tmp_path):
    rng = np.random.default_rng(0)
    per = rng.uniform(0.5, 1.0, (2, 4))  # (seed, repeat) AUCs
    recs = []
    for seed in (0, 1):
        recs.append(MetricRecord("m", seed, "c", "test", "sub8x4", "auc", float(per[seed].mean())))
        recs.append(MetricRecord("m", seed, "c", "test", "sub8x4", "auc_repeat_std", float(per[seed].std(ddof=1))))
        recs += [MetricRecord("m", seed, "c", "test", "sub8x4", "auc", float(v), r) for r, v in enumerate(per[seed])]
    path = write_metrics_json(tmp_path / "metrics.json", recs)
    obj = json.loads(path.read_text())
    reps = [r for r in obj["records"] if "repeat" in r]
    assert sorted((r["seed"], r["repeat"]) for r in reps) == [(s, r) for s in (0, 1) for r in range(4)]
    # seed aggregates come from the per-seed repeat means only
    agg = {(r["seed"], r["metric"]): r["value"] for r in obj["records"] if r["seed"] in ("mean", "std")}
    assert agg[("mean", "auc")] == pytest.approx(per.mean(1).mean())
    assert agg[("std", "auc")] == pytest.approx(np.std(per.mean(1), ddof=1))
    assert len(agg) == 4  # auc and auc_repeat_std, mean and std
    back = read_metrics_json(path)
    assert [r.repeat for r in back if r.repeat is not None] == [r["repeat"] for r in reps]
    with pytest.raises(ValueError, match="repeat must be a non-negative integer"):
        validate_records({"records": [{**reps[0], "repeat": "first"}]})
    table = summary_table(back, ("auc", "auc_repeat_std"))
    m, s = per.mean(1).mean(), np.std(per.mean(1), ddof=1)
    assert table.loc["m", ("c", "sub8x4", "auc")] == f"{m:.3f} ± {s:.3f}"
    rs = per.std(1, ddof=1)
    assert table.loc["m", ("c", "sub8x4", "auc_repeat_std")] == f"{rs.mean():.3f} ± {np.std(rs, ddof=1):.3f}"


def test_geojson_one_closed_polygon_per_tile_in_level0(tmp_path):
    grid = _grid(4, 3)
    downsample, tile_size = 2.0, 256
    extent = tile_size * downsample
    coords = grid * int(extent) + np.array([100, 50])
    att = np.linspace(0, 1, len(grid))
    path = write_geojson(tmp_path / "s.geojson", coords, extent, {"attention": att, "prob_1": att * 0 + np.nan})
    obj = json.loads(path.read_text())
    assert obj["type"] == "FeatureCollection" and len(obj["features"]) == len(grid)
    for (x, y), a, f in zip(coords, att, obj["features"]):
        ring = f["geometry"]["coordinates"][0]
        assert f["geometry"]["type"] == "Polygon" and len(ring) == 5 and ring[0] == ring[-1]
        xs, ys = [p[0] for p in ring], [p[1] for p in ring]
        assert (min(xs), min(ys), max(xs), max(ys)) == (x, y, x + extent, y + extent)
        assert f["properties"]["objectType"] == "detection"
        assert f["properties"]["measurements"] == {"attention": pytest.approx(a)}  # nan dropped


def test_heatmap_size_and_planted_hot_tile():
    grid = _grid(6, 5)
    coords = grid * 64 + 32
    W, H = 6 * 64 + 64, 5 * 64 + 64
    h, w = thumbnail_shape((W, H), 400)
    thumb = np.full((h, w, 3), 230, np.uint8)
    scores = np.full(len(grid), 0.1)
    hot, cold = 7, 22
    scores[hot], scores[cold] = 5.0, -3.0
    img = render_heatmap(thumb, coords, 64, scores, level0_size=(W, H), mode="minmax", legend=False)
    assert img.shape == thumb.shape
    s = w / W

    def centre(i):
        x, y = coords[i] + 32
        return img[int(y * s), int(x * s)].astype(int)

    heat = lambda px: px[0] - px[2]  # red minus blue  # noqa: E731
    assert heat(centre(hot)) > heat(centre(cold)) + 100
    assert heat(centre(hot)) > heat(centre(0))
    np.testing.assert_array_equal(img[2, 2], thumb[2, 2])  # background (no tile) untouched
    # with the legend the image keeps the thumbnail's size
    assert render_heatmap(thumb, coords, 64, scores, level0_size=(W, H), title="t").shape == thumb.shape


def test_rank_normalisation():
    v, text = normalise_scores(np.array([3.0, 1.0, 2.0, 2.0]))
    assert v.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.5]) and "rank" in text
    with pytest.raises(ValueError, match="heatmap mode 'log' unknown"):
        normalise_scores(np.ones(3), "log")


def test_heatmap_of_100k_tiles_has_bounded_memory():
    cols, rows = 400, 250  # 100 000 tiles of 256 level-0 px: level 0 is 102 400 x 64 000 px
    coords = _grid(cols, rows) * 256
    W, H = cols * 256, rows * 256
    h, w = thumbnail_shape((W, H), 1024)
    thumb = np.full((h, w, 3), 240, np.uint8)
    scores = np.random.default_rng(0).random(len(coords))
    tracemalloc.start()
    try:
        img = render_heatmap(thumb, coords, 256, scores, level0_size=(W, H))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    level0_rgb = W * H * 3
    assert img.shape == (h, w, 3)
    assert peak < 100e6 and peak < level0_rgb / 100, f"peak {peak / 1e6:.1f} MB"


def _tifffile_level(path, level):
    """Level ``level`` decoded by tifffile alone (SVS layout: page 0, then pages 2, 3, ...)."""
    with tifffile.TiffFile(path) as tf:
        return tf.pages[0 if level == 0 else level + 1].asarray()


def test_slide_thumbnail_aligned_and_from_coarse_level(tmp_path, opener):
    path = make_slide(tmp_path / "s.svs", size=(1280, 1024), seed=3, n_lesions=1, mpp=0.5).path  # levels 1, 4, 16
    slide = opener(path)
    reads = []
    read_level = slide.read_level
    slide.read_level = lambda level, *a: reads.append(level) or read_level(level, *a)
    thumb, size = slide_thumbnail(slide, max_side=160)  # 8 level-0 px per thumbnail px
    assert size == (1280, 1024) and thumb.shape == (128, 160, 3)
    assert reads and set(reads) == {1}  # read from the coarsest level at least as fine (downsample 4)
    # independent reference: 2 x 2 block means of level 1 as tifffile decodes it (INTER_AREA rounds: 1 grey level)
    ref = _tifffile_level(path, 1).astype(np.float64).reshape(128, 2, 160, 2, 3).mean(axis=(1, 3))
    assert np.abs(thumb.astype(np.float64) - ref).max() <= 1.0
    # a slide smaller than the thumbnail is enlarged from level 0 (bilinear, as cv2 does it)
    big, _ = slide_thumbnail(slide, max_side=2560)
    l0 = _tifffile_level(path, 0)
    np.testing.assert_array_equal(big, cv2.resize(l0, (2560, 2048), interpolation=cv2.INTER_LINEAR))


def test_store_thumbnail_rebuilt_from_tiles(tmp_path):
    grid = _grid(3, 2)
    colours = np.array([[i * 40, 255 - i * 40, 100] for i in range(len(grid))], np.uint8)
    tiles = np.broadcast_to(colours[:, None, None, :], (len(grid), 16, 16, 3)).copy()
    w = StoreWriter(tmp_path / "s.zarr", tile_size=16, capacity=6, attrs={"slide_id": "s", "downsample": 2.0})
    w.append(tiles, grid * 32, grid, np.ones(len(grid)))
    store = open_store(w.commit())
    th = StoreThumbnail.from_store(store, max_side=96)
    assert th.level0_size == (96, 64) and th.image.shape == (64, 96, 3)
    for (c, r), col in zip(grid, colours):
        np.testing.assert_array_equal(th.image[r * 32 + 16, c * 32 + 16], col)


def test_slide_outputs_files(tmp_path):
    grid = _grid(5, 4)
    coords = grid * 32
    att = np.random.default_rng(0).random(len(grid))
    inst = np.random.default_rng(1).random((len(grid), 2))
    thumb = np.full((256, 320, 3), 250, np.uint8)
    out = write_slide_outputs(tmp_path / "heatmaps", "s1", thumbnail=thumb, level0_size=(160, 128), coords=coords,
                              grid=grid, tile_extent=32, attention=att, instance_scores=inst, title="attention")
    with Image.open(out.png) as png:  # closed here: an open file left to the collector warns (ResourceWarning)
        assert png.size == (320, 256)
    df = pd.read_csv(out.scores)
    assert list(df.columns) == ["tile", "x", "y", "size", "col", "row", "attention", "attention_rank", "score_0", "score_1"]
    np.testing.assert_allclose(df["attention"], att, rtol=1e-5)
    assert df["attention_rank"].to_numpy().argmax() == att.argmax()
    feats = json.loads(out.geojson.read_text())["features"]
    assert len(feats) == 20 and set(feats[0]["properties"]["measurements"]) == {"attention", "attention_rank", "score_0", "score_1"}
