"""The tile grid: which pyramid level to read, at what scale, and where every full tile lies.

Tiles are T x T px at the *tile resolution*, non-overlapping, on a grid anchored at level-0
(0, 0); only full tiles are kept. At native resolution the tile resolution is level 0. With a
target mpp, tiles are read from the best level at or finer than the target and resized, so a
40x slide tiles at 20x the way the CAMELYON protocol does. Every position is rounded on the
*level* pixel grid, so a tile's pixels never depend on which neighbours were read with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TileGrid", "make_grid"]


@dataclass(frozen=True)
class TileGrid:
    """Geometry of a slide's tiles.

    Attributes
    ----------
    tile_size : T, tile side in px at the tile resolution.
    level : the pyramid level read.
    level_downsample : level-0 px per px of ``level``.
    level_size : (width, height) of ``level`` in px.
    source_size : tile side in px of ``level`` (T unless the tile is resized).
    downsample : level-0 px per tile px.
    mpp : um per tile px (None when the slide's mpp is unknown).
    cols, rows : grid size in tiles.
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

    @property
    def extent(self) -> float:
        """Tile side in level-0 px."""
        return self.tile_size * self.downsample

    @property
    def resized(self) -> bool:
        """True when level pixels are resized to the tile resolution."""
        return self.source_size != self.tile_size or not math.isclose(self.downsample, self.level_downsample, rel_tol=1e-9)

    @property
    def step(self) -> float:
        """Distance between tile origins in px of ``level``."""
        return self.tile_size * self.downsample / self.level_downsample

    def level_origin(self, index: np.ndarray | int) -> np.ndarray:
        """Tile origin(s) along one axis in px of ``level`` for grid index/indices ``index``."""
        return np.floor(np.asarray(index, np.float64) * self.step + 0.5).astype(np.int64)

    def coords(self, cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Level-0 (x, y) px of the tiles' top-left corners; int64 (k, 2)."""
        lx = self.level_origin(cols).astype(np.float64) * self.level_downsample
        ly = self.level_origin(rows).astype(np.float64) * self.level_downsample
        return np.stack([np.floor(lx + 0.5), np.floor(ly + 0.5)], axis=-1).astype(np.int64).reshape(-1, 2)

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary for store attributes."""
        return {
            "read_level": self.level,
            "level_downsample": self.level_downsample,
            "downsample": self.downsample,
            "tile_size": self.tile_size,
            "tile_extent": self.extent,
            "source_size": self.source_size,
            "grid_shape": [self.rows, self.cols],
            "mpp": self.mpp,
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
    level_dimensions: tuple[tuple[int, int], ...],
    level_downsamples: tuple[float, ...],
    *,
    tile_size: int = 256,
    slide_mpp: float | None = None,
    mpp_target: float | None = None,
    tolerance: float = 0.05,
) -> TileGrid:
    """Plan the tile grid of a slide.

    Parameters
    ----------
    level_dimensions, level_downsamples : the slide's pyramid.
    tile_size : T in px at the tile resolution.
    slide_mpp : um per level-0 px (needed with ``mpp_target``).
    mpp_target : um per tile px, or None for native level 0.
    tolerance : relative mpp difference under which a level is used as is (no resize);
        e.g. a 0.2525 um/px level serves a 0.25 target unchanged.

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
    if mpp_target is None:
        w, h = level_dimensions[0]
        return TileGrid(T, 0, 1.0, (w, h), T, 1.0, slide_mpp, _count(w, T, T), _count(h, T, T))
    if not (mpp_target > 0 and math.isfinite(mpp_target)):
        raise ValueError(f"mpp_target={mpp_target} must be a positive number of um/px")
    if slide_mpp is None:
        raise ValueError("mpp_target needs the slide's mpp (um/px); supply it with --mpp or a manifest mpp column")
    scale = mpp_target / slide_mpp  # level-0 px per tile px
    if scale < 1 - tolerance:
        raise ValueError(
            f"mpp_target={mpp_target} um/px is finer than the slide's level 0 ({slide_mpp:.4g} um/px); "
            f"tiles would be upsampled. Use --mpp-target >= {slide_mpp:.4g} or no --mpp-target (native resolution)"
        )
    level = 0
    for i, d in enumerate(level_downsamples):
        if d <= scale * (1 + tolerance) and d >= level_downsamples[level]:
            level = i
    d = float(level_downsamples[level])
    w, h = level_dimensions[level]
    if abs(d / scale - 1) <= tolerance:
        downsample, source = d, T
    else:
        downsample, source = scale, int(math.floor(T * scale / d + 0.5))
    step = T * downsample / d
    return TileGrid(T, level, d, (w, h), source, downsample, slide_mpp * downsample, _count(w, step, source), _count(h, step, source))
