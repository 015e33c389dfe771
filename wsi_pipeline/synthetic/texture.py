"""H&E-like texture painting, shared by the synthetic slide generator and the tile-level cohort.

Normal tissue is pink stroma with sparse, small, pale nuclei; a lesion is a dense cluster of
large dark nuclei, a texture a CNN tells apart from a few pixels. A mimic (think of an
inflammatory infiltrate) is a benign cluster of small, very dark nuclei: it darkens a region about
as much as a lesion does, so only the nuclei's size and spacing tell the two apart. Everything is deterministic in
the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["Stain", "HE_STAIN", "SCANNER_SHIFT", "paint_tissue", "stain_shift_matrix"]

#: RGB colours (0..255) of stroma, normal nuclei and lesion nuclei.
Stain = tuple[tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]]
HE_STAIN: Stain = ((236.0, 178.0, 208.0), (150.0, 100.0, 170.0), (70.0, 30.0, 110.0))


def stain_shift_matrix(
    src: tuple[tuple[float, float, float], tuple[float, float, float]],
    dst: tuple[tuple[float, float, float], tuple[float, float, float]],
    intensity: tuple[float, float] = (1.0, 1.0),
) -> tuple[tuple[float, float, float], ...]:
    """The 3 x 3 optical-density map that re-stains haematoxylin/eosin vectors ``src`` (H, E as RGB OD
    vectors) as ``dst`` with the stains' amounts scaled by ``intensity``; OD off the ``src`` plane is kept.

    ``A = D diag(intensity) pinv(S) + (I - S pinv(S))`` with S, D the column-normalised 3 x 2 matrices.
    """
    S = np.asarray(src, np.float64).T
    D = np.asarray(dst, np.float64).T
    S, D = S / np.linalg.norm(S, axis=0), D / np.linalg.norm(D, axis=0)
    P = np.linalg.pinv(S)
    A = D @ np.diag(intensity) @ P + (np.eye(3) - S @ P)
    return tuple((float(row[0]), float(row[1]), float(row[2])) for row in A)


#: A scanner/lab shift in stain space (:func:`stain_shift_matrix`): from Ruifrok & Johnston's measured
#: haematoxylin (0.65, 0.70, 0.29) and eosin (0.07, 0.99, 0.11) OD vectors to the H&E reference
#: vectors of Macenko et al.'s normalisation code, estimated on another lab's slides (H (0.5626,
#: 0.7201, 0.4062), E (0.2159, 0.8012, 0.5581); H turns by 8 degrees, E by 30), with both stains
#: 25 % denser (a thicker section, or a scanner with another gain).
SCANNER_SHIFT = stain_shift_matrix(((0.65, 0.70, 0.29), (0.07, 0.99, 0.11)),
                                   ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581)), (1.25, 1.25))


def _nuclei(rng: np.random.Generator, h: int, w: int, density: float, radius: float) -> np.ndarray:
    """Soft nuclei map in [0, 1], shape (h, w): ``density`` nuclei per px^2 of radius ``radius`` px."""
    n = rng.poisson(density * h * w)
    canvas = np.zeros((h, w), np.float32)
    if n:
        ys = rng.integers(0, h, n)
        xs = rng.integers(0, w, n)
        canvas[ys, xs] = 1.0
    k = max(3, int(radius * 4) | 1)
    blurred = cv2.GaussianBlur(canvas, (k, k), radius)
    peak = 1.0 / (2 * np.pi * radius**2)
    return np.clip(blurred / (0.5 * peak), 0.0, 1.0)


def paint_tissue(
    rng: np.random.Generator,
    height: int,
    width: int,
    *,
    lesion: np.ndarray | None = None,
    stain: Stain = HE_STAIN,
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0),
    noise: float = 4.0,
    scale: float = 1.0,
    lesion_contrast: float = 1.0,
    mimic: np.ndarray | None = None,
    nuclei_density: float = 1.0,
    od_matrix: tuple[tuple[float, float, float], ...] | None = None,
) -> np.ndarray:
    """Paint an H&E-like tissue region.

    Parameters
    ----------
    rng : random generator (the only source of randomness).
    height, width : region size in px.
    lesion : optional bool mask (height, width); True pixels get the lesion texture.
    stain : stroma, normal-nucleus and lesion-nucleus colours.
    tint : per-channel multiplier (a stain/scanner shift for external cohorts).
    noise : standard deviation of additive Gaussian pixel noise, in grey levels.
    scale : texture scale (1.0 = nuclei radius ~2 px normal, ~3 px lesion).
    lesion_contrast : 1.0 = dense, large, dark lesion nuclei (obvious at a glance); 0.0 = extra
        nuclei of the normal size and colour, only twice as dense as normal tissue (hard to see);
        values in between interpolate density, radius and colour.
    mimic : optional bool mask (height, width); True pixels get the benign mimic texture.
    nuclei_density : multiplier of the normal nuclei density (slide-to-slide variation).
    od_matrix : a 3 x 3 map applied to every pixel's optical density ``-ln((I + 1) / 256)`` after the
        tint and before the noise (a stain change, e.g. :data:`SCANNER_SHIFT`); None: none.

    Returns
    -------
    uint8 array (height, width, 3), RGB.
    """
    h, w = int(height), int(width)
    stroma, nuc, les = (np.asarray(c, np.float32) for c in stain)
    img = np.broadcast_to(stroma, (h, w, 3)).astype(np.float32)
    # low-frequency stroma variation (fibres)
    var = cv2.GaussianBlur(rng.standard_normal((h, w)).astype(np.float32), (0, 0), 3.0 * scale)
    img += 60.0 * var[..., None] * np.array([0.3, 0.6, 0.4], np.float32)
    a = _nuclei(rng, h, w, 0.004 * nuclei_density / scale**2, 1.6 * scale)[..., None]
    img = img * (1 - 0.7 * a) + nuc * 0.7 * a
    if lesion is not None and lesion.any():
        c = float(np.clip(lesion_contrast, 0.0, 1.0))
        density = (0.008 + c * 0.022) / scale**2
        radius = (1.6 + c * 1.0) * scale
        colour = nuc + c * (les - nuc)
        opacity = 0.7 + c * 0.3
        b = _nuclei(rng, h, w, density, radius)[..., None] * lesion[..., None].astype(np.float32) * opacity
        img = img * (1 - b) + colour * b
    if mimic is not None and mimic.any():
        m = _nuclei(rng, h, w, 0.03 / scale**2, 1.1 * scale)[..., None] * mimic[..., None].astype(np.float32) * 0.85
        img = img * (1 - m) + les * m
    img *= np.asarray(tint, np.float32)
    if od_matrix is not None:
        od = -np.log((np.clip(img, 0, 255) + 1.0) / 256.0)
        od = od @ np.asarray(od_matrix, np.float32).T
        img = (256.0 * np.exp(-od) - 1.0).astype(np.float32)
    if noise > 0:
        img += rng.normal(0.0, noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)
