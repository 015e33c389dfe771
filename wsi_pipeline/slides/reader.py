"""Open a whole-slide image with OpenSlide or tiffslide behind one small interface.

:func:`open_slide` returns a :class:`Slide`: pyramid geometry, resolution (``mpp``), the slide's
properties, and :meth:`Slide.read_region`, which always returns a uint8 RGB array with
transparent or out-of-bounds areas filled with the background colour (white unless the slide
says otherwise). ``backend="auto"`` tries OpenSlide first and falls back to tiffslide (OME-TIFF
and other TIFFs OpenSlide rejects), or for a DICOM file to wsidicom (:mod:`wsi_pipeline.slides.dicom`);
when none opens the file, the error keeps every reason.

:meth:`Slide.read_level` reads a pyramid level's own pixels at integer positions of that level,
exactly as stored (decoded, never resampled). ``read_region`` cannot promise that at levels whose
downsample is not an integer (Aperio writes level sizes ``floor(W / 4)``, so level 1 is 4.0002x):
OpenSlide places the region at a fractional level position and interpolates; tiffslide truncates
``x / downsample``. The tiler reads only through :meth:`Slide.read_level`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BACKENDS", "Slide", "SlideOpenError", "open_slide"]

logger = logging.getLogger(__name__)

#: Accepted values of ``backend``.
BACKENDS: tuple[str, ...] = ("auto", "openslide", "tiffslide", "wsidicom")


class SlideOpenError(ValueError):
    """A file that no backend could open; ``reasons`` maps each backend tried to its error text."""

    def __init__(self, message: str, reasons: Mapping[str, str]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)


#: OME length units -> micrometres.
_OME_UNITS_UM = {"pm": 1e-6, "nm": 1e-3, "µm": 1.0, "um": 1.0, "\u03bcm": 1.0, "mm": 1e3, "cm": 1e4, "m": 1e6}


def _ome_mpp(tif: Any) -> float | None:
    """um per px of an OME-TIFF's first image (``Pixels`` ``PhysicalSizeX/Y`` and their units), or None.

    The OME default unit is the micrometre; a pixel size in another length unit is converted,
    and a non-length unit (e.g. a reference frame) is ignored.
    """
    if tif is None or not getattr(tif, "is_ome", False):
        return None
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(tif.ome_metadata)
    except (ET.ParseError, TypeError, ValueError):
        return None
    pixels = next((el for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return None
    values = {}
    for axis in ("X", "Y"):
        size, unit = pixels.get(f"PhysicalSize{axis}"), pixels.get(f"PhysicalSize{axis}Unit", "µm")
        if size is not None and unit in _OME_UNITS_UM:
            try:
                values[axis] = float(size) * _OME_UNITS_UM[unit]
            except ValueError:
                continue
    return _parse_mpp(values, ("X", "Y"))


def _ome_mpp_of_file(path: Path) -> float | None:
    """:func:`_ome_mpp` of a TIFF file (None when it is not OME or cannot be read)."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            return _ome_mpp(tif)
    except (OSError, ValueError, tifffile.TiffFileError):
        return None


def _parse_mpp(values: Mapping[str, Any], keys: tuple[str, str]) -> float | None:
    """Mean of the positive, finite mpp values found under ``keys`` (x, y); None when there is none."""
    found = []
    for key in keys:
        raw = values.get(key)
        try:
            v = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if math.isfinite(v) and v > 0:
            found.append(v)
    return float(np.mean(found)) if found else None


def _parse_colour(value: Any) -> tuple[int, int, int]:
    """``"RRGGBB"`` hex (OpenSlide's background-color property) to an RGB tuple; white if absent or malformed."""
    try:
        s = str(value).strip().lstrip("#")
        if len(s) == 6:
            return (int(s[0:2], 16), int(s[2:4], 16), int(s[4:6], 16))
    except (TypeError, ValueError):
        pass
    return (255, 255, 255)


