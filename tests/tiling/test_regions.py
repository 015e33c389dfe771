"""QuPath GeoJSON regions: drawn in a generated file, they select exactly the tiles inside them.

The reference is computed here without shapely: each ring is clipped to a convex box (a tile, or a
tile within the exclusion rectangle) with Sutherland-Hodgman and its area taken with the shoelace
formula; a tile's fraction inside = outer rings' areas - holes' areas, minus the same within the
excluded rectangle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.data.store import open_store
from wsi_pipeline.synthetic.fields import FieldSpec, make_field, write_field
from wsi_pipeline.tiling.regions import read_regions, region_file
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.tiler import tile_slide

T = 64  # tile px: 16 x 16 tiles on the 1024 px field
N = 1024

# Tumor: a polygon with a triangular hole; Stroma: a MultiPolygon of two parts (one with a hole);
# an Ignore* rectangle overlapping Tumor; an unclassified point (no area: skipped)
TUMOR = [[[100, 90], [620, 130], [560, 560], [140, 500], [100, 90]], [[250, 250], [400, 260], [300, 380], [250, 250]]]
STROMA = [[[[680, 80], [980, 80], [980, 420], [680, 420], [680, 80]], [[760, 160], [900, 160], [900, 300], [760, 300], [760, 160]]],
          [[[600, 640], [960, 700], [800, 990], [620, 930], [600, 640]]]]
EXCLUDE = (430.0, 300.0, 700.0, 470.0)  # x0, y0, x1, y1


def _clip(poly: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    """Sutherland-Hodgman: the polygon (k, 2) clipped to an axis-aligned box."""
    x0, y0, x1, y1 = box
    edges = [(lambda p: p[0] >= x0, lambda a, b: _cut(a, b, 0, x0)), (lambda p: p[0] <= x1, lambda a, b: _cut(a, b, 0, x1)),
             (lambda p: p[1] >= y0, lambda a, b: _cut(a, b, 1, y0)), (lambda p: p[1] <= y1, lambda a, b: _cut(a, b, 1, y1))]
    pts = [tuple(p) for p in poly]
    for inside, cut in edges:
        out = []
        for i, cur in enumerate(pts):
            prev = pts[i - 1]
            if inside(cur):
                if not inside(prev):
                    out.append(cut(prev, cur))
                out.append(cur)
            elif inside(prev):
                out.append(cut(prev, cur))
        pts = out
        if not pts:
            break
    return np.asarray(pts, np.float64).reshape(-1, 2)


def _cut(a, b, axis: int, v: float):
    t = (v - a[axis]) / (b[axis] - a[axis])
    return (a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1]))


def _area(poly: np.ndarray) -> float:
    if len(poly) < 3:
        return 0.0
    x, y = poly[:, 0], poly[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


def _inside(polygons: list, box) -> float:
    """Area of (polygons with holes) within ``box``."""
    total = 0.0
    for rings in polygons:
        total += _area(_clip(np.asarray(rings[0][:-1], float), box))
        total -= sum(_area(_clip(np.asarray(h[:-1], float), box)) for h in rings[1:])
    return total


def _fraction(polygons: list, x: int, y: int) -> float:
    tile = (x, y, x + T, y + T)
    ex = (max(x, EXCLUDE[0]), max(y, EXCLUDE[1]), min(x + T, EXCLUDE[2]), min(y + T, EXCLUDE[3]))
    inside = _inside(polygons, tile)
    if ex[0] < ex[2] and ex[1] < ex[3]:
        inside -= _inside(polygons, ex)
    return inside / T**2


def _geojson(path: Path) -> Path:
    x0, y0, x1, y1 = EXCLUDE
    feats = [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": TUMOR},
         "properties": {"objectType": "annotation", "classification": {"name": "Tumor", "color": [200, 0, 0]}}},
        {"type": "Feature", "geometry": {"type": "MultiPolygon", "coordinates": STROMA},
         "properties": {"objectType": "annotation", "classification": {"name": "Stroma", "colorRGB": -3670016}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]]},
         "properties": {"objectType": "annotation", "classification": {"name": "Ignore*"}}},
        {"type": "Feature", "geometry": {"type": "Point", "coordinates": [10, 10]}, "properties": {}},
    ]
    path.write_text(json.dumps({"type": "FeatureCollection", "features": feats}))
    return path


@pytest.fixture(scope="module")
def covered(tmp_path_factory) -> Path:
    """A field fully covered by tissue: every tile is tissue, so only the regions decide."""
    f = make_field(FieldSpec((N, N), (240.0, 240.0, 240.0), cover=1.0), seed=9)
    return write_field(tmp_path_factory.mktemp("regions") / "s.svs", f)


def test_regions_select_exactly_the_tiles_inside_them(covered: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ann"
    folder.mkdir()
    gj = _geojson(folder / "s.geojson")
    regions, counts = read_regions(gj)
    assert counts == {"regions": 3, "skipped": 1} and region_file(folder, "s") == gj
    cfg = TilingConfig(tile_size=T, regions=str(folder), qc_mode="off", qc=False)
    r = tile_slide(SlideJob("s", str(covered)), tmp_path / "out", cfg)
    assert r.status == "ok", r
    st = open_store(tmp_path / "out" / "s.zarr")
    ref = {}
    for y in range(0, N, T):
        for x in range(0, N, T):
            fr = {"Stroma": _fraction([STROMA[0], STROMA[1]], x, y), "Tumor": _fraction([TUMOR], x, y)}
            ref[(x, y)] = (fr["Stroma"] + fr["Tumor"], fr)
    expected = {xy for xy, (fr, _) in ref.items() if fr >= 0.5}
    kept = {(int(x), int(y)) for x, y in st.coords}
    assert kept == expected and 20 < len(kept) < 200
    fraction, label = st.array("region_fraction"), st.array("region_label")
    classes = st.attrs["regions"]["classes"]
    assert classes == ["Stroma", "Tumor"]
    for (x, y), f, lab in zip(st.coords, fraction, label):
        fr, per = ref[(int(x), int(y))]
        assert abs(f - fr) < 1e-5
        assert classes[lab] == max(per, key=per.get)
    csv = pd.read_csv(tmp_path / "out" / "regions" / "s.csv", keep_default_na=False)
    assert len(csv) == len(st) and (csv["region_label"] == [classes[i] for i in label]).all()
    # include only Tumor: Stroma tiles go, and a tile half Tumor half Stroma no longer reaches 0.5
    cfg = TilingConfig(tile_size=T, regions=str(gj), region_include=("tum*",), qc_mode="off", qc=False)
    tile_slide(SlideJob("s", str(covered)), tmp_path / "tumor", cfg)
    kept = {(int(x), int(y)) for x, y in open_store(tmp_path / "tumor" / "s.zarr").coords}
    assert kept == {xy for xy, (_, per) in ref.items() if per["Tumor"] >= 0.5}


def test_missing_and_malformed_regions_are_clear_errors(covered: Path, tmp_path: Path) -> None:
    r = tile_slide(SlideJob("s", str(covered)), tmp_path / "o", TilingConfig(regions=str(tmp_path), qc=False))
    assert r.status == "failed" and "no " in r.error and "s.geojson" in r.error
    bad = tmp_path / "bad.geojson"
    bad.write_text('{"type": "Polygon"')
    with pytest.raises(ValueError, match="bad.geojson is not readable JSON"):
        read_regions(bad)
    bad.write_text('{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [1]]]}}')
    with pytest.raises(ValueError, match="feature 0 has a malformed Polygon"):
        read_regions(bad)


def test_qc_image_outlines_the_regions(covered: Path, tmp_path: Path) -> None:
    """The regions are drawn on the QC image (blue), along their rings and nowhere else."""
    import cv2

    from wsi_pipeline.tiling.qc import render_qc

    thumb = np.full((200, 300, 3), 230, np.uint8)
    ring = np.array([[40.0, 30.0], [520.0, 60.0], [400.0, 340.0], [40.0, 30.0]])  # level-0 px, downsample 2
    img = render_qc(thumb, 2.0, np.zeros((0, 2)), 32.0, outlines=[ring], min_side=1, min_tile_px=1)
    assert img.shape[:2] == thumb.shape[:2]  # no zoom: image px = level-0 px / 2
    blue = (img[..., 2] > 150) & (img[..., 0] < 120)
    ys, xs = np.nonzero(blue)
    # every blue px lies within 1.5 px of one of the ring's segments (in image px)
    pts = ring / 2.0
    def dist(p, a, b):
        t = np.clip(np.dot(p - a, b - a) / np.dot(b - a, b - a), 0, 1)
        return np.linalg.norm(p - (a + t * (b - a)))
    d = [min(dist(np.array([x, y], float), pts[i], pts[i + 1]) for i in range(3)) for x, y in zip(xs, ys)]
    assert len(d) > 300 and max(d) < 1.5
    # through the tiler: the QC image of a slide tiled with --regions carries the outline and says so
    folder = tmp_path / "ann"
    folder.mkdir()
    _geojson(folder / "s.geojson")
    tile_slide(SlideJob("s", str(covered)), tmp_path / "out", TilingConfig(tile_size=T, regions=str(folder), qc_mode="off"))
    qc = cv2.cvtColor(cv2.imread(str(tmp_path / "out" / "qc" / "s.png")), cv2.COLOR_BGR2RGB)
    assert ((qc[..., 2] > 200) & (qc[..., 0] < 60) & (qc[..., 1] < 140)).sum() > 200
