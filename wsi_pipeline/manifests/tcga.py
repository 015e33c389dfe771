"""TCGA-PRAD (prostate resections) as an external test cohort, from a user-supplied grade CSV.

No grade file for TCGA-PRAD is public in a form this project can ship: the user supplies a CSV of
slide ids and grades. Every slide gets ``split = "test"`` and ``cohort = "tcga_prad"``: the cohort
is only ever evaluated, never trained on, and ``test`` keeps it out of any stage that selects
``train``/``val`` rows.

Grades: an ISUP grade 0-5 column (``isup_grade``, ``label`` or ``grade``), or a Gleason score
(``gleason_score`` as ``"4+3"``, or ``gleason_primary`` + ``gleason_secondary``) converted to
ISUP: <= 6 -> 1, 3+4 -> 2, 4+3 -> 3, 8 -> 4, 9-10 -> 5; ``0+0``/``negative`` -> 0.

Patients: a ``patient_id``/``case_id``/``case_submitter_id`` column, else the TCGA patient
barcode (``TCGA-XX-XXXX``) at the start of the slide id. The Big-Layers paper keeps one randomly
chosen slide per patient (``one_per_patient``).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.manifests.files import check_files_exist, find_slides, first_few
from wsi_pipeline.manifests.schema import ManifestError
from wsi_pipeline.manifests.sources import (
    SLIDE_ID_COLUMNS,
    ManifestWarning,
    check_label_range,
    check_unique_ids,
    clean_slide_ids,
    finalise,
    pick_column,
    read_table,
)

__all__ = ["ISUP_CLASSES", "gleason_to_isup", "build_tcga_prad_manifest"]

log = logging.getLogger(__name__)

ISUP_CLASSES = 6
_BARCODE = re.compile(r"^(TCGA-[A-Z0-9]{2}-[A-Z0-9]{4})", re.IGNORECASE)
_GRADE_COLUMNS = ("isup_grade", "label", "grade")
_PATIENT_COLUMNS = ("patient_id", "case_id", "case_submitter_id", "patient")


def gleason_to_isup(primary: int, secondary: int) -> int:
    """ISUP grade group of a Gleason pattern pair (0 + 0 = benign -> 0).

    Raises
    ------
    ValueError
        A pattern outside 0-5, or a benign pattern mixed with a cancer pattern.
    """
    p, s = int(primary), int(secondary)
    if not (0 <= p <= 5 and 0 <= s <= 5) or (p == 0) != (s == 0):
        raise ValueError(f"Gleason {p}+{s}: patterns must both be 1-5 (or 0+0 for benign)")
    total = p + s
    if total == 0:
        return 0
    if total <= 6:
        return 1
    if total == 7:
        return 2 if p <= 3 else 3
    return 4 if total == 8 else 5


def _gleason_labels(df: pd.DataFrame, ids: pd.Series, source: Path) -> pd.Series:
    """ISUP labels from a ``gleason_score`` column or primary/secondary pattern columns."""
    lower = {c.lower(): c for c in df.columns}
    if "gleason_score" in lower:
        text = df[lower["gleason_score"]].astype("string").fillna("").str.strip().str.lower()
        text = text.replace({"negative": "0+0", "benign": "0+0"})
        parts = text.str.extract(r"^(\d)\s*\+\s*(\d)$")
        column = lower["gleason_score"]
    elif "gleason_primary" in lower and "gleason_secondary" in lower:
        parts = pd.concat([df[lower["gleason_primary"]], df[lower["gleason_secondary"]]], axis=1)
        parts.columns = [0, 1]
        column = "gleason_primary/gleason_secondary"
    else:
        raise ValueError(
            f"{source}: no grade column; expected one of {list(_GRADE_COLUMNS)} (ISUP 0-5), gleason_score ('4+3'), "
            f"or gleason_primary + gleason_secondary; found {list(df.columns)}"
        )
    out = []
    for sid, (p, s) in zip(ids, parts.itertuples(index=False)):
        try:
            out.append(gleason_to_isup(int(p), int(s)))
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{source}: slide {sid}: cannot read a Gleason score from column {column} ({e})") from e
    return pd.Series(out, index=df.index, dtype="Int64")


def _match_files(ids: pd.Series, slides_dir: Path) -> list[str]:
    """Path of each slide id: a file whose stem equals the id, else whose stem up to the first '.' does
    (TCGA files are ``<barcode>.<uuid>.svs``); ``slides_dir/<id>.svs`` when none is found."""
    index = find_slides(slides_dir) if slides_dir.is_dir() else {}
    by_barcode: dict[str, list[Path]] = {}
    for stem, path in index.items():
        by_barcode.setdefault(stem.split(".", 1)[0], []).append(path)
    out = []
    for sid in ids:
        if sid in index:
            out.append(str(index[sid]))
        elif len(by_barcode.get(sid, [])) == 1:
            out.append(str(by_barcode[sid][0]))
        elif len(by_barcode.get(sid, [])) > 1:
            raise ManifestError(
                f"{slides_dir}: slide id {sid} matches {len(by_barcode[sid])} files ({first_few(by_barcode[sid], 3)}); "
                "use the full file stem as slide id"
            )
        else:
            out.append(str(slides_dir.absolute() / f"{sid}.svs"))
    return out


def build_tcga_prad_manifest(
    labels_csv: str | os.PathLike,
    slides_dir: str | os.PathLike,
    *,
    one_per_patient: bool = False,
    seed: int = 0,
    check_files: bool = True,
) -> pd.DataFrame:
    """Build the TCGA-PRAD external-cohort manifest (cohort ``tcga_prad``, split ``test``, ISUP 0-5).

    Parameters
    ----------
    labels_csv : user CSV with a slide id column (``slide_id``, ``filename``...; endings stripped)
        and a grade (see the module docstring). Other columns are kept, except ``path`` and ``split``.
    slides_dir : folder searched recursively for the slide files; paths are written absolute.
    one_per_patient : keep one randomly chosen slide per patient (seeded), as the paper does.
    seed : seed of that choice.
    check_files : raise when slide files are missing.

    Raises
    ------
    ManifestError
        Duplicate slide ids, grades outside 0-5 or unreadable Gleason scores.
    """
    labels_csv, slides_dir = Path(labels_csv), Path(slides_dir)
    df = read_table(labels_csv, what="TCGA-PRAD labels")
    id_col = pick_column(df, SLIDE_ID_COLUMNS, source=labels_csv, what="slide id")
    df = df.rename(columns={id_col: "slide_id"})
    df["slide_id"] = clean_slide_ids(df["slide_id"])
    check_unique_ids(df["slide_id"], source=labels_csv, column=id_col)
    lower = {c.lower(): c for c in df.columns}
    grade_col = next((lower[c] for c in _GRADE_COLUMNS if c in lower), None)
    if grade_col is not None:
        labels = check_label_range(df, n_classes=ISUP_CLASSES, source=labels_csv, column=grade_col)
        df = df.drop(columns=grade_col)
    else:
        labels = _gleason_labels(df, df["slide_id"], labels_csv)
    unlabelled = df.loc[labels.isna(), "slide_id"]
    if len(unlabelled):
        raise ManifestError(f"{labels_csv}: no grade for slide(s) {first_few(unlabelled)}; an external test cohort needs labels")
    df["label"] = labels
    for col in ("path", "split"):
        if col in df.columns:
            warnings.warn(f"{labels_csv}: column {col!r} ignored (paths come from --slides; the cohort is all test)",
                          ManifestWarning, stacklevel=2)
            df = df.drop(columns=col)
    pcol = next((lower[c] for c in _PATIENT_COLUMNS if c in lower), None)
    if pcol is not None:
        df = df.rename(columns={pcol: "patient_id"})
    else:
        df["patient_id"] = df["slide_id"].str.extract(_BARCODE, expand=False).str.upper().fillna("")
    if one_per_patient:
        rng = np.random.default_rng(seed)
        keep: list[int] = []
        for pid, rows in df.groupby("patient_id", sort=True):
            rows = rows.sort_values("slide_id")
            keep.extend(rows.index if pid == "" else [rows.index[rng.integers(len(rows))]])
        log.info("one slide per patient: %d of %d slides kept", len(keep), len(df))
        df = df.loc[sorted(keep)]
    df["split"] = "test"
    df["cohort"] = "tcga_prad"
    df["path"] = _match_files(df["slide_id"], slides_dir)
    if check_files:
        check_files_exist(df["slide_id"].tolist(), df["path"].tolist(), root=slides_dir)
    return finalise(df.reset_index(drop=True), source=labels_csv, n_classes=ISUP_CLASSES)
