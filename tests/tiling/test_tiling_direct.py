"""The tiler reads JPEG TIFF levels through the direct stored-tile decoder, with several threads, and
writes exactly the store the OpenSlide read path writes.

References computed here, independently of the package: OpenSlide (the library itself) reads the
read level whole; the tile formula of docs/tiling.md cuts (and, off a level's resolution, resizes
with cv2.INTER_AREA) each tile; cv2's grey test decides which tiles are kept. The stored tiles the
direct path decodes are counted against the stored tiles under the candidate tiles' sources.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import openslide
import pytest
import tifffile

from wsi_pipeline.slides.direct import DirectTiles
from wsi_pipeline.slides.opener import open_slide
from wsi_pipeline.data.store import open_store
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.config.tiling_params import GreyscaleParams
from wsi_pipeline.tiling.plan import plan_tiles
from wsi_pipeline.tiling.tiler import tile_slide

from test_tiling_pixels import MPP, T, _formula, _grey_fraction  # MPP: given to the tiler as the manifest's (a generic TIFF has none)


def _write_jpeg_tiff(path: Path, stored: int, size: tuple[int, int] = (1280, 1024)) -> None:
    """A generic pyramidal YCbCr JPEG TIFF: tissue blobs on glass, levels halved exactly (downsample 2, 4)."""
    rng = np.random.default_rng(7)
    W, H = size
    blobs = cv2.resize(rng.random((H // 64 + 2, W // 64 + 2)).astype(np.float32), (W, H), interpolation=cv2.INTER_CUBIC)
    tissue = blobs > np.quantile(blobs, 0.5)
    texture = cv2.GaussianBlur(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), (0, 0), 1.5).astype(np.float32)
    he = np.array([200.0, 120.0, 180.0], np.float32) + (texture - 128.0) * 0.9
    glass = 242.0 + (texture - 128.0) * 0.05
    img = np.clip(np.where(tissue[..., None], he, glass), 0, 255).astype(np.uint8)
    with tifffile.TiffWriter(path) as tw:
        for i in range(3):
            tw.write(img, tile=(stored, stored), photometric="rgb", compression="jpeg", compressionargs={"level": 85},
                     subfiletype=0 if i == 0 else 1, metadata=None)
            img = cv2.resize(img, (img.shape[1] // 2, img.shape[0] // 2), interpolation=cv2.INTER_AREA)


def _reference(path: Path, target: float | None, keep: float) -> dict[tuple[int, int], np.ndarray]:
    """(col, row) -> pixels of every tile the formula keeps at ``keep`` (greyscale 3..230), computed by
    the pixel tests' independent formula on OpenSlide's whole-level decodes."""
    osr = openslide.OpenSlide(str(path))
    levels = [np.asarray(osr.read_region((0, 0), L, osr.level_dimensions[L]))[..., :3] for L in range(osr.level_count)]
    osr.close()
    return {k: px for k, (px, _, _) in _formula(levels, target, T).items() if _grey_fraction(px) >= keep}


@pytest.mark.parametrize("stored", [128, 96], ids=["stored-128-aligned", "stored-96-shared"])
@pytest.mark.parametrize("target", [None, 0.5, 0.6], ids=["native", "level1-as-is", "level1-resized"])
def test_direct_path_is_taken_and_writes_the_read_level_store(tmp_path: Path, monkeypatch, stored: int, target: float | None) -> None:
    path = tmp_path / "jpeg.tif"
    _write_jpeg_tiff(path, stored)
    job = SlideJob("s", str(path), mpp=MPP)
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=target, min_foreground=0.5, qc=False)
    fast = tile_slide(job, tmp_path / "direct", cfg, threads=3)
    assert fast.status == "ok", fast.error
    with monkeypatch.context() as m:  # the OpenSlide path: the direct reader declines every level
        m.setattr(DirectTiles, "supports", lambda self, level: False)
        slow = tile_slide(job, tmp_path / "openslide", cfg, threads=1)
    assert slow.status == "ok", slow.error
    a, b = open_store(tmp_path / "direct" / "s.zarr"), open_store(tmp_path / "openslide" / "s.zarr")
    assert a.attrs["tile_decoder"] == "direct" and b.attrs["tile_decoder"] == "read_level"
    assert a.attrs["timing"]["threads"] == 3 and b.attrs["timing"]["threads"] == 1
    assert a.attrs["read_level"] == (0 if target is None else 1)
    # the same store, tile for tile
    np.testing.assert_array_equal(a.coords, b.coords)
    np.testing.assert_array_equal(a.grid, b.grid)
    np.testing.assert_array_equal(a.foreground, b.foreground)
    tiles = a.read()
    np.testing.assert_array_equal(tiles, b.read())
    # and both are OpenSlide's pixels cut by the formula, the kept set the brute-force one
    ref = _reference(path, target, 0.5)
    assert {tuple(v) for v in a.grid.tolist()} == set(ref) and 0 < len(ref)
    for k, (c, r) in enumerate(a.grid.tolist()):
        np.testing.assert_array_equal(tiles[k], ref[(c, r)], err_msg=f"tile (col {c}, row {r})")
    # each stored tile under a candidate tile's source was decoded exactly once, threads and all
    with open_slide(path, "openslide") as slide:
        plan = plan_tiles(slide, job, cfg)
    grid = plan.grid
    rows, cols = np.nonzero(plan.candidates)
    lxy = grid.level_coords(cols, rows)
    Sx, Sy = grid.source_shape
    under = {(c, r) for x, y in lxy.tolist()
             for r in range(y // stored, (y + Sy - 1) // stored + 1) for c in range(x // stored, (x + Sx - 1) // stored + 1)}
    # (whole, or only its top rows where those settled a probable-glass tile: aligned stored tiles)
    tm = a.attrs["timing"]
    assert tm["stored_tiles_decoded"] + tm["decided_by_top_rows"] == len(under)
    assert tm["decided_by_top_rows"] <= tm["stored_tiles_top_decoded"]
    if stored != T or target is not None:
        assert tm["decided_by_top_rows"] == 0
    assert a.attrs["n_candidates"] == len(rows)


def _write_banded_tiff(path: Path) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """A 256 px JPEG TIFF on glass at grey 242 (inside the pre-screen's margin: every tile a candidate)
    whose tiles each carry a designed band of tissue; returns the image and {case: (col, row)}."""
    S = 256
    rng = np.random.default_rng(11)
    cases = {
        "glass": (0, 0),              # probably glass, settled by its top rows
        "tissue": (1, 0),             # kept, never cut
        "strip-on-top": (2, 0),       # probably glass, but a 14-row strip at the top: the cut cannot settle it
        "bottom-70": (3, 0),          # tissue in the bottom 70 %: kept
        "top-half": (0, 1),           # tissue in the top half: dropped after a whole decode
        "bottom-edge-58": (1, 1),     # just below the threshold
        "glass-dots": (2, 1),         # glass with sparse dark dots: settled by its top rows
        "glass-2": (3, 1),
    }
    img = np.empty((2 * S, 4 * S, 3), np.uint8)
    img[:] = 242
    img += rng.integers(0, 3, img.shape, dtype=np.uint8)
    he = np.clip(np.array([200, 120, 180], np.int16) + rng.integers(-30, 31, (S, S, 3)), 0, 255).astype(np.uint8)

    def paint(case: str, r0: int, r1: int) -> None:
        c, r = cases[case]
        img[r * S + r0 : r * S + r1, c * S : (c + 1) * S] = he[r0:r1]

    paint("tissue", 0, S)
    paint("strip-on-top", 0, 14)
    paint("bottom-70", S - 180, S)
    paint("top-half", 0, S // 2)
    paint("bottom-edge-58", S - 148, S)
    c, r = cases["glass-dots"]
    ys, xs = rng.integers(0, S, 300), rng.integers(0, S, 300)
    img[r * S + ys, c * S + xs] = 90
    tifffile.imwrite(path, img, tile=(S, S), photometric="rgb", compression="jpeg", compressionargs={"level": 90}, metadata=None)
    return img, cases


def test_top_rows_decide_probable_glass_and_keep_exactly_the_exhaustive_set(tmp_path: Path) -> None:
    """Tiles the overview calls probable glass are settled from their top rows when those prove the
    tile fails; the store equals the exhaustive one (every tile decoded whole) and the brute-force
    rule on OpenSlide's pixels; a probable-glass tile its top rows cannot settle is decoded whole."""
    S = 256
    path = tmp_path / "banded.tif"
    _, cases = _write_banded_tiff(path)
    job = SlideJob("s", str(path), mpp=MPP)
    stores = {}
    for name, pre in (("pre", True), ("exhaustive", False)):
        res = tile_slide(job, tmp_path / name, TilingConfig(method="greyscale", qc_mode="off", tile_size=S, qc=False, detector=GreyscaleParams(prescreen=pre)), threads=2)
        assert res.status == "ok", res.error
        stores[name] = open_store(tmp_path / name / "s.zarr")
    a, b = stores["pre"], stores["exhaustive"]
    assert a.attrs["tile_decoder"] == "direct"
    np.testing.assert_array_equal(a.grid, b.grid)
    np.testing.assert_array_equal(a.foreground, b.foreground)
    np.testing.assert_array_equal(a.read(), b.read())
    osr = openslide.OpenSlide(str(path))
    level0 = np.asarray(osr.read_region((0, 0), 0, osr.level_dimensions[0]))[..., :3]
    osr.close()
    fraction = {case: _grey_fraction(np.ascontiguousarray(level0[r * S : (r + 1) * S, c * S : (c + 1) * S])) for case, (c, r) in cases.items()}
    kept = {tuple(v) for v in a.grid.tolist()}
    assert kept == {cases[k] for k, f in fraction.items() if f >= 0.6}
    assert kept == {cases["tissue"], cases["bottom-70"]}  # the design holds (58 % and a half are dropped)
    # what the cut did: the three glass tiles settled from their top rows, the strip tile decoded whole
    with open_slide(path, "openslide") as slide:
        plan = plan_tiles(slide, job, TilingConfig(method="greyscale", qc_mode="off", tile_size=S, qc=False))
    first = {(int(c), int(r)) for r, c in zip(*np.nonzero(plan.top_first))}
    assert {cases[k] for k in ("glass", "glass-2", "glass-dots", "strip-on-top")} <= first
    assert cases["tissue"] not in first and cases["bottom-70"] not in first
    tm, tb = a.attrs["timing"], b.attrs["timing"]
    assert tm["decided_by_top_rows"] == 3 and tm["stored_tiles_top_decoded"] == len(first)
    assert tm["stored_tiles_decoded"] == 8 - 3
    assert tb["decided_by_top_rows"] == tb["stored_tiles_top_decoded"] == 0 and tb["stored_tiles_decoded"] == 8


def test_top_rows_never_drop_a_tile_that_passes(tmp_path: Path, monkeypatch) -> None:
    """With every tile cut first (the overview's guess forced to 'glass'), kept tiles and those just
    below the threshold go through the cut too: the store still equals the exhaustive one."""
    import wsi_pipeline.tiling.detectors as plan_module  # the greyscale detector's pre-screen

    S = 256
    path = tmp_path / "banded.tif"
    _, cases = _write_banded_tiff(path)
    job = SlideJob("s", str(path), mpp=MPP)
    exhaustive = tile_slide(job, tmp_path / "exhaustive", TilingConfig(method="greyscale", qc_mode="off", tile_size=S, qc=False, detector=GreyscaleParams(prescreen=False)), threads=1)
    monkeypatch.setattr(plan_module, "likely_background", lambda overview, ds, grid, **kw: np.ones((grid.rows, grid.cols), bool))
    forced = tile_slide(job, tmp_path / "forced", TilingConfig(method="greyscale", qc_mode="off", tile_size=S, qc=False), threads=2)
    assert exhaustive.status == forced.status == "ok"
    a, b = open_store(tmp_path / "forced" / "s.zarr"), open_store(tmp_path / "exhaustive" / "s.zarr")
    np.testing.assert_array_equal(a.grid, b.grid)
    np.testing.assert_array_equal(a.read(), b.read())
    assert {tuple(v) for v in a.grid.tolist()} == {cases["tissue"], cases["bottom-70"]}
    tm = a.attrs["timing"]
    # all 8 cut; settled: the three glass tiles and the 58 % tile (4 tissue rows in its top 112)
    assert tm["stored_tiles_top_decoded"] == 8 and tm["decided_by_top_rows"] == 4


@pytest.mark.parametrize("compression", ["zstd", "jpeg", "none"])
def test_thread_count_does_not_change_the_store_with_openslide_reads(tmp_path: Path, monkeypatch, compression: str) -> None:
    """Levels read through OpenSlide are decoded by a pool of threads too (which then also compress the
    kept tiles); the store is the one-thread store, byte for byte."""
    path = tmp_path / "jpeg.tif"
    _write_jpeg_tiff(path, 96)
    monkeypatch.setattr(DirectTiles, "supports", lambda self, level: False)
    job = SlideJob("s", str(path), mpp=MPP)
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, min_foreground=0.3, qc=False, read_run=3, compression=compression)  # short runs: many tasks
    stores = {}
    for n in (1, 4):
        assert tile_slide(job, tmp_path / f"t{n}", cfg, threads=n).status == "ok"
        stores[n] = open_store(tmp_path / f"t{n}" / "s.zarr")
        assert stores[n].attrs["timing"]["threads"] == n and stores[n].attrs["tile_decoder"] == "read_level"
    np.testing.assert_array_equal(stores[1].coords, stores[4].coords)
    np.testing.assert_array_equal(stores[1].foreground, stores[4].foreground)
    np.testing.assert_array_equal(stores[1].read(), stores[4].read())
    files = {n: sorted(p.relative_to(tmp_path / f"t{n}") for p in (tmp_path / f"t{n}" / "s.zarr" / "tiles").rglob("*") if p.is_file())
             for n in (1, 4)}
    assert files[1] == files[4] and files[1]
    for rel in files[1]:
        assert (tmp_path / "t1" / rel).read_bytes() == (tmp_path / "t4" / rel).read_bytes(), rel
    assert len(stores[1]) == len(_reference(path, None, 0.3))  # the kept set is decided before compression


