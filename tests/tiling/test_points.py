"""Tiles on given points (tile --points): pixels against crops cut in the test from the reader's own
decode (odd and even sizes, edges padded or skipped), stored classes and points, the file layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
from PIL import Image

from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.data.store import open_store
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.points import mask_fraction, point_origins, read_points

W, H = 61, 47


def _image(seed: int, h: int = H, w: int = W) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = rng.integers(60, 200, (h, w, 3), dtype=np.uint8)  # every pixel "tissue" for the greyscale rule
    img[:, w - 10 :] = 245  # a glass band at the right
    return img


def _reference(img: np.ndarray, x: float, y: float, T: int, fill: int = 255) -> np.ndarray:
    """The tile the contract describes, cut from the decoded image padded with the glass colour."""
    padded = np.pad(img, ((T, T), (T, T), (0, 0)), constant_values=fill)
    px, py = int(np.floor(x)), int(np.floor(y))
    x0, y0 = px - T // 2 + T, py - T // 2 + T
    return padded[y0 : y0 + T, x0 : x0 + T]


POINTS = [  # (x, y, class): inside, on the corners and edges, fractional, outside
    (30.0, 20.0, "epithelial"), (0.0, 0.0, "fibroblast"), (60.9, 46.2, "epithelial"), (3.4, 44.99, ""),
    (59.0, 2.0, "inflammatory"), (13.5, 23.7, "epithelial"), (61.5, 10.0, "fibroblast"), (-0.5, 5.0, "others"),
]


def _cfg(T: int, **kw) -> TilingConfig:
    return TilingConfig(method="greyscale", qc_mode="off", tile_size=T, points=kw.pop("points"), qc=False, **kw)


@pytest.mark.parametrize("T", [27, 32, 8])
@pytest.mark.parametrize("fmt", ["png", "tiled-tiff"])
def test_point_tiles_equal_crops_of_the_decoded_image_padded_at_edges(tmp_path: Path, T: int, fmt: str) -> None:
    img = _image(1)
    if fmt == "png":
        path = tmp_path / "s1.png"
        Image.fromarray(img).save(path)
        ref_img = np.asarray(Image.open(path).convert("RGB"))
    else:
        path = tmp_path / "s1.tif"
        tifffile.imwrite(path, img, photometric="rgb", tile=(16, 16), compression="zlib")
        ref_img = tifffile.imread(path)
    rows = [{"slide_id": "s1", "x": x, "y": y, "class": c} for x, y, c in POINTS]
    rows.append({"slide_id": "other", "x": 5, "y": 5, "class": "epithelial"})  # another slide's row
    pd.DataFrame(rows).to_csv(tmp_path / "points.csv", index=False)
    rep = tile_cohort([SlideJob("s1", str(path), mpp=0.5)], tmp_path / "out", _cfg(T, points=str(tmp_path / "points.csv")),
                      workers=0, progress=False)
    assert rep.ok, rep.results
    st = open_store(tmp_path / "out" / "s1.zarr")
    inside = [(x, y, c) for x, y, c in POINTS if 0 <= x < W and 0 <= y < H]
    assert len(st) == len(inside) == 6
    tiles = st.read()
    names = st.attrs["point_classes"]
    assert names == ["epithelial", "fibroblast", "inflammatory", "others"]  # the classes of all the slide's points
    classes = st.array("point_class")
    np.testing.assert_array_equal(st.array("point_xy"), [(x, y) for x, y, _ in inside])
    for k, (x, y, c) in enumerate(inside):
        np.testing.assert_array_equal(tiles[k], _reference(ref_img, x, y, T), err_msg=f"point {(x, y)}")
        assert (names[classes[k]] if classes[k] >= 0 else "") == c
        px, py = int(np.floor(x)), int(np.floor(y))
        assert tuple(st.coords[k]) == (px - T // 2, py - T // 2)
        assert tuple(st.grid[k]) == (px // T, py // T)
        assert (tiles[k][T // 2, T // 2] == ref_img[py, px]).all()  # the point's pixel at the tile's centre pixel
    info = st.attrs["points"]
    assert info["n_points"] == 8 and info["n_outside"] == 2 and info["edge"] == "pad" and info["filter"] is False
    assert info["n_padded"] == sum(1 for x, y, _ in inside
                                   if not (np.floor(x) - T // 2 >= 0 and np.floor(y) - T // 2 >= 0
                                           and np.floor(x) - T // 2 + T <= W and np.floor(y) - T // 2 + T <= H))
    report = pd.read_csv(tmp_path / "out" / "tiling_report.csv", keep_default_na=False)
    assert report.loc[0, "n_tiles"] == 6 and "2 outside the image" in report.loc[0, "note"]


def test_skip_leaves_out_and_counts_tiles_crossing_the_edge(tmp_path: Path) -> None:
    img = _image(2)
    path = tmp_path / "s.png"
    Image.fromarray(img).save(path)
    T = 27
    pd.DataFrame([{"slide_id": "s", "x": x, "y": y, "class": c} for x, y, c in POINTS]).to_csv(tmp_path / "p.csv", index=False)
    rep = tile_cohort([SlideJob("s", str(path))], tmp_path / "out",
                      _cfg(T, points=str(tmp_path / "p.csv"), points_edge="skip"), workers=0, progress=False)
    assert rep.ok, rep.results
    st = open_store(tmp_path / "out" / "s.zarr")
    whole = [(x, y) for x, y, _ in POINTS
             if np.floor(x) - 13 >= 0 and np.floor(y) - 13 >= 0 and np.floor(x) + 14 <= W and np.floor(y) + 14 <= H]
    assert [tuple(p) for p in st.array("point_xy")] == whole == [(30.0, 20.0), (13.5, 23.7)]
    for k, (x, y) in enumerate(whole):
        np.testing.assert_array_equal(st.read([k])[0], img[int(y) - 13 : int(y) + 14, int(x) - 13 : int(x) + 14])
    assert st.attrs["points"]["n_edge_skipped"] == 4 and st.attrs["points"]["n_outside"] == 2


def test_points_filter_applies_the_foreground_rule_only_when_asked(tmp_path: Path) -> None:
    img = _image(3)
    path = tmp_path / "s.png"
    Image.fromarray(img).save(path)
    pd.DataFrame({"x": [20, 57], "y": [20, 20]}).to_csv(tmp_path / "p.csv", index=False)  # tissue; the glass band
    (tmp_path / "pts").mkdir()
    (tmp_path / "p.csv").rename(tmp_path / "pts" / "s.csv")  # a folder of <slide_id>.csv
    cfg = dict(points=str(tmp_path / "pts"), min_foreground=0.6)
    for filt, expect in ((False, [20, 57]), (True, [20])):
        out = tmp_path / f"out{filt}"
        assert tile_cohort([SlideJob("s", str(path))], out, _cfg(8, points_filter=filt, **cfg), workers=0, progress=False).ok
        st = open_store(out / "s.zarr")
        assert list(st.array("point_xy")[:, 0]) == expect
        grey = (0.299 * img[..., 0] + 0.587 * img[..., 1] + 0.114 * img[..., 2])
        for k, x in enumerate(expect):  # the stored foreground is the greyscale fraction of the tile
            g = np.rint(grey[16:24, x - 4 : x + 4])
            assert st.foreground[k] == pytest.approx(((g >= 3) & (g <= 230)).mean(), abs=1 / 64 + 1e-6)
        assert st.attrs["points"]["n_filtered"] == (1 if filt else 0)
        assert set(st.array("point_class")) == {-1}  # no class column


def test_qupath_geojson_points_and_cell_outlines(tmp_path: Path) -> None:
    img = _image(4)
    path = tmp_path / "g.png"
    Image.fromarray(img).save(path)
    feats = [
        {"type": "Feature", "geometry": {"type": "Point", "coordinates": [10.2, 12.8]},
         "properties": {"objectType": "detection", "classification": {"name": "Tumor", "color": [200, 0, 0]}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[20, 20], [30, 20], [30, 26], [20, 26], [20, 20]]]},
         "properties": {"objectType": "detection", "classification": {"name": "Stroma"}}},
        {"type": "Feature", "geometry": {"type": "MultiPoint", "coordinates": [[40, 5], [41, 6]]}, "properties": {}},
    ]
    (tmp_path / "pts").mkdir()
    (tmp_path / "pts" / "g.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": feats}))
    pts = read_points(tmp_path / "pts", "g")
    np.testing.assert_allclose(pts.xy, [(10.2, 12.8), (25.0, 23.0), (40, 5), (41, 6)])
    assert pts.classes == ["Tumor", "Stroma", "", ""]
    assert tile_cohort([SlideJob("g", str(path))], tmp_path / "out", _cfg(9, points=str(tmp_path / "pts")),
                       workers=0, progress=False).ok
    st = open_store(tmp_path / "out" / "g.zarr")
    assert st.attrs["point_classes"] == ["Stroma", "Tumor"] and list(st.array("point_class")) == [1, 0, -1, -1]
    for k, (x, y) in enumerate(pts.xy):
        np.testing.assert_array_equal(st.read([k])[0], _reference(img, x, y, 9))


def test_bad_point_files_are_refused_before_any_slide_with_the_file_named(tmp_path: Path) -> None:
    """A points file that is not one is refused once, before any slide (issue 51); a slide of a points folder
    without its own file fails alone, naming the file looked for."""
    path = tmp_path / "s.png"
    Image.fromarray(_image(5)).save(path)
    pd.DataFrame({"slide_id": ["s"], "x": [3]}).to_csv(tmp_path / "nox.csv", index=False)
    pd.DataFrame({"slide_id": ["s"], "x": ["a"], "y": [2]}).to_csv(tmp_path / "nan.csv", index=False)
    for name, match in (("nox.csv", r"nox.csv: no column\(s\) \['y'\]"), ("nan.csv", r"nan.csv: row 2 has x='a'")):
        with pytest.raises(ValueError, match=match):
            tile_cohort([SlideJob("s", str(path))], tmp_path / f"out_{name}", _cfg(8, points=str(tmp_path / name)),
                        workers=0, progress=False)
        assert not (tmp_path / f"out_{name}").exists()
    (tmp_path / "empty").mkdir()
    rep = tile_cohort([SlideJob("s", str(path))], tmp_path / "o3", _cfg(8, points=str(tmp_path / "empty")), workers=0, progress=False)
    assert rep.results[0].status == "failed" and "no " in rep.results[0].error and "s.csv" in rep.results[0].error
    with pytest.raises(ValueError, match="level 0"):
        TilingConfig(points="p.csv", mpp_target=0.5)


def test_origins_and_mask_fraction_rules() -> None:
    xy = np.array([[0.0, 0.0], [9.99, 9.99], [10.01, 3.0], [-0.01, 3.0], [10.0, 10.0]])
    w = point_origins(xy, 5, (10, 10), "pad")
    assert w.index.tolist() == [0, 1, 4] and w.n_outside == 2 and w.n_padded == 3
    assert w.origins.tolist() == [[-2, -2], [7, 7], [7, 7]]  # on the far border (x = W): the last pixel
    s = point_origins(np.array([[2.0, 2.0], [1.0, 5.0]]), 5, (10, 10), "skip")
    assert s.index.tolist() == [0] and s.n_edge_skipped == 1
    mask = np.zeros((4, 4), bool)
    mask[1:3, 1:3] = True  # 2 level-0 px per mask px
    got = mask_fraction(mask, 2.0, np.array([[2, 2], [0, 0], [-2, -2], [6, 6]]), 4)
    np.testing.assert_allclose(got, [1.0, 0.25, 0.0, 0.0])


def test_a_slide_without_points_gets_an_empty_complete_store(tmp_path: Path) -> None:
    path = tmp_path / "s.png"
    Image.fromarray(_image(6)).save(path)
    pd.DataFrame({"slide_id": ["other"], "x": [3], "y": [3]}).to_csv(tmp_path / "p.csv", index=False)
    rep = tile_cohort([SlideJob("s", str(path))], tmp_path / "out", _cfg(27, points=str(tmp_path / "p.csv")), workers=0, progress=False)
    assert rep.ok and rep.results[0].n_tiles == 0 and rep.results[0].note.startswith("points: 0 of 0 tiled")
    st = open_store(tmp_path / "out" / "s.zarr")
    assert len(st) == 0 and st.array("point_class").shape == (0,) and st.array("point_xy").shape == (0, 2)
