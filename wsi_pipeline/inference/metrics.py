"""Slide-level classification metrics, bootstrap intervals, the selection rule: moved to :mod:`wsi_pipeline.tasks.metrics` (the tasks own their metrics); the old import path still works."""

from __future__ import annotations

from wsi_pipeline.tasks.metrics import (  # noqa: F401  (the old import path)
    METRICS,
    BOOTSTRAP_MAX_REPEATS,
    RepeatMetrics,
    compute_metrics,
    compute_repeat_metrics,
    confusion,
    VALIDATION_METRICS,
    headline_metric,
    metric_order,
    selection_metric,
    selection_rule,
    bootstrap_interval,
    mean_std,
    resample_interval,
    summarise_repeats,
)

from wsi_pipeline.tasks import ENDPOINT_VALIDATION_METRICS  # noqa: F401  (the old import path)
from wsi_pipeline.tasks.base import LOWER_IS_BETTER  # noqa: F401  (the old import path)

__all__: list[str] = []  # the names' home is wsi_pipeline.tasks (ENDPOINT_VALIDATION_METRICS) and wsi_pipeline.tasks.metrics
