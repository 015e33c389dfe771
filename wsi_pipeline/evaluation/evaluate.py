"""The evaluation stage (``wsi-pipeline eval``): every trained seed of every method, on every test cohort.

Which slides are evaluated (:func:`evaluation_sets`)
----------------------------------------------------
The *training cohorts* are the ``cohort`` values of the manifest's ``train`` and ``val`` slides.

- internal test set: the ``test`` slides of a training cohort (``split`` recorded as ``"test"``);
- external cohort: every slide of a cohort with no ``train``/``val`` slide, whatever its split
  value (``split`` recorded as ``"external"``).

Slides of the training cohorts with split ``train``, ``val`` or empty are never evaluated.

Order of work (the model is fixed before any test slide is read)
----------------------------------------------------------------
For each method and each seed whose run has finished (``runs/<pipeline>/<method>/seed<k>/done``),
``best.pt`` (chosen on validation during training) is loaded first; only then are the test
stores opened. Each slide is embedded once and scored under every protocol of ``eval.protocols``
(:func:`~wsi_pipeline.inference.protocols.predict_protocols`), subsets seeded by ``eval.seed``
and the slide id, so every model sees the same subsets. A model's score under ``sub<k>x<R>`` is
the papers': the metric of each repeat over the cohort's slides, averaged over repeats (each
repeat's value kept in ``metrics.json``); ``ens<k>x<R>`` scores the slide probabilities averaged
over repeats instead (see :mod:`wsi_pipeline.inference.protocols`).

Outputs in ``results/<pipeline>/``
----------------------------------
``predictions_<cohort>_<protocol>.csv`` (all methods and seeds; per slide the mean and std of
the probabilities over repeats), ``metrics.json`` (metrics of each model, their mean/std over
seeds, bootstrap 95 % intervals of the seed mean as metrics ``<metric>_ci_low``/``<metric>_ci_high``
under seed ``"mean"``, and ``localisation_auc``; see :mod:`wsi_pipeline.export.metrics_json`),
``heatmaps/<slide_id>.{png,geojson}`` and ``heatmaps/<slide_id>_scores.csv`` for one model
(the method and seed with the best validation value recorded by training, i.e. the model chosen
on validation; the first evaluated run when no run recorded one; or ``heatmap_method``'s
seed best on validation), drawn with the ground-truth lesion outlines when the manifest has
them, ``report.html`` (led by the model chosen on validation), and the
resolved ``config.yaml``; for models that normalise stain (``data.stain``), ``stain.csv`` (per method
and slide: ``stain_normalised``, and ``stain_problem``, why a slide fell back to no normalisation).
With ``eval.methods`` (``--method``) only the named methods are scored, and the other methods' rows
and records written by an earlier ``eval`` are kept (:mod:`wsi_pipeline.evaluation.earlier_results`).

Prediction on new slides (``wsi-pipeline predict``, :func:`predict_slides`) shares the per-slide
scoring: tile a folder with the model's saved tiling parameters, embed once, aggregate, write
``predictions.csv`` and the same heatmap files.

``localisation_auc``: for slides with ground truth (manifest ``lesion_mask`` +
``mask_downsample`` columns, or a ``lesion`` array in the store), a tile is positive when at
least half its footprint is lesion; the ROC AUC (scikit-learn) of the all-tiles attention
against that truth is computed per slide (slides with both kinds of tile) and averaged over the
cohort's slides (a per-slide AUC is unaffected by attention scales that differ between slides).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from wsi_pipeline.data.store import StoreDamagedError, open_store, store_path
from wsi_pipeline.tasks.endpoint_metrics import PATIENT_PREFIX
from wsi_pipeline.evaluation.earlier_results import earlier_results, retrained_since
from wsi_pipeline.evaluation.endpoint_records import level_bootstrap, level_records, pool_patients, stack_repeats
from wsi_pipeline.evaluation.localisation import LesionMaskError
from wsi_pipeline.devices import resolve_device
from wsi_pipeline.evaluation.scoring import label_of, score_slide
from wsi_pipeline.evaluation.sets import EvalSet, evaluation_sets, trained_runs, validation_scores
from wsi_pipeline.export.metrics_json import MetricRecord, write_metrics_json
from wsi_pipeline.tasks import get_task
from wsi_pipeline.export.predictions import endpoint_columns, endpoint_row, predictions_path, write_predictions
from wsi_pipeline.export.report import best_on_validation
from wsi_pipeline.failures import slide_failures
from wsi_pipeline.config.evaluation import EvalConfig, EvalProtocol, parse_protocols
from wsi_pipeline.methods.models import random_encoder_note
from wsi_pipeline.jobs.slide_jobs import run_slides
from wsi_pipeline.training import distributed
from wsi_pipeline.types import ValidationScore
from wsi_pipeline.output_dirs import check_output_dir
from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig, with_eval

__all__ = ["EvalSummary", "evaluate_pipeline"]

log = logging.getLogger(__name__)


@dataclass
class EvalSummary:
    """What :func:`evaluate_pipeline` did: the results folder, files written, models and slides."""

    results_dir: Path
    files: list[Path] = field(default_factory=list)
    models: list[tuple[str, int]] = field(default_factory=list)
    n_slides: int = 0
    missing_stores: list[str] = field(default_factory=list)
    #: slides that could not be scored (a damaged tile store), with why; the others were scored
    failed_slides: dict[str, str] = field(default_factory=dict)
    skipped_runs: list[str] = field(default_factory=list)
    #: one line per method whose encoder started from random weights (also logged and in the report)
    random_encoders: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _HeatmapChoice:
    """Which model draws the heatmaps: ``run`` (method, seed), and the validation values it was chosen on."""

    run: tuple[str, int] | None
    val_scores: dict[tuple[str, int], ValidationScore]
    best_val: tuple[str, int] | None


@dataclass
class _Collected:
    """What the scoring pass gathers across models and cohorts."""

    rows: dict[tuple[str, str], list[dict]] = field(default_factory=lambda: defaultdict(list))  # (cohort, protocol) -> prediction rows
    records: list[MetricRecord] = field(default_factory=list)
    gallery: list[dict] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    # (method, cohort, split, protocol, metric prefix) -> seed -> (targets, per-repeat scores, survival reference):
    # survival and regression slides, and patients of every task (eval.level: patient)
    levels: dict[tuple[str, str, str, str, str], dict[int, tuple]] = field(default_factory=lambda: defaultdict(dict))
    columns: dict[str, list[str]] = field(default_factory=dict)  # the predictions CSVs' columns (the task's)
    stain: dict[tuple[str, str], dict] = field(default_factory=dict)  # (method, slide_id) -> stain report row


def evaluate_pipeline(
    config: PipelineConfig,
    *,
    progress: bool = True,
    cluster: Any = None,
    retries: int | None = None,
    methods: Sequence[str] | None = None,
    device: str | None = None,
    batch_size: int | None = None,
    heatmaps: bool | None = None,
    heatmap_method: str | None = None,
    heatmap_mode: str | None = None,
    n_boot: int | None = None,
    results_dir: str | os.PathLike[str] | None = None,
) -> EvalSummary:
    """Evaluate every finished run of a pipeline and write ``results/<pipeline>/`` (module docstring).

    Parameters
    ----------
    config : the pipeline; its ``eval`` section (:class:`~wsi_pipeline.config.evaluation.EvalConfig`)
        holds every setting of the stage: which methods, device, batch size, heatmaps (which method,
        colour mode), bootstrap resamples, output folder.
    progress : tqdm bars over slides.
    cluster, retries : score the slides on a Dask cluster (``local[:N]``, ``tcp://HOST:PORT``, ``slurm``,
        a :class:`~wsi_pipeline.jobs.cluster.ClusterSpec` or a ``distributed.Client``), one task per
        slide, each model sent once to every worker; the workers must see the stores and the results
        folder (heatmaps are written by them). The metrics and predictions are computed here from
        the returned scores, as without a cluster.
    methods, device, batch_size, heatmaps, heatmap_method, heatmap_mode, n_boot, results_dir : kept for
        callers written before ``eval`` held them: each given one replaces ``eval.methods``, ``eval.device``,
        ``eval.batch_size``, ``eval.heatmaps``, ``eval.heatmap_method``, ``eval.heatmap_mode``,
        ``eval.bootstrap``, ``eval.results`` (:func:`~wsi_pipeline.config.pipeline.with_eval`, checked there).

    Under torchrun (``torchrun --nproc_per_node=G -m wsi_pipeline.cli.main eval ...``) each rank
    scores a shard of every set's slides on its own device; rank 0 writes the results.

    Raises
    ------
    FileNotFoundError : no finished run (train first) or no manifest.
    ValueError : the manifest has no test slides and no external cohort.
    """
    config = with_eval(config, methods=methods, device=device, batch_size=batch_size, heatmaps=heatmaps,
                       heatmap_method=heatmap_method, heatmap_mode=heatmap_mode, bootstrap=n_boot, results=results_dir)
    ev = config.eval
    methods, batch_size, heatmaps, heatmap_method, heatmap_mode = list(ev.methods) or None, ev.batch_size, ev.heatmaps, ev.heatmap_method, ev.heatmap_mode
    t0 = time.perf_counter()
    out = Path(ev.results) if ev.results is not None else Path(config.results_dir) / config.name
    summary = EvalSummary(results_dir=out)
    if distributed.is_main():
        check_output_dir(out, ("heatmaps",), what="results folder")  # before any model is loaded
    sets = _sets_to_score(config)  # the manifest is checked first: a bad one names itself, not "train first"
    runs = _finished_runs(config, methods, summary)
    # named methods only: the others' earlier results stay in the folder (read now: a damaged file stops us first)
    earlier = earlier_results(out, {m.name for m, _, _ in runs}) if methods and distributed.is_main() else None
    summary.random_encoders = [n for n in (random_encoder_note(m) for m in {m.name: m for m, _, _ in runs}.values()) if n]
    if distributed.is_main():
        for note in summary.random_encoders:
            log.warning(note)
    protocols = parse_protocols(config.eval.protocols)
    dev = str(distributed.device_for(resolve_device(ev.device)))
    choice = _choose_heatmap_run(runs, heatmap_method)
    if heatmaps and config.data.bags == "patient":
        log.info("data.bags: patient: no heatmaps (a patient's bag spans several slides; draw them with data.bags: slide)")
        heatmaps = False
    got = _Collected()
    for method, seed, run_dir in runs:
        make_heatmaps = heatmaps and choice.run == (method.name, seed)
        _evaluate_run(config, method, seed, run_dir, sets, protocols, got, summary, device=dev, batch_size=batch_size,
                      heatmap_dir=out / "heatmaps" if make_heatmaps else None, heatmap_mode=heatmap_mode, progress=progress,
                      cluster=cluster, retries=retries)
    if not distributed.is_main():  # rank 0 writes the results
        return summary
    n_boot = ev.bootstrap
    if n_boot > 0:
        for (method, cohort, split, pname, prefix), by_seed in got.levels.items():
            got.records += level_bootstrap(method, cohort, split, pname, config.task, by_seed, n_boot=n_boot,
                                           seed=int(config.eval.seed), n_classes=config.label_classes, prefix=prefix)
    if earlier is not None and earlier.methods:
        log.info("kept the earlier results of %s in %s (not evaluated now)", ", ".join(earlier.methods), out)
        newer = retrained_since(config, out, earlier.methods)
        if newer:
            log.warning("kept results in %s predate the runs %s, finished since: evaluate them again (wsi-pipeline eval "
                        "--method NAME)", out, ", ".join(newer))
        for key, rows in earlier.rows.items():
            got.rows[key] += rows
        got.records += earlier.records
        got.stain.update(earlier.stain)
    summary.missing_stores = sorted(got.missing)
    summary.failed_slides = dict(sorted(got.failed.items()))
    summary.n_slides = sum(len(s.slides) for s in sets) - len(got.missing) - len(got.failed)
    _write_results(config, out, got, protocols, choice, summary, heatmaps=heatmaps, heatmap_method=heatmap_method)
    summary.seconds = time.perf_counter() - t0
    return summary


def _finished_runs(config: PipelineConfig, methods: Sequence[str] | None, summary: EvalSummary) -> list[tuple[Any, int, Path]]:
    """The finished runs to evaluate (unfinished ones are logged and listed in ``summary.skipped_runs``)."""
    runs, skipped = trained_runs(config, methods)
    summary.skipped_runs = skipped
    for s in skipped:
        log.warning("skipping run %s", s)
    if not runs:
        raise FileNotFoundError(
            f"no finished run of pipeline {config.name!r} under {Path(config.runs_dir) / config.name} "
            f"({'; '.join(skipped) or 'no methods'}); train first: wsi-pipeline train --config <yaml>"
        )
    return runs


def _sets_to_score(config: PipelineConfig) -> list[EvalSet]:
    """The manifest's internal test sets and external cohorts (:func:`~wsi_pipeline.evaluation.sets.evaluation_sets`)."""
    from wsi_pipeline.manifests.schema import read_manifest

    manifest = read_manifest(config.data.manifest, n_classes=config.label_classes)
    sets = evaluation_sets(manifest)
    if not sets:
        raise ValueError(
            f"{config.data.manifest}: no slide to evaluate: no `test` split in the training cohorts and no "
            "external cohort (a cohort value without train/val slides); set split=test on held-out slides"
        )
    return sets


