"""bench-feature-scale's generated files: TRIDENT's layout as our reader reads it, the planted signal where
the docstring says, and a rerun that keeps complete files."""

from __future__ import annotations

import h5py
import numpy as np

from benchmarks.feature_scale import TILE_LEVEL0, write_feature_files


def test_generated_files_are_trident_files_with_the_planted_signal(tmp_path) -> None:
    from wsi_pipeline.data.feature_formats import read_slide_features

    folder, labels = write_feature_files(tmp_path, n_slides=4, n_tiles=40, dim=6)
    assert folder.name == "features_bench" and labels.read_text().splitlines()[1:] == ["s00000,0", "s00001,1", "s00002,0", "s00003,1"]
    with h5py.File(folder / "s00001.h5") as f:
        feats, coords = f["features"][:], f["coords"][:]
        assert f["coords"].attrs["patch_size_level0"] == TILE_LEVEL0
    # positives: the first 5 % of tiles (2 of 40) carry +1 on feature 0, reproduced from the seed here
    expected = np.random.default_rng(1).standard_normal((40, 6), dtype=np.float32)
    expected[:2, 0] += 1.0
    np.testing.assert_array_equal(feats, expected)
    side = 7  # ceil(sqrt(40))
    np.testing.assert_array_equal(coords[:8], np.array([[x % side, x // side] for x in range(8)]) * TILE_LEVEL0)
    got = read_slide_features(folder / "s00001.h5")
    np.testing.assert_array_equal(np.asarray(got.features), feats)
    np.testing.assert_array_equal(np.asarray(got.coords), coords)
    before = (folder / "s00000.h5").stat().st_mtime_ns
    write_feature_files(tmp_path, n_slides=4, n_tiles=40, dim=6)
    assert (folder / "s00000.h5").stat().st_mtime_ns == before  # a rerun keeps complete files
