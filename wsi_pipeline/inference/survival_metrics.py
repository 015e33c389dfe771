"""Survival metrics: moved to :mod:`wsi_pipeline.tasks.survival_metrics` (the tasks own their metrics); the old import path still works."""

from __future__ import annotations

from wsi_pipeline.tasks.survival_metrics import (  # noqa: F401  (the old import path)
    TIED_TOL,
    CensoringWeights,
    brier_scores,
    harrell_c,
    integrated_brier_score,
    kaplan_meier,
    logrank_test,
    time_auc,
    uno_c,
)

__all__: list[str] = []  # the names' home is wsi_pipeline.tasks.survival_metrics
