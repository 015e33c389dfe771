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
resolved ``config.yaml``.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from wsi_pipeline.config.tiling import StoreTiling, TilingConfig, tiler_config
from wsi_pipeline.inference.metrics import METRICS, bootstrap_interval, compute_metrics, compute_repeat_metrics
from wsi_pipeline.inference.protocols import Protocol, SlidePrediction, parse_protocols, predict_protocols, repeat_probs
from wsi_pipeline.export.metrics_json import MetricRecord, write_metrics_json
from wsi_pipeline.export.predictions import prediction_row, predictions_path, write_predictions
from wsi_pipeline.export.report import best_on_validation
from wsi_pipeline.data.store import TileStore, open_store, store_path
from wsi_pipeline.progress import progress_bar
from wsi_pipeline.io_atomic import write_text_atomic

__all__ = [
    "EvalSet",
    "EvalSummary",
    "PredictSummary",
    "evaluation_sets",
    "trained_runs",
    "localisation_auc",
    "evaluate_pipeline",
    "predict_slides",
    "validation_scores",
    "best_on_validation",
]

log = logging.getLogger(__name__)

EXTERNAL = "external"


@dataclass
class EvalSet:
    """Slides scored together: one cohort, internal test split or external."""

    cohort: str
    split: str
    slides: pd.DataFrame


@dataclass
class EvalSummary:
    """What :func:`evaluate_pipeline` did: the results folder, files written, models and slides."""

    results_dir: Path
    files: list[Path] = field(default_factory=list)
    models: list[tuple[str, int]] = field(default_factory=list)
    n_slides: int = 0
    missing_stores: list[str] = field(default_factory=list)
    skipped_runs: list[str] = field(default_factory=list)
    seconds: float = 0.0


def evaluation_sets(manifest: pd.DataFrame) -> list[EvalSet]:
    """Split a manifest into the internal test set(s) and external cohorts (see the module docstring)."""
    cohort = manifest["cohort"].astype("string").fillna("")
    split = manifest["split"].astype("string").fillna("")
    training = set(cohort[split.isin(["train", "val"])])
    sets = []
    for c in sorted(set(cohort)):
        in_c = cohort == c
        if c in training:
            rows = manifest[in_c & (split == "test")]
            if len(rows):
                sets.append(EvalSet(c or "default", "test", rows))
        else:
            sets.append(EvalSet(c or "default", EXTERNAL, manifest[in_c]))
    return sets


def trained_runs(config: Any, methods: Sequence[str] | None = None) -> tuple[list[tuple[Any, int, Path]], list[str]]:
    """``([(method, seed, run_dir)], [skipped reasons])`` for every finished run of the config's methods."""
    wanted = list(methods) if methods else [m.name for m in config.methods]
    known = {m.name: m for m in config.methods}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"method(s) {unknown} not in pipeline {config.name!r}; its methods: {list(known)}")
    runs, skipped = [], []
    for name in wanted:
        for seed in config.seeds:
            d = config.run_dir(name, seed)
            if (d / "done").is_file() and (d / "best.pt").is_file():
                runs.append((known[name], int(seed), d))
            elif (d / "best.pt").is_file():
                skipped.append(f"{d}: unfinished (no `done` marker); finish it with `wsi-pipeline train`")
            else:
                skipped.append(f"{d}: not trained")
    return runs, skipped


def localisation_auc(attention: np.ndarray, lesion_fraction: np.ndarray, threshold: float = 0.5) -> float:
    """ROC AUC (scikit-learn) of tile attention against ``lesion_fraction >= threshold``; nan if one class only."""
    from sklearn.metrics import roc_auc_score

    truth = np.asarray(lesion_fraction) >= threshold
    if truth.all() or not truth.any():
        return math.nan
    return float(roc_auc_score(truth, np.asarray(attention, dtype=np.float64)))


def _lesion_fraction(row: pd.Series, store: TileStore, extent: float) -> np.ndarray | None:
    mask_path = row.get("lesion_mask")
    if isinstance(mask_path, str) and mask_path and os.path.isfile(mask_path):
        from wsi_pipeline.synthetic.truth import read_mask, tile_lesion_fraction

        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return tile_lesion_fraction(read_mask(mask_path), ds, store.coords, extent)
    if "lesion" in store.group:
        return store.array("lesion").astype(np.float64).reshape(-1)
    return None


