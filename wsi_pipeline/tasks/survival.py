"""The ``survival`` task: a slide's risk from its follow-up ``time`` and ``event`` (1 = observed, 0 = censored).

Losses (:mod:`wsi_pipeline.tasks.losses`): ``cox`` (partial likelihood over a step's bags; one
output, the log relative hazard) and ``nll_discrete`` (K hazard logits over time intervals cut at
the training split's event-time quantiles). Scores: ``risk`` (R,) and for ``nll_discrete`` the
interval ``survival`` (R, K). Metrics: :func:`~wsi_pipeline.tasks.endpoint_metrics.survival_metrics`
(they need the training split's :class:`~wsi_pipeline.tasks.endpoint_metrics.SurvivalReference`).
The predictions CSV: ``slide_id, cohort, time, event, risk, risk_group, [survival_at_<t> ...,]
n_tiles, protocol, n_repeats, risk_std, method, seed, patient_id``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.tasks.base import Endpoint, Task, register_task
from wsi_pipeline.tasks.endpoint_metrics import survival_metric_names, survival_metrics, survival_reference
from wsi_pipeline.tasks.losses import cox_partial_nll, discrete_bin, discrete_edges, discrete_time_nll
from wsi_pipeline.tasks.survival_metrics import harrell_c

__all__ = ["Survival", "survival_column"]


def survival_column(end: float) -> str:
    """``survival_at_<t>``: the column of the survival after the interval ending at ``end`` (``inf`` for the last)."""
    return f"survival_at_{float(end):g}"


def _time_event(targets: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray([float(v[0]) for v in targets]), np.asarray([int(v[1]) for v in targets])


@register_task("survival")
class Survival(Task):
    """A slide's survival risk (module docstring)."""

    losses = ("cox", "nll_discrete")
    target_columns = ("time", "event")
    target_noun = "time/event"
    uses_training_reference = True
    risk_groups = True
    score_key = "risk"
    validation_metrics = ("loss", "c_index")
    default_selection = "c_index"
    cv_metrics = ("c_index",)
    cv_headline = "c_index"

    def random_targets(self, rng: np.random.Generator, n: int, n_classes: int | None = None) -> list[Any]:
        events = rng.permutation(np.arange(n) % 3 != 0)  # two thirds observed
        return [(float(t), int(e)) for t, e in zip(np.round(rng.uniform(1.0, 60.0, n), 1), events)]

    def n_outputs(self, loss: str, options: Any, n_classes: int | None) -> int:
        return int(options.bins) if loss == "nll_discrete" else 1

    def coupled(self, loss: str) -> bool:
        return loss == "cox"

    def fit(self, loss: str, options: Any, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
        n_events = sum(int(e) == 1 for _, e in targets)
        if n_events < 2:  # Cox's loss is 0 without events (it trains nothing), and one event ranks nothing
            raise ValueError(
                f"the training split has {n_events} observed event(s) (event = 1) among {len(targets)} bags; survival "
                "training needs at least 2: a cohort whose every case is censored teaches the model nothing (check the "
                "event column: 1 = event observed, 0 = censored)"
            )
        base = super().fit(loss, options, n_classes, targets)
        if loss != "nll_discrete":
            return base
        times = np.asarray([float(t) for t, e in targets if int(e) == 1])
        return Endpoint(**{**base.to_state(), "edges": discrete_edges(times, int(options.bins))})

    def bag_loss(self, endpoint: Endpoint, output: Any, target: Any) -> Any:
        import torch

        if endpoint.loss != "nll_discrete":
            raise ValueError(f"loss {endpoint.loss!r} couples the bags of a step; use group_loss")
        logits = output.logits
        time, event = target
        j = torch.as_tensor(discrete_bin(time, endpoint.edges), device=logits.device).reshape(1)
        return discrete_time_nll(logits.reshape(1, -1), j, torch.as_tensor([float(event)], device=logits.device))

    def group_loss(self, endpoint: Endpoint, outputs: Sequence[Any], targets: Sequence[Any]) -> Any:
        import torch

        if endpoint.loss != "cox":
            return super().group_loss(endpoint, outputs, targets)
        risk = torch.cat([o.logits.reshape(-1)[:1] for o in outputs])
        time = torch.tensor([float(t[0]) for t in targets], dtype=risk.dtype)
        event = torch.tensor([float(t[1]) for t in targets])
        return cox_partial_nll(risk, time, event, endpoint.ties)

    def scores(self, endpoint: Endpoint, logits: np.ndarray) -> dict[str, np.ndarray]:
        z = np.asarray(logits, dtype=np.float64).reshape(-1, endpoint.n_outputs)
        if endpoint.loss != "nll_discrete":
            return {"risk": z[:, 0]}
        surv = np.exp(np.cumsum(-np.logaddexp(0.0, z), axis=1))  # prod (1 - sigmoid(z))
        return {"risk": -surv.sum(1), "survival": surv}

    def metric_names(self, ref: Any = None) -> tuple[str, ...]:
        return survival_metric_names(getattr(ref, "horizons", ()))

    def metrics(self, targets: Sequence[Any], scores: Mapping[str, np.ndarray], *, n_classes: int | None = None,
                ref: Any = None, only: str | None = None) -> dict[str, float]:
        if ref is None:
            raise ValueError("survival metrics need the training split's reference (censoring, horizons)")
        t, e = _time_event(targets)
        return survival_metrics(t, e, scores["risk"], ref, scores.get("survival"), only=only)

    def training_reference(self, endpoint: Endpoint, targets: Sequence[Any], scores: Sequence[float], *,
                           horizons: Sequence[float] = ()) -> Any:
        return survival_reference([float(v[0]) for v in targets], [int(v[1]) for v in targets], horizons=horizons,
                                  risk=scores, endpoint=endpoint)

    def validation(self, endpoint: Endpoint, targets: Sequence[Any], scores: Mapping[str, np.ndarray]) -> dict[str, float]:
        t, e = _time_event(targets)
        return {"c_index": harrell_c(t, e, scores["risk"])}

    def prediction_columns(self, n_classes: int | None, edges: Sequence[float] = ()) -> list[str]:
        curve = [survival_column(e) for e in (*edges, math.inf)] if edges else []
        return ["slide_id", "cohort", "time", "event", "risk", "risk_group", *curve, "n_tiles", "protocol", "n_repeats",
                "risk_std", "method", "seed", "patient_id"]

    def prediction_row(self, *, target: Any, scores: Mapping[str, np.ndarray], edges: Sequence[float] = (),
                       threshold: float | None = None) -> dict[str, Any]:
        risk = np.asarray(scores["risk"], dtype=np.float64)
        time, event = target if target is not None else (None, None)
        row: dict[str, Any] = {"time": time, "event": None if event is None else int(event), "risk": float(risk.mean()),
                               "risk_group": "" if threshold is None else ("high" if risk.mean() > threshold else "low")}
        if "survival" in scores:
            curve = np.asarray(scores["survival"], dtype=np.float64).mean(0)
            row.update({survival_column(e): float(v) for e, v in zip((*edges, math.inf), curve)})
        row["risk_std"] = float(risk.std())
        return row

    def summary_cells(self, row: Mapping[str, Any]) -> dict[str, str]:
        """The risk (higher = earlier event) and, where the training split's median was applied, the risk group."""
        cells = super().summary_cells(row)
        if row.get("risk_group"):
            cells["risk_group"] = str(row["risk_group"])
        return cells

    def report_metrics(self, recorded: Sequence[str]) -> list[str]:
        td = [m for m in dict.fromkeys(recorded) if m.startswith("td_auc_") and not m.endswith(("_low", "_high", "_std"))]
        return ["c_index", "uno_c_index", *td, "ibs", "logrank_p", "n_slides", "n_events"]

    def oof_value_columns(self, n_classes: int | None) -> list[str]:
        return ["risk"]

    def oof_columns(self, raw: pd.DataFrame, n_classes: int | None) -> dict[str, Any]:
        return {"label": raw["event"].astype("Int64"), "prob": raw["risk"].astype(float), "time": raw["time"].astype(float)}

    def cv_metric_values(self, rows: pd.DataFrame, n_classes: int | None) -> dict[str, float]:
        """Harrell's c-index of the risk (``prob``) against ``time`` and the event (``label``)."""
        return {"c_index": harrell_c(rows["time"].to_numpy(float), rows["label"].to_numpy(int), rows["prob"].to_numpy(float))}

    def cv_headline_fn(self, rows: pd.DataFrame, n_classes: int | None) -> Callable[[np.ndarray], float]:
        t = rows["time"].to_numpy(dtype=np.float64)
        y = rows["label"].to_numpy(dtype=np.float64)
        p = rows["prob"].to_numpy(dtype=np.float64)
        return lambda idx: harrell_c(t[idx], y[idx].astype(int), p[idx])
