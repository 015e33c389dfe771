"""Per-slide predictions CSV: ``predictions_<cohort>_<protocol>.csv``, one row per slide, method and seed.

Columns, in order: ``slide_id, cohort, label, pred, prob_0 .. prob_{C-1}, n_tiles, protocol,
n_repeats, prob_std, method, seed``.

- ``label``: the manifest's class, empty for unlabelled slides.
- ``pred``: argmax of the mean probabilities (ties to the lower class).
- ``prob_c``: mean over repeats of the softmax probability of class c.
- ``n_tiles``: tiles in the slide's store (a repeat uses ``min(k, n_tiles)`` of them).
- ``n_repeats``: aggregator passes averaged (1 for ``all`` and when ``k >= n_tiles``).
- ``prob_std``: standard deviation over repeats of the predicted class's probability (0 for one repeat).
- ``seed``: the training seed of the model (empty for ``predict`` runs on a checkpoint without one).
- ``patient_id``: the manifest's patient (the slide id when it names none; empty for ``predict``).

Survival models (:func:`endpoint_columns`): ``slide_id, cohort, time, event, risk, risk_group,
n_tiles, protocol, n_repeats, risk_std, method, seed, patient_id`` and, for discrete-time models,
``survival_at_<t>``: the predicted probability of being event-free after each interval, ending at
time t (the last interval never ends: its column is ``survival_at_inf``). ``risk``: the mean over
repeats of the model's risk (higher = earlier event); ``risk_group``: ``high`` above the median
risk of the training split, else ``low`` (empty where not computed, e.g. ``predict``).
Regression models: ``slide_id, cohort, target, prediction, n_tiles, protocol, n_repeats,
prediction_std, method, seed, patient_id``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.tasks import get_task
from wsi_pipeline.tasks.classification import class_prediction_columns
from wsi_pipeline.tasks.survival import survival_column  # noqa: F401  (the old import path)

__all__ = [
    "endpoint_columns", "endpoint_row", "prediction_columns", "predictions_path", "write_predictions",
    "read_predictions",
]


def prediction_columns(n_classes: int) -> list[str]:
    """The column names of a classification predictions CSV for ``n_classes`` classes, in order."""
    return class_prediction_columns(n_classes)


def endpoint_columns(task: str, edges: Sequence[float] = (), n_classes: int | None = None) -> list[str]:
    """The columns of a predictions CSV of ``task`` (module docstring; :meth:`~wsi_pipeline.tasks.base.Task.prediction_columns`):
    ``edges``: the discrete-time model's inner interval edges (adds the survival curve's columns); ``n_classes``: the
    classes of a task with classes."""
    return get_task(task).prediction_columns(n_classes, edges)


def endpoint_row(
    *, task: str, slide_id: str, cohort: str, target: Any, scores: Mapping[str, np.ndarray], n_tiles: int, protocol: str,
    n_repeats: int, method: str, seed: int | str | None, patient_id: str = "", threshold: float | None = None,
    edges: Sequence[float] = (),
) -> dict[str, Any]:
    """One predictions CSV row of the task's scores (the task's per-repeat scores,
    :meth:`~wsi_pipeline.tasks.base.Task.scores`, averaged over repeats: :meth:`~wsi_pipeline.tasks.base.Task.prediction_row`)."""
    row: dict[str, Any] = {"slide_id": slide_id, "cohort": cohort,
                           **get_task(task).prediction_row(target=target, scores=scores, edges=edges, threshold=threshold)}
    row.update({"n_tiles": int(n_tiles), "protocol": str(protocol), "n_repeats": int(n_repeats), "method": str(method),
                "seed": "" if seed is None else seed, "patient_id": patient_id})
    return row


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)) or "unnamed"


def predictions_path(results_dir: str | os.PathLike, cohort: str, protocol: str) -> Path:
    """``<results_dir>/predictions_<cohort>_<protocol>.csv`` (unsafe characters replaced by ``-``)."""
    return Path(results_dir) / f"predictions_{_safe(cohort)}_{_safe(protocol)}.csv"


def write_predictions(
    path: str | os.PathLike, rows: Iterable[Mapping[str, Any]], n_classes: int | None, *, extra_columns: Sequence[str] = (),
    columns: Sequence[str] | None = None,
) -> Path:
    """Write rows atomically with :func:`prediction_columns` (or ``columns``: :func:`endpoint_columns`),
    then ``extra_columns``."""
    path = Path(path)
    cols = list(columns if columns is not None else prediction_columns(int(n_classes or 2))) + list(extra_columns)
    df = pd.DataFrame(list(rows), columns=cols)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"prediction rows for {path} lack column(s) {missing}")
    for col in ("label", "event"):
        if col in df.columns:
            df[col] = df[col].astype("Int64")
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6g")
    return path


def read_predictions(path: str | os.PathLike) -> pd.DataFrame:
    """Read a predictions CSV (``label`` as nullable Int64, ``slide_id``/``cohort``/``method``/``seed`` as strings)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictions file not found: {path}; run `wsi-pipeline eval` first")
    strings = {c: "string" for c in ("slide_id", "cohort", "method", "seed", "protocol", "patient_id", "risk_group")}
    df = pd.read_csv(path, dtype=strings, keep_default_na=True)
    for col in ("label", "event"):
        if col in df.columns:
            df[col] = df[col].astype("Int64")
    df["seed"] = df["seed"].fillna("")
    return df
