"""Read pyramid levels of TIFF-family slides by decoding their stored tiles directly.

OpenSlide decodes a TIFF slide one stored tile at a time and paints the tiles into the requested
region. :class:`DirectTiles` does the same work without OpenSlide's per-call overhead: it reads each
stored tile's bytes at the offsets tifffile lists (``os.pread``) and decodes them with imagecodecs
(libjpeg-turbo for JPEG; the tifffile codec table for LZW, deflate, zstd, uncompressed, ...), keeping
recently decoded tiles so that a caller walking a tile grid decodes each stored tile once.

The pixels equal OpenSlide's ``read_region`` bit for bit on every level this module agrees to serve,
because it follows OpenSlide's conventions for that vendor driver:

- Aperio SVS and generic tiled TIFF, JPEG with 8-bit RGB or YCbCr in one plane: the tile and the
  JPEGTables are given to libjpeg with the JPEG colour space forced from the TIFF ``Photometric`` tag
  (Aperio stores RGB-coded JPEG without an Adobe marker; YCbCr tiles are upsampled by libjpeg with its
  default "fancy" filter and converted to RGB), exactly as OpenSlide's fast tile path does.
- Generic tiled TIFF, other codecs (none, LZW, deflate, zstd, ...) with 8-bit RGB or greyscale samples:
  OpenSlide goes through libtiff's RGBA interface, which for these layouts copies the samples (grey
  replicated to R = G = B); tifffile's decoder (predictors included) gives the same samples.
- Aperio JPEG 2000 in RGB (compression 33005): OpenJPEG (in imagecodecs as in OpenSlide) decodes
  the codestream and undoes the multi-component transform; the three components are the pixels.
- Hamamatsu NDPI levels stored in the file (not OpenSlide's extra levels made by libjpeg's DCT
  scaling): the restart-marker tiles that tifffile exposes are OpenSlide's tiles too; each is decoded
  behind the file's JPEG header with the tile's size, libjpeg guessing the colour space as OpenSlide does.
- Edge tiles are decoded whole and clipped at the level's edge; areas outside the level and stored
  tiles with no data (byte count 0) in a generic TIFF are filled with the background colour, where
  OpenSlide leaves them transparent (:class:`~wsi_pipeline.slides.base.Slide` composites them over
  the same colour).

Anything else is declined (:meth:`DirectTiles.reason` says why) and the caller reads through
OpenSlide: Aperio JPEG 2000 in YCbCr (33003, converted by OpenSlide's own tables), Aperio levels
with missing tiles (OpenSlide renders those from the level above), YCbCr without JPEG, old-style
JPEG, planar or 16-bit samples, alpha, orientations other than top-left, other vendors' drivers
(Philips, Ventana, Leica, ... whose grids OpenSlide assembles differently), and levels whose
downsample is not an integer: OpenSlide maps a level-0 location to the level by dividing by the
downsample and paints at the sub-pixel remainder, so only integer downsamples give level pixels that
a direct read can equal.

Typical use, with the OpenSlide fallback::

    slide = open_slide(path)
    direct = DirectTiles.from_slide(slide)
    if direct.supports(level):
        tiles = direct.read_tiles(level, origins, 256)   # (x, y) in level px, row-major
    else:
        tiles = (slide.read_region((round(x * d), round(y * d)), level, (256, 256)) for x, y in origins)
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.slides.jpeg_rows import sequential_frame, with_height
from wsi_pipeline.types import SlideLike

__all__ = ["DirectTiles", "direct_levels"]

#: TIFF compression codes read through libtiff's RGBA path by OpenSlide that tifffile decodes
#: (none, LZW, PackBits, deflate, old deflate, LZMA, zstd, WebP).
_LIBTIFF_CODECS = frozenset({1, 5, 8, 32773, 32946, 34925, 50000, 50001})
_JPEG = 7
_RGB, _YCBCR, _MINISBLACK = 2, 6, 1
_APERIO_J2K_RGB = 33005  # JPEG 2000 codestream, RGB (with or without the multi-component transform)


@dataclass(frozen=True)
class _Level:
    """Where one pyramid level's stored tiles are and how to decode them."""

    width: int  # level px
    height: int
    tile_w: int  # stored tile px
    tile_h: int
    across: int  # stored tiles per row / column
    down: int
    offsets: tuple[int, ...]  # bytes into the file, per stored tile (row-major)
    counts: tuple[int, ...]  # bytes per stored tile; 0 = no data
    decode: Callable[[bytes, int], np.ndarray]  # (tile bytes, tile index) -> uint8 (>= th, >= tw, 3)
    cut_by_height: bool = False  # JPEG tile streams decoded as they are: the top rows can be decoded alone


