"""Localisation: tile attention against the slide's ground-truth lesions.

A tile is positive when at least half its footprint is lesion (manifest ``lesion_mask`` +
``mask_downsample`` columns, or a store's ``lesion`` array); the ROC AUC (scikit-learn) of the
all-tiles attention against that truth is computed per slide (slides with both kinds of tile).

A ``lesion_mask`` is read or refused, never skipped in silence: one that exists but is not a
readable image (a FIFO, a device such as ``/dev/zero``, a folder, a text file, a damaged PNG)
raises :class:`LesionMaskError` and that slide fails by name (``eval`` exits 1 unless
``--allow-failures``); one that does not exist is named in a warning, and the slide is scored
without it (the store's own ``lesion`` array when it has one; ``localisation_n_slides`` says how
many slides the localisation AUC covers).
"""

from __future__ import annotations

import logging
import math
import os
import stat

import numpy as np
import pandas as pd

from wsi_pipeline.data.store import TileStore

__all__ = ["LesionMaskError", "lesion_fraction", "lesion_outline", "localisation_auc"]

log = logging.getLogger(__name__)

_missing_told: set[str] = set()  # masks already reported missing (once per file, not per model)


class LesionMaskError(ValueError):
    """A manifest ``lesion_mask`` that exists but does not read as a mask image; the message names slide and file."""


def _read_lesion_mask(row: pd.Series) -> np.ndarray | None:
    """The slide's ``lesion_mask`` as bool (H, W); None when it names none or a file that does not exist (warned)."""
    mask_path = row.get("lesion_mask")
    if not isinstance(mask_path, str) or not mask_path:
        return None
    sid = row.get("slide_id")
    try:
        st = os.stat(mask_path)
    except FileNotFoundError:
        if mask_path not in _missing_told:
            _missing_told.add(mask_path)
            log.warning("slide %s: its lesion_mask %s does not exist; scored without it (no localisation from the "
                        "manifest for this slide)", sid, mask_path)
        return None
    except OSError as e:
        raise LesionMaskError(f"slide {sid}: lesion_mask {mask_path} cannot be read ({e})") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "a device or special file"
        raise LesionMaskError(f"slide {sid}: lesion_mask {mask_path} is {kind}, not a mask image (expected a PNG)")
    from PIL import Image

    from wsi_pipeline.synthetic.truth import read_mask

    try:
        return read_mask(mask_path)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise LesionMaskError(f"slide {sid}: lesion_mask {mask_path} does not open as an image ({e})") from e


def localisation_auc(attention: np.ndarray, lesion_fraction: np.ndarray, threshold: float = 0.5) -> float:
    """ROC AUC (scikit-learn) of tile attention against ``lesion_fraction >= threshold``; nan if one class only."""
    from sklearn.metrics import roc_auc_score

    truth = np.asarray(lesion_fraction) >= threshold
    if truth.all() or not truth.any():
        return math.nan
    return float(roc_auc_score(truth, np.asarray(attention, dtype=np.float64)))


def lesion_fraction(row: pd.Series, store: TileStore, extent: float) -> np.ndarray | None:
    mask = _read_lesion_mask(row)
    if mask is not None:
        from wsi_pipeline.synthetic.truth import tile_lesion_fraction

        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return tile_lesion_fraction(mask, ds, store.coords, extent)
    if "lesion" in store.group:
        return store.array("lesion").astype(np.float64).reshape(-1)
    return None


def lesion_outline(row: pd.Series, store: TileStore, extent: float, level0: tuple[int, int], shape: tuple[int, int]) -> np.ndarray | None:
    """The slide's ground-truth lesions on the thumbnail's grid (bool (h, w)), or None without truth.

    From the manifest's ``lesion_mask`` + ``mask_downsample``, else from a store's ``lesion``
    array (tiles at least half lesion).
    """
    from wsi_pipeline.export.heatmap import mask_to_thumbnail, tile_rects

    mask = _read_lesion_mask(row)
    if mask is not None:
        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return mask_to_thumbnail(mask, ds, level0, shape)
    if "lesion" in store.group:
        pos = store.array("lesion").astype(np.float64).reshape(-1) >= 0.5
        h, w = shape
        x0, y0, x1, y1 = tile_rects(store.coords[pos], extent, (w / level0[0], h / level0[1]), shape)
        out = np.zeros(shape, bool)
        for a, b, c, d in zip(x0, y0, x1, y1):
            out[b:d, a:c] = True
        return out
    return None
