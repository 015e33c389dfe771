"""The evaluation stage's names in one place (``wsi-pipeline eval`` and ``wsi-pipeline predict``).

The stage is split by what each part does; this module re-exports their public names, so
``from wsi_pipeline.evaluation.runner import evaluate_pipeline`` keeps working:

- :mod:`~wsi_pipeline.evaluation.sets`: which slides are evaluated, which runs are finished;
- :mod:`~wsi_pipeline.evaluation.evaluate`: :func:`evaluate_pipeline` (every seed of every method
  on every test cohort; outputs in ``results/<pipeline>/``);
- :mod:`~wsi_pipeline.evaluation.predict`: :func:`predict_slides` on new slides;
- :mod:`~wsi_pipeline.evaluation.scoring`: one slide scored by one model (shared by both);
- :mod:`~wsi_pipeline.evaluation.records`: metric records per protocol, bootstrap intervals;
- :mod:`~wsi_pipeline.evaluation.localisation`: attention against ground-truth lesions.
"""

from __future__ import annotations

from wsi_pipeline.evaluation.evaluate import EvalSummary, evaluate_pipeline
from wsi_pipeline.evaluation.localisation import localisation_auc
from wsi_pipeline.evaluation.predict import PREDICT_EXTRA_COLUMNS, PredictSummary, _check_store_settings, _tiler_config, predict_slides
from wsi_pipeline.evaluation.sets import EXTERNAL, EvalSet, evaluation_sets, trained_runs, validation_scores
from wsi_pipeline.export.report import best_on_validation

__all__ = [
    "EXTERNAL",
    "PREDICT_EXTRA_COLUMNS",
    "EvalSet",
    "EvalSummary",
    "PredictSummary",
    "_check_store_settings",
    "_tiler_config",
    "evaluation_sets",
    "trained_runs",
    "localisation_auc",
    "evaluate_pipeline",
    "predict_slides",
    "validation_scores",
    "best_on_validation",
]
