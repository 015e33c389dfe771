"""`predict` says when a slide lies outside the training cohort's stain: the summary saved at training
time, the per-slide distance, the flag in predictions.csv and on the terminal, prediction never refused.

References are computed here with numpy from the tiles read straight from the stores: optical
density from ``np.log10`` per pixel, saturation from ``(max - min) / max`` per pixel, medians and
MADs with ``np.median``.
"""

from __future__ import annotations

import logging
import shutil

import cv2
import numpy as np
import pandas as pd
import pytest
import yaml

from wsi_pipeline.data.stain_stats import FEATURES, MIN_SPREAD, compare_to_reference, even_indices, stain_reference, tile_features
from wsi_pipeline.manifests.schema import read_manifest
from wsi_pipeline.data.store import StoreWriter, open_store, store_path


def _numpy_features(tiles: np.ndarray) -> np.ndarray:
    """Independent per-tile features: float64 per pixel, no lookup table, no OpenCV."""
    t = tiles.astype(np.float64)
    od = -np.log10((t + 1.0) / 256.0)
    mx, mn = t.max(-1), t.min(-1)
    sat = np.where(mx > 0, (mx - mn) / np.maximum(mx, 1.0), 0.0)
    return np.stack([od[..., 0].mean((1, 2)), od[..., 1].mean((1, 2)), od[..., 2].mean((1, 2)),
                     od.mean(-1).reshape(len(t), -1).std(1), sat.mean((1, 2))], axis=1)


