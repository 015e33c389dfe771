"""Metric records of one model on one cohort under one protocol, and bootstrap intervals of seed means."""

from __future__ import annotations

from typing import Any

import numpy as np

from wsi_pipeline.evaluation.sets import EvalSet
from wsi_pipeline.export.metrics_json import MetricRecord
from wsi_pipeline.tasks.metrics import METRICS, bootstrap_interval, compute_metrics, compute_repeat_metrics
from wsi_pipeline.config.evaluation import EvalProtocol
from wsi_pipeline.inference.protocols import SlidePrediction, repeat_probs
from wsi_pipeline.progress import progress_bar

__all__ = ["bootstrap_records", "protocol_records"]


def protocol_records(
    method: str, seed: int, es: EvalSet, protocol: EvalProtocol, y: np.ndarray, preds: list[SlidePrediction], n_classes: int,
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


def bootstrap_records(
    probs_by: dict[tuple[str, str, str, str], dict[int, tuple[np.ndarray, np.ndarray]]],
    n_classes: int,
    n_boot: int,
    seed: int,
    progress: bool = False,
) -> list[MetricRecord]:
    """95 % bootstrap intervals of each method's seed-mean metric (same resampled slides for every seed).

    Per-repeat protocols (probabilities (R, N, C)): each resample scores the first
    :data:`~wsi_pipeline.tasks.metrics.BOOTSTRAP_MAX_REPEATS` repeats and averages them (see
    :func:`~wsi_pipeline.tasks.metrics.bootstrap_interval`).
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
