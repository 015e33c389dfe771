"""Read a whole slide at a reduced scale, in memory-bounded strips: the one whole-slide downscale.

:func:`read_scaled` (a given downsample: tiling's overview, the tissue U-Net's input,
``Slide.thumbnail``) and :func:`read_resized` (a given output size: heatmap thumbnails) both go
through the same strip reader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from wsi_pipeline.types import SlideLike

__all__ = ["best_exact_level", "read_resized", "read_scaled", "scaled_shape"]

#: Upper bound on the level pixels decoded per strip (keeps memory flat on single-level slides).
_STRIP_PIXELS = 16 * 1024 * 1024


def scaled_shape(dimensions: tuple[int, int], downsample: float) -> tuple[int, int]:
    """(height, width) in px of the slide scaled by 1/``downsample``; partial edge pixels are dropped."""
    w0, h0 = dimensions
    return max(1, int(h0 // downsample)), max(1, int(w0 // downsample))


def best_exact_level(slide: SlideLike, downsample: float) -> int:
    """The coarsest level that :meth:`Slide.read_level` reads exactly with downsample at most ``downsample`` (1e-3 slack)."""
    best = 0
    for i, d in enumerate(slide.level_downsamples):
        if d <= downsample * (1 + 1e-3) and d >= slide.level_downsamples[best] and slide.level_is_exact(i):
            best = i
    return best


def read_scaled(slide: SlideLike, downsample: float) -> np.ndarray:
    """The whole slide at ``downsample`` level-0 px per output px.

    Output pixel (i, j) covers level-0 px [j * d, (j + 1) * d) x [i * d, (i + 1) * d) with
    d = ``downsample``; it is the area average (``cv2.INTER_AREA``) of the best pyramid level at or
    finer than d that the reader addresses exactly (:func:`best_exact_level`, read with
    :meth:`Slide.read_level`). The slide is read in strips, so memory stays bounded for single-level slides.

    Parameters
    ----------
    slide : an open slide.
    downsample : level-0 px per output px (>= 1).

    Returns
    -------
    uint8 (H, W, 3) RGB with (H, W) = :func:`scaled_shape`.
    """
    if not downsample >= 1:
        raise ValueError(f"downsample={downsample} must be >= 1 (level-0 px per output px)")
    return _read_strips(slide, (downsample, downsample), scaled_shape(slide.dimensions, downsample))


def read_resized(slide: SlideLike, shape: tuple[int, int]) -> np.ndarray:
    """The whole slide resized to ``shape`` = (h, w) px (smaller or larger than level 0).

    Output pixel (i, j) covers level-0 px [j * W / w, (j + 1) * W / w) x [i * H / h, (i + 1) * H / h)
    for a level 0 of (W, H) px; read as :func:`read_scaled` reads (area average of the best exact
    level at or finer than the coarser axis' downsample; bilinear where the output is finer than level 0).

    Returns
    -------
    uint8 (h, w, 3) RGB.
    """
    h, w = (int(v) for v in shape)
    if h < 1 or w < 1:
        raise ValueError(f"output shape must be positive (h, w) px; got {shape}")
    W, H = slide.dimensions
    return _read_strips(slide, (W / w, H / h), (h, w))


def _read_strips(slide: SlideLike, downsample: tuple[float, float], shape: tuple[int, int]) -> np.ndarray:
    """Output (h, w) = ``shape`` whose px (i, j) covers level-0 [j * dx, (j + 1) * dx) x [i * dy, (i + 1) * dy),
    (dx, dy) = ``downsample``, read in strips of the best exact level at or finer than min(dx, dy)."""
    import cv2

    dx, dy = downsample
    level = best_exact_level(slide, min(dx, dy))
    sx, sy = slide.level_scale(level)
    lw, lh = slide.level_dimensions[level]
    oh, ow = shape
    scale_x, scale_y = dx / sx, dy / sy  # level px per output px
    src_w = min(lw, max(1, int(round(ow * scale_x))))
    rows_per_strip = max(1, min(oh, int(_STRIP_PIXELS / max(1.0, src_w * scale_y))))
    out = np.empty((oh, ow, 3), np.uint8)
    r = 0
    while r < oh:
        r1 = min(oh, r + rows_per_strip)
        ly0 = int(round(r * scale_y))
        ly1 = min(lh, max(ly0 + 1, int(round(r1 * scale_y))))
        strip = slide.read_level(level, (0, ly0), (src_w, ly1 - ly0))
        if strip.shape[:2] == (r1 - r, ow):
            out[r:r1] = strip
        else:
            interp = cv2.INTER_AREA if min(scale_x, scale_y) >= 1 else cv2.INTER_LINEAR
            out[r:r1] = cv2.resize(strip, (ow, r1 - r), interpolation=interp)
        r = r1
    return out
