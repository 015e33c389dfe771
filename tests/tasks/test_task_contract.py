"""Every registered task, and the worked example of ``docs/extending.md`` (an ordinal grade), against the Task contract.

The contract (each task x each of its losses): the fitted endpoint's output size; the loss of random
outputs is a finite scalar whose gradient equals autograd's numerical one (``gradcheck``, float64) and,
for a loss that does not couple bags, the mean of the bags' losses; scores with the task's score per
slide; metrics naming every :meth:`Task.metric_names`; the selection rule; a predictions CSV written
and read back with exactly the task's columns; the cross-validation table from those predictions; the
manifest row -> training target round trip. Then each built-in task's numbers against an independent
computation (scikit-learn, SciPy, a hand-written loop).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, cohen_kappa_score, mean_absolute_error, mean_squared_error, roc_auc_score

from wsi_pipeline.config.endpoint import LossOptions
from wsi_pipeline.data.bags import Slide
from wsi_pipeline.export.predictions import endpoint_row, read_predictions, write_predictions
from wsi_pipeline.models.registry import Registry
from wsi_pipeline.tasks import Endpoint, Task, base, get_task, task_key, task_names
from wsi_pipeline.tasks.endpoint_metrics import survival_reference

#: The worked example of docs/extending.md ("Adding a task"), run here as it is printed there.
EXAMPLE = '''
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import cohen_kappa_score, mean_absolute_error

from wsi_pipeline.config.endpoint import LossOptions
from wsi_pipeline.tasks import Task, get_task, register_task


@register_task("ordinal")
class Ordinal(Task):
    """A grade 0..3 (manifest column ``grade``): three cumulative logits, P(grade > k) for k = 0, 1, 2."""

    grades = 4
    losses = ("cumulative_bce",)
    target_columns = ("grade",)
    target_noun = "grade"
    score_key = "expected_grade"
    validation_metrics = ("loss", "mae", "qwk")
    default_selection = "qwk"
    cv_metrics = ("mae", "qwk")
    cv_headline = "qwk"

    def n_outputs(self, loss, options, n_classes):
        return self.grades - 1

    def bag_loss(self, endpoint, output, target):
        z = output.logits.reshape(-1)
        above = (float(target) > torch.arange(self.grades - 1, device=z.device)).to(z.dtype)  # 1[grade > k]
        return F.binary_cross_entropy_with_logits(z, above)

    def scores(self, endpoint, logits):
        z = np.asarray(logits, dtype=np.float64).reshape(-1, self.grades - 1)
        return {"expected_grade": (1.0 / (1.0 + np.exp(-z))).sum(1)}  # E[grade] = sum_k P(grade > k)

    def metric_names(self, ref=None):
        return ("mae", "qwk")

    def metrics(self, targets, scores, *, n_classes=None, ref=None, only=None):
        y = np.asarray(targets, dtype=np.int64)
        pred = np.asarray(scores["expected_grade"], dtype=np.float64)
        qwk = cohen_kappa_score(y, np.rint(pred).astype(np.int64), weights="quadratic") if len(set(y)) > 1 else np.nan
        return {"mae": float(mean_absolute_error(y, pred)), "qwk": float(qwk), "n_slides": float(len(y))}

    def random_targets(self, rng, n, n_classes=None):
        return [int(v) for v in rng.permutation(np.arange(n) % self.grades)]


# what training, evaluation and the reports call
task = get_task("ordinal")
endpoint = task.fit("cumulative_bce", LossOptions(), None, task.random_targets(np.random.default_rng(0), 8))
logits = torch.randn(8, endpoint.n_outputs, requires_grad=True)
targets = task.random_targets(np.random.default_rng(1), 8)
loss = endpoint.group_loss([type("Out", (), {"logits": z[None]})() for z in logits], targets)
loss.backward()
scores = endpoint.scores(logits.detach().numpy())
print(f"loss {loss.item():.3f}", task.metrics(targets, scores), task.prediction_columns(None))
'''

N = 12  # slides per check
N_CLASSES = 3  # a task with classes is checked with three (macro AUC, kappa)


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


@pytest.fixture
def example_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry with the example registered, for this test only (a copy of the built-in tasks)."""
    fresh: Registry = Registry("task")
    for name in task_names():
        fresh.register(name)(base.TASKS.get(name))
    monkeypatch.setattr(base, "TASKS", fresh)
    monkeypatch.setattr(base, "_INSTANCES", {})
    exec(compile(EXAMPLE, "docs/extending.md", "exec"), {"__name__": "extending_example"})
    yield


