"""Coverage of level-0 boxes by a low-resolution map: the one tile-fraction function.

A tile's footprint is a box in level-0 px; a mask or score map is stored coarser (one map px per
``downsample`` level-0 px). :func:`box_mean` gives the area-weighted mean of the map over each
box, exactly, including map pixels the box covers only in part. With a 0/1 mask it is the
fraction of the tile covered: tissue (tiling's Otsu foreground, the prescreen) and planted
lesions (synthetic ground truth, localisation metrics) use the same function.
"""

from __future__ import annotations

import numpy as np

__all__ = ["box_mean"]


def box_mean(values: np.ndarray, downsample: float, coords: np.ndarray, extent: float, *, outside: float = 0.0) -> np.ndarray:
    """Area-weighted mean of a low-resolution map over each tile's level-0 footprint.

    The map is treated as constant over each of its pixels, so the integral over any box is
    the bilinear interpolation of the summed-area table at the box corners: exact, including
    partially covered pixels.

    Parameters
    ----------
    values : float (H, W) map; pixel (i, j) covers level-0 [j*d, (j+1)*d) x [i*d, (i+1)*d).
    downsample : d, level-0 px per map px.
    coords : (N, 2) level-0 (x, y) of the footprints' top-left corners.
    extent : footprint side in level-0 px.
    outside : value assumed beyond the map's edge (for parts of a box within 2 map px of the edge;
        parts farther out count 0, exact for masks where outside means 0).

    Returns
    -------
    float64 (N,).
    """
    v = np.asarray(values, np.float64)
    pad = 2
    v = np.pad(v, pad, constant_values=outside)
    sat = np.zeros((v.shape[0] + 1, v.shape[1] + 1))
    sat[1:, 1:] = v.cumsum(0).cumsum(1)

    def integral(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x = np.clip(x + pad, 0, v.shape[1])
        y = np.clip(y + pad, 0, v.shape[0])
        x0 = np.minimum(np.floor(x).astype(np.int64), v.shape[1] - 1)
        y0 = np.minimum(np.floor(y).astype(np.int64), v.shape[0] - 1)
        fx, fy = x - x0, y - y0
        return (
            sat[y0, x0] * (1 - fx) * (1 - fy)
            + sat[y0, x0 + 1] * fx * (1 - fy)
            + sat[y0 + 1, x0] * (1 - fx) * fy
            + sat[y0 + 1, x0 + 1] * fx * fy
        )

    c = np.asarray(coords, np.float64).reshape(-1, 2) / downsample
    e = extent / downsample
    x0, y0 = c[:, 0], c[:, 1]
    total = integral(x0 + e, y0 + e) - integral(x0, y0 + e) - integral(x0 + e, y0) + integral(x0, y0)
    return total / (e * e)
