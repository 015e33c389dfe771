"""Metric records of every task's models, of slides and of patients, with bootstrap intervals.

Slide scores come per repeat (R repeats of a ``sub<k>x<R>`` protocol; one otherwise) as arrays, the task's
(:meth:`~wsi_pipeline.tasks.base.Task.slide_scores`): ``probs`` (N, C) for classification, ``risk`` (N,) (and
``survival`` (N, K) for discrete-time models) for survival, ``prediction`` (N,) for regression.

- ``all`` / ``ens<k>x<R>``: the metrics of each slide's scores averaged over repeats;
- ``sub<k>x<R>``: the metrics of every repeat (the Big-Layers paper's score), their mean as the model's
  score, ``<metric>_repeat_std``, ``n_repeats`` and one record per repeat.

A cohort without a slide to score records every metric as ``nan`` and ``n_slides`` 0.

Patients (``eval.level: patient``): each patient's scores pool its slides' (:func:`pool_patients`:
the mean, or with ``max`` the scores of its slide with the highest risk, prediction or probability
of the last class), per repeat; its target is its slides' (survival and regression targets are
the patient's, checked in the manifest; for classes the highest label of its slides). Patient
records carry the metric name with the prefix ``patient_`` (``patient_c_index``, ``patient_auc``).
Bootstrap intervals resample slides (patients at patient level) with
:func:`~wsi_pipeline.tasks.metrics.resample_interval`, the one resampling loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from wsi_pipeline.export.metrics_json import MetricRecord
from wsi_pipeline.tasks import get_task
from wsi_pipeline.tasks.endpoint_metrics import SurvivalReference
from wsi_pipeline.tasks.metrics import resample_interval, summarise_repeats

__all__ = [
    "Scores",
    "cohort_metrics",
    "level_bootstrap",
    "level_records",
    "metric_names",
    "pool_patients",
    "stack_repeats",
]

#: Per repeat, the score arrays of a cohort's slides (or patients).
Scores = list[dict[str, np.ndarray]]


def metric_names(task: str, ref: SurvivalReference | None = None) -> tuple[str, ...]:
    """The metrics recorded (and bootstrapped) for a task (:meth:`~wsi_pipeline.tasks.base.Task.metric_names`)."""
    return get_task(task).metric_names(ref)


def stack_repeats(per_slide: Sequence[dict[str, np.ndarray]], repeats: int) -> Scores:
    """Slides' per-repeat score arrays (each ``{name: (R_i, ...)}``) -> per repeat ``{name: (N, ...)}``;
    a slide scored in one pass contributes it to every repeat. ``repeats=1`` (``all``, ``ens<k>x<R>``): each
    slide's scores averaged over its repeats (the ensemble's, as its predictions-CSV row)."""
    if repeats == 1:
        return [{k: np.stack([s[k].mean(0) for s in per_slide]) for k in per_slide[0]} if per_slide else {}]
    out: Scores = []
    for r in range(repeats):
        out.append({k: np.stack([s[k][r if len(s[k]) > 1 else 0] for s in per_slide]) for k in per_slide[0]} if per_slide else {})
    return out


def _mean_over_repeats(scores: Scores) -> Scores:
    return [{k: np.mean([s[k] for s in scores], axis=0) for k in scores[0]}] if scores and scores[0] else scores


def cohort_metrics(task: str, targets: Sequence[Any], scores: dict[str, np.ndarray], *, n_classes: int | None = None,
                   ref: SurvivalReference | None = None, only: str | None = None) -> dict[str, float]:
    """Every metric of one repeat's scores (module docstring) against ``targets`` (survival: ``only`` that one):
    :meth:`~wsi_pipeline.tasks.base.Task.metrics`."""
    return get_task(task).metrics(targets, scores, n_classes=n_classes, ref=ref, only=only)


def level_records(
    method: str, seed: int, cohort: str, split: str, protocol: Any, task: str, targets: Sequence[Any], scores: Scores, *,
    n_classes: int | None = None, ref: SurvivalReference | None = None, prefix: str = "",
) -> tuple[list[MetricRecord], Scores]:
    """One model's records on one cohort under one protocol; returns them and the scores they came from
    (one entry for ``all``/``ens``, R for ``sub``), for :func:`level_bootstrap`."""
    rec = lambda metric, value, repeat=None: MetricRecord(method, seed, cohort, split, protocol.name, prefix + metric, value, repeat)  # noqa: E731
    names = metric_names(task, ref)
    empty = {**{m: math.nan for m in names}, "n_slides": 0.0}  # no slide with a target: every metric undefined
    if not protocol.per_repeat:
        scores = _mean_over_repeats(scores)
        if not targets:
            return [rec(k, v) for k, v in empty.items()], scores
        return [rec(k, v) for k, v in cohort_metrics(task, targets, scores[0], n_classes=n_classes, ref=ref).items()], scores
    per = [cohort_metrics(task, targets, s, n_classes=n_classes, ref=ref) if targets else empty for s in scores]
    rm = summarise_repeats(per, names)
    extra = {k: v for k, v in per[0].items() if k.startswith("n_") and k not in ("n_high_risk",)}
    out = [rec(k, v) for k, v in {**rm.mean, **extra, "n_repeats": float(len(per))}.items()]
    out += [rec(f"{k}_repeat_std", v) for k, v in rm.std.items()]
    out += [rec(k, d.get(k, math.nan), r) for r, d in enumerate(per) for k in names]
    return out, scores


def level_bootstrap(
    method: str, cohort: str, split: str, protocol: str, task: str, by_seed: dict[int, tuple[list[Any], Scores, Any]], *,
    n_boot: int, seed: int, n_classes: int | None = None, prefix: str = "",
) -> list[MetricRecord]:
    """95 % intervals of each metric's seed mean: ``by_seed`` = ``{seed: (targets, scores, survival reference)}``,
    the same slides (patients) in the same order for every seed; resamples score every seed's repeats."""
    items = list(by_seed.values())
    targets = items[0][0]
    if not targets or any(list(t) != list(targets) for t, _, _ in items[1:]):
        return []
    n = len(targets)
    out = []
    for metric in metric_names(task, items[0][2]):
        def fn(idx: np.ndarray, payload: tuple[dict[str, np.ndarray], Any], metric: str = metric) -> float:
            s, ref = payload
            sub = {k: v[idx] for k, v in s.items()}
            return cohort_metrics(task, [targets[i] for i in idx], sub, n_classes=n_classes, ref=ref, only=metric).get(metric, math.nan)

        stacks = [[(s, ref) for s in scores] for _, scores, ref in items]
        bounds = get_task(task).metric_bounds(metric)
        lo, hi = resample_interval(n, stacks, fn, n_boot=n_boot, seed=seed, bounds=bounds)
        out.append(MetricRecord(method, "mean", cohort, split, protocol, f"{prefix}{metric}_ci_low", lo))
        out.append(MetricRecord(method, "mean", cohort, split, protocol, f"{prefix}{metric}_ci_high", hi))
    return out


def pool_patients(patients: Sequence[str], targets: Sequence[Any], scores: Scores, how: str = "mean",
                  task: str = "classification") -> tuple[list[str], list[Any], Scores]:
    """Patients' targets and per-repeat scores from their slides' (module docstring), patients in order of first slide."""
    order = list(dict.fromkeys(patients))
    rows = {p: [i for i, q in enumerate(patients) if q == p] for p in order}
    kind = get_task(task)
    pt = [kind.pool_target([targets[i] for i in rows[p]]) for p in order]
    pooled: Scores = []
    for s in scores:
        key = s[kind.score_key]
        key = key[:, -1] if key.ndim > 1 else key
        one: dict[str, np.ndarray] = {}
        for name, v in s.items():
            if how == "max":
                pick = [rows[p][int(np.argmax(key[rows[p]]))] for p in order]
                one[name] = v[pick]
            else:
                one[name] = np.stack([v[rows[p]].mean(0) for p in order])
        pooled.append(one)
    return order, pt, pooled