def _jpeg_decoder(tables: bytes | None, photometric: int) -> Callable[[bytes, int], np.ndarray]:
    import imagecodecs

    cs = imagecodecs.JPEG8.CS
    space = cs.YCbCr if photometric == _YCBCR else cs.RGB

    def decode(data: bytes, index: int) -> np.ndarray:
        return imagecodecs.jpeg8_decode(data, tables=tables, colorspace=space, outcolorspace=cs.RGB)

    return decode


def _ndpi_decoder(header: bytes, tile_h: int, tile_w: int) -> Callable[[bytes, int], np.ndarray]:
    import imagecodecs

    def decode(data: bytes, index: int) -> np.ndarray:
        return imagecodecs.jpeg_decode(data, header=header, shape=(tile_h, tile_w))

    return decode


def _j2k_decoder() -> Callable[[bytes, int], np.ndarray]:
    import imagecodecs

    def decode(data: bytes, index: int) -> np.ndarray:
        # OpenJPEG undoes the multi-component transform; OpenSlide copies the three components
        return imagecodecs.jpeg2k_decode(data)

    return decode


def _tifffile_decoder(page: Any, samples: int) -> Callable[[bytes, int], np.ndarray]:
    page_decode = page.decode

    def decode(data: bytes, index: int) -> np.ndarray:
        arr = page_decode(data, index)[0]  # (1, tile_h, tile_w, samples)
        arr = arr.reshape(arr.shape[-3], arr.shape[-2], samples)
        return np.repeat(arr, 3, axis=2) if samples == 1 else arr

    return decode


def _page_problem(page: Any, vendor: str) -> str | None:
    """Why OpenSlide's pixels of this tiled page cannot be reproduced directly; None if they can."""
    if int(page.bitspersample) != 8 or np.dtype(page.dtype) != np.uint8:
        return f"{page.bitspersample}-bit samples (8-bit expected)"
    if int(page.planarconfig) != 1:
        return "planar (separate) sample planes"
    if getattr(page, "extrasamples", ()):
        return "extra (alpha) samples"
    orientation = int(page.tags.valueof(274, 1))
    if orientation != 1:
        return f"orientation {orientation} (top-left expected)"
    comp, photo, spp = int(page.compression), int(page.photometric), int(page.samplesperpixel)
    if comp == _JPEG:
        if photo in (_RGB, _YCBCR) and spp == 3:
            return None
        return f"JPEG with photometric {photo} and {spp} samples (RGB or YCbCr, 3 samples expected)"
    if vendor == "aperio" and comp == _APERIO_J2K_RGB:
        return None if photo == _RGB and spp == 3 else f"Aperio JPEG 2000 with photometric {photo} and {spp} samples"
    if vendor == "aperio" and comp == 33003:
        return "Aperio JPEG 2000 in YCbCr (compression 33003); OpenSlide converts its colours with its own tables"
    if comp not in _LIBTIFF_CODECS:
        return f"compression {comp} is not one this reader decodes like libtiff"
    if photo == _RGB and spp == 3:
        return None
    if photo == _MINISBLACK and spp == 1:
        return None
    return f"photometric {photo} with {spp} samples under compression {comp} (RGB or grey expected)"


def _prop_int(props: Mapping[str, str], key: str) -> int | None:
    try:
        return int(props[key])
    except (KeyError, ValueError):
        return None


