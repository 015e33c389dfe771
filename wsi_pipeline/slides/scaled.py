"""Read a whole slide (or a level-0 box of it) at a reduced scale, in memory-bounded strips."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from wsi_pipeline.slides.reader import Slide

__all__ = ["read_scaled", "scaled_shape"]

#: Upper bound on the level pixels decoded per strip (keeps memory flat on single-level slides).
_STRIP_PIXELS = 16 * 1024 * 1024


def scaled_shape(dimensions: tuple[int, int], downsample: float) -> tuple[int, int]:
    """(height, width) in px of the slide scaled by 1/``downsample``; partial edge pixels are dropped."""
    w0, h0 = dimensions
    return max(1, int(h0 // downsample)), max(1, int(w0 // downsample))


def read_scaled(slide: Slide, downsample: float) -> np.ndarray:
    """The whole slide at ``downsample`` level-0 px per output px.

    Output pixel (i, j) covers level-0 px [j * d, (j + 1) * d) x [i * d, (i + 1) * d) with
    d = ``downsample``; it is the area average (``cv2.INTER_AREA``) of the best pyramid level at or
    finer than d. The slide is read in strips, so memory stays bounded for single-level slides.

    Parameters
    ----------
    slide : an open slide.
    downsample : level-0 px per output px (>= 1).

    Returns
    -------
    uint8 (H, W, 3) RGB with (H, W) = :func:`scaled_shape`.
    """
    import cv2

    if not downsample >= 1:
        raise ValueError(f"downsample={downsample} must be >= 1 (level-0 px per output px)")
    level = slide.best_level_for_downsample(downsample)
    dl = slide.level_downsamples[level]
    lw, lh = slide.level_dimensions[level]
    oh, ow = scaled_shape(slide.dimensions, downsample)
    scale = downsample / dl  # level px per output px
    src_w = min(lw, max(1, int(round(ow * scale))))
    rows_per_strip = max(1, min(oh, int(_STRIP_PIXELS / max(1.0, src_w * scale))))
    out = np.empty((oh, ow, 3), np.uint8)
    r = 0
    while r < oh:
        r1 = min(oh, r + rows_per_strip)
        ly0 = int(round(r * scale))
        ly1 = min(lh, max(ly0 + 1, int(round(r1 * scale))))
        strip = slide.read_region((0, int(round(ly0 * dl))), level, (src_w, ly1 - ly0))
        if strip.shape[:2] == (r1 - r, ow):
            out[r:r1] = strip
        else:
            interp = cv2.INTER_AREA if scale >= 1 else cv2.INTER_LINEAR
            out[r:r1] = cv2.resize(strip, (ow, r1 - r), interpolation=interp)
        r = r1
    return out

