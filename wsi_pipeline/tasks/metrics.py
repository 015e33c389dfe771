"""Slide-level metrics, all computed by scikit-learn; bootstrap intervals; mean +- std over seeds.

Metric names (keys of :func:`compute_metrics`): ``qwk`` (Cohen's kappa, quadratic weights),
``accuracy``, ``balanced_accuracy``, ``auc`` (binary: ROC AUC of ``probs[:, 1]``; more classes:
macro one-vs-rest ROC AUC) and ``n_slides``. A metric that is undefined on the given slides (AUC
with one class present, kappa when labels and predictions are one constant class) is ``nan``,
never an exception, so one small cohort does not stop an evaluation.

Repeated subsampling as the Big-Layers paper scores it (:func:`compute_repeat_metrics`): each
repeat's slide probabilities are scored on their own, and the model's score is the mean of the R
per-repeat metrics (the std over repeats reported beside it), not the metric of probabilities
averaged over repeats (an ensemble, a different and usually higher number).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sklearn
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    roc_auc_score,
)
from sklearn.exceptions import UndefinedMetricWarning

from wsi_pipeline.tasks.base import get_task

__all__ = [
    "METRICS",
    "BOOTSTRAP_MAX_REPEATS",
    "RepeatMetrics",
    "compute_metrics",
    "compute_repeat_metrics",
    "metric_value",
    "confusion",
    "VALIDATION_METRICS",
    "headline_metric",
    "metric_order",
    "selection_metric",
    "selection_rule",
    "bootstrap_interval",
    "mean_std",
    "resample_interval",
    "summarise_repeats",
]

#: Repeats a bootstrap resample scores under a per-repeat protocol (see :func:`bootstrap_interval`).
BOOTSTRAP_MAX_REPEATS = 5


def _check(labels: Sequence[int] | np.ndarray, probs: np.ndarray, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    p = np.asarray(probs, dtype=np.float64)
    if n_classes < 2:
        raise ValueError(f"n_classes={n_classes}; a classifier needs at least 2 classes")
    if p.ndim != 2 or p.shape[1] != n_classes:
        raise ValueError(f"probs must have shape (N, n_classes={n_classes}); got {p.shape}")
    if y.ndim != 1 or len(y) != len(p):
        raise ValueError(f"labels must be (N,) with N = len(probs) = {len(p)}; got shape {y.shape}")
    if y.size and (not np.issubdtype(y.dtype, np.integer)):
        if not np.all(np.mod(y, 1) == 0):
            raise ValueError(f"labels must be integer classes; got {y[:5]} (drop unlabelled slides first)")
        y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise ValueError(f"labels must lie in [0, {n_classes}); found {sorted(set(y.tolist()))[:10]}")
    return y.astype(np.int64), p


def _auc(y: np.ndarray, p: np.ndarray, n_classes: int) -> float:
    present = np.unique(y)
    if len(present) < 2:
        return math.nan
    if n_classes == 2:
        return float(roc_auc_score(y, p[:, 1]))
    if len(present) == n_classes:
        # scikit-learn insists that multi-class scores sum to 1 (float32 means of softmaxes can miss by 1e-7)
        q = p / np.clip(p.sum(axis=1, keepdims=True), 1e-12, None)
        return float(roc_auc_score(y, q, multi_class="ovr", average="macro", labels=np.arange(n_classes)))
    # Some classes absent from this cohort: macro one-vs-rest over the classes present (each
    # absent class has no positives, so its AUC is undefined and cannot enter the average).
    return float(np.mean([roc_auc_score(y == c, p[:, c]) for c in present]))


def _kappa(y: np.ndarray, pred: np.ndarray, n_classes: int) -> float:
    with warnings.catch_warnings():
        # 0/0 when labels and predictions are one constant class (RuntimeWarning in older
        # scikit-learn, UndefinedMetricWarning in newer ones); the value is nan either way.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UndefinedMetricWarning)
        k = cohen_kappa_score(y, pred, weights="quadratic", labels=np.arange(n_classes))
    return float(k)


def _balanced_accuracy(y: np.ndarray, p: np.ndarray, n_classes: int) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "y_pred contains classes not in y_true"
        return float(balanced_accuracy_score(y, p.argmax(axis=1)))


_METRIC_FNS: dict[str, Callable[[np.ndarray, np.ndarray, int], float]] = {
    "qwk": lambda y, p, c: _kappa(y, p.argmax(axis=1), c),
    "accuracy": lambda y, p, c: float(accuracy_score(y, p.argmax(axis=1))),
    "balanced_accuracy": _balanced_accuracy,
    "auc": _auc,
}


#: The metric registry: what :func:`compute_metrics` returns (besides ``n_slides``), in this order;
#: all are "higher is better".
METRICS: tuple[str, ...] = tuple(_METRIC_FNS)


def headline_metric(n_classes: int) -> str:
    """The metric a task is judged by, as the papers do: quadratic kappa (``"qwk"``) for graded
    multi-class tasks (PANDA ISUP, C > 2), ``"auc"`` for binary tasks (CAMELYON)."""
    return "qwk" if n_classes > 2 else "auc"


def metric_order(n_classes: int) -> tuple[str, ...]:
    """:data:`METRICS` with the task's :func:`headline_metric` first (tables and report columns)."""
    head = headline_metric(n_classes)
    return (head, *(m for m in METRICS if m != head))


