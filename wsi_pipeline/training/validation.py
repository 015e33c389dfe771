"""Validation after each epoch, and the rule that picks ``best.pt``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig, TrainConfig
from wsi_pipeline.tasks import get_task
from wsi_pipeline.tasks.metrics import VALIDATION_METRICS, selection_rule
from wsi_pipeline.training import distributed
from wsi_pipeline.training.strategies import Strategy

__all__ = ["VAL_METRICS", "improves", "selection", "validate", "validation_columns"]

#: The validation columns of ``history.csv`` (``val_<name>``) of a classification run, in order.
VAL_METRICS = VALIDATION_METRICS


def validation_columns(task: str) -> tuple[str, ...]:
    """The validation values a run of ``task`` records per epoch (``val_<name>`` columns)."""
    return get_task(task).validation_metrics


def selection(train_cfg: TrainConfig, n_classes: int | None, task: str = "classification") -> tuple[str, bool]:
    """``(metric name, higher is better)`` of ``train.select_metric``
    (:func:`wsi_pipeline.tasks.metrics.selection_rule`: ``loss`` is lower-is-better)."""
    return selection_rule(n_classes, train_cfg.select_metric, task)


def _better(value: float | None, best: float | None, higher: bool) -> bool:
    if value is None or not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    return value > best if higher else value < best


def improves(value: float | None, loss: float | None, best: dict[str, Any], higher: bool) -> bool:
    """Whether an epoch with validation ``value`` (the selection metric) and ``loss`` beats ``best``.

    A better metric wins; an equal metric wins with a lower validation loss. Without the
    tie-break a metric that saturates early (AUC 1.0 on a small validation set after one epoch)
    would pin ``best.pt`` to that first, barely trained, epoch.
    """
    if _better(value, best.get("value"), higher):
        return True
    tied = value is not None and best.get("value") is not None and value == best["value"]
    return tied and _better(loss, best.get("loss"), higher=False)


def validate(
    strategy: Strategy,
    inputs: Sequence[Any],
    labels: list[Any],
    config: PipelineConfig,
    method: MethodConfig,
    device: torch.device,
    *,
    progress: bool = False,
) -> dict[str, float]:
    """Validation metrics (``loss, auc, qwk, accuracy, balanced_accuracy``); empty without validation slides.

    ``inputs`` come from ``strategy.val_inputs``; the protocol is the method's ``val_protocol`` with
    torch's generator seeded from ``eval.seed`` (the caller's random state is left as it was).
    Under torchrun every rank scores its shard of the slides (positions ``rank, rank + G, ...``),
    the predictions are gathered in slide order and every rank computes the same metrics; each
    slide's subsets are seeded by the slide, so the result is the single process's. ``progress``: a bar
    over the slides (a periodic line with the rate and time left in a log file).
    """
    if not labels:
        return {}
    from wsi_pipeline.inference.protocol_metrics import endpoint_validation_metrics, slide_predictions

    encoder = strategy.embedder()
    mine = distributed.shard(len(inputs))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.eval.seed)
        preds = slide_predictions(
            encoder, strategy.aggregator, [inputs[i] for i in mine], method.val_protocol, n_classes=strategy.endpoint.n_outputs,
            device=device, batch_size=method.chunk_size, seed=config.eval.seed, positions=mine, progress=progress,
        )
    preds = distributed.gather_in_order(mine, preds)
    return endpoint_validation_metrics(strategy.endpoint, labels, preds, method.val_protocol)  # the task's values
