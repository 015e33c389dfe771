"""The ``regression`` task: a number per slide (manifest ``target``) with an ``mse`` or ``huber`` loss.

Targets are standardised with the training split's mean and sd (stored in the :class:`Endpoint`);
the prediction is the output mapped back (``output * sd + mean``), ``huber_delta`` is in sd units.
Metrics: :func:`~wsi_pipeline.tasks.endpoint_metrics.regression_metrics` (``mae``, ``rmse``,
``pearson``, ``spearman``). The predictions CSV: ``slide_id, cohort, target, prediction, n_tiles,
protocol, n_repeats, prediction_std, method, seed, patient_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.tasks.base import Endpoint, Task, register_task
from wsi_pipeline.tasks.endpoint_metrics import REGRESSION_METRICS, regression_metrics

__all__ = ["Regression"]


@register_task("regression")
class Regression(Task):
    """A number per slide (module docstring)."""

    losses = ("mse", "huber")
    target_columns = ("target",)
    target_noun = "target"
    score_key = "prediction"
    validation_metrics = ("loss", "rmse", "mae", "pearson", "spearman")
    default_selection = "rmse"
    cv_metrics = ("rmse", "mae", "pearson")
    cv_headline = "rmse"

    def random_targets(self, rng: np.random.Generator, n: int, n_classes: int | None = None) -> list[Any]:
        return [float(v) for v in rng.normal(10.0, 3.0, n)]

    def fit(self, loss: str, options: Any, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
        y = np.asarray([float(v) for v in targets], dtype=np.float64)
        if len(y) < 2:
            raise ValueError(f"regression needs at least 2 training targets; got {len(y)}")
        with np.errstate(over="ignore", invalid="ignore"):
            mean, sd = float(y.mean()), float(y.std(ddof=1))
        limit = float(np.finfo(np.float32).max) / 1e3  # predictions are mapped back in float32: output * sd + mean
        if not (np.isfinite(mean) and np.isfinite(sd)) or max(abs(mean), sd, float(np.abs(y).max())) > limit:
            raise ValueError(
                f"regression targets up to {float(np.abs(y).max()):.3g} (mean {mean:.3g}, sd {sd:.3g}) overflow float32, "
                f"in which the model computes (limit {limit:.3g}); rescale the target column (other units, or its log)"
            )
        base = super().fit(loss, options, n_classes, targets)
        return Endpoint(**{**base.to_state(), "edges": (), "target_mean": mean, "target_sd": sd if sd > 0 else 1.0})

    def bag_loss(self, endpoint: Endpoint, output: Any, target: Any) -> Any:
        import torch
        import torch.nn.functional as F

        logits = output.logits
        y = torch.as_tensor((float(target) - endpoint.target_mean) / endpoint.target_sd, dtype=logits.dtype,
                            device=logits.device)
        pred = logits.reshape(-1)[0]
        if endpoint.loss == "mse":
            return (pred - y) ** 2
        return F.huber_loss(pred, y, delta=endpoint.huber_delta)

    def scores(self, endpoint: Endpoint, logits: np.ndarray) -> dict[str, np.ndarray]:
        z = np.asarray(logits, dtype=np.float64).reshape(-1, endpoint.n_outputs)
        return {"prediction": z[:, 0] * endpoint.target_sd + endpoint.target_mean}

    def metric_names(self, ref: Any = None) -> tuple[str, ...]:
        return REGRESSION_METRICS

    def metrics(self, targets: Sequence[Any], scores: Mapping[str, np.ndarray], *, n_classes: int | None = None,
                ref: Any = None, only: str | None = None) -> dict[str, float]:
        return regression_metrics(np.asarray(targets, dtype=np.float64), scores["prediction"])

    def cv_metric_values(self, rows: pd.DataFrame, n_classes: int | None) -> dict[str, float]:
        """RMSE, MAE and Pearson's r of the prediction (``prob``) against the target (``label``)."""
        m = regression_metrics(rows["label"].to_numpy(float), rows["prob"].to_numpy(float))
        return {k: m[k] for k in self.cv_metrics}

    def cv_headline_fn(self, rows: pd.DataFrame, n_classes: int | None) -> Callable[[np.ndarray], float]:
        y = rows["label"].to_numpy(dtype=np.float64)
        p = rows["prob"].to_numpy(dtype=np.float64)
        return lambda idx: float(np.sqrt(np.mean((y[idx] - p[idx]) ** 2)))
