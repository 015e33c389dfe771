"""The tile grid: which pyramid level to read, where every tile lies in it, and how it is resized.

A tile's pixels are a function of the slide and the tiling settings alone (the *tile formula*,
:data:`TILE_FORMULA`; README "Tiling"):

- level scales: level L has ``sx = W0 / WL`` and ``sy = H0 / HL`` level-0 px per level px (per
  axis, from the level dimensions; Aperio's ``floor(W / 4)`` levels give e.g. 4.0002), and
  downsample ``dL = (sx + sy) / 2``;
- native resolution (no target): L = 0, tiles are level-0 pixels, T x T;
- target mpp t on a slide of mpp m: ``D = t / m`` level-0 px per tile px; L = the coarsest level
  the reader addresses pixel-exactly with ``dL <= D * (1 + tolerance)``. When
  ``|dL / D - 1| <= tolerance`` the level is used as is (source T x T, step T, no resize, tile
  mpp ``m * dL``); otherwise the source is ``Sx = round(T * D / sx)`` x ``Sy = round(T * D / sy)``
  level px, resized to T x T with ``cv2.INTER_AREA``, and tile origins step ``T * D / sx`` (x)
  and ``T * D / sy`` (y) level px;
- tile (col i, row j): level-L origin ``lx = round(i * step_x)``, ``ly = round(j * step_y)``
  (``round(v) = floor(v + 0.5)``); its source is level-L pixels ``[lx, lx + Sx) x [ly, ly + Sy)``
  exactly as stored (:meth:`~wsi_pipeline.slides.base.Slide.read_level`); only tiles whose
  source lies inside the level are on the grid; the recorded level-0 corner is
  ``(round(lx * sx), round(ly * sy))``.

Every position is an integer on the level's own pixel grid, so a tile's pixels never depend on
which neighbours were read with it, on the pre-screen, the keep threshold or the worker count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wsi_pipeline.slides.coverage import box_mean

__all__ = ["TILE_FORMULA", "TileGrid", "make_grid"]

#: The tile formula in one paragraph, stored in every store's attributes (``tile_formula``).
TILE_FORMULA = (
    "Level L has sx = W0/WL, sy = H0/HL level-0 px per level px (from the level dimensions) and dL = (sx+sy)/2. "
    "Native: L = 0, D = 1. Target mpp t on a slide of mpp m: D = t/m; L = the coarsest pixel-exact level with "
    "dL <= D*(1+tolerance); if |dL/D - 1| <= tolerance the level is used as is (S = T, step = T, D := dL), else "
    "step_x = T*D/sx, step_y = T*D/sy, Sx = round(step_x), Sy = round(step_y). Tile (col i, row j): level-L origin "
    "lx = round(i*step_x), ly = round(j*step_y), round(v) = floor(v+0.5); source = level-L pixels [lx, lx+Sx) x "
    "[ly, ly+Sy) as stored (no resampling), resized to T x T with cv2.INTER_AREA when (Sx, Sy) != (T, T); "
    "only sources inside the level are tiles; coords = (round(lx*sx), round(ly*sy)) level-0 px."
)


def _round(v: np.ndarray | float) -> np.ndarray:
    """floor(v + 0.5) as int64 (round half up)."""
    return np.floor(np.asarray(v, np.float64) + 0.5).astype(np.int64)


@dataclass(frozen=True)
class TileGrid:
    """Geometry of a slide's tiles (see the module docstring for the formula).

    Attributes
    ----------
    tile_size : T, tile side in px at the tile resolution.
    level : the pyramid level read.
    level_downsample : dL, mean level-0 px per px of ``level`` ((sx + sy) / 2).
    level_size : (width, height) of ``level`` in px.
    source_size : Sx, tile width in px of ``level`` (T unless the tile is resized).
    downsample : D, level-0 px per tile px.
    mpp : um per tile px (None when the slide's mpp is unknown).
    cols, rows : grid size in tiles.
    level_scale : (sx, sy) level-0 px per level px per axis.
    source_height : Sy, tile height in px of ``level``.
    level_step : (step_x, step_y), distance between tile origins in px of ``level``.
    """

    tile_size: int
    level: int
    level_downsample: float
    level_size: tuple[int, int]
    source_size: int
    downsample: float
    mpp: float | None
    cols: int
    rows: int
    level_scale: tuple[float, float] = (1.0, 1.0)
    source_height: int = 0
    level_step: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        if self.source_height == 0:
            object.__setattr__(self, "source_height", self.source_size)
        if self.level_step == (0.0, 0.0):
            s = self.tile_size * self.downsample
            object.__setattr__(self, "level_step", (s / self.level_scale[0], s / self.level_scale[1]))

    @property
    def source_shape(self) -> tuple[int, int]:
        """(Sx, Sy): the tile's source size in px of ``level``."""
        return self.source_size, self.source_height

    @property
    def extent(self) -> float:
        """Tile side in level-0 px (T * D)."""
        return self.tile_size * self.downsample

    @property
    def resized(self) -> bool:
        """True when level pixels are resized to the tile resolution."""
        return self.source_shape != (self.tile_size, self.tile_size)

    @property
    def step(self) -> float:
        """Distance between tile origins in px of ``level`` along x (``level_step[0]``)."""
        return self.level_step[0]

    def level_origin(self, index: np.ndarray | int, axis: int = 0) -> np.ndarray:
        """Tile origin(s) in px of ``level`` for grid index/indices ``index`` along ``axis`` (0 = x, 1 = y)."""
        return _round(np.asarray(index, np.float64) * self.level_step[axis])

    def level_coords(self, cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """(lx, ly) of the tiles' top-left corners in px of ``level``; int64 (k, 2)."""
        return np.stack([self.level_origin(cols, 0), self.level_origin(rows, 1)], axis=-1).reshape(-1, 2)

    def coords(self, cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Level-0 (x, y) px of the tiles' top-left corners, (round(lx * sx), round(ly * sy)); int64 (k, 2)."""
        lxy = self.level_coords(cols, rows).astype(np.float64)
        return _round(lxy * np.asarray(self.level_scale, np.float64)).reshape(-1, 2)

    def footprint_means(self, values: np.ndarray, downsample: float, *, extent: float | None = None, outside: float = 0.0) -> np.ndarray:
        """Area-weighted mean of a low-resolution map over every tile's level-0 footprint (:func:`box_mean`).

        Parameters
        ----------
        values : float (H, W) map; pixel (i, j) covers level-0 [j*d, (j+1)*d) x [i*d, (i+1)*d).
        downsample : d, level-0 px per map px.
        extent : footprint side in level-0 px; default :attr:`extent`.
        outside : value assumed beyond the map's edge.

        Returns
        -------
        float64 (rows, cols).
        """
        if self.rows == 0 or self.cols == 0:
            return np.zeros((self.rows, self.cols))
        rows, cols = np.meshgrid(np.arange(self.rows), np.arange(self.cols), indexing="ij")
        side = self.extent if extent is None else float(extent)
        means = box_mean(values, downsample, self.coords(cols.ravel(), rows.ravel()), side, outside=outside)
        return means.reshape(self.rows, self.cols)

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary for store attributes (with the formula's parameters)."""
        return {
            "read_level": self.level,
            "level_downsample": self.level_downsample,
            "level_scale": [float(v) for v in self.level_scale],
            "level_size": [int(v) for v in self.level_size],
            "level_step": [float(v) for v in self.level_step],
            "downsample": self.downsample,
            "tile_size": self.tile_size,
            "tile_extent": self.extent,
            "source_size": self.source_size,
            "source_shape": [int(v) for v in self.source_shape],
            "resize": "cv2.INTER_AREA" if self.resized else "none",
            "grid_shape": [self.rows, self.cols],
            "mpp": self.mpp,
            "tile_formula": TILE_FORMULA,
        }


def _count(length: int, step: float, source: int) -> int:
    """Number of tiles i >= 0 with round(i * step) + source <= length."""
    if length < source:
        return 0
    n = int((length - source) / step) + 1
    while n > 0 and math.floor((n - 1) * step + 0.5) + source > length:
        n -= 1
    while math.floor(n * step + 0.5) + source <= length:
        n += 1
    return n


def make_grid(
    level_dimensions: Sequence[tuple[int, int]],
    level_downsamples: Sequence[float] | None = None,
    *,
    tile_size: int = 256,
    slide_mpp: float | None = None,
    mpp_target: float | None = None,
    tolerance: float = 0.05,
    exact_levels: Sequence[bool] | None = None,
) -> TileGrid:
    """Plan the tile grid of a slide (the tile formula of the module docstring).

    Parameters
    ----------
    level_dimensions : (width, height) px of each pyramid level; the geometry comes from these.
    level_downsamples : the reader's downsamples; only checked for length (the formula derives
        each level's scale from ``level_dimensions``, so both backends plan the same grid).
    tile_size : T in px at the tile resolution.
    slide_mpp : um per level-0 px (needed with ``mpp_target``).
    mpp_target : um per tile px, or None for native level 0.
    tolerance : relative difference under which a level is used as is (no resize);
        e.g. a 0.2525 um/px level serves a 0.25 target unchanged.
    exact_levels : per level, whether the reader returns its pixels exactly
        (:meth:`~wsi_pipeline.slides.base.Slide.exact_levels`); other levels are never read.
        None = all.

    Returns
    -------
    :class:`TileGrid`.

    Raises
    ------
    ValueError : bad ``tile_size``/``mpp_target``, a target finer than the slide's level 0
        beyond ``tolerance`` (that would upsample), or ``mpp_target`` without ``slide_mpp``.
    """
    T = int(tile_size)
    if T < 1:
        raise ValueError(f"tile_size={tile_size} must be a positive number of px")
    dims = [(int(w), int(h)) for w, h in level_dimensions]
    if level_downsamples is not None and len(level_downsamples) != len(dims):
        raise ValueError(f"{len(level_downsamples)} level downsamples for {len(dims)} levels")
    w0, h0 = dims[0]
    scales = [(w0 / w, h0 / h) for w, h in dims]
    usable = [True] * len(dims) if exact_levels is None else [bool(v) for v in exact_levels]
    usable[0] = True
    if mpp_target is None:
        return TileGrid(T, 0, 1.0, (w0, h0), T, 1.0, slide_mpp, _count(w0, T, T), _count(h0, T, T), (1.0, 1.0), T, (T, T))
    if not (mpp_target > 0 and math.isfinite(mpp_target)):
        raise ValueError(f"mpp_target={mpp_target} must be a positive number of um/px")
    if slide_mpp is None:
        raise ValueError("mpp_target needs the slide's mpp (um/px); supply it with --mpp, --mpp-force or a manifest mpp column")
    D = mpp_target / slide_mpp  # level-0 px per tile px
    if D < 1 - tolerance:
        raise ValueError(
            f"mpp_target={mpp_target} um/px is finer than the slide's level 0 ({slide_mpp:.4g} um/px); "
            f"tiles would be upsampled. Use --mpp-target >= {slide_mpp:.4g} or no --mpp-target (native resolution)"
        )
    mean = [(sx + sy) / 2 for sx, sy in scales]
    level = 0
    for i, d in enumerate(mean):
        if usable[i] and d <= D * (1 + tolerance) and d >= mean[level]:
            level = i
    d = mean[level]
    sx, sy = scales[level]
    w, h = dims[level]
    if abs(d / D - 1) <= tolerance:
        downsample, step, source = d, (float(T), float(T)), (T, T)
    else:
        downsample = D
        step = (T * D / sx, T * D / sy)
        source = (int(math.floor(step[0] + 0.5)), int(math.floor(step[1] + 0.5)))
    return TileGrid(
        T, level, d, (w, h), source[0], downsample, slide_mpp * downsample,
        _count(w, step[0], source[0]), _count(h, step[1], source[1]), (sx, sy), source[1], step,
    )