def _choose_heatmap_run(runs: Sequence[tuple[Any, int, Path]], heatmap_method: str | None) -> _HeatmapChoice:
    """Heatmaps of the model chosen on validation (never on the test slides), unless a method is asked for:
    then that method's seed best on validation, else its first finished seed."""
    val_scores = validation_scores(runs)
    best_val = best_on_validation(val_scores)
    if heatmap_method:
        hm_run = best_on_validation({k: v for k, v in val_scores.items() if k[0] == heatmap_method})
        hm_run = hm_run or next(((m.name, s) for m, s, _ in runs if m.name == heatmap_method), None)
    else:
        hm_run = best_val or (runs[0][0].name, runs[0][1])
    if heatmap_method and hm_run is None:
        raise ValueError(f"heatmap_method {heatmap_method!r} has no finished run; finished: {sorted({m.name for m, _, _ in runs})}")
    return _HeatmapChoice(hm_run, val_scores, best_val)


def _evaluate_run(config: PipelineConfig, method: MethodConfig, seed: int, run_dir: Path, sets: Sequence[EvalSet], protocols: list[EvalProtocol],
                  got: _Collected, summary: EvalSummary, *, device: str, batch_size: int | None, heatmap_dir: Path | None,
                  heatmap_mode: str, progress: bool, cluster: Any = None, retries: int | None = None) -> None:
    """Score every evaluation set with one trained run; the model is fixed by validation (``best.pt``)
    before any test slide is opened."""
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.training.rundir import run_config

    model = load_trained_model(run_dir, device=device, which="best", expected=run_config(config, method, seed))
    summary.models.append((method.name, seed))
    log.info("evaluating %s seed %d (best.pt from epoch %d)", method.name, seed, model.epoch)
    bs = int(batch_size or getattr(method, "chunk_size", 64) or 64)
    ref = _training_reference(config, model, bs, device) if model.endpoint.definition.uses_training_reference else None
    task = _ScoreTask(config, protocols, title=f"attention, {method.name} seed {seed}", batch_size=bs, device=device,
                      heatmap_dir=heatmap_dir, heatmap_mode=heatmap_mode)
    for es in sets:
        scorer = _SetScorer(method.name, seed, es, protocols, got, model.endpoint, ref, config.eval, n_classes=config.label_classes)
        items = [row for _, row in es.slides.iterrows()]
        if config.data.bags == "patient":
            items = _patient_rows(items)
        desc = f"{method.name} s{seed} {es.cohort}"
        if distributed.current().enabled and cluster is None:
            _score_on_ranks(items, task, model, scorer, desc=desc, progress=progress)
        else:
            run_slides(items, task, slide_id=_row_slide_id, broadcast=model, cluster=cluster, retries=retries, desc=desc,
                       progress=progress, leave=False, on_result=scorer.collect)
        scorer.add_records(config.label_classes)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _patient_rows(rows: Sequence[pd.Series]) -> list[pd.Series]:
    """``data.bags: patient``: one row per patient (first-slide order), ``slide_id`` = the patient, ``slides`` its
    slides, ``label`` the highest of theirs, the survival/regression target the patient's (its first slide's)."""
    groups: dict[str, list[pd.Series]] = {}
    for r in rows:
        p = r.get("patient_id")
        groups.setdefault(str(p) if isinstance(p, str) and p else str(r["slide_id"]), []).append(r)
    out = []
    for patient, members in groups.items():
        row = members[0].copy()
        labels = [m["label"] for m in members if not pd.isna(m["label"])]
        row["label"] = max(labels) if labels else pd.NA
        row["slide_id"], row["patient_id"], row["path"] = patient, patient, ""
        row["slides"] = [str(m["slide_id"]) for m in members]
        out.append(row)
    return out


