"""bench-many: its table's columns, ratios computed from the measured times, and one tiny real run."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from benchmarks import many


def test_measure_takes_medians_and_ratios_of_the_measured_times() -> None:
    row = many.measure([(4.0, 6.0), (2.0, 3.0), (3.0, 5.0)], [(1.0, 2.0), (1.5, 1.0), (0.5, 1.5)], name="tile", n=100,
                       workers=2)
    assert tuple(asdict(row)) == many.COLUMNS
    assert row.wall_s == 3.0 and row.decode_wall_s == 1.0 and row.ratio == 3.0
    assert row.per_item_ms == 30.0 and row.decode_per_item_ms == 10.0
    assert row.cpu_per_item_ms == 50.0 and row.decode_cpu_per_item_ms == 15.0 and row.cpu_ratio == pytest.approx(3.33)
    with pytest.raises(ValueError):
        many.measure([], [(1.0, 1.0)], name="tile", n=1, workers=1)
    lines = many.table([row]).splitlines()
    assert lines[0].split() == list(many.COLUMNS) and lines[1].split()[0] == "tile"


def test_images_real_turned_and_generated(tmp_path: Path) -> None:
    from PIL import Image

    real = tmp_path / "real"
    real.mkdir()
    src = np.random.default_rng(0).integers(0, 255, (40, 30, 3), np.uint8)
    Image.fromarray(src).save(real / "a.png")
    paths = many.make_images(tmp_path / "imgs", 5, 24, real=real, generated_every=4)
    imgs = [np.asarray(Image.open(p)) for p in paths]
    assert all(a.shape == (24, 24, 3) for a in imgs)
    # the 2nd real pass is the first flipped; the 4th image is generated (not the source's pixels)
    assert not np.array_equal(imgs[0], imgs[1])
    assert np.array_equal(imgs[1], imgs[0][:, ::-1]) or imgs[0].shape != src.shape
    assert many.make_images(tmp_path / "imgs", 5, 24, real=real, generated_every=4) == paths  # kept
    gen = many.make_images(tmp_path / "gen", 3, 16, real=None)
    assert len(gen) == 3 and all(np.asarray(Image.open(p)).shape == (16, 16, 3) for p in gen)


def test_tiny_run_measures_both_sides(tmp_path: Path) -> None:
    res = many.main(["--n", "4", "--size", "96", "--tile-size", "32", "--workers", "1", "--repeats", "1",
                     "--real", str(tmp_path / "none"), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "r.json")])
    (row,) = res["rows"]
    assert tuple(row) == many.COLUMNS and row["stage"] == "tile" and row["n"] == 4
    (dw, dc), = res["runs"]["decode_wall_cpu_s"]
    (tw, tc), = res["runs"]["tile_wall_cpu_s"]
    assert dw > 0 and tw > 0 and dc > 0 and tc > 0
    assert row["ratio"] == round(round(tw, 3) / round(dw, 3), 2) or row["ratio"] == round(tw / dw, 2)
    assert row["cpu_ratio"] == round(tc / dc, 2)
    assert (tmp_path / "r.json").exists()