def test_tiffslide_reads_stay_on_one_thread(tmp_path: Path) -> None:
    """tiffslide handles are not shared between threads: one decoding thread, the writer thread beside it."""
    path = tmp_path / "jpeg.tif"
    _write_jpeg_tiff(path, 128)
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, min_foreground=0.5, qc=False, backend="tiffslide")
    assert tile_slide(SlideJob("s", str(path), mpp=MPP), tmp_path, cfg, threads=4).status == "ok"
    st = open_store(tmp_path / "s.zarr")
    assert st.attrs["tile_decoder"] == "read_level" and st.attrs["level_reader"] == "tiffslide"
    assert st.attrs["timing"]["threads"] == 1 and st.attrs["timing"]["background_write"] is True
    lib = tifffile.imread(path, level=0)  # the stored level-0 pixels as tifffile decodes them
    H, W = lib.shape[:2]
    tiles = st.read()
    assert len(tiles) > 0
    for k, (c, r) in enumerate(st.grid.tolist()):
        np.testing.assert_array_equal(tiles[k], lib[r * T : (r + 1) * T, c * T : (c + 1) * T])
    kept = {tuple(v) for v in st.grid.tolist()}
    for r in range(H // T):
        for c in range(W // T):
            g = cv2.cvtColor(np.ascontiguousarray(lib[r * T : (r + 1) * T, c * T : (c + 1) * T]), cv2.COLOR_RGB2GRAY)
            assert (((g >= 3) & (g <= 230)).mean() >= 0.5) == ((c, r) in kept)
