"""The slide interface every reader backend implements: geometry, resolution and exact reads.

A :class:`Slide` gives pyramid geometry, resolution (``mpp``), the slide's properties, and
:meth:`Slide.read_region`, which always returns a uint8 RGB array with transparent or
out-of-bounds areas filled with the background colour (white unless the slide says otherwise).

:meth:`Slide.read_level` reads a pyramid level's own pixels at integer positions of that level,
exactly as stored (decoded, never resampled). ``read_region`` cannot promise that at levels whose
downsample is not an integer (Aperio writes level sizes ``floor(W / 4)``, so level 1 is 4.0002x):
OpenSlide places the region at a fractional level position and interpolates; tiffslide truncates
``x / downsample``. The tiler reads only through :meth:`Slide.read_level`. The backends are in
:mod:`wsi_pipeline.slides.backends` and :mod:`wsi_pipeline.slides.dicom`;
:func:`wsi_pipeline.slides.opener.open_slide` chooses one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.slides.mpp import parse_mpp

__all__ = ["Slide"]


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
    mpp : microns per level-0 pixel (mean of x and y) from the slide's properties, or None (also
        when the only value is a resolution tag that is not a microscope's, e.g. 72 dpi:
        :func:`~wsi_pipeline.slides.mpp.screen_tag_mpp`).
    mpp_source : where :attr:`mpp` came from: ``vendor:<name>``, ``tiff-tag``, ``ome``, ``dicom``,
        ``image-tag``, ``none``, or ``ignored-dpi:<dpi>`` (a tag that was ignored).
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
    mpp_source: str = "none"
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
            self.mpp = parse_mpp(self.properties, (f"{vendor}.mpp-x", f"{vendor}.mpp-y"))
            maker = self.properties.get(f"{vendor}.vendor", "")
            self.mpp_source = "none" if self.mpp is None else (
                "tiff-tag" if maker in ("", "generic-tiff", "generic", "None") else f"vendor:{maker}")
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
