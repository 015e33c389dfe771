"""After training: the probability calibration and decision threshold of ``best.pt``, fitted on the
run's validation slides (``train.calibrate``; :mod:`wsi_pipeline.tasks.calibration`).

The best epoch's models score every validation slide on all its tiles (the protocol ``eval``
uses), the task fits its calibration to those logits (:meth:`~wsi_pipeline.tasks.base.Task.fit_calibration`),
and ``best.pt`` is rewritten (atomically) with the calibrated :class:`~wsi_pipeline.tasks.base.Endpoint`,
which ``eval`` and ``predict`` read. ``calibration.json`` in the run folder says what was fitted:
the map, the decision threshold it implies on the model's own probability of class 1, and the
validation accuracy before and after. Refitting gives the same map (it reads the models, not the
earlier calibration), so a run interrupted here redoes it on resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint
from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.methods.models import restore_encoder
from wsi_pipeline.tasks import Endpoint
from wsi_pipeline.tasks.calibration import LogitMap
from wsi_pipeline.training.strategies import Strategy

__all__ = ["CALIBRATION_FILE", "calibrate_best"]

log = logging.getLogger(__name__)

#: What :func:`calibrate_best` fitted, in the run folder.
CALIBRATION_FILE = "calibration.json"


def _accuracy(endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any]) -> float:
    return endpoint.definition.decision_accuracy(endpoint, logits, targets)


def calibrate_best(
    run_dir: Path, strategy: Strategy, val_inputs: Sequence[Any], targets: Sequence[Any], config: PipelineConfig,
    method: MethodConfig, device: torch.device,
) -> Endpoint | None:
    """Fit ``method.train.calibrate`` for ``run_dir/best.pt`` on the validation slides; return the new endpoint.

    ``strategy`` is the run's (its modules are loaded with the best epoch's states), ``val_inputs``
    its validation inputs and ``targets`` their targets. Nothing is done (None) with ``calibrate:
    none``, without validation slides or without ``best.pt``.
    """
    best = run_dir / "best.pt"
    if method.train.calibrate == "none" or not targets or not best.is_file():
        return None
    from wsi_pipeline.inference.protocol_metrics import slide_predictions

    ckpt = load_run_checkpoint(best)
    for name, module in strategy.state_modules().items():
        if name == "encoder":
            restore_encoder(method, module, ckpt.models[name], ckpt.encoder_info, where=str(best))
        else:
            module.load_state_dict(ckpt.models[name])
    endpoint = Endpoint.from_state(ckpt.endpoint)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.eval.seed)
        preds = slide_predictions(strategy.embedder(), strategy.aggregator, val_inputs, "all", n_classes=endpoint.n_outputs,
                                  device=device, batch_size=method.chunk_size, seed=config.eval.seed)
    logits = np.stack([np.asarray(p.repeat_logits, dtype=np.float64).mean(0) for p in preds])
    raw = endpoint.calibrated(LogitMap())  # the model's own scores: refitting reads the models, not an earlier map
    fitted = endpoint.definition.fit_calibration(raw, logits, targets, method.train.calibrate)
    save_run_checkpoint(best, dataclasses.replace(ckpt, endpoint=fitted.to_state()))
    fitted_map = fitted.definition.calibration_record(fitted)  # the task says what its map is
    record = {"method": fitted_map.pop("method"), "requested": method.train.calibrate, **fitted_map,
              "validation_slides": len(targets), "validation_accuracy_uncalibrated": _accuracy(raw, logits, targets),
              "validation_accuracy_calibrated": _accuracy(fitted, logits, targets)}
    write_text_atomic(run_dir / CALIBRATION_FILE, json.dumps(record, indent=1) + "\n")
    if record["method"] == "none":
        log.warning("%s: no %s calibration fitted on %d validation slides (one class, or a model that ranks them "
                    "backwards); probabilities stay uncalibrated", run_dir, method.train.calibrate, len(targets))
    else:
        log.info("%s: %s calibration on %d validation slides: %s", run_dir, record["method"], len(targets),
                 ", ".join(f"{k} {v:.3g}" for k, v in fitted_map.items() if isinstance(v, float)))
    return fitted
