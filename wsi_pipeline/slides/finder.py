"""The one slide finder: which files are slides, and each slide's id.

Used by ``tile --slides``, ``manifest folder`` and ``predict``, so a tiled folder, its manifest
and its predictions name every slide the same way.

Rules
-----
- A slide file ends (case-insensitively) in one of :data:`SLIDE_EXTENSIONS`. Formats no backend
  reads (CZI, iSyntax) are listed on purpose: tiling gives them a ``failed`` row, not silence.
  Plain images (``.png .jpg .jpeg .bmp``; plain TIFFs end in ``.tif``/``.tiff``) are single-level
  slides (:mod:`wsi_pipeline.slides.image`).
- Its slide id is the file name without that ending, the longest ending first, so the double
  endings ``.ome.tiff``/``.ome.tif`` are removed whole: ``a.ome.tiff`` -> ``a``, ``a.svs`` -> ``a``.
- DICOM: ``.dcm`` files are grouped into slides by their series (``SeriesInstanceUID``: a
  slide's levels are separate instances of one series). A folder that holds one series and no
  other slide files, below the folder searched, is one slide named after that folder; otherwise
  (a single-file DICOM among other slides, several series in one folder, ``.dcm`` files directly in
  the folder searched) each series is a slide named after its first file (``scan.dcm`` -> ``scan``).
  A slide's path is its first ``.dcm`` file in sorted order.
- Hidden files and folders (``.``-prefixed) and ``*.zarr`` folders (tile stores) are skipped;
  folder links are followed once (cycles skipped); a file link that leads nowhere (dangling, or a
  loop) is skipped with a warning naming it.
- An id must be a name (:func:`wsi_pipeline.slide_ids.check_slide_id`): a file whose name gives
  an id with leading or trailing spaces, ``..`` or control characters is refused up front, naming
  every such file, so that one file never gets two ids in two places.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from wsi_pipeline.slide_ids import SlideIdError, slide_id_problem

__all__ = [
    "DICOM_EXTENSIONS",
    "SLIDE_EXTENSIONS",
    "NoSlidesError",
    "SlideFile",
    "describe_extensions",
    "find_slide_files",
    "is_slide_name",
    "no_slides_message",
    "slide_id",
]

log = logging.getLogger(__name__)

#: File endings of DICOM instances (one folder of them is one slide).
DICOM_EXTENSIONS: tuple[str, ...] = (".dcm",)
#: File endings taken as slides, in the order error messages list them.
_LISTED: tuple[str, ...] = (
    ".svs", ".tif", ".tiff", ".ome.tif", ".ome.tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".bif", ".svslide",
    ".qptiff", ".czi", ".isyntax", ".png", ".jpg", ".jpeg", ".bmp",
) + DICOM_EXTENSIONS
#: File endings taken as slides, lower case, longest first (so double endings win over their tail).
SLIDE_EXTENSIONS: tuple[str, ...] = tuple(sorted(_LISTED, key=len, reverse=True))


class NoSlidesError(FileNotFoundError):
    """A folder (or manifest) that yields no slide files; the message names it and the endings looked for."""


def _ending(name: str) -> str | None:
    low = name.lower()
    for ext in SLIDE_EXTENSIONS:
        if low.endswith(ext) and len(name) > len(ext):
            return ext
    return None


def is_slide_name(name: str) -> bool:
    """True when the file name ends in a slide extension (hidden names excluded)."""
    return not name.startswith(".") and _ending(name) is not None


def slide_id(path: str | os.PathLike) -> str:
    """The slide id of a slide file: its name without the slide ending (a ``.dcm`` file: its folder's name).

    ``a.ome.tiff`` -> ``a``; ``b.SVS`` -> ``b``; ``scan7/0.dcm`` -> ``scan7``.

    Raises
    ------
    ValueError : the name does not end in one of :data:`SLIDE_EXTENSIONS`.
    """
    p = Path(path)
    ext = _ending(p.name)
    if ext is None:
        raise ValueError(f"{p.name!r} is not a slide file name; expected one of the endings {describe_extensions()}")
    if ext in DICOM_EXTENSIONS:
        parent = Path(os.path.abspath(p)).parent.name
        if parent:
            return parent
    return p.name[: -len(ext)]


@dataclass(frozen=True)
class SlideFile:
    """One slide found on disk: its id and absolute path (a DICOM slide: its first ``.dcm`` file)."""

    slide_id: str
    path: Path


def describe_extensions() -> str:
    """The endings looked for, as one line for error messages."""
    return " ".join(_LISTED) + " (a folder of .dcm files is one DICOM slide)"


def _is_link_loop(folder: Path, base: Path) -> bool:
    """Whether ``folder`` is the same folder as one of its ancestors up to ``base`` (a link cycle).

    Two links to the same folder that are not each other's ancestors are both followed: each is
    listed under its own name (a linked DICOM folder too), and the manifest builders warn that the
    two ids point to the same files.
    """
    real = os.path.realpath(folder)
    for parent in folder.parents:
        if os.path.realpath(parent) == real:
            return True
        if parent == base:
            break
    return False


def find_slide_files(root: str | os.PathLike, *, exclude: Iterable[str | os.PathLike] = ()) -> list[SlideFile]:
    """Every slide file under ``root`` (recursively), in sorted order of the paths.

    Two files may give the same id (``a/x.svs`` and ``b/x.svs``); both are returned and the
    caller decides (the manifest builder refuses, the tiler gives both a ``failed`` row).

    Parameters
    ----------
    root : the folder to search.
    exclude : folders not to enter (e.g. the tiler's output folder inside the slides folder).

    Raises
    ------
    FileNotFoundError : ``root`` is not a folder.
    SlideIdError : some file names give unusable ids (all of them named, with the rule).
    """
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"slides folder not found: {base}; pass the folder that holds the slide files")
    base = base.resolve()
    skip = {os.path.realpath(p) for p in exclude}
    found: list[SlideFile] = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
        here = Path(dirpath)
        if _is_link_loop(here, base):
            dirnames[:] = []
            continue
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and not d.lower().endswith(".zarr") and os.path.realpath(here / d) not in skip
        )
        names = []
        for f in sorted(filenames):
            if not is_slide_name(f):
                continue
            if not os.path.exists(here / f):  # a dangling link, or a link loop
                why = "a link loop" if os.path.islink(here / f) and _loops(here / f) else "a link to nothing"
                log.warning("skipping %s: %s, not a slide file", here / f, why)
                continue
            names.append(f)
        dicom = [f for f in names if _ending(f) in DICOM_EXTENSIONS]
        if dicom:
            from wsi_pipeline.slides.dicom import dicom_series

            series = dicom_series([here / f for f in dicom])
            own_folder = len(series) == 1 and len(dicom) == len(names) and here != base
            for group in series:
                sid = slide_id(group[0]) if own_folder else group[0].name[: -len(_ending(group[0].name) or "")]
                found.append(SlideFile(sid, group[0]))
        found.extend(SlideFile(slide_id(f), here / f) for f in names if _ending(f) not in DICOM_EXTENSIONS)
    bad = [(s.path, problem) for s in found if (problem := slide_id_problem(s.slide_id)) is not None]
    if bad:
        listed = "; ".join(f"{p} (id {slide_id(p)!r}: {why})" for p, why in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise SlideIdError(
            f"{len(bad)} slide file(s) under {base} have names that cannot be slide ids: {listed}{more}; "
            "rename them (a slide id is the file name without its ending, and must be a plain name)"
        )
    return sorted(found, key=lambda s: str(s.path))


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == 40  # ELOOP
    return False


def no_slides_message(root: str | os.PathLike, *, exclude: Sequence[str | os.PathLike] = ()) -> str:
    """The error text for a folder without slide files: the folder, the endings looked for, a few other files seen."""
    others: list[str] = []
    base = Path(root)
    skip = {os.path.realpath(p) for p in exclude}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and os.path.realpath(Path(dirpath) / d) not in skip)
        others.extend(os.path.relpath(Path(dirpath) / f, base) for f in sorted(filenames) if not f.startswith("."))
        if len(others) > 5:
            break
    seen = f"; it holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}" if others else "; it is empty"
    return (
        f"no slide files under {base} (looked for the endings {describe_extensions()}){seen}; "
        "pass the folder that holds the slides, or list them in a manifest (--manifest)"
    )
