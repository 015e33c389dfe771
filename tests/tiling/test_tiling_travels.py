"""Tiling settings travel with the data: training checks its stores agree, saves their settings in the
checkpoint, and `predict` tiles new slides exactly as the training stores were tiled."""

from __future__ import annotations

import shutil

import pytest
import yaml

from wsi_pipeline.data.store import open_store, store_path


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    from wsi_pipeline.synthetic.cohort import make_slide_cohort
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.tiling import TilingConfig

    root = tmp_path_factory.mktemp("travels")
    manifest = make_slide_cohort(root / "cohort", n_slides=6, size=1024, mpp=0.25,
                                 splits={"train": 0.67, "val": 0.33})
    tiles = root / "tiles"
    report = tile_cohort(manifest, tiles, TilingConfig(method="greyscale", qc_mode="off", tile_size=128, mpp_target=0.5, min_foreground=0.3),
                         workers=0, progress=False)
    assert report.ok
    return root, manifest, tiles


def _config(root, manifest, tiles, name, tiling=None):
    data = {"manifest": str(manifest), "tiles_dir": str(tiles), "n_classes": 2, "features_dir": str(root / "feat")}
    if tiling is not None:
        data["tiling"] = tiling
    raw = {"name": name, "data": data, "seeds": [0], "runs_dir": str(root / "runs"),
           "train": {"epochs": 1, "bag_size": 4, "batch_bags": 1, "lr": 1e-4},
           "methods": [{"name": "m", "strategy": "full", "encoder": {"name": "resnet18"}}]}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_predict_tiles_new_slides_as_the_training_stores_were_tiled(tiled, tmp_path):
    from wsi_pipeline.evaluation.predict import predict_slides
    from wsi_pipeline.checkpoints.files import load_run_checkpoint
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.training.loop import train_pipeline

    root, manifest, tiles = tiled
    cfg = load_config(_config(root, manifest, tiles, "notiling"))  # no data.tiling at all
    (run,) = train_pipeline(cfg, device="cpu", progress=False)
    saved = load_run_checkpoint(run / "best.pt").tiling
    assert saved["tile_size"] == 128 and saved["mpp_target"] == pytest.approx(0.5)
    assert saved["min_foreground"] == pytest.approx(0.3)

    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(manifest.parent / "slides" / "internal_000.svs", new / "fresh.svs")
    summary = predict_slides(run, new, tmp_path / "pred", device="cpu", heatmaps=False, progress=False)
    assert not summary.failed
    made = open_store(store_path(summary.tiles_dir, "fresh"))
    trained = open_store(store_path(tiles, "internal_000"))
    assert made.tile_size == trained.tile_size == 128
    assert made.attrs["mpp"] == pytest.approx(trained.attrs["mpp"]) and made.attrs["mpp"] == pytest.approx(0.5, rel=0.06)
    assert len(made) == len(trained)  # the same slide file, tiled the same way


def test_training_refuses_stores_the_config_or_each_other_disagree_with(tiled, tmp_path):
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.training.preflight import preflight

    root, manifest, tiles = tiled
    cfg = load_config(_config(root, manifest, tiles, "wrongsize", tiling={"tile_size": 256}))
    with pytest.raises(ValueError, match=r"data.tiling disagrees with the tile stores \(tile_size: config 256 vs stores 128\)"):
        preflight(cfg, cfg.methods, [0])

    mixed = tmp_path / "mixed"
    shutil.copytree(tiles, mixed, symlinks=True)
    shutil.rmtree(mixed / "internal_001.zarr")
    tile_cohort([j for j in _jobs(manifest) if j.slide_id == "internal_001"], mixed,
                TilingConfig(method="greyscale", qc_mode="off", tile_size=64, mpp_target=0.5, min_foreground=0.3), workers=0, progress=False)
    cfg = load_config(_config(root, manifest, mixed, "mixed"))
    with pytest.raises(ValueError, match=r"different tiling settings .*internal_001: .*tile_size=64.*retile"):
        preflight(cfg, cfg.methods, [0])


def _jobs(manifest):
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.tiling.job import SlideJob

    return [SlideJob(str(r.slide_id), str(r.path)) for r in read_manifest(manifest).itertuples()]


def test_predict_refuses_stores_tiled_unlike_the_training_data(tiled, tmp_path):
    from wsi_pipeline.evaluation.predict import check_store_settings
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.tiling import TilingConfig

    root, manifest, tiles = tiled
    trained = {"method": "greyscale", "tile_size": 128, "min_foreground": 0.3, "mpp_target": 0.5}
    same = [tiles / "internal_000.zarr"]
    check_store_settings(same, trained, allow=False)  # tiled as in training: accepted
    other = tmp_path / "other"
    tile_cohort([j for j in _jobs(manifest) if j.slide_id == "internal_000"], other,
                TilingConfig(method="greyscale", qc_mode="off", tile_size=64, min_foreground=0.3), workers=0, progress=False)
    stores = [other / "internal_000.zarr"]
    with pytest.raises(ValueError, match=r"tiled unlike the model's training data .*tile_size 64 \(model: 128\).*"
                       r"mpp_target None \(model: 0.5\).*--allow-other-tiling"):
        check_store_settings(stores, trained, allow=False)
    check_store_settings(stores, trained, allow=True)  # warned, not refused
