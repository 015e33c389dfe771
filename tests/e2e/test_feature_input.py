"""Feature files as the input, through the command line (issue 52): TRIDENT / CLAM / STAMP files generated here
-> `manifest folder --features` -> `train` / `eval` (and `--folds`) -> `predict` on a folder of feature files;
and ours written in TRIDENT's layout training the same model as our native files."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from wsi_pipeline.cli.main import main

pytestmark = pytest.mark.slow

N_SLIDES, DIM, TILE = 12, 8, 512


def _cohort_features(seed: int = 0) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(slide_id, features [n, D], level-0 coords [n, 2]) per slide: class 1 slides carry a shifted first feature."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(N_SLIDES):
        n = 6 + i % 4
        f = rng.normal(size=(n, DIM)).astype(np.float32)
        f[:, 0] += 3.0 * (i % 2)
        xy = np.stack([np.arange(n) % 3, np.arange(n) // 3], 1).astype(np.int64) * TILE + 1000
        out.append((f"s{i:02d}", f, xy))
    return out


def _write(root: Path, fmt: str) -> Path:
    """The cohort in one tool's layout under ``root``; returns the folder to point at."""
    for sid, f, xy in _cohort_features():
        if fmt == "trident":
            path = root / "features_uni_v1" / f"{sid}.h5"
        elif fmt == "clam":
            path = root / "h5_files" / f"{sid}.h5"
        else:
            path = root / f"{sid}.h5"
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w") as h:
            if fmt == "stamp":
                h.create_dataset("feats", data=f)
                h.create_dataset("coords", data=xy * 0.5)  # um at 0.5 um/px
                h.attrs.update({"extractor": "uni", "unit": "um", "tile_size_um": 256.0, "tile_size_px": 224, "mpp": 0.5})
                continue
            h.create_dataset("features", data=f)
            c = h.create_dataset("coords", data=xy)
            if fmt == "trident":
                c.attrs.update({"patch_size": 256, "patch_size_level0": TILE, "level0_magnification": 40.0,
                                "target_magnification": 20.0, "overlap": 0, "level0_width": 4000, "level0_height": 3000})
        if fmt == "clam":  # CLAM's pt_files beside: features only
            (root / "pt_files").mkdir(exist_ok=True)
            torch.save(torch.from_numpy(f), root / "pt_files" / f"{sid}.pt")
    return root


