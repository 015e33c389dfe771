"""`wsi-pipeline features --cluster`: one Dask task per slide gives the same feature files as one process."""

from __future__ import annotations

import h5py
import pandas as pd
import pytest
import torch
from torch import nn

from wsi_pipeline.cli.main import main
from wsi_pipeline.inference.features import extract_features, features_path
from wsi_pipeline.manifests.schema import read_manifest


def _encoder() -> nn.Module:
    # torch's own layers only: a Dask worker unpickles them without importing this test module
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _h5(path) -> tuple[dict, dict]:
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = {k: v for k, v in f.attrs.items() if k != "created"}
    return data, attrs


@pytest.mark.slow
def test_features_on_a_local_cluster_equal_one_process(store_cohort, tmp_path) -> None:
    df = read_manifest(store_cohort).head(4)
    tiles = store_cohort.parent / "tiles"
    ref, got = tmp_path / "ref", tmp_path / "dask"
    # Dask's worker processes run torch with one thread (OMP_NUM_THREADS=1); so does the reference,
    # so both reduce in the same order and the features are equal bit for bit
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rep_ref = extract_features(df, tiles, ref, "seq", encoder=_encoder(), batch_size=7, progress=False, device="cpu")
    finally:
        torch.set_num_threads(threads)
    rep = extract_features(df, tiles, got, "seq", encoder=_encoder(), batch_size=7, progress=False, device="cpu", cluster="local:2")
    assert list(rep["status"]) == ["ok"] * 4
    cols = ["slide_id", "status", "n_tiles", "error"]
    pd.testing.assert_frame_equal(rep[cols], rep_ref[cols])
    pd.testing.assert_frame_equal(pd.read_csv(got / "features_report.csv")[cols], pd.read_csv(ref / "features_report.csv")[cols])
    for sid in df["slide_id"]:
        (d_ref, a_ref), (d_got, a_got) = _h5(features_path(ref, sid)), _h5(features_path(got, sid))
        assert a_got == a_ref and d_ref.keys() == d_got.keys() and len(d_ref["features"]) > 0
        for k in d_ref:
            assert d_got[k].dtype == d_ref[k].dtype and (d_got[k] == d_ref[k]).all(), k


def test_features_cluster_flags_are_checked(store_cohort, tmp_path, capsys) -> None:
    base = ["features", "--manifest", str(store_cohort), "--tiles", str(store_cohort.parent / "tiles"), "--out", str(tmp_path)]
    assert main(base + ["--cluster", "nowhere"]) == 2
    assert "wsi-pipeline features: error: --cluster 'nowhere'" in capsys.readouterr().err  # stderr, the one format
    assert main(base + ["--slurm-memory", "8GB"]) == 2
    assert not list(tmp_path.glob("*.h5"))
