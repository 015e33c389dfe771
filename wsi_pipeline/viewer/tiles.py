"""Image tiles of the zoomable slide: a power-of-two pyramid of 256 px tiles over level-0 pixels.

Geometry (the same for every source, and for the overlays in :mod:`wsi_pipeline.viewer.overlays`):
zoom ``z`` runs from 0 (the whole slide in one tile) to ``max_zoom`` = ceil(log2(max(W, H) / 256))
(1 screen px = 1 level-0 px); tile ``(z, tx, ty)`` covers level-0 px
``[tx, tx + 1) * 256 * 2^(max_zoom - z)`` x ``[ty, ty + 1) * ...``. Edge tiles are padded with the
slide's background colour to 256 x 256.

Sources:

- :class:`DeepZoomTiles`: OpenSlide's own DeepZoom generator (``openslide.deepzoom.DeepZoomGenerator``,
  tile 256, overlap 0), for slides our OpenSlide backend reads (SVS, NDPI, MIRAX, ...). Its DeepZoom
  level ``max_zoom + 8`` is level 0 and each level halves, so DeepZoom level ``z + 8`` is our zoom ``z``.
- :class:`SlideTiles`: the same pyramid over :meth:`wsi_pipeline.slides.Slide.read_region` (the best
  pyramid level for the zoom, then a box filter to the tile), for what OpenSlide cannot read (OME-TIFF
  through tiffslide, DICOM through wsidicom).
- :class:`StoreTiles`: a slide whose file is gone, drawn from its tile store: the stored tiles at their
  level-0 places, glass (white) elsewhere. Zoomed-out tiles come from an overview of the store built once,
  streaming the tiles in batches (memory: the overview, at most 4096 px on its long side, plus a batch).
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
from typing import Protocol

import numpy as np
from PIL import Image

from wsi_pipeline.data.store import TileStore
from wsi_pipeline.slides import Slide
from wsi_pipeline.viewer.query import BadRequest

__all__ = ["TILE", "DeepZoomTiles", "SlideTiles", "StoreTiles", "TileSource", "encode", "max_zoom", "tile_box"]

log = logging.getLogger(__name__)

#: Side of a viewer tile in screen px.
TILE = 256
#: Largest side (px) of a store's overview image (zoomed-out tiles of a slide viewed from its store).
OVERVIEW_MAX = 4096


def max_zoom(dimensions: tuple[int, int]) -> int:
    """The zoom at which one screen px is one level-0 px: ceil(log2(max(W, H) / 256)), at least 0."""
    return max(0, math.ceil(math.log2(max(max(dimensions), 1) / TILE)))


def tile_box(dimensions: tuple[int, int], z: int, tx: int, ty: int) -> tuple[int, int, int, int, int]:
    """``(x0, y0, x1, y1, scale)``: the level-0 box of tile ``(z, tx, ty)`` clipped to the slide, and the level-0
    px per screen px (2^(max_zoom - z)). Raises :class:`~wsi_pipeline.viewer.query.BadRequest` (a ``ValueError``)
    for a zoom or tile outside the pyramid."""
    zmax = max_zoom(dimensions)
    if not 0 <= z <= zmax:
        raise BadRequest(f"zoom {z} outside 0..{zmax}")
    s = 1 << (zmax - z)
    span = TILE * s
    x0, y0 = tx * span, ty * span
    if tx < 0 or ty < 0 or x0 >= dimensions[0] or y0 >= dimensions[1]:
        raise BadRequest(f"tile ({tx}, {ty}) at zoom {z} is outside the slide ({dimensions[0]} x {dimensions[1]} px)")
    return x0, y0, min(x0 + span, dimensions[0]), min(y0 + span, dimensions[1]), s


def _pad(img: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    if img.shape[0] == TILE and img.shape[1] == TILE:
        return img
    out = np.empty((TILE, TILE, 3), np.uint8)
    out[:] = background
    out[: img.shape[0], : img.shape[1]] = img[:TILE, :TILE]
    return out


def encode(tile: np.ndarray, fmt: str = "JPEG", quality: int = 85) -> bytes:
    """A uint8 RGB (or RGBA for PNG) array as JPEG or PNG bytes."""
    buf = io.BytesIO()
    img = Image.fromarray(tile)
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


class TileSource(Protocol):
    """What the server needs of a slide: its size and its tiles."""

    dimensions: tuple[int, int]
    background: tuple[int, int, int]

    def tile(self, z: int, tx: int, ty: int) -> np.ndarray:
        """uint8 (256, 256, 3) RGB of tile ``(z, tx, ty)`` (see the module docstring)."""
        ...

    def region(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        """uint8 (h, w, 3) RGB of level-0 px ``[x, x + w) x [y, y + h)`` (a full-resolution crop)."""
        ...

    def close(self) -> None: ...


class SlideTiles:
    """Tiles read through a :class:`~wsi_pipeline.slides.Slide` (any backend); one read at a time per slide."""

    def __init__(self, slide: Slide) -> None:
        self.slide = slide
        self.dimensions = slide.dimensions
        self.background = slide.background
        self._lock = threading.Lock()

    def tile(self, z: int, tx: int, ty: int) -> np.ndarray:
        x0, y0, x1, y1, s = tile_box(self.dimensions, z, tx, ty)
        level = self.slide.best_level_for_downsample(s)
        ds = self.slide.level_downsamples[level]
        rw, rh = max(1, math.ceil((x1 - x0) / ds)), max(1, math.ceil((y1 - y0) / ds))
        with self._lock:
            img = self.slide.read_region((x0, y0), level, (rw, rh))
        ow, oh = max(1, math.ceil((x1 - x0) / s)), max(1, math.ceil((y1 - y0) / s))
        if (rw, rh) != (ow, oh):
            img = np.asarray(Image.fromarray(img).resize((ow, oh), Image.Resampling.BOX))
        return _pad(img, self.background)

    def region(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        with self._lock:
            return self.slide.read_region((x, y), 0, (w, h))

    def close(self) -> None:
        self.slide.close()


class DeepZoomTiles:
    """Tiles from OpenSlide's DeepZoom generator over the slide file (thread-safe: OpenSlide is)."""

    def __init__(self, slide: Slide) -> None:
        import openslide
        from openslide.deepzoom import DeepZoomGenerator

        self.slide = slide
        self.dimensions = slide.dimensions
        self.background = slide.background
        self._osr = openslide.OpenSlide(str(slide.path))
        self._dz = DeepZoomGenerator(self._osr, tile_size=TILE, overlap=0, limit_bounds=False)
        self._offset = self._dz.level_count - 1 - max_zoom(self.dimensions)

    def tile(self, z: int, tx: int, ty: int) -> np.ndarray:
        tile_box(self.dimensions, z, tx, ty)  # the same range check as every source
        img = self._dz.get_tile(z + self._offset, (tx, ty))
        return _pad(np.asarray(img.convert("RGB")), self.background)

    def region(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        return self.slide.read_region((x, y), 0, (w, h))

    def close(self) -> None:
        self._osr.close()
        self.slide.close()


class StoreTiles:
    """Tiles drawn from a tile store (the slide file is gone): stored tiles at their places, white elsewhere.

    ``dimensions`` is the stored slide size (attribute ``slide_dimensions``/``dimensions`` when recorded) or
    the extent of the tiles.
    """

    def __init__(self, store: TileStore) -> None:
        self.store = store
        attrs = store.attrs
        self.extent = float(attrs.get("tile_size", store.tile_size)) * float(attrs.get("downsample", 1.0))
        coords = store.coords.reshape(-1, 2)
        dims = attrs.get("slide_dimensions") or attrs.get("dimensions")
        if dims:
            self.dimensions = (int(dims[0]), int(dims[1]))
        elif len(coords):
            self.dimensions = (int(coords[:, 0].max() + self.extent), int(coords[:, 1].max() + self.extent))
        else:
            self.dimensions = (int(self.extent), int(self.extent))
        self.background = (255, 255, 255)
        self._coords = coords
        self._lock = threading.Lock()
        self._overview: np.ndarray | None = None
        self._overview_scale = max(1.0, max(self.dimensions) / OVERVIEW_MAX)

    def _paint(self, x0: float, y0: float, x1: float, y1: float, scale: float, out: np.ndarray, batch: int = 64) -> None:
        """Paint the stored tiles meeting level-0 box [x0, x1) x [y0, y1) into ``out`` at ``scale`` level-0 px per px."""
        c = self._coords
        e = self.extent
        sel = np.flatnonzero((c[:, 0] < x1) & (c[:, 0] + e > x0) & (c[:, 1] < y1) & (c[:, 1] + e > y0))
        side = max(1, round(e / scale))
        for start in range(0, len(sel), batch):
            idx = sel[start:start + batch]
            with self._lock:
                tiles = self.store.read(idx)
            for i, t in zip(idx, tiles):
                px, py = round((c[i, 0] - x0) / scale), round((c[i, 1] - y0) / scale)
                img = t if side == t.shape[0] else np.asarray(Image.fromarray(t).resize((side, side), Image.Resampling.BOX))
                ox, oy = max(0, -px), max(0, -py)
                ex, ey = min(side, out.shape[1] - px), min(side, out.shape[0] - py)
                if ex > ox and ey > oy:
                    out[py + oy:py + ey, px + ox:px + ex] = img[oy:ey, ox:ex]

    def _get_overview(self) -> np.ndarray:
        if self._overview is None:
            s = self._overview_scale
            ov = np.full((max(1, math.ceil(self.dimensions[1] / s)), max(1, math.ceil(self.dimensions[0] / s)), 3), 255, np.uint8)
            self._paint(0, 0, self.dimensions[0], self.dimensions[1], s, ov, batch=256)
            self._overview = ov
        return self._overview

    def tile(self, z: int, tx: int, ty: int) -> np.ndarray:
        x0, y0, x1, y1, s = tile_box(self.dimensions, z, tx, ty)
        ow, oh = max(1, math.ceil((x1 - x0) / s)), max(1, math.ceil((y1 - y0) / s))
        if s >= 2 * self._overview_scale:  # zoomed out: from the overview
            ov, k = self._get_overview(), self._overview_scale
            crop = ov[int(y0 / k):math.ceil(y1 / k), int(x0 / k):math.ceil(x1 / k)]
            img = np.asarray(Image.fromarray(crop).resize((ow, oh), Image.Resampling.BOX))
        else:
            img = np.full((oh, ow, 3), 255, np.uint8)
            self._paint(x0, y0, x1, y1, s, img)
        return _pad(img, self.background)

    def region(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        out = np.full((h, w, 3), 255, np.uint8)
        self._paint(x, y, x + w, y + h, 1.0, out)
        return out

    def close(self) -> None:
        pass


class BlankTiles:
    """A white canvas for a slide known only by its heatmap (predictions of precomputed feature files: no slide
    file, no tile store): the attention overlay is drawn on it. ``dimensions`` is the extent of the scored tiles
    (``heatmaps/<slide_id>_scores.csv``: level-0 ``x``, ``y``, ``size``)."""

    def __init__(self, dimensions: tuple[int, int]) -> None:
        self.dimensions = (max(1, int(dimensions[0])), max(1, int(dimensions[1])))
        self.background = (255, 255, 255)

    @classmethod
    def from_scores(cls, scores: str | os.PathLike[str]) -> BlankTiles:
        """The canvas of a scores CSV's tiles (``ValueError`` naming the file when it lacks ``x``, ``y``, ``size``)."""
        import pandas as pd

        df = pd.read_csv(scores)
        missing = {"x", "y", "size"} - set(df.columns)
        if missing:
            raise ValueError(f"scores file {scores}: missing column(s) {sorted(missing)}; expected tile, x, y, size, ...")
        if not len(df):
            return cls((TILE, TILE))
        return cls((int(math.ceil((df["x"] + df["size"]).max())), int(math.ceil((df["y"] + df["size"]).max()))))

    def tile(self, z: int, tx: int, ty: int) -> np.ndarray:
        tile_box(self.dimensions, z, tx, ty)  # a tile outside the pyramid is refused
        return np.full((TILE, TILE, 3), 255, np.uint8)

    def region(self, x: int, y: int, w: int, h: int) -> np.ndarray:
        return np.full((h, w, 3), 255, np.uint8)

    def close(self) -> None:
        pass
