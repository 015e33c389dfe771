"""What a model predicts and how it is trained: classification, survival (Cox, discrete time), regression.

An :class:`Endpoint` turns a method's ``task``/``loss``/``loss_options`` and what was learnt from
the training split (discrete-time bin edges, the targets' mean and sd) into:

- the aggregator's output size (:attr:`Endpoint.n_outputs`): C classes; 1 (a Cox risk, a
  standardised regression value); K (``nll_discrete``: one hazard logit per time interval);
- the loss of one bag (:meth:`Endpoint.bag_loss`), or of a group of bags for the Cox loss, which
  couples the bags of an optimiser step (:meth:`Endpoint.group_loss`; :attr:`Endpoint.coupled`);
- per-slide scores from the outputs (:meth:`Endpoint.scores`).

Losses
------
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

``mse`` / ``huber``: on targets standardised with the training split's mean and sd; the
prediction is the output mapped back (``output * sd + mean``). ``huber_delta`` is in sd units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from wsi_pipeline.config.pipeline import MethodConfig

__all__ = [
    "Endpoint",
    "breslow_baseline",
    "cox_partial_nll",
    "discrete_bin",
    "discrete_edges",
    "discrete_time_nll",
    "endpoint_outputs",
    "fit_endpoint",
]


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


def endpoint_outputs(method: MethodConfig, n_classes: int | None) -> int:
    """The aggregator's output size for a method (config only: what :class:`Endpoint` says, without data)."""
    loss = getattr(method, "loss", None) or "cross_entropy"
    if loss == "cross_entropy":
        if n_classes is None:
            raise ValueError(f"method {method.name!r} classifies: data.n_classes is needed")
        return int(n_classes)
    if loss == "nll_discrete":
        return int(method.loss_options.bins)
    return 1


