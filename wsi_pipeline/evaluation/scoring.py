"""Scoring one slide with one model: embed its store once, aggregate under every protocol, localise, draw.

Shared by the evaluation (:mod:`wsi_pipeline.evaluation.evaluate`) and prediction on new slides
(:mod:`wsi_pipeline.evaluation.predict`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from wsi_pipeline.data.store import TileStore
from wsi_pipeline.evaluation.localisation import lesion_fraction, lesion_outline, localisation_auc
from wsi_pipeline.config.evaluation import EvalProtocol
from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.config.strategy_traits import strategy_traits
from wsi_pipeline.inference.protocols import SlidePrediction, calibrated_prediction, predict_protocols

__all__ = ["SlideScore", "score_slide"]

log = logging.getLogger(__name__)


def label_of(v: Any) -> int | None:
    return None if v is None or pd.isna(v) else int(v)


def saved_frozen_features(model: Any, config: PipelineConfig, store: TileStore) -> torch.Tensor | None:
    """Precomputed features of a frozen method when an up-to-date file exists (saves re-embedding); a
    :class:`~wsi_pipeline.data.feature_formats.SlideFeatures` (``data.features``) is its own features."""
    from wsi_pipeline.data.feature_formats import SlideFeatures

    if isinstance(store, SlideFeatures):
        return torch.from_numpy(store.features)
    strategy = getattr(model.method, "strategy", None)
    if strategy is None or strategy_traits(strategy).trains_encoder:
        return None
    from wsi_pipeline.inference.features import features_path, read_features, store_fingerprint
    from wsi_pipeline.methods.models import frozen_features_dir

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
    want = store.stain.tag if store.stain is not None else "none"
    if attrs.get("stain", "none") != want:  # features of another stain normalisation: the model's is applied instead
        log.info("feature file %s has stain normalisation %s, the model's is %s; embedding the store instead",
                 path, attrs.get("stain", "none"), want)
        return None
    return torch.from_numpy(feats)


@dataclass
class SlideScore:
    """One slide scored by one model: predictions per protocol, localisation AUC, heatmap PNG (or None)."""

    preds: dict[str, SlidePrediction]
    localisation: float | None
    heatmap: Path | None
    outlined: bool = False  # ground-truth lesions drawn on the heatmap
    stain_normalised: bool | None = None  # None: the model does not normalise
    stain_problem: str = ""  # why the slide fell back to no normalisation


def score_slide(
    model: Any,
    config: PipelineConfig,
    store: TileStore,
    row: pd.Series,
    protocols: list[EvalProtocol],
    *,
    seed: int,
    batch_size: int,
    device: str,
    heatmap_dir: Path | None,
    heatmap_mode: str,
    title: str,
) -> SlideScore:
    """Score ``store`` (the slide of manifest ``row``) under every protocol; with ``heatmap_dir``, draw its heatmap.

    The model's stain normalisation (``model.stain``, fitted at training time) is attached to the
    store first, so its tiles are normalised exactly as the training tiles were.

    The thumbnail comes from the slide file (``row["path"]``) when it opens, else it is rebuilt
    from the tiles while they are embedded (or read once, when a frozen method's features file
    spares the embedding).
    """
    from wsi_pipeline.data.feature_formats import SlideFeatures
    from wsi_pipeline.data.store import store_level0_size, store_tile_extent
    from wsi_pipeline.export.thumbnail import StoreThumbnail

    if getattr(model, "stain", None) is not None:
        model.stain.attach(store)
    extent = store_tile_extent(store.attrs, store.tile_size)
    thumb = level0 = None
    builder = None
    from_features = isinstance(store, SlideFeatures)  # precomputed features (data.features): no tiles
    if from_features and store.coords is None:  # CLAM's .pt files: no coordinates to draw a heatmap with
        heatmap_dir = None
    slide_file = row.get("path")
    if from_features and str(slide_file or "").endswith((".h5", ".pt")):  # the manifest names the feature file, not a slide
        slide_file = None
    if heatmap_dir is not None:
        thumb, level0 = _slide_thumbnail(slide_file)
    feats = saved_frozen_features(model, config, store)
    if heatmap_dir is not None and thumb is None:
        builder = StoreThumbnail(store.coords, extent, store_level0_size(store.attrs, store.coords, extent))
    slide_in: Any = store
    if feats is not None:
        slide_in = (feats, store.grid)
        if builder is not None and not from_features:  # no embedding pass to piggy-back on: read the tiles once
            builder = StoreThumbnail.from_store(store)  # (feature files: a blank canvas of the slide's level-0 size)
    preds = predict_protocols(
        model.encoder, model.aggregator, slide_in, protocols, slide_id=str(row["slide_id"]), seed=seed,
        batch_size=batch_size, device=device, on_batch=builder.add if (builder is not None and feats is None) else None,
    )
    # the run's probability calibration (train.calibrate), for eval and predict alike
    preds = {name: calibrated_prediction(pred, getattr(model, "endpoint", None)) for name, pred in preds.items()}
    any_pred = next(iter(preds.values()))
    att = any_pred.attention
    loc = None
    if att is not None:
        frac = lesion_fraction(row, store, extent)
        if frac is not None:
            loc = localisation_auc(att, frac)
    png = None
    outlined = False
    if heatmap_dir is not None and att is not None:
        if builder is not None:
            thumb, level0 = builder.image, builder.level0_size
        png, outlined = _draw_heatmap(heatmap_dir, row, store, extent, thumb, level0, any_pred, heatmap_mode, title)
    st = store.stain
    return SlideScore(preds=preds, localisation=loc, heatmap=png, outlined=png is not None and outlined,
                      stain_normalised=None if st is None else st.normalised, stain_problem="" if st is None else st.problem)


def _slide_thumbnail(path: Any) -> tuple[Any, Any]:
    """(thumbnail, level-0 size) of the slide file at ``path``; (None, None) when it does not open or read."""
    from wsi_pipeline.export.thumbnail import open_slide_or_none, slide_thumbnail

    thumb = level0 = None
    slide = open_slide_or_none(path)
    if slide is not None:
        try:
            thumb, level0 = slide_thumbnail(slide)
        except (OSError, ValueError, RuntimeError) as e:  # a damaged region: rebuild from the tiles instead
            log.warning("thumbnail of %s failed (%s); rebuilding it from the tile store", path, e)
            thumb = level0 = None
        finally:
            close = getattr(slide, "close", None)
            if close:
                close()
    return thumb, level0


def _draw_heatmap(heatmap_dir: Path, row: pd.Series, store: TileStore, extent: float, thumb: Any, level0: Any,
                  pred: SlidePrediction, mode: str, title: str) -> tuple[Path | None, bool]:
    """Write the slide's heatmap PNG, scores CSV and GeoJSON; (the PNG, whether lesion outlines were drawn)."""
    from wsi_pipeline.export.slide_outputs import write_slide_outputs

    if pred.attention is None:  # nothing to draw
        return None, False
    outline = lesion_outline(row, store, extent, level0, thumb.shape[:2])
    outs = write_slide_outputs(
        heatmap_dir, str(row["slide_id"]), thumbnail=thumb, level0_size=level0, coords=store.coords, grid=store.grid,
        tile_extent=extent, attention=pred.attention, instance_scores=pred.instance_scores, mode=mode, title=title,
        outline=outline,
    )
    return outs.png, outline is not None and bool(outline.any())
