"""Prediction on new slides (``wsi-pipeline predict``): tile with the model's settings, score, write.

A folder of slide files is tiled into ``<out>/tiles`` with the tiling parameters saved with the
model (:func:`saved_tiler_config`); a folder of tile stores is scored as it is, after checking it was
tiled like the model's training stores. Each slide is embedded once and scored under every
protocol (:func:`~wsi_pipeline.evaluation.scoring.score_slide`), through the per-slide job runner
(:mod:`wsi_pipeline.jobs.slide_jobs`), and compared with the training tiles' stain summary.

Under torchrun every rank tiles (the slides' locks share the folder out), then scores its shard of
the slides (``rank, rank + G, ...``); rank 0 gathers the rows in slide order and alone writes
``predictions.csv`` and ``predict_info.json``, the same bytes as one process writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.config.store_settings import StoreSettings
from wsi_pipeline.config.tiling import TilingConfig, tiler_config
from wsi_pipeline.data.store import open_store, store_path
from wsi_pipeline.devices import resolve_device
from wsi_pipeline.evaluation.scoring import score_slide
from wsi_pipeline.export.predictions import endpoint_row, write_predictions
from wsi_pipeline.config.evaluation import EvalProtocol, parse_protocols
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.jobs.slide_jobs import run_slides
from wsi_pipeline.tiling.params import output_params
from wsi_pipeline.training import distributed
from wsi_pipeline.output_dirs import check_not_an_input, check_output_dir
from wsi_pipeline.types import TileStoreLike

__all__ = ["PREDICT_EXTRA_COLUMNS", "PredictSummary", "predict_slides"]

log = logging.getLogger(__name__)


@dataclass
class PredictSummary:
    """What :func:`predict_slides` did: output folder, predictions file, per-slide rows, failures."""

    out_dir: Path
    predictions: Path | None
    task: str  # the model's task (its Task names the rows' columns and what the CLI prints of them)
    rows: list[dict] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    heatmaps_dir: Path | None = None
    tiles_dir: Path | None = None  # the tile stores scored, or the feature files (``features``)
    seconds: float = 0.0
    features: bool = False  # the slides were feature files (a model of precomputed features)
    stain_checks: dict[str, Any] = field(default_factory=dict)  # slide_id -> StainCheck against the training tiles
    stain_reference_source: str | None = None


def saved_tiler_config(tiling: StoreSettings | Mapping[str, Any] | None, mpp: float | None) -> TilingConfig:
    """The tiler's settings from the tiling parameters saved with a model.

    ``tiling`` is the dict of the training stores' own settings (checkpoints since stores record
    them), or an older checkpoint's config section (tile size, method, threshold, mpp target).
    """
    return tiler_config(tiling, mpp)


#: The key under which a store records the fingerprint of the tissue model that tiled it (the ``unet`` detector).
TISSUE_MODEL_KEY = "tissue_model_fingerprint"


def _recorded_tissue_model(tiling: StoreSettings | Mapping[str, Any] | None) -> str | None:
    """The fingerprint of the tissue model that tiled the model's training stores, as saved with the model (None when
    it saved none: an older checkpoint, or a detector without a tissue model)."""
    if isinstance(tiling, Mapping):
        value = tiling.get(TISSUE_MODEL_KEY)
    else:
        value = (getattr(tiling, "detector", None) or {}).get(TISSUE_MODEL_KEY)
    return str(value) if value else None


def tiling_for_prediction(tiling: StoreSettings | Mapping[str, Any] | None, mpp: float | None, tissue_model: str | None,
                          where: str | os.PathLike) -> TilingConfig:
    """The tiler's settings for new slides: :func:`saved_tiler_config`, its tissue model the training's own.

    A model whose training stores the ``unet`` detector tiled recorded that tissue model's fingerprint; the file
    used now (``tissue_model``, None: the shipped one) must have the same, else ``ValueError`` naming ``where``
    (the checkpoint), both fingerprints and ``--tissue-model``. A ``tissue_model`` for a detector that uses
    none is refused too (``ValueError``); a missing file is ``FileNotFoundError``.
    """
    from wsi_pipeline.config.tiling_params import UNetParams
    from wsi_pipeline.slides.fingerprint import same_slide, slide_fingerprint
    from wsi_pipeline.tissue_seg.tiling_mask import resolve_tissue_model

    config = saved_tiler_config(tiling, mpp)
    if not isinstance(config.detector, UNetParams):
        if tissue_model is not None:
            raise ValueError(f"--tissue-model {tissue_model}: {where} was trained on stores tiled by the "
                             f"{config.method!r} detector, which uses no tissue model; leave --tissue-model out")
        return config
    path = resolve_tissue_model(tissue_model)
    current, recorded = slide_fingerprint(path), _recorded_tissue_model(tiling)
    if recorded is None:
        log.warning("%s records no fingerprint of the tissue model that tiled its training stores: new slides are "
                    "tiled with %s, unchecked", where, path)
    elif not same_slide(recorded, current):
        given = f"--tissue-model {tissue_model}" if tissue_model is not None else f"the shipped tissue model {path}"
        raise ValueError(f"{where} was trained on stores tiled by the tissue model of fingerprint {recorded}, but "
                         f"{given} has fingerprint {current}; pass the file that tiled them (their `tile --tissue-model "
                         "FILE`) with --tissue-model FILE")
    return dataclasses.replace(config, detector=dataclasses.replace(config.detector, tissue_model=os.fspath(path)))


def check_store_settings(stores: Sequence[Path], tiling: Any, *, allow: bool) -> None:
    """Refuse (or with ``allow``, warn about) stores tiled unlike the model's training stores.

    ``tiling`` is what the checkpoint saved: the training stores' own settings (a dict), or an
    older checkpoint's config section, of which only the fields it sets are compared.
    """
    from wsi_pipeline.data.bags import store_settings

    keys = ("method", "tile_size", "min_foreground", "mpp_target", TISSUE_MODEL_KEY)
    want = {k: (tiling.get(k) if isinstance(tiling, dict) else getattr(tiling, k, None)) for k in keys}
    want = {k: v for k, v in want.items() if v is not None}
    odd = []
    for path in stores:
        try:
            got = store_settings(path)
        except (ValueError, OSError):  # a damaged store fails that slide alone, by name, when it is scored
            continue
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
PREDICT_EXTRA_COLUMNS = ("stain_distance", "off_distribution", "stain_normalised", "stain_problem")


def _training_stain_reference(model: Any) -> tuple[dict | None, str | None]:
    """The model's stain reference and where it came from.

    Saved in the checkpoint since training records it; for an older checkpoint, computed now from
    the training stores its config names when they are still on disk; else ``(None, None)``.
    """
    if model.stain_reference:
        return model.stain_reference, f"checkpoint {model.checkpoint}"
    if model.config.data.tiles_dir is None:  # trained on precomputed features: no tiles to summarise
        return None, None
    try:
        from wsi_pipeline.data.bags import slides_for_split
        from wsi_pipeline.data.stain_stats import stain_reference
        from wsi_pipeline.manifests.schema import read_manifest

        cfg = model.config
        manifest = read_manifest(cfg.data.manifest, n_classes=cfg.label_classes)
        from wsi_pipeline.data.store import is_complete

        train = [s for s in slides_for_split(manifest, "train", cfg.data.tiles_dir, task=cfg.task) if is_complete(s.store)]
        ref = stain_reference(train) if train else None
    except (FileNotFoundError, ValueError, OSError, KeyError) as e:
        log.info("no stain reference: the checkpoint has none and the training stores cannot be read (%s)", e)
        return None, None
    return (ref, f"training stores under {cfg.data.tiles_dir}") if ref else (None, None)


def _stain_reference_for(model: Any, summary: PredictSummary) -> dict | None:
    """The training tiles' stain summary the slides are checked against (:func:`_training_stain_reference`), its
    source filed in ``summary``; a warning when there is none (but for feature files, which have no tiles)."""
    stain_ref, summary.stain_reference_source = _training_stain_reference(model)
    if stain_ref is None and not summary.features:
        log.warning("no stain summary of the training tiles (checkpoint without one, training stores not found): "
                    "slides are not checked for being off-distribution")
    return stain_ref


def _feature_files_to_score(src: Path) -> tuple[Path, list[str], dict[str, str]]:
    """(features folder, slide ids, {}) of a folder of feature files (TRIDENT, CLAM, STAMP or ours; a CLAM or
    TRIDENT output folder works too: :func:`~wsi_pipeline.data.feature_formats.feature_folder`)."""
    from wsi_pipeline.data.feature_formats import feature_folder, list_feature_files

    folder = feature_folder(src)
    files = list_feature_files(folder)
    if not files:
        raise FileNotFoundError(f"no feature files (<slide_id>.h5 or .pt) in {folder}: this model was trained on "
                                "precomputed features (encoder 'precomputed'), so --slides must be a folder of feature files")
    return folder, [p.stem for p in files], {}


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
    encoder_weights: str | os.PathLike | None = None,
    tissue_model: str | None = None,
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
    cluster, retries : tile on a Dask cluster (see :func:`wsi_pipeline.tiling.cohort.tile_cohort`);
        embedding and scoring stay in this process (under torchrun: in the ranks, a shard each).
    encoder_weights : the base weights file of a foundation encoder whose checkpoint stores only
        the trained tensors, when it is not where the training config says; its sha256 must be
        the one recorded at training (else ``ValueError``).
    tissue_model : the tissue model file that tiled the training stores of a model trained on ``unet`` stores
        (None: the shipped model); slides are tiled with it, and one of another fingerprint than the recorded is
        refused (:func:`tiling_for_prediction`).

    Every slide's tiles are also compared with the training tiles' stain summary
    (:mod:`wsi_pipeline.data.stain_stats`; saved in the checkpoint, or for older checkpoints
    computed from the training stores when they exist): ``predictions.csv`` gets the columns
    ``stain_distance`` and ``off_distribution`` (empty when no summary is available), and a slide
    beyond the threshold is logged as a warning. It is still predicted.

    The model's stain normalisation (``data.stain``, fitted at training time and stored in the
    checkpoint) is applied to every slide, each with its own stain estimate: ``stain_normalised``
    says whether it was (empty for a model without normalisation) and ``stain_problem`` why a slide
    fell back to no normalisation.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    src = Path(slides)
    if not src.is_dir():
        raise FileNotFoundError(f"slides folder not found: {src}; pass a folder of slide files or of .zarr tile stores")
    from wsi_pipeline.inference.trained import load_trained_model

    check_not_an_input(out, "--out", {"--slides": src})  # a second run would predict the first one's heatmaps
    if distributed.is_main():
        check_output_dir(out, ("heatmaps", "tiles"), what="predictions folder")
    dev = str(distributed.device_for(resolve_device(device)))
    model = load_trained_model(model_path, device=dev, encoder_weights=encoder_weights)
    prots = parse_protocols(protocols)
    summary = PredictSummary(out_dir=out, predictions=None, task=model.endpoint.task)
    summary.features = model.method.encoder.name == "precomputed"  # a model of precomputed features scores feature files
    features_format = "auto" if summary.features else None  # detected per file
    tiles_dir, ids, slide_paths = _feature_files_to_score(src) if summary.features else _slides_to_score(
        src, out, model, summary, mpp=mpp, tissue_model=tissue_model, workers=workers, progress=progress, cluster=cluster,
        retries=retries, allow_other_tiling=allow_other_tiling)
    if distributed.current().enabled:  # every rank tiled the folder together; rank 0's list is the one scored
        ids, slide_paths, summary.failed = distributed.broadcast_object((ids, slide_paths, summary.failed))
    summary.tiles_dir = tiles_dir
    if not ids and not summary.failed:
        raise FileNotFoundError(f"no slides found in {src} (looked for slide files and *.zarr stores)")
    summary.heatmaps_dir = out / "heatmaps" if heatmaps else None
    stain_ref = _stain_reference_for(model, summary)
    scorer = _SlidePredictor(model, prots, tiles_dir, slide_paths, stain_ref, summary, cohort=src.resolve().name or "predict",
                             seed=seed, batch_size=int(batch_size or getattr(model.method, "chunk_size", 64) or 64),
                             device=dev, heatmap_mode=heatmap_mode, features_format=features_format, mpp=mpp)
    if not _score_slides(scorer, ids, progress=progress):  # rank 0 writes
        summary.seconds = time.perf_counter() - t0
        return summary
    out.mkdir(parents=True, exist_ok=True)
    endpoint = model.endpoint
    summary.predictions = write_predictions(out / "predictions.csv", summary.rows, model.n_classes,
                                            extra_columns=PREDICT_EXTRA_COLUMNS,
                                            columns=endpoint.definition.prediction_columns(model.n_classes, endpoint.edges))
    _write_predict_info(out / "predict_info.json", model, prots, src, tiles_dir, stain_ref, summary)
    summary.seconds = time.perf_counter() - t0
    return summary


def _score_slides(scorer: _SlidePredictor, ids: Sequence[str], *, progress: bool) -> bool:
    """Score ``ids`` through the job runner, each slide's row filed by ``scorer.collect``; a bad slide is a failed
    row and a bug stops the run (:mod:`wsi_pipeline.failures`). Under torchrun each rank scores its shard and every
    rank files all rows in slide order. Returns whether this process writes the outputs (rank 0, or no torchrun)."""
    if not distributed.current().enabled:
        run_slides(ids, scorer, desc="predicting", progress=progress, on_result=scorer.collect)
        return True
    mine = distributed.shard(len(ids))
    rows = run_slides([ids[i] for i in mine], scorer, desc="predicting", progress=progress and distributed.is_main())
    for row in distributed.gather_in_order(mine, rows):
        scorer.collect(row)
    return distributed.is_main()


def _slides_to_score(src: Path, out: Path, model: Any, summary: PredictSummary, *, mpp: float | None, tissue_model: str | None,
                     workers: int | None, progress: bool, cluster: Any, retries: int,
                     allow_other_tiling: bool) -> tuple[Path, list[str], dict[str, str]]:
    """(tiles folder, slide ids to score, slide id -> slide file): ``src``'s stores as they are (checked against
    the model's tiling), or its slide files tiled into ``<out>/tiles`` with the model's tiling and tissue model
    (:func:`tiling_for_prediction`, checked before any slide is tiled); tiling failures go to ``summary.failed``."""
    stores = _store_folder(src)
    if stores:
        check_store_settings(stores, model.tiling, allow=allow_other_tiling)
        return src, [p.name[: -len(".zarr")] for p in stores], {}
    from wsi_pipeline.tiling.cohort import tile_cohort

    tiling = tiling_for_prediction(model.tiling, mpp, tissue_model, model.checkpoint)
    tiles_dir = out / "tiles"
    report = tile_cohort(src, tiles_dir, tiling, workers=workers, progress=progress,
                         cluster=cluster, retries=retries)
    ids, slide_paths = [], {}
    for r in report.results:
        slide_paths[r.slide_id] = r.path
        if r.status in ("ok", "skipped") and r.n_tiles > 0:
            ids.append(r.slide_id)
        elif r.status in ("ok", "skipped"):  # the tiler's note says why (e.g. a dark background) when it knows
            summary.failed.append((r.slide_id, r.note or "no tissue tiles found (check the slide, or lower min_foreground)"))
        else:
            summary.failed.append((r.slide_id, f"tiling failed: {r.error}"))
    return tiles_dir, ids, slide_paths


@dataclass
class _SlidePredictor:
    """The job runner's work for one slide (:func:`wsi_pipeline.jobs.slide_jobs.run_one`): open its store, check
    its stain against the training tiles, score it; :meth:`collect` files the row into the summary."""

    model: Any
    protocols: list[EvalProtocol]
    tiles_dir: Path
    slide_paths: dict[str, str]
    stain_ref: dict | None
    summary: PredictSummary
    cohort: str
    seed: int
    batch_size: int
    device: str
    heatmap_mode: str

    features_format: str | None = None  # a folder of feature files (a model of precomputed features), read in this format
    mpp: float | None = None  # level-0 um/px of slides whose files lack it (STAMP's micrometre coordinates)

    def __call__(self, sid: str, row: dict[str, Any]) -> None:
        # a missing or damaged store fails this slide only (the runner applies wsi_pipeline.failures)
        store: Any
        if self.features_format is not None:
            from wsi_pipeline.data.feature_formats import feature_file, read_slide_features

            store = read_slide_features(feature_file(self.tiles_dir, sid), self.features_format, mpp=self.mpp)
        else:
            store = open_store(store_path(self.tiles_dir, sid))
        if len(store) == 0:
            row.update(status="failed", error="the feature file has no rows" if self.features_format else "the tile store has no tiles")
            return
        manifest_row = pd.Series({"slide_id": sid, "path": self.slide_paths.get(sid) or store.attrs.get("slide_path", "")})
        stain, row["stain_check"] = self._stain(sid, store)
        model = self.model
        res = score_slide(model, model.config, store, manifest_row, self.protocols, seed=self.seed,
                          batch_size=self.batch_size, device=self.device, heatmap_dir=self.summary.heatmaps_dir,
                          heatmap_mode=self.heatmap_mode, title=f"attention, {model.method.name}")
        # the model's stored normalisation (score_slide attached it): whether this slide got it, or why not
        stain.update(stain_normalised=res.stain_normalised, stain_problem=res.stain_problem or None)
        endpoint = model.endpoint
        row["predictions"] = [{**endpoint_row(
            task=endpoint.task, slide_id=sid, cohort=self.cohort, target=None, scores=endpoint.definition.slide_scores(endpoint, pred),
            n_tiles=pred.n_tiles, protocol=pname, n_repeats=pred.n_repeats, method=model.method.name, seed=model.seed,
            edges=endpoint.edges), **stain} for pname, pred in res.preds.items()]

    def _stain(self, sid: str, store: TileStoreLike) -> tuple[dict[str, Any], Any]:
        """The slide's stain columns (distance to the training tiles, off-distribution flag) and the
        check behind them (None without a training summary); warns when it is off-distribution."""
        from wsi_pipeline.data.stain_stats import compare_to_reference, store_tile_features

        stain: dict[str, Any] = {"stain_distance": None, "off_distribution": None}
        if self.stain_ref is None:
            return stain, None
        chk = compare_to_reference(store_tile_features(store, int(self.stain_ref.get("max_tiles_per_slide", 64))), self.stain_ref)
        stain = {"stain_distance": round(chk.distance, 3), "off_distribution": chk.off_distribution}
        if chk.off_distribution:
            log.warning("slide %s looks unlike the training tiles (%s); predicted anyway, treat its result with "
                        "caution (fluorescence or another stain on a brightfield model?)", sid, chk.describe())
        return stain, chk

    def collect(self, row: dict[str, Any]) -> None:
        """File one slide's outcome: its prediction rows and stain check, or its failure."""
        if row["status"] == "failed":
            self.summary.failed.append((row["slide_id"], row["error"]))
        else:
            self.summary.rows.extend(row["predictions"])
            if row.get("stain_check") is not None:
                self.summary.stain_checks[row["slide_id"]] = row["stain_check"]


def _write_predict_info(path: Path, model: Any, prots: Sequence[EvalProtocol], src: Path, tiles_dir: Path,
                        stain_ref: dict | None, summary: PredictSummary) -> None:
    """``predict_info.json``: the model, protocols, slides, tiling settings, failures and stain checks."""
    info = {
        "model": str(model.checkpoint), "method": model.method.name, "seed": model.seed, "epoch": model.epoch,
        "n_classes": model.n_classes, "protocols": [p.name for p in prots], "slides": str(src.resolve()),
        **({"endpoint": model.endpoint.to_state()} if model.endpoint is not None else {}),
        "tiles_dir": str(tiles_dir), "tiling": output_params(saved_tiler_config(model.tiling, None)),
        "failed": [{"slide_id": s, "reason": r} for s, r in summary.failed],
        "stain_reference": {"source": summary.stain_reference_source, **(stain_ref or {})},
        "stain_normalisation": model.stain.state() if model.stain is not None else {"method": "none"},
        "stain_checks": {s: {"distance": c.distance, "off_distribution": c.off_distribution, "feature": c.feature,
                             "medians": c.medians} for s, c in summary.stain_checks.items()},
    }
    write_text_atomic(path, json.dumps(info, indent=1) + "\n")
