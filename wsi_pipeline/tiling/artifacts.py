"""Tile artifact QC: pen ink, out-of-focus tiles and folds.

Ink and folds are large and coloured, so they are found on the overview (each pixel averages
1/16 of a tile side) and a tile's share of them is the area-weighted mean over its footprint;
focus needs the tile's own pixels and is measured on each decoded tile.

- **Pen** (:func:`pen_mask`): marker ink by colour in HSV (OpenCV's 0..180 hue, 0..255
  saturation and value), as histolab's pen filters do by RGB ranges: green (hue 70..190 degrees,
  saturation >= 25 %), blue (200..260 degrees, saturation >= 50 %: a haematoxylin
  counterstain is a paler blue), red (within 16 degrees of pure red, saturation >= 50 %: eosin is
  pink, 320..345 degrees, DAB brown, 20..40 degrees; over eosin, red ink is a dark, deeply
  saturated magenta-red: 300..20 degrees, saturation >= 70 %, value <= 120) and black (brightest channel <= 80 and
  saturation <= 40 %: stained tissue averaged over an overview pixel is never that dark and grey).
  A colour that covers more than 30 % of the slide's stained area is its stain (a blue special
  stain, the light green of a trichrome), not ink, and is not looked for on that slide. Limit:
  ink of the stain's own colour is then missed.
- **Blur** (:func:`focus_measure`): the ratio of the tile's finest detail to its next band,
  ``E[(g - G1 g)^2] / (E[(G1 g - G3 g)^2] + 4)`` on the grey tile ``g`` (BT.601 luma), with
  ``Gs`` a Gaussian of sigma ``s`` px at the tile resolution (the second band is taken at half
  resolution, where ``G1 g`` holds all its detail; kernels cut at 2 sigma), per block of a 4 x 4 grid, the median
  over the blocks that are not flat (glass). Contrast cancels (pale tissue in
  focus scores as high as dark tissue: 0.2..0.6 on in-focus generated and CMU-1 tiles), while a
  point spread of sigma >= 2 px removes the first band far more than the second (<= 0.08); the
  ``+ 4`` (grey levels^2) keeps scanner noise on flat tissue from reading as detail. Only tiles
  holding stained tissue are judged (a tile of glass has no focus).
- **Fold** (:func:`fold_mask`): tissue folded over itself is a double layer: twice the optical
  density in the same colour. An overview tissue pixel is folded when its density vector is at
  least ``fold_od_ratio`` times the slide's median tissue density and within 15 degrees of its
  direction. Limit: dense tissue of the same colour as the rest (a solid sheet of cells in an
  otherwise sparse section) reads as folded; folds are flagged, not dropped, by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wsi_pipeline.config.choices import QC_ARTIFACTS
from wsi_pipeline.config.tiling import QCParams

__all__ = ["INK_MAX_SHARE", "QC_BITS", "TileQC", "describe", "flags_of", "focus_measure", "fold_mask", "ink_mask", "pen_colours"]

#: Bit of each artifact in the store's ``qc_flags`` array.
QC_BITS: dict[str, int] = {name: 1 << i for i, name in enumerate(QC_ARTIFACTS)}
#: An ink colour covering more of the stained area than this is the slide's stain (not ink) on that slide.
INK_MAX_SHARE = 0.3
#: Tiles with less stained tissue than this (fraction) are not judged for focus (their ``qc_focus`` is NaN).
FOCUS_MIN_STAINED = 0.25
#: The focus measure is taken per block of this many x this many blocks over the tile.
FOCUS_BLOCKS = 4
#: Blocks whose second-band energy (grey levels^2) is below this are flat (glass) and do not vote.
FLAT_BAND = 0.5
#: Largest angle (degrees) between a folded pixel's density vector and the slide's median tissue density.
_FOLD_MAX_ANGLE = 15.0


def pen_colours(rgb: np.ndarray) -> dict[str, np.ndarray]:
    """Bool (H, W) per ink colour: pixels of a uint8 (H, W, 3) RGB overview coloured like that marker ink."""
    import cv2

    hsv = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2HSV)
    h, s, v = (hsv[..., i].astype(np.int16) for i in range(3))
    return {
        "green": (h >= 35) & (h <= 95) & (s >= 64),
        "blue": (h >= 100) & (h <= 130) & (s >= 128),
        # red ink, and red ink over eosin (dark, deeply saturated magenta-red: no stain is both)
        "red": (((h <= 8) | (h >= 172)) & (s >= 128)) | (((h <= 10) | (h >= 150)) & (s >= 180) & (v <= 120)),
        "black": (v <= 80) & (s <= 102),
    }


def ink_mask(rgb: np.ndarray, stained: np.ndarray | None = None, max_share: float = INK_MAX_SHARE) -> tuple[np.ndarray, dict[str, Any]]:
    """Bool (H, W) marker ink on a uint8 (H, W, 3) RGB overview, and which colours were looked for.

    A colour that covers more than ``max_share`` of the ``stained`` (light-absorbing) pixels is the
    slide's stain, not ink (a blue special stain, a green trichrome): it is not reported as ink on
    that slide (``info["stain_colours"]``).
    """
    colours = pen_colours(rgb)
    ink = np.zeros(rgb.shape[:2], bool)
    skipped = []
    n = int(stained.sum()) if stained is not None else 0
    for name, m in colours.items():
        if n and float((m & stained).sum()) > max_share * n:
            skipped.append(name)
            continue
        ink |= m
    return ink, {"ink_fraction": float(ink.mean()), "stain_colours": skipped}


def fold_mask(overview: np.ndarray, tissue: np.ndarray, glass: np.ndarray | tuple[float, float, float] | None,
              ratio: float) -> np.ndarray:
    """Bool (H, W): tissue pixels of the overview that look folded (module docstring).

    Parameters
    ----------
    overview : uint8 (H, W, 3) RGB.
    tissue : bool (H, W) tissue mask.
    glass : the glass colour; None (no glass in view): the brightest 1 % of the overview per channel.
    ratio : density ratio to the slide's median tissue density.
    """
    from wsi_pipeline.tiling.density import optical_density

    if not tissue.any():
        return np.zeros(tissue.shape, bool)
    if glass is None:
        glass = np.percentile(overview.reshape(-1, 3), 99, axis=0)
    od = optical_density(overview, glass)
    med = np.median(od[tissue], axis=0)
    norm_med = float(np.linalg.norm(med))
    if norm_med <= 1e-6:
        return np.zeros(tissue.shape, bool)
    unit = med / norm_med
    along = od @ unit  # density along the median's direction
    norm = np.linalg.norm(od, axis=-1)
    cos = np.divide(along, norm, out=np.zeros_like(along), where=norm > 0)
    return tissue & (along >= ratio * norm_med) & (cos >= np.cos(np.radians(_FOLD_MAX_ANGLE)))


def focus_measure(tiles: np.ndarray | Sequence[np.ndarray], blocks: int = FOCUS_BLOCKS) -> np.ndarray:
    """float32 (k,): the focus measure of each uint8 (T, T, 3) RGB tile (module docstring); higher = sharper.

    The ratio is taken per block of a ``blocks`` x ``blocks`` grid over the tile; the tile's measure is
    the median over the blocks with any structure (second-band energy >= :data:`FLAT_BAND` grey
    levels^2: blank glass has none), so a few sharp blocks in a blurred tile do not decide it.
    """
    import cv2

    out = np.empty(len(tiles), np.float32)
    n = int(blocks)
    for i, t in enumerate(tiles):
        g = np.float32(cv2.cvtColor(np.ascontiguousarray(t), cv2.COLOR_RGB2GRAY))
        g1 = cv2.GaussianBlur(g, (5, 5), 1.0)  # kernels cut at 2 sigma
        d1 = cv2.subtract(g, g1)
        fine = cv2.resize(cv2.multiply(d1, d1), (n, n), interpolation=cv2.INTER_AREA).ravel()
        # the second band at half resolution (g1 holds nothing finer): G3 = G1 then a Gaussian of
        # sqrt(3^2 - 1^2) px = sqrt(2) half-resolution px
        h1 = cv2.resize(g1, (g.shape[1] // 2, g.shape[0] // 2), interpolation=cv2.INTER_AREA)
        d2 = cv2.subtract(h1, cv2.GaussianBlur(h1, (7, 7), float(np.sqrt(2.0))))
        band = cv2.resize(cv2.multiply(d2, d2), (n, n), interpolation=cv2.INTER_AREA).ravel()
        some = band >= FLAT_BAND
        if not some.any():
            some[:] = True
        out[i] = float(np.median(fine[some] / (band[some] + 4.0)))
    return out


@dataclass
class TileQC:
    """Per-tile artifact measures of a slide's grid (overview-based) and the rule that flags them.

    Attributes
    ----------
    pen : float (rows, cols) ink fraction of each tile.
    fold : float (rows, cols) folded-tissue fraction of each tile.
    stained : float (rows, cols) stained-tissue fraction (tiles under :data:`FOCUS_MIN_STAINED` are not judged for focus).
    params : the thresholds.
    mode : ``drop``, ``flag`` or ``off``.
    """

    pen: np.ndarray
    fold: np.ndarray
    stained: np.ndarray
    params: QCParams
    mode: str

    def flags(self, rows: np.ndarray, cols: np.ndarray, focus: np.ndarray) -> np.ndarray:
        """uint8 (k,) :data:`QC_BITS` of tiles (rows, cols) with focus measures ``focus`` (NaN: not measured)."""
        p = self.params
        f = np.zeros(len(rows), np.uint8)
        f[self.pen[rows, cols] >= p.pen_fraction] |= QC_BITS["pen"]
        f[self.fold[rows, cols] >= p.fold_fraction] |= QC_BITS["fold"]
        judged = self.judged(rows, cols) & np.isfinite(focus)
        f[judged & (focus < p.focus_min)] |= QC_BITS["blur"]
        return f

    def judged(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Bool (k,): tiles (rows, cols) holding enough stained tissue (>= :data:`FOCUS_MIN_STAINED`) to judge their focus."""
        return self.stained[rows, cols] >= FOCUS_MIN_STAINED

    def dropped(self, flags: np.ndarray) -> np.ndarray:
        """Bool (k,): tiles ``qc_mode="drop"`` removes (any of ``params.drop`` set)."""
        if self.mode != "drop":
            return np.zeros(len(flags), bool)
        mask = sum(QC_BITS[a] for a in self.params.drop)
        return (flags & mask) != 0


def flags_of(flags: np.ndarray) -> dict[str, int]:
    """Count of tiles with each artifact's bit set in ``flags``."""
    return {name: int(((np.asarray(flags) & bit) != 0).sum()) for name, bit in QC_BITS.items()}


def describe(params: QCParams, mode: str) -> dict[str, Any]:
    """JSON-ready description of the QC settings (store attribute ``qc``)."""
    return {"mode": mode, "drop": list(params.drop), "pen_fraction": params.pen_fraction, "focus_min": params.focus_min,
            "fold_fraction": params.fold_fraction, "fold_od_ratio": params.fold_od_ratio, "bits": dict(QC_BITS),
            "focus_measure": "E[(g - G1 g)^2] / (E[(G1 g - G3 g)^2] + 4), g = BT.601 luma of the tile, Gs = Gaussian sigma s px"}
