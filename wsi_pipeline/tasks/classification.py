"""The ``classification`` task: a slide's class (manifest ``label``, 0 .. C-1) with a cross-entropy loss.

Outputs: C logits (``data.n_classes``); scores ``probs`` (R, C), their softmax; metrics
:func:`~wsi_pipeline.tasks.metrics.compute_metrics` (``qwk``, ``accuracy``, ``balanced_accuracy``,
``auc``); a patient's class is the highest of its slides'. The predictions CSV:
``slide_id, cohort, label, pred, prob_0 .. prob_{C-1}, n_tiles, protocol, n_repeats, prob_std, method,
seed, patient_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import math

import numpy as np
import pandas as pd

from wsi_pipeline.tasks.base import Endpoint, Task, register_task
from wsi_pipeline.tasks.metrics import (
    METRICS, VALIDATION_METRICS, compute_metrics, compute_repeat_metrics, headline_metric, metric_value,
)

__all__ = ["CLASS_LOSS", "Classification", "class_prediction_columns", "prob_columns"]

#: The cross-entropy on the slide's class index: the classification loss, and the one a block that trains its own
#: loss on the class (PatchGD, DTFD's tier-1; ``classes_only``) needs the method to train with.
CLASS_LOSS = "cross_entropy"


def prob_columns(n_classes: int) -> list[str]:
    """``prob_0 .. prob_{C-1}``."""
    return [f"prob_{c}" for c in range(n_classes)]


def class_prediction_columns(n_classes: int) -> list[str]:
    """The column names of a classification predictions CSV for ``n_classes`` classes, in order."""
    return (["slide_id", "cohort", "label", "pred", *prob_columns(n_classes)]
            + ["n_tiles", "protocol", "n_repeats", "prob_std", "method", "seed", "patient_id"])


def _repeat_stack(per_slide: Sequence[np.ndarray], repeats: int, n_classes: int) -> np.ndarray:
    """Slides' per-repeat probabilities (each (R_i, C)) as (R, N, C): a slide scored in one pass (at most k tiles)
    contributes it to every repeat (:func:`~wsi_pipeline.inference.protocols.repeat_probs`)."""
    if not per_slide:
        return np.zeros((repeats, 0, n_classes))
    cols = []
    for rp in per_slide:
        rp = np.asarray(rp, dtype=np.float64)
        if len(rp) == 1:
            rp = np.repeat(rp, repeats, axis=0)
        elif len(rp) != repeats:
            raise ValueError(f"a slide prediction has {len(rp)} repeats; expected 1 or {repeats}")
        cols.append(rp)
    return np.stack(cols, axis=1)


@register_task("classification")
class Classification(Task):
    """A slide's class (module docstring)."""

    losses = (CLASS_LOSS,)
    target_columns = ("label",)
    target_noun = "labelled"
    has_classes = True
    score_key = "probs"
    validation_metrics = VALIDATION_METRICS
    cv_metrics = ("accuracy", "precision", "recall", "f1", "auc")
    cv_headline = "auc"

    def classes(self, n_classes: int | None) -> int | None:
        if n_classes is None:
            raise ValueError("missing required key 'n_classes' in section 'data' (classification methods need it)")
        return int(n_classes)

    def lone_class(self, targets: Sequence[Any]) -> Any:
        present = {int(t) for t in targets}
        return present.pop() if len(present) == 1 else None

    def slide_fields(self, values: Sequence[Any]) -> tuple[int, tuple[float, ...] | None]:
        return int(values[0]), None

    def target_of(self, label: Any, target: tuple[float, ...] | None) -> Any:
        return label

    def pool_target(self, targets: Sequence[Any]) -> Any:
        return max(int(t) for t in targets)

    def random_targets(self, rng: np.random.Generator, n: int, n_classes: int | None = None) -> list[Any]:
        c = int(n_classes or 2)
        return [int(v) for v in rng.permutation(np.arange(n) % c)]  # every class present once n >= C

    def n_outputs(self, loss: str, options: Any, n_classes: int | None) -> int:
        if n_classes is None:
            raise ValueError("classifies: data.n_classes is needed")
        return int(n_classes)

    def bag_loss(self, endpoint: Endpoint, output: Any, target: Any) -> Any:
        import torch
        import torch.nn.functional as F

        logits = output.logits
        y = torch.as_tensor(target, dtype=torch.long, device=logits.device).reshape(1)
        loss = F.cross_entropy(logits.reshape(1, -1), y)
        aux = getattr(output, "aux_loss", None)
        return loss if aux is None else loss + aux

    def scores(self, endpoint: Endpoint, logits: np.ndarray) -> dict[str, np.ndarray]:
        """Softmax of the logits after the run's calibration (:attr:`Endpoint.logit_map`; identity when none)."""
        z = endpoint.logit_map.apply(np.asarray(logits, dtype=np.float64).reshape(-1, endpoint.n_outputs))
        e = np.exp(z - z.max(1, keepdims=True))
        return {"probs": e / e.sum(1, keepdims=True)}

    def slide_scores(self, endpoint: Endpoint | None, pred: Any) -> dict[str, np.ndarray]:
        """The class probabilities of every repeat the prediction holds (already calibrated by
        :func:`~wsi_pipeline.inference.protocols.calibrated_prediction`); its mean probabilities when it has none."""
        return {"probs": pred.repeat_probs if pred.repeat_probs is not None else np.asarray(pred.probs)[None]}

    def fit_calibration(self, endpoint: Endpoint, logits: np.ndarray, targets: Sequence[Any], method: str) -> Endpoint:
        """Platt or temperature scaling of the logits on the validation slides
        (:func:`~wsi_pipeline.tasks.calibration.fit_logit_map`; ``platt`` needs two classes)."""
        from wsi_pipeline.tasks.calibration import fit_logit_map

        return endpoint.calibrated(fit_logit_map(logits, [int(t) for t in targets], method))

    def metric_names(self, ref: Any = None) -> tuple[str, ...]:
        return METRICS

    def metrics(self, targets: Sequence[Any], scores: Mapping[str, np.ndarray], *, n_classes: int | None = None,
                ref: Any = None, only: str | None = None) -> dict[str, float]:
        if only is not None and only in METRICS:  # one metric (a bootstrap resample): as compute_metrics computes it
            return {only: metric_value(only, np.asarray(targets, dtype=np.int64), scores["probs"], int(n_classes or 2))}
        return compute_metrics(np.asarray(targets, dtype=np.int64), scores["probs"], int(n_classes or 2))

    def validation_values(self, endpoint: Endpoint, targets: Sequence[Any], preds: Sequence[Any], protocol: Any) -> dict[str, float]:
        """``qwk``, ``accuracy``, ``balanced_accuracy``, ``auc``, ``n_slides`` (:func:`compute_metrics`) and ``loss`` (the
        mean cross-entropy of the slide probabilities, natural log, clipped at 1e-7) of the (mean) slide probabilities;
        for a per-repeat protocol each is the mean over repeats of its value on that repeat's probabilities, with
        ``<metric>_repeat_std`` (ddof 1) and ``n_repeats`` (:func:`compute_repeat_metrics`)."""
        n_classes = int(endpoint.n_outputs)
        y = np.asarray([int(v) for v in targets], dtype=np.int64)
        if len(preds) != len(y):
            raise ValueError(f"validation_metrics: {len(preds)} predictions but {len(y)} labels")
        if protocol.per_repeat:
            stack = _repeat_stack([self.slide_scores(endpoint, p)["probs"] for p in preds], protocol.repeats, n_classes)
        else:
            stack = np.stack([p.probs for p in preds])[None] if len(preds) else np.zeros((1, 0, n_classes))
        if not protocol.per_repeat:
            out = compute_metrics(y, stack[0], n_classes)
        else:
            rm = compute_repeat_metrics(y, stack, n_classes)
            out = {**rm.mean, **{f"{m}_repeat_std": v for m, v in rm.std.items()}}
        if len(y):
            # per repeat (one repeat for all/ensemble), then the mean over repeats
            ce = -np.log(np.clip(stack[:, np.arange(len(y)), y], 1e-7, None))
            out["loss"] = float(ce.mean())
        else:
            out["loss"] = math.nan
        return out

    def selection_rule(self, name: str, n_classes: int | None) -> tuple[str, bool]:
        if name == "loss":
            return "loss", False
        if name == "auto":
            return headline_metric(int(n_classes or 2)), True
        if name not in METRICS:
            raise ValueError(f"selection metric {name!r} unknown; choose 'auto', 'loss' or one of {list(METRICS)}")
        return name, True

    def prediction_columns(self, n_classes: int | None, edges: Sequence[float] = ()) -> list[str]:
        return class_prediction_columns(int(n_classes or 2))

    def prediction_row(self, *, target: Any, scores: Mapping[str, np.ndarray], edges: Sequence[float] = (),
                       threshold: float | None = None) -> dict[str, Any]:
        probs = np.asarray(scores["probs"], dtype=np.float64)
        p, s = probs.mean(0), probs.std(0)
        pred = int(np.argmax(p))
        lab = None if target is None or pd.isna(target) else int(target)
        return {"label": lab, "pred": pred, **{f"prob_{c}": float(v) for c, v in enumerate(p)},
                "prob_std": float(s[pred]) if s.size else 0.0}

    def summary_cells(self, row: Mapping[str, Any]) -> dict[str, str]:
        """The predicted class, its probability and every class's probability."""
        n = sum(1 for k in row if str(k).startswith("prob_") and str(k)[5:].isdigit())
        probs = [float(row[c]) for c in prob_columns(n)]
        pred = int(row["pred"])
        return {"pred": str(pred), "p(pred)": f"{probs[pred]:.3f}", "probs": " ".join(f"{v:.3f}" for v in probs)}

    def report_metrics(self, recorded: Sequence[str]) -> list[str]:
        return [*METRICS, "n_slides"]

    def oof_value_columns(self, n_classes: int | None) -> list[str]:
        return prob_columns(int(n_classes or 2))

    def oof_columns(self, raw: pd.DataFrame, n_classes: int | None) -> dict[str, Any]:
        c = int(n_classes or 2)
        probs = raw[prob_columns(c)].to_numpy(dtype=np.float64)
        pred = probs.argmax(axis=1)  # ties to the lower class, as the predictions CSVs
        out: dict[str, Any] = {"label": raw["label"].astype("Int64"),
                               "prob": probs[:, 1] if c == 2 else probs[np.arange(len(probs)), pred]}
        if c > 2:
            out["pred"] = pred
            out.update({f"prob_{k}": probs[:, k] for k in range(c)})
        return out

    def cv_metric_values(self, rows: pd.DataFrame, n_classes: int | None) -> dict[str, float]:
        """Accuracy of the arg-max class; precision, recall and F1 of class 1 (binary) or macro-averaged
        (more classes), ``zero_division=0``; ROC AUC as the evaluation computes it."""
        from sklearn.metrics import precision_recall_fscore_support

        c = int(n_classes or 2)
        y = rows["label"].to_numpy(dtype=np.int64)
        if c == 2:
            p1 = rows["prob"].to_numpy(dtype=np.float64)
            probs = np.stack([1.0 - p1, p1], axis=1)
        else:
            probs = rows[prob_columns(c)].to_numpy(dtype=np.float64)
        base = compute_metrics(y, probs, c)
        prec, rec, f1, _ = precision_recall_fscore_support(
            y, probs.argmax(axis=1), average="binary" if c == 2 else "macro", labels=None if c == 2 else np.arange(c),
            zero_division=0)
        return {"accuracy": base["accuracy"], "precision": float(prec), "recall": float(rec), "f1": float(f1),
                "auc": base["auc"]}

    def cv_headline_fn(self, rows: pd.DataFrame, n_classes: int | None) -> Callable[[np.ndarray], float]:
        c = int(n_classes or 2)
        if c > 2:
            probs = rows[prob_columns(c)]
            return lambda idx: self.cv_metric_values(
                rows.iloc[idx].assign(**{k: probs[k].to_numpy()[idx] for k in probs}), n_classes)["auc"]
        from sklearn.metrics import roc_auc_score

        y = rows["label"].to_numpy(dtype=np.float64)
        p = rows["prob"].to_numpy(dtype=np.float64)
        return lambda idx: float(roc_auc_score(y[idx], p[idx])) if len(np.unique(y[idx])) == 2 else math.nan

    def oof_roc(self, oof: pd.DataFrame) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Two classes (no ``prob_<c>`` columns): each method's ROC curve of ``prob`` (class 1), where both classes occur."""
        if "prob_0" in oof.columns:
            return []
        from sklearn.metrics import roc_curve

        curves = []
        for method, sub in oof.groupby("method", sort=True):
            if sub["label"].nunique() == 2:
                fpr, tpr, _ = roc_curve(sub["label"].astype(int), sub["prob"])
                curves.append((str(method), fpr, tpr))
        return curves
