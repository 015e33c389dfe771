"""The file-format backends: OpenSlide (openslide-bin provides the library) and tiffslide.

Each is a :class:`~wsi_pipeline.slides.base.Slide`; DICOM has its own backend in
:mod:`wsi_pipeline.slides.dicom`. Open slides with :func:`wsi_pipeline.slides.open_slide`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from pathlib import Path

import numpy as np

from wsi_pipeline.slides.base import Slide
from wsi_pipeline.slides.mpp import ome_mpp

__all__ = ["OpenSlideSlide", "TiffSlideSlide", "error_reason"]

logger = logging.getLogger(__name__)


def error_reason(err: BaseException) -> str:
    """``"TypeName: message"`` of an error, for the reasons a backend could not open a file."""
    text = str(err).strip() or type(err).__name__
    return f"{type(err).__name__}: {text}"


class OpenSlideSlide(Slide):
    """A slide opened with OpenSlide (openslide-bin provides the library)."""

    backend = "openslide"

    def __init__(self, path: Path) -> None:
        import openslide

        self.path = path
        self._osr = openslide.OpenSlide(str(path))
        self._describe_handle(self._osr, "openslide")
        # The C call writes premultiplied ARGB straight into a numpy buffer; the public Python
        # API would build a PIL image and un-premultiply first (about a third slower per tile).
        from openslide import lowlevel

        self._raw_read = getattr(lowlevel, "_read_region", None) if sys.byteorder == "little" else None

    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        import cv2

        if self._raw_read is None:  # pragma: no cover - older/newer openslide-python without the private call
            rgba = np.asarray(self._osr.read_region((x, y), level, (w, h)))
            return _composite_straight(rgba, self.background)
        buf = np.empty((h, w), np.uint32)
        self._raw_read(self._osr._osr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), x, y, level, w, h)
        bgra = buf.view(np.uint8).reshape(h, w, 4)  # little-endian ARGB words are B, G, R, A bytes
        rgb = cv2.cvtColor(bgra, cv2.COLOR_BGRA2RGB)
        alpha = bgra[..., 3]
        if alpha.min() < 255:
            # premultiplied colour over the background: c + (1 - a) * bg
            rest = (255 - alpha.astype(np.uint16))[..., None] * np.asarray(self.background, np.uint16) // 255
            rgb = np.minimum(rgb.astype(np.uint16) + rest, 255).astype(np.uint8)
        return rgb

    def level_is_exact(self, level: int) -> bool:
        """Integer-downsample levels (read by OpenSlide) and, in a TIFF that tiffslide reads with the
        same pyramid, every level (read through tiffslide: OpenSlide would interpolate there)."""
        return super().level_is_exact(level) or self._tiff_twin() is not None

    def _read_level(self, level: int, lx: int, ly: int, w: int, h: int) -> np.ndarray:
        if super().level_is_exact(level):
            return super()._read_level(level, lx, ly, w, h)
        twin = self._tiff_twin()
        assert twin is not None  # read_level checked level_is_exact
        return twin._read_level(level, lx, ly, w, h)

    def level_reader(self, level: int) -> str:
        """``"openslide"``, or ``"tiffslide"`` for a non-integer-downsample level read through tiffslide."""
        return "openslide" if super().level_is_exact(level) or self._tiff_twin() is None else "tiffslide"

    def _tiff_twin(self) -> TiffSlideSlide | None:
        """The same file opened with tiffslide when its pyramid equals OpenSlide's, else None (cached).

        OpenSlide reads a level whose downsample d is not an integer at the fractional level
        position x / d and interpolates (cairo, bilinear), so no level-0 location gives that level's
        own pixels; tiffslide (tifffile) addresses level pixels directly.
        """
        if not hasattr(self, "_twin"):
            self._twin: TiffSlideSlide | None = None
            try:
                twin = TiffSlideSlide(self.path)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as err:  # not a TIFF tiffslide reads: non-integer levels stay unused
                logger.debug("tiffslide cannot read %s (%s); its non-integer-downsample levels are not used", self.path, error_reason(err))
                return None
            if twin.level_dimensions == self.level_dimensions:
                twin.background = self.background
                self._twin = twin
            else:
                logger.debug("tiffslide sees another pyramid in %s (%s vs %s)", self.path, twin.level_dimensions, self.level_dimensions)
                twin.close()
        return self._twin

    def close(self) -> None:
        twin = getattr(self, "_twin", None)
        if twin is not None:
            twin.close()
        self._osr.close()


def _composite_straight(rgba: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    """Composite a straight-alpha RGBA array (h, w, 4) over ``background``; uint8 (h, w, 3)."""
    rgb = rgba[..., :3]
    if rgba.shape[-1] < 4 or rgba[..., 3].min() == 255:
        return np.ascontiguousarray(rgb)
    a = rgba[..., 3:4].astype(np.float32) / 255.0
    out = rgb.astype(np.float32) * a + np.asarray(background, np.float32) * (1 - a)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)



class TiffSlideSlide(Slide):
    """A slide opened with tiffslide (pure Python on tifffile; reads OME-TIFF and other TIFFs)."""

    backend = "tiffslide"

    def __init__(self, path: Path) -> None:
        import tiffslide

        self.path = path
        self._ts = tiffslide.TiffSlide(str(path))
        self._describe_handle(self._ts, "tiffslide")
        if self.mpp is None:  # tiffslide does not read OME-XML's pixel size
            self.mpp = ome_mpp(getattr(self._ts, "ts_tifffile", None))
            self.mpp_source = "ome" if self.mpp is not None else "none"

    def level_is_exact(self, level: int) -> bool:
        """Every level: tiffslide addresses level pixels directly."""
        self._check(level, (0, 0))
        return True

    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        d = self.level_downsamples[level]
        return self._read_level(level, int(math.floor(x / d)), int(math.floor(y / d)), w, h)

    def _read_level(self, level: int, lx: int, ly: int, w: int, h: int) -> np.ndarray:
        lw, lh = self.level_dimensions[level]
        # tiffslide pads out-of-bounds areas with black; read the part inside and fill the rest.
        x0, y0 = max(lx, 0), max(ly, 0)
        x1, y1 = min(lx + w, lw), min(ly + h, lh)
        if x0 == lx and y0 == ly and x1 == lx + w and y1 == ly + h:
            return self._as_rgb(self._ts.read_region(self._location(level, lx, ly), level, (w, h), as_array=True, padding=False))
        out = np.empty((h, w, 3), np.uint8)
        out[:] = self.background
        if x1 > x0 and y1 > y0:
            part = self._ts.read_region(self._location(level, x0, y0), level, (x1 - x0, y1 - y0), as_array=True, padding=False)
            out[y0 - ly : y1 - ly, x0 - lx : x1 - lx] = self._as_rgb(part)
        return out

    def _location(self, level: int, lx: int, ly: int) -> tuple[int, int]:
        """The level-0 location tiffslide maps to level px (lx, ly) >= 0 (it takes int(x / downsample))."""
        transform = getattr(self._ts, "_read_region_loc_transform", None)
        d = float(self._ts.level_downsamples[level])

        def to_level(x: int, y: int) -> tuple[int, int]:
            if transform is not None:
                return tuple(int(v) for v in transform((x, y), level))  # type: ignore[return-value]
            return int(x / d), int(y / d)

        x, y = int(math.ceil(lx * d)), int(math.ceil(ly * d))
        for _ in range(8):
            gx, gy = to_level(x, y)
            if (gx, gy) == (lx, ly):
                return x, y
            x += (lx > gx) - (lx < gx)
            y += (ly > gy) - (ly < gy)
        raise ValueError(f"slide {self.path}: no level-0 location maps to px ({lx}, {ly}) of level {level} in tiffslide")

    def _as_rgb(self, arr: np.ndarray) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.dtype != np.uint8:
            raise ValueError(f"slide {self.path}: pixel type {arr.dtype} is not supported (expected 8-bit RGB)")
        if arr.ndim == 2:
            return np.repeat(arr[..., None], 3, axis=2)
        if arr.shape[-1] == 4:
            return _composite_straight(arr, self.background)
        if arr.shape[-1] == 1:
            return np.repeat(arr, 3, axis=2)
        return np.ascontiguousarray(arr[..., :3])

    def close(self) -> None:
        self._ts.close()
