"""A tile's pixels are the documented tile formula (wsi_pipeline.tiling.grid), on pyramids whose levels
have non-integer downsamples (Aperio-like: level sizes floor(W / 2^k)), for both backends, and do not
change with the keep threshold, the pre-screen or the worker count.

The reference is written here from the formula's statement (docs/tiling.md, "The tile formula"), not from the package:
level L has sx = W0 / WL, sy = H0 / HL; with a target, D = target / mpp and L is the coarsest level
with (sx + sy) / 2 <= D * 1.05; within 5 % of D the level is used as is (T x T sources, step T),
otherwise sources are round(T * D / s) level px, stepping T * D / s, resized with cv2.INTER_AREA;
tile (i, j) has level origin (round(i * step_x), round(j * step_y)) and level-0 corner
(round(lx * sx), round(ly * sy)).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import cv2
import numpy as np
import openslide
import pytest
import tifffile
import tiffslide

from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import open_store
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.config.tiling_params import GreyscaleParams
from wsi_pipeline.tiling.tiler import tile_slide

T = 128
MPP = 0.25
TOL = 0.05


def _r(v: float) -> int:
    return int(math.floor(v + 0.5))


def _write_pyramid(path: Path, seed: int, size: tuple[int, int] = (2049, 1537), n_levels: int = 4) -> list[np.ndarray]:
    """An Aperio-like SVS (lossless deflate tiles): tissue blobs on glass, level k = floor(W / 2^k) x floor(H / 2^k),
    each level the area average of the one above (as scanners make them). Returns the level arrays."""
    rng = np.random.default_rng(seed)
    W, H = size
    blobs = cv2.resize(rng.random((H // 64 + 2, W // 64 + 2)).astype(np.float32), (W, H), interpolation=cv2.INTER_CUBIC)
    tissue = blobs > np.quantile(blobs, 0.55)
    texture = cv2.GaussianBlur(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), (0, 0), 1.2).astype(np.float32)
    he = np.array([190.0, 110.0, 170.0], np.float32) + (texture - 128.0) * 0.9
    glass = 246.0 + (texture - 128.0) * 0.06
    level0 = np.clip(np.where(tissue[..., None], he, glass), 0, 255).astype(np.uint8)
    levels = [level0]
    for k in range(1, n_levels):
        levels.append(cv2.resize(levels[-1], (W >> k, H >> k), interpolation=cv2.INTER_AREA))
    head = f"Aperio Image Library v12.0.16\r\n{W}x{H} [0,0 {W}x{H}] (128x128) deflate"
    opts = {"photometric": "rgb", "compression": "zlib", "metadata": None}
    with tifffile.TiffWriter(path) as tw:
        tw.write(level0, tile=(128, 128), description=f"{head}|AppMag = 40|MPP = {MPP}", **opts)
        tw.write(levels[-1], description=f"{head} -> thumbnail", **opts)  # SVS: second directory = thumbnail
        for lv in levels[1:]:
            tw.write(lv, tile=(128, 128), description=f"{head} -> {lv.shape[1]}x{lv.shape[0]}", **opts)
    return levels


def _formula(
    levels: list[np.ndarray], target: float | None, T: int = T, usable: int | None = None
) -> dict[tuple[int, int], tuple[np.ndarray, tuple[int, int], tuple[int, int]]]:
    """Every full tile of the formula: (col, row) -> (pixels, level-0 corner, level origin); only
    levels up to ``usable`` may be read (None = all)."""
    H0, W0 = levels[0].shape[:2]
    scales = [(W0 / lv.shape[1], H0 / lv.shape[0]) for lv in levels]
    if target is None:
        L, D = 0, 1.0
    else:
        D = target / MPP
        L = max(i for i, (sx, sy) in enumerate(scales) if (sx + sy) / 2 <= D * (1 + TOL) and (usable is None or i <= usable))
    sx, sy = scales[L]
    if abs((sx + sy) / 2 / D - 1) <= TOL:
        stx = sty = float(T)
        Sx = Sy = T
    else:
        stx, sty = T * D / sx, T * D / sy
        Sx, Sy = _r(stx), _r(sty)
    lvl = levels[L]
    HL, WL = lvl.shape[:2]
    out = {}
    j = 0
    while _r(j * sty) + Sy <= HL:
        i = 0
        while _r(i * stx) + Sx <= WL:
            lx, ly = _r(i * stx), _r(j * sty)
            src = np.ascontiguousarray(lvl[ly : ly + Sy, lx : lx + Sx])
            px = src if (Sx, Sy) == (T, T) else cv2.resize(src, (T, T), interpolation=cv2.INTER_AREA)
            out[(i, j)] = (px, (_r(lx * sx), _r(ly * sy)), (lx, ly))
            i += 1
        j += 1
    return out


def _grey_fraction(tile: np.ndarray, lo: int = 3, hi: int = 230) -> float:
    g = cv2.cvtColor(tile, cv2.COLOR_RGB2GRAY)
    return float(((g >= lo) & (g <= hi)).mean())


def _check_store(store_dir: Path, ref: dict, min_foreground: float) -> dict[tuple[int, int], np.ndarray]:
    """Every stored tile, corner and level origin equals the formula; the kept set is the formula's tiles at >= min_foreground."""
    st = open_store(store_dir)
    tiles = st.read()
    got = {}
    for k, ((c, r), xy) in enumerate(zip(st.grid.tolist(), st.coords.tolist())):
        px, corner, origin = ref[(c, r)]
        np.testing.assert_array_equal(tiles[k], px, err_msg=f"tile (col {c}, row {r}) of {store_dir}")
        assert tuple(xy) == corner
        assert tuple(st.array("level_coords")[k]) == origin
        got[(c, r)] = tiles[k]
    expected = {k for k, (px, _, _) in ref.items() if _grey_fraction(px) >= min_foreground}
    assert set(got) == expected
    return got


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    path = tmp_path_factory.mktemp("pyr") / "aperio_like.svs"
    return path, _write_pyramid(path, seed=3)


