"""Finding slide files on disk for the manifest builders.

Known extensions are the formats OpenSlide 4.0 reads (tiffslide reads a subset of them: SVS,
generic tiled TIFF, NDPI, SCN, BIF): ``.svs .tif .tiff .ndpi .vms .vmu .scn .mrxs .svslide .bif
.czi .dcm``. A DICOM slide is a folder of ``.dcm`` files (one per level or frame group); it is
listed once, named after its folder, with the first file (sorted) as its path, which is how
OpenSlide opens it. ``.qptiff``, ``.jpg`` and ``.png`` are not listed: neither reader treats them
as whole-slide images reliably. Matching is case-insensitive; hidden files and folders (``.``)
are skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from wsi_pipeline.manifests.schema import ManifestError

__all__ = ["SLIDE_EXTENSIONS", "slide_stem", "find_slides", "check_files_exist", "first_few"]

log = logging.getLogger(__name__)

#: File name endings of whole-slide images the readers open (lower case, longest first where nested).
SLIDE_EXTENSIONS: tuple[str, ...] = (
    ".svs", ".tiff", ".tif", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif", ".czi", ".dcm",
)


def first_few(values: Iterable[object], k: int = 5) -> str:
    """``"a, b, c (and 7 more)"``: the first ``k`` values of a listing, for error messages."""
    values = [str(v) for v in values]
    more = f" (and {len(values) - k} more)" if len(values) > k else ""
    return ", ".join(values[:k]) + more


def slide_stem(name: str) -> str | None:
    """The file name without its slide extension, or None when the name is not a known slide format."""
    low = name.lower()
    for ext in SLIDE_EXTENSIONS:
        if low.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)]
    return None


def find_slides(root: str | os.PathLike) -> dict[str, Path]:
    """Index every slide file under ``root`` (recursively) by slide id.

    The slide id is the file name without its extension (a DICOM slide: its folder's name).
    Symbolic links to folders are followed once (cycles are skipped).

    Returns
    -------
    dict slide_id -> absolute path, in sorted order of the paths.

    Raises
    ------
    FileNotFoundError
        ``root`` is not a folder.
    ManifestError
        Two files give the same slide id (e.g. ``a/x.svs`` and ``b/x.svs``), naming both.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"slides folder not found: {root}; pass the folder that holds the slide files")
    found: dict[str, list[Path]] = {}
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath).absolute()
        dicom = sorted(f for f in filenames if f.lower().endswith(".dcm") and not f.startswith("."))
        if dicom:
            found.setdefault(here.name, []).append(here / dicom[0])
        for name in sorted(filenames):
            if name.startswith(".") or name.lower().endswith(".dcm"):
                continue
            stem = slide_stem(name)
            if stem is not None:
                found.setdefault(stem, []).append(here / name)
    dups = {k: v for k, v in found.items() if len(v) > 1}
    if dups:
        listing = "; ".join(f"{k}: {first_few(v, 3)}" for k, v in list(dups.items())[:5])
        raise ManifestError(
            f"{root}: {len(dups)} slide id(s) occur more than once (slide ids come from file names, so they must be "
            f"unique across subfolders): {listing}; rename or move the duplicates"
        )
    index = {k: v[0] for k, v in found.items()}
    log.info("found %d slide files under %s", len(index), root)
    return dict(sorted(index.items(), key=lambda kv: str(kv[1])))


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
