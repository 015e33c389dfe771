"""Probability calibration of a classifier's logits, fitted on a validation split.

Small cohorts give models whose probabilities sit on a different scale in every fold (a short
run's probabilities near 0.5, a long run's near 0 and 1), so a fixed decision threshold of 0.5
and out-of-fold predictions pooled over folds both mislead. A run therefore fits, on its own
validation slides, an affine map of its logits (:func:`fit_logit_map`) that the task applies to
every score it reports afterwards (``eval``, ``predict``, ``oof_predictions.csv``):

- ``platt`` (binary): the calibrated log-odds are ``a * s + b`` with ``s = z_1 - z_0`` the model's
  log-odds (Platt 1999). The decision "class 1 when the calibrated probability >= 0.5" is then the
  threshold ``s >= -b / a`` on the model's own log-odds, chosen on the validation split.
- ``temperature`` (any number of classes): every logit divided by a temperature ``T = 1 / a``
  (Guo et al. 2017); the arg-max class does not change.

Both fit by maximum likelihood against Platt's smoothed targets ``(N+ + 1) / (N+ + 2)`` for the
positives and ``1 / (N- + 2)`` for the negatives (per class for ``temperature``): on a validation
split the classes separate perfectly more often than not, and the plain likelihood then has no
maximum (``a`` grows without bound). A fitted slope ``a <= 0`` (a model that ranks the validation
slides backwards) is not used: the map stays the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LogitMap", "fit_logit_map", "smoothed_targets"]


@dataclass(frozen=True)
class LogitMap:
    """``z -> scale * z`` then ``+ shift`` on the class-1 logit (binary ``platt``); the identity by default.

    Attributes
    ----------
    scale : a (> 0); 1 / temperature.
    shift : b, added to the log-odds of class 1 (0 for ``temperature``).
    method : ``none``, ``platt`` or ``temperature``.
    n_slides : validation slides it was fitted on (0: not fitted).
    """

    scale: float = 1.0
    shift: float = 0.0
    method: str = "none"
    n_slides: int = 0

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The calibrated logits of ``logits`` (R, C), float64."""
        z = np.asarray(logits, dtype=np.float64) * self.scale
        if self.shift and z.shape[-1] == 2:
            z = z.copy()
            z[..., 1] += self.shift
        return z

    def raw_threshold(self) -> float:
        """The binary decision threshold on the model's own probability of class 1 that the map moves to 0.5."""
        return float(1.0 / (1.0 + np.exp(self.shift / self.scale)))


def smoothed_targets(labels: np.ndarray) -> np.ndarray:
    """Platt's targets for binary ``labels`` (0/1): ``(N+ + 1) / (N+ + 2)`` for 1, ``1 / (N- + 2)`` for 0."""
    y = np.asarray(labels, dtype=np.int64)
    pos, neg = int((y == 1).sum()), int((y == 0).sum())
    return np.where(y == 1, (pos + 1.0) / (pos + 2.0), 1.0 / (neg + 2.0))


def fit_logit_map(logits: np.ndarray, labels: Sequence[int], method: str) -> LogitMap:
    """Fit ``method`` on validation ``logits`` (N, C) and their class ``labels`` (N,).

    Returns the identity (``n_slides`` still recorded) when ``method`` is ``none``, when the labels
    hold fewer than two classes, or when the fitted slope is not positive (see the module docstring).
    """
    from scipy.optimize import minimize
    from scipy.special import log_softmax

    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    n = len(y)
    if z.ndim != 2 or z.shape[0] != n:
        raise ValueError(f"fit_logit_map: logits of shape {z.shape} for {n} labels; expected (N, C)")
    if method == "none" or n == 0 or len(np.unique(y)) < 2:
        return LogitMap(n_slides=n)
    if method == "platt":
        if z.shape[1] != 2:
            raise ValueError(f"platt calibration is binary; the model has {z.shape[1]} outputs (use temperature)")
        s, t = z[:, 1] - z[:, 0], smoothed_targets(y)

        def nll(p: np.ndarray) -> float:
            u = p[0] * s + p[1]
            return float(np.sum(np.logaddexp(0.0, u) - t * u))  # -t log sig(u) - (1 - t) log(1 - sig(u))

        fit = minimize(nll, np.array([1.0, 0.0]), method="BFGS")
        a, b = (float(v) for v in fit.x)
    elif method == "temperature":
        c = z.shape[1]
        onehot = np.zeros_like(z)
        onehot[np.arange(n), y] = 1.0
        counts = onehot.sum(0)
        soft = np.where(onehot > 0, (counts + 1.0) / (counts + 2.0), 1.0 / (n - counts + 2.0))
        soft = soft / soft.sum(1, keepdims=True) if c > 2 else soft

        def nll_t(p: np.ndarray) -> float:
            return float(-(soft * log_softmax(p[0] * z, axis=1)).sum())

        fit = minimize(nll_t, np.array([1.0]), method="BFGS")
        a, b = float(fit.x[0]), 0.0
    else:
        raise ValueError(f"calibration {method!r} unknown; choose none, platt or temperature (train.calibrate)")
    if not (np.isfinite(a) and np.isfinite(b)) or a <= 0:
        return LogitMap(n_slides=n)
    return LogitMap(scale=a, shift=b, method=method, n_slides=n)