def _training_reference(config: PipelineConfig, model: Any, batch_size: int, device: str) -> Any:
    """What the task's metrics take from the training split (:meth:`~wsi_pipeline.tasks.base.Task.training_reference`),
    from its targets and the model's scores of its slides (all tiles). Survival: the
    :class:`~wsi_pipeline.tasks.endpoint_metrics.SurvivalReference` (censoring distribution, horizons, the median
    training risk that splits every cohort into low and high risk, a Cox model's Breslow baseline)."""
    from wsi_pipeline.data.bags import slides_for_split
    from wsi_pipeline.evaluation.scoring import saved_frozen_features
    from wsi_pipeline.config.evaluation import ALL
    from wsi_pipeline.inference.protocols import predict_protocols
    from wsi_pipeline.manifests.schema import read_manifest

    manifest = read_manifest(config.data.manifest)
    train = slides_for_split(manifest, "train", config.data.tiles_dir or "", task=config.task)
    if config.data.bags == "patient":
        from wsi_pipeline.data.patient_bags import PatientStore, patient_units

        train = patient_units(train)
    kind = model.endpoint.definition
    targets, scores = [], []
    for s in train:
        try:
            if config.data.features is not None:  # precomputed feature files (data.features)
                from wsi_pipeline.training.precomputed import slide_features

                store: Any = slide_features(config, s.slide_id)
            else:
                store = PatientStore(s.slide_id, [p.store for p in s.parts]) if s.parts else open_store(s.store)
        except (FileNotFoundError, ValueError):
            continue
        if len(store) == 0:
            continue
        feats = saved_frozen_features(model, config, store)
        pred = predict_protocols(model.encoder, model.aggregator, store if feats is None else (feats, store.grid), [ALL],
                                 slide_id=s.slide_id, batch_size=batch_size, device=device, with_attention=False)["all"]
        targets.append(s.y)
        scores.append(float(model.endpoint.scores(pred.repeat_logits)[kind.score_key].mean()))
    return kind.training_reference(model.endpoint, targets, scores, horizons=config.eval.horizons)


