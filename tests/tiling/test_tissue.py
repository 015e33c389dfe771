"""Foreground rules, Otsu tissue masks, the tile grid and the pre-screen bound, against brute force."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from wsi_pipeline.tiling.grid import make_grid
from wsi_pipeline.tiling.prescreen import foreground_bound_map, prescreen_candidates
from wsi_pipeline.config.tiling_params import OtsuParams
from wsi_pipeline.slides.coverage import box_mean
from wsi_pipeline.tiling.tissue import grey, otsu_tissue_mask, strip_foreground, tiles_foreground


def test_grey_is_opencv_bt601() -> None:
    rgb = np.random.default_rng(1).integers(0, 256, (2, 40, 50, 3), dtype=np.uint8)
    g = grey(rgb)
    ref = np.stack([cv2.cvtColor(im, cv2.COLOR_RGB2GRAY) for im in rgb])
    np.testing.assert_array_equal(g, ref)
    luma = 0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]
    assert np.abs(g - luma).max() <= 1.0


def _brute_fraction(tile: np.ndarray, lo: int, hi: int) -> float:
    g = cv2.cvtColor(np.ascontiguousarray(tile), cv2.COLOR_RGB2GRAY).astype(int)
    return float(((g >= lo) & (g <= hi)).mean())


def test_foreground_fractions_match_brute_force_including_bounds() -> None:
    rng = np.random.default_rng(2)
    T, k = 16, 5
    strip = rng.integers(0, 256, (T, k * T, 3), dtype=np.uint8)
    # grey values exactly at and just beyond the bounds 3 and 230 (grey of (v, v, v) is v)
    for v, col in ((2, 0), (3, 1), (230, 2), (231, 3)):
        strip[:, col * T : col * T + T] = v
    tiles = strip.reshape(T, k, T, 3).transpose(1, 0, 2, 3)
    ref = np.array([_brute_fraction(t, 3, 230) for t in tiles])
    np.testing.assert_allclose(strip_foreground(strip, T, 3, 230), ref, atol=1e-7)
    np.testing.assert_allclose(tiles_foreground(np.ascontiguousarray(tiles), 3, 230), ref, atol=1e-7)
    assert ref[:4].tolist() == [0.0, 1.0, 1.0, 0.0]


def test_box_mean_equals_pixel_average_at_level0() -> None:
    rng = np.random.default_rng(3)
    d = 4  # level-0 px per map px
    m = rng.random((12, 15))
    level0 = np.kron(m, np.ones((d, d)))  # the map as level-0 pixels
    coords = np.array([[0, 0], [5, 3], [17, 9], [40, 30], [2, 37]])
    extent = 11  # not a multiple of d: partial map pixels
    ref = [level0[y : y + extent, x : x + extent].mean() for x, y in coords]
    np.testing.assert_allclose(box_mean(m, d, coords, extent), ref, rtol=1e-10)
    # beyond the map: the `outside` value
    got = box_mean(m, d, np.array([[56, 0]]), 8, outside=1.0)
    ref_edge = (level0[0:8, 56:60].sum() + 4 * 8 * 1.0) / 64
    np.testing.assert_allclose(got, [ref_edge], rtol=1e-10)


def _blob_image(scale: int) -> np.ndarray:
    """White background, a dark tissue disk with a large and a small hole, and small dark specks."""
    n = 400 // scale
    yy, xx = np.mgrid[0:n, 0:n] * scale
    img = np.full((n, n, 3), 245, np.uint8)
    tissue = (yy - 200) ** 2 + (xx - 200) ** 2 < 120**2
    big_hole = (yy - 200) ** 2 + (xx - 170) ** 2 < 40**2
    small_hole = (yy - 250) ** 2 + (xx - 260) ** 2 < 6**2
    specks = ((yy - 30) ** 2 + (xx - 30) ** 2 < 6**2) | ((yy - 370) ** 2 + (xx - 350) ** 2 < 5**2)
    dark = (tissue & ~big_hole & ~small_hole) | specks
    img[dark] = (170, 90, 150)
    return img, tissue & ~big_hole


@pytest.mark.parametrize("scale", [2, 4])
def test_otsu_mask_keeps_tissue_removes_specks_and_small_holes(scale: int) -> None:
    # sizes in um^2 at 1 um per level-0 px: specks (~100 um^2) and the small hole (~110 um^2)
    # are below 500 um^2; the big hole (~5000 um^2) is kept
    img, expected = _blob_image(scale)
    params = OtsuParams(median_um=4, closing_um=4, min_object_um2=500, min_hole_um2=500)
    mask, info = otsu_tissue_mask(img, float(scale), params)
    assert info["background"] == "bright"
    iou = (mask & expected).sum() / (mask | expected).sum()
    assert iou > 0.93, iou
    assert not mask[: 60 // scale, : 60 // scale].any()  # speck removed
    n = 400 // scale
    yy, xx = np.mgrid[0:n, 0:n] * scale
    assert mask[(yy - 250) ** 2 + (xx - 260) ** 2 < 4**2].all()  # small hole filled
    assert not mask[(yy - 200) ** 2 + (xx - 170) ** 2 < 25**2].any()  # big hole kept


def test_otsu_blank_image_has_no_tissue_and_dark_background_is_detected() -> None:
    rng = np.random.default_rng(4)
    blank = np.clip(248 + rng.normal(0, 2, (100, 120, 3)), 0, 255).astype(np.uint8)
    mask, info = otsu_tissue_mask(blank, 8.0)
    assert not mask.any() and info["tissue_fraction"] == 0.0
    fluo = np.zeros((100, 120, 3), np.uint8)
    fluo[20:80, 30:90, 2] = 120  # a blue (DAPI-like) region on black
    mask, info = otsu_tissue_mask(fluo, 8.0, OtsuParams(median_um=8, closing_um=8, min_object_um2=64, min_hole_um2=64))
    assert info["background"] == "dark"
    ref = np.zeros((100, 120), bool)
    ref[20:80, 30:90] = True
    assert (mask == ref).mean() > 0.97


def test_grid_native_counts_full_tiles_from_origin() -> None:
    g = make_grid(((2220, 2967),), (1.0,), tile_size=256)
    assert (g.cols, g.rows) == (2220 // 256, 2967 // 256) == (8, 11)
    cols, rows = np.meshgrid(np.arange(g.cols), np.arange(g.rows))
    c = g.coords(cols.ravel(), rows.ravel())
    np.testing.assert_array_equal(c, np.stack([cols.ravel() * 256, rows.ravel() * 256], 1))
    assert (c + 256 <= [2220, 2967]).all()
    assert not g.resized


def test_grid_level_choice_for_mpp_target() -> None:
    dims = ((40000, 30000), (20000, 15000), (5000, 3750))
    # a 2x level exists: a 40x (0.25) slide tiles at 20x (0.5) from level 1 without resizing
    g = make_grid(dims, (1.0, 2.0, 8.0), tile_size=256, slide_mpp=0.25, mpp_target=0.5)
    assert (g.level, g.resized, g.mpp, g.extent) == (1, False, 0.5, 512.0)
    assert (g.cols, g.rows) == (20000 // 256, 15000 // 256)
    # only a 4x level: read level 0 (the best at or finer than the target), 512 px -> 256 px
    dims4 = ((40000, 30000), (10000, 7500))
    g = make_grid(dims4, (1.0, 4.0), tile_size=256, slide_mpp=0.25, mpp_target=0.5)
    assert (g.level, g.source_size, g.resized, g.mpp) == (0, 512, True, 0.5)
    assert (g.cols, g.rows) == (40000 // 512, 30000 // 512)
    # within tolerance: no resize at all
    g = make_grid(((2220, 2967),), (1.0,), tile_size=256, slide_mpp=0.499, mpp_target=0.5)
    assert (g.level, g.resized, g.mpp) == (0, False, 0.499)
    with pytest.raises(ValueError, match="finer than the slide's level 0"):
        make_grid(dims, (1.0, 2.0, 8.0), tile_size=256, slide_mpp=0.5, mpp_target=0.25)
    with pytest.raises(ValueError, match="needs the slide's mpp"):
        make_grid(dims, (1.0, 2.0, 8.0), tile_size=256, slide_mpp=None, mpp_target=0.5)


def test_prescreen_bound_never_below_true_foreground() -> None:
    """On adversarial tiles (bright + a few dark pixels, fine patterns) the bound from exact area
    means is an upper bound of the true fraction, so the pre-screen never drops a keepable tile."""
    rng = np.random.default_rng(5)
    T, n = 32, 8
    img = np.full((T * n, T * n, 3), 250, np.uint8)
    for r in range(n):
        for c in range(n):
            t = img[r * T : (r + 1) * T, c * T : (c + 1) * T]
            if (r + c) % 3 == 0:
                continue  # plain glass
            frac = rng.uniform(0.3, 0.9)
            on = rng.random((T, T)) < frac
            t[on] = rng.integers(200, 231)  # just foreground
            t[~on] = rng.integers(231, 256)  # just background
    g = make_grid(((T * n, T * n),), (1.0,), tile_size=T)
    ds = 4
    overview = img.reshape(T * n // ds, ds, T * n // ds, ds, 3).mean(axis=(1, 3)).round().astype(np.uint8)
    cols, rows = np.meshgrid(np.arange(n), np.arange(n))
    true = np.array([_brute_fraction(img[y : y + T, x : x + T], 3, 230) for x, y in g.coords(cols.ravel(), rows.ravel())])
    bound = box_mean(foreground_bound_map(overview, 230, margin=1.0), ds, g.coords(cols.ravel(), rows.ravel()), T)
    assert (bound >= true - 1e-9).all()
    cand = prescreen_candidates(overview, ds, g, grey_max=230, min_foreground=0.6, margin=1.0).ravel()
    assert cand[true >= 0.6].all()
    assert not cand.all()  # and it does skip some tiles


def test_otsu_finds_pale_stroma_not_only_dark_lesions(tmp_path, opener) -> None:
    """Three grey modes (glass, pale stroma, dark lesion): the mask must cover the whole tissue."""
    from wsi_pipeline.slides import read_scaled
    from wsi_pipeline.synthetic.slides import make_slide

    s = make_slide(tmp_path / "s.svs", size=1024, seed=8, n_lesions=3, lesion_size=0.2, tissue_fraction=0.4)
    overview = read_scaled(opener(s.path), s.mask_downsample)  # same grid as the true mask
    mask, info = otsu_tissue_mask(overview, 0.5 * s.mask_downsample)
    truth = s.tissue[: mask.shape[0], : mask.shape[1]]
    iou = (mask & truth).sum() / (mask | truth).sum()
    assert info["channel"] == "saturation" and iou > 0.85, (info, iou)
