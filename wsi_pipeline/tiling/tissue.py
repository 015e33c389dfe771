"""Foreground and tissue detection: the greyscale rule and the Otsu tissue mask.

- Greyscale (PANDA / TCGA-PRAD protocol): grey = BT.601 luma as OpenCV's ``RGB2GRAY`` computes
  it (8-bit fixed point); a pixel is foreground when ``grey_min <= grey <= grey_max``
  (3 and 230); a tile's foreground is the fraction of such pixels.
- Otsu (CAMELYON protocol): on a low-resolution image, median blur, Otsu threshold (of the
  HSV saturation on brightfield slides, as CLAM does: pale stroma is grey-ish in luma but
  clearly coloured), morphological closing, then removal of small objects and small holes.
  Sizes are in um and um^2, so the result does not depend on the mask's resolution.
  On a bright background the threshold is trusted only against glass the image shows
  (:mod:`wsi_pipeline.tiling.background`): with no glass visible the whole field is tissue
  (a crop inside the tissue); with glass, the threshold is clipped to
  [glass's 99th percentile, that + ``glass_margin``] of the thresholded channel, so a split
  inside the tissue (dense vs pale, DAB vs haematoxylin) never drops the paler tissue, and
  the image is blank when the tissue class is within ``min_contrast`` of the glass.
  With glass in view the same rule also runs on the optical density against the glass colour
  (``log10(glass / value)`` of the most absorbing channel, 1/510 per level; ``info["optical_density"]``);
  when it finds half as much tissue again as the saturation, tissue is what either channel finds:
  a pale, barely coloured section (saturation within a few levels of the glass) still absorbs light. Limit: tissue absorbing less than
  ``min_contrast`` / 510 = 0.03 optical density (7 % of the light) is missed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from wsi_pipeline.config.tiling_params import OtsuParams
from wsi_pipeline.tiling.background import Background, estimate_background, glass_pixels

__all__ = ["grey", "otsu_tissue_mask", "strip_foreground", "tiles_foreground"]


def grey(rgb: np.ndarray) -> np.ndarray:
    """uint8 (..., H, W, 3) RGB to uint8 (..., H, W) BT.601 luma, exactly as ``cv2.COLOR_RGB2GRAY``."""
    import cv2

    rgb = np.ascontiguousarray(rgb)
    if rgb.ndim == 3:
        return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    h, w = rgb.shape[-3:-1]
    flat = rgb.reshape(-1, w, 3)
    return cv2.cvtColor(flat, cv2.COLOR_RGB2GRAY).reshape(rgb.shape[:-1])


def _in_range(g: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (g >= lo) & (g <= hi)


def strip_foreground(strip: np.ndarray, tile_size: int, grey_min: int = 3, grey_max: int = 230) -> np.ndarray:
    """Foreground fractions of the tiles of a horizontal strip.

    Parameters
    ----------
    strip : uint8 (T, k*T, 3) RGB, k tiles side by side.
    tile_size : T in px.
    grey_min, grey_max : inclusive foreground grey range.

    Returns
    -------
    float32 (k,), fraction of each tile's pixels within the range.
    """
    T = int(tile_size)
    g = grey(strip)
    k = g.shape[1] // T
    fg = _in_range(g[:, : k * T], grey_min, grey_max)
    counts = fg.reshape(T, k, T).sum(axis=(0, 2), dtype=np.int64)
    return (counts / float(T * T)).astype(np.float32)


def tiles_foreground(tiles: np.ndarray, grey_min: int = 3, grey_max: int = 230) -> np.ndarray:
    """Foreground fractions of tiles uint8 (k, T, T, 3); float32 (k,)."""
    if len(tiles) == 0:
        return np.zeros(0, np.float32)
    g = grey(tiles)
    fg = _in_range(g, grey_min, grey_max)
    return fg.reshape(len(tiles), -1).mean(axis=1, dtype=np.float64).astype(np.float32)


def _drop_small_components(mask: np.ndarray, min_area: int, *, touching_border: bool) -> np.ndarray:
    """Remove 8-connected True components with fewer than ``min_area`` px.

    With ``touching_border=False`` components that touch the image edge are always kept (used
    for holes: background open to the slide edge is not a hole).
    """
    import cv2

    n, labels, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    small = stats[:, cv2.CC_STAT_AREA] < min_area
    small[0] = False  # label 0 is the complement
    if not touching_border:
        h, w = mask.shape
        x, y = stats[:, cv2.CC_STAT_LEFT], stats[:, cv2.CC_STAT_TOP]
        bw, bh = stats[:, cv2.CC_STAT_WIDTH], stats[:, cv2.CC_STAT_HEIGHT]
        small &= ~((x == 0) | (y == 0) | (x + bw == w) | (y + bh == h))
    if not small.any():
        return mask
    return mask & ~small[labels]


def otsu_tissue_mask(
    rgb: np.ndarray, um_per_px: float, params: OtsuParams = OtsuParams(), *, background: Background | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """Tissue mask of a low-resolution slide image.

    Parameters
    ----------
    rgb : uint8 (H, W, 3) RGB, the slide at a reduced scale.
    um_per_px : microns per pixel of ``rgb``.
    params : :class:`OtsuParams`.
    background : the background estimate of ``rgb`` when the caller has it; None = estimate it here.

    Returns
    -------
    (mask, info): bool (H, W), True = tissue; info has the threshold, the background polarity,
    the channel thresholded, the contrast, the rule that decided (``otsu``, ``otsu-vs-glass``
    or ``no-glass``), the background estimate and the tissue fraction.
    """
    if params.background not in ("auto", "bright", "dark"):
        raise ValueError(f"background={params.background!r}; expected 'auto', 'bright' or 'dark'")
    if params.channel not in ("auto", "grey"):
        raise ValueError(f"channel={params.channel!r}; expected 'auto' or 'grey'")
    if not um_per_px > 0:
        raise ValueError(f"um_per_px={um_per_px} must be > 0")
    rgb = np.ascontiguousarray(rgb)
    g = grey(rgb)
    bg = estimate_background(rgb) if background is None else background
    polarity = params.background
    if polarity == "auto":
        polarity = "dark" if bg.is_dark else "bright"
    glass_px = glass_pixels(rgb) if polarity == "bright" and bg.kind == "bright" else None
    signal, channel = _tissue_signal(rgb, g, polarity, params, um_per_px)
    thr, contrast, passes = _otsu_threshold(signal, params)
    rule = "otsu"
    if polarity == "bright" and glass_px is None:
        # no glass in view: a bimodal split would cut the tissue in two; all of it is tissue
        thr, rule = -1.0, "no-glass"
    elif glass_px is not None and glass_px.any():
        thr, contrast = _against_glass(signal, thr, glass_px, params)
        rule = "otsu-vs-glass"
    info: dict[str, Any] = {
        "threshold": float(thr), "passes": passes, "background": polarity, "channel": channel, "contrast": contrast,
        "rule": rule, "glass": bg.as_dict(),
    }
    mask = signal > thr if rule == "no-glass" or contrast >= params.min_contrast else np.zeros(signal.shape, bool)
    if rule == "otsu-vs-glass" and params.channel == "auto" and bg.rgb is not None:
        # pale tissue barely coloured (saturation near the glass's) still absorbs light: the same rule on its
        # optical density against the glass colour, and tissue is what either channel finds
        od = _od_signal(rgb, bg.rgb, params, um_per_px)
        od_thr, od_contrast, od_passes = _otsu_threshold(od, params)
        od_thr, od_contrast = _against_glass(od, od_thr, glass_px, params, robust=True)  # type: ignore[arg-type]
        od_mask = od > od_thr
        # used when it finds a population the saturation missed (half as much again), not to widen edges
        used = od_contrast >= params.min_contrast and od_mask.sum() > OD_MORE * mask.sum()
        info["optical_density"] = {"threshold": float(od_thr), "contrast": od_contrast, "passes": od_passes, "used": bool(used)}
        if used:
            mask |= od_mask
            contrast = max(contrast, od_contrast)
    if rule != "no-glass" and contrast < params.min_contrast:
        info["tissue_fraction"] = 0.0
        return np.zeros(signal.shape, bool), info
    mask = _clean_mask(mask, um_per_px, params)
    info["tissue_fraction"] = float(mask.mean())
    return mask, info


def _against_glass(signal: np.ndarray, thr: float, glass_px: np.ndarray, params: OtsuParams,
                   robust: bool = False) -> tuple[float, float]:
    """Otsu's threshold clipped to [glass high, that + ``glass_margin``] and the contrast of the tissue class
    against the glass's median. Glass high: the glass pixels' 99th percentile, or with ``robust`` their
    median + 5 robust standard deviations (1.4826 x the median absolute deviation; at least 2 levels), which
    pale flat tissue taken for glass does not raise."""
    on_glass = signal[glass_px].astype(np.float64)
    g_med = float(np.median(on_glass))
    if robust:
        g_hi = g_med + max(2.0, 5.0 * 1.4826 * float(np.median(np.abs(on_glass - g_med))))
    else:
        g_hi = float(np.percentile(on_glass, 99))
    hi = signal[signal > thr]
    contrast = float(hi.mean() - g_med) if hi.size else 0.0
    return float(min(max(thr, g_hi), g_hi + params.glass_margin)), contrast


def _tissue_signal(rgb: np.ndarray, g: np.ndarray, polarity: str, params: OtsuParams, um_per_px: float) -> tuple[np.ndarray, str]:
    """(uint8 (H, W) signal, larger = more likely tissue, median-filtered over ``median_um``; the channel's name)."""
    import cv2

    if params.channel == "grey":
        signal, channel = (255 - g if polarity == "bright" else g), "grey"
    elif polarity == "bright":
        signal, channel = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)[..., 1], "saturation"
    else:
        signal, channel = rgb.max(axis=2), "max_rgb"
    signal = np.ascontiguousarray(signal, dtype=np.uint8)
    k = min(255, max(3, int(round(params.median_um / um_per_px)) | 1))
    if min(signal.shape) > k:
        signal = cv2.medianBlur(signal, k)
    return signal, channel


