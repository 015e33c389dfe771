"""Metrics of survival and regression models: moved to :mod:`wsi_pipeline.tasks.endpoint_metrics` (the tasks own their metrics); the old import path still works."""

from __future__ import annotations

from wsi_pipeline.tasks.endpoint_metrics import (  # noqa: F401  (the old import path)
    IBS_POINTS,
    PATIENT_PREFIX,
    REGRESSION_METRICS,
    SurvivalReference,
    endpoint_metric_names,
    horizon_name,
    regression_metrics,
    survival_metric_names,
    survival_metrics,
    survival_reference,
)

__all__: list[str] = []  # the names' home is wsi_pipeline.tasks.endpoint_metrics
