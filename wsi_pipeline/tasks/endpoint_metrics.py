"""Metrics of survival and regression models on a cohort, and the training-split reference they need.

Regression (:func:`regression_metrics`): ``mae``, ``rmse`` (scikit-learn), ``pearson``,
``spearman`` (SciPy) of predicted against true values.

Survival (:func:`survival_metrics`), from each slide's risk (and predicted survival function):

- ``c_index`` (Harrell's) and ``uno_c_index`` (Uno's, censoring weights from the training split);
- ``td_auc_<t>``: cumulative/dynamic AUC at each horizon t (``eval.horizons``, default the
  25/50/75th percentiles of the training split's event times);
- ``ibs``: integrated Brier score over :data:`IBS_POINTS` times evenly spaced between the 10th
  and 90th percentiles of the training split's event times (kept inside the cohort's own
  follow-up, as the Brier score needs); survival functions from the Breslow baseline of the
  training split's risks (Cox) or the predicted interval survival (discrete time);
- ``logrank_p`` / ``logrank_chi2``: log-rank test of the low- and high-risk groups, split at the
  median risk of the training split (the same threshold for every cohort), ``n_high_risk``;
- ``n_slides``, ``n_events``.

All metric functions are in :mod:`wsi_pipeline.tasks.survival_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import mean_absolute_error, mean_squared_error

from wsi_pipeline.tasks import survival_metrics as sm
from wsi_pipeline.tasks.base import Endpoint, get_task
from wsi_pipeline.tasks.losses import breslow_baseline, discrete_bin

__all__ = [
    "IBS_POINTS",
    "PATIENT_PREFIX",
    "REGRESSION_METRICS",
    "SurvivalReference",
    "endpoint_metric_names",
    "horizon_name",
    "regression_metrics",
    "survival_metric_names",
    "survival_metrics",
    "survival_reference",
]

REGRESSION_METRICS: tuple[str, ...] = ("mae", "rmse", "pearson", "spearman")
#: Prefix of patient-level metric records (``patient_c_index``, ``patient_auc``).
PATIENT_PREFIX = "patient_"
#: Times of the integrated Brier score's grid.
IBS_POINTS = 50


def horizon_name(t: float) -> str:
    """``td_auc_<t>`` with t written compactly (``td_auc_12.5``)."""
    return f"td_auc_{float(t):g}"


def regression_metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """MAE, RMSE, Pearson and Spearman correlation of ``pred`` against ``y``; correlations ``nan`` when
    either side is constant; ``n_slides``."""
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    if len(y) != len(p):
        raise ValueError(f"regression_metrics: {len(y)} targets but {len(p)} predictions")
    if len(y) == 0:
        return {**{m: math.nan for m in REGRESSION_METRICS}, "n_slides": 0.0}
    constant = len(y) < 2 or np.ptp(y) == 0 or np.ptp(p) == 0
    return {
        "mae": float(mean_absolute_error(y, p)),
        "rmse": float(math.sqrt(mean_squared_error(y, p))),
        "pearson": math.nan if constant else float(pearsonr(y, p).statistic),
        "spearman": math.nan if constant else float(spearmanr(y, p).statistic),
        "n_slides": float(len(y)),
    }


@dataclass
class SurvivalReference:
    """What survival metrics take from the training split (the same for every cohort).

    Attributes
    ----------
    censoring : G, the Kaplan-Meier censoring distribution of the training split.
    horizons : times of ``td_auc_<t>``.
    ibs_range : (first, last) time of the integrated Brier score's grid.
    threshold : the median training risk (high risk: above it); None when not known.
    baseline : Cox: Breslow's (times, H0) from the training split's risks; None otherwise.
    """

    censoring: sm.CensoringWeights
    horizons: tuple[float, ...]
    ibs_range: tuple[float, float]
    threshold: float | None = None
    baseline: tuple[np.ndarray, np.ndarray] | None = None
    endpoint: Endpoint | None = field(default=None)


def survival_reference(time: Sequence[float], event: Sequence[int], *, horizons: Sequence[float] = (),
                       risk: Sequence[float] | None = None, endpoint: Endpoint | None = None) -> SurvivalReference:
    """The :class:`SurvivalReference` of a training split (``risk``: the model's training risks, for the
    median split and, with a Cox endpoint, Breslow's baseline)."""
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    if not e.any():
        raise ValueError("the training split has no event; survival metrics need its event times")
    hz = tuple(float(h) for h in horizons) or tuple(float(v) for v in np.percentile(t[e], [25, 50, 75]))
    lo, hi = np.percentile(t[e], [10, 90])
    threshold = baseline = None
    if risk is not None:
        r = np.asarray(risk, dtype=np.float64)
        threshold = float(np.median(r))
        if endpoint is not None and endpoint.loss == "cox":
            baseline = breslow_baseline(t, e, r)
    return SurvivalReference(sm.CensoringWeights.fit(t, e), hz, (float(lo), float(hi)), threshold, baseline, endpoint)


def survival_metric_names(horizons: Sequence[float] = ()) -> tuple[str, ...]:
    """The survival metrics recorded per cohort, headline first (``td_auc_<t>`` per horizon)."""
    return ("c_index", "uno_c_index", *(horizon_name(h) for h in horizons), "ibs", "logrank_p", "logrank_chi2")


def endpoint_metric_names(task: str, horizons: Sequence[float] = ()) -> tuple[str, ...]:
    """The metrics of a task, headline first (what records, bootstrap intervals and tables carry)."""
    from types import SimpleNamespace

    return get_task(task).metric_names(SimpleNamespace(horizons=tuple(horizons)))


def ibs_times(ref: SurvivalReference, time: np.ndarray) -> np.ndarray:
    """The Brier grid: :data:`IBS_POINTS` times in ``ref.ibs_range`` cut to the cohort's follow-up
    ``[min time, max time)``; empty when fewer than two remain."""
    t = np.asarray(time, dtype=np.float64)
    if len(t) == 0:
        return np.zeros(0)
    lo, hi = max(ref.ibs_range[0], float(t.min())), min(ref.ibs_range[1], float(t.max()))
    if not hi > lo:
        return np.zeros(0)
    grid = np.linspace(lo, hi, IBS_POINTS)
    return grid[grid < t.max()]


def survival_at(ref: SurvivalReference, risk: np.ndarray, curves: np.ndarray | None, times: np.ndarray) -> np.ndarray | None:
    """Predicted S(t | slide) at ``times``, (N, T): Cox from Breslow's baseline, discrete time from the
    interval survival ``curves`` (N, K) (S over interval j is the survival after interval j - 1); None
    when neither is available."""
    r = np.asarray(risk, dtype=np.float64)
    if ref.baseline is not None:
        bt, h0 = ref.baseline
        idx = np.searchsorted(bt, times, side="right") - 1
        h = np.where(idx >= 0, h0[np.clip(idx, 0, None)], 0.0) if len(bt) else np.zeros(len(times))
        return np.exp(-np.outer(np.exp(r), h))
    if curves is not None and ref.endpoint is not None and ref.endpoint.edges:
        c = np.asarray(curves, dtype=np.float64).reshape(len(r), -1)
        before = np.concatenate([np.ones((len(r), 1)), c[:, :-1]], axis=1)
        return before[:, discrete_bin(times, ref.endpoint.edges)]
    return None


def survival_metrics(time: np.ndarray, event: np.ndarray, risk: np.ndarray, ref: SurvivalReference,
                     curves: np.ndarray | None = None, *, only: str | None = None) -> dict[str, float]:
    """The survival metrics of one cohort (module docstring); ``curves``: discrete-time interval survival
    (N, K); ``only``: compute just this metric (bootstrap resamples)."""
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    r = np.asarray(risk, dtype=np.float64)
    want = (lambda name: only is None or only == name)  # noqa: E731
    out: dict[str, float] = {}
    if want("c_index"):
        out["c_index"] = sm.harrell_c(t, e, r)
    if want("uno_c_index"):
        out["uno_c_index"] = sm.uno_c(t, e, r, ref.censoring)
    for h in ref.horizons:
        if want(horizon_name(h)):
            out[horizon_name(h)] = sm.time_auc(t, e, r, h, ref.censoring)
    if want("ibs"):
        grid = ibs_times(ref, t)
        surv = survival_at(ref, r, curves, grid) if len(grid) >= 2 else None
        out["ibs"] = sm.integrated_brier_score(t, e, surv, grid, ref.censoring) if surv is not None else math.nan
    if want("logrank_p") or want("logrank_chi2") or want("n_high_risk"):
        if ref.threshold is not None:
            high = r > ref.threshold
            out["logrank_chi2"], out["logrank_p"] = sm.logrank_test(t, e, high)
            out["n_high_risk"] = float(high.sum())
        else:
            out["logrank_chi2"] = out["logrank_p"] = math.nan
    if only is None:
        out["n_slides"] = float(len(t))
        out["n_events"] = float(e.sum())
    return out
