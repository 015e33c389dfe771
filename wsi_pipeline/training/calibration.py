"""BatchNorm calibration of a run's encoder on training tiles (``encoder.calibrate_bn``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

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
    log_level: int = logging.DEBUG, stain: Any = None,
) -> None:
    """Calibrate ``encoder``'s BatchNorm statistics on ``method.encoder.calibrate_bn`` training tiles (no-op at 0).

    The calibration is logged at ``log_level``: the run logs its first one, not the repeats
    (feature extraction, per-epoch recalibration).

    Tiles are drawn evenly over ``slides`` with a fixed seed, shuffled so that every batch of
    ``method.chunk_size`` tiles mixes slides; see :mod:`wsi_pipeline.models.bn_calibration`.
    ``stain``: the run's :class:`~wsi_pipeline.data.stain_slides.StainContext`; each tile is
    normalised with its own slide's estimate, as in training.
    """
    n = method.encoder.calibrate_bn
    if n <= 0 or not slides:
        return
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.models.bn_calibration import calibrate_batchnorm

    reader = TileReader(slides, stain)
    rng = np.random.default_rng(CALIBRATION_SEED)
    per_slide = -(-n // len(slides))
    parts, owners = [], []
    for i in range(len(slides)):
        count = len(reader.store(i))
        parts.append(reader.read(i, np.sort(rng.choice(count, min(per_slide, count), replace=False))))
        owners.append(np.full(len(parts[-1]), i))
    order = rng.permutation(sum(len(p) for p in parts))[:n]
    tiles, owner = np.concatenate(parts)[order], np.concatenate(owners)[order]
    step = max(2, method.chunk_size)

    def batches() -> Iterator[torch.Tensor]:
        for j in range(0, len(tiles), step):
            t, o = tiles[j : j + step], owner[j : j + step]
            if len(t) < 2:
                continue
            if stain is None:
                yield tiles_to_tensor(t, device=device)
                continue
            x = torch.empty((len(t), 3) + t.shape[1:3], dtype=torch.get_default_dtype(), device=device)
            for i in np.unique(o):  # each slide's tiles with its own estimate (a per-tile transform)
                m = torch.from_numpy(o == i).to(device)
                x[m] = tiles_to_tensor(t[o == i], device=device, stain=reader.stain_of(int(i)))
            yield x

    seen = calibrate_batchnorm(encoder, batches())
    log.log(log_level, "method %s: BatchNorm statistics calibrated on %d training tiles (%d batches)", method.name, len(tiles), seen)
