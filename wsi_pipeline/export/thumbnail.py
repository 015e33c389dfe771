"""Slide thumbnails for heatmaps, read from the slide or rebuilt from a tile store.

Both ways keep memory at the thumbnail's size: the slide is read by the package's one whole-slide
downscale (:func:`wsi_pipeline.slides.scaled.read_resized`: strips of the pyramid level nearest
the thumbnail resolution, each shrunk into place); a store-only slide (no readable slide file) is
rebuilt by shrinking its tiles into their footprints, batch by batch, on a white background.

The thumbnail's longest side is ``max_side`` px (default 1024, up- or down-scaled from level 0),
so the overlay and legend have room even for a small slide.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from wsi_pipeline.data.store import store_level0_size, store_tile_extent
from wsi_pipeline.export.heatmap import tile_rects
from wsi_pipeline.slides.scaled import read_resized
from wsi_pipeline.types import TileStoreLike

if TYPE_CHECKING:
    from wsi_pipeline.slides.base import Slide

__all__ = ["thumbnail_shape", "slide_thumbnail", "StoreThumbnail"]

log = logging.getLogger(__name__)


def thumbnail_shape(level0_size: tuple[int, int], max_side: int = 1024) -> tuple[int, int]:
    """(h, w) of the thumbnail of a level 0 of (width, height) px whose longest side is ``max_side``."""
    W, H = level0_size
    if W <= 0 or H <= 0:
        raise ValueError(f"level-0 size must be positive; got {level0_size}")
    s = max_side / max(W, H)
    return max(1, int(round(H * s))), max(1, int(round(W * s)))


def slide_thumbnail(slide: Slide, max_side: int = 1024) -> tuple[np.ndarray, tuple[int, int]]:
    """Thumbnail of an open slide (:func:`wsi_pipeline.slides.open_slide`) whose longest side is ``max_side`` px.

    Returns ``(uint8 (h, w, 3), (W, H) level-0 size)`` with (h, w) = :func:`thumbnail_shape`; read by
    :func:`wsi_pipeline.slides.scaled.read_resized` (the coarsest exact level at least as fine as
    the thumbnail, in memory-bounded strips).
    """
    W, H = (int(v) for v in slide.dimensions)
    return read_resized(slide, thumbnail_shape((W, H), max_side)), (W, H)


class StoreThumbnail:
    """Rebuild a thumbnail from tiles, batch by batch (pass :meth:`add` as ``embed_slide``'s ``on_batch``).

    Parameters
    ----------
    coords : (N, 2) tile top-left (x, y) in level-0 px, for all tiles of the store.
    tile_extent : tile side in level-0 px.
    level0_size : (W, H) level-0 px.
    max_side : longest thumbnail side in px.
    """

    def __init__(self, coords: np.ndarray, tile_extent: float, level0_size: tuple[int, int], max_side: int = 1024) -> None:
        self.level0_size = level0_size
        h, w = thumbnail_shape(level0_size, max_side)
        self.image = np.full((h, w, 3), 255, np.uint8)
        self.rects = tile_rects(coords, tile_extent, (w / level0_size[0], h / level0_size[1]), (h, w))

    def add(self, indices: np.ndarray, tiles: np.ndarray) -> None:
        """Shrink ``tiles`` uint8 (k, T, T, 3) of store ``indices`` (k,) into their footprints."""
        x0, y0, x1, y1 = self.rects
        for i, tile in zip(np.asarray(indices), tiles):
            tw, th = int(x1[i] - x0[i]), int(y1[i] - y0[i])
            if tw <= 0 or th <= 0:
                continue
            interp = cv2.INTER_AREA if tw <= tile.shape[1] else cv2.INTER_LINEAR
            self.image[y0[i] : y1[i], x0[i] : x1[i]] = cv2.resize(tile, (tw, th), interpolation=interp)

    @classmethod
    def from_store(cls, store: TileStoreLike, max_side: int = 1024, batch_size: int = 256) -> StoreThumbnail:
        """Rebuild from every tile of an open store (reads it once, ``batch_size`` tiles at a time)."""
        extent = store_tile_extent(store.attrs, store.tile_size)
        th = cls(store.coords, extent, store_level0_size(store.attrs, store.coords, extent), max_side)
        n = len(store)
        for s in range(0, n, batch_size):
            idx = np.arange(s, min(n, s + batch_size))
            th.add(idx, store.read(idx))
        return th


def open_slide_or_none(path: str | os.PathLike | None) -> Any | None:
    """The slide at ``path`` opened with :func:`wsi_pipeline.slides.open_slide`, or None when it cannot be read."""
    if not path or not os.path.isfile(path):
        return None
    try:
        from wsi_pipeline.slides import open_slide

        return open_slide(path)
    except (ImportError, OSError, ValueError, RuntimeError) as e:  # unreadable: fall back to the tiles
        log.info("cannot open slide %s for a thumbnail (%s); rebuilding it from the tile store", path, e)
        return None
