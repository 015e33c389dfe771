"""Draw train/val/test splits and cross-validation folds for a manifest that has none.

For a user's own cohort: the labels file names slides and labels (and, when known, patients);
this module decides which slides train, validate and test. Splits are label-stratified and
patient-grouped: every slide of a patient lands in one split (a patient's slides in two splits
leak), and the label mix of each split follows the cohort's. Patients are stratified by the
label of their slides (the highest label when they differ, i.e. the patient's worst slide).

Rows whose ``split`` is already set are kept as they are, and their patients stay where they are;
only unlabelled-split rows are drawn, so a user can pin an external test set and draw the rest.
Unlabelled slides (empty ``label``) are left without a split: nothing can be trained or scored
on them.

Folds: with ``folds=K`` the test split is drawn first with its fraction; the remaining patients
are cut into K label-stratified groups; fold ``k`` validates on group ``k`` and trains on the
others, so every non-test slide validates exactly once across the folds. When every labelled slide
already has a split (a manifest drawn before), its test split is kept and its train and val slides
are cut into the folds. (Cross-validation in which every slide is *tested* once:
:mod:`wsi_pipeline.manifests.crossval`.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import pandas as pd

from wsi_pipeline.manifests.splits import normalise_fractions, stratified_split

__all__ = ["parse_fractions", "assign_splits", "fold_manifests", "duplicate_files", "patient_of", "has_target",
           "pinned_splits"]

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "val", "test")


def parse_fractions(text: str) -> dict[str, float]:
    """``"0.6,0.2,0.2"`` -> ``{"train": 0.6, "val": 0.2, "test": 0.2}`` (scaled to sum to 1).

    Raises
    ------
    ValueError
        Not three comma-separated non-negative numbers.
    """
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError as e:
        raise ValueError(f"--split {text!r}: expected three numbers train,val,test such as 0.6,0.2,0.2") from e
    if len(values) != 3:
        raise ValueError(f"--split {text!r}: expected three numbers train,val,test such as 0.6,0.2,0.2, got {len(values)}")
    return normalise_fractions(dict(zip(SPLIT_NAMES, values)), what=f"--split {text!r}")


def patient_of(df: pd.DataFrame) -> pd.Series:
    """Patient of each row: the ``patient_id`` column where set, else the slide itself."""
    slide = df["slide_id"].astype("string")
    if "patient_id" not in df.columns:
        return slide
    patient = df["patient_id"].astype("string").fillna("").str.strip()
    return patient.mask(patient == "", "slide:" + slide)


def has_target(df: pd.DataFrame) -> pd.Series:
    """Rows with a label, a survival target (time and event) or a regression target."""
    has = df["label"].notna()
    if "time" in df.columns and "event" in df.columns:
        has |= df["time"].notna() & df["event"].notna()
    if "target" in df.columns:
        has |= df["target"].notna()
    return has


def pinned_splits(df: pd.DataFrame, patients: pd.Series | None = None) -> pd.Series:
    """The ``split`` column as stripped strings, a patient's unsplit slides following its pinned ones.

    Raises
    ------
    ValueError
        A patient whose slides are pinned to two different splits.
    """
    patients = patient_of(df) if patients is None else patients
    split = df["split"].astype("string").fillna("").str.strip() if "split" in df.columns else pd.Series("", index=df.index, dtype="string")
    pinned = split != ""
    pinned_of = split[pinned].groupby(patients[pinned].to_numpy()).unique()
    clash = {p: sorted(map(str, s)) for p, s in pinned_of.items() if len(s) > 1}
    if clash:
        raise ValueError(f"patients with slides in several splits: {dict(list(clash.items())[:5])}; a patient belongs to one split")
    follow = patients.map({p: str(s[0]) for p, s in pinned_of.items()}).astype("string").fillna("")
    return split.mask(~pinned & (follow != ""), follow)


def _patient_strata(df: pd.DataFrame, patients: pd.Series) -> dict[str, int]:
    """Patient -> highest label among the patient's slides (survival cohorts without labels: the event)."""
    labels = pd.to_numeric(df["label"], errors="coerce")
    if labels.isna().all() and "event" in df.columns:
        labels = pd.to_numeric(df["event"], errors="coerce")
    labels = labels.fillna(0)
    return {str(p): int(v) for p, v in labels.groupby(patients.to_numpy()).max().items()}


