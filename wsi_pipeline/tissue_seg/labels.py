"""The shared-memory paper's label pipeline: a classical tissue mask for whole-image training.

The paper (Remedios et al., MIDL 2023, ``003`` in ``shared/papers``) builds its labels by
cropping, downsampling by 8, tiling into non-overlapping 1 x 1 tiles, setting tiles whose mean
intensity is over 230 to 0, converting to greyscale, setting non-zero pixels to 255, median
blurring, eroding, dilating, filling holes, upsampling to the original resolution, re-thresholding
values above 0 to 255 and binarising. Each step is its own function here so it can be checked.

Where the paper is silent this module chooses (all are keyword parameters of :func:`paper_labels`):

* crop origin: the top-left corner; an image smaller than the crop is padded with white glass (255);
* downsampling: area mean over ``downsample`` x ``downsample`` px blocks (partial edge blocks are
  padded with 255 first);
* "mean intensity" of a tile: the mean over its pixels and its RGB channels;
* greyscale: ITU-R BT.601 luma (0.299 R + 0.587 G + 0.114 B), rounded to uint8;
* median blur: 5 x 5 px window (at the downsampled scale), edges replicated;
* erosion and dilation: a 5 x 5 px square, 1 iteration each; pixels beyond the border count as
  tissue for the erosion (tissue touching the crop edge is not eaten) and as background for the
  dilation;
* hole filling: background regions not connected (4-connectivity) to the image border become
  tissue (``scipy.ndimage.binary_fill_holes``);
* upsampling: nearest neighbour (each downsampled pixel becomes a ``downsample`` x ``downsample``
  block), cropped back to the crop size.

The rule only tells glass from tissue when the glass is brighter than ``bright_threshold`` (mean
over 230 by default): on a slide scanned with darker glass every block is "tissue". Lower the
threshold for such scanners (the classical tiler estimates the glass level per slide,
:mod:`wsi_pipeline.tiling.background`).

All sizes are in px of the image given (the training resolution), not level-0 px.
"""

from __future__ import annotations

from typing import Literal, overload

import numpy as np
from scipy import ndimage

__all__ = [
    "crop_or_pad",
    "block_mean_downsample",
    "zero_bright_tiles",
    "to_grey",
    "nonzero_to_255",
    "median_blur",
    "erode",
    "dilate",
    "fill_holes",
    "upsample_nearest",
    "binarise",
    "paper_labels",
]


def crop_or_pad(rgb: np.ndarray, size: tuple[int, int] | None, fill: int = 255) -> np.ndarray:
    """Top-left ``size`` = (height, width) px of ``rgb`` (H, W[, C]); missing rows/columns are ``fill``."""
    if size is None:
        return rgb
    h, w = int(size[0]), int(size[1])
    if h < 1 or w < 1:
        raise ValueError(f"crop size must be positive (height, width) px, got {size}")
    out = np.full((h, w) + rgb.shape[2:], fill, dtype=rgb.dtype)
    hh, ww = min(h, rgb.shape[0]), min(w, rgb.shape[1])
    out[:hh, :ww] = rgb[:hh, :ww]
    return out


def block_mean_downsample(img: np.ndarray, factor: int, fill: int = 255) -> np.ndarray:
    """Area mean over ``factor`` x ``factor`` px blocks (float64); edges padded with ``fill`` to whole blocks."""
    if factor < 1:
        raise ValueError(f"downsample factor must be >= 1, got {factor}")
    h, w = img.shape[:2]
    hb, wb = -(-h // factor), -(-w // factor)
    padded = crop_or_pad(img, (hb * factor, wb * factor), fill)
    shaped = padded.reshape((hb, factor, wb, factor) + img.shape[2:]).astype(np.float64)
    return shaped.mean(axis=(1, 3))


def zero_bright_tiles(img: np.ndarray, threshold: float = 230.0, tile: int = 1) -> np.ndarray:
    """Set every non-overlapping ``tile`` x ``tile`` px tile whose mean intensity (pixels and channels)
    is over ``threshold`` to 0 (partial edge tiles are averaged over the pixels they have)."""
    if tile < 1:
        raise ValueError(f"tile size must be >= 1 px, got {tile}")
    mean = img.mean(axis=2) if img.ndim == 3 else img.astype(np.float64)
    h, w = mean.shape
    # per-tile mean: sum over the tile's pixels / number of pixels it has (edge tiles are partial)
    rows, cols = np.arange(0, h, tile), np.arange(0, w, tile)
    sums = np.add.reduceat(np.add.reduceat(mean, rows, axis=0), cols, axis=1)
    counts = np.outer(np.diff(np.append(rows, h)), np.diff(np.append(cols, w)))
    bright = np.repeat(np.repeat(sums / counts > threshold, tile, axis=0), tile, axis=1)[:h, :w]
    out = img.copy()
    out[bright] = 0
    return out


def to_grey(rgb: np.ndarray) -> np.ndarray:
    """ITU-R BT.601 luma of an (H, W, 3) RGB image, rounded to uint8 ((H, W) greyscale passes through)."""
    if rgb.ndim == 2:
        return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) RGB image, got shape {rgb.shape}")
    y = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
    return np.clip(np.rint(y), 0, 255).astype(np.uint8)


def nonzero_to_255(grey: np.ndarray) -> np.ndarray:
    """uint8 image with every non-zero pixel set to 255."""
    return np.where(grey != 0, 255, 0).astype(np.uint8)


