"""BatchNorm calibration of a run's encoder on training tiles (``encoder.calibrate_bn``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.data.bags import Slide, TileReader

__all__ = ["CALIBRATION_SEED", "calibrate_encoder"]

log = logging.getLogger(__name__)

#: Seed of the tile draw for BatchNorm calibration: the same tiles for every run and seed of a
#: method and for its feature extraction, so a frozen method's features and model agree.
CALIBRATION_SEED = 0


def calibrate_encoder(
    encoder: torch.nn.Module, method: MethodConfig, slides: Sequence[Slide], device: torch.device, *,
    log_level: int = logging.DEBUG,
) -> None:
    """Calibrate ``encoder``'s BatchNorm statistics on ``method.encoder.calibrate_bn`` training tiles (no-op at 0).

    The calibration is logged at ``log_level``: the run logs its first one, not the repeats
    (feature extraction, per-epoch recalibration).

    Tiles are drawn evenly over ``slides`` with a fixed seed, shuffled so that every batch of
    ``method.chunk_size`` tiles mixes slides; see :mod:`wsi_pipeline.models.bn_calibration`.
    """
    n = method.encoder.calibrate_bn
    if n <= 0 or not slides:
        return
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.models.bn_calibration import calibrate_batchnorm

    reader = TileReader(slides)
    rng = np.random.default_rng(CALIBRATION_SEED)
    per_slide = -(-n // len(slides))
    parts = []
    for i in range(len(slides)):
        count = len(reader.store(i))
        parts.append(reader.read(i, np.sort(rng.choice(count, min(per_slide, count), replace=False))))
    tiles = np.concatenate(parts)
    tiles = tiles[rng.permutation(len(tiles))[:n]]
    step = max(2, method.chunk_size)
    batches = (tiles_to_tensor(tiles[j : j + step], device=device) for j in range(0, len(tiles), step) if len(tiles[j : j + step]) > 1)
    seen = calibrate_batchnorm(encoder, batches)
    log.log(log_level, "method %s: BatchNorm statistics calibrated on %d training tiles (%d batches)", method.name, len(tiles), seen)