def _fluorescence_store(tiles_dir, slide_id: str, n: int = 20, T: int = 32, seed: int = 0):
    """A DAPI-like slide as a tile store: near-black background, bright blue-cyan nuclei."""
    rng = np.random.default_rng(seed)
    tiles = np.empty((n, T, T, 3), np.uint8)
    for i in range(n):
        canvas = np.zeros((T, T), np.float32)
        canvas[rng.integers(0, T, 10), rng.integers(0, T, 10)] = 1.0
        nuclei = np.clip(cv2.GaussianBlur(canvas, (7, 7), 1.6) * 25.0, 0.0, 1.0)
        img = 6.0 + nuclei[..., None] * np.array([40.0, 110.0, 235.0]) + rng.normal(0, 2.0, (T, T, 3))
        tiles[i] = np.clip(np.round(img), 0, 255).astype(np.uint8)
    side = int(np.ceil(np.sqrt(n)))
    grid = np.stack([np.arange(n) % side, np.arange(n) // side], 1).astype(np.int32)
    w = StoreWriter(store_path(tiles_dir, slide_id), tile_size=T, capacity=n,
                    attrs={"slide_id": slide_id, "slide_path": f"{slide_id}.tif", "mpp": 0.5, "downsample": 1.0, "tile_size": T})
    w.append(tiles, grid.astype(np.int64) * T, grid, np.ones(n, np.float32))
    w.commit()
    return store_path(tiles_dir, slide_id)


def test_tile_features_and_reference_match_numpy(tmp_path):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    man = read_manifest(make_store_cohort(tmp_path, n_slides=6, tiles_per_slide=(10, 90), seed=2))
    paths = [store_path(tmp_path / "tiles", s) for s in man.slide_id]
    ref = stain_reference(paths, max_tiles=16)
    feats = []
    for p in paths:
        st = open_store(p)
        tiles = st.read(even_indices(len(st), 16))
        assert len(tiles) == min(len(st), 16)
        ours, theirs = tile_features(tiles), _numpy_features(tiles)
        # OD: a 256-entry float64 table vs log10 per pixel, averaged: equal to float64 rounding
        np.testing.assert_allclose(ours[:, :4], theirs[:, :4], rtol=0, atol=1e-12)
        # saturation: OpenCV stores S rounded to uint8 (255 * (max - min) / max): <= 0.5 / 255 per pixel
        np.testing.assert_allclose(ours[:, 4], theirs[:, 4], rtol=0, atol=0.5 / 255 + 1e-12)
        feats.append(ours)
    x = np.concatenate(feats)
    med = np.median(x, 0)
    spread = np.maximum(1.4826 * np.median(np.abs(x - med), 0), [MIN_SPREAD[f] for f in FEATURES])
    np.testing.assert_allclose(ref["median"], med, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ref["spread"], spread, rtol=0, atol=1e-12)
    assert ref["n_slides"] == 6 and ref["n_tiles"] == len(x)
    # the distance is the largest per-feature |median - reference| / spread
    chk = compare_to_reference(x[:5], ref)
    z = np.abs(np.median(x[:5], 0) - med) / spread
    assert chk.distance == pytest.approx(z.max(), abs=1e-12) and chk.feature == FEATURES[int(z.argmax())]
    with pytest.raises(ValueError, match="uint8"):
        tile_features(np.zeros((1, 4, 4, 3), np.float32))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of ResNet-18 + ABMIL on an 8-slide H&E-like store cohort."""
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.training.loop import train_pipeline

    tmp = tmp_path_factory.mktemp("offdist")
    manifest = make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(12, 20), seed=0)
    raw = {
        "name": "t", "seeds": [0], "runs_dir": str(tmp / "runs"),
        "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2, "lr": 1e-4},
        "methods": [{"name": "m", "strategy": "full", "chunk_size": 16, "encoder": {"bn": "frozen"}}],
    }
    (tmp / "t.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "t.yaml")
    train_pipeline(cfg, device="cpu", progress=False)
    return {"tmp": tmp, "cfg": cfg, "manifest": read_manifest(manifest)}


@pytest.mark.slow
def test_training_saves_the_training_tiles_stain_summary(trained):
    from wsi_pipeline.inference.trained import load_trained_model

    cfg, man = trained["cfg"], trained["manifest"]
    tm = load_trained_model(cfg.run_dir("m", 0))
    train_ids = man[man.split == "train"].slide_id
    expect = stain_reference([store_path(cfg.data.tiles_dir, s) for s in train_ids])
    assert tm.stain_reference == expect and expect["n_slides"] == len(train_ids)


@pytest.mark.slow
def test_predict_flags_a_fluorescence_slide_and_still_predicts_it(trained, tmp_path, capsys, caplog):
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.synthetic.cohort import EXTERNAL_TINT
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.inference.trained import load_trained_model

    cfg, man = trained["cfg"], trained["manifest"]
    stores = tmp_path / "stores"
    stores.mkdir()
    he = list(man[man.split == "test"].slide_id)
    for sid in he:  # held-out H&E slides of the training cohort
        shutil.copytree(store_path(cfg.data.tiles_dir, sid), stores / f"{sid}.zarr")
    # another "scanner": the external tint of the synthetic demo, other slides
    make_store_cohort(tmp_path / "ext", n_slides=2, tiles_per_slide=(12, 20), cohort="ext", tint=EXTERNAL_TINT,
                      splits={"test": 1.0}, seed=5)
    for p in (tmp_path / "ext" / "tiles").glob("*.zarr"):
        shutil.copytree(p, stores / p.name)
    fl = _fluorescence_store(stores, "dapi_001")
    caplog.set_level(logging.WARNING)
    rc = main(["predict", "--model", str(cfg.run_dir("m", 0)), "--slides", str(stores), "--out", str(tmp_path / "pred"),
               "--device", "cpu", "--no-heatmaps", "--quiet"])
    assert rc == 0
    df = pd.read_csv(tmp_path / "pred" / "predictions.csv").set_index("slide_id")
    assert set(df.index) == set(he) | {"ext_000", "ext_001", "dapi_001"}  # nothing refused
    np.testing.assert_allclose(df[["prob_0", "prob_1"]].sum(axis=1), 1.0, atol=1e-5)
    assert list(df.columns[-4:]) == ["stain_distance", "off_distribution", "stain_normalised", "stain_problem"]
    assert df["stain_normalised"].isna().all()  # a model without stain normalisation: the column is empty
    assert df.loc["dapi_001", "off_distribution"] == True  # noqa: E712 (numpy/pandas bool)
    assert not df.drop(index="dapi_001")["off_distribution"].any()
    # the fluorescence distance, recomputed with numpy from the saved reference and the store's tiles
    ref = load_trained_model(cfg.run_dir("m", 0)).stain_reference
    st = open_store(fl)
    x = _numpy_features(st.read(even_indices(len(st), ref["max_tiles_per_slide"])))
    z = np.abs(np.median(x, 0) - ref["median"]) / np.asarray(ref["spread"])
    assert df.loc["dapi_001", "stain_distance"] == pytest.approx(z.max(), rel=1e-3)
    assert z.max() > 4 * ref["threshold"]  # far outside, not a borderline call
    assert (df.drop(index="dapi_001")["stain_distance"] < ref["threshold"]).all()
    # on the terminal: one warning naming the slide, and the CLI's closing line
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "dapi_001" in r.getMessage()]
    assert len(warned) == 1 and "unlike the training tiles" in warned[0]
    out = capsys.readouterr().out
    assert "1 slide(s) look unlike the model's training tiles" in out and "dapi_001" in out and "OFF" in out


@pytest.mark.slow
def test_a_checkpoint_without_a_summary_uses_the_training_stores_or_says_it_cannot_check(trained, tmp_path, caplog):
    import dataclasses

    import torch

    from wsi_pipeline.evaluation.predict import predict_slides
    from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint

    cfg = trained["cfg"]
    ckpt = load_run_checkpoint(cfg.run_dir("m", 0) / "best.pt")
    ref = ckpt.stain_reference
    assert ref is not None
    ckpt = dataclasses.replace(ckpt, stain_reference=None)  # as written before checkpoints kept the summary
    old = save_run_checkpoint(tmp_path / "old.pt", ckpt)
    stores = tmp_path / "stores"
    stores.mkdir()
    _fluorescence_store(stores, "dapi_002", seed=1)
    s = predict_slides(old, stores, tmp_path / "p1", device="cpu", heatmaps=False, progress=False)
    assert s.stain_reference_source.startswith("training stores") and s.stain_checks["dapi_002"].off_distribution
    assert compare_to_reference(tile_features(open_store(store_path(stores, "dapi_002")).read()), ref).distance == \
        pytest.approx(s.stain_checks["dapi_002"].distance, abs=1e-12)
    # training stores gone: predicted, columns empty, one warning
    config = {**ckpt.config, "data": {**ckpt.config["data"], "tiles_dir": str(tmp_path / "gone")}}
    gone = save_run_checkpoint(tmp_path / "gone.pt", dataclasses.replace(ckpt, config=config))
    caplog.set_level(logging.WARNING)
    s = predict_slides(gone, stores, tmp_path / "p2", device="cpu", heatmaps=False, progress=False)
    df = pd.read_csv(tmp_path / "p2" / "predictions.csv")
    assert len(df) == 1 and df["stain_distance"].isna().all() and df["off_distribution"].isna().all()
    assert sum("not checked for being off-distribution" in r.getMessage() for r in caplog.records) == 1
    assert torch.is_tensor(ckpt.models["aggregator"][next(iter(ckpt.models["aggregator"]))])


@pytest.mark.slow
def test_predict_under_torchrun_shards_the_slides_and_writes_what_one_process_writes(trained, tmp_path, free_port):
    """2 ranks (gloo, CPU) each score half the slides, the fluorescence one included; rank 0 alone
    prints and writes, and predictions.csv, predict_info.json (stain checks of every slide) and the
    heatmap files equal one process's byte for byte."""
    import json
    import os
    import subprocess
    import sys

    cfg, man = trained["cfg"], trained["manifest"]
    stores = tmp_path / "stores"
    stores.mkdir()
    for sid in man[man.split == "test"].slide_id:
        shutil.copytree(store_path(cfg.data.tiles_dir, sid), stores / f"{sid}.zarr")
    _fluorescence_store(stores, "dapi_001")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's per-rank default; the same for the single process
    env.pop("WORLD_SIZE", None)
    common = ["-m", "wsi_pipeline.cli.main", "predict", "--model", str(cfg.run_dir("m", 0)), "--slides", str(stores),
              "--device", "cpu", "--no-progress", "--protocol", "all", "--protocol", "sub4x3"]
    one = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port}", *common, "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    n = len(list(stores.glob("*.zarr")))
    assert two.stdout.count(f"Predicted {n} slide(s)") == 1 and two.stdout.count("dapi_001") >= 1  # rank 0 alone
    assert (tmp_path / "one" / "predictions.csv").read_bytes() == (tmp_path / "two" / "predictions.csv").read_bytes()
    info1, info2 = (json.loads((tmp_path / d / "predict_info.json").read_text()) for d in ("one", "two"))
    assert info1 == info2 and sorted(info2["stain_checks"]) == sorted(p.name[:-5] for p in stores.glob("*.zarr"))
    assert info2["stain_checks"]["dapi_001"]["off_distribution"] is True
    hm1, hm2 = (sorted(p.name for p in (tmp_path / d / "heatmaps").iterdir()) for d in ("one", "two"))
    assert hm1 == hm2 and len(hm1) >= 3 * n
    for name in hm1:
        if name.endswith((".csv", ".geojson")):
            assert (tmp_path / "one" / "heatmaps" / name).read_bytes() == (tmp_path / "two" / "heatmaps" / name).read_bytes(), name
