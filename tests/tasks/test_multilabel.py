"""The ``multilabel`` task (issue 52, item 3): its numbers against independent computations, its
config and manifest checks, and its slides.

Metrics against scikit-learn per target on the observed slides (masked entries left out); the loss
against a plain torch loop over the observed entries; errors naming the file or field, the value
found and what was expected.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, roc_auc_score

from wsi_pipeline.config.endpoint import LossOptions
from wsi_pipeline.tasks import Endpoint, get_task, task_key

TARGETS = ("tp53", "kras", "braf")


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def _task():
    return get_task(task_key("multilabel", TARGETS))


def _data(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Targets (n, 3) 0/1 with about a fifth masked (NaN), and logits."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, (n, 3)).astype(np.float64)
    y[rng.random((n, 3)) < 0.2] = np.nan
    y[0] = np.nan  # a slide with no target observed at all
    return y, rng.normal(0, 1.5, (n, 3))


def test_the_bound_task_is_named_by_its_targets_and_comes_back_from_an_endpoint() -> None:
    task = _task()
    assert task.name == "multilabel[tp53,kras,braf]" and task.target_columns == TARGETS
    assert get_task(task.name) is task
    endpoint = task.fit("bce", LossOptions(), None, [tuple(r) for r in _data()[0]])
    assert endpoint.n_outputs == 3 and endpoint.task == task.name
    assert Endpoint.from_state(endpoint.to_state()).definition is task  # a checkpoint knows its targets
    assert task.metric_names()[:2] == ("auc", "balanced_accuracy")
    assert {"auc_tp53", "balanced_accuracy_braf"} <= set(task.validation_metrics) & set(task.cv_metrics)


def test_masked_loss_equals_a_plain_torch_loop_over_the_observed_entries() -> None:
    task = _task()
    y, z = _data()
    endpoint = task.fit("bce", LossOptions(), None, [tuple(r) for r in y])
    logits = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    loss = endpoint.group_loss([_Out(row[None]) for row in logits], [tuple(r) for r in y])
    per_bag = []
    for i in range(len(y)):
        terms = [F.binary_cross_entropy_with_logits(logits[i, k], torch.tensor(y[i, k], dtype=torch.float64))
                 for k in range(3) if not math.isnan(y[i, k])]
        per_bag.append(torch.stack(terms).mean() if terms else logits[i].sum() * 0.0)
    want = torch.stack(per_bag).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    g1, = torch.autograd.grad(loss, logits)
    g2, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g1, g2)
    assert torch.all(g1[0] == 0)  # the slide without targets contributes nothing
    # by hand: -[y log p + (1 - y) log(1 - p)]
    p = 1 / (1 + np.exp(-z[1]))
    seen = ~np.isnan(y[1])
    hand = -np.mean(y[1, seen] * np.log(p[seen]) + (1 - y[1, seen]) * np.log(1 - p[seen]))
    assert float(endpoint.bag_loss(_Out(torch.tensor(z[1:2])), tuple(y[1]))) == pytest.approx(hand, rel=1e-10)


def test_metrics_per_target_and_their_mean_match_sklearn_on_the_observed_slides() -> None:
    task = _task()
    y, z = _data(60, seed=1)
    endpoint = task.fit("bce", LossOptions(), None, [tuple(r) for r in y])
    probs = endpoint.scores(z)["probs"]
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-z)), rtol=1e-12)
    m = task.metrics([tuple(r) for r in y], {"probs": probs})
    aucs, baccs = [], []
    for k, c in enumerate(TARGETS):
        seen = ~np.isnan(y[:, k])
        auc = roc_auc_score(y[seen, k].astype(int), probs[seen, k])
        bacc = balanced_accuracy_score(y[seen, k].astype(int), (probs[seen, k] >= 0.5).astype(int))
        assert m[f"auc_{c}"] == pytest.approx(auc, abs=1e-12)
        assert m[f"balanced_accuracy_{c}"] == pytest.approx(bacc, abs=1e-12)
        aucs.append(auc)
        baccs.append(bacc)
    assert m["auc"] == pytest.approx(np.mean(aucs), abs=1e-12)
    assert m["balanced_accuracy"] == pytest.approx(np.mean(baccs), abs=1e-12)
    assert m["n_slides"] == 60
    # a target with one class observed has no AUC; the mean is over the others
    y1 = y.copy()
    y1[:, 2] = np.where(np.isnan(y1[:, 2]), np.nan, 1.0)
    m1 = task.metrics([tuple(r) for r in y1], {"probs": probs})
    assert math.isnan(m1["auc_braf"]) and m1["auc"] == pytest.approx(np.mean(aucs[:2]), abs=1e-12)
    seen = ~np.isnan(y1[:, 2])
    assert m1["balanced_accuracy_braf"] == pytest.approx(np.mean(probs[seen, 2] >= 0.5), abs=1e-12)  # recall of class 1
    assert task.selection_rule("auto", None) == ("auc", True)


def test_predictions_rows_columns_and_the_cross_validation_values() -> None:
    task = _task()
    probs = np.array([[0.2, 0.9, 0.5], [0.4, 0.7, 0.5]])  # two repeats
    row = task.prediction_row(target=(1.0, math.nan, 0.0), scores={"probs": probs})
    assert row["tp53"] == 1.0 and row["kras"] is None and row["braf"] == 0.0
    assert row["prob_tp53"] == pytest.approx(0.3) and row["prob_kras"] == pytest.approx(0.8)
    assert row["prob_std"] == pytest.approx(0.1)
    assert task.prediction_columns(None) == ["slide_id", "cohort", "tp53", "kras", "braf", "prob_tp53", "prob_kras",
                                             "prob_braf", "n_tiles", "protocol", "n_repeats", "prob_std", "method", "seed",
                                             "patient_id"]
    assert task.summary_cells(row) == {"prob_tp53": "0.300", "prob_kras": "0.800", "prob_braf": "0.500"}
    y, z = _data(30, seed=2)
    raw = pd.DataFrame({**{c: y[:, k] for k, c in enumerate(TARGETS)},
                        **{f"prob_{c}": 1 / (1 + np.exp(-z[:, k])) for k, c in enumerate(TARGETS)}})
    oof = pd.DataFrame(task.oof_columns(raw, None))
    assert list(oof.columns) == [*TARGETS, "prob_tp53", "prob_kras", "prob_braf"]
    cv = task.cv_metric_values(oof, None)
    seen = ~np.isnan(y[:, 1])
    assert cv["auc_kras"] == pytest.approx(roc_auc_score(y[seen, 1].astype(int), oof["prob_kras"][seen]), abs=1e-12)
    idx = np.arange(0, 30, 2)
    assert task.cv_headline_fn(oof, None)(idx) == pytest.approx(task.cv_metric_values(oof.iloc[idx], None)["auc"])


def test_patient_targets_and_manifest_rows() -> None:
    task = _task()
    pooled = task.pool_target([(0.0, math.nan, math.nan), (1.0, 0.0, math.nan)])
    assert pooled[:2] == (1.0, 0.0) and math.isnan(pooled[2])
    got = task.manifest_target(pd.Series({"slide_id": "s", "tp53": 1, "kras": None, "braf": 0}))
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 0.0
    assert task.manifest_target(pd.Series({"slide_id": "s", "tp53": None, "kras": np.nan, "braf": None})) is None


def test_slides_with_some_targets_are_kept_masked_and_slides_with_none_left_out(tmp_path: Path) -> None:
    from wsi_pipeline.data.bags import slides_for_split

    task = _task()
    manifest = pd.DataFrame({"slide_id": ["s1", "s2", "s3"], "split": ["train"] * 3, "tp53": [1, None, None],
                             "kras": [0, 1, None], "braf": [None, 0, None]})
    train = slides_for_split(manifest, "train", tmp_path, task=task.name)
    assert [s.slide_id for s in train] == ["s1", "s2"]
    assert train[0].y[:2] == (1.0, 0.0) and math.isnan(train[0].y[2])
    with pytest.raises(ValueError, match=r"needs the manifest column\(s\) \['tp53', 'kras', 'braf'\]; missing \['braf'\]"):
        slides_for_split(manifest.drop(columns="braf"), "train", tmp_path, task=task.name)
    with pytest.raises(ValueError, match=r"no training slide has a value of target\(s\) \['braf'\]"):
        task.fit("bce", LossOptions(), None, [(1.0, 0.0, math.nan), (0.0, 1.0, math.nan)])


def test_a_target_value_other_than_0_or_1_is_refused_naming_file_column_value_and_slide() -> None:
    task = _task()
    task.check_manifest(pd.DataFrame({"slide_id": ["a", "b"], "tp53": [1, None], "kras": [0, 1], "braf": [0, 0]}), "m.csv")
    bad = pd.DataFrame({"slide_id": ["a", "b"], "tp53": [1, 2], "kras": [0, 1], "braf": [0, 0]})
    with pytest.raises(ValueError, match=r"m\.csv: column 'tp53' \(task 'multilabel'\) holds \[2\] for slide\(s\) \['b'\]; "
                                         r"expected 0 or 1"):
        task.check_manifest(bad, "m.csv")


def _raw(method: dict) -> dict:
    return {"name": "p", "data": {"manifest": "m.csv", "tiles_dir": "tiles"}, "seeds": [0],
            "methods": [{"name": "m", "strategy": "frozen", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"},
                         **method}]}


def test_the_config_binds_the_targets_and_refuses_what_does_not_fit() -> None:
    from wsi_pipeline.config.pipeline import config_from_dict, config_to_dict

    cfg = config_from_dict(_raw({"task": "multilabel", "targets": ["tp53", "kras"]}))
    assert cfg.task == "multilabel[tp53,kras]" and cfg.methods[0].loss == "bce" and cfg.label_classes is None
    assert config_from_dict(config_to_dict(cfg)).task == cfg.task  # a saved run config reads back
    cases = [
        ({"task": "multilabel"}, r"methods\.m\.targets is missing or empty; task 'multilabel' needs"),
        ({"task": "multilabel", "targets": ["tp53", "tp53"]}, r"methods\.m\.targets lists \['tp53'\] twice"),
        ({"task": "multilabel", "targets": ["tp-53"]}, r"methods\.m\.targets: \['tp-53'\] are not column names"),
        ({"task": "multilabel", "targets": ["label"]}, r"methods\.m\.targets: \['label'\] name columns"),
        ({"task": "regression", "targets": ["a"]}, r"methods\.m\.targets=\['a'\]: task 'regression' reads its target from"),
        ({"task": "multilabel", "targets": ["a"], "loss": "mse"}, r"methods\.m\.loss='mse' does not fit task 'multilabel'"),
    ]
    for method, match in cases:
        with pytest.raises(ValueError, match=match):
            config_from_dict(_raw(method))
    raw = _raw({"task": "multilabel", "targets": ["a"]})
    raw["methods"].append({**raw["methods"][0], "name": "m2", "targets": ["b"]})
    with pytest.raises(ValueError, match=r"methods have different tasks .*multilabel\[a\].*multilabel\[b\]"):
        config_from_dict(raw)


def test_train_refuses_a_bad_manifest_value_and_a_method_without_targets_naming_them(tmp_path: Path, capsys) -> None:
    """Through the command line: the manifest file, column, value and slide; the YAML file and field."""
    import yaml

    from wsi_pipeline.cli.main import main

    manifest = tmp_path / "m.csv"
    pd.DataFrame({"slide_id": ["s1", "s2", "s3"], "path": ["s1.svs", "s2.svs", "s3.svs"], "split": ["train", "val", "test"],
                  "cohort": ["c"] * 3, "tp53": [1, 3, 0], "kras": [0, 1, None]}).to_csv(manifest, index=False)
    raw = _raw({"task": "multilabel", "targets": ["tp53", "kras"]})
    raw["data"] = {"manifest": str(manifest), "tiles_dir": str(tmp_path / "tiles")}
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "m.csv: column 'tp53' (task 'multilabel') holds [3] for slide(s) ['s2']; expected 0 or 1" in err, err
    del raw["methods"][0]["targets"]
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "p.yaml" in err and "methods.m.targets is missing or empty" in err, err


def test_per_target_calibration_is_the_two_class_platt_map_of_each_logit_on_its_observed_slides() -> None:
    from wsi_pipeline.tasks.calibration import LogitMap, fit_logit_map

    task = _task()
    y, z = _data(50, seed=4)
    z = 3.0 * z + 1.0  # over-confident and shifted: something to calibrate
    targets = [tuple(r) for r in y]
    raw = task.fit("bce", LossOptions(), None, targets)
    fitted = task.fit_calibration(raw, z, targets, "platt")
    assert fitted.calibration == "platt" and fitted.calibrated_on == 50 and len(fitted.target_scales) == 3
    probs = fitted.scores(z)["probs"]
    for k in range(3):
        seen = ~np.isnan(y[:, k])
        m = fit_logit_map(np.stack([np.zeros(seen.sum()), z[seen, k]], 1), y[seen, k].astype(int), "platt")
        assert (fitted.target_scales[k], fitted.target_shifts[k]) == pytest.approx((m.scale, m.shift), rel=1e-12)
        np.testing.assert_allclose(probs[:, k], 1 / (1 + np.exp(-(m.scale * z[:, k] + m.shift))), rtol=1e-12)
    back = Endpoint.from_state(fitted.to_state())
    assert back == fitted and back.calibrated(LogitMap()).target_scales == ()  # a refit starts from the model's own
    seen = ~np.isnan(y)
    want = np.mean((probs[seen] >= 0.5) == (y[seen] == 1))
    assert task.decision_accuracy(fitted, z, targets) == pytest.approx(want)
    record = task.calibration_record(fitted)
    assert record["method"] == "platt" and record["scale_kras"] == fitted.target_scales[1]
    a, b = fitted.target_scales[0], fitted.target_shifts[0]
    p = record["threshold_on_model_probability_tp53"]  # the model's own probability the map moves to 0.5
    assert a * math.log(p / (1 - p)) + b == pytest.approx(0.0, abs=1e-9)
