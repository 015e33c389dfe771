"""Tile stores written by the release before StoreSettings (tests/fixtures/stores, see make_stores.py there):
their settings read back as that release recorded them, their tiles read, and resume still takes them as current."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline.config.store_settings import SCHEMA_VERSION, SLIDE_KEYS, StoreSettings
from wsi_pipeline.config.tiling import TilingConfig, tiler_config
from wsi_pipeline.config.tiling_params import GreyscaleParams, QCParams
from wsi_pipeline.data.bags import store_settings
from wsi_pipeline.data.store import open_store
from wsi_pipeline.slides import open_slide
from wsi_pipeline.tiling.identity import store_matches
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.params import store_settings as settings_of

FIXTURES = Path(__file__).parents[1] / "fixtures" / "stores"
RECORDED = json.loads((FIXTURES / "recorded.json").read_text())
NAMES = sorted(RECORDED)


def _configs(points: Path) -> dict[str, TilingConfig]:
    """The settings each fixture was tiled with (as make_stores.py gives them)."""
    return {
        "greyscale_plain": TilingConfig(method="greyscale", qc_mode="off", tile_size=16, qc=False,
                                        detector=GreyscaleParams(grey_max="auto")),
        "tissue_qc": TilingConfig(method="tissue", tile_size=16, qc=False, qc_params=QCParams(drop=("pen",), pen_fraction=0.2)),
        "otsu_points": TilingConfig(method="otsu", tile_size=16, qc=False, shard_tiles=0, points=str(points)),
    }


@pytest.mark.parametrize("name", NAMES)
def test_old_store_settings_read_as_recorded(name: str) -> None:
    assert store_settings(FIXTURES / f"{name}.zarr") == RECORDED[name]["store_settings"]


@pytest.mark.parametrize("name", NAMES)
def test_old_store_tiles_are_the_slide_pixels(name: str) -> None:
    store = open_store(FIXTURES / f"{name}.zarr")
    assert len(store) == RECORDED[name]["n_tiles"] > 0
    tiles, coords = store.read(), store.array("coords")
    T = tiles.shape[1]
    with open_slide(FIXTURES / "fx.svs") as slide:
        for tile, (x, y) in zip(tiles, coords, strict=True):
            if name == "otsu_points":  # point tiles may cross the edge (padded): compare the part inside
                x0, y0 = max(0, x), max(0, y)
                w, h = min(slide.dimensions[0], x + T) - x0, min(slide.dimensions[1], y + T) - y0
                ref = slide.read_region((int(x0), int(y0)), 0, (int(w), int(h)))
                np.testing.assert_array_equal(tile[y0 - y : y0 - y + h, x0 - x : x0 - x + w], ref)
            else:
                np.testing.assert_array_equal(tile, slide.read_region((int(x), int(y)), 0, (T, T)))


@pytest.mark.parametrize("name", NAMES)
def test_old_store_is_current_for_resume(tmp_path: Path, name: str) -> None:
    """A store of the earlier release, tiled with the same settings, is not rebuilt on resume."""
    slide = shutil.copy(FIXTURES / "fx.svs", tmp_path / "fx.svs")  # another mtime: the fingerprint is recomputed
    config = _configs(FIXTURES / "points.csv")[name]
    assert store_matches(FIXTURES / f"{name}.zarr", SlideJob("fx", str(slide)), config) is not None
    other = TilingConfig(method="greyscale", tile_size=32, qc_mode="off")
    assert store_matches(FIXTURES / f"{name}.zarr", SlideJob("fx", str(slide)), other) is None


@pytest.mark.parametrize("name", NAMES)
def test_old_store_settings_migrate_to_store_settings(name: str) -> None:
    """Through StoreSettings.from_state the old record is the settings of the config that made it (the same
    object this release records), and its state is the old record plus the schema version."""
    identity = open_store(FIXTURES / f"{name}.zarr").attrs["tiling_identity"]
    old = StoreSettings.from_state(identity)
    config = _configs(FIXTURES / "points.csv")[name]
    assert old == settings_of(config)
    recorded = {k: v for k, v in identity.items() if k not in SLIDE_KEYS}
    assert old.to_state() == {**recorded, "schema_version": SCHEMA_VERSION}
    assert StoreSettings.from_state(old.to_state()) == old
    # the tiler config it gives records the same settings again (predict tiles new slides this way)
    again = tiler_config(RECORDED[name]["store_settings"])
    assert (again.method, again.tile_size, again.threshold) == (config.method, config.tile_size, config.threshold)
    assert again.detector == config.detector and again.qc_mode == config.qc_mode and again.qc_params == config.qc_params


def test_settings_from_a_newer_release_are_refused() -> None:
    state = {**RECORDED["tissue_qc"]["store_settings"], "schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this release's"):
        StoreSettings.from_state(state)


def test_settings_recorded_before_tile_qc_were_made_without_it() -> None:
    """Version-1 settings without qc_mode (stores tiled before tile QC existed) read as QC off."""
    state = {k: v for k, v in RECORDED["greyscale_plain"]["store_settings"].items()}
    assert "qc_mode" not in state and StoreSettings.from_state(state).qc_mode == "off"
    assert tiler_config(state).qc_mode == "off"