#: Validation values training records per epoch (``val_<name>`` columns, in this order).
VALIDATION_METRICS: tuple[str, ...] = ("loss", *metric_order(2))


def compute_metrics(labels: Sequence[int] | np.ndarray, probs: np.ndarray, n_classes: int) -> dict[str, float]:
    """Slide-level metrics of class probabilities against integer labels.

    Parameters
    ----------
    labels : int (N,), classes in ``[0, n_classes)``; unlabelled slides must be dropped first.
    probs : float (N, n_classes), class probabilities per slide (rows sum to 1).
    n_classes : number of classes C >= 2.

    Returns
    -------
    dict with ``qwk``, ``accuracy``, ``balanced_accuracy``, ``auc`` (floats, ``nan`` where
    undefined, see the module docstring) and ``n_slides`` (N, as a float). The prediction is
    ``argmax(probs)`` (ties go to the lower class).
    """
    y, p = _check(labels, probs, n_classes)
    out: dict[str, float] = {"n_slides": float(len(y))}
    if len(y) == 0:
        return {**{m: math.nan for m in METRICS}, **out}
    for m in METRICS:
        out[m] = _METRIC_FNS[m](y, p, n_classes)
    return {m: out[m] for m in (*METRICS, "n_slides")}


@dataclass
class RepeatMetrics:
    """Metrics of a per-repeat subsample protocol on one cohort.

    Attributes
    ----------
    mean : the model's score: per metric of :data:`METRICS`, the mean over repeats of the
        per-repeat values (``nan`` if any repeat's value is undefined), plus ``n_slides`` and
        ``n_repeats`` (R).
    std : per metric, the sample standard deviation (ddof 1) over repeats; ``nan`` for R = 1.
    per_repeat : R dicts from :func:`compute_metrics`, one per repeat, in repeat order.
    """

    mean: dict[str, float]
    std: dict[str, float]
    per_repeat: list[dict[str, float]]


def metric_value(metric: str, labels: Sequence[int] | np.ndarray, probs: np.ndarray, n_classes: int) -> float:
    """One metric of :data:`METRICS` as :func:`compute_metrics` computes it (``nan`` without slides)."""
    y, p = _check(labels, probs, n_classes)
    if len(y) == 0:
        return math.nan
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):  # inputs checked above
        return _METRIC_FNS[metric](y, p, n_classes)


