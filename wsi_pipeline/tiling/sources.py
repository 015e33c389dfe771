"""The slides of a tiling run: a folder of slides, one slide file, a manifest, or a list of jobs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from wsi_pipeline.slides.finder import (
    NoSlidesError,
    describe_extensions,
    find_slide_files,
    is_slide_name,
    no_slides_message,
    slide_id,
)
from wsi_pipeline.tiling.job import SlideJob

__all__ = ["jobs_from_folder", "jobs_from_manifest", "jobs_from_source"]


def jobs_from_folder(folder: str | os.PathLike, *, exclude: Sequence[str | os.PathLike] = ()) -> list[SlideJob]:
    """List the slides under ``folder`` (recursively), sorted by path, with :mod:`wsi_pipeline.slides.finder`.

    ``slide_id`` is the file name without its extension (``a.ome.tiff`` -> ``a``). A folder
    holding ``.dcm`` files is one DICOM slide named after the folder. Hidden folders, ``*.zarr``
    stores and ``exclude`` are skipped. Two slides with the same id both get a job that fails
    with a message naming both.

    Raises
    ------
    FileNotFoundError : ``folder`` is not a directory.
    """
    found = find_slide_files(folder, exclude=exclude)
    by_id: dict[str, list[Path]] = {}
    for f in found:
        by_id.setdefault(f.slide_id, []).append(f.path)
    jobs = []
    for f in found:
        problem = None
        if len(by_id[f.slide_id]) > 1:
            others = ", ".join(str(q) for q in by_id[f.slide_id])
            problem = f"duplicate slide_id {f.slide_id!r} ({others}); rename one of the files or list the slides in a manifest with unique slide_id"
        jobs.append(SlideJob(f.slide_id, str(f.path), None, problem))
    return jobs


def jobs_from_manifest(manifest: str | os.PathLike) -> list[SlideJob]:
    """One job per manifest row (``slide_id``, ``path`` made absolute, optional ``mpp``).

    Raises ``FileNotFoundError`` for a missing manifest and ``ManifestError`` for one that
    breaks the schema; rows whose slide is missing become jobs that fail with that reason.
    """
    from wsi_pipeline.manifests.schema import read_manifest

    df = read_manifest(manifest)
    jobs = []
    for row in df.itertuples(index=False):
        mpp = getattr(row, "mpp", None)
        mpp = float(mpp) if mpp is not None and not pd.isna(mpp) else None
        path = "" if pd.isna(row.path) else str(row.path)
        problem = None
        if path and not Path(path).exists():
            problem = f"slide file not found: {path} (manifest {manifest}, slide_id {row.slide_id!r}); fix the path column or remove the row"
        jobs.append(SlideJob(str(row.slide_id), path, mpp, problem))
    return jobs


def jobs_from_source(source: str | os.PathLike | Sequence[SlideJob], out: Path) -> list[SlideJob]:
    """The jobs of a folder, a slide file, a manifest or a job list; :class:`NoSlidesError` when there are none."""
    if not isinstance(source, (str, os.PathLike)):
        return list(source)
    src = Path(source)
    if src.is_dir():
        jobs = jobs_from_folder(src, exclude=[out])
        if not jobs:
            raise NoSlidesError(no_slides_message(src, exclude=[out]))
    elif src.suffix.lower() == ".csv":
        jobs = jobs_from_manifest(src)
        if not jobs:
            raise NoSlidesError(f"manifest {src} lists no slides; expected one row per slide (slide_id, path)")
    elif src.is_file() and is_slide_name(src.name):
        jobs = [SlideJob(slide_id(src), str(src.resolve()))]
    elif src.exists():
        raise NoSlidesError(
            f"{src} is neither a folder of slides, a slide file (endings {describe_extensions()}), nor a manifest .csv"
        )
    else:
        raise FileNotFoundError(f"{src} not found; pass a folder of slides, a slide file or a manifest .csv")
    return jobs
