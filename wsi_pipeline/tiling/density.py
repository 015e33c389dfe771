"""The ``tissue`` method: stained tissue by optical density against each slide's own glass.

A scanner records transmitted light: glass passes all of it (its level, per RGB channel, is
wherever the scanner's white balance put it: grey 210..252, sometimes slightly blue), and every
stain absorbs some of it in some channel (haematoxylin red and green, eosin green, DAB blue,
special stains elsewhere). So on the overview (each pixel averages the level-0 pixels of
1/16 of a tile side, which removes scanner noise):

1. **Glass** (:func:`~wsi_pipeline.tiling.background.estimate_background`): neutral, bright, flat
   overview pixels; their per-channel median is the glass colour ``G``.
2. **Optical density** of a pixel ``I``: ``od_c = log10(G_c / I_c)`` per channel; the tissue signal
   is the largest channel's, so a stain that absorbs in one channel only (pale blue haematoxylin
   counterstain: red; DAB: blue) counts as much as one absorbing in all three. It is
   independent of the glass level: tissue on glass at 210 and at 250 has the same density.
3. **Threshold**: tissue when the signal reaches ``min_od``, or more where the glass itself
   varies (uneven lighting): the glass pixels' median plus 5 robust standard deviations (1.4826
   x their median absolute deviation) plus ``glass_margin_od``; after a 3 x 3 median. Ink
   (:func:`~wsi_pipeline.tiling.artifacts.ink_mask`) is not tissue.
4. **Cleaning**: components smaller than ``min_object`` of a tile (dust) are dropped, holes smaller
   than ``max_hole`` of a tile filled. Sizes are in tiles, so no mpp is needed.

A slide whose overview shows no glass (a crop inside the tissue) is tissue wherever it is not
ink and not near-white; a dark-background (fluorescence) slide is skipped before this runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from wsi_pipeline.config.tiling_params import TissueParams
from wsi_pipeline.tiling.background import Background, glass_pixels

__all__ = ["NO_GLASS_WHITE", "clean_tissue", "density_tissue_mask", "optical_density", "stained_mask", "tissue_signal"]

#: With no glass in view, pixels at least this bright in every channel are not tissue (holes, fat).
NO_GLASS_WHITE = 235


def optical_density(rgb: np.ndarray, glass: np.ndarray | tuple[float, float, float]) -> np.ndarray:
    """float32 (..., 3) optical density ``log10(glass_c / max(value_c, 1))`` per channel, >= 0.

    Parameters
    ----------
    rgb : uint8 (..., 3) RGB.
    glass : the glass colour (3,), 0..255 per channel.
    """
    g = np.maximum(np.asarray(glass, np.float32), 1.0)
    od = np.log10(g / np.maximum(rgb.astype(np.float32), 1.0))
    return np.maximum(od, 0.0)


def tissue_signal(rgb: np.ndarray, glass: np.ndarray | tuple[float, float, float]) -> np.ndarray:
    """float32 (H, W): the largest channel's optical density against ``glass``, median-filtered 3 x 3."""
    import cv2

    s = optical_density(rgb, glass).max(axis=-1)
    if min(s.shape) >= 3:
        s = cv2.medianBlur(np.ascontiguousarray(s, np.float32), 3)
    return s


def _drop_small(mask: np.ndarray, min_area: int) -> np.ndarray:
    """Remove 8-connected True components under ``min_area`` px."""
    import cv2

    if min_area <= 1 or not mask.any():
        return mask
    n, labels, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    small = stats[:, cv2.CC_STAT_AREA] < min_area
    small[0] = False
    return mask & ~small[labels] if small.any() else mask