class Slide(ABC):
    """A whole-slide image, read-only.

    Attributes
    ----------
    path : the slide file.
    backend : ``"openslide"``, ``"tiffslide"`` or ``"wsidicom"``, the library that opened it.
    dimensions : (width, height) of level 0 in px.
    level_count : number of pyramid levels.
    level_dimensions : (width, height) of each level in px.
    level_downsamples : level-0 px per level px, per level (level 0 is 1.0).
    mpp : microns per level-0 pixel (mean of x and y) from the slide's properties, or None.
    properties : the slide's metadata as ``str -> str``.
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

    def _describe_handle(self, handle: Any, vendor: str) -> None:
        """Take geometry, properties, mpp (um/px) and background colour from an OpenSlide-like
        ``handle`` (OpenSlide or tiffslide, whose property names start with ``vendor``); the
        handle is closed when that fails, so a half-opened slide holds no file."""
        try:
            self.dimensions = tuple(int(v) for v in handle.dimensions)  # type: ignore[assignment]
            self.level_count = int(handle.level_count)
            self.level_dimensions = tuple((int(w), int(h)) for w, h in handle.level_dimensions)
            self.level_downsamples = tuple(float(d) for d in handle.level_downsamples)
            self.properties = {str(k): str(v) for k, v in handle.properties.items() if v is not None}
            self.mpp = _parse_mpp(self.properties, (f"{vendor}.mpp-x", f"{vendor}.mpp-y"))
            self.background = _parse_colour(self.properties.get(f"{vendor}.background-color", "FFFFFF"))
        except BaseException:
            handle.close()
            raise

    def _check(self, level: int, size: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= int(level) < self.level_count:
            raise ValueError(f"level={level} out of range [0, {self.level_count}) for slide {self.path}")
        w, h = int(size[0]), int(size[1])
        if w < 0 or h < 0:
            raise ValueError(f"size={size} must be non-negative (width, height) in px")
        return w, h

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """Read a region.

        Parameters
        ----------
        location : (x, y) of the top-left corner in level-0 px.
        level : pyramid level to read from.
        size : (width, height) in px of ``level``.

        Returns
        -------
        uint8 array (height, width, 3), RGB; areas outside the slide or transparent are
        filled with :attr:`background`.

        Notes
        -----
        At a level whose downsample is not an integer the backends map ``location`` differently
        (OpenSlide interpolates at the fractional level position, tiffslide truncates); for a
        level's own pixels use :meth:`read_level`.
        """
        w, h = self._check(level, size)
        if w == 0 or h == 0:
            return np.zeros((h, w, 3), np.uint8)
        return self._read(int(location[0]), int(location[1]), int(level), w, h)

    @abstractmethod
    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray: ...

    def level_scale(self, level: int) -> tuple[float, float]:
        """(x, y) level-0 px per px of ``level``, per axis from the level dimensions: (W0 / WL, H0 / HL)."""
        self._check(level, (0, 0))
        (w0, h0), (w, h) = self.dimensions, self.level_dimensions[level]
        return w0 / w, h0 / h

    def level_is_exact(self, level: int) -> bool:
        """True when :meth:`read_level` can return ``level``'s pixels exactly (level 0 always can).

        This base version accepts levels whose downsample is an integer k (level px x is level-0
        px k * x for any reader convention); backends that address every level exactly override it.
        """
        self._check(level, (0, 0))
        return level == 0 or float(self.level_downsamples[level]).is_integer()

    def read_level(self, level: int, origin: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        """Read a level's own pixels, exactly as stored (no resampling).

        Parameters
        ----------
        level : pyramid level (one for which :meth:`level_is_exact` is True).
        origin : (x, y) of the top-left corner in px of ``level`` (not level-0 px).
        size : (width, height) in px of ``level``.

        Returns
        -------
        uint8 array (height, width, 3), RGB: pixels [x, x + width) x [y, y + height) of ``level``;
        areas outside the level are filled with :attr:`background`.

        Raises
        ------
        ValueError : ``level`` out of range, negative ``size``, or a level this reader cannot
            address pixel-exactly.
        """
        w, h = self._check(level, size)
        if not self.level_is_exact(level):
            raise ValueError(
                f"slide {self.path}: level {level} (downsample {self.level_downsamples[level]:.6g}) cannot be read "
                f"pixel-exactly with the {self.backend} backend; use a level with level_is_exact() True"
            )
        if w == 0 or h == 0:
            return np.zeros((h, w, 3), np.uint8)
        return self._read_level(int(level), int(origin[0]), int(origin[1]), w, h)

    def _read_level(self, level: int, lx: int, ly: int, w: int, h: int) -> np.ndarray:
        k = int(self.level_downsamples[level])  # an integer downsample (level_is_exact)
        return self._read(lx * k, ly * k, level, w, h)

    def level_reader(self, level: int) -> str:
        """The library that decodes ``level`` in :meth:`read_level` (this slide's backend unless stated)."""
        return self.backend

    def exact_levels(self) -> tuple[bool, ...]:
        """:meth:`level_is_exact` of every level."""
        return tuple(self.level_is_exact(i) for i in range(self.level_count))

    def best_level_for_downsample(self, downsample: float) -> int:
        """The coarsest level whose downsample is at most ``downsample`` (1e-3 relative slack)."""
        best = 0
        for i, d in enumerate(self.level_downsamples):
            if d <= downsample * (1 + 1e-3) and d >= self.level_downsamples[best]:
                best = i
        return best

    def thumbnail(self, max_size: int = 1024) -> np.ndarray:
        """The whole slide scaled so that its longer side is at most ``max_size`` px; uint8 (h, w, 3) RGB."""
        from wsi_pipeline.slides.scaled import read_scaled

        w0, h0 = self.dimensions
        return read_scaled(self, max(1.0, max(w0, h0) / float(max_size)))

    @abstractmethod
    def close(self) -> None:
        """Release the file handle."""

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, backend={self.backend!r}, dimensions={self.dimensions}, levels={self.level_count}, mpp={self.mpp})"


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
                logger.debug("tiffslide cannot read %s (%s); its non-integer-downsample levels are not used", self.path, _reason(err))
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
            self.mpp = _ome_mpp(getattr(self._ts, "ts_tifffile", None))

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


