"""Cross-validation in which every slide is tested once: K folds, optionally repeated R times.

``wsi-pipeline manifest folder|split --crossval K [--repeats R] [--seed S] --out M.csv`` cuts the
labelled slides into K folds per repeat with scikit-learn's ``StratifiedGroupKFold``: the label
mix of each fold follows the cohort's (survival cohorts: the event; regression: no strata) and
every slide of a ``patient_id`` lands in one fold. In repeat ``r``, fold ``k`` is the test split,
fold ``k+1 (mod K)`` the validation split (model selection) and the other K-2 folds train, so
across the K manifests of a repeat every slide is tested exactly once.

What is written:

- ``M.csv``: the manifest with one integer column per repeat, ``cv_fold_r<r>`` (the fold in which
  the slide is tested in repeat ``r``; ``-1`` for slides outside the cross-validation);
- ``M_fold<k>.csv`` (one repeat) or ``M_r<r>_fold<k>.csv`` (several): the manifest of repeat ``r``,
  fold ``k``, with ``split`` set to test / val / train as above.

Which slides are cross-validated: every slide with a label (or a survival / regression target)
except those of an *external cohort*, a ``cohort`` whose labelled slides are all pinned to
``test`` (as ``eval`` defines it: such slides stay ``test`` in every fold, so every fold's model
scores them too). Input ``train``/``val``/``test`` splits of the other cohorts are replaced by the
folds; unlabelled slides stay without a split. Folds are fixed by the seed and do not depend on
the order of the input rows.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.manifests.assign import has_target, patient_of, pinned_splits

__all__ = ["CV_COLUMN", "assign_crossval", "crossval_columns", "crossval_manifests", "crossval_manifest_path"]

log = logging.getLogger(__name__)

#: Prefix of the per-repeat fold columns: ``cv_fold_r0``, ``cv_fold_r1``, ...
CV_COLUMN = "cv_fold_r"
_CV_RE = re.compile(rf"^{CV_COLUMN}(\d+)$")


def crossval_columns(columns) -> list[str]:
    """The ``cv_fold_r<r>`` columns among ``columns``, ordered by repeat."""
    found = [(int(m.group(1)), c) for c in map(str, columns) if (m := _CV_RE.match(c))]
    return [c for _, c in sorted(found)]


def crossval_manifest_path(manifest: str | os.PathLike, fold: int, repeat: int = 0, repeats: int = 1) -> Path:
    """``M_fold<k>.csv`` (``repeats == 1``) or ``M_r<r>_fold<k>.csv`` beside manifest ``M.csv``."""
    m = Path(manifest)
    tag = f"fold{int(fold)}" if int(repeats) == 1 else f"r{int(repeat)}_fold{int(fold)}"
    return m.with_name(f"{m.stem}_{tag}{m.suffix}")


def _strata(df: pd.DataFrame) -> np.ndarray:
    """Stratum of each slide: its label; survival without labels: the event; otherwise one stratum."""
    labels = pd.to_numeric(df["label"], errors="coerce") if "label" in df.columns else pd.Series(np.nan, index=df.index)
    if labels.isna().all() and "event" in df.columns:
        labels = pd.to_numeric(df["event"], errors="coerce")
    return labels.fillna(-1).astype(np.int64).to_numpy()


def _check_classes(sub: pd.DataFrame, folds: int, source: str | os.PathLike | None) -> None:
    """Refuse a cross-validation whose labelled slides are all of one class (no fold could be scored)."""
    if "label" not in sub.columns:
        return
    labels = pd.to_numeric(sub["label"], errors="coerce").dropna()
    classes = sorted({int(v) for v in labels})
    if len(labels) and len(classes) < 2:
        where = f"{source}: " if source is not None else ""
        raise ValueError(f"{where}--crossval {folds}: every one of the {len(labels)} labelled slide(s) is of one class "
                         f"(label {classes[0]}); cross-validation needs at least two classes (each fold's test split is "
                         "scored against both); check the label column or add slides of another class")


def assign_crossval(df: pd.DataFrame, folds: int, *, repeats: int = 1, seed: int = 0,
                    source: str | os.PathLike | None = None) -> pd.DataFrame:
    """Return a copy of manifest ``df`` with the columns ``cv_fold_r0 .. cv_fold_r<R-1>``.

    Parameters
    ----------
    df : manifest frame (``slide_id``, ``label`` or survival/regression columns, optional ``split``,
        ``patient_id``).
    folds : K >= 3 (fold k tests, fold k+1 validates, at least one fold trains).
    repeats : R >= 1 independent cuts (repeat r is drawn with a seed derived from ``seed`` and r).
    seed : seed of the draw.
    source : the file the labels came from (named in errors).

    Returns
    -------
    The frame with ``split`` set to ``""`` for the cross-validated slides (their split depends on
    the fold), external cohorts' ``test`` kept, and one ``cv_fold_r<r>`` column per repeat
    (``0..K-1``, ``-1`` outside the cross-validation).

    Raises
    ------
    ValueError
        ``folds`` < 3, ``repeats`` < 1, fewer patients than folds, a patient pinned to two splits,
        labelled slides all of one class.
    """
    from sklearn.model_selection import StratifiedGroupKFold

    folds, repeats = int(folds), int(repeats)
    if folds < 3:
        raise ValueError(f"--crossval {folds}: cross-validation needs at least 3 folds (fold k tests, fold k+1 "
                         "validates, the others train)")
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: expected at least 1")
    old = [c for c in (*crossval_columns(df.columns), "fold") if c in df.columns]
    if old:
        log.info("cross-validation: the manifest's earlier fold column(s) %s are replaced", ", ".join(old))
    out = df.drop(columns=old)
    patients = patient_of(out)
    split = pinned_splits(out, patients)
    labelled = has_target(out)
    cohort = out["cohort"].astype("string").fillna("") if "cohort" in out.columns else pd.Series("", index=out.index)
    internal = set(cohort[labelled & (split != "test")])
    external = (split == "test") & ~cohort.isin(internal)
    cv = labelled & ~external
    replaced = int((cv & (split != "")).sum())
    if replaced:
        log.info("cross-validation: the input split of %d slide(s) is replaced by the folds", replaced)
    if external.any():
        log.info("cross-validation: %d slide(s) of external cohort(s) %s stay test in every fold", int(external.sum()),
                 ", ".join(sorted(set(cohort[external]))))
    sub = out[cv]
    _check_classes(sub, folds, source)
    groups = patients[cv].astype(str).to_numpy()
    n_groups = len(set(groups))
    if n_groups < folds:
        raise ValueError(f"--crossval {folds}: only {n_groups} labelled patient(s) (slides without patient_id count "
                         f"as their own patient) to cut into {folds} folds; use at most {n_groups} folds")
    order = np.argsort(sub["slide_id"].astype(str).to_numpy(), kind="stable")  # independent of the row order
    y = _strata(sub)[order]
    g = groups[order]
    idx = sub.index.to_numpy()[order]
    out["split"] = split.mask(cv, "").astype("string")
    for r in range(repeats):
        state = int(np.random.default_rng([int(seed), r]).integers(2**31 - 1))
        fold_of = pd.Series(-1, index=out.index, dtype="int64")
        splitter = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=state)
        for k, (_, test) in enumerate(splitter.split(np.zeros(len(idx)), y, g)):
            fold_of.loc[idx[test]] = k
        out[f"{CV_COLUMN}{r}"] = fold_of
    return out


def crossval_manifests(df: pd.DataFrame) -> list[tuple[int, int, pd.DataFrame]]:
    """``(repeat, fold, manifest)`` for every repeat and fold of a frame from :func:`assign_crossval`.

    In the manifest of repeat ``r`` and fold ``k``: slides with ``cv_fold_r<r> == k`` are ``test``,
    ``== k+1 (mod K)`` are ``val``, other cross-validated slides ``train``; the rest keep their split.
    """
    cols = crossval_columns(df.columns)
    if not cols:
        raise ValueError(f"manifest has no {CV_COLUMN}<r> column; draw the folds with assign_crossval(...) first")
    out = []
    for r, col in enumerate(cols):
        fold = df[col].astype(int).to_numpy()
        n_folds = int(fold.max()) + 1
        in_cv = fold >= 0
        for k in range(n_folds):
            m = df.copy()
            split = np.where(fold == k, "test", np.where(fold == (k + 1) % n_folds, "val", "train"))
            m.loc[in_cv, "split"] = split[in_cv]
            m["split"] = m["split"].astype("string")
            out.append((r, k, m))
    return out