def test_generated_pyramid_has_non_integer_downsamples_and_both_readers_see_its_pixels(pyramid) -> None:
    path, levels = pyramid
    o, t = openslide.OpenSlide(str(path)), tiffslide.TiffSlide(str(path))
    assert o.properties["openslide.vendor"] == "aperio"
    assert o.level_dimensions == t.level_dimensions == tuple((lv.shape[1], lv.shape[0]) for lv in levels)
    assert not float(o.level_downsamples[1]).is_integer() and o.level_downsamples[1] == pytest.approx(2.0011, abs=1e-4)
    for L, lv in enumerate(levels):  # a whole-level read anchored at (0, 0) is exact in both libraries
        w, h = o.level_dimensions[L]
        np.testing.assert_array_equal(np.asarray(o.read_region((0, 0), L, (w, h)))[..., :3], lv)
        np.testing.assert_array_equal(t.read_region((0, 0), L, (w, h), as_array=True), lv)
    o.close()
    t.close()


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
@pytest.mark.parametrize("target", [None, 0.5, 0.6, 1.1], ids=["native", "level1-as-is", "level1-resized", "level2-resized"])
def test_every_stored_tile_is_the_formula(pyramid, tmp_path: Path, backend: str, target: float | None) -> None:
    path, levels = pyramid
    ref = _formula(levels, target)
    res = tile_slide(SlideJob("s", str(path)), tmp_path, TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=target, min_foreground=0.5,
                                                                     backend=backend, qc=False))
    assert res.status == "ok", res.error
    got = _check_store(tmp_path / "s.zarr", ref, 0.5)
    assert 0 < len(got) < len(ref)
    attrs = open_store(tmp_path / "s.zarr").attrs
    resized = target in (0.6, 1.1)
    assert attrs["resize"] == ("cv2.INTER_AREA" if resized else "none")
    assert attrs["read_level"] == {None: 0, 0.5: 1, 0.6: 1, 1.1: 2}[target]
    assert "cv2.INTER_AREA" in attrs["tile_formula"]
    # OpenSlide would interpolate a 2.0011x level: tiffslide decodes it
    assert attrs["level_reader"] == ("tiffslide" if backend == "tiffslide" or target is not None else "openslide")


def test_openslide_without_tiff_access_skips_non_integer_levels(pyramid, tmp_path: Path, monkeypatch) -> None:
    """A format only OpenSlide reads (no tiffslide twin): levels with a non-integer downsample are
    never read (OpenSlide would interpolate them); the target is met from level 0, resized."""
    from wsi_pipeline.slides.backends import OpenSlideSlide

    monkeypatch.setattr(OpenSlideSlide, "_tiff_twin", lambda self: None)
    path, levels = pyramid
    res = tile_slide(SlideJob("s", str(path)), tmp_path, TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=0.5, min_foreground=0.5,
                                                                     backend="openslide", qc=False))
    assert res.status == "ok", res.error
    assert len(_check_store(tmp_path / "s.zarr", _formula(levels, 0.5, usable=0), 0.5)) > 0
    attrs = open_store(tmp_path / "s.zarr").attrs
    assert attrs["read_level"] == 0 and attrs["source_shape"] == [2 * T, 2 * T] and attrs["resize"] == "cv2.INTER_AREA"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