def _labels(tmp_path: Path, task: str) -> Path:
    rows = []
    for i, (sid, f, _) in enumerate(_cohort_features()):
        row: dict = {"slide_id": sid, "split": ("train", "train", "val", "test")[i % 4] if i < 8 else ("train", "val", "test", "test")[i % 4]}
        if task == "classification":
            row["label"] = i % 2
        elif task == "survival":
            row.update(time=float(3 * i + 1), event=1 if i % 3 else 0)
        else:
            row["target"] = float(f[:, 0].mean())
        rows.append(row)
    path = tmp_path / f"labels_{task}.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _config(tmp_path: Path, manifest: Path, features: Path, methods: list[dict], *, fmt: str = "auto", name: str = "f",
            task: str = "classification") -> Path:
    raw = {
        "name": name,
        "data": {"manifest": str(manifest), "features": {"dir": str(features), "format": fmt},
                 **({"n_classes": 2} if task == "classification" else {})},
        "train": {"epochs": 2, "bag_size": 8, "batch_bags": 2, "lr": 1e-3},
        "eval": {"protocols": ["all"], "bootstrap": 20},
        "seeds": [0],
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
        "methods": methods,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _method(name: str, aggregator: str, task: str = "classification", **options) -> dict:
    m = {"name": name, "strategy": "frozen", "encoder": {"name": "precomputed"},
         "aggregator": {"name": aggregator, **({"options": options} if options else {})}}
    if task != "classification":
        m.update(task=task, loss={"survival": "cox", "regression": "mse"}[task])
    return m


EVERY_AGGREGATOR = [_method("abmil", "abmil", gated=False), _method("gated", "abmil", gated=True), _method("mean", "mean"),
                    _method("max", "max"), _method("dtfd", "dtfd"),
                    _method("transmil", "transmil", dim=32, num_landmarks=8)]  # small: 8 s an epoch at its default width


@pytest.mark.parametrize("fmt", ["trident", "clam", "stamp"])
def test_every_frozen_method_trains_evaluates_and_predicts_from_feature_files(fmt, tmp_path, capsys):
    feats = _write(tmp_path / fmt, fmt)
    manifest = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--features", str(feats), "--labels", str(_labels(tmp_path, "classification")),
                 "--out", str(manifest)]) == 0
    df = pd.read_csv(manifest)
    assert sorted(df["slide_id"]) == [f"s{i:02d}" for i in range(N_SLIDES)]
    assert all(p.endswith(".h5") for p in df["path"])
    # every method once over the three formats (abmil in each: predict runs it)
    methods = {"trident": EVERY_AGGREGATOR[:2], "clam": [EVERY_AGGREGATOR[0], *EVERY_AGGREGATOR[2:4]],
               "stamp": [EVERY_AGGREGATOR[0], *EVERY_AGGREGATOR[4:]]}[fmt]
    cfg = _config(tmp_path, manifest, feats, methods, fmt=fmt)
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    for m in methods:
        assert (tmp_path / "runs" / "f" / m["name"] / "seed0" / "done").is_file()
    assert main(["eval", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    results = tmp_path / "results" / "f"
    pred = pd.read_csv(next(results.glob("predictions_*_all.csv")))
    assert set(pred["method"]) == {m["name"] for m in methods}
    assert sorted(set(pred["slide_id"])) == sorted(df[df["split"] == "test"]["slide_id"])
    assert (results / "report.html").is_file()
    if fmt != "clam":  # coordinates given: heatmaps on a blank canvas (no slide file)
        assert list((results / "heatmaps").glob("*.png"))
    capsys.readouterr()
    out = tmp_path / "pred"
    assert main(["predict", "--model", str(tmp_path / "runs" / "f" / "abmil" / "seed0"), "--slides", str(feats),
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"Predicted {N_SLIDES} slide(s)" in printed
    p = pd.read_csv(out / "predictions.csv")
    assert len(p) == N_SLIDES
    # the tool's files and predict agree with eval on the test slides
    ev = pred[pred["method"] == "abmil"].set_index("slide_id")["prob_1"]
    np.testing.assert_allclose(p.set_index("slide_id").loc[ev.index, "prob_1"], ev, atol=1e-5)


def test_clam_pt_files_train_without_coordinates(tmp_path):
    root = _write(tmp_path / "clam", "clam")
    manifest = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--features", str(root / "pt_files"), "--labels",
                 str(_labels(tmp_path, "classification")), "--out", str(manifest)]) == 0
    cfg = _config(tmp_path, manifest, root / "pt_files", [_method("abmil", "abmil")], fmt="clam")
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    assert main(["eval", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    assert not list((tmp_path / "results" / "f" / "heatmaps").glob("*.png"))  # no coordinates: no heatmap


@pytest.mark.parametrize("task", ["survival", "regression"])
def test_tasks_without_classes_train_on_feature_files_with_folds(task, tmp_path):
    feats = _write(tmp_path / "trident", "trident")
    manifest = tmp_path / "cv.csv"
    assert main(["manifest", "folder", "--features", str(feats), "--labels", str(_labels(tmp_path, task)),
                 "--crossval", "3", "--out", str(manifest)]) == 0
    cfg = _config(tmp_path, manifest, feats, [_method("abmil", "abmil", task)], task=task)
    assert main(["train", "--config", str(cfg), "--folds", "--no-progress", "--quiet"]) == 0
    assert main(["eval", "--config", str(cfg), "--folds", "--no-progress", "--quiet", "--no-heatmaps"]) == 0
    oof = pd.read_csv(tmp_path / "results" / "f_cv" / "oof_predictions.csv")
    assert sorted(oof["slide_id"]) == [f"s{i:02d}" for i in range(N_SLIDES)]


def test_a_pipeline_without_tiles_or_features_is_refused(tmp_path):
    from wsi_pipeline.config.pipeline import load_config

    cfg = _config(tmp_path, tmp_path / "m.csv", tmp_path, [_method("abmil", "abmil")])
    raw = yaml.safe_load(cfg.read_text())
    del raw["data"]["features"]
    cfg.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="data has neither tiles_dir .* nor features"):
        load_config(cfg)


def test_a_feature_file_missing_what_its_format_requires_stops_training_by_name(tmp_path):
    feats = _write(tmp_path / "trident", "trident")
    with h5py.File(feats / "features_uni_v1" / "s01.h5", "a") as h:
        del h["coords"].attrs["patch_size_level0"]
    manifest = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--features", str(feats), "--labels", str(_labels(tmp_path, "classification")),
                 "--out", str(manifest)]) == 0
    cfg = _config(tmp_path, manifest, feats, [_method("abmil", "abmil")], fmt="trident")
    with pytest.raises(ValueError, match=r"s01\.h5 \(TRIDENT\) lacks attribute\(s\) .*\['patch_size_level0'\]"):
        from wsi_pipeline.config.pipeline import load_config
        from wsi_pipeline.training.loop import train_pipeline

        train_pipeline(load_config(cfg), progress=False)


def test_ours_in_trident_layout_trains_the_same_model_as_our_native_files(store_cohort, tmp_path):
    """`features --layout trident` -> train on data.features gives the weights and predictions of the native frozen
    pipeline (tile stores + our feature files) with the same seed."""
    from wsi_pipeline.checkpoints.files import load_run_checkpoint
    from wsi_pipeline.inference.features import read_features

    tiles = store_cohort.parent / "tiles"
    native, trident = tmp_path / "native", tmp_path / "job"
    base = ["features", "--manifest", str(store_cohort), "--tiles", str(tiles), "--no-progress", "--quiet"]
    assert main([*base, "--out", str(native)]) == 0
    assert main([*base, "--out", str(trident), "--layout", "trident"]) == 0
    folder = trident / "features_resnet18"
    for sid in pd.read_csv(store_cohort)["slide_id"]:  # the same features and coordinates read back
        f0, c0, _ = read_features(native / f"{sid}.h5")
        f1, c1, a1 = read_features(folder / f"{sid}.h5")
        np.testing.assert_array_equal(f0, f1)
        np.testing.assert_array_equal(c0, c1)
        with h5py.File(folder / f"{sid}.h5") as h:
            assert "patch_size_level0" in h["coords"].attrs and h.attrs["encoder"] == "resnet18"
    train = {"epochs": 2, "bag_size": 8, "batch_bags": 2, "lr": 1e-3}
    raw_native = {
        "name": "n", "data": {"manifest": str(store_cohort), "tiles_dir": str(tiles), "features_dir": str(tmp_path / "unused"),
                              "n_classes": 2},
        "train": train, "seeds": [0], "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results"),
        "eval": {"protocols": ["all"], "bootstrap": 20},
        "methods": [{"name": "m", "strategy": "frozen", "encoder": {"name": "resnet18"}, "features_dir": str(native),
                     "aggregator": {"name": "abmil"}}],
    }
    raw_trident = {**raw_native, "name": "r", "data": {"manifest": str(store_cohort), "features": {"dir": str(trident)},
                                                        "n_classes": 2},
                   "methods": [_method("m", "abmil")]}
    for raw in (raw_native, raw_trident):
        cfg = tmp_path / f"{raw['name']}.yaml"
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
        assert main(["eval", "--config", str(cfg), "--no-progress", "--quiet", "--no-heatmaps"]) == 0
    a = load_run_checkpoint(tmp_path / "runs" / "n" / "m" / "seed0" / "best.pt")
    b = load_run_checkpoint(tmp_path / "runs" / "r" / "m" / "seed0" / "best.pt")
    sa, sb = a.models["aggregator"], b.models["aggregator"]
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    pa = pd.read_csv(next((tmp_path / "results" / "n").glob("predictions_*_all.csv")))
    pb = pd.read_csv(next((tmp_path / "results" / "r").glob("predictions_*_all.csv")))
    np.testing.assert_array_equal(pa["slide_id"], pb["slide_id"])
    np.testing.assert_allclose(pa["prob_1"], pb["prob_1"], rtol=0, atol=1e-7)


