"""Tile artifact QC: pen ink, out-of-focus tiles and folds.

Ink and folds are large and coloured, so they are found on an overview whose pixel has a fixed
physical size, at least ``QCParams.overview_um`` um (:func:`qc_overview`; the tiler's overview,
averaged further where it is finer; a slide without an mpp is taken to be at
:data:`DEFAULT_QC_MPP` um/px), and a tile's share of them is the area-weighted mean over its
footprint. At that scale an overview pixel averages several nuclei with the tissue around them,
so haematoxylin-dense tissue (clusters of tumour or inflammatory nuclei) is never as dark or as
saturated as marker ink, whatever the tile size or magnification. (Before, the overview pixel was
1/16 of a tile side: one nucleus at 32 px tiles and 40x, and the "blue" and "black" ink rules
dropped up to a third of the tissue tiles of real, ink-free H&E as pen.) Focus needs the tile's
own pixels and is measured on each decoded tile, at no finer than :data:`FOCUS_UM` um/px.

- **Pen** (:func:`ink_mask`): marker ink by colour in HSV (OpenCV's 0..180 hue, 0..255
  saturation and value), as histolab's pen filters do by RGB ranges: green to teal (hue 70..200 degrees,
  saturation >= 25 %), blue (200..240 degrees, saturation >= 50 %: a haematoxylin
  counterstain is a paler blue, and dense haematoxylin is violet, 250..280 degrees: it absorbs
  green more than red, marker blue the reverse), red (within 16 degrees of pure red, saturation >= 50 %: eosin is
  pink, 320..345 degrees, DAB brown, 20..40 degrees; over eosin, red ink is a dark, deeply
  saturated magenta-red: 300..20 degrees, saturation >= 70 %, value <= 120) and black (brightest channel <= 80 and
  saturation <= 40 %: stained tissue averaged over a ``overview_um`` pixel is never that dark and grey).
  A colour that covers more than 30 % of the slide's stained area is its stain (a blue special
  stain, the light green of a trichrome), not ink, and is not looked for on that slide. Limit:
  ink of the stain's own colour is then missed. Regions of one ink colour smaller than
  :data:`INK_MIN_AREA_UM2` are not ink (a marker stroke is 0.3..2 mm wide). The ink found at this
  scale then grows into the ink-coloured pixels of the tiler's finer overview connected to it
  (:func:`grow_ink`), so the mixed edges of a thin stroke count again, while an ink-coloured
  nucleus cluster not touching ink stays tissue.
- **Blur** (:func:`focus_measure`): the ratio of the tile's finest detail to its next band,
  ``E[(g - G1 g)^2] / (E[(G1 g - G3 g)^2] + 4)`` on the grey tile ``g`` (BT.601 luma), with
  ``Gs`` a Gaussian of sigma ``s`` px at the tile resolution (the second band is taken at half
  resolution, where ``G1 g`` holds all its detail; kernels cut at 2 sigma), per block of a 4 x 4 grid, the median
  over the blocks that are not flat (glass). Contrast cancels (pale tissue in
  focus scores as high as dark tissue: 0.2..0.6 on in-focus generated and CMU-1 tiles), while a
  point spread of sigma >= 2 px removes the first band far more than the second (<= 0.08); the
  ``+ 4`` (grey levels^2) keeps scanner noise on flat tissue from reading as detail. Only tiles
  holding stained tissue are judged (a tile of glass has no focus). Tiles finer than
  :data:`FOCUS_UM` um/px are averaged down to it first (:attr:`TileQC.focus_factor`): at 40x a
  sharp scan's finest band is the optics', not the tissue's, and would read as blurred. Tiles
  smaller than :data:`FOCUS_DROP_MIN_PX` px at that scale are flagged ``blur`` but not dropped
  for it (too few px for a trustworthy verdict).
- **Fold** (:func:`fold_mask`): tissue folded over itself is a double layer: twice the optical
  density in the same colour. An overview tissue pixel is folded when its density vector is at
  least ``fold_od_ratio`` times the slide's median tissue density and within 15 degrees of its
  direction, in a connected region of at least ``fold_min_area_um2`` (a fold runs along the
  section: a long band, not a nest of cells). Limit: dense tissue of the same colour as the
  rest (a solid sheet of cells in an otherwise sparse section) reads as folded; folds are
  flagged, not dropped, by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import logging

import numpy as np

from wsi_pipeline.config.choices import QC_ARTIFACTS
from wsi_pipeline.config.tiling_params import QCParams
from wsi_pipeline.tiling.grid import TileGrid

__all__ = ["DEFAULT_QC_MPP", "FOCUS_DROP_MIN_PX", "FOCUS_UM", "INK_MAX_SHARE", "INK_MIN_AREA_UM2", "QC_BITS", "QC_LOSS_WARN", "QCOverview", "TileQC", "describe", "flags_of",
           "focus_factor", "focus_measure", "fold_mask", "grow_ink", "ink_mask", "pen_colours", "qc_loss_note", "qc_overview", "slide_qc"]

logger = logging.getLogger(__name__)

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
#: um per level-0 px assumed for the QC scales of a slide without an mpp (20x).
DEFAULT_QC_MPP = 0.5
#: Ink regions (one colour, 8-connected) smaller than this (um^2, a 50 um square) are not ink: a marker
#: stroke is 0.3..2 mm wide; a dark cluster of nuclei is smaller.
INK_MIN_AREA_UM2 = 2500.0
#: Tiles finer than this (um per tile px) are averaged down to it before their focus is measured.
FOCUS_UM = 0.5
#: Tiles with fewer px than this per side at the focus scale are flagged ``blur``, not dropped: on real,
#: in-focus H&E the measure of 32 px tiles (blocks of 8 px) reads up to 7 % of them as blurred.
FOCUS_DROP_MIN_PX = 64


@dataclass(frozen=True)
class QCOverview:
    """The overview ink and folds are judged on (:func:`qc_overview`).

    Attributes
    ----------
    rgb : uint8 (h, w, 3).
    downsample : level-0 px per pixel.
    um : um per pixel (with :data:`DEFAULT_QC_MPP` where the slide's mpp is unknown).
    """

    rgb: np.ndarray
    downsample: float
    um: float


def qc_overview(overview: np.ndarray, overview_downsample: float, mpp: float | None, overview_um: float) -> QCOverview:
    """The tiler's overview averaged (``cv2.INTER_AREA``) to pixels of ``overview_um`` um, or as it is when
    its pixels are that large already.

    Parameters
    ----------
    overview : uint8 (H, W, 3) RGB, the slide at ``overview_downsample`` level-0 px per px.
    mpp : um per level-0 px; None: :data:`DEFAULT_QC_MPP`.
    overview_um : the QC pixel size, um.
    """
    import cv2

    um0 = float(mpp) if mpp else DEFAULT_QC_MPP
    um = overview_downsample * um0
    h, w = overview.shape[:2]
    if um >= overview_um * 0.999 or min(h, w) <= 1:
        return QCOverview(overview, float(overview_downsample), um)
    f = overview_um / um
    size = (max(1, int(round(w / f))), max(1, int(round(h / f))))
    small = cv2.resize(np.ascontiguousarray(overview), size, interpolation=cv2.INTER_AREA)
    ds = overview_downsample * w / size[0]
    return QCOverview(small, ds, ds * um0)


def focus_factor(tile_mpp: float | None) -> float:
    """How many tile px are averaged into one before the focus measure: ``FOCUS_UM / tile_mpp`` when the tiles
    are finer than :data:`FOCUS_UM` um/px, else 1 (tiles of unknown mpp: 1)."""
    if not tile_mpp or tile_mpp >= FOCUS_UM * 0.95:
        return 1.0
    return FOCUS_UM / float(tile_mpp)


def pen_colours(rgb: np.ndarray) -> dict[str, np.ndarray]:
    """Bool (H, W) per ink colour: pixels of a uint8 (H, W, 3) RGB overview coloured like that marker ink."""
    import cv2

    hsv = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2HSV)
    h, s, v = (hsv[..., i].astype(np.int16) for i in range(3))
    return {
        "green": (h >= 35) & (h < 100) & (s >= 64),  # green to teal (70..200 degrees): no stain is cyan
        # blue ink absorbs red more than green (hue <= 240 degrees); haematoxylin is violet (red above green)
        "blue": (h >= 100) & (h <= 120) & (s >= 128),
        # red ink, and red ink over eosin (dark, deeply saturated magenta-red: no stain is both)
        "red": (((h <= 8) | (h >= 172)) & (s >= 128)) | (((h <= 10) | (h >= 150)) & (s >= 180) & (v <= 120)),
        "black": (v <= 80) & (s <= 102),
    }


def ink_mask(rgb: np.ndarray, stained: np.ndarray | None = None, max_share: float = INK_MAX_SHARE, *,
             um_per_px: float | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Bool (H, W) marker ink on a uint8 (H, W, 3) RGB overview, and which colours were looked for.

    A colour that covers more than ``max_share`` of the ``stained`` (light-absorbing) pixels is the
    slide's stain, not ink (a blue special stain, a green trichrome): it is not reported as ink on
    that slide (``info["stain_colours"]``). With ``um_per_px`` (the overview's pixel size), regions of
    one ink colour (8-connected) smaller than :data:`INK_MIN_AREA_UM2` are not ink.
    """
    import cv2

    colours = pen_colours(rgb)
    ink = np.zeros(rgb.shape[:2], bool)
    skipped = []
    n = int(stained.sum()) if stained is not None else 0
    min_px = INK_MIN_AREA_UM2 / (um_per_px * um_per_px) if um_per_px else 0.0
    for name, m in colours.items():
        if n and float((m & stained).sum()) > max_share * n:
            skipped.append(name)
            continue
        if min_px > 1 and m.any():
            _, labels, stats, _ = cv2.connectedComponentsWithStats(m.astype(np.uint8), connectivity=8)
            small = stats[:, cv2.CC_STAT_AREA] < min_px
            small[0] = False
            m = m & ~small[labels]
        ink |= m
    return ink, {"ink_fraction": float(ink.mean()), "stain_colours": skipped}


def grow_ink(seeds: np.ndarray, rgb: np.ndarray, skip: Sequence[str] = ()) -> np.ndarray:
    """Bool (H, W): the ink found on the QC overview (``seeds``, resampled onto ``rgb``'s grid) grown into the
    pixels of a finer overview ``rgb`` that are ink-coloured (:func:`pen_colours`, less the slide's stain colours
    ``skip``) and connected (8-connected) to a seed. A thin stroke's edges, mixed with tissue on the coarse
    overview, are ink again; ink-coloured pixels not touching ink found at the coarse scale (a dense nucleus)
    stay tissue."""
    import cv2

    if not seeds.any():
        return seeds
    cand = seeds.copy()
    for name, m in pen_colours(rgb).items():
        if name not in skip:
            cand |= m
    n, labels = cv2.connectedComponents(cand.astype(np.uint8), connectivity=8)
    hit = np.zeros(n, bool)
    hit[np.unique(labels[seeds])] = True
    hit[0] = False
    return hit[labels]


def fold_mask(overview: np.ndarray, tissue: np.ndarray, glass: np.ndarray | tuple[float, float, float] | None,
              ratio: float, *, min_area_px: float = 0.0) -> np.ndarray:
    """Bool (H, W): tissue pixels of the overview that look folded (module docstring).

    Parameters
    ----------
    overview : uint8 (H, W, 3) RGB.
    tissue : bool (H, W) tissue mask.
    glass : the glass colour; None (no glass in view): the brightest 1 % of the overview per channel.
    ratio : density ratio to the slide's median tissue density.
    min_area_px : folded regions (8-connected) smaller than this many overview px are not folds.
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
    fold = tissue & (along >= ratio * norm_med) & (cos >= np.cos(np.radians(_FOLD_MAX_ANGLE)))
    if min_area_px > 1 and fold.any():
        import cv2

        n, labels, stats, _ = cv2.connectedComponentsWithStats(fold.astype(np.uint8), connectivity=8)
        small = stats[:, cv2.CC_STAT_AREA] < min_area_px
        small[0] = False
        fold &= ~small[labels]
    return fold


def focus_measure(tiles: np.ndarray | Sequence[np.ndarray], blocks: int = FOCUS_BLOCKS, factor: float = 1.0) -> np.ndarray:
    """float32 (k,): the focus measure of each uint8 (T, T, 3) RGB tile (module docstring); higher = sharper.

    The ratio is taken per block of a ``blocks`` x ``blocks`` grid over the tile; the tile's measure is
    the median over the blocks with any structure (second-band energy >= :data:`FLAT_BAND` grey
    levels^2: blank glass has none), so a few sharp blocks in a blurred tile do not decide it.
    ``factor`` > 1: the grey tile is first averaged (``cv2.INTER_AREA``) to 1/factor of its side
    (:func:`focus_factor`: the measure at :data:`FOCUS_UM` um/px).
    """
    import cv2

    out = np.empty(len(tiles), np.float32)
    n = int(blocks)
    for i, t in enumerate(tiles):
        g: np.ndarray = cv2.cvtColor(np.ascontiguousarray(t), cv2.COLOR_RGB2GRAY).astype(np.float32)
        if factor > 1.0 + 1e-6:
            side = (max(8, int(round(g.shape[1] / factor))), max(8, int(round(g.shape[0] / factor))))
            g = cv2.resize(g, side, interpolation=cv2.INTER_AREA)
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
    focus_factor : tile px averaged into one before the focus measure (:func:`focus_factor`).
    focus_px : the tile's side at the focus scale (px); under :data:`FOCUS_DROP_MIN_PX` blur is only flagged.
    """

    pen: np.ndarray
    fold: np.ndarray
    stained: np.ndarray
    params: QCParams
    mode: str
    focus_factor: float = 1.0
    focus_px: float = float(FOCUS_DROP_MIN_PX)

    def focus(self, tiles: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
        """float32 (k,): :func:`focus_measure` of the tiles at this grid's focus scale."""
        return focus_measure(tiles, factor=self.focus_factor)

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
        """Bool (k,): tiles ``qc_mode="drop"`` removes (any of ``params.drop`` set; blur only on tiles of at
        least :data:`FOCUS_DROP_MIN_PX` px at the focus scale)."""
        if self.mode != "drop":
            return np.zeros(len(flags), bool)
        # a tile too small for a trustworthy focus measure is flagged blur, never dropped for it
        drop = [a for a in self.params.drop if a != "blur" or self.focus_px >= FOCUS_DROP_MIN_PX]
        mask = sum(QC_BITS[a] for a in drop)
        return (flags & mask) != 0


def slide_qc(qov: QCOverview, ink: np.ndarray, tissue: np.ndarray, tissue_downsample: float,
             glass: tuple[float, float, float] | None, grid: TileGrid, params: QCParams, mode: str) -> TileQC:
    """The :class:`TileQC` of a slide's grid.

    Parameters
    ----------
    qov : the QC overview (:func:`qc_overview`).
    ink : bool (H, W) ink (:func:`ink_mask` on ``qov``, grown by :func:`grow_ink`) on the tissue's grid.
    tissue : bool (H, W) tissue mask at ``tissue_downsample`` level-0 px per px (the tiler's overview).
    glass : the glass colour, or None (no glass in view).
    grid : the tile grid; ``params``, ``mode``: the QC settings.
    """
    import cv2

    h, w = qov.rgb.shape[:2]
    if tissue.shape == (h, w):
        tissue_q = tissue
    else:
        tissue_q = cv2.resize(tissue.astype(np.float32), (w, h), interpolation=cv2.INTER_AREA) >= 0.5
    min_px = params.fold_min_area_um2 / (qov.um * qov.um)
    fold = fold_mask(qov.rgb, tissue_q, glass, params.fold_od_ratio, min_area_px=min_px)
    pen_f = grid.footprint_means(ink.astype(np.float32), tissue_downsample)
    fold_f = grid.footprint_means(fold.astype(np.float32), qov.downsample)
    stained = grid.footprint_means(tissue.astype(np.float32), tissue_downsample)
    k = focus_factor(grid.mpp)
    return TileQC(pen_f, fold_f, stained, params=params, mode=mode, focus_factor=k, focus_px=grid.tile_size / k)


#: A slide losing more than this share of its tissue tiles to QC is warned about (:func:`qc_loss_note`).
QC_LOSS_WARN = 0.10


def qc_loss_note(slide_id: str, counts: dict[str, Any], n_kept: int, drop: Sequence[str]) -> str:
    """A warning (logged) and report note when QC dropped more than :data:`QC_LOSS_WARN` of a slide's tissue
    tiles (kept + dropped), naming the detectors and the flags that keep their tiles; "" otherwise.

    ``counts``: the tile loop's ``{"dropped": {artifact: n}, "n_dropped": n}``.
    """
    n_dropped = int(counts.get("n_dropped", 0))
    total = n_kept + n_dropped
    if total == 0 or n_dropped <= QC_LOSS_WARN * total:
        return ""
    by = {a: int(counts["dropped"].get(a, 0)) for a in drop if counts["dropped"].get(a, 0)}
    parts = ", ".join(f"{a} {100.0 * n / total:.0f} %" for a, n in sorted(by.items(), key=lambda kv: -kv[1]))
    keep = [a for a in drop if a not in by]
    hint = (f"--qc-drop {','.join(keep)}" if keep else "--qc-drop ''") + f" stops dropping {', '.join(by)}"
    note = (f"QC dropped {n_dropped} of {total} tissue tiles ({100.0 * n_dropped / total:.0f} %: {parts}); "
            f"check qc/{slide_id}.png; {hint}, --qc flag only flags")
    logger.warning("slide %s: %s", slide_id, note)
    return note


def flags_of(flags: np.ndarray) -> dict[str, int]:
    """Count of tiles with each artifact's bit set in ``flags``."""
    return {name: int(((np.asarray(flags) & bit) != 0).sum()) for name, bit in QC_BITS.items()}


def describe(params: QCParams, mode: str) -> dict[str, Any]:
    """JSON-ready description of the QC settings (store attribute ``qc``)."""
    return {"mode": mode, "drop": list(params.drop), "pen_fraction": params.pen_fraction, "focus_min": params.focus_min,
            "fold_fraction": params.fold_fraction, "fold_od_ratio": params.fold_od_ratio,
            "fold_min_area_um2": params.fold_min_area_um2, "overview_um": params.overview_um, "focus_um": FOCUS_UM,
            "bits": dict(QC_BITS),
            "focus_measure": "E[(g - G1 g)^2] / (E[(G1 g - G3 g)^2] + 4), g = BT.601 luma of the tile, Gs = Gaussian sigma s px"}
