"""The survival losses and their helpers (pure torch / numpy, no model code).

``cox`` (:func:`cox_partial_nll`): the negative log partial likelihood of the step's bags divided by
their number of events; risk sets are the bags of the step (so a step needs several bags and
events, ``train.batch_bags``). Tied event times: Breslow (every tied event sees the whole risk set)
or Efron (the tied events' own share of the risk set is removed step by step, l/d for l = 0..d-1).

``nll_discrete`` (:func:`discrete_time_nll`): time is cut into K intervals ``[e_k, e_{k+1})`` with
``e_0 = 0``, ``e_K = inf`` and inner edges the quantiles 1/K .. (K-1)/K of the training split's event
times. Output k is the logit of the hazard h_k = P(event in interval k | alive at its start). A
slide with an event in interval j contributes ``-log(h_j prod_{k<j}(1 - h_k))``; one censored in
interval j ``-log prod_{k<j}(1 - h_k)`` (it is known to have survived the intervals before j, no
more). Predicted survival after interval k is ``S_k = prod_{i<=k}(1 - h_i)`` and the risk is
``-sum_k S_k`` (minus the expected number of intervals survived).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["breslow_baseline", "cox_partial_nll", "discrete_bin", "discrete_edges", "discrete_time_nll"]


def cox_partial_nll(risk: Tensor, time: Tensor, event: Tensor, ties: str = "efron") -> Tensor:
    """Negative log Cox partial likelihood of ``risk`` (n,) divided by the number of events.

    Parameters
    ----------
    risk : log relative hazards (model outputs), any float dtype, with gradient.
    time : (n,) follow-up times; event : (n,) 1 = event observed, 0 = censored.
    ties : ``efron`` or ``breslow``.

    Returns
    -------
    Scalar tensor; ``0 * risk.sum()`` (zero, keeping the graph) when no event is observed.
    """
    if ties not in ("efron", "breslow"):
        raise ValueError(f"ties={ties!r}; expected 'efron' or 'breslow'")
    risk = risk.reshape(-1)
    time = torch.as_tensor(time, dtype=risk.dtype, device=risk.device).reshape(-1)
    ev = torch.as_tensor(event, device=risk.device).reshape(-1).bool()
    if not (len(risk) == len(time) == len(ev)):
        raise ValueError(f"risk, time and event must have one value per bag; got {len(risk)}, {len(time)}, {len(ev)}")
    if not bool(ev.any()):
        return risk.sum() * 0.0
    t_ev = torch.unique(time[ev])  # distinct event times (m,)
    at_risk = (time[None, :] >= t_ev[:, None]).to(risk.dtype)  # (m, n)
    dies = ((time[None, :] == t_ev[:, None]) & ev[None, :]).to(risk.dtype)
    d = dies.sum(1)
    shift = risk.detach().max()
    e = torch.exp(risk - shift)
    total = at_risk @ e  # sum of exp(risk) over each risk set
    tied = dies @ e  # over each time's events
    events = dies @ risk
    if ties == "breslow":
        log_terms = d * (torch.log(total) + shift)
    else:
        dmax = int(d.max().item())
        steps = torch.arange(dmax, dtype=risk.dtype, device=risk.device)
        valid = steps[None, :] < d[:, None]
        frac = torch.where(valid, steps[None, :] / d[:, None], torch.zeros_like(valid, dtype=risk.dtype))
        inner = total[:, None] - frac * tied[:, None]
        log_terms = (torch.where(valid, torch.log(inner) + shift, torch.zeros_like(inner))).sum(1)
    return -(events - log_terms).sum() / ev.sum().to(risk.dtype)


def discrete_edges(event_times: np.ndarray, bins: int) -> tuple[float, ...]:
    """Inner interval edges for ``nll_discrete``: the quantiles 1/K .. (K-1)/K of the event times.

    Raises ``ValueError`` when the training split has too few distinct event times for K intervals.
    """
    t = np.asarray(event_times, dtype=np.float64)
    if len(t) < bins:
        raise ValueError(f"loss_options.bins={bins}: the training split has {len(t)} event(s); need at least as many as bins")
    edges = np.quantile(t, np.arange(1, bins) / bins)
    if not np.all(np.diff(edges) > 0) or edges[0] <= 0:
        raise ValueError(
            f"loss_options.bins={bins}: the training split's event-time quantiles {np.round(edges, 4).tolist()} are not "
            "distinct and positive (many tied times); use fewer bins"
        )
    return tuple(float(v) for v in edges)


def discrete_bin(time: np.ndarray | Tensor | float, edges: Sequence[float]) -> np.ndarray:
    """Interval index of each time: the number of inner edges ``<= time`` (0 .. K-1)."""
    return np.searchsorted(np.asarray(edges, dtype=np.float64), np.asarray(time, dtype=np.float64), side="right")


def discrete_time_nll(logits: Tensor, interval: Tensor, event: Tensor) -> Tensor:
    """Mean discrete-time negative log-likelihood of hazard ``logits`` (n, K) (module docstring).

    ``interval`` (n,) is each time's interval index (:func:`discrete_bin`), ``event`` (n,) 1/0.
    """
    logits = logits.reshape(len(interval), -1) if logits.ndim < 2 else logits
    j = torch.as_tensor(interval, device=logits.device).long().reshape(-1, 1)
    ev = torch.as_tensor(event, device=logits.device).to(logits.dtype).reshape(-1)
    log_alive = F.logsigmoid(-logits).cumsum(1)  # log prod_{i<=k} (1 - h_i)
    before = torch.cat([torch.zeros_like(log_alive[:, :1]), log_alive[:, :-1]], 1).gather(1, j).reshape(-1)
    log_h = F.logsigmoid(logits).gather(1, j).reshape(-1)
    return -(before + ev * log_h).mean()


def breslow_baseline(time: np.ndarray, event: np.ndarray, risk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Breslow's cumulative baseline hazard of a Cox model on a training split.

    Returns ``(distinct event times, H0 at each)``, ``H0(t) = sum_{t_j <= t} d_j / sum_{i: t_i >= t_j} exp(risk_i)``;
    survival of a slide with risk r: ``S(t) = exp(-H0(t) exp(r))``.
    """
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    r = np.asarray(risk, dtype=np.float64)
    times = np.unique(t[e])
    if len(times) == 0:
        return np.zeros(0), np.zeros(0)
    shift = r.max()
    w = np.exp(r - shift)
    denom = (t[None, :] >= times[:, None]) @ w
    d = ((t[None, :] == times[:, None]) & e[None, :]).sum(1)
    return times, np.cumsum(d / denom) * math.exp(-shift)
