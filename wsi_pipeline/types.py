"""Shared structural types: what code that reads a slide or a tile store relies on.

Functions that accept "a slide" or "a tile store" are typed with these Protocols instead of
``Any``, so a test double or another reader fits as long as it offers the same members.
:class:`SlideLike` is what :func:`wsi_pipeline.slides.open_slide` returns
(:class:`wsi_pipeline.slides.base.Slide`); :class:`TileStoreLike` is what
:class:`wsi_pipeline.data.store.TileStore` offers; :class:`ValidationScore` is what a finished run
recorded of its validation. This module imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = ["SlideLike", "TileStoreLike", "ValidationScore"]


class ValidationScore(NamedTuple):
    """A finished run's best validation result: the selection ``metric`` (e.g. ``auc``, ``loss``), its
    ``value`` at the best epoch, and that epoch's validation ``loss`` (mean cross-entropy, nats per
    slide; None where the run did not record it), which breaks ties between runs of equal ``value``."""

    metric: str
    value: float
    loss: float | None = None


@runtime_checkable
class SlideLike(Protocol):
    """A whole-slide image, read-only (lengths in px of the level named; level 0 is full resolution).

    Attributes
    ----------
    path : the slide file.
    backend : the library that opened it.
    dimensions : (width, height) of level 0 in px.
    level_count : number of pyramid levels.
    level_dimensions : (width, height) of each level in px.
    level_downsamples : level-0 px per level px, per level.
    mpp : microns per level-0 px from the slide's metadata, or None.
    properties : the slide's metadata.
    background : RGB fill of transparent or out-of-bounds areas.
    """

    path: Path
    backend: str
    dimensions: tuple[int, int]
    level_count: int
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    mpp: float | None
    properties: dict[str, str]
    background: tuple[int, int, int]

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """uint8 (h, w, 3) RGB of ``size`` (w, h) level px at ``location`` (x, y) in level-0 px."""
        ...

    def read_level(self, level: int, origin: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        """uint8 (h, w, 3) RGB of ``size`` level px at ``origin`` in level px."""
        ...

    def level_is_exact(self, level: int) -> bool:
        """True when :meth:`read_level` returns ``level``'s pixels exactly, as stored."""
        ...

    def level_scale(self, level: int) -> tuple[float, float]:
        """(x, y) level-0 px per px of ``level``."""
        ...

    def best_level_for_downsample(self, downsample: float) -> int:
        """The coarsest level whose downsample is at most ``downsample`` (level-0 px per level px)."""
        ...

    def thumbnail(self, max_size: int = 1024) -> np.ndarray:
        """uint8 (h, w, 3) RGB of the whole slide, longer side <= ``max_size`` px."""
        ...

    def close(self) -> None:
        """Release the file."""
        ...


@runtime_checkable
class TileStoreLike(Protocol):
    """A complete tile store, read-only.

    Attributes
    ----------
    path : the store folder.
    attrs : the store's attributes (slide id, tiling settings, ...).
    coords : int64 (N, 2) tile top-left (x, y) in level-0 px.
    grid : int32 (N, 2) tile (col, row) at the read resolution.
    foreground : float32 (N,) foreground fraction of each tile.
    tile_size : T in px.
    stain : the slide's stain normalisation applied when tiles become tensors, or None.
    """

    path: Path
    attrs: dict[str, Any]
    coords: np.ndarray
    grid: np.ndarray
    foreground: np.ndarray
    tile_size: int
    stain: Any

    @property
    def slide_id(self) -> str:
        """The slide's id (from the store's attributes, else its folder name)."""
        ...

    def __len__(self) -> int:
        """Number of tiles N."""
        ...

    def read(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """uint8 (k, T, T, 3) tiles in the order of ``indices`` (all tiles when None)."""
        ...

    def array(self, name: str) -> np.ndarray:
        """An extra per-tile array stored with the tiles."""
        ...