#: The optical-density mask joins the saturation mask when it is larger by this factor.
OD_MORE = 1.5
#: Optical density per level of the ``optical_density`` channel (0..255 spans 0..0.5).
OD_PER_LEVEL = 1.0 / 510.0


def _od_signal(rgb: np.ndarray, glass: tuple[float, float, float], params: OtsuParams, um_per_px: float) -> np.ndarray:
    """uint8 (H, W): the largest channel's optical density against ``glass`` in levels of :data:`OD_PER_LEVEL`, median-filtered."""
    import cv2

    from wsi_pipeline.tiling.density import optical_density

    od = optical_density(rgb, glass).max(axis=-1)
    signal = np.ascontiguousarray(np.clip(np.rint(od / OD_PER_LEVEL), 0, 255), dtype=np.uint8)
    k = min(255, max(3, int(round(params.median_um / um_per_px)) | 1))
    return cv2.medianBlur(signal, k) if min(signal.shape) > k else signal


def _otsu_threshold(signal: np.ndarray, params: OtsuParams) -> tuple[float, float, int]:
    """(Otsu threshold of ``signal``, contrast between its classes, passes: 2 when a second pass found pale tissue)."""
    import cv2

    thr, _ = cv2.threshold(signal, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    lo, hi = signal[signal <= thr], signal[signal > thr]
    contrast = float(hi.mean() - lo.mean()) if lo.size and hi.size else 0.0
    passes = 1
    if lo.size > 1 and contrast >= params.min_contrast:
        # Three populations (glass, pale tissue, dense dark tissue) make Otsu split the two
        # kinds of tissue. A second pass on the lower class finds the pale tissue when it is a
        # distinct population (>= 10 % of the image, well above the glass level).
        thr2, _ = cv2.threshold(lo.reshape(1, -1), 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        glass, mid = lo[lo <= thr2], lo[lo > thr2]
        if mid.size >= 0.1 * signal.size and glass.size and mid.mean() - glass.mean() >= params.min_contrast:
            thr, passes = thr2, 2
    return thr, contrast, passes


def _clean_mask(mask: np.ndarray, um_per_px: float, params: OtsuParams) -> np.ndarray:
    """Close gaps up to ``closing_um``, drop objects under ``min_object_um2`` and fill holes under ``min_hole_um2``."""
    import cv2

    r = int(round(params.closing_um / um_per_px))
    if r >= 1:
        disk = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * r + 1, 2 * r + 1))
        # default border: dilation ignores, erosion keeps pixels beyond the edge (tissue cut by the
        # image edge is not eroded from it)
        mask = cv2.morphologyEx(mask.astype(np.uint8), cv2.MORPH_CLOSE, disk) > 0
    px_area = um_per_px * um_per_px
    min_obj = int(math.ceil(params.min_object_um2 / px_area))
    min_hole = int(math.ceil(params.min_hole_um2 / px_area))
    if min_obj > 1:
        mask = _drop_small_components(mask, min_obj, touching_border=True)
    if min_hole > 1:
        mask = ~_drop_small_components(~mask, min_hole, touching_border=False)
    return mask