def test_features_layout_stamp_writes_micrometres_and_reads_back_as_ours(store_cohort, tmp_path, capsys):
    from wsi_pipeline.data.feature_formats import read_slide_features
    from wsi_pipeline.data.store import open_store

    tiles = store_cohort.parent / "tiles"
    base = ["features", "--manifest", str(store_cohort), "--tiles", str(tiles), "--no-progress", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "ours")]) == 0
    assert main([*base, "--out", str(tmp_path / "stamp"), "--layout", "stamp"]) == 0
    sid = pd.read_csv(store_cohort)["slide_id"][0]
    store = open_store(tiles / f"{sid}.zarr")
    mpp0 = float(store.attrs["mpp"]) / float(store.attrs.get("downsample", 1.0))
    with h5py.File(tmp_path / "stamp" / f"{sid}.h5") as h:
        assert set(h.keys()) == {"feats", "coords"}
        np.testing.assert_allclose(h["coords"][:], store.coords * mpp0)  # micrometres
        assert h.attrs["unit"] == "um" and h.attrs["extractor"] == "resnet18"
        assert h.attrs["tile_size_px"] == store.tile_size
        assert h.attrs["tile_size_um"] == pytest.approx(store.tile_size * float(store.attrs.get("downsample", 1.0)) * mpp0)
    ours = read_slide_features(tmp_path / "ours" / f"{sid}.h5")
    back = read_slide_features(tmp_path / "stamp" / f"{sid}.h5")
    assert (ours.format, back.format) == ("wsi-pipeline", "stamp")
    np.testing.assert_array_equal(back.features, ours.features)
    np.testing.assert_array_equal(back.coords, ours.coords)
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "stamp"), "--layout", "stamp"]) == 0  # up to date: skipped
    assert "0 written" in capsys.readouterr().out
    assert main([*base, "--out", str(tmp_path / "stamp")]) == 0  # our layout in that folder: every file rebuilt
    assert f"{len(pd.read_csv(store_cohort))} written" in capsys.readouterr().out
    assert read_slide_features(tmp_path / "stamp" / f"{sid}.h5").format == "wsi-pipeline"
