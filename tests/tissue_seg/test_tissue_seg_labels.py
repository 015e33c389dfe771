"""The paper's label pipeline, step by step, against independent numpy computations."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from wsi_pipeline.tissue_seg import labels as L


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_crop_or_pad_top_left_and_white_fill() -> None:
    img = _rng().integers(0, 256, (5, 7, 3), dtype=np.uint8)
    out = L.crop_or_pad(img, (8, 4))
    assert out.shape == (8, 4, 3)
    assert np.array_equal(out[:5], img[:5, :4])
    assert (out[5:] == 255).all()


def test_block_mean_downsample_matches_loop() -> None:
    img = _rng(1).integers(0, 256, (19, 13, 3), dtype=np.uint8)
    out = L.block_mean_downsample(img, 8)
    padded = np.full((24, 16, 3), 255.0)
    padded[:19, :13] = img
    for i in range(3):
        for j in range(2):
            ref = padded[i * 8 : i * 8 + 8, j * 8 : j * 8 + 8].reshape(-1, 3).mean(axis=0)
            assert np.allclose(out[i, j], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tile", [1, 3])
def test_zero_bright_tiles(tile: int) -> None:
    img = _rng(2).integers(180, 256, (7, 8, 3)).astype(np.float64)
    out = L.zero_bright_tiles(img, 230.0, tile)
    for r in range(0, 7, tile):
        for c in range(0, 8, tile):
            block = img[r : r + tile, c : c + tile]
            bright = block.mean() > 230.0
            got = out[r : r + tile, c : c + tile]
            assert np.array_equal(got, np.zeros_like(block) if bright else block)


def test_to_grey_and_nonzero() -> None:
    img = _rng(3).integers(0, 256, (4, 5, 3)).astype(np.float64)
    grey = L.to_grey(img)
    for (r, c), v in np.ndenumerate(grey):
        R, G, B = img[r, c]
        assert v == int(np.clip(round(0.299 * R + 0.587 * G + 0.114 * B), 0, 255))
    g = np.array([[0, 1, 200], [0, 0, 255]], np.uint8)
    assert np.array_equal(L.nonzero_to_255(g), np.array([[0, 255, 255], [0, 0, 255]]))


def test_median_blur_replicated_border() -> None:
    img = (_rng(4).random((11, 9)) > 0.5).astype(np.uint8) * 255
    k = 5
    ref = np.median(sliding_window_view(np.pad(img, k // 2, mode="edge"), (k, k)), axis=(2, 3))
    assert np.array_equal(L.median_blur(img, k), ref.astype(np.uint8))


@pytest.mark.parametrize("iterations", [1, 2])
def test_erode_dilate_square(iterations: int) -> None:
    m = _rng(5).random((12, 10)) > 0.3
    k = 3
    ref_e = m.copy()
    ref_d = m.copy()
    for _ in range(iterations):
        ref_e = sliding_window_view(np.pad(ref_e, k // 2, constant_values=True), (k, k)).all(axis=(2, 3))
        ref_d = sliding_window_view(np.pad(ref_d, k // 2, constant_values=False), (k, k)).any(axis=(2, 3))
    assert np.array_equal(L.erode(m, k, iterations), ref_e)
    assert np.array_equal(L.dilate(m, k, iterations), ref_d)


def _flood_fill_holes(m: np.ndarray) -> np.ndarray:
    """Independent hole filling: breadth-first search of background from the border (4-connectivity)."""
    h, w = m.shape
    outside = np.zeros_like(m, bool)
    stack = [(r, c) for r in range(h) for c in (0, w - 1)] + [(r, c) for r in (0, h - 1) for c in range(w)]
    while stack:
        r, c = stack.pop()
        if 0 <= r < h and 0 <= c < w and not m[r, c] and not outside[r, c]:
            outside[r, c] = True
            stack += [(r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)]
    return ~outside


def test_fill_holes_vs_flood_fill() -> None:
    m = _rng(6).random((15, 17)) > 0.45
    m[3:9, 3:9] = True
    m[5:7, 5:7] = False  # a hole
    assert np.array_equal(L.fill_holes(m), _flood_fill_holes(m))


def test_upsample_and_binarise() -> None:
    low = np.array([[0, 255], [255, 0]], np.uint8)
    up = L.upsample_nearest(low, 8, (13, 16))
    for r in range(13):
        for c in range(16):
            assert up[r, c] == low[r // 8, c // 8]
    assert np.array_equal(L.binarise(np.array([0, 1, 255])), np.array([0, 1, 1], np.uint8))


def test_paper_labels_end_to_end_on_generated_slide() -> None:
    """A dark disk with a bright hole and a speck of dust on glass: tissue is the filled disk."""
    h, w, d = 160, 240, 8
    yy, xx = np.mgrid[:h, :w]
    rgb = np.full((h, w, 3), 242, np.uint8)  # glass, mean over 230
    disk = (yy - 80) ** 2 + (xx - 100) ** 2 < 50**2
    rgb[disk] = (150, 90, 160)
    rgb[(yy - 80) ** 2 + (xx - 100) ** 2 < 12**2] = 245  # a bright lumen inside tissue: a hole to fill
    rgb[10:14, 200:204] = 40  # dust, smaller than one downsampled px: removed by the median/erosion
    lab, low = L.paper_labels(rgb, downsample=d, return_low=True)
    assert lab.shape == (h, w) and lab.dtype == np.uint8
    # independent reference: same steps written out with numpy only
    blocks = rgb.reshape(h // d, d, w // d, d, 3).astype(float).mean(axis=(1, 3))
    keep = blocks.mean(axis=2) <= 230
    grey = np.rint(blocks @ np.array([0.299, 0.587, 0.114]))
    m = np.where(keep & (grey != 0), 255, 0)
    m = np.median(sliding_window_view(np.pad(m, 2, mode="edge"), (5, 5)), axis=(2, 3)) > 0
    m = sliding_window_view(np.pad(m, 2, constant_values=True), (5, 5)).all(axis=(2, 3))
    m = sliding_window_view(np.pad(m, 2, constant_values=False), (5, 5)).any(axis=(2, 3))
    m = _flood_fill_holes(m)
    assert np.array_equal(low, m.astype(np.uint8))
    assert np.array_equal(lab, np.kron(m, np.ones((d, d))).astype(np.uint8))
    # the lumen is filled, the dust is gone, glass is 0
    assert lab[80, 100] == 1 and lab[12, 202] == 0 and lab[150, 230] == 0


def test_paper_labels_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        L.paper_labels(np.zeros((8, 8), np.float32))
