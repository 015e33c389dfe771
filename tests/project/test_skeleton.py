import subprocess
import sys

import pandas as pd
import pytest

from wsi_pipeline.manifests import ManifestError, read_manifest, validate_manifest
from wsi_pipeline.data.store import StoreWriter, is_complete, open_store


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "wsi_pipeline", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "wsi-pipeline" in out.stdout


def test_store_roundtrip_and_atomic_commit(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    tiles = rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    w = StoreWriter(tmp_path / "s.zarr", tile_size=8, capacity=2, attrs={"slide_id": "s"})
    w.append(tiles[:3], np.arange(6).reshape(3, 2), np.zeros((3, 2)), np.ones(3))
    w.append(tiles[3:], np.arange(4).reshape(2, 2), np.zeros((2, 2)), np.ones(2))
    assert not (tmp_path / "s.zarr").exists()  # nothing visible before commit
    w.commit()
    assert is_complete(tmp_path / "s.zarr")
    s = open_store(tmp_path / "s.zarr")
    assert len(s) == 5
    np.testing.assert_array_equal(s.read([4, 1, 4]), tiles[[4, 1, 4]])
    # a failed rebuild leaves the complete store intact
    w2 = StoreWriter(tmp_path / "s.zarr", tile_size=8, capacity=1, attrs={"slide_id": "s"})
    w2.append(tiles[:1], np.zeros((1, 2)), np.zeros((1, 2)), np.ones(1))
    w2.abort()
    assert len(open_store(tmp_path / "s.zarr")) == 5


def test_manifest_errors_name_the_problem(tmp_path):
    base = {"slide_id": ["a", "b"], "path": ["a.svs", "b.svs"], "label": [0, 1], "split": ["train", "val"], "cohort": ["x", "x"]}
    validate_manifest(pd.DataFrame(base), n_classes=2)
    with pytest.raises(ManifestError, match=r"duplicate slide_id a"):
        validate_manifest(pd.DataFrame({**base, "slide_id": ["a", "a"]}))
    with pytest.raises(ManifestError, match=r"label outside \[0, 2\).*b"):
        validate_manifest(pd.DataFrame({**base, "label": [0, 2]}), n_classes=2)
    with pytest.raises(ManifestError, match=r"patient\(s\) p1 appear in more than one split"):
        validate_manifest(pd.DataFrame({**base, "patient_id": ["p1", "p1"]}))
    with pytest.raises(FileNotFoundError, match="manifest not found"):
        read_manifest(tmp_path / "nope.csv")
