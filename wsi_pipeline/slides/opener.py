"""Open a whole-slide image with the backend that reads it.

``backend="auto"`` tries OpenSlide first and falls back to tiffslide (OME-TIFF and other TIFFs
OpenSlide rejects, e.g. striped plain TIFFs), or for a DICOM file to wsidicom
(:mod:`wsi_pipeline.slides.dicom`); a PNG, JPEG or BMP file (by its ending) is read by Pillow
(:mod:`wsi_pipeline.slides.image`) as a single-level slide. When none opens the file, the error
(:class:`SlideOpenError`) keeps every reason. Every slide's own mpp is screened: a resolution tag
that is not a microscope's (72 dpi and the like) is ignored (:func:`~wsi_pipeline.slides.mpp.screen_tag_mpp`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from wsi_pipeline.slides.backends import OpenSlideSlide, TiffSlideSlide, error_reason
from wsi_pipeline.slides.base import Slide
from wsi_pipeline.slides.image import IMAGE_EXTENSIONS, ImageSlide
from wsi_pipeline.slides.mpp import ome_mpp_of_file, screen_tag_mpp

__all__ = ["BACKENDS", "SlideOpenError", "open_slide"]

logger = logging.getLogger(__name__)

#: Accepted values of ``backend``.
BACKENDS: tuple[str, ...] = ("auto", "openslide", "tiffslide", "wsidicom", "pillow")


class SlideOpenError(ValueError):
    """A file that no backend could open; ``reasons`` maps each backend tried to its error text."""

    def __init__(self, message: str, reasons: Mapping[str, str]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)


def _open_wsidicom(path: Path) -> Slide:
    from wsi_pipeline.slides.dicom import WsiDicomSlide

    return WsiDicomSlide(path)


_OPENERS: dict[str, Callable[[Path], Slide]] = {
    "openslide": OpenSlideSlide, "tiffslide": TiffSlideSlide, "wsidicom": _open_wsidicom, "pillow": ImageSlide,
}


def _open_logging_warnings(name: str, p: Path) -> Slide:
    """Open with backend ``name``; the readers' own warnings (e.g. tiffslide's "partially implemented") go to the log."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slide = _OPENERS[name](p)
    for w in caught:
        logger.info("%s on %s: %s", name, p.name, w.message)
    return slide


def open_slide(path: str | os.PathLike[str], backend: str = "auto") -> Slide:
    """Open a whole-slide image.

    Parameters
    ----------
    path : the slide file (for DICOM, any ``.dcm`` file of the slide's series, or their folder).
    backend : ``"auto"`` (OpenSlide, then tiffslide; for DICOM OpenSlide, then wsidicom; for a
        ``.png``/``.jpg``/``.jpeg``/``.bmp`` file Pillow), ``"openslide"``, ``"tiffslide"``,
        ``"wsidicom"`` or ``"pillow"``.

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
    if backend != "auto":
        names: tuple[str, ...] = (backend,)
    elif dicom:
        names = ("openslide", "wsidicom")
    elif p.suffix.lower() in IMAGE_EXTENSIONS:
        names = ("pillow",)
    else:
        names = ("openslide", "tiffslide")
    reasons: dict[str, str] = {}
    for name in names:
        try:
            slide = _open_logging_warnings(name, p)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # any backend failure is recorded and the next backend tried
            reasons[name] = error_reason(err)
            logger.debug("backend %s could not open %s: %s", name, p, reasons[name])
            continue
        if slide.level_count < 1 or min(slide.dimensions) < 1:
            reasons[name] = f"opened, but level 0 is empty (dimensions {slide.dimensions})"
            slide.close()
            continue
        if slide.mpp is None and p.is_file() and p.suffix.lower() in (".tif", ".tiff"):
            slide.mpp = ome_mpp_of_file(p)  # OpenSlide reads an OME-TIFF as a generic TIFF, without its pixel size
            slide.mpp_source = "ome" if slide.mpp is not None else "none"
        slide.mpp, slide.mpp_source = screen_tag_mpp(slide.mpp, slide.mpp_source, str(p))
        return slide
    detail = "; ".join(f"{k}: {v}" for k, v in reasons.items())
    hint = "" if backend == "auto" else " (try --backend auto)"
    if dicom:
        hint += f"; the file is DICOM: {describe_dicom(p)}; {SUPPORTED_LAYOUTS}"
    raise SlideOpenError(f"cannot open slide {p}: not a readable whole-slide image ({detail}){hint}", reasons)
