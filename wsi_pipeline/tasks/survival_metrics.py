"""Survival metrics of predicted risks: concordance, time-dependent AUC, Brier score, Kaplan-Meier, log-rank.

Inputs are NumPy arrays: ``time`` (float, the manifest's unit), ``event`` (bool: True = the event
was observed, False = censored at ``time``) and ``risk`` (float, higher = earlier event expected).
Definitions follow scikit-survival's (the tests compare against it and lifelines):

- :func:`harrell_c`: pairs (i, j) are comparable when i had the event and ``t_i < t_j``, or
  ``t_i == t_j`` and j is censored; concordant when ``risk_i > risk_j``; risks within 1e-8 count
  one half.
- :func:`uno_c`: Harrell's pairs weighted by ``1 / G(t_i)^2``, G the Kaplan-Meier estimate of the
  censoring distribution on the **training** split, only pairs with ``t_i < tau`` (default tau:
  the training split's largest time, beyond which G is unknown).
- :func:`time_auc`: cumulative/dynamic AUC at time t: cases ``t_i <= t`` with an event (weight
  ``1 / G(t_i)``) against controls ``t_j > t``.
- :func:`brier_scores` / :func:`integrated_brier_score`: IPCW Brier score of predicted survival
  probabilities ``S(t | x_i)``; the integral is the trapezoid rule over the times divided by their span.
- :func:`kaplan_meier`, :func:`logrank_test`: the product-limit estimate and the two-group
  log-rank test (chi-square with one degree of freedom).

G beyond the training split's last time is held at its last value (scikit-survival refuses such
times instead). Undefined values (no comparable pair, one group empty) are ``nan``, never errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2
from sklearn.metrics import roc_auc_score

__all__ = [
    "TIED_TOL",
    "CensoringWeights",
    "brier_scores",
    "harrell_c",
    "integrated_brier_score",
    "kaplan_meier",
    "logrank_test",
    "time_auc",
    "uno_c",
]

#: Risks closer than this are tied (as scikit-survival's ``tied_tol``).
TIED_TOL = 1e-8


def _arrays(time: np.ndarray, event: np.ndarray, risk: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    t = np.asarray(time, dtype=np.float64).reshape(-1)
    e = np.asarray(event).reshape(-1).astype(bool)
    if len(t) != len(e):
        raise ValueError(f"time and event must have the same length; got {len(t)} and {len(e)}")
    if np.isnan(t).any() or (t < 0).any():
        raise ValueError("survival times must be >= 0 and not missing")
    if risk is None:
        return t, e
    r = np.asarray(risk, dtype=np.float64).reshape(-1)
    if len(r) != len(t):
        raise ValueError(f"risk must have one value per slide ({len(t)}); got {len(r)}")
    return t, e, r


def kaplan_meier(time: np.ndarray, event: np.ndarray, *, reverse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Product-limit estimate: ``(distinct times, S(t) right after each)``.

    ``reverse``: the censoring distribution G instead (censorings are the events; at a time with
    both, the events happen first, so they leave the risk set before the censorings).
    """
    t, e = _arrays(time, event)
    times, inverse = np.unique(t, return_inverse=True)
    n_event: np.ndarray = np.bincount(inverse, weights=e, minlength=len(times))
    n_total = np.bincount(inverse, minlength=len(times)).astype(np.float64)
    at_risk = n_total[::-1].cumsum()[::-1]
    if reverse:
        at_risk = at_risk - n_event
        n_event = n_total - n_event
    ratio = np.divide(n_event, at_risk, out=np.zeros_like(at_risk), where=n_event > 0)
    return times, np.cumprod(1.0 - ratio)


