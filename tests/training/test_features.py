"""Frozen-encoder feature files: content equals the encoder applied to the store's tiles; skip-if-done; CLI."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from torch import nn

from wsi_pipeline.inference.features import extract_features, features_path, read_features, weights_sha256
from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.manifests.schema import read_manifest
from wsi_pipeline.data.store import open_store, store_path


class StandIn(nn.Module):
    """Tiny encoder with BatchNorm: [k, 3, T, T] -> [k, 8]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


#: The features are computed in float64 (the ``float64`` fixture) and stored as float32, so they
#: differ from the float64 reference by the rounding to float32 (<= 2**-24 relative) plus float64
#: noise of the differently batched computation (~1e-15): within 2 float32 ulps (2**-22 relative).
F32_STORED = 2.0**-22


def _reference(encoder: nn.Module, store_dir, slide_id: str) -> tuple[np.ndarray, np.ndarray]:
    store = open_store(store_path(store_dir, slide_id))
    device = next(encoder.parameters()).device  # extraction moved it to its device (the GPU, where there is one)
    with torch.no_grad():
        return encoder.eval()(tiles_to_tensor(store.read(), device=device)).cpu().numpy(), store.coords


def test_features_equal_encoder_on_store_tiles(store_cohort, tmp_path, float64) -> None:
    df = read_manifest(store_cohort).head(3)
    tiles = store_cohort.parent / "tiles"
    torch.manual_seed(0)
    enc = StandIn()
    report = extract_features(df, tiles, tmp_path, "standin", encoder=enc, batch_size=5, progress=False)
    assert list(report["status"]) == ["ok"] * 3
    for sid in df["slide_id"]:
        feats, coords, attrs = read_features(features_path(tmp_path, sid))
        ref, ref_coords = _reference(enc, tiles, sid)
        assert feats.dtype == np.float32 and feats.shape == ref.shape
        np.testing.assert_allclose(feats, ref, rtol=F32_STORED, atol=0)
        np.testing.assert_array_equal(coords, ref_coords)
        assert attrs["n_tiles"] == len(ref) and attrs["encoder"] == "standin"
        assert attrs["feature_dim"] == 8 and attrs["complete"]
        assert attrs["weights_sha256"] == weights_sha256(copy.deepcopy(enc))
    assert (tmp_path / "features_report.csv").is_file()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_up_to_date_files_are_skipped_and_new_weights_rewrite(store_cohort, tmp_path, float64) -> None:
    df = read_manifest(store_cohort).head(2)
    tiles = store_cohort.parent / "tiles"
    torch.manual_seed(1)
    enc = StandIn()
    extract_features(df, tiles, tmp_path, "standin", encoder=enc, progress=False)
    path = features_path(tmp_path, df["slide_id"].iloc[0])
    mtime = path.stat().st_mtime_ns
    again = extract_features(df, tiles, tmp_path, "standin", encoder=enc, progress=False)
    assert list(again["status"]) == ["skipped", "skipped"]
    assert path.stat().st_mtime_ns == mtime
    with torch.no_grad():
        enc.conv.weight[0, 0, 0, 0] += 0.1
    changed = extract_features(df, tiles, tmp_path, "standin", encoder=enc, progress=False)
    assert list(changed["status"]) == ["ok", "ok"]
    feats, _, attrs = read_features(path)
    np.testing.assert_allclose(feats, _reference(enc, tiles, df["slide_id"].iloc[0])[0], rtol=F32_STORED, atol=0)
    assert attrs["weights_sha256"] == weights_sha256(enc)


def test_missing_store_is_recorded_and_others_go_on(store_cohort, tmp_path) -> None:
    df = read_manifest(store_cohort).head(2).copy()
    df.loc[df.index[0], "slide_id"] = "no_such_slide"
    report = extract_features(df, store_cohort.parent / "tiles", tmp_path, "standin", encoder=StandIn(), progress=False)
    assert list(report["status"]) == ["failed", "ok"]
    assert "run `wsi-pipeline tile` first" in report["error"].iloc[0]
    with pytest.raises(FileNotFoundError, match="run `wsi-pipeline features` first"):
        read_features(features_path(tmp_path, "no_such_slide"))


def test_a_slide_the_tiler_skipped_is_skipped_not_failed(store_cohort, tmp_path) -> None:
    """A fluorescence slide left untiled by rule has no store: features says "skipped" with the tiler's reason."""
    import pandas as pd

    from wsi_pipeline.inference.features import LEFT_OUT_NOTE

    df = read_manifest(store_cohort).head(2).copy()
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    for sid in df["slide_id"]:
        (tiles / f"{sid}.zarr").symlink_to(store_cohort.parent / "tiles" / f"{sid}.zarr")
    pd.DataFrame([{"slide_id": "dapi", "status": "skipped", "n_tiles": 0,
                   "note": "skipped: dark background (fluorescence?)"}]).to_csv(tiles / "tiling_report.csv", index=False)
    df = pd.concat([df, df.head(1).assign(slide_id="dapi")])
    report = extract_features(df, tiles, tmp_path / "f", "standin", encoder=StandIn(), progress=False)
    by_id = report.set_index("slide_id")
    assert by_id.loc["dapi", "status"] == "skipped" and by_id.loc["dapi", "note"].startswith(LEFT_OUT_NOTE)
    assert "dark background" in by_id.loc["dapi", "note"] and (by_id.drop("dapi")["status"] == "ok").all()
    on_disk = pd.read_csv(tmp_path / "f" / "features_report.csv", keep_default_na=False).set_index("slide_id")
    assert sorted(on_disk.index) == sorted(df["slide_id"]) and on_disk.loc["dapi", "status"] == "skipped"