@pytest.fixture(params=[*task_names(), "ordinal"])
def task(request: pytest.FixtureRequest) -> Task:
    if request.param == "ordinal":
        request.getfixturevalue("example_registered")
    if get_task(request.param).takes_targets:  # a method names its columns: the task bound to two of them
        return get_task(task_key(request.param, ("a", "b")))
    return get_task(request.param)


def _n_classes(task: Task) -> int | None:
    return N_CLASSES if task.has_classes else None


def _reference(task: Task, endpoint: Endpoint, targets: list[Any], scores: dict[str, np.ndarray]) -> Any:
    """What the task's metrics take from a training split (here the same slides), as evaluation builds it."""
    return task.training_reference(endpoint, targets, list(np.ravel(scores[task.score_key]))) if task.uses_training_reference else None


def _as_tuple(target: Any) -> tuple[Any, ...]:
    return target if isinstance(target, tuple) else (target,)


@pytest.mark.parametrize("loss_index", [0, 1])
def test_loss_outputs_and_scores(task: Task, loss_index: int) -> None:
    if loss_index >= len(task.losses):
        pytest.skip(f"{task.name} has {len(task.losses)} loss(es)")
    loss = task.losses[loss_index]
    rng = np.random.default_rng(loss_index)
    targets = task.random_targets(rng, N, _n_classes(task))
    options = LossOptions(bins=3)
    endpoint = task.fit(loss, options, _n_classes(task), targets)
    assert endpoint.task == task.name and endpoint.loss == loss
    assert endpoint.n_outputs == task.n_outputs(loss, options, _n_classes(task)) >= 1
    assert endpoint.definition is task

    logits = torch.tensor(rng.normal(0, 1, (N, endpoint.n_outputs)), dtype=torch.float64, requires_grad=True)
    group = lambda z: endpoint.group_loss([_Out(row[None]) for row in z], targets)  # noqa: E731
    value = group(logits)
    assert value.ndim == 0 and math.isfinite(value.item())
    assert torch.autograd.gradcheck(group, (logits,), eps=1e-6, atol=1e-5)
    if not endpoint.coupled:
        mean = torch.stack([endpoint.bag_loss(_Out(row[None]), t) for row, t in zip(logits, targets)]).mean()
        assert value.item() == pytest.approx(mean.item(), rel=1e-12)

    scores = endpoint.scores(logits.detach().numpy())
    assert task.score_key in scores and all(len(v) == N for v in scores.values())
    assert np.isfinite(scores[task.score_key]).all()


def test_metrics_selection_and_validation(task: Task) -> None:
    rng = np.random.default_rng(3)
    targets = task.random_targets(rng, N, _n_classes(task))
    endpoint = task.fit(task.losses[0], LossOptions(bins=3), _n_classes(task), targets)
    scores = endpoint.scores(rng.normal(0, 1, (N, endpoint.n_outputs)))
    ref = _reference(task, endpoint, targets, scores)
    values = task.metrics(targets, scores, n_classes=_n_classes(task), ref=ref)
    names = task.metric_names(ref)
    assert names and set(names) <= set(values)
    assert all(math.isfinite(values[m]) for m in names if not m.startswith("logrank"))
    for m in names:
        lo, hi = task.metric_bounds(m)
        assert lo <= values[m] <= hi or math.isnan(values[m])

    assert task.selection_rule("loss", _n_classes(task)) == ("loss", False)
    metric, _ = task.selection_rule("auto", _n_classes(task))
    assert metric in task.validation_metrics or metric in names
    with pytest.raises(ValueError, match="selection metric 'no_such_metric'"):
        task.selection_rule("no_such_metric", _n_classes(task))
    assert set(task.validation(endpoint, targets, scores)) <= set(task.validation_metrics) - {"loss"}
    assert set(task.report_metrics(list(values))) >= {"n_slides"}


