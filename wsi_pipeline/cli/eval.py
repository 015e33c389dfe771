"""``wsi-pipeline eval``: evaluate every trained seed of every method of a pipeline on its test cohorts."""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args, join_torchrun
from wsi_pipeline.cli._common import (
    add_failure_argument, add_trust_argument, failure_status,
    add_device_argument,
    add_config_flag,
    add_heatmap_mode_argument,
    add_output_arguments,
    add_set_argument,
    name_the_flag,
    pipeline_from_args,
)

if TYPE_CHECKING:
    from wsi_pipeline.config.pipeline import PipelineConfig
    from wsi_pipeline.manifests.folds import FoldRun

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate trained models on the internal test split and external cohorts",
        description=(
            "Evaluate every finished run (runs/<pipeline>/<method>/seed<k>/ with a `done` marker) of the "
            "pipeline: each model is fixed by its best.pt (chosen on validation) before any test slide is read. "
            "Test sets: the `test` slides of the training cohorts and every cohort without train/val slides "
            "(external). Each slide is embedded once and scored on all tiles and on the config's R x k subsample "
            "protocols. Writes results/<pipeline>/: predictions_<cohort>_<protocol>.csv, metrics.json, "
            "report.html and heatmaps/ (PNG, per-tile scores CSV, QuPath GeoJSON)."
        ),
    )
    p.add_argument("--config", required=True, metavar="YAML", help="pipeline YAML, e.g. pipelines/demo.yaml")
    add_set_argument(p)
    add_config_flag(p, "--method", key="eval.methods", dest="methods", action="append", metavar="NAME",
                    help="evaluate only this method (repeatable; eval.methods; default: every method of the config). The "
                         "other methods' results from an earlier eval stay in the results folder, and --folds pools "
                         "every method evaluated on every fold")
    add_device_argument(p, note="default: the config's, auto", key="eval.device")
    add_config_flag(p, "--batch-size", key="eval.batch_size", type=int, metavar="N",
                    help="tiles per encoder call (eval.batch_size; default: each method's chunk_size)")
    add_config_flag(p, "--bootstrap", key="eval.bootstrap", type=int, metavar="N",
                    help="bootstrap resamples for the 95%% intervals; 0 turns them off (eval.bootstrap; default: the "
                         "config's, 1000)")
    add_config_flag(p, "--no-heatmaps", key="eval.heatmaps", dest="heatmaps", action="store_false",
                    help="skip heatmaps, per-tile scores and GeoJSON (eval.heatmaps: false)")
    add_config_flag(p, "--heatmap-method", key="eval.heatmap_method", metavar="NAME",
                    help="method whose seed best on validation draws the heatmaps (eval.heatmap_method; default: the run "
                         "best on validation)")
    add_heatmap_mode_argument(p, "eval")
    add_config_flag(p, "--results", key="eval.results", metavar="DIR",
                    help="output folder (eval.results; default: <results_dir>/<pipeline name>; with --folds the folder "
                         "that holds <name>_fold<k>/ and <name>_cv/)")
    p.add_argument("--folds", action="store_true",
                   help="evaluate every fold trained with `train --folds` (a fold whose results are newer than its "
                   "runs is not evaluated again), then pool them into <results_dir>/<name>_cv/. Fixed-test folds "
                   "(`manifest --folds K`): report.html and cv_table.csv, mean ± std across folds of each fold's "
                   "test metrics. Cross-validation (`manifest --crossval K [--repeats R]`): the out-of-fold "
                   "predictions of the all-tiles protocol, oof_predictions.csv (slide_id, repeat, fold, method, "
                   "label, prob), cv_table.csv (per method and metric: mean ± standard error over repeats, sd over "
                   "folds, the pooled out-of-fold value with a bootstrap interval) and report.html")
    p.add_argument("--reevaluate", action="store_true",
                   help="with --folds: evaluate every fold again, even those whose results are newer than their runs")
    add_output_arguments(p)
    add_failure_argument(p)
    add_trust_argument(p)
    add_cluster_arguments(p, shard=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.training import distributed

    config = pipeline_from_args(args)  # a bad flag or key is refused before torchrun is joined
    try:
        config.check_eval_methods()
    except ValueError as e:
        raise ValueError(f"{args.config}: {name_the_flag(e, args)}") from e
    try:
        join_torchrun(args)
        return _run(config, args)
    finally:
        distributed.shutdown()


def _run(config: PipelineConfig, args: argparse.Namespace) -> int:
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.export.metrics_json import read_metrics_json
    from wsi_pipeline.training import distributed

    if getattr(args, "folds", False):
        return _run_folds(config, args)
    from wsi_pipeline.manifests.folds import check_not_crossval

    check_not_crossval(config.data.manifest, "eval")
    summary = evaluate_pipeline(config, progress=not args.no_progress, cluster=cluster_from_args(args), retries=args.retries)
    if not distributed.is_main():
        return 0
    out = summary.results_dir
    rate = len(summary.models) * summary.n_slides / summary.seconds * 3600 if summary.seconds > 0 else 0.0
    print(f"Evaluated {len(summary.models)} model(s) on {summary.n_slides} slide(s) in {summary.seconds:.1f} s "
          f"({rate:,.0f} slides/h, each model's scoring counted).")
    for s in summary.skipped_runs:
        print(f"  skipped {s}")
    from wsi_pipeline.data.bags import skipped_by_tiler

    left_out = skipped_by_tiler(config.data.tiles_dir) if config.data.tiles_dir else {}
    by_tiler = [sid for sid in summary.missing_stores if sid in left_out]
    missing = [sid for sid in summary.missing_stores if sid not in left_out]
    if by_tiler:
        print(f"  {len(by_tiler)} slide(s) were left out by the tiler (see tiling_report.csv): "
              + "; ".join(f"{sid} ({left_out[sid]})" for sid in by_tiler[:3]) + (" ..." if len(by_tiler) > 3 else ""))
    if missing and config.data.features is not None:
        print(f"  {len(missing)} slide(s) had no feature file in {config.data.features.dir} and were skipped "
              f"(e.g. {', '.join(missing[:3])})")
    elif missing:
        print(f"  {len(missing)} slide(s) had no complete tile store and were skipped "
              f"(e.g. {', '.join(missing[:3])}); run `wsi-pipeline tile` for them")
    for sid, why in summary.failed_slides.items():
        print(f"wsi-pipeline eval: slide {sid} was not scored: {why}", file=sys.stderr)
    if summary.n_slides == 0:
        reasons = [f"{len(by_tiler)} left out by the tiler" if by_tiler else "", f"{len(missing)} without a tile store" if missing else "",
               f"{len(summary.failed_slides)} failed" if summary.failed_slides else ""]
        print(f"wsi-pipeline eval: error: no test or external slide could be scored ({', '.join(w for w in reasons if w) or 'none listed'}); "
              "nothing was evaluated. Give the manifest test slides that tiled (`wsi-pipeline manifest split --redraw` after "
              "tiling draws splits among them)", file=sys.stderr)
        return 1
    _print_table(read_metrics_json(out / "metrics.json"))
    print(f"\nResults in {out}/")
    print(f"  report       {out / 'report.html'}")
    print(f"  metrics      {out / 'metrics.json'}")
    print(f"  predictions  {out}/predictions_<cohort>_<protocol>.csv ({sum(1 for f in summary.files if f.name.startswith('predictions_'))} files)")
    if config.eval.heatmaps:
        print(f"  heatmaps     {out / 'heatmaps'}/<slide_id>.png, .geojson (QuPath), _scores.csv")
    return failure_status(bool(summary.failed_slides), args)


def _run_folds(config: PipelineConfig, args: argparse.Namespace) -> int:
    """Evaluate each fold as its own pipeline, then pool the folds: mean ± std across fixed-test folds, or the
    out-of-fold predictions of a cross-validation."""
    import dataclasses
    from pathlib import Path

    from wsi_pipeline.config.evaluation import ALL
    from wsi_pipeline.config.pipeline import with_eval
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.manifests.folds import fold_config, fold_runs

    runs = fold_runs(config.data.manifest)
    crossval = runs[0].crossval
    if crossval and not any(p.is_all for p in config.eval.protocols):
        # the out-of-fold predictions are the all-tiles protocol's
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, protocols=(ALL, *config.eval.protocols)))
    root = Path(config.eval.results) if config.eval.results is not None else Path(config.results_dir)
    methods = list(config.eval.methods) or None
    _check_folds_trained(config, runs, methods, args)
    for i, run in enumerate(runs):
        cfg = fold_config(config, run)
        where = f"repeat {run.repeat} fold {run.fold}" if run.repeats > 1 else f"fold {run.fold}"
        if not args.reevaluate and _evaluated(cfg, root / cfg.name, methods):
            print(f"{where} ({i + 1}/{len(runs)}): {cfg.name} already evaluated (results newer than its runs; "
                  "--reevaluate to redo)")
            continue
        print(f"{where} ({i + 1}/{len(runs)}): evaluating {cfg.name}")
        # cross-validation: intervals come from the pooled out-of-fold predictions, not from each small fold
        cfg = with_eval(cfg, results=root / cfg.name, bootstrap=0 if crossval else None)
        evaluate_pipeline(cfg, progress=not args.no_progress, cluster=cluster_from_args(args), retries=args.retries)
    from wsi_pipeline.training import distributed

    if not distributed.is_main():  # rank 0 pools and prints
        return 0
    if crossval:
        return _pool_crossval(config, runs, root, args)
    from wsi_pipeline.evaluation.folds import pool_folds
    from wsi_pipeline.export.metrics_json import read_metrics_json

    folds = [r.fold for r in runs]
    out = pool_folds(config, folds, results_dir=root)
    print(f"\nMean ± std across {len(folds)} folds:")
    _print_table(read_metrics_json(out / "metrics_folds.json"))
    print(f"\nCross-validation results in {out}/ (report.html, cv_table.csv, metrics_folds.json)")
    return 0


