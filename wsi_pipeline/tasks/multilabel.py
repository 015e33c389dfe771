"""The ``multilabel`` task: several binary targets per slide, the manifest columns a method names.

In a method of the pipeline YAML::

    task: multilabel
    targets: [tp53, kras]     # binary 0/1 manifest columns; an empty cell masks that target for that slide

The aggregator has one output per target (its logit). The loss (``bce``) is the binary cross-entropy
with logits of every observed (slide, target) entry, averaged over the observed entries of the bag
(a slide missing one target trains on the others; a slide missing all of them is not trained on).
The aggregator's attention is shared by the targets (one attention branch, one linear output per
target), so a slide's heatmap is the same for every target.

Scores: ``probs`` (R, K), the sigmoid of each output. Metrics, per target ``<col>`` on the slides where
it is observed: ``auc_<col>`` (ROC AUC; ``nan`` with one class) and ``balanced_accuracy_<col>`` (at
probability 0.5); ``auc`` and ``balanced_accuracy`` are their means over the targets (``auc`` selects the
checkpoint and heads the cross-validation table). Predictions CSV: ``slide_id, cohort, <col> ...,
prob_<col> ..., n_tiles, protocol, n_repeats, prob_std, method, seed, patient_id`` (``prob_std``: the
largest standard deviation over repeats of a target's probability); ``oof_predictions.csv``: ``slide_id,
repeat, fold, method, <col> ..., prob_<col> ...``. A patient has a target positive when one of its slides
has. ``train.calibrate`` (``platt`` or ``temperature``) fits one map per target on the validation slides where
it is observed (:meth:`Multilabel.fit_calibration`).

A method's ``targets`` bind the task (:meth:`Multilabel.bind`): the bound task is named
``multilabel[<col>,<col>,...]`` (:func:`~wsi_pipeline.tasks.base.task_key`), the name configs, endpoints and
checkpoints carry, so a model knows its targets.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.tasks.base import Endpoint, Task, register_task, task_key

__all__ = ["MULTILABEL_RESERVED", "Multilabel", "masked_bce", "multilabel_metrics"]

#: Columns of the manifest and of the predictions a target may not be named after.
MULTILABEL_RESERVED: frozenset[str] = frozenset({
    "slide_id", "path", "split", "cohort", "patient_id", "n_tiles", "protocol", "n_repeats", "prob_std", "method",
    "seed", "repeat", "fold", "label", "prob", "pred"})


def masked_bce(logits: Any, target: Sequence[float]) -> Any:
    """Mean binary cross-entropy with logits over the observed (non-NaN) entries of ``target``;
    ``0 * logits.sum()`` (zero, keeping the graph) when none is observed."""
    import torch
    import torch.nn.functional as F

    z = logits.reshape(-1)
    y = torch.as_tensor(np.asarray(target, dtype=np.float64), dtype=z.dtype, device=z.device).reshape(-1)
    if len(y) != len(z):
        raise ValueError(f"multilabel: {len(z)} outputs but {len(y)} targets")
    seen = ~torch.isnan(y)
    if not bool(seen.any()):
        return z.sum() * 0.0
    return F.binary_cross_entropy_with_logits(z[seen], y[seen])


def multilabel_metrics(y: np.ndarray, probs: np.ndarray, targets: Sequence[str]) -> dict[str, float]:
    """``auc``, ``balanced_accuracy`` (means over the targets of the defined values), then ``auc_<col>`` and
    ``balanced_accuracy_<col>`` per target on its observed slides (scikit-learn's ``balanced_accuracy_score`` of the
    decision ``p >= 0.5``, written out: with one class observed it is that class's recall), and ``n_slides``. ``y``: (N, K) 0/1 with NaN
    where a target is missing; ``probs``: (N, K)."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(y, dtype=np.float64).reshape(len(y), len(targets))
    p = np.asarray(probs, dtype=np.float64).reshape(len(y), len(targets))
    per: dict[str, float] = {}
    for k, col in enumerate(targets):
        seen = ~np.isnan(y[:, k])
        yk, pk = y[seen, k].astype(np.int64), p[seen, k]
        auc = float(roc_auc_score(yk, pk)) if len(np.unique(yk)) == 2 else math.nan
        hit = (pk >= 0.5).astype(np.int64) == yk  # balanced accuracy: the mean recall of the classes observed
        bacc = float(np.mean([hit[yk == c].mean() for c in np.unique(yk)])) if len(yk) else math.nan
        per[f"auc_{col}"], per[f"balanced_accuracy_{col}"] = auc, bacc

    def mean(prefix: str) -> float:
        v = np.array([per[f"{prefix}_{c}"] for c in targets])
        v = v[~np.isnan(v)]
        return float(v.mean()) if len(v) else math.nan

    return {"auc": mean("auc"), "balanced_accuracy": mean("balanced_accuracy"), **per, "n_slides": float(len(y))}


def _matrix(targets: Sequence[Any], k: int) -> np.ndarray:
    """Slides' targets (tuples, or a number with one target: :attr:`Slide.y <wsi_pipeline.data.bags.Slide.y>`) as (N, k)."""
    return np.asarray([np.ravel(np.asarray(t, dtype=np.float64)) for t in targets], dtype=np.float64).reshape(-1, k)


def _probs(targets: Sequence[str]) -> list[str]:
    return [f"prob_{c}" for c in targets]


@register_task("multilabel")
class Multilabel(Task):
    """Several binary targets per slide (module docstring); a method's ``targets`` bind it (:meth:`bind`)."""

    losses = ("bce",)
    target_columns = ()  # a bound task's own (bind)
    target_noun = "target"
    takes_targets = True
    score_key = "probs"
    validation_metrics = ("loss", "auc", "balanced_accuracy")
    default_selection = "auc"
    cv_metrics = ("auc", "balanced_accuracy")
    cv_headline = "auc"

    # ---- a method's targets ----------------------------------------------------------------

    def check_method(self, targets: Sequence[str], where: str) -> None:
        """A non-empty list of distinct column names (identifiers, not a reserved column)."""
        if not targets:
            raise ValueError(f"{where}.targets is missing or empty; task 'multilabel' needs the manifest's binary "
                             "columns to predict, e.g. targets: [tp53, kras]")
        bad = [t for t in targets if not isinstance(t, str) or not t.isidentifier() or keyword.iskeyword(t)]
        if bad:
            raise ValueError(f"{where}.targets: {bad} are not column names; expected names of letters, digits and _ "
                             "(not starting with a digit)")
        reserved = sorted(set(targets) & MULTILABEL_RESERVED)
        if reserved:
            raise ValueError(f"{where}.targets: {reserved} name columns the manifest or the predictions already have; "
                             "rename the target column(s)")
        dup = sorted({t for t in targets if list(targets).count(t) > 1})
        if dup:
            raise ValueError(f"{where}.targets lists {dup} twice; expected distinct columns")

    def bind(self, targets: tuple[str, ...]) -> Task:
        if not targets:
            return self
        names = tuple(targets)
        per = tuple(f"{m}_{c}" for c in names for m in ("auc", "balanced_accuracy"))
        bound: type[Multilabel] = type(f"Multilabel_{len(names)}", (Multilabel,), {
            "name": task_key("multilabel", names), "target_columns": names,
            "validation_metrics": (*Multilabel.validation_metrics, *per), "cv_metrics": (*Multilabel.cv_metrics, *per)})
        return bound()

    def _targets(self) -> tuple[str, ...]:
        if not self.target_columns:
            raise ValueError("task 'multilabel' needs its targets: methods[].targets: [col, ...]")
        return self.target_columns

    def has_target(self, manifest: pd.DataFrame) -> pd.Series:
        """Rows with at least one of the targets given (the others are masked)."""
        return manifest[list(self._targets())].notna().any(axis=1)

    # ---- label schema ------------------------------------------------------------------

    def slide_fields(self, values: Sequence[Any]) -> tuple[int, tuple[float, ...] | None]:
        return -1, tuple(math.nan if v is None or pd.isna(v) else float(v) for v in values)

    def manifest_target(self, row: Any) -> tuple[float, ...] | None:
        """The targets of a manifest row (NaN where missing); None when every one is missing."""
        values = [row.get(c) if isinstance(row, (Mapping, pd.Series)) else getattr(row, c, None) for c in self._targets()]
        if all(v is None or pd.isna(v) for v in values):
            return None
        return self.slide_fields(values)[1]

    def target_of(self, label: Any, target: tuple[float, ...] | None) -> Any:
        if target is None:
            return None
        return tuple(target) if len(target) > 1 else target[0]  # as Slide.y

    def pool_target(self, targets: Sequence[Any]) -> Any:
        """Per target, positive when one of the patient's slides is (NaN when none has it)."""
        y = _matrix(targets, len(self._targets()))
        with np.errstate(all="ignore"):
            out = [float(np.nanmax(c)) if (~np.isnan(c)).any() else math.nan for c in y.T]
        return tuple(out)

    def check_manifest(self, manifest: pd.DataFrame, source: str) -> None:
        """Every given value of a target column is 0 or 1 (an empty cell masks the target)."""
        super().check_manifest(manifest, source)
        cols: tuple[str, ...] = self.target_columns
        for c in cols:
            if c not in manifest.columns:
                continue
            values = pd.to_numeric(manifest[c], errors="coerce").astype(float)
            bad = values.notna() & ~values.isin([0.0, 1.0])
            if bad.any():
                ids = manifest.loc[bad, "slide_id"].astype(str).tolist() if "slide_id" in manifest.columns else []
                raise ValueError(f"{source}: column {c!r} (task 'multilabel') holds {manifest.loc[bad, c].tolist()[:3]} "
                                 f"for slide(s) {ids[:3]}; expected 0 or 1 (or an empty cell: target not known)")

    def random_targets(self, rng: np.random.Generator, n: int, n_classes: int | None = None) -> list[Any]:
        k = len(self.target_columns) or 2
        y = np.stack([rng.permutation(np.arange(n) % 2) for _ in range(k)], axis=1).astype(np.float64)
        if n > 4:
            y[n - 1, 0] = math.nan  # a masked entry
        return [tuple(float(v) for v in row) for row in y]

    # ---- outputs and training ----------------------------------------------------------

    def n_outputs(self, loss: str, options: Any, n_classes: int | None) -> int:
        return len(self._targets())

    def fit(self, loss: str, options: Any, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
        """Refuses a training split on which a target is never observed."""
        cols = self._targets()
        y = _matrix(targets, len(cols))
        never = [c for k, c in enumerate(cols) if not (~np.isnan(y[:, k])).any()]
        if never:
            raise ValueError(f"multilabel: no training slide has a value of target(s) {never}; expected 0/1 values "
                             "in those manifest columns for training slides")
        return super().fit(loss, options, n_classes, targets)

    def bag_loss(self, endpoint: Endpoint, output: Any, target: Any) -> Any:
        loss = masked_bce(output.logits, target)
        aux = getattr(output, "aux_loss", None)
        return loss if aux is None else loss + aux

    def scores(self, endpoint: Endpoint, logits: np.ndarray) -> dict[str, np.ndarray]:
        """The sigmoid of each output after its calibration (``a_k * z_k + b_k``; the identity when none)."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1, endpoint.n_outputs)
        if endpoint.target_scales:
            z = z * np.asarray(endpoint.target_scales) + np.asarray(endpoint.target_shifts)
        return {"probs": 0.5 * (1.0 + np.tanh(0.5 * z))}  # the sigmoid, without overflow

    def fit_calibration(self, endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any], method: str) -> Endpoint:
        """Per target, Platt (``a_k z_k + b_k``) or temperature (``a_k z_k``) scaling of its logit fitted on the
        validation slides where it is observed (:func:`~wsi_pipeline.tasks.calibration.fit_logit_map` of the
        two-class logits ``(0, z_k)``, whose class-1 probability is the sigmoid); a target with one class
        observed, or fitted backwards, keeps the identity."""
        from wsi_pipeline.tasks.calibration import LogitMap, fit_logit_map

        cols = self._targets()
        z = np.asarray(logits, dtype=np.float64).reshape(-1, len(cols))
        y = _matrix(targets, len(cols))
        maps = []
        for k in range(len(cols)):
            seen = ~np.isnan(y[:, k])
            two = np.stack([np.zeros(int(seen.sum())), z[seen, k]], axis=1)
            maps.append(fit_logit_map(two, y[seen, k].astype(np.int64), method))
        fitted = [m for m in maps if m.method != "none"]
        base = endpoint.calibrated(LogitMap(method=method if fitted else "none", n_slides=len(y)))
        return replace(base, target_scales=tuple(float(m.scale) for m in maps),
                       target_shifts=tuple(float(m.shift) for m in maps))

    def decision_accuracy(self, endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any]) -> float:
        """The share of observed (slide, target) entries decided right at probability 0.5."""
        y = _matrix(targets, len(self._targets()))
        p = self.scores(endpoint, logits)["probs"]
        seen = ~np.isnan(y)
        return float(np.mean((p[seen] >= 0.5) == (y[seen] == 1))) if seen.any() else math.nan

    def calibration_record(self, endpoint: Endpoint) -> dict[str, Any]:
        """Per target ``scale_<col>``, ``shift_<col>`` and the threshold on the model's own probability that the
        map moves to 0.5 (``threshold_on_model_probability_<col>``)."""
        out: dict[str, Any] = {"method": endpoint.calibration}
        scales = endpoint.target_scales or (1.0,) * len(self._targets())
        shifts = endpoint.target_shifts or (0.0,) * len(self._targets())
        for c, a, b in zip(self._targets(), scales, shifts):
            out.update({f"scale_{c}": float(a), f"shift_{c}": float(b),
                        f"threshold_on_model_probability_{c}": float(1.0 / (1.0 + np.exp(b / a)))})
        return out

    # ---- metrics -----------------------------------------------------------------------

    def metric_names(self, ref: Any = None) -> tuple[str, ...]:
        return ("auc", "balanced_accuracy", *(f"{m}_{c}" for c in self._targets() for m in ("auc", "balanced_accuracy")))

    def metrics(self, targets: Sequence[Any], scores: Mapping[str, np.ndarray], *, n_classes: int | None = None,
                ref: Any = None, only: str | None = None) -> dict[str, float]:
        cols = self._targets()
        y = _matrix(targets, len(cols))
        return multilabel_metrics(y, np.asarray(scores["probs"]), cols)

    # ---- predictions and reports -------------------------------------------------------

    def prediction_columns(self, n_classes: int | None, edges: Sequence[float] = ()) -> list[str]:
        cols = self._targets()
        return ["slide_id", "cohort", *cols, *_probs(cols), "n_tiles", "protocol", "n_repeats", "prob_std", "method",
                "seed", "patient_id"]

    def prediction_row(self, *, target: Any, scores: Mapping[str, np.ndarray], edges: Sequence[float] = (),
                       threshold: float | None = None) -> dict[str, Any]:
        cols = self._targets()
        probs = np.asarray(scores["probs"], dtype=np.float64).reshape(-1, len(cols))
        values = [None] * len(cols) if target is None else list(np.ravel(np.asarray(target, dtype=np.float64)))
        row: dict[str, Any] = {c: None if v is None or pd.isna(v) else float(v) for c, v in zip(cols, values)}
        row.update({p: float(v) for p, v in zip(_probs(cols), probs.mean(0))})
        row["prob_std"] = float(probs.std(0).max()) if probs.size else 0.0
        return row

    def summary_cells(self, row: Mapping[str, Any]) -> dict[str, str]:
        """Each target's probability."""
        return {p: "-" if row.get(p) is None or pd.isna(row.get(p)) else f"{float(row[p]):.3f}" for p in _probs(self._targets())}

    # ---- cross-validation --------------------------------------------------------------

    def oof_value_columns(self, n_classes: int | None) -> list[str]:
        return _probs(self._targets())

    def oof_columns(self, raw: pd.DataFrame, n_classes: int | None) -> dict[str, Any]:
        """Each target column, then each ``prob_<col>`` (no ``label``/``prob``: there is no one target)."""
        cols = self._targets()
        return {**{c: raw[c].astype(float) for c in cols}, **{p: raw[p].astype(float) for p in _probs(cols)}}

    def cv_metric_values(self, rows: pd.DataFrame, n_classes: int | None) -> dict[str, float]:
        cols = self._targets()
        m = multilabel_metrics(rows[list(cols)].to_numpy(float), rows[_probs(cols)].to_numpy(float), cols)
        return {k: m[k] for k in self.cv_metrics}

    def cv_headline_fn(self, rows: pd.DataFrame, n_classes: int | None) -> Callable[[np.ndarray], float]:
        cols = self._targets()
        y, p = rows[list(cols)].to_numpy(float), rows[_probs(cols)].to_numpy(float)
        return lambda idx: multilabel_metrics(y[idx], p[idx], cols)["auc"]