def test_predictions_csv_and_crossval_table(task: Task, tmp_path: Path) -> None:
    """Rows from per-repeat scores -> the CSV has exactly the task's columns -> the OOF table's metrics."""
    rng = np.random.default_rng(5)
    targets = task.random_targets(rng, N, _n_classes(task))
    endpoint = task.fit(task.losses[-1], LossOptions(bins=3), _n_classes(task), targets)
    repeats = 3
    rows, per_slide = [], []
    for i, target in enumerate(targets):
        scores = endpoint.scores(rng.normal(0, 1, (repeats, endpoint.n_outputs)))  # one row per repeat
        per_slide.append(scores)
        rows.append(endpoint_row(task=task.name, slide_id=f"s{i}", cohort="c", target=target, scores=scores, n_tiles=10,
                                 protocol="sub4x3", n_repeats=repeats, method="m", seed=0, threshold=0.0, edges=endpoint.edges))
    columns = task.prediction_columns(_n_classes(task), endpoint.edges)
    path = write_predictions(tmp_path / "p.csv", rows, _n_classes(task), columns=columns)
    df = read_predictions(path)
    assert list(df.columns) == columns
    assert {"slide_id", "cohort", "n_tiles", "protocol", "n_repeats", "method", "seed", "patient_id"} <= set(columns)
    for c in task.target_columns:
        assert c in columns
    key = task.oof_value_columns(_n_classes(task))[0]
    first = np.asarray(per_slide[0][task.score_key], dtype=np.float64).mean(0)
    assert df[key].iloc[0] == pytest.approx(float(np.ravel(first)[0]), rel=1e-5)  # the mean over repeats

    oof = pd.DataFrame(task.oof_columns(df, _n_classes(task)))
    # the contract's label and prob; a task with several targets has each target's prob_<col> instead
    assert ({f"prob_{c}" for c in task.target_columns} if task.takes_targets else {"label", "prob"}) <= set(oof.columns)
    cv = task.cv_metric_values(oof, _n_classes(task))
    assert list(cv) == list(task.cv_metrics) and task.cv_headline in cv
    headline = task.cv_headline_fn(oof, _n_classes(task))(np.arange(len(oof)))
    assert headline == pytest.approx(cv[task.cv_headline], rel=1e-9, nan_ok=True)


def test_manifest_row_to_training_target(task: Task) -> None:
    for target in task.random_targets(np.random.default_rng(7), 4, _n_classes(task)):
        row = dict(zip(task.target_columns, _as_tuple(target)))
        values = task.manifest_target(pd.Series({"slide_id": "s", **row}))
        assert values is not None and len(values) == len(task.target_columns)
        label, stored = task.slide_fields(list(values))
        y = Slide("s", label, Path("s.h5"), stored).y
        assert task.target_of(label, stored) == y
        assert _as_tuple(y) == pytest.approx(_as_tuple(target))
    assert task.manifest_target(pd.Series({"slide_id": "s"})) is None


def test_a_target_that_is_not_a_number_is_refused_naming_file_column_and_slide(task: Task) -> None:
    column = task.target_columns[0]
    good = pd.DataFrame({"slide_id": ["a", "b"], column: [1, None]})
    task.check_manifest(good, "m.csv")  # an empty cell is a slide without a target
    bad = pd.DataFrame({"slide_id": ["a", "b", "c"], column: [1, "high", float("inf")]})
    with pytest.raises(ValueError, match=rf"m\.csv: column '{column}' .*\['high', inf\].*\['b', 'c'\]; expected a finite number"):
        task.check_manifest(bad, "m.csv")


