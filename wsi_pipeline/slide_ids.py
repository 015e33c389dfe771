"""Slide ids are names, never paths: the one rule, and the one way an output path is made from an id.

Every builder and reader of manifests, the slide finder and every writer of per-slide outputs go
through :func:`check_slide_id` / :func:`slide_output_path`, so a manifest row such as
``/data/other/victim`` or ``../x`` can neither write nor remove anything outside the output folder.

The rule (:func:`slide_id_problem`): a slide id is a non-empty name of at most
:data:`MAX_ID_BYTES` bytes (UTF-8) with no path separator (``/`` or ``\\``), no ``..``, no leading
``.`` (hidden names are the tools' temporary files), no leading or trailing white space and no
control characters.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

__all__ = ["MAX_ID_BYTES", "SlideIdError", "check_slide_id", "slide_id_problem", "slide_output_path"]

#: Longest slide id in UTF-8 bytes: file names hold 255 bytes, and the tools add up to ~50
#: (``.<id>.zarr.tmp-<pid>-<thread>``, ``<id>_scores.csv.tmp-...``).
MAX_ID_BYTES = 200


class SlideIdError(ValueError):
    """A slide id that could be taken for a path (or is otherwise unusable as a file name)."""


def slide_id_problem(slide_id: object) -> str | None:
    """Why ``slide_id`` is not a usable slide id (one short phrase), or None when it is."""
    if not isinstance(slide_id, str):
        return f"it is a {type(slide_id).__name__}, not text"
    if slide_id == "":
        return "it is empty"
    if "/" in slide_id or "\\" in slide_id:
        return "it contains a path separator (/ or \\)"
    if ".." in slide_id:
        return "it contains '..'"
    if slide_id.startswith("."):
        return "it starts with '.' (hidden names are reserved for temporary files)"
    if slide_id != slide_id.strip():
        return "it starts or ends with white space"
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in slide_id):
        return "it contains a control character"
    if len(slide_id.encode("utf-8")) > MAX_ID_BYTES:
        return f"it is longer than {MAX_ID_BYTES} bytes"
    return None


RULE = (f"a slide id is a file name: non-empty, at most {MAX_ID_BYTES} bytes, no / or \\, no '..', no leading '.', "
        "no leading or trailing spaces, no control characters")


def check_slide_id(slide_id: object, *, where: str = "") -> str:
    """Return ``slide_id`` if it is a usable slide id, else raise :class:`SlideIdError`.

    ``where`` (a file and row, a folder) starts the message, which then shows the id and the rule.
    """
    why = slide_id_problem(slide_id)
    if why is not None:
        prefix = f"{where}: " if where else ""
        raise SlideIdError(f"{prefix}slide_id {slide_id!r} refused: {why}; {RULE}")
    return slide_id  # type: ignore[return-value]


def slide_output_path(root: str | os.PathLike[str], slide_id: str, suffix: str = "") -> Path:
    """``root / (slide_id + suffix)``, checked to name an entry directly inside ``root``.

    The id is checked with :func:`check_slide_id`, and the joined path's parent is ``root``
    itself (compared after resolving links in ``root``), so nothing built from an id can land
    elsewhere, whatever the id.

    Raises
    ------
    SlideIdError : the id breaks the rule, or the name would leave ``root``.
    """
    check_slide_id(slide_id, where=str(root))
    name = f"{slide_id}{suffix}"
    base = Path(root)
    path = base / name
    if path.name != name or os.path.realpath(path.parent) != os.path.realpath(base):
        raise SlideIdError(f"{root}: the output name {name!r} of slide {slide_id!r} would leave the folder")
    return path