def _step(times: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """A right-continuous step function (1 before the first time) evaluated at ``at``."""
    idx = np.searchsorted(times, np.asarray(at, dtype=np.float64), side="right") - 1
    return np.where(idx >= 0, values[np.clip(idx, 0, None)], 1.0)


@dataclass(frozen=True)
class CensoringWeights:
    """The censoring survival function G of a training split (Kaplan-Meier of the censorings)."""

    times: np.ndarray
    values: np.ndarray
    last_time: float

    @classmethod
    def fit(cls, time: np.ndarray, event: np.ndarray) -> CensoringWeights:
        t, e = _arrays(time, event)
        if len(t) == 0:
            raise ValueError("the censoring distribution needs training times; the training split has none")
        times, g = kaplan_meier(t, e, reverse=True)
        return cls(times, g, float(t.max()))

    def __call__(self, at: np.ndarray) -> np.ndarray:
        """G(t) at ``at`` (held at its last value beyond the last training time)."""
        return _step(self.times, self.values, at)


def harrell_c(time: np.ndarray, event: np.ndarray, risk: np.ndarray) -> float:
    """Harrell's concordance index (module docstring); ``nan`` without a comparable pair."""
    t, e, r = _arrays(time, event, risk)
    return _concordance(t, e, r, np.ones_like(t))


def _concordance(t: np.ndarray, e: np.ndarray, r: np.ndarray, w: np.ndarray) -> float:
    # comparable[i, j]: i had the event before j's time (or at it, j censored)
    later = (t[None, :] > t[:, None]) | ((t[None, :] == t[:, None]) & ~e[None, :])
    comparable = later & e[:, None] & (w[:, None] > 0)
    if not comparable.any():
        return math.nan
    diff = r[:, None] - r[None, :]
    tied = np.abs(diff) <= TIED_TOL
    score = np.where(tied, 0.5, (diff > 0).astype(np.float64))
    wi = w[:, None]
    return float((wi * score * comparable).sum() / (wi * comparable).sum())


def uno_c(time: np.ndarray, event: np.ndarray, risk: np.ndarray, censoring: CensoringWeights, tau: float | None = None) -> float:
    """Uno's concordance index with censoring weights ``1 / G(t_i)^2`` (module docstring)."""
    t, e, r = _arrays(time, event, risk)
    tau = censoring.last_time if tau is None else float(tau)
    g = censoring(t)
    w = np.where(e & (t < tau) & (g > 0), 1.0 / np.square(np.where(g > 0, g, 1.0)), 0.0)
    return _concordance(t, e, r, w)


def time_auc(time: np.ndarray, event: np.ndarray, risk: np.ndarray, at: float, censoring: CensoringWeights) -> float:
    """Cumulative/dynamic AUC at time ``at`` (module docstring); ``nan`` without a case or a control."""
    t, e, r = _arrays(time, event, risk)
    case = (t <= at) & e
    control = t > at
    if not case.any() or not control.any():
        return math.nan
    keep = case | control
    g = censoring(t[keep])
    w = np.where(case[keep], 1.0 / np.where(g > 0, g, np.inf), 1.0)
    return float(roc_auc_score(case[keep], r[keep], sample_weight=w))


def brier_scores(time: np.ndarray, event: np.ndarray, survival: np.ndarray, times: np.ndarray,
                 censoring: CensoringWeights) -> np.ndarray:
    """IPCW Brier score at each of ``times`` of predicted survival probabilities ``survival`` (N, T)."""
    t, e = _arrays(time, event)
    s = np.asarray(survival, dtype=np.float64).reshape(len(t), -1)
    times = np.asarray(times, dtype=np.float64)
    if s.shape[1] != len(times):
        raise ValueError(f"survival must have one column per time ({len(times)}); got {s.shape[1]}")
    g_y = censoring(t)
    g_y = np.where(g_y > 0, g_y, np.inf)
    out = np.empty(len(times))
    for k, at in enumerate(times):
        g_t = float(censoring(np.array([at]))[0]) or math.inf
        case = (t <= at) & e
        control = t > at
        out[k] = np.mean(np.square(s[:, k]) * case / g_y + np.square(1.0 - s[:, k]) * control / g_t)
    return out


def integrated_brier_score(time: np.ndarray, event: np.ndarray, survival: np.ndarray, times: np.ndarray,
                           censoring: CensoringWeights) -> float:
    """Trapezoid integral of :func:`brier_scores` over ``times`` (>= 2, increasing) divided by their span."""
    times = np.asarray(times, dtype=np.float64)
    if len(times) < 2 or not np.all(np.diff(times) > 0):
        return math.nan
    bs = brier_scores(time, event, survival, times, censoring)
    return float(np.trapezoid(bs, times) / (times[-1] - times[0]))


def logrank_test(time: np.ndarray, event: np.ndarray, group: np.ndarray) -> tuple[float, float]:
    """Two-group log-rank test: ``(chi-square statistic, p-value)``; ``(nan, nan)`` when a group is empty
    or there is no event."""
    t, e = _arrays(time, event)
    g = np.asarray(group).reshape(-1).astype(bool)
    if g.all() or not g.any() or not e.any():
        return math.nan, math.nan
    times = np.unique(t[e])
    at_risk = (t[None, :] >= times[:, None])
    dies = (t[None, :] == times[:, None]) & e[None, :]
    n = at_risk.sum(1).astype(np.float64)
    n1 = (at_risk & g[None, :]).sum(1).astype(np.float64)
    d = dies.sum(1).astype(np.float64)
    d1 = (dies & g[None, :]).sum(1).astype(np.float64)
    expected = d * n1 / n
    var = np.divide(d * (n1 / n) * (1 - n1 / n) * (n - d), n - 1, out=np.zeros_like(n), where=n > 1)
    if var.sum() <= 0:
        return math.nan, math.nan
    stat = float(np.square((d1 - expected).sum()) / var.sum())
    return stat, float(chi2.sf(stat, 1))