def test_a_registered_task_is_a_config_choice(example_registered: None, tmp_path: Path) -> None:
    """The example is a ``methods[].task`` of a pipeline (its default loss filled in) and its slides are read
    from its own manifest column; an unregistered name is refused naming the registered ones."""
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.data.bags import slides_for_split

    raw = {"name": "graded", "data": {"manifest": "m.csv", "tiles_dir": str(tmp_path)}, "seeds": [0],
           "methods": [{"name": "m", "strategy": "frozen", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"},
                        "task": "ordinal"}]}
    cfg = config_from_dict(raw)
    assert cfg.task == "ordinal" and cfg.methods[0].loss == "cumulative_bce" and cfg.label_classes is None
    manifest = pd.DataFrame({"slide_id": ["a", "b", "c"], "split": ["train", "train", "val"], "grade": [2, None, 3]})
    train = slides_for_split(manifest, "train", tmp_path, task="ordinal")
    assert [(s.slide_id, s.y) for s in train] == [("a", 2.0)]
    raw["methods"][0]["task"] = "grading"
    with pytest.raises(ValueError, match="ordinal"):
        config_from_dict(raw)


# ---- the built-in tasks against independent computations ---------------------------------


def test_classification_loss_scores_and_metrics_match_torch_and_sklearn() -> None:
    task = get_task("classification")
    rng = np.random.default_rng(11)
    y = task.random_targets(rng, 30, N_CLASSES)
    endpoint = task.fit("cross_entropy", LossOptions(), N_CLASSES, y)
    z = rng.normal(0, 2, (30, N_CLASSES))
    loss = endpoint.group_loss([_Out(torch.tensor(row[None])) for row in z], y)
    log_softmax = z - np.log(np.exp(z).sum(1, keepdims=True))
    assert float(loss) == pytest.approx(-np.mean(log_softmax[np.arange(30), y]), rel=1e-9)
    probs = task.scores(endpoint, z)["probs"]
    np.testing.assert_allclose(probs, np.exp(log_softmax), rtol=1e-12)
    m = task.metrics(y, {"probs": probs}, n_classes=N_CLASSES)
    assert m["auc"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr", average="macro"))
    assert m["accuracy"] == pytest.approx(accuracy_score(y, probs.argmax(1)))
    assert m["qwk"] == pytest.approx(cohen_kappa_score(y, probs.argmax(1), weights="quadratic"))
    assert task.pool_target([0, 2, 1]) == 2


def test_survival_cox_loss_and_c_index_match_hand_computation() -> None:
    task = get_task("survival")
    rng = np.random.default_rng(12)
    targets = task.random_targets(rng, 15)
    endpoint = task.fit("cox", LossOptions(ties="breslow"), None, targets)
    risk = rng.normal(0, 1, 15)
    loss = endpoint.group_loss([_Out(torch.tensor([[r]])) for r in risk], targets)
    t = np.array([a for a, _ in targets])
    e = np.array([b for _, b in targets])
    nll = -sum(risk[i] - np.log(np.exp(risk[t >= t[i]]).sum()) for i in range(15) if e[i]) / e.sum()
    assert float(loss) == pytest.approx(nll, rel=1e-9)
    num = den = 0.0
    for i, j in itertools.permutations(range(15), 2):
        if e[i] and t[i] < t[j]:
            den += 1
            num += 1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0
    ref = survival_reference(t, e, risk=risk, endpoint=endpoint)
    assert task.metrics(targets, {"risk": risk}, ref=ref)["c_index"] == pytest.approx(num / den)
    with pytest.raises(ValueError, match="1 observed event"):
        task.fit("cox", LossOptions(), None, [(1.0, 1), (2.0, 0), (3.0, 0)])


def test_regression_loss_scores_and_metrics_match_sklearn_and_scipy() -> None:
    task = get_task("regression")
    rng = np.random.default_rng(13)
    y = task.random_targets(rng, 20)
    endpoint = task.fit("mse", LossOptions(), None, y)
    assert endpoint.target_mean == pytest.approx(np.mean(y)) and endpoint.target_sd == pytest.approx(np.std(y, ddof=1))
    z = rng.normal(0, 1, 20)
    loss = endpoint.group_loss([_Out(torch.tensor([[v]])) for v in z], y)
    standard = (np.asarray(y) - endpoint.target_mean) / endpoint.target_sd
    assert float(loss) == pytest.approx(np.mean((z - standard) ** 2), rel=1e-9)
    pred = task.scores(endpoint, z[:, None])["prediction"]
    np.testing.assert_allclose(pred, z * endpoint.target_sd + endpoint.target_mean, rtol=1e-12)
    m = task.metrics(y, {"prediction": pred})
    assert m["mae"] == pytest.approx(mean_absolute_error(y, pred))
    assert m["rmse"] == pytest.approx(math.sqrt(mean_squared_error(y, pred)))
    assert m["pearson"] == pytest.approx(pearsonr(y, pred).statistic)
    assert m["spearman"] == pytest.approx(spearmanr(y, pred).statistic)


def test_the_example_matches_its_independent_computation(example_registered: None) -> None:
    """The ordinal example's loss is the mean binary cross-entropy of the cumulative targets, its score the expected grade."""
    task = get_task("ordinal")
    rng = np.random.default_rng(14)
    y = task.random_targets(rng, 8)
    endpoint = task.fit("cumulative_bce", LossOptions(), None, y)
    z = rng.normal(0, 1, (8, 3))
    p = 1.0 / (1.0 + np.exp(-z))
    above = (np.asarray(y)[:, None] > np.arange(3)[None, :]).astype(float)
    bce = -(above * np.log(p) + (1 - above) * np.log(1 - p)).mean(1).mean()
    assert float(endpoint.group_loss([_Out(torch.tensor(row[None])) for row in z], y)) == pytest.approx(bce, rel=1e-9)
    np.testing.assert_allclose(task.scores(endpoint, z)["expected_grade"], p.sum(1), rtol=1e-12)
    assert task.prediction_columns(None) == ["slide_id", "cohort", "grade", "expected_grade", "n_tiles", "protocol",
                                             "n_repeats", "expected_grade_std", "method", "seed", "patient_id"]


@pytest.mark.slow
def test_the_example_trains_and_evaluates_through_the_pipeline(example_registered: None, tmp_path: Path,
                                                               store_cohort: Path) -> None:
    """A registered task needs nothing else: ``train`` records its validation values, ``eval`` writes its
    predictions columns and its metrics, equal to scikit-learn's on the written predictions."""
    import yaml
    from pipeline_helpers import make_config

    from wsi_pipeline.config.pipeline import load_config
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.export.metrics_json import read_metrics_json
    from wsi_pipeline.export.predictions import predictions_path
    from wsi_pipeline.manifests.schema import read_manifest, write_manifest
    from wsi_pipeline.training.loop import train_pipeline

    df = read_manifest(store_cohort)
    df["grade"] = [i % 4 for i in range(len(df))]
    manifest = write_manifest(df, tmp_path / "graded.csv")
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    path = make_config(tmp_path, manifest, [{"name": "m", "strategy": "frozen", "chunk_size": 32, "task": "ordinal"}],
                       train={"epochs": 1}, results_dir=str(tmp_path / "results"), eval={"protocols": ["all"], "bootstrap": 0})
    raw = yaml.safe_load(path.read_text())
    del raw["data"]["n_classes"]  # a task without classes needs none
    path.write_text(yaml.safe_dump(raw))

    cfg = load_config(path)
    train_pipeline(cfg, progress=False)
    history = pd.read_csv(cfg.run_dir("m", 0) / "history.csv")
    assert {"val_loss", "val_mae", "val_qwk"} <= set(history.columns)
    summary = evaluate_pipeline(cfg, device="cpu", heatmaps=False, progress=False)
    test = df[df["split"] == "test"]
    preds = read_predictions(predictions_path(summary.results_dir, str(test["cohort"].iloc[0]), "all"))
    assert list(preds.columns) == get_task("ordinal").prediction_columns(None)
    records = {r.metric: r.value for r in read_metrics_json(summary.results_dir / "metrics.json")
               if r.seed == 0 and r.split == "test" and r.repeat is None}
    y, p = preds["grade"].to_numpy(int), preds["expected_grade"].to_numpy(float)
    assert records["mae"] == pytest.approx(mean_absolute_error(y, p), rel=1e-5)  # the CSV holds 6 significant digits
    assert (summary.results_dir / "report.html").is_file()
