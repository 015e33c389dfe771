"""The :class:`Task` contract, the task registry (:data:`TASKS`) and a method's fitted :class:`Endpoint`.

A task is what a method predicts from a slide (a class, a survival risk, a number, ...). It owns,
in one class, everything that differs between tasks:

- its label schema: the manifest columns its targets come from (:attr:`Task.target_columns`), its classes
  (:meth:`Task.classes`, :meth:`Task.lone_class`), how
  a manifest row becomes a training target (:meth:`Task.slide_fields`, :meth:`Task.target_of`) and
  how a patient's target pools its slides' (:meth:`Task.pool_target`);
- its model outputs (the aggregator's size, :meth:`Task.n_outputs`), its losses (:attr:`Task.losses`,
  the first is the default; :meth:`Task.bag_loss`, :meth:`Task.group_loss`) and what it learns from
  the training split before training (:meth:`Task.fit`);
- per-slide scores from the outputs (:meth:`Task.scores`) and of a slide's prediction (:meth:`Task.slide_scores`);
- its metrics (:meth:`Task.metric_names`, :meth:`Task.metrics`), its validation values and
  checkpoint selection (:attr:`Task.validation_metrics`, :meth:`Task.validation`, :meth:`Task.validation_values`,
  :meth:`Task.selection_rule`);
- the predictions CSV's columns and rows (:meth:`Task.prediction_columns`, :meth:`Task.prediction_row`) and
  what ``predict`` prints of a row (:meth:`Task.summary_cells`);
- the report's metric table (:meth:`Task.report_metrics`) and the cross-validation table
  (:attr:`Task.cv_metrics`, :attr:`Task.cv_headline`, :meth:`Task.oof_columns`,
  :meth:`Task.cv_metric_values`, :meth:`Task.cv_headline_fn`, the pooled ROC curves :meth:`Task.oof_roc`).
- its probability calibration (:meth:`Task.fit_calibration`) and what ``calibration.json`` says of it
  (:meth:`Task.decision_accuracy`, :meth:`Task.calibration_record`);
- for a task whose columns each method names (``multilabel``'s ``targets``; :attr:`Task.takes_targets`):
  the check of a method's list (:meth:`Task.check_method`) and the task bound to it (:meth:`Task.bind`),
  named ``<task>[<col>,...]`` (:func:`task_key`), the name configs, endpoints and checkpoints carry.

Register a task with ``@register_task("name")`` on a :class:`Task` subclass; ``get_task(name)``
returns its (stateless, shared) instance and :func:`task_names` lists them (the choices of
``methods[].task``). The built-in tasks are ``classification``, ``survival``, ``regression`` and ``multilabel``;
``docs/extending.md`` adds one.

Every part of the pipeline asks the task (``get_task(config.task)`` or
``endpoint.definition``); nothing outside this package compares a task's name to a string.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, TypeVar

import numpy as np
import pandas as pd

from wsi_pipeline.models.registry import Registry
from wsi_pipeline.tasks.calibration import LogitMap

__all__ = ["Endpoint", "LOWER_IS_BETTER", "TASKS", "Task", "get_task", "register_task", "task_key", "task_names"]

#: Metrics where lower is better (losses, errors, the Brier score).
LOWER_IS_BETTER: frozenset[str] = frozenset({"loss", "mae", "rmse", "ibs"})

#: Task classes by name; :func:`get_task` returns the shared instance.
TASKS: Registry[Callable[[], Task]] = Registry("task")
_INSTANCES: dict[str, Task] = {}
T = TypeVar("T", bound="type[Task]")


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: register a :class:`Task` subclass as ``name`` (sets its :attr:`Task.name`)."""

    def deco(cls: T) -> T:
        cls.name = name
        TASKS.register(name)(cls)
        return cls

    return deco


def get_task(name: str) -> Task:
    """The registered task ``name``; ``ValueError`` listing the registered names when it is unknown.

    ``name`` may carry a method's own targets, ``<task>[<col>,<col>,...]`` (:func:`task_key`): the task
    bound to them (:meth:`Task.bind`), whose :attr:`Task.name` is that key.
    """
    if name not in _INSTANCES:
        base, sep, rest = name.partition("[")
        if sep and rest.endswith("]"):
            _INSTANCES[name] = get_task(base).bind(tuple(c for c in rest[:-1].split(",") if c))
        else:
            _INSTANCES[name] = TASKS.get(name)()
    return _INSTANCES[name]


