"""Reading the cohorts' own label and split files, and the checks every builder runs on them.

The public cohorts publish their labels in different shapes (``image_id`` vs ``FILENAME`` vs
``filenames`` with ``.tif.npy`` endings, booleans vs ``Tumor``/``Normal``); these helpers find
the columns by their known names, normalise slide ids, and raise errors that name the file, the
column and the rows, with the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from wsi_pipeline.slides.finder import SLIDE_EXTENSIONS
from wsi_pipeline.manifests.files import first_few
from wsi_pipeline.manifests.schema import MANIFEST_COLUMNS, OPTIONAL_COLUMNS, ManifestError, validate_manifest

__all__ = [
    "ManifestWarning",
    "SLIDE_ID_COLUMNS",
    "read_table",
    "pick_column",
    "clean_slide_ids",
    "check_unique_ids",
    "check_label_range",
    "check_one_split_per_slide",
    "check_patient_splits",
    "finalise",
]

#: Column names that hold slide ids in the cohorts' files, in order of preference.
SLIDE_ID_COLUMNS: tuple[str, ...] = (
    "slide_id", "image_id", "FILENAME", "filename", "filenames", "file_name", "slide_name", "slide", "image",
)
#: Endings stripped from slide ids in label files (``normal_001.tif.npy`` -> ``normal_001``).
_ID_SUFFIXES: tuple[str, ...] = SLIDE_EXTENSIONS + (".npy", ".h5", ".pt", ".zarr")


class ManifestWarning(UserWarning):
    """A recoverable oddity in a cohort's files (a label overridden, a slide left out)."""


def read_table(path: str | os.PathLike, *, what: str, header: int | None = 0) -> pd.DataFrame:
    """Read a CSV as strings (no type guessing), naming ``what`` it is in errors.

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        The file has no rows or cannot be parsed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, header=header, skipinitialspace=True)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: not a readable CSV ({e}); expected a comma-separated file with a header row") from e
    if df.empty:
        raise ValueError(f"{what} {path}: no rows; expected one row per slide")
    if header is not None:
        df.columns = [str(c).strip() for c in df.columns]
    df = df.apply(lambda c: c.str.strip())
    return df.drop(columns=[c for c in df.columns if str(c).startswith("Unnamed: ")])


def pick_column(df: pd.DataFrame, candidates: Sequence[str], *, source: str | os.PathLike, what: str) -> str:
    """The first of ``candidates`` present in ``df`` (case-insensitive); error listing both otherwise."""
    lower = {str(c).lower(): c for c in df.columns}
    for c in candidates:
        if c.lower() in lower:
            return lower[c.lower()]
    raise ValueError(
        f"{source}: no {what} column; expected one of {list(candidates)}, found {list(df.columns)}; "
        "rename the column or check that this is the right file"
    )


def clean_slide_ids(ids: pd.Series) -> pd.Series:
    """Slide ids without folders and file endings: ``a/normal_001.tif.npy`` -> ``normal_001``."""

    def clean(s: str) -> str:
        s = str(s).strip().replace("\\", "/").rsplit("/", 1)[-1]
        changed = True
        while changed:
            changed = False
            for ext in _ID_SUFFIXES:
                if s.lower().endswith(ext) and len(s) > len(ext):
                    s, changed = s[: -len(ext)], True
        return s

    return ids.astype("string").fillna("").map(clean).astype("string")


def check_unique_ids(ids: pd.Series, *, source: str | os.PathLike, column: str = "slide_id") -> None:
    """Raise :class:`ManifestError` for empty or repeated slide ids in one file."""
    empty = ids.index[ids.isna() | (ids == "")]
    if len(empty):
        raise ManifestError(f"{source}: empty {column} in {len(empty)} row(s); every row needs a slide id")
    dup = ids[ids.duplicated()].unique().tolist()
    if dup:
        raise ManifestError(
            f"{source}: duplicate slide id(s) {first_few(dup)} in column {column}; each slide must appear once "
            "(remove the repeated rows)"
        )


def check_label_range(
    df: pd.DataFrame, *, n_classes: int | None, source: str | os.PathLike, column: str, id_column: str = "slide_id"
) -> pd.Series:
    """Parse ``df[column]`` as integer labels in ``[0, n_classes)`` (empty allowed); return them as Int64.

    ``n_classes=None`` only requires labels >= 0.
    """
    raw = df[column].astype("string").fillna("").str.strip()
    num = pd.to_numeric(raw.where(raw != ""), errors="coerce")
    bad = df.loc[(raw != "") & (num.isna() | (num % 1 != 0)), id_column]
    if len(bad):
        raise ManifestError(
            f"{source}: column {column} must hold integer classes; slide(s) {first_few(bad)} have "
            f"{first_few(raw[bad.index])}"
        )
    hi = n_classes if n_classes is not None else float("inf")
    out = df.loc[num.notna() & ((num < 0) | (num >= hi)), id_column]
    if len(out):
        expected = f"[0, {n_classes})" if n_classes is not None else ">= 0"
        raise ManifestError(
            f"{source}: label out of range {expected} in column {column} for slide(s) {first_few(out)} "
            f"(values {first_few(raw[out.index])}); check that this is the right label file"
        )
    return num.astype("Int64")


def _where(per: pd.Series) -> list[str]:
    """``["a (train and test)", ...]`` from a Series of id -> sorted list of splits."""
    return [f"{k} ({' and '.join(map(str, v))})" for k, v in per.items()]


def check_one_split_per_slide(listing: pd.DataFrame, *, source: str | os.PathLike, where: str = "split") -> None:
    """``listing`` has one row per (slide_id, split) mention; raise when a slide is in two splits.

    ``where`` names the column that tells where each mention came from (the split or the file).
    """
    per = listing.groupby("slide_id")[where].agg(lambda s: sorted(set(s)))
    two = per[per.map(len) > 1]
    if len(two):
        raise ManifestError(
            f"{source}: {len(two)} slide(s) in more than one split: "
            f"{first_few(_where(two))}; a slide may belong to one split only"
        )
    dup = listing["slide_id"][listing["slide_id"].duplicated()].unique().tolist()
    if dup:
        raise ManifestError(f"{source}: duplicate slide id(s) {first_few(dup)}; each slide must appear once")


def check_patient_splits(df: pd.DataFrame, *, source: str | os.PathLike) -> None:
    """Raise when a patient's slides fall in more than one split (a leaked split)."""
    if "patient_id" not in df.columns:
        return
    has = df[(df["patient_id"].astype("string").fillna("") != "") & (df["split"].astype("string").fillna("") != "")]
    per = has.groupby("patient_id")["split"].agg(lambda s: sorted(set(s)))
    two = per[per.map(len) > 1]
    if len(two):
        raise ManifestError(
            f"{source}: patient(s) in more than one split (a leaked split): "
            f"{first_few(_where(two))}; "
            "put all slides of a patient in the same split"
        )


def finalise(df: pd.DataFrame, *, source: str | os.PathLike, n_classes: int | None) -> pd.DataFrame:
    """Run the checks above and the schema's validation; return the normalised manifest frame."""
    check_unique_ids(df["slide_id"], source=source)
    check_patient_splits(df, source=source)
    out = validate_manifest(df.reset_index(drop=True), source=str(source), n_classes=n_classes)
    first = [c for c in MANIFEST_COLUMNS + OPTIONAL_COLUMNS if c in out.columns]
    return out[first + [c for c in out.columns if c not in first]]
