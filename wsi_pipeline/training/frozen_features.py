"""Frozen-encoder features for the ``frozen`` strategy, extracted before training (validation reads them
lazily: :class:`wsi_pipeline.inference.features.LazyFeatures`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig
from wsi_pipeline.devices import bf16_active
from wsi_pipeline.methods.models import frozen_encoder, frozen_features_dir
from wsi_pipeline.training.calibration import calibrate_encoder

if TYPE_CHECKING:
    from wsi_pipeline.training.preflight import RunPlan

__all__ = ["ensure_features"]

log = logging.getLogger(__name__)


def ensure_features(config: PipelineConfig, method: MethodConfig, plan: RunPlan, device: torch.device, progress: bool) -> Path:
    """Make sure the slides a frozen method reads as features have up-to-date ones; extract the rest.

    Those are the training and validation slides, or only the validation slides when the method
    augments (its training bags are then embedded on the fly from augmented tiles). Returns the
    method's feature folder.
    """
    from wsi_pipeline.inference.features import extract_features, features_path

    if config.data.features is not None:  # precomputed files (data.features): nothing to extract
        from wsi_pipeline.training.precomputed import features_input_dir

        return features_input_dir(config)
    out = Path(frozen_features_dir(method, config.data.features_dir))
    slides = plan.val if method.train.augment.enabled else plan.train + plan.val
    if not slides:
        return out
    missing = [s.slide_id for s in slides if not features_path(out, s.slide_id).is_file()]
    if missing:  # the normal first run: information, not a warning
        log.info(
            "method %s: %d of %d slides have no feature file in %s; extracting them now with the frozen %s encoder",
            method.name, len(missing), len(slides), out, method.encoder.name,
        )
    rows = plan.manifest[plan.manifest["slide_id"].isin([s.slide_id for s in slides])]
    encoder = frozen_encoder(method).to(device)
    calibrate_encoder(encoder, method, plan.train, device, stain=plan.stain_ctx)
    # files that exist are checked against the encoder's weights and the store (stale ones are rebuilt)
    report = extract_features(
        rows, config.data.stores_dir(), out, method.encoder.name, method.encoder.weights,
        encoder=encoder, batch_size=method.chunk_size, device=str(device), progress=progress, stain=plan.stain_ctx,
        bf16=bf16_active(method.train.bf16, device),
    )
    failed = report[report["status"] == "failed"]
    if len(failed):
        raise RuntimeError(
            f"method {method.name!r}: feature extraction failed for {len(failed)} slide(s): "
            + "; ".join(f"{r.slide_id}: {r.error}" for r in failed.head(5).itertuples())
        )
    return out
