"""The manifest CSV: one row per slide.

Columns (see ``data_manifests/README.md``): ``slide_id`` (unique), ``path`` (absolute or relative
to the manifest file), ``label`` (integer class, empty for unlabelled), ``split`` (train/val/test
or empty), ``cohort``; optional ``patient_id`` and ``mpp`` (um/px, overrides the slide's own);
optional endpoint columns ``time`` (follow-up time >= 0, any unit) and ``event`` (1 = event
observed, 0 = censored) for survival, ``target`` (a number) for regression; any extra column is
kept and passed through. Survival and regression targets belong to the patient: every slide of a
``patient_id`` must carry the same ``time``, ``event`` and ``target``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.slide_ids import SlideIdError, check_slide_id, slide_id_problem

__all__ = ["MANIFEST_COLUMNS", "SPLITS", "ManifestError", "read_manifest", "validate_manifest", "write_manifest"]

MANIFEST_COLUMNS: tuple[str, ...] = ("slide_id", "path", "label", "split", "cohort")
OPTIONAL_COLUMNS: tuple[str, ...] = ("patient_id", "mpp", "time", "event", "target")
#: Patient-level endpoint columns: survival (``time``, ``event``) and regression (``target``).
ENDPOINT_COLUMNS: tuple[str, ...] = ("time", "event", "target")
SPLITS: tuple[str, ...] = ("train", "val", "test")
#: Columns holding file paths, resolved relative to the manifest by :func:`read_manifest`.
PATH_COLUMNS: tuple[str, ...] = ("path", "lesion_mask")


class ManifestError(ValueError):
    """A manifest that breaks the schema; the message names the file, the field and the rows."""


def first_few(values: Any, k: int = 5) -> str:
    """The first ``k`` values, comma-separated, and how many more there are: a warning about 100k ids stays one short line."""
    values = list(values)
    more = f" (and {len(values) - k} more)" if len(values) > k else ""
    return ", ".join(map(str, values[:k])) + more


_first = first_few


def validate_manifest(df: pd.DataFrame, *, source: str = "<manifest>", n_classes: int | None = None) -> pd.DataFrame:
    """Check ``df`` against the schema and return it normalised.

    Normalised means: ``label`` is a nullable integer column, ``split``/``cohort``/``patient_id``
    are strings with ``""`` for missing, ``mpp`` is float (NaN for missing).

    Raises :class:`ManifestError` naming ``source`` for: missing columns, empty or duplicate
    slide ids, ids that break :func:`wsi_pipeline.slide_ids.check_slide_id` (with the line),
    non-integer labels, labels outside ``[0, n_classes)``, unknown split values,
    a patient in two splits, non-positive mpp, negative times, events other than 0/1, a time
    without an event (or the reverse), non-numeric targets, and a patient whose slides disagree
    on ``time``, ``event`` or ``target``.
    """
    missing = [c for c in ("slide_id", "path") if c not in df.columns]
    if missing:
        raise ManifestError(
            f"{source}: missing column(s) {missing}; a manifest needs {list(MANIFEST_COLUMNS)} "
            f"(label, split, cohort may be empty), found {list(df.columns)}"
        )
    df = df.copy()
    for col in ("label", "split", "cohort"):
        if col not in df.columns:
            df[col] = pd.NA if col == "label" else ""
    df["slide_id"] = df["slide_id"].astype("string")
    empty = df.index[df["slide_id"].isna() | (df["slide_id"].str.strip() == "")].tolist()
    if empty:
        raise ManifestError(f"{source}: empty slide_id in row(s) {_first(i + 2 for i in empty)} (line numbers)")
    for line, sid in zip(range(2, len(df) + 2), df["slide_id"]):  # ids are names, never paths
        if slide_id_problem(sid) is not None:
            try:
                check_slide_id(sid, where=f"{source}, line {line}")
            except SlideIdError as e:
                raise ManifestError(str(e)) from None
    dup = df["slide_id"][df["slide_id"].duplicated()].unique().tolist()
    if dup:
        raise ManifestError(f"{source}: duplicate slide_id {_first(dup)}; slide ids must be unique")
    df["path"] = df["path"].astype("string")

    raw = df["label"]
    numeric = pd.to_numeric(raw, errors="coerce")
    bad = df["slide_id"][raw.notna() & (raw.astype("string").str.strip() != "") & (numeric.isna() | (numeric % 1 != 0))]
    if len(bad):
        raise ManifestError(f"{source}: label is not an integer class for slide(s) {_first(bad)}; found {_first(raw[bad.index])}")
    df["label"] = numeric.astype("Int64")
    if n_classes is not None:
        out = df[df["label"].notna() & ((df["label"] < 0) | (df["label"] >= n_classes))]
        if len(out):
            raise ManifestError(
                f"{source}: label outside [0, {n_classes}) for slide(s) {_first(out['slide_id'])} "
                f"(labels {_first(out['label'])}); check n_classes or the label column"
            )

    for col in ("split", "cohort", "patient_id"):
        if col in df.columns:
            df[col] = df[col].astype("string").fillna("").str.strip()
    bad_split = df[~df["split"].isin(SPLITS + ("",))]
    if len(bad_split):
        raise ManifestError(
            f"{source}: split must be one of {list(SPLITS)} or empty; slide(s) {_first(bad_split['slide_id'])} "
            f"have {_first(bad_split['split'].unique())}"
        )
    if "patient_id" in df.columns:
        has = df[(df["patient_id"] != "") & (df["split"] != "")]
        n_splits = has.groupby("patient_id")["split"].nunique()
        leaked = n_splits[n_splits > 1].index.tolist()
        if leaked:
            raise ManifestError(f"{source}: patient(s) {_first(leaked)} appear in more than one split (a leaked split)")
    _check_endpoints(df, source)
    if "mpp" in df.columns:
        df["mpp"] = pd.to_numeric(df["mpp"], errors="coerce")
        bad_mpp = df[df["mpp"].notna() & (df["mpp"] <= 0)]
        if len(bad_mpp):
            raise ManifestError(f"{source}: mpp must be > 0 um/px; slide(s) {_first(bad_mpp['slide_id'])}")
    return df


def _numeric(df: pd.DataFrame, col: str, source: str, expected: str) -> pd.Series:
    """Column ``col`` as float (NaN for empty cells); ``ManifestError`` naming the slides whose value is not a number."""
    raw = df[col]
    text = raw.astype("string").str.strip()
    value = pd.to_numeric(raw, errors="coerce")
    bad = df["slide_id"][text.notna() & (text != "") & value.isna()]
    if len(bad):
        raise ManifestError(f"{source}: {col} is not a number for slide(s) {_first(bad)}; found {_first(raw[bad.index])} "
                            f"(expected {expected})")
    value = value.astype("float64")
    infinite = df["slide_id"][np.isinf(value.to_numpy())]
    if len(infinite):  # inf parses as a number: a follow-up time or target of inf would skew every metric silently
        raise ManifestError(f"{source}: {col} is not finite for slide(s) {_first(infinite)}; found "
                            f"{_first(raw[infinite.index])} (expected {expected}, finite)")
    return value


def _check_endpoints(df: pd.DataFrame, source: str) -> None:
    """Normalise and check ``time``, ``event`` and ``target`` in place (see the module docstring)."""
    if "time" in df.columns:
        df["time"] = _numeric(df, "time", source, "a follow-up time >= 0")
        neg = df[df["time"] < 0]
        if len(neg):
            raise ManifestError(f"{source}: negative time for slide(s) {_first(neg['slide_id'])} ({_first(neg['time'])}); "
                                "expected a follow-up time >= 0")
    if "event" in df.columns:
        ev = _numeric(df, "event", source, "1 = event observed, 0 = censored")
        bad = df[ev.notna() & ~ev.isin([0.0, 1.0])]
        if len(bad):
            raise ManifestError(f"{source}: event must be 0 (censored) or 1 (event observed); slide(s) "
                                f"{_first(bad['slide_id'])} have {_first(ev[bad.index])}")
        df["event"] = ev.astype("Int64")
    if "time" in df.columns and "event" in df.columns:
        half = df[df["time"].isna() != df["event"].isna()]
        if len(half):
            raise ManifestError(f"{source}: slide(s) {_first(half['slide_id'])} have only one of time and event; "
                                "give both (a survival target) or neither")
    if "target" in df.columns:
        df["target"] = _numeric(df, "target", source, "a number")
    if "patient_id" not in df.columns:
        return
    for col in ENDPOINT_COLUMNS:
        if col not in df.columns:
            continue
        rows = df[(df["patient_id"] != "") & df[col].notna()]
        n_values = rows.groupby("patient_id")[col].nunique()
        odd = n_values[n_values > 1].index.tolist()
        if odd:
            examples = "; ".join(f"{p}: {sorted(set(rows.loc[rows['patient_id'] == p, col].tolist()))}" for p in odd[:3])
            raise ManifestError(f"{source}: the slides of patient(s) {_first(odd)} disagree on {col} ({examples}); "
                                f"{col} belongs to the patient, so every slide of a patient needs the same value")


def read_manifest(path: str | os.PathLike, *, n_classes: int | None = None) -> pd.DataFrame:
    """Read and validate a manifest CSV.

    Relative entries of the file columns (``path`` and, for synthetic cohorts, ``lesion_mask``)
    become absolute, relative to the manifest's folder.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found: {path}")
    df = pd.read_csv(path, dtype={"slide_id": "string", "split": "string", "cohort": "string", "patient_id": "string"}, keep_default_na=True)
    df = validate_manifest(df, source=str(path), n_classes=n_classes)
    base = path.resolve().parent
    for col in PATH_COLUMNS:
        if col in df.columns:
            df[col] = [p if (not p or os.path.isabs(p)) else str(base / p) for p in df[col].astype("string").fillna("")]
    return df


def write_manifest(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Validate ``df`` and write it atomically to ``path`` (temp file, then rename)."""
    path = Path(path)
    df = validate_manifest(df, source=str(path))
    cols = list(MANIFEST_COLUMNS) + [c for c in df.columns if c not in MANIFEST_COLUMNS]
    with atomic_path(path) as tmp:
        df[cols].to_csv(tmp, index=False)
    return path
