"""Slides whose tile store holds 0 tiles: left out of training with one warning, or refused with --strict."""

from __future__ import annotations

import logging

import pandas as pd
import pytest

from pipeline_helpers import make_config
from wsi_pipeline.data.store import StoreWriter, open_store
from wsi_pipeline.config.pipeline import load_config
from wsi_pipeline.training.preflight import preflight


def _cohort_with_an_empty_slide(tmp_path, store_cohort):
    df = pd.read_csv(store_cohort)
    root = tmp_path / "cohort"
    (root / "tiles").mkdir(parents=True)
    for sid in df["slide_id"]:
        (root / "tiles" / f"{sid}.zarr").symlink_to(store_cohort.parent / "tiles" / f"{sid}.zarr")
    empty = StoreWriter(root / "tiles" / "blank.zarr", tile_size=32, capacity=4, attrs={"slide_id": "blank"})
    empty.commit()  # a complete store in which every tile failed the foreground rule
    assert len(open_store(root / "tiles" / "blank.zarr")) == 0
    row = {**df[df["split"] == "train"].iloc[0].to_dict(), "slide_id": "blank"}
    pd.concat([df, pd.DataFrame([row])]).to_csv(root / "manifest.csv", index=False)
    return root / "manifest.csv"


def test_a_slide_with_no_tiles_is_left_out_with_one_warning(tmp_path, store_cohort, caplog):
    manifest = _cohort_with_an_empty_slide(tmp_path, store_cohort)
    cfg = load_config(make_config(tmp_path, manifest, [{"name": "m", "strategy": "accumulate"}]))
    with caplog.at_level(logging.WARNING):
        plan = preflight(cfg, cfg.methods, [0])
    ids = [s.slide_id for s in plan.train]
    n_train = int((pd.read_csv(manifest)["split"] == "train").sum())
    assert "blank" not in ids and len(ids) == n_train - 1
    warned = [r.getMessage() for r in caplog.records if "0 tiles" in r.getMessage()]
    assert len(warned) == 1 and "blank" in warned[0] and "train" in warned[0]


def test_strict_refuses_a_slide_with_no_tiles(tmp_path, store_cohort):
    manifest = _cohort_with_an_empty_slide(tmp_path, store_cohort)
    cfg = load_config(make_config(tmp_path, manifest, [{"name": "m", "strategy": "accumulate"}]))
    with pytest.raises(ValueError, match=r"1 train slide\(s\) have 0 tiles .*blank.*--strict"):
        preflight(cfg, cfg.methods, [0], strict=True)


def test_a_slide_the_tiler_skipped_is_left_out_like_an_empty_one(tmp_path, store_cohort, caplog):
    """A fluorescence slide skipped by the brightfield rules has no store, but the report says why."""
    manifest = _cohort_with_an_empty_slide(tmp_path, store_cohort)
    df = pd.read_csv(manifest)
    row = {**df[df["split"] == "train"].iloc[0].to_dict(), "slide_id": "dapi"}
    pd.concat([df, pd.DataFrame([row])]).to_csv(manifest, index=False)
    tiles = manifest.parent / "tiles"
    pd.DataFrame([{"slide_id": "dapi", "status": "skipped", "n_tiles": 0,
                   "note": "skipped: dark background (fluorescence?); background grey 1"}]).to_csv(tiles / "tiling_report.csv", index=False)
    cfg = load_config(make_config(tmp_path, manifest, [{"name": "m", "strategy": "accumulate"}]))
    with caplog.at_level(logging.WARNING):
        plan = preflight(cfg, cfg.methods, [0])
    assert not {"dapi", "blank"} & {s.slide_id for s in plan.train}
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warned) == 1 and "blank" in warned[0] and "dapi" in warned[0]
    (tiles / "tiling_report.csv").unlink()  # without the report's word, a missing store is an error
    with pytest.raises(FileNotFoundError, match=r"no store for 1: dapi"):
        preflight(cfg, cfg.methods, [0])


def test_a_slide_that_failed_tiling_is_left_out_like_an_empty_one(tmp_path, store_cohort, caplog):
    """One unreadable slide must not block `train` with "run `wsi-pipeline tile`", which has just failed on it."""
    manifest = _cohort_with_an_empty_slide(tmp_path, store_cohort)
    df = pd.read_csv(manifest)
    row = {**df[df["split"] == "train"].iloc[0].to_dict(), "slide_id": "broken"}
    pd.concat([df, pd.DataFrame([row])]).to_csv(manifest, index=False)
    tiles = manifest.parent / "tiles"
    pd.DataFrame([{"slide_id": "broken", "status": "failed", "n_tiles": 0, "note": "",
                   "error": "SlideOpenError: no backend could open broken.svs"}]).to_csv(tiles / "tiling_report.csv", index=False)
    cfg = load_config(make_config(tmp_path, manifest, [{"name": "m", "strategy": "accumulate"}]))
    with caplog.at_level(logging.WARNING):
        plan = preflight(cfg, cfg.methods, [0])
    assert "broken" not in {s.slide_id for s in plan.train}
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warned) == 1 and "failed in tiling: broken (failed in tiling: SlideOpenError" in warned[0]
    with pytest.raises(ValueError, match=r"broken.*--strict"):
        preflight(cfg, cfg.methods, [0], strict=True)


def test_a_validation_or_test_split_of_one_class_is_a_warning_before_training(tmp_path, store_cohort, caplog):
    df = pd.read_csv(store_cohort)
    root = tmp_path / "one"
    root.mkdir()
    (root / "tiles").symlink_to(store_cohort.parent / "tiles")
    val_labels = df.loc[df["split"] == "val", "label"]
    assert val_labels.nunique() == 2  # the fixture's validation split has both classes
    df.loc[df["split"] == "val", "label"] = int(val_labels.iloc[0])
    df.loc[df["split"] == "test", "label"] = 1
    df.to_csv(root / "manifest.csv", index=False)
    cfg = load_config(make_config(tmp_path, root / "manifest.csv", [{"name": "m", "strategy": "accumulate"}]))
    with caplog.at_level(logging.WARNING):
        preflight(cfg, cfg.methods, [0])
    warned = [r.getMessage() for r in caplog.records if "split has" in r.getMessage()]
    assert len(warned) == 2
    assert "the val split has" in warned[0] and "val_auc is undefined" in warned[0] and "--redraw" in warned[0]
    assert "the test split has" in warned[1] and "all of class 1" in warned[1]
    caplog.clear()
    cfg2 = load_config(make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "accumulate"}], name="ok"))
    with caplog.at_level(logging.WARNING):
        preflight(cfg2, cfg2.methods, [0])
    assert not [r for r in caplog.records if "split has" in r.getMessage()]