def compute_repeat_metrics(labels: Sequence[int] | np.ndarray, probs: np.ndarray, n_classes: int) -> RepeatMetrics:
    """The paper's subsample score: metrics of every repeat over all slides, then mean and std over repeats.

    Parameters
    ----------
    labels : int (N,), classes in ``[0, n_classes)``.
    probs : float (R, N, n_classes): slide n's class probabilities from repeat r's tiles (a slide
        with at most k tiles has the same all-tiles row in every repeat).
    n_classes : C >= 2.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 3 or p.shape[0] < 1:
        raise ValueError(f"repeat probabilities must have shape (R >= 1, N, n_classes={n_classes}); got {p.shape}")
    per = [compute_metrics(labels, p[r], n_classes) for r in range(p.shape[0])]
    out = summarise_repeats(per, METRICS)
    out.mean["n_slides"] = per[0]["n_slides"]
    out.mean["n_repeats"] = float(p.shape[0])
    return out


def confusion(labels: Sequence[int] | np.ndarray, probs: np.ndarray, n_classes: int) -> np.ndarray:
    """Confusion matrix int64 (C, C): row = true class, column = predicted class (argmax of ``probs``)."""
    y, p = _check(labels, probs, n_classes)
    return confusion_matrix(y, p.argmax(axis=1), labels=np.arange(n_classes)).astype(np.int64)


def selection_rule(n_classes: int | None, name: str = "auto", task: str = "classification") -> tuple[str, bool]:
    """The validation metric that picks the best checkpoint (and stops early), and whether higher is better:
    the registered task's :meth:`~wsi_pipeline.tasks.base.Task.selection_rule` (``"auto"``: its headline
    metric; ``"loss"``: the validation loss, lower-is-better)."""
    return get_task(task).selection_rule(name, n_classes)


def selection_metric(n_classes: int, name: str = "auto") -> str:
    """The name :func:`selection_rule` picks."""
    return selection_rule(n_classes, name)[0]


def bootstrap_interval(
    labels: Sequence[int] | np.ndarray,
    probs: np.ndarray | Sequence[np.ndarray],
    n_classes: int,
    metric: str,
    *,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    max_repeats: int = BOOTSTRAP_MAX_REPEATS,
) -> tuple[float, float]:
    """Percentile bootstrap interval of a metric over slides.

    Slides are resampled with replacement ``n_boot`` times. ``probs`` may be one (N, C) array or
    a list of them (one per seed, same slides and order): each resample then scores every seed
    on the same slides and takes the mean, giving the interval of the method's seed-mean.
    Resamples where the metric is undefined (e.g. one class only, for AUC) are skipped.

    Per-repeat protocols: an entry may be (R, N, C), one slide-probability matrix per repeat
    (:func:`compute_repeat_metrics`); a resample then scores the first ``m = min(R, max_repeats)``
    repeats on the same resampled slides and takes their mean, at m times the cost of a
    one-pass interval. With R <= ``max_repeats`` this is exactly the interval of the
    mean-over-repeats score. With R > ``max_repeats`` it is the interval of the m-repeat mean
    (repeats are independent draws, so the first m are a random sample of them), shifted by
    the difference between the R-repeat and the m-repeat scores on the whole cohort so that it
    surrounds the reported score, and clipped to the metric's range ([-1, 1] for ``qwk``,
    [0, 1] otherwise); it is a little wide, since a mean of fewer repeats varies more.

    Returns
    -------
    (low, high) at the ``level`` two-sided percentile interval; ``(nan, nan)`` when fewer than
    10 resamples give a defined value.

    Cost: one scikit-learn call per resample, seed and metric (about 1-3 ms each), so 1000
    resamples of three seeds take a few seconds per metric; lower ``n_boot`` for quick looks.
    """
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} unknown; choose one of {list(METRICS)}")
    stack = [probs] if isinstance(probs, np.ndarray) and np.ndim(probs) in (2, 3) else list(probs)
    # every entry as (R, N, C): one pass (R = 1) or the repeats of a per-repeat protocol
    full = [np.asarray(p, dtype=np.float64) for p in stack]
    full = [p[None] if p.ndim == 2 else p for p in full]
    checked = [[_check(labels, p[r], n_classes)[1] for r in range(len(p))] for p in full]
    y = _check(labels, full[0][0], n_classes)[0]
    fn = _METRIC_FNS[metric]
    bounds = (-1.0, 1.0) if metric == "qwk" else (0.0, 1.0)
    # inputs were validated once above; scikit-learn's per-call parameter checks would dominate
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        return resample_interval(
            len(y), checked, lambda idx, p: fn(y[idx], p[idx], n_classes), n_boot=n_boot, level=level, seed=seed,
            max_repeats=max_repeats, bounds=bounds,
        )


def resample_interval(
    n: int,
    stacks: Sequence[Sequence[Any]],
    fn: Callable[[np.ndarray, Any], float],
    *,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    max_repeats: int = BOOTSTRAP_MAX_REPEATS,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[float, float]:
    """The percentile bootstrap of :func:`bootstrap_interval` for any metric: the one resampling loop.

    Parameters
    ----------
    n : slides (or patients) resampled with replacement.
    stacks : per seed, per repeat, what ``fn`` scores (e.g. the probability matrix of that repeat).
    fn : ``fn(indices, payload) -> value`` on the resampled slides (``indices``: int array of length n).
    bounds : the metric's range, which a shifted interval is clipped to (see :func:`bootstrap_interval`).
    Other parameters and the result as :func:`bootstrap_interval`.
    """
    if max_repeats < 1:
        raise ValueError(f"max_repeats={max_repeats}; expected >= 1")
    if n == 0:
        return math.nan, math.nan
    rep = [list(s)[:max_repeats] for s in stacks]
    ps = [p for r in rep for p in r]
    owner = np.repeat(np.arange(len(rep)), [len(r) for r in rep])  # which seed each payload belongs to
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        per = np.asarray([fn(idx, p) for p in ps])
        v = float(np.mean([per[owner == i].mean() for i in range(len(rep))]))  # repeat mean, then seed mean
        if not math.isnan(v):
            values.append(v)
    if len(values) < 10:
        return math.nan, math.nan
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [a, 1.0 - a])
    if any(len(f) > len(r) for f, r in zip(stacks, rep)):
        # fewer repeats per resample than reported: centre the interval on the reported score
        every = np.arange(n)
        score = lambda st: float(np.mean([np.mean([fn(every, p) for p in s]) for s in st]))  # noqa: E731
        shift = score([list(s) for s in stacks]) - score(rep)
        if math.isfinite(shift):
            lo, hi = np.clip([lo + shift, hi + shift], *bounds)
    return float(lo), float(hi)


def summarise_repeats(per: list[dict[str, float]], metrics: Sequence[str]) -> RepeatMetrics:
    """:class:`RepeatMetrics` of per-repeat metric dicts: the mean and sample sd (ddof 1) over repeats of each of ``metrics``."""
    mean: dict[str, float] = {}
    std: dict[str, float] = {}
    for m in metrics:
        v = np.asarray([d.get(m, math.nan) for d in per], dtype=np.float64)
        mean[m] = float(v.mean())
        std[m] = float(v.std(ddof=1)) if len(v) > 1 else math.nan
    return RepeatMetrics(mean=mean, std=std, per_repeat=per)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1) over seeds, ignoring ``nan`` values.

    The paper tables report mean +- std over three models; with fewer than two defined values
    the std is ``nan`` (written as ``null`` in ``metrics.json``), never a misleading 0.
    """
    v = np.asarray([x for x in values if x is not None and not math.isnan(float(x))], dtype=np.float64)
    if v.size == 0:
        return math.nan, math.nan
    if v.size == 1:
        return float(v[0]), math.nan
    return float(v.mean()), float(v.std(ddof=1))