@pytest.mark.slow
def test_cli_resnet18(store_cohort, tmp_path, float64) -> None:
    encoders = pytest.importorskip("wsi_pipeline.models.encoders")
    import argparse

    from wsi_pipeline.cli import features as cli_features
    from wsi_pipeline.manifests.schema import write_manifest

    def main(argv: list[str]) -> int:
        # only this command's parser, so a half-written sibling command cannot break the test
        parser = argparse.ArgumentParser()
        cli_features.register(parser.add_subparsers())
        args = parser.parse_args(argv)
        return args.func(args)

    df = read_manifest(store_cohort).head(3)
    manifest = write_manifest(df, tmp_path / "manifest.csv")
    out = tmp_path / "feats"
    argv = ["features", "--manifest", str(manifest), "--tiles", str(store_cohort.parent / "tiles"),
            "--out", str(out), "--batch-size", "7", "--device", "cpu"]
    assert main(argv) == 0
    torch.manual_seed(0)  # unweighted encoders are initialised from seed 0
    enc = encoders.build_encoder("resnet18")
    for sid in df["slide_id"]:
        feats, _, attrs = read_features(features_path(out, sid))
        np.testing.assert_allclose(feats, _reference(enc, store_cohort.parent / "tiles", sid)[0], rtol=F32_STORED, atol=0)
        assert attrs["encoder"] == "resnet18" and feats.shape[1] == 512
    assert len(list(out.glob("*.h5"))) == len(df)
    assert main(argv) == 0  # second run: everything up to date
    with pytest.raises(SystemExit) as e:  # an unknown encoder is a usage error (choices from the registry)
        main(argv[:-2] + ["--encoder", "nope"])
    assert e.value.code == 2


def test_re_extraction_says_why_and_orphan_files_are_reported(store_cohort, tmp_path, caplog) -> None:
    import logging

    df = read_manifest(store_cohort).head(3)
    tiles = store_cohort.parent / "tiles"
    torch.manual_seed(1)
    enc = StandIn()
    extract_features(df, tiles, tmp_path, "standin", encoder=enc, progress=False)
    with torch.no_grad():
        enc.conv.weight[0, 0, 0, 0] += 0.1
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.inference.features"):
        report = extract_features(df.head(2), tiles, tmp_path, "standin", encoder=enc, progress=False)
    assert list(report["status"]) == ["ok", "ok"]
    text = [r.getMessage() for r in caplog.records]
    why = [t for t in text if t.startswith("re-extracted")]
    assert len(why) == 1 and "2 slide(s): encoder weights changed" in why[0]
    orphan = [t for t in text if "not in this manifest" in t]
    assert len(orphan) == 1 and str(df["slide_id"].iloc[2]) in orphan[0]
    assert str(df["slide_id"].iloc[2]) not in set(report["slide_id"])  # ignored, not rebuilt or listed


def test_bad_slide_policy_a_damaged_store_fails_its_slide_and_a_bug_stops_the_run(store_cohort, tmp_path,
                                                                                monkeypatch) -> None:
    """wsi_pipeline.failures: a store whose tiles do not decode is a failed row and the next slide is embedded;
    a TypeError inside the per-slide work (a bug) stops the run instead of failing each slide."""
    import shutil

    import pandas as pd

    from wsi_pipeline.data.store import StoreDamagedError
    from wsi_pipeline.inference import features as features_mod

    df = read_manifest(store_cohort).head(3)
    ids = list(df["slide_id"])
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    for sid in ids:
        shutil.copytree(store_cohort.parent / "tiles" / f"{sid}.zarr", tiles / f"{sid}.zarr")
    for chunk in (tiles / f"{ids[1]}.zarr" / "tiles").glob("c*"):  # every tile shard of the middle slide damaged
        if chunk.is_file():
            chunk.write_bytes(b"\x00" * 16)
    report = extract_features(df, tiles, tmp_path / "f", "standin", encoder=StandIn(), progress=False)
    assert list(report["status"]) == ["ok", "failed", "ok"]
    assert report["error"].iloc[1].startswith(StoreDamagedError.__name__)
    on_disk = pd.read_csv(tmp_path / "f" / "features_report.csv", keep_default_na=False)
    assert list(on_disk["status"]) == ["ok", "failed", "ok"]

    real = features_mod._embed_store

    def buggy(store, *args, **kwargs):
        if store.slide_id == ids[1]:
            raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'int'")
        return real(store, *args, **kwargs)

    monkeypatch.setattr(features_mod, "_embed_store", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        extract_features(df, store_cohort.parent / "tiles", tmp_path / "g", "standin", encoder=StandIn(), progress=False)
    on_disk = pd.read_csv(tmp_path / "g" / "features_report.csv", keep_default_na=False)
    assert list(on_disk["slide_id"]) == ids[:1] and list(on_disk["status"]) == ["ok"]  # the rows before the bug
