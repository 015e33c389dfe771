"""Ground truth of synthetic slides: the planted-lesion mask and per-tile lesion fractions.

A synthetic cohort's manifest carries two extra columns: ``lesion_mask`` (path of a PNG, uint8,
255 = lesion, 0 = not) and ``mask_downsample`` (level-0 px per mask px).
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

__all__ = ["write_mask", "read_mask", "tile_lesion_fraction"]


def write_mask(path: str | os.PathLike, mask: np.ndarray) -> None:
    """Write a bool/uint8 mask as a PNG (255 = lesion), atomically."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}.png"
    Image.fromarray((np.asarray(mask) > 0).astype(np.uint8) * 255).save(tmp)
    os.replace(tmp, path)


def read_mask(path: str | os.PathLike) -> np.ndarray:
    """Read a lesion mask PNG as bool (H, W)."""
    return np.asarray(Image.open(path).convert("L")) > 127


def tile_lesion_fraction(mask: np.ndarray, downsample: float, coords: np.ndarray, tile_extent: float) -> np.ndarray:
    """Fraction of each tile's footprint covered by the lesion mask.

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
    m = np.asarray(mask, np.float64)
    integral = np.zeros((m.shape[0] + 1, m.shape[1] + 1))
    integral[1:, 1:] = m.cumsum(0).cumsum(1)
    c = np.asarray(coords, np.float64)
    x0 = np.clip(np.floor(c[:, 0] / downsample), 0, m.shape[1]).astype(int)
    y0 = np.clip(np.floor(c[:, 1] / downsample), 0, m.shape[0]).astype(int)
    x1 = np.clip(np.ceil((c[:, 0] + tile_extent) / downsample), 0, m.shape[1]).astype(int)
    y1 = np.clip(np.ceil((c[:, 1] + tile_extent) / downsample), 0, m.shape[0]).astype(int)
    area = np.maximum((np.ceil((c[:, 0] + tile_extent) / downsample) - np.floor(c[:, 0] / downsample))
                      * (np.ceil((c[:, 1] + tile_extent) / downsample) - np.floor(c[:, 1] / downsample)), 1)
    s = integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
    return s / area
