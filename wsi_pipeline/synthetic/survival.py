"""Survival times for a synthetic cohort: hazard rising with lesion burden, censoring at a stated rate.

Each slide's linear predictor is ``eta = beta * lesion_fraction / reference`` (``reference``: the
mean lesion fraction of the slides that have lesions, so eta is about ``beta`` for a typical
lesion-bearing slide and 0 without lesions). Event times are Weibull with shape ``k``, proportional
hazards in eta: ``T = scale * (E * exp(-eta))^(1/k)``, ``E ~ Exp(1)``; a large shape keeps times
close to their expectation, so the ranking a model can reach is high. Censoring times are
independent exponentials whose rate is solved (bisection) so that a fraction ``censoring`` of the
cohort is censored; a slide's observed time is ``min(T, C)`` and ``event = T <= C``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["survival_targets"]


def survival_targets(lesion_fraction: np.ndarray, *, seed: int, beta: float = 2.0, shape: float = 3.0,
                     scale: float = 100.0, censoring: float = 0.25,
                     reference: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(time, event, eta)`` per slide (module docstring); times rounded to 0.1, deterministic in ``seed``.

    ``reference``: the lesion fraction that maps to ``eta = beta`` (default: the mean over slides with
    lesions; pass the internal cohort's for an external one, so both share one hazard model).
    """
    frac = np.asarray(lesion_fraction, dtype=np.float64)
    if not 0.0 <= censoring < 1.0:
        raise ValueError(f"censoring={censoring}; expected a fraction in [0, 1)")
    ref = reference if reference is not None else (float(frac[frac > 0].mean()) if (frac > 0).any() else 1.0)
    eta = beta * frac / ref
    rng = np.random.default_rng([int(seed), 0x5A1])
    t = scale * (rng.exponential(1.0, len(frac)) * np.exp(-eta)) ** (1.0 / shape)
    u = rng.exponential(1.0, len(frac))  # censoring time = u / rate
    lo, hi = 1e-9, 1e3
    for _ in range(200):  # the rate whose censored share is `censoring`
        mid = np.sqrt(lo * hi)
        share = float(np.mean(u / mid < t))
        lo, hi = (lo, mid) if share > censoring else (mid, hi)
    c = u / hi if censoring > 0 else np.full(len(frac), np.inf)
    time = np.round(np.minimum(t, c), 1)
    return np.maximum(time, 0.1), (t <= c).astype(np.int64), eta
