"""``tile --config PIPELINE.yaml``: the pipeline's data.tiling through the config builder train uses, the
tile flags given on the command line as overrides, the same store as the equivalent flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from wsi_pipeline.data.store import open_store


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    for i in range(2):
        img = np.full((90, 100, 3), 240, np.uint8)
        img[10:70, 5 + 20 * i : 80] = rng.integers(80, 190, (60, 75 - 20 * i, 3))
        Image.fromarray(img).save(tmp_path / "images" / f"im{i}.png")
    pd.DataFrame({"slide_id": ["im0", "im1"], "label": [0, 1], "mpp": [0.5, 0.5], "split": ["train", "val"]}).to_csv(
        tmp_path / "labels.csv", index=False)
    pd.DataFrame({"slide_id": ["im0", "im0", "im1"], "x": [3, 50, 60], "y": [40, 30, 88.5], "class": ["a", "b", "a"]}).to_csv(
        tmp_path / "pts.csv", index=False)
    return tmp_path


def _yaml(root: Path, tiling: dict) -> Path:
    raw = {"name": "c", "data": {"manifest": str(root / "m.csv"), "tiles_dir": str(root / "yaml_tiles"),
                                 "features_dir": str(root / "f"), "n_classes": 2, "tiling": tiling},
           "methods": [{"name": "fz", "strategy": "frozen"}]}
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _same_stores(a: Path, b: Path, ids: list[str]) -> None:
    for sid in ids:
        x, y = open_store(a / f"{sid}.zarr"), open_store(b / f"{sid}.zarr")
        np.testing.assert_array_equal(x.read(), y.read())
        np.testing.assert_array_equal(x.coords, y.coords)
        np.testing.assert_array_equal(x.grid, y.grid)
        np.testing.assert_array_equal(x.foreground, y.foreground)
        assert x.attrs["tiling_identity"] == y.attrs["tiling_identity"]
        for key in ("point_class", "point_xy"):
            if "points" in x.attrs:
                np.testing.assert_array_equal(x.array(key), y.array(key))


def test_tile_config_gives_the_store_of_the_equivalent_flags(folder: Path) -> None:
    from wsi_pipeline.cli.main import main

    assert main(["manifest", "folder", "--slides", str(folder / "images"), "--labels", str(folder / "labels.csv"),
                 "--out", str(folder / "m.csv")]) == 0
    cfg = _yaml(folder, {"method": "greyscale", "tile_size": 16, "min_foreground": 0.5, "qc_mode": "off", "grey_max": 220})
    # data.manifest and data.tiles_dir are the defaults of --manifest and --out
    assert main(["tile", "--config", str(cfg), "--workers", "0"]) == 0
    assert main(["tile", "--manifest", str(folder / "m.csv"), "--out", str(folder / "flag_tiles"), "--workers", "0",
                 "--method", "greyscale", "--tile-size", "16", "--min-foreground", "0.5", "--qc", "off",
                 "--grey-max", "220"]) == 0
    _same_stores(folder / "yaml_tiles", folder / "flag_tiles", ["im0", "im1"])
    st = open_store(folder / "yaml_tiles" / "im0.zarr")
    assert st.attrs["tile_size"] == 16 and st.attrs["grey_max"] == 220 and st.attrs["method"] == "greyscale"
    # --set changes data.tiling as train's --set does; a flag given overrides data.tiling, a flag left out does not
    assert main(["tile", "--config", str(cfg), "--set", "data.tiling.tile_size=20", "--out", str(folder / "set"),
                 "--workers", "0"]) == 0
    assert open_store(folder / "set" / "im0.zarr").attrs["tile_size"] == 20
    assert main(["tile", "--config", str(cfg), "--tile-size", "256", "--out", str(folder / "flag_over"), "--workers", "0",
                 "--min-foreground", "0"]) == 0
    over = open_store(folder / "flag_over" / "im0.zarr").attrs
    assert over["tile_size"] == 256 and over["method"] == "greyscale" and over["grey_max"] == 220
    # points in data.tiling: the store of tile --points with the same settings
    pts = _yaml(folder, {"tile_size": 27, "qc_mode": "off", "points": str(folder / "pts.csv"), "points_edge": "skip"})
    assert main(["tile", "--config", str(pts), "--out", str(folder / "p_yaml"), "--workers", "0"]) == 0
    assert main(["tile", "--manifest", str(folder / "m.csv"), "--out", str(folder / "p_flags"), "--workers", "0",
                 "--tile-size", "27", "--qc", "off", "--points", str(folder / "pts.csv"), "--points-edge", "skip"]) == 0
    _same_stores(folder / "p_yaml", folder / "p_flags", ["im0", "im1"])
    assert len(open_store(folder / "p_yaml" / "im0.zarr")) == 1  # (3, 40) crosses the left edge: skipped
    assert open_store(folder / "p_yaml" / "im1.zarr").attrs["points"]["n_edge_skipped"] == 1


def test_tile_config_errors_name_the_problem(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from wsi_pipeline.cli.main import main

    bad = _yaml(folder, {"tile_size": 16, "grey_max": 300})
    assert main(["tile", "--config", str(bad), "--workers", "0"]) == 2
    assert "c.yaml: data.tiling.grey_max=300; expected a grey level 0..255 or 'auto'" in capsys.readouterr().err
    # without --config, --set and the flags override an empty data.tiling: bounds are the dataclass's
    assert main(["tile", "--slides", str(folder / "images"), "--set", "data.tiling.tile_size=3"]) == 2
    assert "data.tiling.tile_size=3; expected a value >= 8" in capsys.readouterr().err
    assert main(["tile", "--slides", str(folder / "images"), "--out", str(folder / "o"), "--min-foreground", "1.5"]) == 2
    assert "data.tiling.min_foreground=1.5; expected a value <= 1.0" in capsys.readouterr().err
    assert main(["tile", "--slides", str(folder / "images"), "--set", "train.epochs=2"]) == 2
    assert "--set train.epochs=2: without --config only data.tiling keys can be set" in capsys.readouterr().err
    assert main(["tile", "--slides", str(folder / "images")]) == 2
    assert "--out DIR" in capsys.readouterr().err


def test_tile_config_set_equals_the_flags_and_flags_are_overrides(folder: Path) -> None:
    """``tile --config x.yaml --set data.tiling.tile_size=64`` makes the stores of the same run with flags; each
    tiling flag is the override of its data.tiling key (the settings pass one builder either way)."""
    import dataclasses

    from wsi_pipeline.cli.main import main
    from wsi_pipeline.cli._common import flag_values
    from wsi_pipeline.cli.main import build_parser
    from wsi_pipeline.cli.tile import tiling_from_args

    assert main(["manifest", "folder", "--slides", str(folder / "images"), "--labels", str(folder / "labels.csv"),
                 "--out", str(folder / "m.csv")]) == 0
    cfg = _yaml(folder, {"method": "otsu", "qc_mode": "flag", "qc_params": {"pen_fraction": 0.2}, "min_foreground": 0.4})
    assert main(["tile", "--config", str(cfg), "--set", "data.tiling.tile_size=64", "--workers", "0",
                 "--out", str(folder / "by_set")]) == 0
    assert main(["tile", "--manifest", str(folder / "m.csv"), "--out", str(folder / "by_flags"), "--workers", "0",
                 "--method", "otsu", "--qc", "flag", "--qc-pen", "0.2", "--min-foreground", "0.4", "--tile-size", "64"]) == 0
    _same_stores(folder / "by_set", folder / "by_flags", ["im0", "im1"])
    ident = open_store(folder / "by_set" / "im0.zarr").attrs["tiling_identity"]
    assert ident["tile_size"] == 64 and ident["method"] == "otsu" and ident["qc_params"]["pen_fraction"] == 0.2
    # the flags set their data.tiling keys: the same section as --set gives, and --set has the last word
    flags = ["--method", "otsu", "--tile-size", "64", "--qc", "flag", "--region-include", "Tumour*", "--qc-drop", "pen"]
    ns = build_parser().parse_args(["tile", *flags])
    assert flag_values(ns) == {"data.tiling.method": "otsu", "data.tiling.tile_size": 64, "data.tiling.qc_mode": "flag",
                               "data.tiling.region_include": ["Tumour*"], "data.tiling.qc_params.drop": ["pen"]}
    by_flags = tiling_from_args(ns)[0]
    ns2 = build_parser().parse_args(["tile", "--set", "data.tiling.method=otsu", "--set", "data.tiling.tile_size=64",
                                     "--set", "data.tiling.qc_mode=flag", "--set", "data.tiling.region_include=[Tumour*]",
                                     "--set", "data.tiling.qc_params.drop=[pen]"])
    assert tiling_from_args(ns2)[0] == by_flags
    both = build_parser().parse_args(["tile", *flags, "--set", "data.tiling.tile_size=128"])
    assert tiling_from_args(both)[0] == dataclasses.replace(by_flags, tile_size=128)
