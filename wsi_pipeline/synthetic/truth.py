"""Ground truth of synthetic slides: the planted-lesion mask and per-tile lesion fractions.

A synthetic cohort's manifest carries two extra columns: ``lesion_mask`` (path of a PNG, uint8,
255 = lesion, 0 = not) and ``mask_downsample`` (level-0 px per mask px).
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.slides.coverage import box_mean

__all__ = ["write_mask", "read_mask", "tile_lesion_fraction"]


def write_mask(path: str | os.PathLike, mask: np.ndarray) -> None:
    """Write a bool/uint8 mask as a PNG (255 = lesion), atomically."""
    with atomic_path(path, suffix=".png") as tmp:
        Image.fromarray((np.asarray(mask) > 0).astype(np.uint8) * 255).save(tmp)


def read_mask(path: str | os.PathLike) -> np.ndarray:
    """Read a lesion mask PNG as bool (H, W)."""
    return np.asarray(Image.open(path).convert("L")) > 127


def tile_lesion_fraction(mask: np.ndarray, downsample: float, coords: np.ndarray, tile_extent: float) -> np.ndarray:
    """Fraction of each tile's footprint covered by the lesion mask (:func:`wsi_pipeline.slides.coverage.box_mean`).

    Exact: mask pixels the footprint covers in part count by the part covered.

    Parameters
    ----------
    mask : bool (H, W) lesion mask, one pixel per ``downsample`` level-0 px.
    downsample : level-0 px per mask px.
    coords : (N, 2) tile top-left (x, y) in level-0 px.
    tile_extent : tile side in level-0 px (tile_size * store downsample).

    Returns
    -------
    float (N,) in [0, 1]; footprint parts outside the mask count as non-lesion.
    """
    return box_mean(np.asarray(mask, np.float64), downsample, coords, tile_extent)
