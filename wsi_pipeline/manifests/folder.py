"""Manifest of every slide in a folder, with labels joined from an optional CSV.

For a user's own cohort, and for ``predict`` on new slides (no labels needed). Slides are found
and named by :mod:`wsi_pipeline.slides.finder`, as ``tile --slides`` and ``predict`` find them
(the file name without its extension, ``a.ome.tiff`` -> ``a``; a DICOM folder's name).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from wsi_pipeline.manifests.files import find_slides, first_few
from wsi_pipeline.manifests.schema import ManifestError
from wsi_pipeline.manifests.sources import (
    SLIDE_ID_COLUMNS,
    ManifestWarning,
    check_label_range,
    check_one_split_per_slide,
    check_patient_splits,
    clean_slide_ids,
    finalise,
    pick_column,
    read_table,
)
from wsi_pipeline.slides.finder import no_slides_message

__all__ = ["build_folder_manifest"]

log = logging.getLogger(__name__)


#: The endpoint columns a labels CSV may carry (``--time-column`` etc. name them when they are called otherwise).
ENDPOINT_NAMES: tuple[str, ...] = ("time", "event", "target")


def _check_exact_ids(ids: pd.Series, labels_csv: Path) -> None:
    """Raise :class:`ManifestError` naming the row when a labels-file id holds a folder (``/``, ``\\``) or ``..``:
    ids are matched to the slide files' names exactly (only a file ending is taken off), never as paths."""
    for i, value in enumerate(ids.astype("string").fillna("")):
        if "/" in value or "\\" in value or ".." in value:
            raise ManifestError(
                f"{labels_csv}: row {i + 1} (line {i + 2}): slide_id '{value}' refused: it holds a path "
                f"({'..' if '..' in value else 'a folder separator'}); ids are matched to the slide files' names "
                "exactly (file name without its ending, e.g. a.svs -> a)")


def _read_labels(labels_csv: Path, columns: Mapping[str, str] | None = None) -> pd.DataFrame:
    """The labels CSV with ``slide_id`` and ``label`` columns (and ``time``/``event``/``target``), checked;
    other columns kept. ``label`` may be missing when the CSV has a survival or regression target."""
    df = read_table(labels_csv, what="labels CSV")
    rename = {}
    for name, col in (columns or {}).items():
        if name not in ENDPOINT_NAMES:
            raise ValueError(f"unknown endpoint column {name!r}; expected one of {list(ENDPOINT_NAMES)}")
        if col not in df.columns:
            raise ManifestError(f"{labels_csv}: no column {col!r} (asked for as the {name} column); found {list(df.columns)}")
        rename[col] = name
    df = df.rename(columns=rename)
    id_col = pick_column(df, SLIDE_ID_COLUMNS, source=labels_csv, what="slide id")
    df = df.rename(columns={id_col: "slide_id"})
    if any(c in df.columns for c in ENDPOINT_NAMES) and not any(c.lower() == "label" for c in df.columns):
        df["label"] = pd.NA  # a survival or regression cohort needs no class
    label_col = pick_column(df, ("label",), source=labels_csv, what="label")
    df = df.rename(columns={label_col: "label"})
    _check_exact_ids(df["slide_id"], labels_csv)
    df["slide_id"] = clean_slide_ids(df["slide_id"])
    if (df["slide_id"] == "").any():
        raise ManifestError(f"{labels_csv}: empty slide id in {int((df['slide_id'] == '').sum())} row(s)")
    if "split" in df.columns:
        check_one_split_per_slide(df, source=labels_csv)
    else:
        check_one_split_per_slide(df.assign(split=""), source=labels_csv)
    df["label"] = check_label_range(df, n_classes=None, source=labels_csv, column="label")
    if "split" in df.columns:
        check_patient_splits(df, source=labels_csv)
    if "path" in df.columns:
        warnings.warn(
            f"{labels_csv}: its 'path' column is ignored; paths come from the files found in the slides folder",
            ManifestWarning, stacklevel=3,
        )
        df = df.drop(columns="path")
    return df