@pytest.mark.parametrize("target", [0.5, 0.6])
def test_tile_pixels_do_not_depend_on_threshold_prescreen_or_workers(pyramid, tmp_path: Path, backend: str, target: float) -> None:
    path, levels = pyramid
    ref = _formula(levels, target)
    runs = {}
    for name, thr, pre, bg in (("keep20", 0.2, True, True), ("keep90", 0.9, True, True), ("exhaustive", 0.2, False, False)):
        cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=target, min_foreground=thr, detector=GreyscaleParams(prescreen=pre), backend=backend, qc=False)
        assert tile_slide(SlideJob("s", str(path)), tmp_path / name, cfg, background_write=bg).status == "ok"
        runs[name] = _check_store(tmp_path / name / "s.zarr", ref, thr)
    # two worker processes on a folder of two copies
    folder = tmp_path / "slides"
    folder.mkdir()
    for sid in ("a", "b"):
        shutil.copy(path, folder / f"{sid}.svs")
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=target, min_foreground=0.2, backend=backend, qc=False)
    rep = tile_cohort(folder, tmp_path / "workers", cfg, workers=2, progress=False)
    assert rep.ok and rep.count("ok") == 2
    for sid in ("a", "b"):
        runs[sid] = _check_store(tmp_path / "workers" / f"{sid}.zarr", ref, 0.2)
    assert len(runs["keep90"]) < len(runs["keep20"]) == len(runs["exhaustive"])
    for k, px in runs["keep90"].items():  # the same tile in every run is the same array
        for other in ("keep20", "exhaustive", "a", "b"):
            np.testing.assert_array_equal(runs[other][k], px)


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
def test_jpeg_aperio_like_slide_matches_the_library_read_of_the_level(tmp_path: Path, backend: str) -> None:
    """JPEG tiles as scanners write them; the reference decodes each level with the library itself
    (a whole-level read_region anchored at (0, 0), exact in both) and applies the formula with cv2."""
    path = make_slide(tmp_path / "j.svs", size=(2049, 1537), seed=9, mpp=MPP, level_factor=2, tissue_fraction=0.5).path
    if backend == "openslide":
        lib = openslide.OpenSlide(str(path))
        levels = [np.asarray(lib.read_region((0, 0), L, lib.level_dimensions[L]))[..., :3] for L in range(lib.level_count)]
    else:
        lib = tiffslide.TiffSlide(str(path))
        levels = [lib.read_region((0, 0), L, lib.level_dimensions[L], as_array=True) for L in range(lib.level_count)]
    lib.close()
    assert not float(levels[0].shape[1] / levels[1].shape[1]).is_integer()
    for target in (0.5, 0.6):
        ref = _formula(levels, target)
        out = tmp_path / f"out{target}"
        cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=T, mpp_target=target, min_foreground=0.5, backend=backend, qc=False)
        assert tile_slide(SlideJob("j", str(path)), out, cfg).status == "ok"
        assert len(_check_store(out / "j.zarr", ref, 0.5)) > 0


@pytest.mark.real_slides
@pytest.mark.filterwarnings("ignore:hamamatsu-format metadata parsing")
def test_real_ndpi_level1_tiles_are_its_level_pixels(real_slides_dir: Path, tmp_path: Path) -> None:
    """A real NDPI at half its resolution: tiles are level 1 as OpenSlide decodes it, cut on the level grid."""
    src = real_slides_dir / "test3-DAPI-2-387.ndpi"
    osr = openslide.OpenSlide(str(src))
    mpp = float(osr.properties["openslide.mpp-x"])
    level1 = np.asarray(osr.read_region((0, 0), 1, osr.level_dimensions[1]))[..., :3]
    cfg = TilingConfig(tile_size=256, mpp_target=2 * mpp, min_foreground=0.0, method="greyscale", detector=GreyscaleParams(grey_min=0, grey_max=255),
                       backend="openslide", qc=False, allow_dark_background=True)  # the NDPI is fluorescence
    assert tile_slide(SlideJob("n", str(src)), tmp_path, cfg).status == "ok"
    st = open_store(tmp_path / "n.zarr")
    assert st.attrs["read_level"] == 1 and st.attrs["resize"] == "none"
    h, w = level1.shape[:2]
    assert len(st) == (w // 256) * (h // 256)
    tiles = st.read()
    for k, (c, r) in enumerate(st.grid.tolist()):
        np.testing.assert_array_equal(tiles[k], level1[r * 256 : (r + 1) * 256, c * 256 : (c + 1) * 256])
    np.testing.assert_array_equal(st.coords, st.grid * 512)