class DirectTiles:
    """Direct reader of a TIFF-family slide's levels, pixel-equal to OpenSlide where it serves a level.

    Parameters
    ----------
    path : the slide file.
    properties : the slide's OpenSlide properties (``openslide.vendor``, ``openslide.level[i].*``).
    level_downsamples : level-0 px per level px, per OpenSlide level.
    background : RGB fill for areas outside the level or without stored data.
    cache_bytes : bytes of decoded stored tiles kept (least recently used dropped first; at least one
        tile is kept); :meth:`read_tiles` raises it while it runs to what a row-major grid needs to
        decode each stored tile once (about two rows of stored tiles).

    Use :meth:`from_slide` with an OpenSlide-backed :class:`~wsi_pipeline.slides.base.Slide`.
    :meth:`read` and :meth:`stored_tile` are thread-safe (file reads are positional; the tile cache is
    locked; imagecodecs releases the GIL while decoding; a stored tile another thread is decoding is
    waited for, not decoded twice); run one :meth:`read_tiles` at a time.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        properties: Mapping[str, str],
        level_downsamples: Iterable[float],
        background: tuple[int, int, int] = (255, 255, 255),
        cache_bytes: int = 128 * 2**20,
    ) -> None:
        self.path = Path(path)
        self.background = tuple(int(v) for v in background)
        self.level_downsamples = tuple(float(d) for d in level_downsamples)
        self.cache_bytes = int(cache_bytes)
        self._cached_bytes = 0
        #: stored tiles decoded so far (a cache hit does not count)
        self.decoded = 0
        #: stored tiles of which only the top rows were decoded (:meth:`stored_tile_top`)
        self.decoded_top = 0
        self._cache: OrderedDict[tuple[int, int, int], np.ndarray | None] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int, int], threading.Event] = {}  # stored tiles being decoded
        self._levels: dict[int, _Level] = {}
        self._reasons: dict[int, str] = {}
        self._fd: int | None = None
        self._tif: Any = None
        vendor = str(properties.get("openslide.vendor", ""))
        n = len(self.level_downsamples)
        if vendor not in ("aperio", "generic-tiff", "hamamatsu"):
            self._reasons = {i: f"OpenSlide vendor driver {vendor!r} is not read directly" for i in range(n)}
            return
        import tifffile

        try:
            self._tif = tifffile.TiffFile(str(self.path))
        except (OSError, ValueError, tifffile.TiffFileError) as err:
            self._reasons = {i: f"tifffile cannot parse {self.path}: {err}" for i in range(n)}
            return
        try:
            if vendor == "hamamatsu" and not self._tif.is_ndpi:
                self._reasons = {i: "Hamamatsu slide that is not NDPI" for i in range(n)}
                return
            self._fd = os.open(str(self.path), os.O_RDONLY | getattr(os, "O_BINARY", 0))
            pages = [p for p in self._tif.pages if getattr(p, "is_tiled", False)]
            for i in range(n):
                try:
                    self._levels[i] = self._describe(i, vendor, properties, pages)
                except _Declined as why:
                    self._reasons[i] = str(why)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_slide(cls, slide: SlideLike, cache_bytes: int = 128 * 2**20) -> DirectTiles:
        """A reader for an open :class:`~wsi_pipeline.slides.base.Slide`; every level is declined
        unless OpenSlide opened it (OpenSlide's pixels are the reference)."""
        if getattr(slide, "backend", None) != "openslide":
            reader = cls(slide.path, {}, slide.level_downsamples, slide.background, cache_bytes)
            reader._reasons = {i: f"slide opened with {slide.backend!r}, not OpenSlide" for i in range(slide.level_count)}
            return reader
        return cls(slide.path, slide.properties, slide.level_downsamples, slide.background, cache_bytes)

    # -- level discovery ---------------------------------------------------------------------

    def _describe(self, i: int, vendor: str, props: Mapping[str, str], pages: list[Any]) -> _Level:
        key = f"openslide.level[{i}]."
        w, h = _prop_int(props, key + "width"), _prop_int(props, key + "height")
        tw, th = _prop_int(props, key + "tile-width"), _prop_int(props, key + "tile-height")
        if w is None or h is None or tw is None or th is None:
            raise _Declined(f"OpenSlide gives no stored tile size for level {i}")
        d = self.level_downsamples[i]
        if d != math.floor(d):
            raise _Declined(f"downsample {d!r} is not an integer (OpenSlide resamples at sub-pixel offsets)")
        match = [p for p in pages if (p.imagewidth, p.imagelength, p.tilewidth, p.tilelength) == (w, h, tw, th)]
        if vendor == "generic-tiff":  # OpenSlide takes the first page and reduced-resolution pages only
            match = [p for p in match if p.index == 0 or int(p.subfiletype) & 1]
        if not match and vendor == "hamamatsu":
            raise _Declined("OpenSlide makes this level by libjpeg's DCT scaling of a stored level; it is not stored in the file")
        if len(match) != 1:
            found = "no" if not match else f"{len(match)}"
            raise _Declined(f"{found} stored pages of {w} x {h} px with {tw} x {th} px tiles (one expected)")
        page = match[0]
        problem = _page_problem(page, vendor)
        if problem:
            raise _Declined(problem)
        across, down = -(-w // tw), -(-h // th)
        offsets = tuple(int(v) for v in page.dataoffsets)
        counts = tuple(int(v) for v in page.databytecounts)
        if len(offsets) < across * down or len(counts) < across * down:
            raise _Declined(f"{len(offsets)} stored tiles for a {across} x {down} grid")
        if vendor != "generic-tiff" and min(counts[: across * down]) == 0:
            raise _Declined("stored tiles without data (OpenSlide renders them from another level)")
        cut = False
        if int(page.compression) == _JPEG:
            if vendor == "hamamatsu":
                decode = _ndpi_decoder(page.jpegheader, th, tw)
            else:
                decode, cut = _jpeg_decoder(page.jpegtables, int(page.photometric)), True
        elif int(page.compression) == _APERIO_J2K_RGB:
            decode = _j2k_decoder()
        else:
            decode = _tifffile_decoder(page, int(page.samplesperpixel))
        return _Level(w, h, tw, th, across, down, offsets, counts, decode, cut)

    # -- public queries ------------------------------------------------------------------------

    def supports(self, level: int) -> bool:
        """True when ``level`` is read directly (pixel-equal to OpenSlide); else use OpenSlide."""
        return int(level) in self._levels

    def reason(self, level: int) -> str | None:
        """Why ``level`` is not read directly; None when it is."""
        if int(level) in self._levels:
            return None
        return self._reasons.get(int(level), f"level {level} out of range [0, {len(self.level_downsamples)})")

    def stored_tile_size(self, level: int) -> tuple[int, int]:
        """(width, height) in level px of the stored tiles of a served level."""
        lv = self._level(level)
        return lv.tile_w, lv.tile_h

    def stored_tile(self, level: int, col: int, row: int) -> np.ndarray | None:
        """Stored tile (``col``, ``row``) of a served level, decoded once (then from the cache).

        Returns uint8 (>= tile height, >= tile width, 3) RGB as stored (edge tiles keep their padding
        past the level's edge), or None for a tile without data. Do not modify the array: it is shared.
        """
        lv = self._level(level)
        if not (0 <= int(col) < lv.across and 0 <= int(row) < lv.down):
            raise ValueError(f"stored tile ({col}, {row}) outside the {lv.across} x {lv.down} grid of level {level}")
        return self._tile(int(level), lv, int(col), int(row))

    def stored_tile_top(self, level: int, col: int, row: int, rows: int) -> np.ndarray | None:
        """At least the top ``rows`` rows of stored tile (``col``, ``row``), decoding little more than them.

        Returns uint8 (r, >= tile width, 3) with ``rows`` <= r < tile height, equal to
        ``stored_tile(level, col, row)[:r]`` bit for bit (:mod:`~wsi_pipeline.slides.jpeg_rows` says
        why), or None where only the whole tile can be decoded: a level whose stored tiles are not JPEG
        streams read as they are (NDPI, other codecs), a tile that is not sequential JPEG, ``rows``
        too close to the tile height to save anything, or a tile without data. The cache is neither
        filled nor needed (a cached tile is sliced).
        """
        lv = self._level(level)
        col, row = int(col), int(row)
        if not (0 <= col < lv.across and 0 <= row < lv.down):
            raise ValueError(f"stored tile ({col}, {row}) outside the {lv.across} x {lv.down} grid of level {level}")
        with self._lock:
            cached = self._cache.get((int(level), col, row))
        if cached is not None:
            return cached[: max(int(rows), 1)] if int(rows) < lv.tile_h else None
        idx = row * lv.across + col
        if not lv.cut_by_height or not lv.counts[idx]:
            return None
        data = self._pread(lv.counts[idx], lv.offsets[idx])
        frame = sequential_frame(data) if len(data) == lv.counts[idx] else None
        if frame is None:
            return None
        declared, exact = frame.exact_rows(max(int(rows), 1))
        if declared >= min(frame.height, lv.tile_h):
            return None
        try:
            top = lv.decode(with_height(data, frame, declared), idx)
        except (ValueError, RuntimeError):
            return None  # the whole tile's decode reports the problem
        if top.dtype != np.uint8 or top.ndim != 3 or top.shape[0] != declared or top.shape[2] != 3:
            return None
        with self._lock:
            self.decoded_top += 1
        return top[:exact]

    def _level(self, level: int) -> _Level:
        try:
            return self._levels[int(level)]
        except KeyError:
            raise ValueError(f"slide {self.path}: level {level} is not read directly: {self.reason(level)}") from None

    # -- reading -------------------------------------------------------------------------------

    def _tile(self, level: int, lv: _Level, col: int, row: int) -> np.ndarray | None:
        """Decoded stored tile (col, row) of ``level``, uint8 (>= tile_h, >= tile_w, 3); None without data."""
        key = (level, col, row)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            # another thread decoding this tile: wait for it rather than decode it twice
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = threading.Event()
        if pending is not None:
            pending.wait()
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return self._cache[key]
            return self._decode_tile(level, lv, col, row, key, claimed=False)  # evicted already, or it failed
        return self._decode_tile(level, lv, col, row, key, claimed=True)

    def _decode_tile(self, level: int, lv: _Level, col: int, row: int, key: tuple[int, int, int], claimed: bool) -> np.ndarray | None:
        """Decode stored tile (col, row) and cache it; ``claimed``: this thread registered it as pending."""
        try:
            return self._decode_uncached(level, lv, col, row, key)
        finally:
            if claimed:
                with self._lock:
                    event = self._pending.pop(key, None)
                if event is not None:
                    event.set()

    def _decode_uncached(self, level: int, lv: _Level, col: int, row: int, key: tuple[int, int, int]) -> np.ndarray | None:
        idx = row * lv.across + col
        count = lv.counts[idx]
        tile = None
        if count:
            data = self._pread(count, lv.offsets[idx])
            if len(data) != count:
                raise ValueError(f"slide {self.path}: stored tile {idx} of level {level} is truncated ({len(data)} of {count} bytes)")
            try:
                tile = lv.decode(data, idx)
            except (ValueError, RuntimeError) as err:
                raise ValueError(f"slide {self.path}: cannot decode stored tile {idx} of level {level}: {err}") from err
            need_h = min(lv.tile_h, lv.height - row * lv.tile_h)
            need_w = min(lv.tile_w, lv.width - col * lv.tile_w)
            if tile.dtype != np.uint8 or tile.ndim != 3 or tile.shape[2] != 3 or tile.shape[0] < need_h or tile.shape[1] < need_w:
                raise ValueError(
                    f"slide {self.path}: stored tile {idx} of level {level} decoded to {tile.dtype} {tile.shape}; "
                    f"expected uint8 ({lv.tile_h}, {lv.tile_w}, 3)"
                )
        with self._lock:
            self.decoded += 1
            if key not in self._cache:
                self._cache[key] = tile
                self._cached_bytes += 0 if tile is None else tile.nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= 0 if old is None else old.nbytes
        return tile

    def _pread(self, count: int, offset: int) -> bytes:
        if self._fd is None:
            raise ValueError(f"slide {self.path}: the direct reader is closed")
        if hasattr(os, "pread"):
            return os.pread(self._fd, count, offset)
        with self._lock:  # pragma: no cover - platforms without pread (Windows)
            os.lseek(self._fd, offset, os.SEEK_SET)
            return os.read(self._fd, count)

    def read(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """Read a region of ``level`` in that level's px.

        Parameters
        ----------
        level : a served level (:meth:`supports`).
        x, y : top-left corner in level px (may lie outside the level).
        width, height : size in level px.

        Returns
        -------
        uint8 (height, width, 3) RGB, equal to OpenSlide's ``read_region((x * d, y * d), level,
        (width, height))`` composited over :attr:`background` (``d`` the level's integer downsample).
        """
        lv = self._level(level)
        x, y, w, h = int(x), int(y), int(width), int(height)
        if w < 0 or h < 0:
            raise ValueError(f"size ({width}, {height}) must be non-negative (width, height) in px")
        out = np.empty((h, w, 3), np.uint8)
        x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + w, lv.width), min(y + h, lv.height)
        if not (x0 == x and y0 == y and x1 == x + w and y1 == y + h):
            out[:] = self.background
        if x1 <= x0 or y1 <= y0:
            return out
        for row in range(y0 // lv.tile_h, (y1 - 1) // lv.tile_h + 1):
            ty = row * lv.tile_h
            r0, r1 = max(y0, ty), min(y1, ty + lv.tile_h)
            for col in range(x0 // lv.tile_w, (x1 - 1) // lv.tile_w + 1):
                tx = col * lv.tile_w
                c0, c1 = max(x0, tx), min(x1, tx + lv.tile_w)
                tile = self._tile(level, lv, col, row)
                if tile is None:
                    out[r0 - y : r1 - y, c0 - x : c1 - x] = self.background
                else:
                    out[r0 - y : r1 - y, c0 - x : c1 - x] = tile[r0 - ty : r1 - ty, c0 - tx : c1 - tx]
        return out

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """:meth:`Slide.read_region`'s signature: ``location`` in level-0 px, a multiple of the level's
        downsample; ``size`` (width, height) in level px. uint8 (height, width, 3) RGB."""
        self._level(level)
        d = self.level_downsamples[int(level)]
        lx, ly = int(location[0]) / d, int(location[1]) / d
        if lx != math.floor(lx) or ly != math.floor(ly):
            raise ValueError(f"location {tuple(location)} (level-0 px) is not a multiple of level {level}'s downsample {d}")
        return self.read(level, int(lx), int(ly), int(size[0]), int(size[1]))

    def read_tiles(self, level: int, origins: Iterable[tuple[int, int]], size: int | tuple[int, int]) -> Iterator[np.ndarray]:
        """Read many regions of one ``size`` (px, or (width, height)) at ``origins`` (x, y in level px).

        With origins in row-major order (rows by increasing y), every stored tile is decoded once:
        the cache holds the stored rows a region row spans, and rows above the current region are
        dropped. Yields uint8 (height, width, 3) RGB arrays in the order of ``origins``.
        """
        lv = self._level(level)
        w, h = (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
        need = lv.across * (-(-h // lv.tile_h) + 1) + -(-w // lv.tile_w) + 1
        saved = self.cache_bytes
        self.cache_bytes = max(saved, need * lv.tile_w * lv.tile_h * 3)
        top = None
        try:
            for x, y in origins:
                if top is None or y > top:
                    top = int(y)
                    first_row = max(top, 0) // lv.tile_h
                    with self._lock:
                        for key in [k for k in self._cache if k[0] == level and k[2] < first_row]:
                            old = self._cache.pop(key)
                            self._cached_bytes -= 0 if old is None else old.nbytes
                yield self.read(level, int(x), int(y), w, h)
        finally:
            self.cache_bytes = saved

    def clear_cache(self) -> None:
        """Drop every decoded stored tile."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def close(self) -> None:
        """Release the file handles and the cache."""
        self.clear_cache()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tif is not None:
            self._tif.close()
            self._tif = None

    def __enter__(self) -> DirectTiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Declined(Exception):
    """A level that is not read directly; the message says why."""


def direct_levels(slide: SlideLike) -> dict[int, str | None]:
    """Per level of an open slide: None when :class:`DirectTiles` reads it directly, else the reason."""
    with DirectTiles.from_slide(slide) as reader:
        return {i: reader.reason(i) for i in range(slide.level_count)}