def task_key(name: str, targets: Sequence[str] = ()) -> str:
    """The string that names task ``name`` bound to a method's ``targets`` (``name`` itself without targets):
    what configs, endpoints and checkpoints pass around, and :func:`get_task` reads back."""
    return f"{name}[{','.join(targets)}]" if targets else name


def task_names() -> list[str]:
    """The registered tasks (``methods[].task`` choices)."""
    return TASKS.names()


@dataclass(frozen=True)
class Endpoint:
    """A method's task and loss with what training learnt from its training split.

    Plain values (saved in checkpoints, :meth:`to_state`); the behaviour is the task's
    (:attr:`definition`), which the methods below call.

    Attributes
    ----------
    task, loss : the method's (``loss`` resolved).
    n_outputs : the aggregator's output size.
    ties : Cox ties (``efron``/``breslow``).
    edges : ``nll_discrete`` inner interval edges (K - 1 times, increasing).
    target_mean, target_sd : regression standardisation (training split).
    huber_delta : in sd units.
    calibration, logit_scale, logit_shift, calibrated_on : the probability calibration fitted on the
        run's validation slides after training (:mod:`wsi_pipeline.tasks.calibration`; ``train.calibrate``):
        the task's scores read ``logit_scale * logits`` with ``logit_shift`` added to the log-odds of
        class 1; ``none`` / 1 / 0 / 0 until fitted.
    target_scales, target_shifts : a calibration per output (``multilabel``: each target's Platt map of its
        logit, ``a_k * z_k + b_k``); empty when none.
    """

    task: str = "classification"
    loss: str = "cross_entropy"
    n_outputs: int = 2
    ties: str = "efron"
    edges: tuple[float, ...] = ()
    target_mean: float = 0.0
    target_sd: float = 1.0
    huber_delta: float = 1.0
    calibration: str = "none"
    logit_scale: float = 1.0
    logit_shift: float = 0.0
    calibrated_on: int = 0
    target_scales: tuple[float, ...] = ()
    target_shifts: tuple[float, ...] = ()

    @property
    def logit_map(self) -> LogitMap:
        """The fitted calibration as a :class:`~wsi_pipeline.tasks.calibration.LogitMap` (the identity when none)."""
        return LogitMap(scale=self.logit_scale, shift=self.logit_shift, method=self.calibration, n_slides=self.calibrated_on)

    def calibrated(self, fitted: LogitMap) -> Endpoint:
        """This endpoint with the calibration ``fitted`` (replacing any earlier one, per-output maps included)."""
        return replace(self, calibration=fitted.method, logit_scale=float(fitted.scale), logit_shift=float(fitted.shift),
                       calibrated_on=int(fitted.n_slides), target_scales=(), target_shifts=())

    @property
    def definition(self) -> Task:
        """The registered :class:`Task` of :attr:`task`."""
        return get_task(self.task)

    @property
    def coupled(self) -> bool:
        """True when the loss couples the bags of a step (Cox): it is computed over a group of bags."""
        return self.definition.coupled(self.loss)

    def to_state(self) -> dict[str, Any]:
        """Plain containers for checkpoints."""
        d = asdict(self)
        d["edges"] = list(self.edges)
        d["target_scales"], d["target_shifts"] = list(self.target_scales), list(self.target_shifts)
        return d

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Endpoint:
        s = dict(state)
        for key in ("edges", "target_scales", "target_shifts"):
            s[key] = tuple(float(v) for v in s.get(key, ()))
        return cls(**{k: v for k, v in s.items() if k in cls.__dataclass_fields__})

    def bag_loss(self, output: Any, target: Any) -> Any:
        """The loss of one bag (:meth:`Task.bag_loss`)."""
        return self.definition.bag_loss(self, output, target)

    def group_loss(self, outputs: Sequence[Any], targets: Sequence[Any]) -> Any:
        """The loss of a step's bags (:meth:`Task.group_loss`)."""
        return self.definition.group_loss(self, outputs, targets)

    def scores(self, logits: np.ndarray) -> dict[str, np.ndarray]:
        """Per-slide scores of outputs ``logits`` (R, n_outputs), one row per repeat (:meth:`Task.scores`)."""
        return self.definition.scores(self, logits)