def assign_splits(
    df: pd.DataFrame, fractions: Mapping[str, float], *, seed: int = 0, folds: int | None = None
) -> pd.DataFrame:
    """Return a copy of manifest ``df`` with ``split`` drawn for labelled slides that have none.

    Parameters
    ----------
    df : manifest frame (``slide_id``, ``label``, ``split``, optional ``patient_id``).
    fractions : ``{"train": f, "val": f, "test": f}`` (sums to 1), fractions of patients.
    seed : seed of the draw; the result does not depend on the row order.
    folds : when given (>= 2), also add an integer ``fold`` column (``0..K-1`` for non-test
        labelled slides, -1 otherwise); ``split`` then holds only ``test`` and, for the other
        drawn slides, ``train`` (use :func:`fold_manifests` to get one manifest per fold).

    Raises
    ------
    ValueError
        ``folds`` < 2; a patient with slides already in two splits; more folds than patients.
    """
    fr = normalise_fractions(fractions, what="split fractions")
    if folds is not None and folds < 2:
        raise ValueError(f"folds={folds}: cross-validation needs at least 2 folds")
    out = df.copy()
    labelled = has_target(out)
    patients = patient_of(out)
    split = pinned_splits(out, patients)
    todo = labelled & (split == "")
    if folds is not None and not todo.any() and labelled.any():
        # every labelled slide already has a split (e.g. a manifest drawn before): keep its test split
        # and cut the train and val slides into the folds, instead of writing no fold at all
        redraw = labelled & split.isin(["train", "val"])
        if not redraw.any():
            raise ValueError(f"folds={folds}: every labelled slide is pinned to the test split; there is nothing to "
                             "cut into folds (use --redraw to draw the test split and the folds anew)")
        log.info("folds=%d: the %d train/val slide(s) are cut into folds; the %d test slide(s) keep their split",
                 folds, int(redraw.sum()), int((labelled & (split == "test")).sum()))
        split = split.mask(redraw, "")
        todo = redraw
        fr = {"train": 1.0, "val": 0.0, "test": 0.0}
    if todo.any():
        sub = out[todo]
        pats = patients[todo]
        strata = _patient_strata(sub, pats)
        uniq = sorted(strata)
        if folds is None:
            drawn = dict(zip(uniq, stratified_split(uniq, [strata[p] for p in uniq], fr, seed=seed)))
            split = split.mask(todo, pats.map(drawn))
        else:
            test_fr = fr["test"]
            first = dict(zip(uniq, stratified_split(
                uniq, [strata[p] for p in uniq], {"test": test_fr, "rest": 1.0 - test_fr}, seed=seed)))
            rest = [p for p in uniq if first[p] == "rest"]
            if len(rest) < folds:
                raise ValueError(f"folds={folds}: only {len(rest)} patient(s) left after the test split; use fewer folds")
            fold_of = dict(zip(rest, stratified_split(
                rest, [strata[p] for p in rest], {str(k): 1.0 / folds for k in range(folds)}, seed=seed + 1)))
            split = split.mask(todo, pats.map(lambda p: "test" if first[p] == "test" else "train"))
            fold = pats.map(lambda p: int(fold_of[p]) if p in fold_of else -1)
            out["fold"] = pd.Series(-1, index=out.index, dtype="int64")
            out.loc[todo, "fold"] = fold.astype("int64")
    elif folds is not None:
        out["fold"] = pd.Series(-1, index=out.index, dtype="int64")
    out["split"] = split.astype("string")
    n_left = int((~labelled & (split == "")).sum())
    if n_left:
        log.info("%d unlabelled slide(s) left without a split (usable by predict only)", n_left)
    return out


def fold_manifests(df: pd.DataFrame) -> list[pd.DataFrame]:
    """One manifest per fold of a frame from ``assign_splits(..., folds=K)``.

    In manifest ``k`` the slides of fold ``k`` are ``val``, those of other folds ``train``; test
    and pinned splits are unchanged; the ``fold`` column is kept for reference.
    """
    if "fold" not in df.columns:
        raise ValueError("manifest has no 'fold' column; draw folds with assign_splits(..., folds=K) first")
    folds = sorted(int(f) for f in df["fold"].unique() if int(f) >= 0)
    out = []
    for k in folds:
        m = df.copy()
        in_cv = m["fold"].astype(int) >= 0
        m.loc[in_cv, "split"] = np.where(m.loc[in_cv, "fold"].astype(int) == k, "val", "train")
        m["split"] = m["split"].astype("string")
        out.append(m)
    return out


def duplicate_files(df: pd.DataFrame) -> list[list[str]]:
    """Groups of slide ids that point to the same file: same resolved path or same content fingerprint.

    The fingerprint is the file size plus a hash of its first MiB
    (:func:`wsi_pipeline.slides.fingerprint.slide_fingerprint`), so two copies of one slide under
    different names are found without reading whole slides. Folders (DICOM) are compared by path.
    """
    from pathlib import Path

    from wsi_pipeline.slides.fingerprint import slide_fingerprint

    keys: dict[str, list[str]] = {}
    for sid, path in zip(df["slide_id"].astype(str), df["path"].astype(str)):
        p = Path(path)
        try:
            key = slide_fingerprint(p) if p.is_file() else f"path:{p.resolve()}"
        except OSError:
            key = f"path:{p.resolve()}"
        keys.setdefault(key, []).append(sid)
    return [sorted(ids) for ids in keys.values() if len(ids) > 1]