def median_blur(img: np.ndarray, ksize: int = 5) -> np.ndarray:
    """Median over a ``ksize`` x ``ksize`` px window, border pixels replicated."""
    if ksize < 1 or ksize % 2 == 0:
        raise ValueError(f"median blur ksize must be a positive odd number of px, got {ksize}")
    return ndimage.median_filter(img, size=ksize, mode="nearest")


def erode(mask: np.ndarray, ksize: int = 5, iterations: int = 1) -> np.ndarray:
    """Binary erosion (non-zero = tissue) by a ``ksize`` px square; outside the image counts as tissue."""
    if ksize < 1 or iterations < 0:
        raise ValueError(f"erosion needs ksize >= 1 px and iterations >= 0, got {ksize}, {iterations}")
    if iterations == 0:
        return mask != 0
    return ndimage.binary_erosion(mask != 0, np.ones((ksize, ksize), bool), iterations=iterations, border_value=1)


def dilate(mask: np.ndarray, ksize: int = 5, iterations: int = 1) -> np.ndarray:
    """Binary dilation (non-zero = tissue) by a ``ksize`` px square; outside the image counts as glass."""
    if ksize < 1 or iterations < 0:
        raise ValueError(f"dilation needs ksize >= 1 px and iterations >= 0, got {ksize}, {iterations}")
    if iterations == 0:
        return mask != 0
    return ndimage.binary_dilation(mask != 0, np.ones((ksize, ksize), bool), iterations=iterations, border_value=0)


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """Background regions not 4-connected to the image border become tissue."""
    return ndimage.binary_fill_holes(mask != 0)


def upsample_nearest(img: np.ndarray, factor: int, size: tuple[int, int]) -> np.ndarray:
    """Each pixel becomes a ``factor`` x ``factor`` block; the result is cropped to ``size`` = (H, W) px."""
    up = np.repeat(np.repeat(img, factor, axis=0), factor, axis=1)
    if up.shape[0] < size[0] or up.shape[1] < size[1]:
        raise ValueError(f"upsampled image {up.shape[:2]} is smaller than the target size {size}")
    return up[: size[0], : size[1]]


def binarise(img: np.ndarray) -> np.ndarray:
    """Values above 0 to 255, then to a uint8 {0, 1} mask."""
    return (np.where(img > 0, 255, 0) == 255).astype(np.uint8)


@overload
def paper_labels(
    rgb: np.ndarray,
    *,
    size: tuple[int, int] | None = None,
    downsample: int = 8,
    bright_threshold: float = 230.0,
    tile: int = 1,
    median_ksize: int = 5,
    erode_ksize: int = 5,
    erode_iterations: int = 1,
    dilate_ksize: int = 5,
    dilate_iterations: int = 1,
    return_low: Literal[False] = False,
) -> np.ndarray: ...
@overload
def paper_labels(
    rgb: np.ndarray,
    *,
    size: tuple[int, int] | None = None,
    downsample: int = 8,
    bright_threshold: float = 230.0,
    tile: int = 1,
    median_ksize: int = 5,
    erode_ksize: int = 5,
    erode_iterations: int = 1,
    dilate_ksize: int = 5,
    dilate_iterations: int = 1,
    return_low: Literal[True],
) -> tuple[np.ndarray, np.ndarray]: ...
def paper_labels(
    rgb: np.ndarray,
    *,
    size: tuple[int, int] | None = None,
    downsample: int = 8,
    bright_threshold: float = 230.0,
    tile: int = 1,
    median_ksize: int = 5,
    erode_ksize: int = 5,
    erode_iterations: int = 1,
    dilate_ksize: int = 5,
    dilate_iterations: int = 1,
    return_low: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The paper's tissue label for an RGB image (uint8 {0, 1}, tissue = 1, at the image's resolution).

    Parameters
    ----------
    rgb
        uint8 (H, W, 3) RGB image (glass is bright).
    size
        Crop (height, width) px from the top-left corner (paper: 16,000 x 64,000); None keeps the image.
    downsample
        Factor of the area-mean downsampling (paper: 8).
    bright_threshold
        Tiles with mean intensity over this are set to 0 (paper: 230).
    tile
        Tile edge in downsampled px (paper: 1).
    median_ksize, erode_ksize, erode_iterations, dilate_ksize, dilate_iterations
        Not given by the paper; chosen here (px at the downsampled scale), see the module docstring.
    return_low
        Also return the mask at the downsampled scale (uint8 {0, 1}, shape ceil(H/d) x ceil(W/d)).
    """
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected a uint8 (H, W, 3) RGB image, got {rgb.dtype} {rgb.shape}")
    img = crop_or_pad(rgb, size)
    h, w = img.shape[:2]
    low = block_mean_downsample(img, downsample)
    low = zero_bright_tiles(low, bright_threshold, tile)
    grey = to_grey(low)
    m = nonzero_to_255(grey)
    m = median_blur(m, median_ksize)
    m = erode(m, erode_ksize, erode_iterations)
    m = dilate(m, dilate_ksize, dilate_iterations)
    m = fill_holes(m)
    low_mask = m.astype(np.uint8) * 255
    full = binarise(upsample_nearest(low_mask, downsample, (h, w)))
    if return_low:
        return full, binarise(low_mask)
    return full
