"""DICOM whole-slide images through wsidicom, and what ``auto`` tries for a DICOM file.

Supported DICOM layouts (what :data:`SUPPORTED_LAYOUTS` tells a user whose file no reader opens):
VL Whole Slide Microscopy Image instances (SOP class 1.2.840.10008.5.1.4.1.1.77.1.6), tiled full
or sparse, one slide per folder: all of a slide's ``.dcm`` instances (one per pyramid level,
plus label/overview) in one folder, or a single-file slide. The pyramid levels must halve
(wsidicom's rule: downsamples 1, 2, 4, ... up to rounding). JPEG, JPEG 2000 and uncompressed
frames are decoded.

``auto`` on a DICOM file (``.dcm`` ending, or the ``DICM`` marker at byte 128) tries OpenSlide,
then wsidicom; tiffslide cannot read DICOM and is not tried.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np

from wsi_pipeline.slides.base import Slide
from wsi_pipeline.slides.mpp import parse_mpp

__all__ = ["SUPPORTED_LAYOUTS", "WsiDicomSlide", "describe_dicom", "dicom_files", "is_dicom_file"]

logger = logging.getLogger(__name__)

#: One line for error messages: the DICOM layouts the readers open.
SUPPORTED_LAYOUTS = (
    "supported DICOM layouts: VL Whole Slide Microscopy Image instances (SOP class 1.2.840.10008.5.1.4.1.1.77.1.6, "
    "tiled full or sparse, JPEG / JPEG 2000 / uncompressed frames, pyramid levels halving), one slide per folder "
    "(all its .dcm instances together, nothing else in the folder) or a single-file slide"
)
_WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"


def is_dicom_file(path: str | os.PathLike) -> bool:
    """True for a ``.dcm`` name or a file with the DICOM ``DICM`` marker at byte 128."""
    p = Path(path)
    if p.name.lower().endswith(".dcm"):
        return True
    try:
        with open(p, "rb") as f:
            f.seek(128)
            return f.read(4) == b"DICM"
    except OSError:
        return False


def dicom_files(path: str | os.PathLike) -> list[Path]:
    """The instances of the slide that ``path`` belongs to: every ``.dcm`` file of its folder (sorted).

    ``path`` is a ``.dcm`` file or a folder of them. A file without the ``.dcm`` ending is taken alone.
    """
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    if p.is_file() and not p.name.lower().endswith(".dcm"):
        return [p]
    return sorted(q for q in folder.iterdir() if q.is_file() and q.name.lower().endswith(".dcm") and not q.name.startswith("."))


def describe_dicom(path: str | os.PathLike) -> str:
    """What a DICOM file is (SOP class, modality, image type), for an error message; '' when unreadable."""
    try:
        import pydicom

        ds = pydicom.dcmread(str(path), stop_before_pixels=True)
    except Exception as err:  # any parse failure: say so, the caller's error stands
        return f"pydicom cannot parse it ({type(err).__name__}: {err})"
    sop = str(getattr(ds, "SOPClassUID", "?"))
    name = getattr(getattr(ds, "SOPClassUID", None), "name", "") or "unknown SOP class"
    parts = [f"SOP class {sop} ({name})"]
    if sop != _WSI_SOP_CLASS:
        parts.append("not a whole-slide image instance")
    for key in ("Modality", "ImageType", "DimensionOrganizationType"):
        if key in ds:
            parts.append(f"{key} {getattr(ds, key)}")
    return ", ".join(parts)


class WsiDicomSlide(Slide):
    """A DICOM WSI opened with wsidicom: all ``.dcm`` instances of the file's folder, its first pyramid."""

    backend = "wsidicom"

    def __init__(self, path: Path) -> None:
        from wsidicom import WsiDicom

        self.path = path
        files = dicom_files(path)
        self._wsi = WsiDicom.open(files if len(files) > 1 else path)
        try:
            self._describe()
        except BaseException:
            self._wsi.close()
            raise

    def _describe(self) -> None:
        from wsidicom.errors import WsiDicomNoResolutionError

        self._levels = list(self._wsi.levels)
        if not self._levels:
            raise ValueError(f"{self.path}: no pyramid levels (no VL whole-slide VOLUME instances)")
        w0, h0 = int(self._levels[0].size.width), int(self._levels[0].size.height)
        self.dimensions = (w0, h0)
        self.level_count = len(self._levels)
        self.level_dimensions = tuple((int(lv.size.width), int(lv.size.height)) for lv in self._levels)
        # as OpenSlide computes them: the mean of the width and height ratios
        self.level_downsamples = tuple((w0 / w + h0 / h) / 2.0 for w, h in self.level_dimensions)
        props: dict[str, str] = {"wsidicom.level-count": str(self.level_count)}
        try:
            mpp = self._wsi.mpp  # um/px of the base level, from the pixel spacing
            props["wsidicom.mpp-x"], props["wsidicom.mpp-y"] = repr(float(mpp.width)), repr(float(mpp.height))
        except (WsiDicomNoResolutionError, AttributeError):
            pass
        try:
            props["wsidicom.series-uid"] = str(self._wsi.uids.series_instance)
            eq = self._wsi.metadata.equipment
            for key, value in (("manufacturer", eq.manufacturer), ("model", eq.model_name)):
                if value:
                    props[f"wsidicom.{key}"] = str(value)
        except AttributeError:  # metadata layout differs between wsidicom versions; it is informative only
            pass
        self.properties = props
        self.mpp = parse_mpp(props, ("wsidicom.mpp-x", "wsidicom.mpp-y"))
        self.mpp_source = "dicom" if self.mpp is not None else "none"
        self.background = (255, 255, 255)

    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        lw, lh = self.level_dimensions[level]
        d = self.level_downsamples[level]
        # wsidicom reads in the level's own pixels and refuses areas outside it: read the part
        # inside, fill the rest with the background (as OpenSlide does)
        lx, ly = int(math.floor(x / d)), int(math.floor(y / d))
        x0, y0 = max(lx, 0), max(ly, 0)
        x1, y1 = min(lx + w, lw), min(ly + h, lh)
        if x0 == lx and y0 == ly and x1 == lx + w and y1 == ly + h:
            return self._region(x0, y0, level, w, h)
        out = np.empty((h, w, 3), np.uint8)
        out[:] = self.background
        if x1 > x0 and y1 > y0:
            out[y0 - ly : y1 - ly, x0 - lx : x1 - lx] = self._region(x0, y0, level, x1 - x0, y1 - y0)
        return out

    def _region(self, lx: int, ly: int, level: int, w: int, h: int) -> np.ndarray:
        arr = np.asarray(self._wsi.read_region((lx, ly), self._levels[level].level, (w, h), as_array=True))
        if arr.dtype != np.uint8:
            raise ValueError(f"slide {self.path}: pixel type {arr.dtype} is not supported (expected 8-bit RGB)")
        if arr.ndim == 2:
            return np.repeat(arr[..., None], 3, axis=2)
        if arr.shape[-1] == 1:
            return np.repeat(arr, 3, axis=2)
        return np.ascontiguousarray(arr[..., :3])

    def close(self) -> None:
        self._wsi.close()