def _check_folds_trained(config: PipelineConfig, runs: list[FoldRun], methods: list[str] | None,
                         args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming every fold run that is not finished, before any fold is evaluated (the pooled
    table needs them all)."""
    from wsi_pipeline.evaluation.sets import trained_runs
    from wsi_pipeline.manifests.folds import fold_config

    missing = [why for run in runs for why in trained_runs(fold_config(config, run), methods)[1]]
    if missing:
        raise ValueError(
            f"{args.config}: eval --folds needs the finished runs of every fold of {config.data.manifest}; "
            f"{len(missing)} are not: {'; '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}. Nothing was "
            f"evaluated; finish them with `wsi-pipeline train --config {args.config} --folds`")


def _evaluated(cfg: PipelineConfig, out: Path, methods: list[str] | None) -> bool:
    """Whether fold pipeline ``cfg`` has results in ``out`` newer than every finished run they cover."""
    from wsi_pipeline.evaluation.sets import finished_since, trained_runs
    from wsi_pipeline.export.metrics_json import read_metrics_json

    metrics = out / "metrics.json"
    if not metrics.is_file():
        return False
    runs, _ = trained_runs(cfg, methods)
    if not runs:
        return False
    done = {m.method for m in read_metrics_json(metrics)}
    return all(m.name in done for m, _, _ in runs) and not finished_since(runs, metrics)


def _pool_crossval(config: PipelineConfig, runs: list[FoldRun], root: Path, args: argparse.Namespace) -> int:
    """Pool the out-of-fold predictions of every repeat and fold; print the table and where it is."""
    import pandas as pd

    from wsi_pipeline.evaluation.crossval import format_table, pool_crossval

    # every method evaluated on every fold, those named by --method now and the others earlier
    out = pool_crossval(config, runs, results_dir=root, n_boot=config.eval.bootstrap)
    table = pd.read_csv(out / "cv_table.csv")
    n_folds, n_rep = int(table["n_folds"].max()), int(table["n_repeats"].max())
    print(f"\n{n_folds}-fold cross-validation x {n_rep} repeat(s), out-of-fold predictions of the all-tiles protocol "
          f"(mean ± standard error over {'repeats' if n_rep > 1 else 'folds'}):")
    print(format_table(table, config.task))
    print(f"\nCross-validation results in {out}/ (report.html, cv_table.csv, oof_predictions.csv, cv_folds.csv)")
    return 0


#: The metrics the command prints (those a pipeline has), classification, survival, regression and patients.
_SHOWN = ("auc", "qwk", "accuracy", "auc_repeat_std", "localisation_auc", "c_index", "uno_c_index", "ibs", "logrank_p",
          "rmse", "mae", "pearson", "patient_auc", "patient_c_index", "patient_rmse")


def _print_table(records: list[Any]) -> None:
    cells: dict[tuple[str, str, str], dict[str, str]] = defaultdict(dict)
    look = {(r.method, r.seed, r.cohort, r.split, r.protocol, r.metric): r.value for r in records}
    for r in records:
        if r.seed != "mean" or r.metric not in _SHOWN:
            continue
        std = look.get((r.method, "std", r.cohort, r.split, r.protocol, r.metric))
        txt = "-" if math.isnan(r.value) else f"{r.value:.3f}"
        if std is not None and not math.isnan(std):
            txt += f"±{std:.3f}"
        cells[(r.method, f"{r.cohort} ({r.split})", r.protocol)][r.metric] = txt
    if not cells:
        return
    metrics = [m for m in _SHOWN if any(m in c for c in cells.values())]
    head = ["method", "cohort", "protocol", *metrics]
    rows = [[*k, *(v.get(m, "") for m in metrics)] for k, v in cells.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
