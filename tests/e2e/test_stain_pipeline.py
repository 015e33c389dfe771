"""Stain normalisation through the stages: fitted once on the training split, stored in the run folder
and the checkpoint, recorded in the frozen features' cache key, applied unchanged by ``eval`` and
``predict``, and a slide whose stain cannot be estimated falls back by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from wsi_pipeline.data.store import open_store, store_path


def _fluorescence_store(tiles_dir, slide_id: str, n: int = 12, T: int = 32):
    """Bright blue nuclei on a black background, as a tile store."""
    from wsi_pipeline.data.store import StoreWriter

    rng = np.random.default_rng(3)
    tiles = np.full((n, T, T, 3), 5, np.uint8)
    tiles[:, 8:20, 8:20, 2] = rng.integers(150, 255, (n, 12, 12))
    grid = np.stack([np.arange(n) % 4, np.arange(n) // 4], 1).astype(np.int32)
    w = StoreWriter(store_path(tiles_dir, slide_id), tile_size=T, capacity=n,
                    attrs={"slide_id": slide_id, "slide_path": f"{slide_id}.tif", "mpp": 0.5, "downsample": 1.0, "tile_size": T})
    w.append(tiles, grid.astype(np.int64) * T, grid, np.ones(n, np.float32))
    w.commit()
    return store_path(tiles_dir, slide_id)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of a frozen and an end-to-end ResNet-18 + ABMIL, Macenko-normalised, on 8 store slides."""
    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.training.loop import train_pipeline

    tmp = tmp_path_factory.mktemp("stain")
    manifest = make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(12, 20), seed=0)
    raw = {
        "name": "t", "seeds": [0], "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results"),
        "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "features_dir": str(tmp / "feat"),
                 "n_classes": 2, "tiling": {"tile_size": 32}, "stain": {"normalise": "macenko", "max_tiles": 8}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2, "lr": 1e-4},
        "eval": {"protocols": ["all"], "bootstrap": 0},
        "methods": [{"name": "e2e", "strategy": "full", "chunk_size": 16, "encoder": {"bn": "frozen"}},
                    {"name": "fz", "strategy": "frozen", "chunk_size": 16}],
    }
    (tmp / "t.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "t.yaml")
    train_pipeline(cfg, device="cpu", progress=False)
    return {"tmp": tmp, "cfg": cfg, "manifest": pd.read_csv(manifest)}


@pytest.mark.slow
def test_the_normaliser_is_fitted_on_the_training_split_and_stored_with_the_run(trained):
    from wsi_pipeline.data.stain import estimate_stain, fit_target
    from wsi_pipeline.data.stain_stats import even_indices
    from wsi_pipeline.checkpoints.files import load_checkpoint
    from wsi_pipeline.inference.trained import load_trained_model

    cfg, man = trained["cfg"], trained["manifest"]
    run = cfg.run_dir("e2e", 0)
    ckpt = load_checkpoint(run / "best.pt")
    assert ckpt["stain_normalise"] == "macenko" and ckpt["stain"]["method"] == "macenko"
    assert json.loads((run / "stain.json").read_text()) == ckpt["stain"]  # the run folder holds the same, exactly
    # the target, recomputed here: each training slide's estimate from 8 evenly spaced tiles, medians
    ests = {}
    for sid in man[man.split == "train"].slide_id:
        st = open_store(store_path(cfg.data.tiles_dir, sid))
        ests[sid] = estimate_stain(st.read(even_indices(len(st), 8)))
    target, n = fit_target(ests.values(), "macenko")
    assert ckpt["stain"]["normaliser"]["target"] == target.to_dict() and n == len(ests)
    assert set(ckpt["stain"]["training"]) == set(ests)
    tm = load_trained_model(run)
    assert tm.stain.state() == ckpt["stain"]
    report = pd.read_csv(run / "stain.csv")
    assert set(report.slide_id) == set(ests) and report.stain_normalised.tolist() == [True] * len(ests)


@pytest.mark.slow
def test_frozen_features_record_the_normalisation_in_their_cache_key(trained, caplog):
    import h5py

    from wsi_pipeline.data.stain import StainNormaliser
    from wsi_pipeline.data.stain_slides import StainContext
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.inference.features import extract_features, features_path

    cfg, man = trained["cfg"], trained["manifest"]
    tm = load_trained_model(cfg.run_dir("fz", 0))
    sid = man[man.split == "train"].slide_id.iloc[0]
    path = features_path(cfg.data.features_dir + "/resnet18", sid)
    store = open_store(store_path(cfg.data.tiles_dir, sid))
    with h5py.File(path) as f:
        assert f.attrs["stain"] == tm.stain.for_store(store).tag and f.attrs["stain"].startswith("macenko:")
    # the same slide under another normalisation is another cache entry: rebuilt, with its own key
    other = StainContext(StainNormaliser("reinhard", tm.stain.normaliser.target), 8)
    rows = man[man.slide_id == sid]
    rep = extract_features(rows, cfg.data.tiles_dir, cfg.data.features_dir + "/resnet18", encoder=tm.encoder, device="cpu",
                           progress=False, stain=other)
    assert rep.status.tolist() == ["ok"]
    with h5py.File(path) as f:
        assert f.attrs["stain"].startswith("reinhard:")
    rep = extract_features(rows, cfg.data.tiles_dir, cfg.data.features_dir + "/resnet18", encoder=tm.encoder, device="cpu",
                           progress=False, stain=other)
    assert rep.status.tolist() == ["skipped"]  # up to date under the same normalisation


@pytest.mark.slow
def test_predict_applies_the_stored_normaliser_and_a_fluorescence_slide_falls_back_by_name(trained, tmp_path, caplog):
    import logging

    from wsi_pipeline.data.stain import estimate_stain
    from wsi_pipeline.data.stain_slides import SlideStain
    from wsi_pipeline.data.stain_stats import even_indices
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.evaluation.predict import predict_slides
    import copy
    import dataclasses

    from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint

    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.synthetic.cohort import EXTERNAL_TINT
    from wsi_pipeline.synthetic.stores import make_store_cohort

    cfg = trained["cfg"]
    stores = tmp_path / "stores"
    stores.mkdir()
    make_store_cohort(tmp_path / "ext", n_slides=2, tiles_per_slide=(12, 16), cohort="ext", tint=EXTERNAL_TINT,
                      splits={"test": 1.0}, seed=5)
    for p in (tmp_path / "ext" / "tiles").glob("*.zarr"):
        shutil.copytree(p, stores / p.name)
    _fluorescence_store(stores, "dapi_001")
    caplog.set_level(logging.WARNING)
    run = cfg.run_dir("e2e", 0)
    predict_slides(run, stores, tmp_path / "pred", device="cpu", heatmaps=False, progress=False)
    df = pd.read_csv(tmp_path / "pred" / "predictions.csv").set_index("slide_id")
    assert df.loc[["ext_000", "ext_001", "dapi_001"], "stain_normalised"].tolist() == [True, True, False]
    assert "dark image" in df.loc["dapi_001", "stain_problem"]
    assert any("dapi_001" in r.getMessage() and "not macenko-normalised" in r.getMessage() for r in caplog.records)
    # each slide's probability, recomputed by hand: the checkpoint's target, the slide's own estimate
    tm = load_trained_model(run)
    for sid in ("ext_000", "dapi_001"):
        st = open_store(store_path(stores, sid))
        stain = SlideStain(tm.stain.normaliser, estimate_stain(st.read(even_indices(len(st), 8))))
        with torch.no_grad():
            z = tm.encoder(tiles_to_tensor(st.read(), stain=stain))
            p = torch.softmax(tm.aggregator(z).logits.reshape(-1), 0).numpy()
        np.testing.assert_allclose(df.loc[sid, "prob_1"], p[1], atol=1e-5)
    # and it is the stored normaliser that predict applies: another target in the checkpoint, other probabilities
    ckpt = load_run_checkpoint(run / "best.pt")
    stain = copy.deepcopy(ckpt.stain)
    stain["normaliser"]["target"]["max_c"] = [2 * v for v in stain["normaliser"]["target"]["max_c"]]
    save_run_checkpoint(tmp_path / "altered.pt", dataclasses.replace(ckpt, stain=stain))
    predict_slides(tmp_path / "altered.pt", stores, tmp_path / "pred2", device="cpu", heatmaps=False, progress=False)
    df2 = pd.read_csv(tmp_path / "pred2" / "predictions.csv").set_index("slide_id")
    assert (df2.loc[["ext_000", "ext_001"], "prob_1"] - df.loc[["ext_000", "ext_001"], "prob_1"]).abs().min() > 1e-4
    assert df2.loc["dapi_001", "prob_1"] == pytest.approx(df.loc["dapi_001", "prob_1"], abs=1e-6)  # fell back: unchanged


@pytest.mark.slow
def test_eval_applies_the_stored_normaliser_and_reports_it_per_slide(trained):
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline

    cfg, man = trained["cfg"], trained["manifest"]
    # an external cohort of one fluorescence slide: scored unnormalised, named in stain.csv and the report
    _fluorescence_store(cfg.data.tiles_dir, "dapi_eval")
    row = {**man.iloc[0].to_dict(), "slide_id": "dapi_eval", "cohort": "fluo", "split": "test", "lesion_mask": None}
    pd.concat([man, pd.DataFrame([row])]).to_csv(cfg.data.manifest, index=False)
    summary = evaluate_pipeline(cfg, device="cpu", heatmaps=False, progress=False)
    table = pd.read_csv(summary.results_dir / "stain.csv").set_index(["method", "slide_id"])
    test_ids = set(man[man.split == "test"].slide_id)
    assert set(table.index) == {(m, s) for m in ("e2e", "fz") for s in test_ids | {"dapi_eval"}}
    assert table.stain_normalised.to_dict() == {(m, s): s != "dapi_eval" for m, s in table.index}
    assert "dark image" in table.loc[("e2e", "dapi_eval"), "stain_problem"]
    html = (summary.results_dir / "report.html").read_text()
    assert f"{len(test_ids)} of {len(test_ids) + 1} evaluated slides were stain-normalised" in html
    assert "dapi_eval" in html.split("Stain normalisation")[1]


def test_a_named_reference_slide_is_the_target_and_an_unknown_one_is_refused(tmp_path):
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.data.bags import slides_for_split
    from wsi_pipeline.data.stain_slides import estimate_store
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.training.stain import fit_run_stain

    manifest = make_store_cohort(tmp_path, n_slides=4, tiles_per_slide=(8, 10), seed=1)
    man = pd.read_csv(manifest)
    ref = str(man[man.split == "test"].slide_id.iloc[0])  # any slide of the manifest may be the reference

    def fit(target):
        cfg = config_from_dict({"name": "p", "data": {"manifest": str(manifest), "tiles_dir": str(tmp_path / "tiles"), "n_classes": 2,
                                                      "stain": {"normalise": "reinhard", "target": target, "max_tiles": 4}},
                                "methods": [{"name": "a", "strategy": "full"}]})
        return fit_run_stain(cfg, cfg.methods, slides_for_split(man, "train", cfg.data.tiles_dir), man)

    ctx = fit(ref)
    assert ctx.normaliser.target == estimate_store(open_store(store_path(tmp_path / "tiles", ref)), 4)
    assert ctx.normaliser.target_name == ref and ref not in ctx.training
    with pytest.raises(ValueError, match=r"data\.stain\.target='nope' is not a slide_id of"):
        fit("nope")
