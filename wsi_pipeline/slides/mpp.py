"""The resolution (microns per level-0 pixel) used for a slide, where it came from, and the error when it is missing.

Precedence, per slide (:func:`resolve_mpp`):

1. ``run-forced``: the run's ``--mpp-force`` (every slide, whatever it or the manifest says);
2. ``manifest``: the manifest's ``mpp`` column for this slide (explicit, per slide);
3. ``slide``: the slide's own metadata;
4. ``run-fallback``: the run's ``--mpp``, only for slides that have no mpp of their own;
5. ``none``: no mpp (an error where one is needed).

The slide's own value (3) is screened first (:func:`screen_tag_mpp`): a resolution tag that is not a
microscope's (a TIFF, PNG, JPEG or BMP dots-per-inch tag such as 72, 96, 150 or 300 dpi, i.e. a
level-0 mpp above :data:`MAX_MICROSCOPE_MPP`) is never taken as the slide's mpp. It is ignored with
one warning per slide (naming the slide and the value), and the slide's ``mpp_source`` becomes
``ignored-dpi:<dpi>``; a run then records that value as its ``mpp_source`` when no other source
gives an mpp. Where the slide's own value came from (:attr:`~wsi_pipeline.slides.base.Slide.mpp_source`):
``vendor:<name>`` (a scanner format's metadata, e.g. ``vendor:aperio``), ``tiff-tag`` (a generic
TIFF's resolution tags), ``ome`` (OME-XML), ``dicom``, ``image-tag`` (a PNG/JPEG/BMP resolution
tag), ``none``, or ``ignored-dpi:<dpi>``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MAX_MICROSCOPE_MPP", "MPP_SOURCES", "MissingMppError", "ome_mpp", "ome_mpp_of_file", "parse_mpp", "resolve_mpp",
    "screen_tag_mpp",
]

logger = logging.getLogger(__name__)

#: The coarsest level-0 resolution (um/px) read from a file's own tags that is taken as a microscope's.
#: A 2x objective scans at about 5 um/px; screen and print resolutions (72-600 dpi) are 42-353 um/px.
MAX_MICROSCOPE_MPP = 20.0

_warned: set[str] = set()
_warned_lock = threading.Lock()

#: Values of ``mpp_source`` in store attributes and ``tiling_report.csv``, in precedence order.
MPP_SOURCES: tuple[str, ...] = ("run-forced", "manifest", "slide", "run-fallback", "none")


class MissingMppError(ValueError):
    """A slide without mpp in a step that needs one; the message names the slide and the fixes."""


def _valid(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


def resolve_mpp(
    slide_mpp: float | None,
    *,
    manifest_mpp: float | None = None,
    run_mpp: float | None = None,
    force_mpp: float | None = None,
    slide_id: str = "",
    path: str = "",
    needed_for: str | None = None,
) -> tuple[float | None, str]:
    """Choose the mpp (um per level-0 px) of a slide.

    Precedence: ``force_mpp`` (``--mpp-force``), then the manifest's ``mpp`` for this slide, then
    the slide's own metadata, then ``run_mpp`` (``--mpp``, a fallback for slides without one).

    Parameters
    ----------
    slide_mpp : the value from the slide's properties (None when absent).
    manifest_mpp : the manifest's ``mpp`` for this slide (None/NaN when empty).
    run_mpp : the run-wide fallback ``--mpp`` (None when not given).
    force_mpp : the run-wide ``--mpp-force`` (None when not given).
    slide_id, path : for the error message.
    needed_for : what needs the mpp (e.g. ``"--mpp-target 0.5"``); when given and no mpp is
        found, raise :class:`MissingMppError`.

    Returns
    -------
    (mpp or None, source) with source one of :data:`MPP_SOURCES`.
    """
    order = ((force_mpp, "run-forced"), (manifest_mpp, "manifest"), (slide_mpp, "slide"), (run_mpp, "run-fallback"))
    for value, source in order:
        v = _valid(value)
        if v is not None:
            return v, source
    if needed_for:
        raise MissingMppError(
            f"slide {slide_id!r} ({path}) has no mpp (microns per pixel) in its metadata, and {needed_for} needs one; "
            f"give it per slide in an `mpp` column of the manifest (--manifest), or with `--mpp <um/px>` for every slide "
            f"that has none (e.g. --mpp 0.25 for 40x, 0.5 for 20x; slides with their own mpp keep it). "
            f"`--mpp-force <um/px>` overrides every slide's mpp, including correct ones"
        )
    return None, "none"


def screen_tag_mpp(mpp: float | None, source: str, slide: str) -> tuple[float | None, str]:
    """The slide's own mpp and its source, with a resolution tag that is not a microscope's ignored.

    Parameters
    ----------
    mpp : um per level-0 px read from the file's own metadata (None when absent).
    source : where it came from (e.g. ``"tiff-tag"``, ``"image-tag"``, ``"vendor:aperio"``).
    slide : the slide's path or name, for the warning.

    Returns
    -------
    ``(mpp, source)`` unchanged when mpp is None or at most :data:`MAX_MICROSCOPE_MPP`; else
    ``(None, "ignored-dpi:<dpi>")`` with dpi = 25400 / mpp (72 dpi is 352.8 um/px), after one
    warning per slide and process naming the slide and the value.
    """
    if mpp is None or mpp <= MAX_MICROSCOPE_MPP:
        return mpp, source if mpp is not None else "none"
    dpi = f"{round(25400.0 / mpp, 1):g}"
    with _warned_lock:
        first = slide not in _warned
        _warned.add(slide)
    if first:
        logger.warning(
            "slide %s: its resolution tag (%s) says %g um/px (%s dpi), which is a screen or print resolution, not a "
            "microscope's (above %g um/px); ignored. Give the slide's mpp in a manifest `mpp` column, with --mpp "
            "(slides without one) or --mpp-force", slide, source, mpp, dpi, MAX_MICROSCOPE_MPP,
        )
    return None, f"ignored-dpi:{dpi}"


#: OME length units -> micrometres.
_OME_UNITS_UM = {"pm": 1e-6, "nm": 1e-3, "µm": 1.0, "um": 1.0, "\u03bcm": 1.0, "mm": 1e3, "cm": 1e4, "m": 1e6}


def ome_mpp(tif: Any) -> float | None:
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
    return parse_mpp(values, ("X", "Y"))


def ome_mpp_of_file(path: Path) -> float | None:
    """:func:`ome_mpp` of a TIFF file (None when it is not OME or cannot be read)."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            return ome_mpp(tif)
    except (OSError, ValueError, tifffile.TiffFileError):
        return None


def parse_mpp(values: Mapping[str, Any], keys: tuple[str, str]) -> float | None:
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