def build_folder_manifest(
    slides_dir: str | os.PathLike, labels_csv: str | os.PathLike | None = None, *, cohort: str | None = None,
    columns: Mapping[str, str] | None = None, features: bool = False,
) -> pd.DataFrame:
    """Manifest of all slides under ``slides_dir`` (recursive), labelled from ``labels_csv`` when given.

    With ``features``, ``slides_dir`` is a folder of feature files instead (TRIDENT, CLAM, STAMP or ours:
    ``<slide_id>.h5``, CLAM's ``<slide_id>.pt``; a CLAM or TRIDENT output folder is looked into,
    :func:`wsi_pipeline.data.feature_formats.feature_folder`): each file is a slide, its ``path`` the file.

    Parameters
    ----------
    slides_dir : folder searched recursively for slide files (the finder's extensions,
        :data:`wsi_pipeline.slides.finder.SLIDE_EXTENSIONS`).
    labels_csv : optional CSV with a slide id column (``slide_id``, or ``image_id``/``filename``...;
        file endings are stripped) and a ``label`` column (integer class >= 0, empty = unlabelled).
        Its ``split``, ``cohort``, ``patient_id``, ``mpp``, ``time``, ``event``, ``target`` and any
        other columns are carried over; ``label`` may be left out when it has ``time``/``event`` or ``target``.
    cohort : cohort name; default the labels CSV's ``cohort`` column, else the folder's name.
    columns : endpoint columns named otherwise in the CSV, ``{"time": "os_months", "event": "dead"}``;
        they become the manifest's ``time``, ``event`` and ``target``.

    Returns
    -------
    Validated manifest frame, one row per slide file, absolute paths, in path order. Slides
    missing from the labels CSV are unlabelled; CSV rows without a slide file are dropped with a
    :class:`ManifestWarning` naming them.

    Raises
    ------
    FileNotFoundError
        ``slides_dir`` or ``labels_csv`` does not exist.
    ManifestError
        No slide files; two files with the same slide id; in the CSV: duplicate slide ids, a
        slide in two splits, a patient in two splits, a non-integer or negative label.
    """
    slides_dir = Path(slides_dir)
    if features:
        from wsi_pipeline.data.feature_formats import feature_folder, list_feature_files

        index = {p.stem: p.resolve() for p in list_feature_files(slides_dir)}
        if not index:
            raise ManifestError(f"no feature files (<slide_id>.h5, or CLAM's <slide_id>.pt) in {feature_folder(slides_dir)}")
    else:
        index = find_slides(slides_dir)
    if not index:
        raise ManifestError(no_slides_message(slides_dir))
    df = pd.DataFrame({"slide_id": pd.Series(list(index), dtype="string"), "path": [str(p) for p in index.values()]})
    if labels_csv is not None:
        labels_csv = Path(labels_csv)
        labels = _read_labels(labels_csv, columns)
        orphans = labels.loc[~labels["slide_id"].isin(df["slide_id"]), "slide_id"].tolist()
        if orphans:
            warnings.warn(
                f"{labels_csv}: {len(orphans)} labelled slide(s) have no file under {slides_dir} and are left out: "
                f"{first_few(orphans)}",
                ManifestWarning, stacklevel=2,
            )
        df = df.merge(labels, on="slide_id", how="left", validate="one_to_one")
        n_unlabelled = int(df["label"].isna().sum())
        if n_unlabelled:
            log.info("%d of %d slides have no label in %s (kept, unlabelled)", n_unlabelled, len(df), labels_csv)
    else:
        df["label"] = pd.array([pd.NA] * len(df), dtype="Int64")
    if "split" not in df.columns:
        df["split"] = ""
    default = cohort if cohort is not None else slides_dir.resolve().name
    if cohort is not None or "cohort" not in df.columns:
        df["cohort"] = default
    else:  # the CSV's cohort column, the folder's name for slides it does not list
        df["cohort"] = df["cohort"].astype("string").fillna("").replace("", default)
    df["split"] = df["split"].astype("string").fillna("")
    return finalise(df, source=labels_csv if labels_csv is not None else slides_dir, n_classes=None)
