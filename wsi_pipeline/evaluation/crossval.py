"""Pool a cross-validation's out-of-fold predictions into one result (``eval --folds`` on a
``manifest ... --crossval K [--repeats R]`` manifest).

Each repeat ``r`` and fold ``k`` is evaluated as its own pipeline ``<name>_fold<k>`` (one repeat)
or ``<name>_r<r>_fold<k>`` (:func:`wsi_pipeline.manifests.folds.fold_config`); its test split is
fold ``k``. The out-of-fold (OOF) prediction of a slide in repeat ``r`` is the prediction of the
fold whose test split holds it, under the **all tiles** protocol (``predictions_<cohort>_all.csv``),
averaged over the config's training seeds when there are several. Slides pinned to ``test``
outside the cross-validation (external cohorts) are not OOF predictions and are left out here, as
is a method without predictions on every fold (a warning names it).

Written to ``<results_dir>/<name>_cv/``:

- ``oof_predictions.csv``: columns ``slide_id, repeat, fold, method, label, prob``, one row per
  slide, method and repeat. Binary tasks: ``prob`` = probability of class 1. More classes: ``prob``
  = probability of the predicted class, then ``pred, prob_0 .. prob_{C-1}``. Survival: ``label`` =
  event (1/0), ``prob`` = the model's risk, then ``time``. Regression: ``label`` = target, ``prob``
  = the prediction. Multilabel: no ``label``/``prob``; each target column, then its
  ``prob_<col>`` (the task's :meth:`~wsi_pipeline.tasks.base.Task.oof_columns`).
- ``cv_table.csv``: one row per method and metric (classification: accuracy, precision, recall, F1
  with class 1 positive, or macro-averaged with more classes, and ROC AUC; survival: Harrell's
  ``c_index``; regression: ``rmse``, ``mae``, ``pearson``; multilabel: ``auc``, ``balanced_accuracy`` (means
  over the targets), then ``auc_<col>``, ``balanced_accuracy_<col>`` per target), columns

  * ``mean``: each fold's metric on its test slides, averaged over the K folds of a repeat, then
    over the R repeats (the layout the MIL papers report);
  * ``se``: standard error of that mean: sample sd (ddof 1) of the R repeat values / sqrt(R); with
    one repeat, sd of the K fold values / sqrt(K) (``se_over`` says which);
  * ``sd_folds``: sample sd of the fold values within a repeat, averaged over repeats;
  * ``pooled``: the metric of all OOF predictions at once (every repeat's rows stacked: with one
    repeat, each slide once), and for the headline metric (``auc``, ``c_index``, ``rmse``) its
    percentile bootstrap 95 % interval ``ci_low``/``ci_high`` (slides resampled with all their
    repeats);
  * ``n_repeats``, ``n_folds``, ``n_slides``.

  Undefined values (AUC of a fold with one class) are left out of the means and counted in
  ``n_undefined``. Precision and recall are 0 where nothing is predicted positive (scikit-learn's
  ``zero_division=0``). Survival: risks of different folds' models need not share a scale, so the
  pooled c-index mixes scales; the per-fold ``mean`` does not.
- ``report.html``: the table as ``mean ± se``, the pooled value with its interval, each fold's value,
  and the pooled OOF ROC curve per method (binary tasks).
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.evaluation.folds import cv_page
from wsi_pipeline.export.predictions import predictions_path
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.manifests.crossval import CV_COLUMN
from wsi_pipeline.manifests.folds import FoldRun, cv_name, fold_config
from wsi_pipeline.manifests.schema import read_manifest
from wsi_pipeline.tasks import get_task, task_names

__all__ = ["OOF_COLUMNS", "TASK_METRICS", "HEADLINE", "fold_test_slides", "fold_test_predictions", "oof_predictions", "set_metrics", "per_fold_values", "cv_table",
           "pool_crossval", "format_table"]

log = logging.getLogger(__name__)

#: The first columns of ``oof_predictions.csv`` (the contract).
OOF_COLUMNS: tuple[str, ...] = ("slide_id", "repeat", "fold", "method", "label", "prob")
#: Metrics of the pooled table per registered task, in table order (each task's ``cv_metrics``; a task bound to a
#: method's targets has its own: ask ``get_task(config.task)``).
TASK_METRICS: dict[str, tuple[str, ...]] = {n: get_task(n).cv_metrics for n in task_names()}
#: The metric given a bootstrap interval, per task (each task's ``cv_headline``).
HEADLINE: dict[str, str] = {n: get_task(n).cv_headline for n in task_names()}


def fold_test_slides(config: PipelineConfig, run: FoldRun) -> pd.DataFrame:
    """The rows of fold ``run.fold``'s manifest (repeat ``run.repeat``) for the slides that fold tests: its
    cross-validation column equal to the fold, in the test split.

    Raises
    ------
    ValueError : the fold manifest tests no slide of the fold.
    """
    fold_cfg = fold_config(config, run)
    manifest = read_manifest(fold_cfg.data.manifest)
    col = f"{CV_COLUMN}{run.repeat}"
    test = manifest[(manifest[col].astype(int) == run.fold) & (manifest["split"] == "test")]
    if test.empty:
        raise ValueError(f"{fold_cfg.data.manifest}: no slide with {col} == {run.fold} in the test split; "
                         "the fold manifest does not match its cross-validation")
    return test


def fold_test_predictions(config: PipelineConfig, run: FoldRun, root: str | Path,
                          methods: Sequence[str] | None = None) -> pd.DataFrame:
    """The rows of fold ``run.fold``'s all-tiles predictions (repeat ``run.repeat``; one per slide, method and seed,
    as ``predictions_<cohort>_all.csv`` under ``<root>/<fold name>/`` holds them) for the slides that fold tests.

    Raises
    ------
    FileNotFoundError : the fold was not evaluated (naming the file and the command).
    ValueError : the fold manifest tests no slide of the fold.
    """
    fold_cfg = fold_config(config, run)
    test = fold_test_slides(config, run)
    fold_dir = Path(root) / fold_cfg.name
    frames = []
    for cohort in sorted(test["cohort"].astype(str).unique()):
        path = predictions_path(fold_dir, cohort, "all")
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: repeat {run.repeat} fold {run.fold} has no all-tiles predictions; "
                                    "run `wsi-pipeline eval --config ... --folds` after training every fold")
        frames.append(pd.read_csv(path))
    pred = pd.concat(frames, ignore_index=True)
    pred["slide_id"] = pred["slide_id"].astype(str)
    ids = set(test["slide_id"].astype(str))
    pred = pred[pred["slide_id"].isin(ids)]
    if methods:
        pred = pred[pred["method"].isin(list(methods))]
    missing = sorted(ids - set(pred["slide_id"]))
    if missing:
        log.warning("repeat %d fold %d: %d test slide(s) have no prediction (e.g. %s); they are left out of the "
                    "out-of-fold predictions", run.repeat, run.fold, len(missing), ", ".join(missing[:3]))
    return pred


def _fold_predictions(config: PipelineConfig, run: FoldRun, root: Path, methods: Sequence[str] | None) -> pd.DataFrame:
    """Repeat ``run.repeat``'s OOF rows from fold ``run.fold``'s all-tiles predictions (seed mean per slide and method)."""
    pred = fold_test_predictions(config, run, root, methods)
    kind = get_task(config.task)
    value_cols = kind.oof_value_columns(config.label_classes)
    target_cols = list(kind.target_columns)
    # seed mean per slide and method (targets are the same in every seed's row)
    out = pred.groupby(["method", "slide_id"], sort=True).agg(
        {**{c: "mean" for c in value_cols}, **{c: "first" for c in target_cols}}).reset_index()
    out.insert(1, "repeat", run.repeat)
    out.insert(2, "fold", run.fold)
    return out


def oof_predictions(config: PipelineConfig, runs: Sequence[FoldRun], *, results_dir: str | Path,
                    methods: Sequence[str] | None = None) -> pd.DataFrame:
    """Every repeat's out-of-fold predictions: the columns of ``oof_predictions.csv`` (module docstring).

    Raises
    ------
    FileNotFoundError : a fold was not evaluated (naming the file and the command).
    """
    root = Path(results_dir)
    raw = pd.concat([_fold_predictions(config, run, root, methods) for run in runs], ignore_index=True)
    n_runs = raw.groupby("method")[["repeat", "fold"]].apply(lambda g: len(g.drop_duplicates()))
    partial = sorted(n_runs.index[n_runs < len(runs)])
    if partial:  # pooled over some folds only, a method's numbers would not be out-of-fold over the cohort
        log.warning("method(s) %s left out of the pooled results: not evaluated on every fold (evaluate them with "
                    "`wsi-pipeline eval --folds --method NAME`)", ", ".join(partial))
        raw = raw[~raw["method"].isin(partial)]
    df = raw[["slide_id", "repeat", "fold", "method"]].copy()
    for name, column in get_task(config.task).oof_columns(raw, config.label_classes).items():
        df[name] = column
    dup = df.duplicated(["slide_id", "repeat", "method"])
    if dup.any():
        raise ValueError(f"slide(s) {df.loc[dup, 'slide_id'].unique().tolist()[:5]} are tested in two folds of one "
                         "repeat; the fold manifests do not form a cross-validation")
    return df.sort_values(["method", "repeat", "fold", "slide_id"], kind="stable").reset_index(drop=True)


def set_metrics(task: str, rows: pd.DataFrame, n_classes: int | None = None) -> dict[str, float]:
    """The :data:`TASK_METRICS` of one set of OOF rows (a fold's test slides, a repeat, or all).

    Classification: accuracy of the arg-max class; precision, recall and F1 of class 1 (binary) or
    macro-averaged (more classes), ``zero_division=0``; ROC AUC as the evaluation computes it
    (``nan`` with one class present). Survival: Harrell's c-index of the risk. Regression: RMSE,
    MAE and Pearson's r.
    """
    return get_task(task).cv_metric_values(rows, n_classes)


def _sd(values: np.ndarray) -> float:
    v = values[~np.isnan(values)]
    return float(v.std(ddof=1)) if len(v) > 1 else math.nan


def _mean(values: np.ndarray) -> float:
    v = values[~np.isnan(values)]
    return float(v.mean()) if len(v) else math.nan


def per_fold_values(oof: pd.DataFrame, task: str, n_classes: int | None = None) -> pd.DataFrame:
    """One row per method, repeat and fold: the fold's :func:`set_metrics` on its test slides."""
    rows = []
    for (method, r, k), sub in oof.groupby(["method", "repeat", "fold"], sort=True):
        rows.append({"method": method, "repeat": int(r), "fold": int(k), "n_slides": len(sub),
                     **set_metrics(task, sub, n_classes)})
    return pd.DataFrame(rows)


def _headline_fn(task: str, rows: pd.DataFrame, n_classes: int | None) -> Any:
    """``f(row_indices) -> value`` of the task's :data:`HEADLINE` metric on those OOF rows (the bootstrap's inner
    call: arrays taken out of the frame once, one scikit-learn or numpy call per resample)."""
    return get_task(task).cv_headline_fn(rows, n_classes)


def _resampled(idx: np.ndarray, payload: tuple[Any, list[np.ndarray]]) -> float:
    """The headline metric on resampled slides ``idx``, each with all its OOF rows (every repeat)."""
    headline, rows_of = payload
    return float(headline(np.concatenate([rows_of[i] for i in idx])))


def cv_table(oof: pd.DataFrame, task: str, n_classes: int | None = None, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """The pooled table (module docstring) of OOF rows from :func:`oof_predictions`."""
    from wsi_pipeline.tasks.metrics import resample_interval

    metrics = get_task(task).cv_metrics
    folds = per_fold_values(oof, task, n_classes)
    out = []
    for method, fm in folds.groupby("method", sort=False):
        sub = oof[oof["method"] == method].reset_index(drop=True)
        repeats = sorted(fm["repeat"].unique())
        n_folds = int(fm.groupby("repeat")["fold"].nunique().max())
        pooled = set_metrics(task, sub, n_classes)
        codes, slides = pd.factorize(sub["slide_id"])
        rows_of = [np.flatnonzero(codes == i) for i in range(len(slides))]
        headline = _headline_fn(task, sub, n_classes)
        for m in metrics:
            per_repeat = np.array([_mean(fm.loc[fm["repeat"] == r, m].to_numpy(float)) for r in repeats])
            sd_folds = np.array([_sd(fm.loc[fm["repeat"] == r, m].to_numpy(float)) for r in repeats])
            values = fm[m].to_numpy(float)
            if len(repeats) > 1:
                se, se_over = _sd(per_repeat) / math.sqrt(int((~np.isnan(per_repeat)).sum())), "repeats"
            else:
                se, se_over = _sd(values) / math.sqrt(int((~np.isnan(values)).sum())), "folds"
            lo = hi = math.nan
            if m == get_task(task).cv_headline and n_boot > 0:
                lo, hi = resample_interval(len(slides), [[(headline, rows_of)]], _resampled, n_boot=n_boot, seed=seed)
            out.append({"method": method, "metric": m, "mean": _mean(per_repeat), "se": se, "se_over": se_over,
                        "sd_folds": _mean(sd_folds), "pooled": pooled[m], "ci_low": lo, "ci_high": hi,
                        "n_repeats": len(repeats), "n_folds": n_folds, "n_slides": len(slides),
                        "n_undefined": int(np.isnan(values).sum())})
    return pd.DataFrame(out)


def _cell(mean: float, se: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def _report(config: PipelineConfig, table: pd.DataFrame, folds: pd.DataFrame, oof: pd.DataFrame, task: str) -> str:
    n_rep, n_folds = int(table["n_repeats"].max()), int(table["n_folds"].max())
    wide = table.assign(cell=[_cell(m, s) for m, s in zip(table["mean"], table["se"])]).pivot(
        index="method", columns="metric", values="cell")[list(get_task(task).cv_metrics)]
    head = get_task(task).cv_headline
    hl = table[table["metric"] == head].set_index("method")
    wide[f"pooled OOF {head} (95% CI)"] = [
        "-" if math.isnan(hl.loc[m, "pooled"]) else f"{hl.loc[m, 'pooled']:.3f}"
        + ("" if math.isnan(hl.loc[m, "ci_low"]) else f" ({hl.loc[m, 'ci_low']:.3f}-{hl.loc[m, 'ci_high']:.3f})")
        for m in wide.index]
    se_over = "repeats" if n_rep > 1 else "folds"
    per_fold = folds.set_index(["method", "repeat", "fold"])[list(get_task(task).cv_metrics)].round(3)
    roc = ""
    curves = get_task(task).oof_roc(oof)  # the task's ROC curves (two classes), each method in its colour
    if curves:
        from wsi_pipeline.export.report import roc_svg

        colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
        order = sorted(oof["method"].unique())
        roc = (f"<h2>Pooled out-of-fold ROC</h2>\n"
               f"{roc_svg([(m, colours[order.index(m) % len(colours)], fpr, tpr) for m, fpr, tpr in curves], title='all repeats stacked')}\n")
    body = (
        f"<h1>{html.escape(config.name)}: {n_folds}-fold cross-validation × {n_rep} repeat(s)</h1>\n"
        f"<p>Every slide is tested once per repeat, by the model of the fold that held it out (fold k tests, fold "
        f"k+1 validates, the rest train). Predictions: the all-tiles protocol, averaged over seeds "
        f"{', '.join(map(str, config.seeds))}. Each cell: mean over repeats of the mean over folds of each fold's "
        f"metric on its test slides ± standard error over {se_over}; the last column pools every out-of-fold "
        f"prediction (repeats stacked) with a percentile bootstrap interval over slides. Out-of-fold predictions: "
        f"oof_predictions.csv; all numbers: cv_table.csv.</p>\n"
        f"{wide.to_html(border=0, na_rep='-')}\n{roc}<h2>Per fold (test slides of each fold)</h2>\n"
        f"{per_fold.to_html(border=0, na_rep='-')}\n"
    )
    return cv_page(f"{config.name} cross-validation", body)


def pool_crossval(config: PipelineConfig, runs: Sequence[FoldRun], *, results_dir: str | Path | None = None,
                  methods: Sequence[str] | None = None, n_boot: int | None = None) -> Path:
    """Write ``oof_predictions.csv``, ``cv_table.csv`` and ``report.html`` to ``<results_dir>/<name>_cv/``; return it.

    ``config`` is the pipeline without folds; fold results are read from
    ``<results_dir>/<name>_<tag>/predictions_<cohort>_all.csv``. ``n_boot``: bootstrap resamples
    of the pooled interval (default: the config's ``eval.bootstrap``; 0: no interval).
    """
    root = Path(results_dir if results_dir is not None else config.results_dir)
    task = config.task
    n_classes = config.label_classes
    oof = oof_predictions(config, runs, results_dir=root, methods=methods)
    if oof.empty:
        raise ValueError(f"no out-of-fold predictions in {root}: no method was evaluated on its test folds")
    boots = int(config.eval.bootstrap if n_boot is None else n_boot)
    table = cv_table(oof, task, n_classes, n_boot=boots, seed=int(config.eval.seed))
    folds = per_fold_values(oof, task, n_classes)
    out = root / cv_name(config)
    write_text_atomic(out / "oof_predictions.csv", oof.to_csv(index=False))
    write_text_atomic(out / "cv_folds.csv", folds.to_csv(index=False))
    write_text_atomic(out / "report.html", _report(config, table, folds, oof, task))
    write_text_atomic(out / "cv_table.csv", table.to_csv(index=False))  # last: the pooled result is complete
    return out


def format_table(table: pd.DataFrame, task: str) -> str:
    """The pooled table as text: method x metric cells ``mean ± se``, then the pooled headline with its interval."""
    head = get_task(task).cv_headline
    lines = []
    metrics = list(get_task(task).cv_metrics)
    rows = []
    for method, sub in table.groupby("method", sort=False):
        s = sub.set_index("metric")
        cells: list[Any] = [method, *(_cell(s.loc[m, "mean"], s.loc[m, "se"]) for m in metrics)]
        p, lo, hi = s.loc[head, "pooled"], s.loc[head, "ci_low"], s.loc[head, "ci_high"]
        cells.append("-" if math.isnan(p) else f"{p:.3f}" + ("" if math.isnan(lo) else f" ({lo:.3f}-{hi:.3f})"))
        rows.append([str(c) for c in cells])
    header = ["method", *metrics, f"pooled {head} (95% CI)"]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