def _row_slide_id(mrow: pd.Series) -> str:
    return str(mrow["slide_id"])


def _score_on_ranks(items: Sequence[pd.Series], task: _ScoreTask, model: Any, scorer: _SetScorer, *, desc: str,
                    progress: bool) -> None:
    """Under torchrun: every rank scores its shard of the slides (``rank, rank + G, ...``); the rows are
    gathered and filed in slide order on every rank, so rank 0 writes what one process would."""
    mine = distributed.shard(len(items))
    rows = run_slides([items[i] for i in mine], task, slide_id=_row_slide_id, broadcast=model, desc=desc,
                      progress=progress and distributed.is_main(), leave=False)
    for row in distributed.gather_in_order(mine, rows):
        scorer.collect(row)


@dataclass(frozen=True)
class _ScoreTask:
    """The job runner's work per slide (:func:`wsi_pipeline.jobs.slide_jobs.run_one`): score one slide with
    the model it is given (``broadcast``: sent once to each Dask worker). Pure, so it can run on a
    worker: the row carries the score back; a slide whose store is missing or empty is ``skipped``, a bad
    slide ``failed`` (:func:`_bad_slide_row`); a bug stops the run (:mod:`wsi_pipeline.failures`)."""

    config: PipelineConfig
    protocols: list[EvalProtocol]
    title: str
    batch_size: int
    device: str
    heatmap_dir: Path | None
    heatmap_mode: str

    def __call__(self, mrow: pd.Series, row: dict[str, Any], model: Any) -> None:
        with slide_failures(lambda err: _bad_slide_row(row, err)):  # a bad slide fails alone; a bug stops the run
            self._score(mrow, row, model)
        if row["status"] != "ok":
            return
        row["label"] = label_of(mrow["label"])
        row["target"] = get_task(self.config.task).manifest_target(mrow)
        patient = mrow.get("patient_id")
        row["patient_id"] = str(patient) if isinstance(patient, str) and patient else str(mrow["slide_id"])

    def _score(self, mrow: pd.Series, row: dict[str, Any], model: Any) -> None:
        if self.config.data.features is not None:  # precomputed feature files (data.features)
            from wsi_pipeline.training.precomputed import slide_features

            store: Any = slide_features(self.config, row["slide_id"], mrow.get("mpp"))
            if len(store) == 0:
                row.update(status="skipped", error=f"its feature file {store.path} has no rows")
                return
            row["score"] = score_slide(
                model, self.config, store, mrow, self.protocols, seed=self.config.eval.seed, batch_size=self.batch_size,
                device=self.device, heatmap_dir=self.heatmap_dir, heatmap_mode=self.heatmap_mode, title=self.title)
            return
        tiles = Path(str(self.config.data.tiles_dir))
        if "slides" in mrow.index:  # a patient bag (data.bags: patient)
            from wsi_pipeline.data.patient_bags import PatientStore

            store = PatientStore(row["slide_id"], [store_path(tiles, s) for s in mrow["slides"]])
        else:
            store = open_store(store_path(tiles, row["slide_id"]))
        if len(store) == 0:
            row.update(status="skipped", error=f"its tile store {store.path} has no tiles")
            return
        row["score"] = score_slide(
            model, self.config, store, mrow, self.protocols, seed=self.config.eval.seed, batch_size=self.batch_size,
            device=self.device, heatmap_dir=self.heatmap_dir, heatmap_mode=self.heatmap_mode, title=self.title)


