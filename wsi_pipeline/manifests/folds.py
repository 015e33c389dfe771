"""Cross-validation folds of a manifest, and the pipeline config of each fold.

``wsi-pipeline manifest folder|split --folds K`` writes the manifest ``M.csv`` with a ``fold``
column (``0..K-1`` for the cross-validation slides, ``-1`` for test and pinned ones) and one
manifest per fold, ``M_fold<k>.csv``, in which fold ``k`` is ``val`` and the other folds
``train`` (:func:`wsi_pipeline.manifests.assign.fold_manifests`). Fold ``k`` of a pipeline named
``P`` is the same pipeline on ``M_fold<k>.csv``, named ``P_fold<k>``, so its runs go to
``<runs_dir>/P_fold<k>/`` and its results to ``<results_dir>/P_fold<k>/``; the pooled table
across folds goes to ``<results_dir>/P_cv/``.

A cross-validation manifest (``manifest ... --crossval K [--repeats R]``, columns ``cv_fold_r<r>``;
:mod:`wsi_pipeline.manifests.crossval`) is found by its columns: its runs are :class:`FoldRun` items
of every repeat and fold, named ``P_fold<k>`` (one repeat) or ``P_r<r>_fold<k>``, on the manifests
``M_fold<k>.csv`` or ``M_r<r>_fold<k>.csv`` (fold k = test).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.manifests.crossval import crossval_columns, crossval_manifest_path

__all__ = ["FoldRun", "check_not_crossval", "fold_config", "fold_manifest_path", "fold_numbers", "fold_runs", "cv_name"]


@dataclass(frozen=True)
class FoldRun:
    """One fold of a manifest's folds: ``fold`` of ``repeat`` (of ``repeats``).

    ``crossval``: True for a cross-validation manifest (fold = test split), False for the
    fixed-test folds of ``--folds`` (fold = validation split, one repeat).
    """

    fold: int
    repeat: int = 0
    repeats: int = 1
    crossval: bool = False

    @property
    def tag(self) -> str:
        """``fold<k>`` (one repeat) or ``r<r>_fold<k>``: the suffix of the fold's manifest and pipeline names."""
        return f"fold{self.fold}" if self.repeats == 1 else f"r{self.repeat}_fold{self.fold}"

    def manifest(self, manifest: str | os.PathLike) -> Path:
        """This fold's manifest beside ``manifest``."""
        return crossval_manifest_path(manifest, self.fold, self.repeat, self.repeats)


def fold_manifest_path(manifest: str | os.PathLike, k: int) -> Path:
    """``M_fold<k>.csv`` beside manifest ``M.csv`` (the name ``manifest ... --folds`` writes)."""
    m = Path(manifest)
    return m.with_name(f"{m.stem}_fold{int(k)}{m.suffix}")


def fold_numbers(manifest: str | os.PathLike) -> list[int]:
    """The folds of ``manifest`` (sorted), from its ``fold`` column.

    Raises
    ------
    FileNotFoundError : the manifest, or one of its per-fold manifests, is missing.
    ValueError : the manifest has no ``fold`` column or no fold >= 0.
    """
    path = Path(manifest)
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found: {path}")
    df = pd.read_csv(path, usecols=lambda c: c == "fold")
    fix = f"draw folds with `wsi-pipeline manifest split --manifest {path} --folds K --out {path}`"
    if "fold" not in df.columns:
        raise ValueError(f"{path}: no 'fold' column, so there are no cross-validation folds; {fix}")
    folds = sorted({int(f) for f in df["fold"].dropna() if int(f) >= 0})
    if not folds:
        raise ValueError(f"{path}: the 'fold' column holds no fold >= 0; {fix}")
    missing = [str(fold_manifest_path(path, k)) for k in folds if not fold_manifest_path(path, k).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: per-fold manifest(s) missing: {', '.join(missing)}; {fix}")
    return folds


def fold_runs(manifest: str | os.PathLike) -> list[FoldRun]:
    """Every fold (and repeat) of ``manifest``: its cross-validation columns ``cv_fold_r<r>`` when
    it has them, else its fixed-test ``fold`` column (:func:`fold_numbers`).

    Raises
    ------
    FileNotFoundError : the manifest, or one of its per-fold manifests, is missing.
    ValueError : the manifest has neither kind of fold column, or a column without folds.
    """
    path = Path(manifest)
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found: {path}")
    header = pd.read_csv(path, nrows=0).columns
    cols = crossval_columns(header)
    if not cols:
        return [FoldRun(k) for k in fold_numbers(path)]
    df = pd.read_csv(path, usecols=cols)
    fix = f"draw them with `wsi-pipeline manifest split --manifest {path} --crossval K --out {path}`"
    runs = []
    for r, col in enumerate(cols):
        folds = sorted({int(f) for f in df[col].dropna() if int(f) >= 0})
        if not folds:
            raise ValueError(f"{path}: the column {col!r} holds no fold >= 0; {fix}")
        runs += [FoldRun(k, r, len(cols), crossval=True) for k in folds]
    missing = [str(run.manifest(path)) for run in runs if not run.manifest(path).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: per-fold manifest(s) missing: {', '.join(missing[:5])}"
                                f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}; {fix}")
    return runs


def check_not_crossval(manifest: str | os.PathLike, command: str) -> None:
    """Refuse to run ``command`` on a cross-validation manifest without ``--folds``: its slides have no
    split of their own (each fold's manifest gives them one). One fold's manifest (``M_fold<k>.csv``:
    the same fold columns, and every slide's split of that fold) is accepted.

    Raises
    ------
    ValueError : naming the manifest, its columns and the two ways on.
    """
    path = Path(manifest)
    if not path.is_file():
        return  # the command's own checks name a missing manifest
    header = pd.read_csv(path, nrows=0).columns
    cols = crossval_columns(header)
    if cols and "split" in header and pd.read_csv(path, usecols=["split"])["split"].notna().any():
        return  # one fold's manifest: its slides carry that fold's split
    if cols:
        raise ValueError(f"{path} is a cross-validation manifest (columns {', '.join(cols)}): its slides are split "
                         f"per fold; run `wsi-pipeline {command} --config ... --folds` for every repeat and fold, or set "
                         f"data.manifest to one fold's manifest ({crossval_manifest_path(path, 0, 0, len(cols)).name})")


def fold_config(config: PipelineConfig, k: int | FoldRun) -> PipelineConfig:
    """``config`` for fold ``k``: its manifest ``M_<tag>.csv`` and its name ``<name>_<tag>``, where the
    tag is ``fold<k>`` (fixed-test folds, or cross-validation with one repeat) or ``r<r>_fold<k>``."""
    run = k if isinstance(k, FoldRun) else FoldRun(int(k))
    data = dataclasses.replace(config.data, manifest=str(run.manifest(config.data.manifest)))
    return dataclasses.replace(config, name=f"{config.name}_{run.tag}", data=data)


def cv_name(config: PipelineConfig) -> str:
    """Folder name of the pooled cross-validation results: ``<name>_cv``."""
    return f"{config.name}_cv"