def _lesion_outline(row: pd.Series, store: TileStore, extent: float, level0: tuple[int, int], shape: tuple[int, int]) -> np.ndarray | None:
    """The slide's ground-truth lesions on the thumbnail's grid (bool (h, w)), or None without truth.

    From the manifest's ``lesion_mask`` + ``mask_downsample``, else from a store's ``lesion``
    array (tiles at least half lesion).
    """
    from wsi_pipeline.export.heatmap import mask_to_thumbnail, tile_rects

    mask_path = row.get("lesion_mask")
    if isinstance(mask_path, str) and mask_path and os.path.isfile(mask_path):
        from wsi_pipeline.synthetic.truth import read_mask

        ds = float(row.get("mask_downsample", 1.0) or 1.0)
        return mask_to_thumbnail(read_mask(mask_path), ds, level0, shape)
    if "lesion" in store.group:
        pos = store.array("lesion").astype(np.float64).reshape(-1) >= 0.5
        h, w = shape
        x0, y0, x1, y1 = tile_rects(store.coords[pos], extent, (w / level0[0], h / level0[1]), shape)
        out = np.zeros(shape, bool)
        for a, b, c, d in zip(x0, y0, x1, y1):
            out[b:d, a:c] = True
        return out
    return None


def validation_scores(runs: Sequence[tuple[Any, int, Path]]) -> dict[tuple[str, int], tuple[str, float]]:
    """``{(method, seed): (select metric, best validation value)}`` from each finished run's ``done`` record.

    Runs without a finite recorded value (no validation split) are left out.
    """
    import json

    out = {}
    for method, seed, run_dir in runs:
        try:
            rec = json.loads((Path(run_dir) / "done").read_text() or "{}")
        except (OSError, ValueError):
            continue
        v = rec.get("best_value") if isinstance(rec, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[(method.name, int(seed))] = (str(rec.get("select_metric", "")), float(v))
    return out


def _label(v: Any) -> int | None:
    return None if v is None or pd.isna(v) else int(v)


def _resolve_device(device: str) -> str:
    from wsi_pipeline.devices import resolve_device

    return str(resolve_device(device))


def _frozen_features(model: Any, config: Any, store: TileStore) -> torch.Tensor | None:
    """Precomputed features of a frozen method when an up-to-date file exists (saves re-embedding)."""
    if getattr(model.method, "strategy", None) != "frozen":
        return None
    from wsi_pipeline.inference.features import features_path, read_features, store_fingerprint
    from wsi_pipeline.inference.models import frozen_features_dir

    path = features_path(frozen_features_dir(model.method, config.data.features_dir), store.slide_id)
    if not path.is_file():
        return None
    try:
        feats, coords, attrs = read_features(path)
    except (OSError, ValueError) as e:
        log.warning("ignoring feature file %s (%s); embedding the store instead", path, e)
        return None
    if attrs.get("store_fingerprint") != store_fingerprint(store) or len(feats) != len(store):
        log.info("feature file %s does not match store %s; embedding the store instead", path, store.path)
        return None
    return torch.from_numpy(feats)


def evaluate_pipeline(
    config: Any,
    *,
    methods: Sequence[str] | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    heatmaps: bool = True,
    heatmap_method: str | None = None,
    heatmap_mode: str = "rank",
    n_boot: int | None = None,
    results_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> EvalSummary:
    """Evaluate every finished run of a pipeline and write ``results/<pipeline>/`` (module docstring).

    Parameters
    ----------
    config : a :class:`~wsi_pipeline.config.pipeline.PipelineConfig`.
    methods : evaluate only these methods (default: all of the config's).
    device : ``auto``, ``cpu``, ``cuda``...
    batch_size : tiles per encoder call (default: each method's ``chunk_size``).
    heatmaps : write per-slide heatmaps, scores CSV and GeoJSON for one model.
    heatmap_method : method whose seed best on validation makes the heatmaps (default: the
        method and seed best on validation across all runs; see the module docstring).
    heatmap_mode : ``rank`` (default), ``minmax`` or ``raw``.
    n_boot : bootstrap resamples for the 95 % intervals (0: no intervals); None = ``eval.bootstrap``.
    results_dir : default ``<config.results_dir>/<config.name>``.
    progress : tqdm bars over slides.

    Raises
    ------
    FileNotFoundError : no finished run (train first) or no manifest.
    ValueError : the manifest has no test slides and no external cohort.
    """
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.inference.checkpoint import load_trained_model

    t0 = time.perf_counter()
    n_classes = int(config.data.n_classes)
    out = Path(results_dir) if results_dir is not None else Path(config.results_dir) / config.name
    summary = EvalSummary(results_dir=out)
    runs, skipped = trained_runs(config, methods)
    summary.skipped_runs = skipped
    for s in skipped:
        log.warning("skipping run %s", s)
    if not runs:
        raise FileNotFoundError(
            f"no finished run of pipeline {config.name!r} under {Path(config.runs_dir) / config.name} "
            f"({'; '.join(skipped) or 'no methods'}); train first: wsi-pipeline train --config <yaml>"
        )
    manifest = read_manifest(config.data.manifest, n_classes=n_classes)
    sets = evaluation_sets(manifest)
    if not sets:
        raise ValueError(
            f"{config.data.manifest}: no slide to evaluate: no `test` split in the training cohorts and no "
            "external cohort (a cohort value without train/val slides); set split=test on held-out slides"
        )
    protocols = parse_protocols(config.eval.protocols)
    dev = _resolve_device(device)
    # heatmaps of the model chosen on validation (never on the test slides), unless one is asked for
    val_scores = validation_scores(runs)
    best_val = best_on_validation(val_scores)
    if heatmap_method:  # that method's seed best on validation, else its first finished seed
        hm_run = best_on_validation({k: v for k, v in val_scores.items() if k[0] == heatmap_method})
        hm_run = hm_run or next(((m.name, s) for m, s, _ in runs if m.name == heatmap_method), None)
    else:
        hm_run = best_val or (runs[0][0].name, runs[0][1])
    if heatmap_method and hm_run is None:
        raise ValueError(f"heatmap_method {heatmap_method!r} has no finished run; finished: {sorted({m.name for m, _, _ in runs})}")

    rows: dict[tuple[str, str], list[dict]] = defaultdict(list)  # (cohort, protocol) -> prediction rows
    records: list[MetricRecord] = []
    probs_by: dict[tuple[str, str, str, str], dict[int, tuple[np.ndarray, np.ndarray]]] = defaultdict(dict)
    gallery: list[dict] = []
    missing: set[str] = set()
    tiles_dir = Path(config.data.tiles_dir)

    for method, seed, run_dir in runs:
        # the model is fixed by validation (best.pt) before any test slide is opened
        model = load_trained_model(run_dir, device=dev, which="best")
        summary.models.append((method.name, seed))
        log.info("evaluating %s seed %d (best.pt from epoch %d)", method.name, seed, model.epoch)
        bs = int(batch_size or getattr(method, "chunk_size", 64) or 64)
        make_heatmaps = heatmaps and hm_run == (method.name, seed)
        for es in sets:
            labels, preds, loc = [], {p.name: [] for p in protocols}, []
            it: Any = es.slides.iterrows()
            if progress:
                it = progress_bar(it, total=len(es.slides), desc=f"{method.name} s{seed} {es.cohort}", unit="slide", leave=False)
            for _, row in it:
                sid = str(row["slide_id"])
                try:
                    store = open_store(store_path(tiles_dir, sid))
                except (FileNotFoundError, ValueError) as e:
                    if sid not in missing:
                        log.warning("slide %s skipped: %s", sid, e)
                    missing.add(sid)
                    continue
                if len(store) == 0:
                    if sid not in missing:
                        log.warning("slide %s skipped: its tile store %s has no tiles", sid, store.path)
                    missing.add(sid)
                    continue
                res = _score_slide(model, config, store, row, protocols, seed=config.eval.seed, batch_size=bs,
                                   device=dev, heatmap_dir=out / "heatmaps" if make_heatmaps else None,
                                   heatmap_mode=heatmap_mode, title=f"attention, {method.name} seed {seed}")
                lab = _label(row["label"])
                for pname, pred in res.preds.items():
                    rows[(es.cohort, pname)].append(prediction_row(
                        slide_id=sid, cohort=es.cohort, label=lab, probs=pred.probs, prob_std=pred.prob_std,
                        n_tiles=pred.n_tiles, protocol=pname, n_repeats=pred.n_repeats, method=method.name, seed=seed))
                    if lab is not None:
                        preds[pname].append(pred)
                if lab is not None:
                    labels.append(lab)
                if res.localisation is not None and not math.isnan(res.localisation):
                    loc.append(res.localisation)
                if res.heatmap is not None:
                    gallery.append({"slide_id": sid, "cohort": es.cohort, "label": lab, "png": res.heatmap,
                                    "probs": res.preds[protocols[0].name].probs, "localisation": res.localisation,
                                    "outline": res.outlined})
            y = np.asarray(labels, dtype=np.int64)
            for p in protocols:
                recs, P = _protocol_records(method.name, seed, es, p, y, preds[p.name], n_classes)
                records += recs
                probs_by[(method.name, es.cohort, es.split, p.name)][seed] = (y, P)
            if loc:
                records.append(MetricRecord(method.name, seed, es.cohort, es.split, "all", "localisation_auc", float(np.mean(loc))))
                records.append(MetricRecord(method.name, seed, es.cohort, es.split, "all", "localisation_n_slides", float(len(loc))))
        del model
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()

    if n_boot is None:
        n_boot = int(config.eval.bootstrap)
    if n_boot > 0:
        records += _bootstrap_records(probs_by, n_classes, n_boot, seed=int(config.eval.seed), progress=progress)
    summary.missing_stores = sorted(missing)
    summary.n_slides = sum(len(s.slides) for s in sets) - len(missing)
    out.mkdir(parents=True, exist_ok=True)
    for (cohort, pname), rr in sorted(rows.items()):
        summary.files.append(write_predictions(predictions_path(out, cohort, pname), rr, n_classes))
    summary.files.append(write_metrics_json(out / "metrics.json", records))
    from wsi_pipeline.config.pipeline import save_config

    summary.files.append(save_config(config, out / "config.yaml"))
    from wsi_pipeline.export.report import write_report

    all_rows = pd.DataFrame([r for rr in rows.values() for r in rr])
    summary.files.append(write_report(
        out / "report.html", pipeline=config.name, predictions=all_rows, metrics_path=out / "metrics.json",
        n_classes=n_classes, gallery=gallery, heatmap_model=f"{hm_run[0]} seed {hm_run[1]}" if hm_run and heatmaps else None,
        protocols=[p.name for p in protocols], validation=val_scores,
        heatmap_run=hm_run if heatmaps else None, heatmap_chosen_on_validation=bool(best_val and not heatmap_method),
    ))
    summary.seconds = time.perf_counter() - t0
    return summary


def _protocol_records(
    method: str, seed: int, es: EvalSet, protocol: Protocol, y: np.ndarray, preds: list[SlidePrediction], n_classes: int,
) -> tuple[list[MetricRecord], np.ndarray]:
    """One model's metric records on one cohort under one protocol, and the probabilities they came from.

    ``all`` / ``ens<k>x<R>``: metrics of the (mean) slide probabilities, P (N, C).
    ``sub<k>x<R>``: metrics per repeat (records with ``repeat``), their mean over repeats as the
    model's score, ``<metric>_repeat_std`` and ``n_repeats``; P (R, N, C).
    """
    rec = lambda metric, value, repeat=None: MetricRecord(method, seed, es.cohort, es.split, protocol.name, metric, value, repeat)  # noqa: E731
    if not protocol.per_repeat:
        P = np.asarray([pr.probs for pr in preds], dtype=np.float64).reshape(len(y), n_classes)
        return [rec(k, v) for k, v in compute_metrics(y, P, n_classes).items()], P
    P = repeat_probs(preds, protocol.repeats) if preds else np.zeros((protocol.repeats, 0, n_classes))
    rm = compute_repeat_metrics(y, P, n_classes)
    out = [rec(k, v) for k, v in rm.mean.items()]
    out += [rec(f"{k}_repeat_std", v) for k, v in rm.std.items()]
    out += [rec(k, d[k], r) for r, d in enumerate(rm.per_repeat) for k in METRICS]
    return out, P


def _bootstrap_records(
    probs_by: dict[tuple[str, str, str, str], dict[int, tuple[np.ndarray, np.ndarray]]],
    n_classes: int,
    n_boot: int,
    seed: int,
    progress: bool = False,
) -> list[MetricRecord]:
    """95 % bootstrap intervals of each method's seed-mean metric (same resampled slides for every seed).

    Per-repeat protocols (probabilities (R, N, C)): each resample scores the first
    :data:`~wsi_pipeline.inference.metrics.BOOTSTRAP_MAX_REPEATS` repeats and averages them (see
    :func:`~wsi_pipeline.inference.metrics.bootstrap_interval`).
    """
    out = []
    items: Any = probs_by.items()
    if progress:
        items = progress_bar(items, total=len(probs_by), desc=f"bootstrap ({n_boot} resamples)", unit="group", leave=False)
    for (method, cohort, split, pname), by_seed in items:
        ys = [y for y, _ in by_seed.values()]
        if not ys or len(ys[0]) == 0 or any(not np.array_equal(ys[0], y) for y in ys[1:]):
            continue  # seeds saw different slides (a store vanished mid-run): no paired interval
        stack = [P for _, P in by_seed.values()]
        for metric in METRICS:
            lo, hi = bootstrap_interval(ys[0], stack, n_classes, metric, n_boot=n_boot, seed=seed)
            out.append(MetricRecord(method, "mean", cohort, split, pname, f"{metric}_ci_low", lo))
            out.append(MetricRecord(method, "mean", cohort, split, pname, f"{metric}_ci_high", hi))
    return out


@dataclass
class _SlideResult:
    preds: dict[str, SlidePrediction]
    localisation: float | None
    heatmap: Path | None
    outlined: bool = False  # ground-truth lesions drawn on the heatmap


def _score_slide(
    model: Any,
    config: Any,
    store: TileStore,
    row: pd.Series,
    protocols: list[Protocol],
    *,
    seed: int,
    batch_size: int,
    device: str,
    heatmap_dir: Path | None,
    heatmap_mode: str,
    title: str,
) -> _SlideResult:
    from wsi_pipeline.export.thumbnail import StoreThumbnail, open_slide_or_none, slide_thumbnail, store_level0_size, store_tile_extent

    extent = store_tile_extent(store.attrs, store.tile_size)
    thumb = level0 = None
    builder = None
    if heatmap_dir is not None:
        slide = open_slide_or_none(row.get("path"))
        if slide is not None:
            try:
                thumb, level0 = slide_thumbnail(slide)
            except (OSError, ValueError, RuntimeError) as e:  # a damaged region: rebuild from the tiles instead
                log.warning("thumbnail of %s failed (%s); rebuilding it from the tile store", row.get("path"), e)
                thumb = level0 = None
            finally:
                close = getattr(slide, "close", None)
                if close:
                    close()
    feats = _frozen_features(model, config, store)
    if heatmap_dir is not None and thumb is None:
        builder = StoreThumbnail(store.coords, extent, store_level0_size(store.attrs, store.coords, extent))
    slide_in: Any = store
    if feats is not None:
        slide_in = (feats, store.grid)
        if builder is not None:  # no embedding pass to piggy-back on: read the tiles once for the thumbnail
            builder = StoreThumbnail.from_store(store)
    preds = predict_protocols(
        model.encoder, model.aggregator, slide_in, protocols, slide_id=str(row["slide_id"]), seed=seed,
        batch_size=batch_size, device=device, on_batch=builder.add if (builder is not None and feats is None) else None,
    )
    any_pred = next(iter(preds.values()))
    att = any_pred.attention
    loc = None
    if att is not None:
        frac = _lesion_fraction(row, store, extent)
        if frac is not None:
            loc = localisation_auc(att, frac)
    png = None
    outlined = False
    if heatmap_dir is not None and att is not None:
        from wsi_pipeline.export.slide_outputs import write_slide_outputs

        if builder is not None:
            thumb, level0 = builder.image, builder.level0_size
        outline = _lesion_outline(row, store, extent, level0, thumb.shape[:2])
        outs = write_slide_outputs(
            heatmap_dir, str(row["slide_id"]), thumbnail=thumb, level0_size=level0, coords=store.coords, grid=store.grid,
            tile_extent=extent, attention=att, instance_scores=any_pred.instance_scores, mode=heatmap_mode, title=title,
            outline=outline,
        )
        png = outs.png
        outlined = outline is not None and bool(outline.any())
    return _SlideResult(preds=preds, localisation=loc, heatmap=png, outlined=png is not None and outlined)


# ----------------------------------------------------------------------------------------------
# Prediction on new slides (``wsi-pipeline predict``)
# ----------------------------------------------------------------------------------------------


@dataclass
class PredictSummary:
    """What :func:`predict_slides` did: output folder, predictions file, per-slide rows, failures."""

    out_dir: Path
    predictions: Path | None
    rows: list[dict] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    heatmaps_dir: Path | None = None
    tiles_dir: Path | None = None
    seconds: float = 0.0
    stain_checks: dict[str, Any] = field(default_factory=dict)  # slide_id -> StainCheck against the training tiles
    stain_reference_source: str | None = None


def _tiler_config(tiling: StoreTiling | Mapping[str, Any] | None, mpp: float | None) -> TilingConfig:
    """The tiler's settings from the tiling parameters saved with a model.

    ``tiling`` is the dict of the training stores' own settings (checkpoints since stores record
    them), or an older checkpoint's config section (tile size, method, threshold, mpp target).
    """
    return tiler_config(tiling, mpp)


def _check_store_settings(stores: Sequence[Path], tiling: Any, *, allow: bool) -> None:
    """Refuse (or with ``allow``, warn about) stores tiled unlike the model's training stores.

    ``tiling`` is what the checkpoint saved: the training stores' own settings (a dict), or an
    older checkpoint's config section, of which only the fields it sets are compared.
    """
    from wsi_pipeline.data.bags import store_settings

    keys = ("method", "tile_size", "min_foreground", "mpp_target")
    want = {k: (tiling.get(k) if isinstance(tiling, dict) else getattr(tiling, k, None)) for k in keys}
    want = {k: v for k, v in want.items() if v is not None}
    odd = []
    for path in stores:
        got = store_settings(path)
        if got is None:
            continue
        diff = [f"{k} {got.get(k)} (model: {v})" for k, v in want.items()
                if not (got.get(k) == v or (isinstance(v, float) and isinstance(got.get(k), float) and abs(got[k] - v) < 1e-9))]
        if diff:
            odd.append(f"{path.name}: {', '.join(diff)}")
    if not odd:
        return
    msg = (f"{len(odd)} store(s) were tiled unlike the model's training data ({'; '.join(odd[:4])}"
           f"{' ...' if len(odd) > 4 else ''}); the model would see another tile size or resolution")
    if not allow:
        raise ValueError(msg + ". Pass the slide files instead (they are tiled with the model's settings), "
                         "or --allow-other-tiling to score these stores anyway")
    log.warning(msg)


#: Columns ``predict`` adds after the evaluation's predictions columns.
PREDICT_EXTRA_COLUMNS = ("stain_distance", "off_distribution")


def _training_stain_reference(model: Any) -> tuple[dict | None, str | None]:
    """The model's stain reference and where it came from.

    Saved in the checkpoint since training records it; for an older checkpoint, computed now from
    the training stores its config names when they are still on disk; else ``(None, None)``.
    """
    if model.stain_reference:
        return model.stain_reference, f"checkpoint {model.checkpoint}"
    try:
        from wsi_pipeline.data.bags import slides_for_split
        from wsi_pipeline.data.stain_stats import stain_reference
        from wsi_pipeline.manifests.schema import read_manifest

        cfg = model.config
        manifest = read_manifest(cfg.data.manifest, n_classes=int(model.n_classes))
        from wsi_pipeline.data.store import is_complete

        train = [s for s in slides_for_split(manifest, "train", cfg.data.tiles_dir) if is_complete(s.store)]
        ref = stain_reference(train) if train else None
    except (FileNotFoundError, ValueError, OSError, KeyError) as e:
        log.info("no stain reference: the checkpoint has none and the training stores cannot be read (%s)", e)
        return None, None
    return (ref, f"training stores under {cfg.data.tiles_dir}") if ref else (None, None)


def _store_folder(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.zarr") if p.is_dir())


def predict_slides(
    model_path: str | os.PathLike,
    slides: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    protocols: Sequence[Any] = ("all",),
    device: str = "auto",
    workers: int | None = None,
    batch_size: int | None = None,
    mpp: float | None = None,
    heatmaps: bool = True,
    heatmap_mode: str = "rank",
    seed: int = 0,
    progress: bool = True,
    allow_other_tiling: bool = False,
    cluster: Any = None,
    retries: int = 2,
) -> PredictSummary:
    """Tile, embed and score a folder of new (unlabelled) slides with a trained model.

    Parameters
    ----------
    model_path : a run folder (its ``best.pt`` is used) or a checkpoint file.
    slides : a folder of slide files (tiled into ``<out_dir>/tiles`` with the tiling parameters
        saved with the model; complete, current stores there are reused), or a folder of
        ``<slide_id>.zarr`` tile stores (used as they are).
    out_dir : receives ``predictions.csv`` (the columns of the evaluation's predictions files;
        ``label`` empty, ``cohort`` = the slides folder's name, all protocols in one file),
        ``heatmaps/`` and ``predict_info.json``.
    protocols : scoring protocols (``"all"``, ``"sub256x100"``, ``"ens256x100"``).
    device, workers, batch_size : compute settings (``workers``: tiling processes).
    mpp : um/px to assume for slides whose files lack it.
    heatmaps, heatmap_mode : per-slide heatmap PNG + scores CSV + GeoJSON.
    seed : seed of the subsample protocols.
    allow_other_tiling : score a folder of stores tiled with other settings than the model's
        training stores (tile size, resolution, method, thresholds) with a warning instead of
        refusing it.
    cluster, retries : tile on a Dask cluster (see :func:`wsi_pipeline.tiling.runner.tile_cohort`);
        embedding and scoring stay in this process.

    Every slide's tiles are also compared with the training tiles' stain summary
    (:mod:`wsi_pipeline.data.stain_stats`; saved in the checkpoint, or for older checkpoints
    computed from the training stores when they exist): ``predictions.csv`` gets the columns
    ``stain_distance`` and ``off_distribution`` (empty when no summary is available), and a slide
    beyond the threshold is logged as a warning. It is still predicted.
    """
    import json

    from wsi_pipeline.data.stain_stats import compare_to_reference, store_tile_features

    from wsi_pipeline.inference.checkpoint import load_trained_model

    t0 = time.perf_counter()
    out = Path(out_dir)
    src = Path(slides)
    if not src.is_dir():
        raise FileNotFoundError(f"slides folder not found: {src}; pass a folder of slide files or of .zarr tile stores")
    dev = _resolve_device(device)
    model = load_trained_model(model_path, device=dev)
    prots = parse_protocols(protocols)
    summary = PredictSummary(out_dir=out, predictions=None)
    stores = _store_folder(src)
    slide_paths: dict[str, str] = {}
    if stores:
        tiles_dir = src
        ids = [p.name[: -len(".zarr")] for p in stores]
        _check_store_settings(stores, model.tiling, allow=allow_other_tiling)
    else:
        from wsi_pipeline.tiling.runner import tile_cohort

        tiles_dir = out / "tiles"
        report = tile_cohort(src, tiles_dir, _tiler_config(model.tiling, mpp), workers=workers, progress=progress,
                             cluster=cluster, retries=retries)
        ids = []
        for r in report.results:
            slide_paths[r.slide_id] = r.path
            if r.status in ("ok", "skipped") and r.n_tiles > 0:
                ids.append(r.slide_id)
            elif r.status in ("ok", "skipped"):  # the tiler's note says why (e.g. a dark background) when it knows
                summary.failed.append((r.slide_id, r.note or "no tissue tiles found (check the slide, or lower min_foreground)"))
            else:
                summary.failed.append((r.slide_id, f"tiling failed: {r.error}"))
    summary.tiles_dir = tiles_dir
    if not ids and not summary.failed:
        raise FileNotFoundError(f"no slides found in {src} (looked for slide files and *.zarr stores)")
    cohort = src.resolve().name or "predict"
    hm_dir = out / "heatmaps" if heatmaps else None
    summary.heatmaps_dir = hm_dir
    bs = int(batch_size or getattr(model.method, "chunk_size", 64) or 64)
    stain_ref, summary.stain_reference_source = _training_stain_reference(model)
    if stain_ref is None:
        log.warning("no stain summary of the training tiles (checkpoint without one, training stores not found): "
                    "slides are not checked for being off-distribution")
    it: Any = ids
    if progress:
        it = progress_bar(ids, desc="predicting", unit="slide")
    for sid in it:
        try:
            store = open_store(store_path(tiles_dir, sid))
        except (FileNotFoundError, ValueError) as e:
            summary.failed.append((sid, str(e)))
            continue
        if len(store) == 0:
            summary.failed.append((sid, "the tile store has no tiles"))
            continue
        row = pd.Series({"slide_id": sid, "path": slide_paths.get(sid) or store.attrs.get("slide_path", "")})
        stain: dict[str, Any] = {"stain_distance": None, "off_distribution": None}
        if stain_ref is not None:
            chk = compare_to_reference(store_tile_features(store, int(stain_ref.get("max_tiles_per_slide", 64))), stain_ref)
            summary.stain_checks[sid] = chk
            stain = {"stain_distance": round(chk.distance, 3), "off_distribution": chk.off_distribution}
            if chk.off_distribution:
                log.warning("slide %s looks unlike the training tiles (%s); predicted anyway, treat its result with "
                            "caution (fluorescence or another stain on a brightfield model?)", sid, chk.describe())
        res = _score_slide(model, model.config, store, row, prots, seed=seed, batch_size=bs, device=dev,
                           heatmap_dir=hm_dir, heatmap_mode=heatmap_mode, title=f"attention, {model.method.name}")
        for pname, pred in res.preds.items():
            summary.rows.append({**prediction_row(
                slide_id=sid, cohort=cohort, label=None, probs=pred.probs, prob_std=pred.prob_std, n_tiles=pred.n_tiles,
                protocol=pname, n_repeats=pred.n_repeats, method=model.method.name, seed=model.seed), **stain})
    out.mkdir(parents=True, exist_ok=True)
    summary.predictions = write_predictions(out / "predictions.csv", summary.rows, int(model.n_classes),
                                            extra_columns=PREDICT_EXTRA_COLUMNS)
    from wsi_pipeline.tiling.params import output_params

    info = {
        "model": str(model.checkpoint), "method": model.method.name, "seed": model.seed, "epoch": model.epoch,
        "n_classes": int(model.n_classes), "protocols": [p.name for p in prots], "slides": str(src.resolve()),
        "tiles_dir": str(tiles_dir), "tiling": output_params(_tiler_config(model.tiling, None)),
        "failed": [{"slide_id": s, "reason": r} for s, r in summary.failed],
        "stain_reference": {"source": summary.stain_reference_source, **(stain_ref or {})},
        "stain_checks": {s: {"distance": c.distance, "off_distribution": c.off_distribution, "feature": c.feature,
                             "medians": c.medians} for s, c in summary.stain_checks.items()},
    }
    write_text_atomic(out / "predict_info.json", json.dumps(info, indent=1) + "\n")
    summary.seconds = time.perf_counter() - t0
    return summary