def _bad_slide_row(row: dict[str, Any], err: BaseException) -> None:
    """Eval's row for a slide error (:mod:`wsi_pipeline.failures`): a missing store, or a value that makes it no
    slide to score (no label, ...) is ``skipped``; a damaged store or lesion mask, or any other slide error,
    ``failed`` by name (the other slides are scored)."""
    if isinstance(err, (FileNotFoundError, ValueError)) and not isinstance(err, (StoreDamagedError, LesionMaskError)):
        row.update(status="skipped", error=str(err))
    else:
        row.update(status="failed", error=str(err))


class _SetScorer:
    """One model on one evaluation set, in this process: :meth:`collect` files each slide's row (from
    :class:`_ScoreTask`, here or on a worker), :meth:`add_records` the set's metrics once all are in.

    A skipped slide (store missing or empty) is logged once per slide across models. Every task's slides
    (the task's :meth:`~wsi_pipeline.tasks.base.Task.slide_scores`, rows by its
    :meth:`~wsi_pipeline.tasks.base.Task.prediction_row`), and patients (``eval.level: patient``), are recorded
    by :func:`~wsi_pipeline.evaluation.endpoint_records.level_records`.
    """

    def __init__(self, method: str, seed: int, es: EvalSet, protocols: list[EvalProtocol], got: _Collected,
                 endpoint: Any = None, ref: Any = None, eval_cfg: EvalConfig | None = None, n_classes: int | None = None) -> None:
        self.method, self.seed, self.es, self.protocols, self.got = method, seed, es, protocols, got
        self.n_classes = n_classes  # data.n_classes of a task with classes (the predictions CSV's prob_<c> columns)
        self.endpoint, self.ref, self.eval_cfg = endpoint, ref, eval_cfg
        self.task = endpoint.task if endpoint is not None else "classification"
        self.kind = get_task(self.task)
        self.labels: list[Any] = []
        self.patients: list[str] = []
        self.scores: dict[str, list[dict[str, np.ndarray]]] = {p.name: [] for p in protocols}
        self.loc: list[float] = []

    def collect(self, row: dict[str, Any]) -> None:
        """File a scored slide's predictions, label, localisation and heatmap."""
        if row["status"] == "skipped":
            if row["slide_id"] not in self.got.missing:
                log.warning("slide %s skipped: %s", row["slide_id"], row["error"])
            self.got.missing.add(row["slide_id"])
            return
        if row["status"] == "failed":  # a bad slide (or a Dask worker that kept dying): named, the others scored
            if row["slide_id"] not in self.got.failed:
                log.error("slide %s not scored: %s", row["slide_id"], row["error"])
            self.got.failed[row["slide_id"]] = row["error"]
            return
        sid, res, es = row["slide_id"], row["score"], self.es
        patient = row.get("patient_id") or sid
        lab = self.kind.target_of(row["label"], row.get("target"))
        if res.stain_normalised is not None:
            self.got.stain[(self.method, sid)] = {"method": self.method, "slide_id": sid, "cohort": es.cohort,
                                                  "stain_normalised": res.stain_normalised, "stain_problem": res.stain_problem}
        for pname, pred in res.preds.items():
            scores = self.kind.slide_scores(self.endpoint, pred)
            edges = () if self.endpoint is None else self.endpoint.edges
            self.got.rows[(es.cohort, pname)].append(endpoint_row(
                task=self.task, slide_id=sid, cohort=es.cohort, target=lab, scores=scores, n_tiles=pred.n_tiles,
                protocol=pname, n_repeats=pred.n_repeats, method=self.method, seed=self.seed, patient_id=patient,
                threshold=None if self.ref is None else self.ref.threshold, edges=edges))
            self.got.columns.setdefault(self.task, endpoint_columns(self.task, edges, self.n_classes))
            if lab is not None:
                self.scores[pname].append(scores)
        if lab is not None:
            self.labels.append(lab)
            self.patients.append(patient)
        if res.localisation is not None and not math.isnan(res.localisation):
            self.loc.append(res.localisation)
        if res.heatmap is not None:
            self.got.gallery.append({"slide_id": sid, "cohort": es.cohort, "label": lab,
                                     "png": res.heatmap, "probs": res.preds[self.protocols[0].name].probs,
                                     "localisation": res.localisation, "outline": res.outlined})

    def add_records(self, n_classes: int | None) -> None:
        """The set's metric records under every protocol (slides, and patients with ``eval.level: patient``),
        and its mean localisation AUC."""
        es, got = self.es, self.got
        for p in self.protocols:
            repeats = p.repeats if p.per_repeat else 1
            stacked = stack_repeats(self.scores[p.name], repeats) if self.scores[p.name] else [{}] * repeats
            recs, used = level_records(self.method, self.seed, es.cohort, es.split, p, self.task, self.labels, stacked,
                                       n_classes=n_classes, ref=self.ref)
            got.records += recs
            got.levels[(self.method, es.cohort, es.split, p.name, "")][self.seed] = (list(self.labels), used, self.ref)
            if self.eval_cfg is not None and self.eval_cfg.level == "patient" and self.labels:
                ids, targets, pooled = pool_patients(self.patients, self.labels, stacked, self.eval_cfg.patient_pool, self.task)
                recs, used = level_records(self.method, self.seed, es.cohort, es.split, p, self.task, targets, pooled,
                                           n_classes=n_classes, ref=self.ref, prefix=PATIENT_PREFIX)
                got.records += recs
                got.levels[(self.method, es.cohort, es.split, p.name, PATIENT_PREFIX)][self.seed] = (targets, used, self.ref)
        if self.loc:
            got.records.append(MetricRecord(self.method, self.seed, es.cohort, es.split, "all", "localisation_auc", float(np.mean(self.loc))))
            got.records.append(MetricRecord(self.method, self.seed, es.cohort, es.split, "all", "localisation_n_slides", float(len(self.loc))))