class _Outputs:
    """An aggregator output carrying only ``logits`` (a task's losses on stored outputs)."""

    def __init__(self, logits: Any) -> None:
        self.logits = logits


def _value(row: Any, column: str) -> Any:
    """``row[column]`` of a mapping / Series, or ``row.column`` of a named tuple; None when absent."""
    if isinstance(row, Mapping) or isinstance(row, pd.Series):
        return row[column] if column in row else None
    return getattr(row, column, None)


class Task(ABC):
    """What a method predicts and everything that depends on it (module docstring).

    Subclasses set the class attributes and implement the abstract methods; the other methods
    have defaults that fit a task with one score per slide (:attr:`score_key`) and a target per
    slide from :attr:`target_columns`.
    """

    #: The registered name (set by :func:`register_task`).
    name: ClassVar[str] = ""
    #: The losses it trains with (``methods[].loss``); the first is the default.
    losses: ClassVar[tuple[str, ...]] = ()
    #: The manifest columns its targets come from (a row missing any is not trained or scored on).
    target_columns: ClassVar[tuple[str, ...]] = ("target",)
    #: What a slide with a target has, for messages ("no slides with a <noun> value").
    target_noun: ClassVar[str] = "target"
    #: True when it predicts one of ``data.n_classes`` classes (needs ``n_classes``; the classification
    #: report, ROC curves and per-class probability columns).
    has_classes: ClassVar[bool] = False
    #: True when its metrics need the training split's reference (censoring, risk threshold):
    #: evaluation scores the training slides first.
    uses_training_reference: ClassVar[bool] = False
    #: True when the report draws Kaplan-Meier curves of predicted risk groups.
    risk_groups: ClassVar[bool] = False
    #: The per-slide score that ranks slides (patient ``max`` pooling) and is the OOF ``prob`` column.
    score_key: ClassVar[str] = "prediction"
    #: The validation values recorded per epoch (``val_<name>`` columns of ``history.csv``).
    validation_metrics: ClassVar[tuple[str, ...]] = ("loss",)
    #: What ``train.select_metric: auto`` selects on.
    default_selection: ClassVar[str] = "loss"
    #: The cross-validation table's metrics (``cv_table.csv``), in order, and the one given an interval.
    cv_metrics: ClassVar[tuple[str, ...]] = ()
    cv_headline: ClassVar[str] = ""
    #: True when a method names the task's manifest columns itself (``methods[].targets``; :meth:`bind`).
    takes_targets: ClassVar[bool] = False

    # ---- a method's own targets ----------------------------------------------------------

    def check_method(self, targets: Sequence[str], where: str) -> None:
        """Raise ``ValueError`` naming ``where`` (``methods.<name>``) when a method's ``targets`` do not fit the
        task; by default the task has fixed columns and takes no ``targets``."""
        if targets:
            raise ValueError(f"{where}.targets={list(targets)}: task {self.name!r} reads its target from the manifest "
                             f"column(s) {list(self.target_columns)}; `targets` is for a task that takes a method's own "
                             f"columns ({[n for n in task_names() if get_task(n).takes_targets]})")

    def bind(self, targets: tuple[str, ...]) -> Task:
        """This task with a method's own target ``targets`` (:attr:`takes_targets`); the task itself otherwise."""
        return self

    def classes(self, n_classes: int | None) -> int | None:
        """The classes it predicts out of ``data.n_classes`` (manifest labels are checked against them; the predictions
        CSV's and report's per-class columns): None for a task without classes; ``ValueError`` when it needs
        ``data.n_classes`` and has none."""
        return None

    def lone_class(self, targets: Sequence[Any]) -> Any:
        """The class every one of ``targets`` (a split's, non-empty) holds when they hold a single class (a
        classifier cannot learn or be scored on them: preflight warns); None otherwise or for a task without classes."""
        return None

    def has_target(self, manifest: pd.DataFrame) -> pd.Series:
        """Which rows of ``manifest`` have a target to train and score on (every :attr:`target_columns` value given)."""
        return manifest[list(self.target_columns)].notna().all(axis=1)

    # ---- label schema ------------------------------------------------------------------

    def slide_fields(self, values: Sequence[Any]) -> tuple[int, tuple[float, ...] | None]:
        """``(label, target)`` of a training slide from its :attr:`target_columns` values: the class
        index (classification) or -1, and the float target tuple or None."""
        return -1, tuple(float(v) for v in values)

    def target_of(self, label: Any, target: tuple[float, ...] | None) -> Any:
        """The training/scoring target of a slide from its manifest ``label`` and ``target`` tuple
        (the value :attr:`Slide.y <wsi_pipeline.data.bags.Slide.y>` holds); None when it has none."""
        if target is None:
            return None
        return target if len(target) > 1 else target[0]

    def pool_target(self, targets: Sequence[Any]) -> Any:
        """A patient's target from its slides' (the patient's own, so the first)."""
        return targets[0]

    @abstractmethod
    def random_targets(self, rng: np.random.Generator, n: int, n_classes: int | None = None) -> list[Any]:
        """``n`` plausible targets drawn with ``rng`` (the form :attr:`Slide.y <wsi_pipeline.data.bags.Slide.y>`
        holds), for the contract tests every registered task runs through."""

    def manifest_target(self, row: Any) -> tuple[float, ...] | None:
        """The values of :attr:`target_columns` in a manifest row (mapping, Series or named tuple) as floats;
        None when any is missing or empty."""
        values = [_value(row, c) for c in self.target_columns]
        if any(v is None or pd.isna(v) for v in values):
            return None
        return tuple(float(v) for v in values)

    def check_manifest(self, manifest: pd.DataFrame, source: str) -> None:
        """Raise ``ValueError`` naming ``source``, the column and the first slides when a target column present in
        ``manifest`` holds a value that is not a finite number (empty cells are slides without a target)."""
        for c in self.target_columns:
            if c not in manifest.columns:
                continue
            given = manifest[c].notna()
            values = pd.to_numeric(manifest[c], errors="coerce").astype(float)
            bad = given & ~np.isfinite(values)
            if bad.any():
                ids = manifest.loc[bad, "slide_id"].astype(str).tolist() if "slide_id" in manifest.columns else []
                raise ValueError(f"{source}: column {c!r} (task {self.name!r}) holds {manifest.loc[bad, c].tolist()[:3]} "
                                 f"for slide(s) {ids[:3]}; expected a finite number")

    # ---- outputs and training ----------------------------------------------------------

    def n_outputs(self, loss: str, options: Any, n_classes: int | None) -> int:
        """The aggregator's output size for ``loss`` with ``options`` (``LossOptions``)."""
        return 1

    def coupled(self, loss: str) -> bool:
        """Whether ``loss`` couples the bags of a step (it needs :meth:`group_loss`)."""
        return False

    def fit(self, loss: str, options: Any, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
        """The :class:`Endpoint` of a method from the training split's ``targets`` (raise
        ``ValueError`` saying what is wrong with them)."""
        return Endpoint(task=self.name, loss=loss, n_outputs=self.n_outputs(loss, options, n_classes),
                        ties=str(getattr(options, "ties", "efron")), huber_delta=float(getattr(options, "huber_delta", 1.0)))

    @abstractmethod
    def bag_loss(self, endpoint: Endpoint, output: Any, target: Any) -> Any:
        """The loss (scalar tensor) of one bag: ``output`` has ``logits`` (1, n_outputs)."""

    def group_loss(self, endpoint: Endpoint, outputs: Sequence[Any], targets: Sequence[Any]) -> Any:
        """The loss of a step's bags: the mean of :meth:`bag_loss` (override for a coupled loss)."""
        import torch

        return torch.stack([self.bag_loss(endpoint, o, t) for o, t in zip(outputs, targets)]).mean()

    def fit_calibration(self, endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any], method: str) -> Endpoint:
        """``endpoint`` with a probability calibration ``method`` (``train.calibrate``) fitted on validation
        ``logits`` (N, n_outputs) and their ``targets``; tasks without probabilities return it unchanged."""
        return endpoint

    def decision_accuracy(self, endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any]) -> float:
        """The accuracy of the decisions :meth:`scores` imply on ``logits`` (N, n_outputs) against ``targets``
        (``calibration.json``): the arg-max class of :attr:`score_key` by default."""
        probs = self.scores(endpoint, logits)[self.score_key]
        return float(np.mean(np.argmax(probs, axis=1) == np.asarray(targets, dtype=np.int64)))

    def calibration_record(self, endpoint: Endpoint) -> dict[str, Any]:
        """What ``calibration.json`` says of ``endpoint``'s fitted calibration: its map (``scale``, ``shift``) and,
        with two outputs, the decision threshold it implies on the model's own probability of class 1."""
        m = endpoint.logit_map
        out: dict[str, Any] = {"method": m.method, "scale": m.scale, "shift": m.shift}
        if endpoint.n_outputs == 2:
            out["threshold_on_model_probability"] = m.raw_threshold()
        return out

    @abstractmethod
    def scores(self, endpoint: Endpoint, logits: np.ndarray) -> dict[str, np.ndarray]:
        """Per-slide scores of outputs ``logits`` (R, n_outputs): ``{name: (R, ...)}``, including :attr:`score_key`."""

    def slide_scores(self, endpoint: Endpoint | None, pred: Any) -> dict[str, np.ndarray]:
        """The per-repeat scores ``{name: (R, ...)}`` of one slide's prediction under a protocol (a
        :class:`~wsi_pipeline.inference.protocols.SlidePrediction`): :meth:`scores` of its ``repeat_logits``."""
        if endpoint is None:
            raise ValueError(f"task {self.name!r}: scoring a slide needs the model's endpoint")
        return self.scores(endpoint, pred.repeat_logits)

    # ---- metrics -----------------------------------------------------------------------

    @abstractmethod
    def metric_names(self, ref: Any = None) -> tuple[str, ...]:
        """The metrics recorded (and bootstrapped) for a cohort, headline first."""

    @abstractmethod
    def metrics(self, targets: Sequence[Any], scores: Mapping[str, np.ndarray], *, n_classes: int | None = None,
                ref: Any = None, only: str | None = None) -> dict[str, float]:
        """Every metric of one repeat's ``scores`` ``{name: (N, ...)}`` against ``targets`` (``only``: that one)."""

    def training_reference(self, endpoint: Endpoint, targets: Sequence[Any], scores: Sequence[float], *,
                           horizons: Sequence[float] = ()) -> Any:
        """What :meth:`metrics` takes from the training split (``ref``), from its ``targets`` and the model's
        :attr:`score_key` per training slide; evaluation computes it when :attr:`uses_training_reference`."""
        return None

    def metric_bounds(self, metric: str) -> tuple[float, float]:
        """The range of a metric (bootstrap intervals are clipped to it)."""
        if metric in ("qwk", "pearson", "spearman"):
            return -1.0, 1.0
        if metric in ("mae", "rmse", "logrank_chi2"):
            return 0.0, math.inf
        return 0.0, 1.0

    def validation(self, endpoint: Endpoint, targets: Sequence[Any], scores: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Validation values besides ``loss`` of one repeat's scores (the rest of :attr:`validation_metrics`)."""
        m = self.metrics(targets, scores, n_classes=endpoint.n_outputs if self.has_classes else None)
        return {k: m[k] for k in self.validation_metrics if k != "loss"}

    def validation_values(self, endpoint: Endpoint, targets: Sequence[Any], preds: Sequence[Any], protocol: Any) -> dict[str, float]:
        """A model's validation values (:attr:`validation_metrics`, ``history.csv``) from every validation slide's
        prediction (:class:`~wsi_pipeline.inference.protocols.SlidePrediction`, in the order of ``targets``) under the
        parsed ``protocol``: per repeat (one for ``all``/ensembles: each slide's mean logits) the training ``loss`` over
        all slides (Cox: every slide in one risk set) and :meth:`validation`; for a per-repeat protocol their mean over
        repeats and ``<name>_repeat_std``."""
        import torch

        if len(preds) != len(targets):
            raise ValueError(f"endpoint_validation_metrics: {len(preds)} predictions but {len(targets)} targets")
        if not preds:
            return {m: math.nan for m in self.validation_metrics}
        logits = [p.repeat_logits for p in preds]
        if any(z is None for z in logits):
            raise ValueError("endpoint_validation_metrics: a slide prediction has no repeat_logits (the model's outputs); "
                             "score the slides with slide_predictions")
        per = []
        for r in range(protocol.repeats if protocol.per_repeat else 1):
            z = np.stack([lg[r if len(lg) > 1 else 0] if protocol.per_repeat else lg.mean(0) for lg in logits])
            with torch.no_grad():
                loss = float(self.group_loss(endpoint, [_Outputs(torch.as_tensor(row)) for row in z], list(targets)))
            per.append({"loss": loss, **self.validation(endpoint, list(targets), self.scores(endpoint, z))})
        if not protocol.per_repeat:
            return {m: per[0][m] for m in self.validation_metrics}
        values = {m: np.asarray([d.get(m, math.nan) for d in per], dtype=np.float64) for m in self.validation_metrics}
        return {**{m: float(v.mean()) for m, v in values.items()},  # as tasks.metrics.summarise_repeats
                **{f"{m}_repeat_std": float(v.std(ddof=1)) if len(v) > 1 else math.nan for m, v in values.items()}}

    def selection_rule(self, name: str, n_classes: int | None) -> tuple[str, bool]:
        """``(metric, higher is better)`` that picks the best checkpoint for ``train.select_metric`` ``name``."""
        if name == "loss":
            return "loss", False
        if name == "auto":
            name = self.default_selection
        if name not in self.validation_metrics:
            raise ValueError(f"selection metric {name!r} does not fit task {self.name!r}; choose 'auto' or one of "
                             f"{list(self.validation_metrics)}")
        return name, name not in LOWER_IS_BETTER

    # ---- predictions and reports -------------------------------------------------------

    def prediction_columns(self, n_classes: int | None, edges: Sequence[float] = ()) -> list[str]:
        """The columns of a predictions CSV."""
        return ["slide_id", "cohort", *self.target_columns, self.score_key, "n_tiles", "protocol", "n_repeats",
                f"{self.score_key}_std", "method", "seed", "patient_id"]

    def prediction_row(self, *, target: Any, scores: Mapping[str, np.ndarray], edges: Sequence[float] = (),
                       threshold: float | None = None) -> dict[str, Any]:
        """The task's cells of one predictions CSV row (targets and scores averaged over repeats, and the
        spread over repeats); the caller adds slide, cohort, tiles, protocol, method, seed and patient."""
        values = np.asarray(scores[self.score_key], dtype=np.float64)
        cells = [None] * len(self.target_columns) if target is None else list(target if isinstance(target, tuple) else (target,))
        row: dict[str, Any] = {c: None if v is None else float(v) for c, v in zip(self.target_columns, cells)}
        row.update({self.score_key: float(values.mean()), f"{self.score_key}_std": float(values.std())})
        return row

    def summary_cells(self, row: Mapping[str, Any]) -> dict[str, str]:
        """What ``predict`` prints of one predictions-CSV ``row`` (a :meth:`prediction_row` with the caller's
        cells): ``{heading: text}``, in order; by default the :attr:`score_key` value."""
        value = row.get(self.score_key)
        return {self.score_key: "-" if value is None or pd.isna(value) else f"{float(value):.4g}"}

    def report_metrics(self, recorded: Sequence[str]) -> list[str]:
        """The metrics of the report's table, given the names recorded in ``metrics.json``."""
        return [*self.metric_names(), "n_slides"]

    # ---- cross-validation --------------------------------------------------------------

    def oof_value_columns(self, n_classes: int | None) -> list[str]:
        """The predictions-CSV columns averaged over seeds into the out-of-fold predictions."""
        return [self.score_key]

    def oof_columns(self, raw: pd.DataFrame, n_classes: int | None) -> dict[str, Any]:
        """``label``, ``prob`` and extra columns of ``oof_predictions.csv`` from seed-averaged prediction rows."""
        return {"label": raw[self.target_columns[0]].astype(float), "prob": raw[self.score_key].astype(float)}

    def cv_metric_values(self, rows: pd.DataFrame, n_classes: int | None) -> dict[str, float]:
        """The :attr:`cv_metrics` of one set of OOF rows."""
        target = rows["label"].to_numpy(float)
        m = self.metrics(list(target), {self.score_key: rows["prob"].to_numpy(float)}, n_classes=n_classes)
        return {k: m[k] for k in self.cv_metrics}

    def cv_headline_fn(self, rows: pd.DataFrame, n_classes: int | None) -> Callable[[np.ndarray], float]:
        """``f(row indices) -> value`` of :attr:`cv_headline` on those OOF rows (the bootstrap's inner call)."""
        return lambda idx: self.cv_metric_values(rows.iloc[idx], n_classes)[self.cv_headline]

    def oof_roc(self, oof: pd.DataFrame) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The ROC curves ``[(method, fpr, tpr)]`` of the pooled out-of-fold predictions (``oof_predictions.csv``'s
        rows) the cross-validation report draws; none for a task without a binary decision."""
        return []