def _fill_holes(mask: np.ndarray, max_area: int) -> np.ndarray:
    """Fill 4-connected False regions under ``max_area`` px that do not touch the image edge."""
    import cv2

    if max_area <= 1 or mask.all():
        return mask
    n, labels, stats, _ = cv2.connectedComponentsWithStats((~mask).astype(np.uint8), connectivity=4)
    h, w = mask.shape
    x, y = stats[:, cv2.CC_STAT_LEFT], stats[:, cv2.CC_STAT_TOP]
    bw, bh = stats[:, cv2.CC_STAT_WIDTH], stats[:, cv2.CC_STAT_HEIGHT]
    hole = (stats[:, cv2.CC_STAT_AREA] < max_area) & ~((x == 0) | (y == 0) | (x + bw == w) | (y + bh == h))
    hole[0] = False
    return mask | hole[labels] if hole.any() else mask


def stained_mask(overview: np.ndarray, background: Background, params: TissueParams = TissueParams()) -> tuple[np.ndarray, dict[str, Any]]:
    """Bool (H, W): overview pixels whose optical density against the glass reaches the threshold
    (steps 1-3 of the module docstring, before ink and cleaning), and a description of the rule.

    Parameters
    ----------
    overview : uint8 (H, W, 3) RGB, the slide at a reduced scale.
    background : its background estimate (:func:`~wsi_pipeline.tiling.background.estimate_background`).
    params : :class:`~wsi_pipeline.config.tiling_params.TissueParams`.
    """
    overview = np.ascontiguousarray(overview)
    if overview.ndim != 3 or overview.shape[2] != 3 or overview.dtype != np.uint8:
        raise ValueError(f"overview must be a uint8 (H, W, 3) RGB array; got {overview.dtype} {overview.shape}")
    if background.kind == "bright" and background.rgb is not None:
        glass = np.asarray(background.rgb, np.float32)
        signal = tissue_signal(overview, glass)
        on_glass = signal[glass_pixels(overview)]
        floor = 0.0
        if on_glass.size:
            # robust spread of the glass (a pale, flat tissue pixel taken for glass must not raise it)
            med = float(np.median(on_glass))
            floor = med + 5.0 * 1.4826 * float(np.median(np.abs(on_glass - med))) + params.glass_margin_od
        thr = max(params.min_od, floor)
        mask = signal >= thr
        info: dict[str, Any] = {"rule": "od-vs-glass", "glass_rgb": [float(v) for v in glass], "threshold_od": round(float(thr), 4)}
    else:
        mask = ~np.all(overview >= NO_GLASS_WHITE, axis=-1)
        info = {"rule": "no-glass", "glass_rgb": None, "threshold_od": None}
    return mask, info


def clean_tissue(mask: np.ndarray, params: TissueParams = TissueParams(), *, tile_px: float = 16.0) -> np.ndarray:
    """Step 4: drop components under ``min_object`` of a tile's area and fill holes under ``max_hole``.

    ``tile_px``: overview px per tile side.
    """
    area = float(tile_px) ** 2
    cleaned = _drop_small(mask, int(math.ceil(params.min_object * area)))
    return _fill_holes(cleaned, int(math.ceil(params.max_hole * area)))


def density_tissue_mask(
    overview: np.ndarray, background: Background, params: TissueParams = TissueParams(), *, tile_px: float = 16.0,
    ink: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Tissue mask of a slide's overview (the rule in the module docstring).

    Parameters
    ----------
    overview : uint8 (H, W, 3) RGB, the slide at a reduced scale.
    background : its background estimate (:func:`~wsi_pipeline.tiling.background.estimate_background`).
    params : :class:`~wsi_pipeline.config.tiling_params.TissueParams`.
    tile_px : overview px per tile side (object and hole sizes are fractions of a tile's area).
    ink : bool (H, W) pen ink (not tissue, not filled as a hole), or None.

    Returns
    -------
    (mask, info): bool (H, W), True = tissue; info has the glass colour, the threshold (optical
    density), the rule (``od-vs-glass`` or ``no-glass``) and the tissue fraction.
    """
    mask, info = stained_mask(overview, background, params)
    if ink is not None:
        mask = mask & ~ink
    mask = clean_tissue(mask, params, tile_px=tile_px)
    if ink is not None:
        mask &= ~ink
    info["tissue_fraction"] = float(mask.mean())
    return mask, info
