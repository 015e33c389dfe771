"""Cross-validation folds of a manifest, and the pipeline config of each fold.

``wsi-pipeline manifest folder|split --folds K`` writes the manifest ``M.csv`` with a ``fold``
column (``0..K-1`` for the cross-validation slides, ``-1`` for test and pinned ones) and one
manifest per fold, ``M_fold<k>.csv``, in which fold ``k`` is ``val`` and the other folds
``train`` (:func:`wsi_pipeline.manifests.assign.fold_manifests`). Fold ``k`` of a pipeline named
``P`` is the same pipeline on ``M_fold<k>.csv``, named ``P_fold<k>``, so its runs go to
``<runs_dir>/P_fold<k>/`` and its results to ``<results_dir>/P_fold<k>/``; the pooled table
across folds goes to ``<results_dir>/P_cv/``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pandas as pd

from wsi_pipeline.config.pipeline import PipelineConfig

__all__ = ["fold_config", "fold_manifest_path", "fold_numbers", "cv_name"]


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


def fold_config(config: PipelineConfig, k: int) -> PipelineConfig:
    """``config`` for fold ``k``: its manifest ``M_fold<k>.csv`` and its name ``<name>_fold<k>``."""
    data = dataclasses.replace(config.data, manifest=str(fold_manifest_path(config.data.manifest, k)))
    return dataclasses.replace(config, name=f"{config.name}_fold{int(k)}", data=data)


def cv_name(config: PipelineConfig) -> str:
    """Folder name of the pooled cross-validation results: ``<name>_cv``."""
    return f"{config.name}_cv"
