"""Finding slide files on disk for the manifest builders.

The extensions and the slide-id rule are those of :mod:`wsi_pipeline.slides.finder`, the one
finder ``tile`` and ``predict`` use too (``a.ome.tiff`` -> ``a``; a folder of ``.dcm`` files is
one DICOM slide named after the folder, with its first file as its path). Matching is
case-insensitive; hidden files and folders (``.``) and ``*.zarr`` stores are skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from wsi_pipeline.manifests.schema import ManifestError
from wsi_pipeline.slides.finder import NoSlidesError, find_slide_files, is_slide_name, no_slides_message
from wsi_pipeline.slides.finder import slide_id as _slide_id

__all__ = ["slide_stem", "find_slides", "check_files_exist", "first_few"]

log = logging.getLogger(__name__)


def first_few(values: Iterable[object], k: int = 5) -> str:
    """``"a, b, c (and 7 more)"``: the first ``k`` values of a listing, for error messages."""
    texts = [str(v) for v in values]
    more = f" (and {len(texts) - k} more)" if len(texts) > k else ""
    return ", ".join(texts[:k]) + more


def slide_stem(name: str) -> str | None:
    """The slide id of a file name (:func:`wsi_pipeline.slides.finder.slide_id`), or None when it is not a slide name."""
    return _slide_id(name) if is_slide_name(name) else None


def find_slides(root: str | os.PathLike, *, require: bool = False) -> dict[str, Path]:
    """Index every slide file under ``root`` (recursively) by slide id.

    Parameters
    ----------
    root : the folder to search.
    require : raise :class:`~wsi_pipeline.slides.finder.NoSlidesError` when there is none.

    Returns
    -------
    dict slide_id -> absolute path, in sorted order of the paths.

    Raises
    ------
    FileNotFoundError
        ``root`` is not a folder (or, with ``require``, holds no slide files).
    ManifestError
        Two files give the same slide id (e.g. ``a/x.svs`` and ``b/x.svs``), naming both.
    """
    files = find_slide_files(root)
    if require and not files:
        raise NoSlidesError(no_slides_message(root))
    found: dict[str, list[Path]] = {}
    for f in files:
        found.setdefault(f.slide_id, []).append(f.path)
    dups = {k: v for k, v in found.items() if len(v) > 1}
    if dups:
        listing = "; ".join(f"{k}: {first_few(v, 3)}" for k, v in list(dups.items())[:5])
        raise ManifestError(
            f"{root}: {len(dups)} slide id(s) occur more than once (slide ids come from file names, so they must be "
            f"unique across subfolders): {listing}; rename or move the duplicates"
        )
    log.info("found %d slide files under %s", len(files), root)
    return {f.slide_id: f.path for f in files}


def check_files_exist(slide_ids: Sequence[str], paths: Sequence[str | os.PathLike], *, root: str | os.PathLike) -> None:
    """Raise when any of ``paths`` is not a file, saying how many and which.

    Raises
    ------
    FileNotFoundError
        ``"<n> of <N> slide files not found under <root> (first few: ...)"`` with the fix.
    """
    missing = [(s, str(p)) for s, p in zip(slide_ids, paths) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of {len(slide_ids)} slide files not found under {root} (first few: "
            f"{first_few((f'{s} -> {p}' for s, p in missing), 3)}); check --slides (the folder of the slide files), "
            "or pass --no-check-files (check_files=False) to write the manifest before the slides are downloaded"
        )
