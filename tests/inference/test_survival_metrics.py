"""Survival and regression metrics against independent implementations (scikit-survival, lifelines,
SciPy, NumPy formulas written here), bootstrap intervals against a resampling loop written here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wsi_pipeline.tasks import survival_metrics as sm
from wsi_pipeline.tasks.endpoint_metrics import regression_metrics, survival_reference
from wsi_pipeline.tasks import Endpoint
from wsi_pipeline.tasks.losses import breslow_baseline

import lifelines  # the test extra's references
import sksurv.metrics as sksurv_metrics
from sksurv.util import Surv


def _cohort(seed: int, n: int = 50):
    rng = np.random.default_rng(seed)
    risk = np.round(rng.normal(size=n), 1)  # rounded: tied risks
    time = np.round(rng.exponential(10 * np.exp(-0.7 * risk)), 0) + 1  # rounded: tied times
    event = rng.random(n) < 0.7
    return time, event, risk


def _train(seed: int, t_max: float):
    rng = np.random.default_rng(seed + 100)
    time = np.round(rng.exponential(10, 80), 0) + 1
    event = rng.random(80) < 0.6
    time[0], event[0] = t_max + 5, False  # the training follow-up covers the test cohort's
    return time, event


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concordance_auc_brier_match_scikit_survival(seed):
    t, e, r = _cohort(seed)
    tt, te = _train(seed, t.max())
    y_train, y_test = Surv.from_arrays(te, tt), Surv.from_arrays(e, t)
    g = sm.CensoringWeights.fit(tt, te)
    assert sm.harrell_c(t, e, r) == pytest.approx(sksurv_metrics.concordance_index_censored(e, t, r)[0], abs=1e-12)
    assert sm.uno_c(t, e, r, g) == pytest.approx(sksurv_metrics.concordance_index_ipcw(y_train, y_test, r, tau=tt.max())[0], abs=1e-12)
    tau = np.percentile(t, 60)
    assert sm.uno_c(t, e, r, g, tau) == pytest.approx(sksurv_metrics.concordance_index_ipcw(y_train, y_test, r, tau=tau)[0], abs=1e-12)
    horizons = np.percentile(t[e], [25, 50, 75])
    want = sksurv_metrics.cumulative_dynamic_auc(y_train, y_test, r, horizons)[0]
    assert [sm.time_auc(t, e, r, h, g) for h in horizons] == pytest.approx(list(want), abs=1e-12)
    times = np.linspace(np.percentile(t, 10), np.percentile(t, 80), 15)
    surv = np.exp(-np.outer(np.exp(r), times) / 15)
    assert sm.integrated_brier_score(t, e, surv, times, g) == pytest.approx(
        sksurv_metrics.integrated_brier_score(y_train, y_test, surv, times), abs=1e-12)


def test_harrell_matches_lifelines_and_is_undefined_without_pairs():
    t, e, r = _cohort(3)
    from lifelines.utils import concordance_index

    assert sm.harrell_c(t, e, r) == pytest.approx(concordance_index(t, -r, e), abs=1e-12)
    assert math.isnan(sm.harrell_c(np.array([1.0, 2.0]), np.array([False, False]), np.array([0.1, 0.2])))


def test_kaplan_meier_and_logrank_match_lifelines():
    from lifelines.statistics import logrank_test

    t, e, r = _cohort(4, 80)
    times, s = sm.kaplan_meier(t, e)
    km = lifelines.KaplanMeierFitter().fit(t, e)
    assert s == pytest.approx(km.survival_function_at_times(times).to_numpy(), abs=1e-12)
    from sksurv.nonparametric import kaplan_meier_estimator

    ct, cs = kaplan_meier_estimator(e, t, reverse=True)
    assert sm.kaplan_meier(t, e, reverse=True)[1] == pytest.approx(cs, abs=1e-12)
    high = r > np.median(r)
    stat, p = sm.logrank_test(t, e, high)
    ref = logrank_test(t[high], t[~high], e[high], e[~high])
    assert stat == pytest.approx(ref.test_statistic, rel=1e-10) and p == pytest.approx(ref.p_value, rel=1e-10)
    assert math.isnan(sm.logrank_test(t, e, np.ones(len(t), bool))[1])


def test_breslow_baseline_matches_scikit_survival():
    from sksurv.linear_model.coxph import BreslowEstimator

    t, e, r = _cohort(5)
    times, h0 = breslow_baseline(t, e, r)
    ref = BreslowEstimator().fit(r, e, t)
    assert h0 == pytest.approx(ref.cum_baseline_hazard_(times), rel=1e-10)


def test_regression_metrics_match_formulas():
    from scipy.stats import rankdata

    rng = np.random.default_rng(6)
    y = rng.normal(5, 2, 40)
    p = y + rng.normal(0, 1, 40)
    got = regression_metrics(y, p)
    assert got["mae"] == pytest.approx(np.mean(np.abs(y - p)), rel=1e-12)
    assert got["rmse"] == pytest.approx(math.sqrt(np.mean((y - p) ** 2)), rel=1e-12)
    pearson = np.sum((y - y.mean()) * (p - p.mean())) / math.sqrt(np.sum((y - y.mean()) ** 2) * np.sum((p - p.mean()) ** 2))
    assert got["pearson"] == pytest.approx(pearson, rel=1e-10)
    ry, rp = rankdata(y), rankdata(p)
    assert got["spearman"] == pytest.approx(np.corrcoef(ry, rp)[0, 1], rel=1e-10)
    assert math.isnan(regression_metrics(y, np.ones(40))["pearson"])


def test_survival_bootstrap_and_repeats_follow_the_resampling_loop():
    """A seed-mean bootstrap interval of the C-index equals the percentile interval of a loop written here
    (same draws: ``default_rng(seed).integers(0, n, n)`` per resample, two seeds scored on the same slides)."""
    from wsi_pipeline.evaluation.endpoint_records import level_bootstrap, level_records
    from wsi_pipeline.config.evaluation import EvalProtocol

    t, e, r = _cohort(7, 30)
    r2 = r + np.random.default_rng(8).normal(0, 0.5, len(r))
    ref = survival_reference(*_train(7, t.max()), risk=np.zeros(10))
    targets = [(float(a), float(b)) for a, b in zip(t, e)]
    by_seed = {0: (targets, [{"risk": r}], ref), 1: (targets, [{"risk": r2}], ref)}
    got = level_bootstrap("m", "c", "test", "all", "survival", by_seed, n_boot=300, seed=11)
    low = next(x.value for x in got if x.metric == "c_index_ci_low")
    high = next(x.value for x in got if x.metric == "c_index_ci_high")
    rng = np.random.default_rng(11)
    values = []
    for _ in range(300):
        idx = rng.integers(0, len(t), len(t))
        c = [sksurv_metrics.concordance_index_censored(e[idx], t[idx], x[idx])[0] if e[idx].any() else math.nan for x in (r, r2)]
        if not any(math.isnan(v) for v in c):
            values.append(np.mean(c))
    assert (low, high) == pytest.approx(tuple(np.quantile(values, [0.025, 0.975])), abs=1e-12)
    # per-repeat protocol: the mean and sd over repeats of each repeat's C-index
    reps = [{"risk": r + k * 0.3 * np.sin(np.arange(len(r)))} for k in range(4)]
    recs, _ = level_records("m", 0, "c", "test", EvalProtocol(8, 4), "survival", targets, reps, ref=ref)
    per = [sksurv_metrics.concordance_index_censored(e, t, x["risk"])[0] for x in reps]
    value = {x.metric: x.value for x in recs if x.repeat is None}
    assert value["c_index"] == pytest.approx(np.mean(per), abs=1e-12)
    assert value["c_index_repeat_std"] == pytest.approx(np.std(per, ddof=1), abs=1e-12)
    assert [x.value for x in recs if x.metric == "c_index" and x.repeat is not None] == pytest.approx(per, abs=1e-12)


def test_discrete_time_scores_and_survival_curve():
    ep = Endpoint(task="survival", loss="nll_discrete", n_outputs=3, edges=(10.0, 20.0))
    z = np.array([[0.0, -1.0, 2.0]])
    s = ep.scores(z)
    h = 1 / (1 + np.exp(-z[0]))
    assert s["survival"][0] == pytest.approx(np.cumprod(1 - h), rel=1e-12)
    assert s["risk"][0] == pytest.approx(-np.cumprod(1 - h).sum(), rel=1e-12)
