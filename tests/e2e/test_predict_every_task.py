"""``wsi-pipeline predict`` through the command line for the tasks without classes (issues 50, 51, 52).

A tiny frozen-encoder survival (Cox) and regression (MSE) model is trained on the session's store
cohort with ``train``, then ``predict --model RUN --slides DIR`` scores a folder of two of its
stores. The command must exit 0, print its summary with the task's own score, and write the task's
columns; the values must equal the trained model applied here to every tile of each store (risk =
the aggregator's output; regression = output * sd + mean of the training split's targets, computed
here from the manifest; multilabel = the sigmoid of each target's output).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from wsi_pipeline.cli.main import main

pytestmark = pytest.mark.slow

SLIDES = ("synthetic_000", "synthetic_005")


def _targets(n: int, task: str) -> dict[str, list]:
    """Endpoint columns for ``n`` slides: times and alternating events, a spread of numbers, or two binary
    columns (one cell empty)."""
    if task == "survival":
        return {"time": [float(3 * i + 1) for i in range(n)], "event": [1 if i % 3 else 0 for i in range(n)]}
    if task == "multilabel":
        return {"a": [float(i % 2) for i in range(n)], "b": [None if i == 1 else float((i // 2) % 2) for i in range(n)]}
    return {"target": [10.0 + 2.5 * ((7 * i) % 11) for i in range(n)]}


def _train(store_cohort: Path, tmp_path: Path, task: str, loss: str) -> tuple[Path, pd.DataFrame]:
    """Train one tiny frozen-encoder run of ``task``; returns its run folder and the manifest."""
    from pipeline_helpers import make_config

    df = pd.read_csv(store_cohort)
    for col, values in _targets(len(df), task).items():
        df[col] = values
    manifest = tmp_path / "m.csv"
    df.to_csv(manifest, index=False)
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    method = {"name": "m", "strategy": "frozen", "chunk_size": 16, "task": task, "loss": loss}
    if task == "multilabel":
        method["targets"] = ["a", "b"]
    cfg = make_config(tmp_path, manifest, [method], train={"epochs": 1})
    raw = yaml.safe_load(cfg.read_text())
    raw["data"].pop("n_classes")
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    return tmp_path / "runs" / "t" / "m" / "seed0", df


def _model_outputs(run: Path, stores: Path) -> dict[str, np.ndarray]:
    """The trained aggregator's output over every tile of each store, applied here."""
    import torch

    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.inference.trained import load_trained_model

    model = load_trained_model(run, device="cpu")
    model.encoder.eval(), model.aggregator.eval()
    out = {}
    for sid in SLIDES:
        store = open_store(stores / f"{sid}.zarr")
        with torch.no_grad():
            z = model.aggregator(model.encoder(tiles_to_tensor(store.read(np.arange(len(store)))))).logits
        out[sid] = z.double().reshape(-1).numpy()
    return out


def _predict_cli(run, store_cohort, tmp_path, capsys):
    """``predict`` through the CLI on copies of the test slides' stores: (their folder, the captured output,
    predictions.csv by slide_id); it must exit 0 without a traceback."""
    new = tmp_path / "new"
    for sid in SLIDES:
        shutil.copytree(store_cohort.parent / "tiles" / f"{sid}.zarr", new / f"{sid}.zarr")
    capsys.readouterr()
    rc = main(["predict", "--model", str(run), "--slides", str(new), "--out", str(tmp_path / "pred"), "--no-progress",
               "--no-heatmaps", "--device", "cpu", "--workers", "0"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Traceback" not in out.err and "KeyError" not in out.err, out.err
    return new, out, pd.read_csv(tmp_path / "pred" / "predictions.csv").set_index("slide_id")


@pytest.mark.parametrize("task,loss,column", [("survival", "cox", "risk"), ("regression", "mse", "prediction")])
def test_predict_through_the_cli_for_every_task_without_classes(task, loss, column, store_cohort, tmp_path, capsys):
    run, manifest = _train(store_cohort, tmp_path, task, loss)
    new, out, pred = _predict_cli(run, store_cohort, tmp_path, capsys)
    assert sorted(pred.index) == sorted(SLIDES)
    assert column in pred.columns and "pred" not in pred.columns
    assert not [c for c in pred.columns if c.startswith("prob_")]
    z = _model_outputs(run, new)
    if task == "survival":
        want = {sid: float(v[0]) for sid, v in z.items()}
    else:
        train = manifest.loc[manifest["split"] == "train", "target"].to_numpy(float)
        want = {sid: float(v[0]) * train.std(ddof=1) + train.mean() for sid, v in z.items()}
    for sid in SLIDES:
        assert pred.loc[sid, column] == pytest.approx(want[sid], rel=1e-4, abs=1e-5)
        assert pred.loc[sid, f"{column}_std"] == 0.0  # one repeat: the all-tiles protocol
    # the printed summary: a heading for the task's score and each slide's value as predictions.csv holds it
    lines = out.out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["slide_id"])
    assert column in lines[head].split()
    shown = {ln.split()[0]: ln.split() for ln in lines[head + 1: head + 1 + len(SLIDES)]}
    for sid in SLIDES:
        assert float(shown[sid][lines[head].split().index(column)]) == pytest.approx(pred.loc[sid, column], rel=1e-3)
    assert "Predicted 2 slide(s)" in out.out


def test_predict_through_the_cli_for_a_multilabel_model(store_cohort, tmp_path, capsys):
    """Every target's probability is the sigmoid of its output; the summary prints each ``prob_<col>``."""
    run, _ = _train(store_cohort, tmp_path, "multilabel", "bce")
    new, out, pred = _predict_cli(run, store_cohort, tmp_path, capsys)
    assert sorted(pred.index) == sorted(SLIDES)
    assert {"a", "b", "prob_a", "prob_b", "prob_std"} <= set(pred.columns) and "pred" not in pred.columns
    z = _model_outputs(run, new)
    for sid in SLIDES:
        want = 1.0 / (1.0 + np.exp(-z[sid]))
        assert [pred.loc[sid, "prob_a"], pred.loc[sid, "prob_b"]] == pytest.approx(list(want), rel=1e-4, abs=1e-5)
    lines = out.out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["slide_id"])
    cols = lines[head].split()
    assert "prob_a" in cols and "prob_b" in cols
    shown = {ln.split()[0]: ln.split() for ln in lines[head + 1: head + 1 + len(SLIDES)]}
    for sid in SLIDES:
        assert float(shown[sid][cols.index("prob_b")]) == pytest.approx(pred.loc[sid, "prob_b"], abs=1e-3)
    assert "Predicted 2 slide(s)" in out.out
