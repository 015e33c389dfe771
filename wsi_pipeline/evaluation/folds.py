"""Pool the evaluations of K cross-validation folds into one table: mean +- std across folds.

Each fold ``k`` is evaluated as its own pipeline ``<name>_fold<k>``
(:func:`wsi_pipeline.manifests.folds.fold_config`), which writes ``metrics.json`` with a seed
mean per (method, cohort, split, protocol, metric). A fold's value is that seed mean (for
``sub<k>x<R>``: the seed mean of the per-seed repeat means); the pooled value is the mean and
sample standard deviation (ddof 1) of the K fold values. ``<results_dir>/<name>_cv/`` gets:

- ``metrics_folds.json``: the ``metrics.json`` schema with the fold number in the ``seed`` field
  and the ``"mean"`` / ``"std"`` records across folds;
- ``cv_table.csv``: method x (cohort, protocol, metric) cells ``mean ± std`` across folds;
- ``report.html``: that table, the number of folds, and each fold's values.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.export.metrics_json import (
    MetricRecord,
    aggregate_seeds,
    read_metrics_json,
    summary_table,
    write_metrics_json,
)
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.manifests.folds import cv_name, fold_config

__all__ = ["cv_page", "fold_records", "pool_folds"]

#: Metrics shown in the pooled table: those the evaluation computes for labels, survival and regression
#: (the ones a pipeline's records hold are shown), and their patient-level versions.
TABLE_METRICS: tuple[str, ...] = (
    "auc", "qwk", "accuracy", "balanced_accuracy", "c_index", "uno_c_index", "ibs", "rmse", "mae", "pearson", "spearman",
    "patient_auc", "patient_c_index", "patient_rmse",
)


def fold_records(metrics_by_fold: Mapping[int, Sequence[MetricRecord]]) -> list[MetricRecord]:
    """One record per fold and (method, cohort, split, protocol, metric): the fold's seed mean, with
    the fold number in the ``seed`` field. Per-repeat records and seed std are left out."""
    out: list[MetricRecord] = []
    for k in sorted(metrics_by_fold):
        for r in metrics_by_fold[k]:
            if r.seed == "mean" and r.repeat is None:
                out.append(MetricRecord(r.method, int(k), r.cohort, r.split, r.protocol, r.metric, r.value))
    return out


def _per_fold_table(records: Sequence[MetricRecord], metrics: Sequence[str]) -> pd.DataFrame:
    rows = [
        {"method": r.method, "cohort": r.cohort, "protocol": r.protocol, "metric": r.metric, "fold": r.seed,
         "value": None if r.value is None or math.isnan(r.value) else round(float(r.value), 4)}
        for r in records if isinstance(r.seed, int) and r.metric in metrics
    ]
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    return df.pivot_table(index=["method", "cohort", "protocol", "metric"], columns="fold", values="value", aggfunc="first")


def pool_folds(config: PipelineConfig, folds: Sequence[int], *, results_dir: str | Path | None = None) -> Path:
    """Pool the folds' ``metrics.json`` into ``<results_dir>/<name>_cv/``; return that folder.

    ``config`` is the pipeline without folds (its ``name`` and ``results_dir``); fold ``k``'s
    results are read from ``<results_dir>/<name>_fold<k>/metrics.json``.

    Raises
    ------
    FileNotFoundError : a fold has not been evaluated, naming the file and the command.
    """
    root = Path(results_dir if results_dir is not None else config.results_dir)
    by_fold: dict[int, list[MetricRecord]] = {}
    for k in folds:
        path = root / fold_config(config, k).name / "metrics.json"
        if not path.is_file():
            raise FileNotFoundError(f"fold {k} has no results ({path}); run `wsi-pipeline eval --config ... --folds` "
                                    "after training every fold")
        by_fold[int(k)] = read_metrics_json(path)
    records = fold_records(by_fold)
    out = root / cv_name(config)
    write_metrics_json(out / "metrics_folds.json", records)
    pooled = records + aggregate_seeds(records)  # what the file holds: the folds, then mean/std across them
    present = [m for m in TABLE_METRICS if any(r.metric == m for r in records)]
    table = summary_table(pooled, metrics=present, digits=3)
    write_text_atomic(out / "cv_table.csv", table.to_csv())
    per_fold = _per_fold_table(records, present)
    body = (
        f"<h1>{html.escape(config.name)}: {len(folds)}-fold cross-validation</h1>\n"
        f"<p>Each cell: mean ± sample std (ddof 1) across {len(folds)} folds of each fold's seed mean "
        f"(seeds {', '.join(map(str, config.seeds))}); folds evaluated separately in "
        f"{', '.join(html.escape(fold_config(config, k).name) for k in folds)}.</p>\n"
        f"{table.to_html(border=0, na_rep='-')}\n<h2>Per fold</h2>\n{per_fold.to_html(border=0, na_rep='-')}\n"
    )
    write_text_atomic(out / "report.html", cv_page(f"{config.name} cross-validation", body))
    return out


def cv_page(title: str, body: str) -> str:
    """A self-contained HTML page of a cross-validation report: ``title`` (escaped here) and the ``body`` HTML."""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}"
            f"</style></head><body>\n{body}</body></html>\n")