def _open_wsidicom(path: Path) -> Slide:
    from wsi_pipeline.slides.dicom import WsiDicomSlide

    return WsiDicomSlide(path)


_OPENERS = {"openslide": OpenSlideSlide, "tiffslide": TiffSlideSlide, "wsidicom": _open_wsidicom}


def _open_logging_warnings(name: str, p: Path) -> Slide:
    """Open with backend ``name``; the readers' own warnings (e.g. tiffslide's "partially implemented") go to the log."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slide = _OPENERS[name](p)
    for w in caught:
        logger.info("%s on %s: %s", name, p.name, w.message)
    return slide


def _reason(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return f"{type(err).__name__}: {text}"


def open_slide(path: str | os.PathLike, backend: str = "auto") -> Slide:
    """Open a whole-slide image.

    Parameters
    ----------
    path : the slide file (for DICOM, any ``.dcm`` file of the slide's series, or their folder).
    backend : ``"auto"`` (OpenSlide, then tiffslide; for DICOM OpenSlide, then wsidicom),
        ``"openslide"``, ``"tiffslide"`` or ``"wsidicom"``.

    Returns
    -------
    A :class:`Slide`.

    Raises
    ------
    FileNotFoundError : ``path`` does not exist or is not a file.
    ValueError : unknown ``backend``; an empty file; :class:`SlideOpenError` when no backend
        could open the file (the message carries each backend's reason).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    from wsi_pipeline.slides.dicom import SUPPORTED_LAYOUTS, describe_dicom, dicom_files, is_dicom_file

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"slide file not found: {p}")
    if p.is_dir() and dicom_files(p):  # a DICOM slide's folder: open it through its first instance
        p = dicom_files(p)[0]
    if not p.is_file():
        raise FileNotFoundError(f"slide path is not a file: {p} (for a DICOM series pass one of its .dcm files)")
    if p.stat().st_size == 0:
        raise ValueError(f"slide file is empty (0 bytes): {p}; the copy or download is incomplete, replace the file")
    dicom = is_dicom_file(p)
    names = (("openslide", "wsidicom") if dicom else ("openslide", "tiffslide")) if backend == "auto" else (backend,)
    reasons: dict[str, str] = {}
    for name in names:
        try:
            slide = _open_logging_warnings(name, p)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # any backend failure is recorded and the next backend tried
            reasons[name] = _reason(err)
            logger.debug("backend %s could not open %s: %s", name, p, reasons[name])
            continue
        if slide.level_count < 1 or min(slide.dimensions) < 1:
            reasons[name] = f"opened, but level 0 is empty (dimensions {slide.dimensions})"
            slide.close()
            continue
        if slide.mpp is None and p.is_file() and p.suffix.lower() in (".tif", ".tiff"):
            slide.mpp = _ome_mpp_of_file(p)  # OpenSlide reads an OME-TIFF as a generic TIFF, without its pixel size
        return slide
    detail = "; ".join(f"{k}: {v}" for k, v in reasons.items())
    hint = "" if backend == "auto" else " (try --backend auto)"
    if dicom:
        hint += f"; the file is DICOM: {describe_dicom(p)}; {SUPPORTED_LAYOUTS}"
    raise SlideOpenError(f"cannot open slide {p}: not a readable whole-slide image ({detail}){hint}", reasons)
