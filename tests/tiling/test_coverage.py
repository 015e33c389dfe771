"""The one tile-fraction function against a brute-force level-0 average computed here."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_pipeline.slides.coverage import box_mean
from wsi_pipeline.synthetic.truth import tile_lesion_fraction
from wsi_pipeline.tiling import grid


def _brute(mask: np.ndarray, d: int, coords: np.ndarray, extent: int) -> np.ndarray:
    """Upsample the mask to level-0 px (each mask px -> d x d), pad with zeros so every box fits,
    and average the level-0 pixels inside each box [x, x + extent) x [y, y + extent)."""
    level0 = np.kron(mask.astype(np.float64), np.ones((d, d)))
    pad = extent + int(np.abs(coords).max()) + 1
    big = np.pad(level0, pad)
    return np.array([big[y + pad : y + pad + extent, x + pad : x + pad + extent].mean() for x, y in coords])


@pytest.mark.parametrize("d,extent", [(16, 32), (16, 20), (8, 5), (3, 7)])
def test_tile_fraction_equals_level0_average(d, extent):
    rng = np.random.default_rng(d * 100 + extent)
    mask = rng.random((11, 13)) < 0.4
    H, W = mask.shape[0] * d, mask.shape[1] * d
    # aligned, unaligned, partly beyond every edge, and wholly outside the mask
    coords = np.concatenate([
        rng.integers(-extent, max(W, H), (40, 2)),
        np.array([[0, 0], [W - extent // 2, H - extent // 2], [-extent // 2, 3], [W + 2 * extent, 0], [d, 2 * d]]),
    ])
    ref = _brute(mask, d, coords, extent)
    # sums of at most H*W 0/1 values and the bilinear weights are exact in float64 up to a few ulps of the sums
    np.testing.assert_allclose(box_mean(mask, d, coords, extent), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tile_lesion_fraction(mask, d, coords, extent), ref, rtol=0, atol=1e-12)
    assert grid.box_mean is box_mean  # tiling's callers use the same function


def test_aligned_tiles_are_exact_counts():
    """Tiles on the mask grid (the synthetic demo's case): the fraction is count / area, bit for bit."""
    rng = np.random.default_rng(0)
    d, extent = 16, 32
    mask = rng.random((20, 20)) < 0.3
    cols, rows = np.meshgrid(np.arange(10), np.arange(10))
    coords = np.stack([cols.ravel(), rows.ravel()], axis=1) * extent
    k = extent // d
    counts = mask.reshape(10, k, 10, k).sum(axis=(1, 3)).ravel()
    np.testing.assert_array_equal(tile_lesion_fraction(mask, d, coords, extent), counts / float(k * k))


def test_unaligned_tile_counts_partial_mask_pixels_by_area():
    """Mask pixels a tile covers in part count by the part covered. Snapping the box outward to whole
    mask px (the former tile_lesion_fraction) gave 1/4 for both tiles here (one lesion px of a 2 x 2 box)."""
    d = 16
    mask = np.zeros((4, 4), bool)
    mask[1, 1] = True  # lesion px (1, 1) = level-0 [16, 32)^2
    # tile [28, 44)^2 overlaps it on [28, 32)^2: 16 of the tile's 256 level-0 px
    assert tile_lesion_fraction(mask, d, np.array([[28, 28]]), 16)[0] == pytest.approx(16 / 256, abs=1e-15)
    # tile [20, 36)^2 overlaps it on [20, 32)^2: 144 of 256
    assert tile_lesion_fraction(mask, d, np.array([[20, 20]]), 16)[0] == pytest.approx(144 / 256, abs=1e-15)
