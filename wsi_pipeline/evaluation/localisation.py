"""Localisation: tile attention against the slide's ground-truth lesions.

A tile is positive when at least half its footprint is lesion (manifest ``lesion_mask`` +
``mask_downsample`` columns, or a store's ``lesion`` array); the ROC AUC (scikit-learn) of the
all-tiles attention against that truth is computed per slide (slides with both kinds of tile).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd

from wsi_pipeline.data.store import TileStore

__all__ = ["lesion_fraction", "lesion_outline", "localisation_auc"]


def localisation_auc(attention: np.ndarray, lesion_fraction: np.ndarray, threshold: float = 0.5) -> float:
    """ROC AUC (scikit-learn) of tile attention against ``lesion_fraction >= threshold``; nan if one class only."""
    from sklearn.metrics import roc_auc_score

    truth = np.asarray(lesion_fraction) >= threshold
    if truth.all() or not truth.any():
        return math.nan
    return float(roc_auc_score(truth, np.asarray(attention, dtype=np.float64)))


def lesion_fraction(row: pd.Series, store: TileStore, extent: float) -> np.ndarray | None:
    mask_path = row.get("lesion_mask")
    if isinstance(mask_path, str) and mask_path and os.path.isfile(mask_path):
        from wsi_pipeline.synthetic.truth import read_mask, tile_lesion_fraction

        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return tile_lesion_fraction(read_mask(mask_path), ds, store.coords, extent)
    if "lesion" in store.group:
        return store.array("lesion").astype(np.float64).reshape(-1)
    return None


def lesion_outline(row: pd.Series, store: TileStore, extent: float, level0: tuple[int, int], shape: tuple[int, int]) -> np.ndarray | None:
    """The slide's ground-truth lesions on the thumbnail's grid (bool (h, w)), or None without truth.

    From the manifest's ``lesion_mask`` + ``mask_downsample``, else from a store's ``lesion``
    array (tiles at least half lesion).
    """
    from wsi_pipeline.export.heatmap import mask_to_thumbnail, tile_rects

    mask_path = row.get("lesion_mask")
    if isinstance(mask_path, str) and mask_path and os.path.isfile(mask_path):
        from wsi_pipeline.synthetic.truth import read_mask

        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return mask_to_thumbnail(read_mask(mask_path), ds, level0, shape)
    if "lesion" in store.group:
        pos = store.array("lesion").astype(np.float64).reshape(-1) >= 0.5
        h, w = shape
        x0, y0, x1, y1 = tile_rects(store.coords[pos], extent, (w / level0[0], h / level0[1]), shape)
        out = np.zeros(shape, bool)
        for a, b, c, d in zip(x0, y0, x1, y1):
            out[b:d, a:c] = True
        return out
    return None
