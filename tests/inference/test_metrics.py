import math

import numpy as np
import pytest
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    roc_auc_score,
)

from wsi_pipeline.config.pipeline import SELECT_METRICS
from wsi_pipeline.tasks.metrics import (
    METRICS,
    VALIDATION_METRICS,
    bootstrap_interval,
    compute_metrics,
    compute_repeat_metrics,
    confusion,
    mean_std,
    metric_order,
    selection_metric,
    selection_rule,
)


def _probs(rng, labels, n_classes, signal=1.5):
    logits = rng.normal(size=(len(labels), n_classes))
    logits[np.arange(len(labels)), labels] += signal
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_binary_metrics_equal_sklearn():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 40)
    p = _probs(rng, y, 2)
    m = compute_metrics(y, p, 2)
    pred = p.argmax(1)
    assert m["qwk"] == pytest.approx(cohen_kappa_score(y, pred, weights="quadratic"))
    assert m["accuracy"] == pytest.approx(accuracy_score(y, pred))
    assert m["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, pred))
    assert m["auc"] == pytest.approx(roc_auc_score(y, p[:, 1]))
    assert m["n_slides"] == 40
    np.testing.assert_array_equal(confusion(y, p, 2), confusion_matrix(y, pred, labels=[0, 1]))


def test_multiclass_metrics_equal_sklearn():
    rng = np.random.default_rng(2)
    y = np.r_[np.arange(6), rng.integers(0, 6, 54)]  # every ISUP grade present
    p = _probs(rng, y, 6, signal=1.0)
    m = compute_metrics(y, p, 6)
    pred = p.argmax(1)
    assert m["qwk"] == pytest.approx(cohen_kappa_score(y, pred, weights="quadratic"))
    assert m["accuracy"] == pytest.approx(accuracy_score(y, pred))
    assert m["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, pred))
    assert m["auc"] == pytest.approx(roc_auc_score(y, p, multi_class="ovr", average="macro"))
    np.testing.assert_array_equal(confusion(y, p, 6), confusion_matrix(y, pred, labels=np.arange(6)))


def test_absent_classes_and_undefined_values():
    rng = np.random.default_rng(3)
    y = np.array([0, 2, 2, 0, 2, 0, 0, 2])  # class 1 absent from this cohort
    p = _probs(rng, y, 3)
    ref = np.mean([roc_auc_score(y == c, p[:, c]) for c in (0, 2)])
    assert compute_metrics(y, p, 3)["auc"] == pytest.approx(ref)
    one = compute_metrics([1, 1, 1], np.array([[0.2, 0.8], [0.3, 0.7], [0.1, 0.9]]), 2)
    assert math.isnan(one["auc"]) and one["accuracy"] == 1.0


def test_bad_inputs_raise_with_names():
    with pytest.raises(ValueError, match=r"probs must have shape \(N, n_classes=3\)"):
        compute_metrics([0, 1], np.zeros((2, 2)), 3)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        compute_metrics([0, 5], np.full((2, 2), 0.5), 2)
    with pytest.raises(ValueError, match="selection metric 'f1' unknown"):
        selection_metric(2, "f1")


def test_selection_metric_follows_the_papers():
    assert selection_metric(6) == "qwk"
    assert selection_metric(2) == "auc"
    assert selection_metric(2, "accuracy") == "accuracy"


def test_one_selection_rule_for_every_config_choice():
    """Every ``train.select_metric`` choice goes through the one rule: loss is lower-is-better,
    the computed metrics higher-is-better, auto the task's headline (QWK graded, AUC binary)."""
    from wsi_pipeline.tasks import ENDPOINT_VALIDATION_METRICS

    endpoint = {m for names in ENDPOINT_VALIDATION_METRICS.values() for m in names} - {"loss"}
    assert set(SELECT_METRICS) == {"auto", "loss", *METRICS, *endpoint}
    for n_classes in (2, 3, 6):
        for name in set(SELECT_METRICS) - endpoint:
            metric, higher = selection_rule(n_classes, name)
            assert (metric, higher) == (("loss", False) if name == "loss" else
                                        ("qwk" if n_classes > 2 else "auc", True) if name == "auto" else (name, True))
    # every metric the rule may pick is recorded per epoch by training
    assert set(VALIDATION_METRICS) == {"loss", *METRICS}
    # survival and regression: auto is the C-index / RMSE; errors are lower-is-better; other tasks' names refused
    assert selection_rule(None, "auto", "survival") == ("c_index", True)
    assert selection_rule(None, "auto", "regression") == ("rmse", False)
    assert selection_rule(None, "mae", "regression") == ("mae", False)
    assert selection_rule(None, "spearman", "regression") == ("spearman", True)
    with pytest.raises(ValueError, match="does not fit task 'survival'"):
        selection_rule(None, "auc", "survival")


def test_metric_order_puts_the_headline_first_and_keeps_every_metric():
    rng = np.random.default_rng(0)
    for n_classes, head in ((2, "auc"), (5, "qwk")):
        order = metric_order(n_classes)
        assert order[0] == head and sorted(order) == sorted(METRICS)
        y = rng.integers(0, n_classes, 30)
        assert set(compute_metrics(y, _probs(rng, y, n_classes), n_classes)) == {*METRICS, "n_slides"}


def test_bootstrap_interval():
    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 60)
    p = _probs(rng, y, 2)
    point = roc_auc_score(y, p[:, 1])
    lo, hi = bootstrap_interval(y, p, 2, "auc", n_boot=200, seed=0)
    assert lo < point < hi and 0 <= lo and hi <= 1
    assert (lo, hi) == bootstrap_interval(y, p, 2, "auc", n_boot=200, seed=0)
    # a perfect classifier has a degenerate interval at 1
    perfect = np.eye(2)[y]
    assert bootstrap_interval(y, perfect, 2, "accuracy", n_boot=50) == (1.0, 1.0)
    # seed-mean interval: identical seeds give the single-seed interval
    assert bootstrap_interval(y, [p, p], 2, "qwk", n_boot=100, seed=1) == pytest.approx(
        bootstrap_interval(y, p, 2, "qwk", n_boot=100, seed=1)
    )


def test_mean_std_over_seeds():
    v = [0.7, 0.8, 0.95]
    assert mean_std(v) == pytest.approx((np.mean(v), np.std(v, ddof=1)))
    m, s = mean_std([0.5, float("nan")])
    assert m == 0.5 and math.isnan(s)


def _sklearn_binary(y, p):
    """Reference metrics of one (N, 2) probability matrix, straight from scikit-learn."""
    pred = p.argmax(1)
    return {
        "auc": roc_auc_score(y, p[:, 1]),
        "accuracy": accuracy_score(y, pred),
        "balanced_accuracy": balanced_accuracy_score(y, pred),
        "qwk": cohen_kappa_score(y, pred, weights="quadratic"),
    }


def test_repeat_metrics_are_sklearn_per_repeat_then_mean():
    rng = np.random.default_rng(7)
    y = rng.integers(0, 2, 30)
    P = np.stack([_probs(rng, y, 2, signal=0.8) for _ in range(6)])  # (R=6, N, C)
    rm = compute_repeat_metrics(y, P, 2)
    assert len(rm.per_repeat) == 6
    refs = [_sklearn_binary(y, P[r]) for r in range(6)]
    for m in ("auc", "accuracy", "balanced_accuracy", "qwk"):
        per = [ref[m] for ref in refs]
        assert [d[m] for d in rm.per_repeat] == pytest.approx(per, rel=1e-12)
        assert rm.mean[m] == pytest.approx(np.mean(per), rel=1e-12)
        assert rm.std[m] == pytest.approx(np.std(per, ddof=1), rel=1e-12)
    assert rm.mean["n_repeats"] == 6 and rm.mean["n_slides"] == 30
    one = compute_repeat_metrics(y, P[:1], 2)
    assert one.mean["auc"] == pytest.approx(refs[0]["auc"]) and math.isnan(one.std["auc"])
    with pytest.raises(ValueError, match=r"shape \(R >= 1, N, n_classes=2\)"):
        compute_repeat_metrics(y, P[0], 2)


def test_per_repeat_score_and_ensemble_differ():
    # two repeats that each rank one negative above one positive, in opposite slides: averaging
    # the probabilities over repeats cancels the errors, scoring each repeat does not
    y = np.array([0, 0, 1, 1])
    p1 = np.array([[0.2, 0.6, 0.7, 0.5], [0.6, 0.2, 0.5, 0.7]])  # P(class 1), (R, N)
    P = np.stack([1 - p1, p1], axis=-1)
    per_repeat = compute_repeat_metrics(y, P, 2).mean["auc"]
    ensemble = compute_metrics(y, P.mean(0), 2)["auc"]
    assert per_repeat == pytest.approx(np.mean([roc_auc_score(y, p1[0]), roc_auc_score(y, p1[1])]))
    assert ensemble == pytest.approx(roc_auc_score(y, p1.mean(0)))
    assert ensemble - per_repeat > 0.2


def test_bootstrap_interval_of_a_per_repeat_score():
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 40)
    P = np.stack([_probs(rng, y, 2, signal=1.0) for _ in range(4)])
    # R identical repeats: the interval of one pass
    same = np.repeat(P[:1], 3, axis=0)
    assert bootstrap_interval(y, [same], 2, "auc", n_boot=60, seed=2) == pytest.approx(
        bootstrap_interval(y, P[0], 2, "auc", n_boot=60, seed=2))
    # max_repeats=1 resamples the first repeat only, then moves to the 4-repeat score
    first = np.asarray(bootstrap_interval(y, P[0], 2, "accuracy", n_boot=60, seed=2))
    shift = np.mean([accuracy_score(y, P[k].argmax(1)) for k in range(4)]) - accuracy_score(y, P[0].argmax(1))
    assert bootstrap_interval(y, [P], 2, "accuracy", n_boot=60, seed=2, max_repeats=1) == pytest.approx(
        tuple(np.clip(first + shift, 0, 1)))
    # otherwise each resample is the mean over repeats of the per-repeat values: reference loop
    def reference(max_rep):
        r = np.random.default_rng(3)
        vals = []
        for _ in range(80):
            idx = r.integers(0, len(y), len(y))
            a = np.mean([roc_auc_score(y[idx], P[k][idx, 1]) for k in range(max_rep)])
            b = np.mean([roc_auc_score(y[idx], P[::-1][k][idx, 1]) for k in range(max_rep)])
            vals.append((a + b) / 2)
        return np.quantile(vals, [0.025, 0.975])

    point = compute_repeat_metrics(y, P, 2).mean["auc"]  # P[::-1] has the same repeat mean
    lo, hi = bootstrap_interval(y, [P, P[::-1]], 2, "auc", n_boot=80, seed=3, max_repeats=4)
    assert (lo, hi) == pytest.approx(tuple(reference(4)))
    assert lo < point < hi
    # fewer repeats per resample than reported: the interval of the 2-repeat mean, moved by the
    # difference between the 4-repeat and the 2-repeat scores on the whole cohort
    lo2, hi2 = bootstrap_interval(y, [P, P[::-1]], 2, "auc", n_boot=80, seed=3, max_repeats=2)
    two = np.mean([roc_auc_score(y, P[k][:, 1]) for k in (0, 1)] + [roc_auc_score(y, P[::-1][k][:, 1]) for k in (0, 1)])
    assert (lo2, hi2) == pytest.approx(tuple(np.clip(reference(2) + point - two, 0, 1)))
    assert lo2 < point < hi2
