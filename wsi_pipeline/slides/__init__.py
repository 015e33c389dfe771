"""Slide reading: one interface (``base``) over the OpenSlide, tiffslide (``backends``), DICOM
(``dicom``) and plain-image (``image``: PNG, JPEG, BMP through Pillow) readers, chosen by
:func:`open_slide` (``opener``); resolution (``mpp``) and file identity."""

from wsi_pipeline.slides.base import Slide
from wsi_pipeline.slides.fingerprint import slide_fingerprint
from wsi_pipeline.slides.mpp import MPP_SOURCES, MissingMppError, resolve_mpp
from wsi_pipeline.slides.opener import BACKENDS, SlideOpenError, open_slide
from wsi_pipeline.slides.scaled import read_scaled, scaled_shape

__all__ = [
    "BACKENDS",
    "MPP_SOURCES",
    "MissingMppError",
    "Slide",
    "SlideOpenError",
    "open_slide",
    "read_scaled",
    "resolve_mpp",
    "scaled_shape",
    "slide_fingerprint",
]