@dataclass(frozen=True)
class Endpoint:
    """A method's task and loss with what training learnt from its training split (module docstring).

    Attributes
    ----------
    task, loss : the method's (``loss`` resolved).
    n_outputs : the aggregator's output size.
    ties : Cox ties (``efron``/``breslow``).
    edges : ``nll_discrete`` inner interval edges (K - 1 times, increasing).
    target_mean, target_sd : regression standardisation (training split).
    huber_delta : in sd units.
    """

    task: str = "classification"
    loss: str = "cross_entropy"
    n_outputs: int = 2
    ties: str = "efron"
    edges: tuple[float, ...] = ()
    target_mean: float = 0.0
    target_sd: float = 1.0
    huber_delta: float = 1.0

    @property
    def coupled(self) -> bool:
        """True when the loss couples the bags of a step (Cox): it is computed over a group of bags."""
        return self.loss == "cox"

    def to_state(self) -> dict[str, Any]:
        """Plain containers for checkpoints."""
        d = asdict(self)
        d["edges"] = list(self.edges)
        return d

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Endpoint:
        s = dict(state)
        s["edges"] = tuple(float(v) for v in s.get("edges", ()))
        return cls(**{k: v for k, v in s.items() if k in cls.__dataclass_fields__})

    # ---- losses ------------------------------------------------------------------------

    def bag_loss(self, output: Any, target: Any) -> Tensor:
        """The loss of one bag (not for ``cox``, which needs the step's bags: :meth:`group_loss`).

        ``target``: the class index (classification), ``(time, event)`` (survival) or the value (regression).
        """
        logits = output.logits
        if self.loss == "cross_entropy":
            y = torch.as_tensor(target, dtype=torch.long, device=logits.device).reshape(1)
            loss = F.cross_entropy(logits.reshape(1, -1), y)
            aux = getattr(output, "aux_loss", None)
            return loss if aux is None else loss + aux
        if self.loss == "nll_discrete":
            time, event = target
            j = torch.as_tensor(discrete_bin(time, self.edges), device=logits.device).reshape(1)
            return discrete_time_nll(logits.reshape(1, -1), j, torch.as_tensor([float(event)], device=logits.device))
        if self.loss in ("mse", "huber"):
            y = torch.as_tensor((float(target) - self.target_mean) / self.target_sd, dtype=logits.dtype, device=logits.device)
            pred = logits.reshape(-1)[0]
            if self.loss == "mse":
                return (pred - y) ** 2
            return F.huber_loss(pred, y, delta=self.huber_delta)
        raise ValueError(f"loss {self.loss!r} couples the bags of a step; use group_loss")

    def group_loss(self, outputs: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """The loss of a step's bags: Cox over them; for the other losses the mean of :meth:`bag_loss`."""
        if self.loss != "cox":
            return torch.stack([self.bag_loss(o, t) for o, t in zip(outputs, targets)]).mean()
        risk = torch.cat([o.logits.reshape(-1)[:1] for o in outputs])
        time = torch.tensor([float(t[0]) for t in targets], dtype=risk.dtype)
        event = torch.tensor([float(t[1]) for t in targets])
        return cox_partial_nll(risk, time, event, self.ties)

    # ---- scores ------------------------------------------------------------------------

    def scores(self, logits: np.ndarray) -> dict[str, np.ndarray]:
        """Per-slide scores of outputs ``logits`` (R, n_outputs), one row per repeat.

        Returns ``probs`` (R, C) for classification; ``risk`` (R,) for survival (and ``survival``
        (R, K) after each interval for ``nll_discrete``); ``prediction`` (R,) for regression.
        """
        z = np.asarray(logits, dtype=np.float64).reshape(-1, self.n_outputs)
        if self.task == "classification":
            e = np.exp(z - z.max(1, keepdims=True))
            return {"probs": e / e.sum(1, keepdims=True)}
        if self.loss == "cox":
            return {"risk": z[:, 0]}
        if self.loss == "nll_discrete":
            log_alive = np.cumsum(-np.logaddexp(0.0, z), axis=1)  # log prod (1 - sigmoid(z))
            surv = np.exp(log_alive)
            return {"risk": -surv.sum(1), "survival": surv}
        return {"prediction": z[:, 0] * self.target_sd + self.target_mean}


def fit_endpoint(method: MethodConfig, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
    """The :class:`Endpoint` of ``method`` with what it needs from the training split's ``targets``
    (``(time, event)`` pairs for survival, values for regression; unused for classification)."""
    task, loss = method.task, method.loss
    opts = method.loss_options
    base: dict[str, Any] = dict(task=task, loss=loss, n_outputs=endpoint_outputs(method, n_classes), ties=opts.ties,
                huber_delta=float(opts.huber_delta))
    if task == "survival":
        n_events = sum(int(e) == 1 for _, e in targets)
        if n_events < 2:  # Cox's loss is 0 without events (it trains nothing), and one event ranks nothing
            raise ValueError(
                f"the training split has {n_events} observed event(s) (event = 1) among {len(targets)} bags; survival "
                "training needs at least 2: a cohort whose every case is censored teaches the model nothing (check the "
                "event column: 1 = event observed, 0 = censored)"
            )
    if loss == "nll_discrete":
        times = np.asarray([float(t) for t, e in targets if int(e) == 1])
        base["edges"] = discrete_edges(times, int(opts.bins))
    if task == "regression":
        y = np.asarray([float(v) for v in targets], dtype=np.float64)
        if len(y) < 2:
            raise ValueError(f"method {method.name!r}: regression needs at least 2 training targets; got {len(y)}")
        with np.errstate(over="ignore", invalid="ignore"):
            mean, sd = float(y.mean()), float(y.std(ddof=1))
        limit = float(np.finfo(np.float32).max) / 1e3  # predictions are mapped back in float32: output * sd + mean
        if not (np.isfinite(mean) and np.isfinite(sd)) or max(abs(mean), sd, float(np.abs(y).max())) > limit:
            raise ValueError(
                f"regression targets up to {float(np.abs(y).max()):.3g} (mean {mean:.3g}, sd {sd:.3g}) overflow float32, "
                f"in which the model computes (limit {limit:.3g}); rescale the target column (other units, or its log)"
            )
        base.update(target_mean=mean, target_sd=sd if sd > 0 else 1.0)
    return Endpoint(**base)