def _write_results(config: PipelineConfig, out: Path, got: _Collected, protocols: list[EvalProtocol], choice: _HeatmapChoice,
                   summary: EvalSummary, *, heatmaps: bool, heatmap_method: str | None) -> None:
    """Write the predictions files, ``metrics.json``, the resolved ``config.yaml`` and ``report.html``."""
    from wsi_pipeline.config.pipeline import save_config
    from wsi_pipeline.export.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    columns = got.columns.get(config.task)
    for (cohort, pname), rr in sorted(got.rows.items()):
        summary.files.append(write_predictions(predictions_path(out, cohort, pname), rr, config.label_classes, columns=columns))
    summary.files.append(write_metrics_json(out / "metrics.json", got.records))
    stain_table = None
    if got.stain:  # per method and slide: normalised, or why it fell back (one row per slide, whatever the seeds)
        from wsi_pipeline.io_atomic import write_text_atomic

        cols = ["method", "slide_id", "cohort", "stain_normalised", "stain_problem"]
        stain_table = pd.DataFrame([got.stain[k] for k in sorted(got.stain)], columns=cols)
        summary.files.append(write_text_atomic(out / "stain.csv", stain_table.to_csv(index=False)))
    summary.files.append(save_config(config, out / "config.yaml"))
    hm_run = choice.run
    all_rows = pd.DataFrame([r for rr in got.rows.values() for r in rr])
    n_classes = config.label_classes  # the task's classes (Task.classes): the class report draws them
    if n_classes is None:
        from wsi_pipeline.export.endpoint_report import write_endpoint_report

        summary.files.append(write_endpoint_report(
            out / "report.html", pipeline=config.name, task=config.task, predictions=all_rows,
            metrics_path=out / "metrics.json", gallery=got.gallery, protocols=[p.name for p in protocols],
            validation=choice.val_scores, heatmap_run=hm_run if heatmaps else None))
        return
    summary.files.append(write_report(
        out / "report.html", pipeline=config.name, predictions=all_rows, metrics_path=out / "metrics.json",
        n_classes=n_classes, gallery=got.gallery, heatmap_model=f"{hm_run[0]} seed {hm_run[1]}" if hm_run and heatmaps else None,
        protocols=[p.name for p in protocols], validation=choice.val_scores,
        heatmap_run=hm_run if heatmaps else None, heatmap_chosen_on_validation=bool(choice.best_val and not heatmap_method),
        stain=stain_table, notes=summary.random_encoders,
        histories={f"{m} seed {sd}": config.run_dir(m, sd) / "history.csv" for m, sd in summary.models},
    ))
