"""Plain images (PNG, JPEG, BMP) as single-level slides, decoded by Pillow.

Why Pillow: it decodes all three formats with one call, gives the file's resolution tag (the
``dpi`` of a PNG ``pHYs`` chunk, a JPEG JFIF/EXIF header or a BMP header) so that a screen
resolution can be recognised and ignored (:func:`~wsi_pipeline.slides.mpp.screen_tag_mpp`), returns
RGB in file order, and is already a dependency. OpenCV's ``imread`` returns BGR, applies the EXIF
orientation (so its pixels are not the file's), and does not expose the resolution tag; tifffile
does not read these formats. Plain TIFFs (single-level, striped or tiled) are not read here: OpenSlide
reads tiled ones and tiffslide (tifffile's decode) striped ones, as before; their resolution tag is
screened the same way.

The pixels of :meth:`ImageSlide.read_region` are ``np.asarray(Image.open(path).convert("RGB"))`` for
RGB, greyscale (``L``) and palette images without transparency; images with transparency
(``RGBA``, ``LA``, ``P`` with a transparent colour) are composited over white, as the other
backends fill transparent areas; 16-bit or float images are refused (the pipeline reads 8-bit RGB).
The EXIF orientation of a JPEG is not applied (the stored pixel grid, like every slide reader).
The image is decoded once, on the first read, and held in memory (images here are small; Pillow's
decompression-bomb limit, :data:`PIL.Image.MAX_IMAGE_PIXELS`, applies: a larger image belongs in a
tiled TIFF).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wsi_pipeline.slides.base import Slide

__all__ = ["IMAGE_EXTENSIONS", "ImageSlide"]

#: File endings read by :class:`ImageSlide` (lower case).
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".bmp")
_FORMATS = ("PNG", "JPEG", "BMP", "MPO")  # MPO: a JPEG with extra frames (camera files); frame 0 is read
_EIGHT_BIT = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1")


class ImageSlide(Slide):
    """A PNG, JPEG or BMP image opened as a one-level slide (Pillow decodes it)."""

    backend = "pillow"

    def __init__(self, path: Path) -> None:
        from PIL import Image

        self.path = Path(path)
        self._pixels: np.ndarray | None = None
        with Image.open(self.path) as im:  # reads the header only
            if im.format not in _FORMATS:
                raise ValueError(f"{self.path}: Pillow reads it as {im.format}, not a PNG, JPEG or BMP image")
            if im.mode not in _EIGHT_BIT:
                raise ValueError(f"{self.path}: pixel mode {im.mode!r} is not supported (expected 8-bit RGB, greyscale or palette)")
            w, h = im.size
            info = dict(im.info)
            self._format, self._mode = str(im.format), str(im.mode)
        self.dimensions = (int(w), int(h))
        self.level_count = 1
        self.level_dimensions = (self.dimensions,)
        self.level_downsamples = (1.0,)
        self.background = (255, 255, 255)
        self.properties = {"pillow.format": self._format, "pillow.mode": self._mode}
        dpi = info.get("dpi")
        self.mpp, self.mpp_source = None, "none"
        if isinstance(dpi, tuple) and len(dpi) == 2:
            self.properties["pillow.dpi"] = f"{float(dpi[0]):g},{float(dpi[1]):g}"
            per_axis = [25400.0 / float(d) for d in dpi if float(d) > 0]
            if per_axis:
                self.mpp, self.mpp_source = float(np.mean(per_axis)), "image-tag"

    def pixels(self) -> np.ndarray:
        """The whole image, uint8 (height, width, 3) RGB (decoded on the first call, then kept)."""
        if self._pixels is None:
            from PIL import Image

            with Image.open(self.path) as im:
                im.load()
                if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                    rgba = np.asarray(im.convert("RGBA"))
                    a = rgba[..., 3:4].astype(np.float32) / 255.0
                    out = rgba[..., :3].astype(np.float32) * a + np.asarray(self.background, np.float32) * (1 - a)
                    self._pixels = np.clip(np.rint(out), 0, 255).astype(np.uint8)
                else:
                    self._pixels = np.ascontiguousarray(np.asarray(im.convert("RGB")))
        return self._pixels

    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        img = self.pixels()
        W, H = self.dimensions
        x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + w, W), min(y + h, H)
        if x0 == x and y0 == y and x1 == x + w and y1 == y + h:
            return img[y:y1, x:x1].copy()
        out = np.empty((h, w, 3), np.uint8)
        out[:] = self.background
        if x1 > x0 and y1 > y0:
            out[y0 - y : y1 - y, x0 - x : x1 - x] = img[y0:y1, x0:x1]
        return out

    def close(self) -> None:
        self._pixels = None
