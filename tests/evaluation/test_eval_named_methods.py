"""``eval --method A`` scores A and keeps the other methods' earlier results (evaluation.earlier_results).

Two methods' runs are saved as checkpoints over a tiny store cohort. The reference is an ``eval`` of
every method into a fresh folder: evaluating everything, then changing A's model and evaluating A
alone, must leave the same predictions, metrics and report rows as evaluating everything once with
A's new model.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pandas as pd
import pytest
import torch

from wsi_pipeline.config.pipeline import config_from_dict, with_eval
from wsi_pipeline.evaluation.evaluate import evaluate_pipeline

METHODS = ("attention", "mean")


def _config(tmp, results: str):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    manifest = tmp / "data" / "manifest.csv"
    if not manifest.is_file():
        manifest = make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(6, 10), seed=0)
    aggregators = {"attention": {"name": "abmil", "options": {"projection": False, "dropout": 0.0}},
                   "mean": {"name": "mean", "options": {"projection": False}}}
    return config_from_dict({
        "name": "t", "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "n_classes": 2,
                              "tiling": {"tile_size": 32}},
        "eval": {"val_protocol": "all", "protocols": ["all", "ens4x3"], "seed": 0, "bootstrap": 20, "heatmaps": False},
        "seeds": [0, 1],
        "methods": [{"name": m, "strategy": "full", "encoder": {"name": "ilse_cnn"}, "aggregator": aggregators[m]}
                    for m in METHODS],
        "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / results),
    })


def _save_runs(cfg, method: str, weights_seed: int) -> None:
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.training.rundir import run_config

    m = next(x for x in cfg.methods if x.name == method)
    for seed in cfg.seeds:
        torch.manual_seed(100 * weights_seed + seed)
        enc, agg = build_models(m, 2, for_training=False)
        d = cfg.run_dir(method, seed)
        save_run_checkpoint(d / "best.pt", RunCheckpoint.build(
            run_config(cfg, m, seed), m, seed=seed, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()}))
        (d / "done").touch()


def _predictions(folder) -> dict[str, pd.DataFrame]:
    return {p.name: pd.read_csv(p).sort_values(["method", "seed", "slide_id"]).reset_index(drop=True)
            for p in sorted(folder.glob("predictions_*.csv"))}


def _records(folder) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True) for r in json.loads((folder / "metrics.json").read_text())["records"])


def test_eval_of_one_method_keeps_the_others_and_equals_a_full_eval(tmp_path):
    cfg = _config(tmp_path, "results")
    for m in METHODS:
        _save_runs(cfg, m, weights_seed=1)
    evaluate_pipeline(cfg, progress=False)
    out = tmp_path / "results" / "t"
    before = _predictions(out)
    assert set(before) == {"predictions_synthetic_all.csv", "predictions_synthetic_ens4x3.csv"}

    _save_runs(cfg, "attention", weights_seed=2)  # a retrained attention model
    evaluate_pipeline(with_eval(cfg, methods=["attention"]), progress=False)
    after = _predictions(out)

    for name, df in after.items():
        old, new = before[name], df
        # the mean pooling rows are the earlier eval's, unchanged
        pd.testing.assert_frame_equal(old[old.method == "mean"].reset_index(drop=True),
                                      new[new.method == "mean"].reset_index(drop=True))
        # attention was scored again, with its new model
        assert not new.loc[new.method == "attention", "prob_1"].equals(
            old.loc[old.method == "attention", "prob_1"].reset_index(drop=True))

    # the reference: one eval of both methods with today's models, in a fresh folder
    ref_cfg = _config(tmp_path, "reference")
    evaluate_pipeline(ref_cfg, progress=False)
    ref = tmp_path / "reference" / "t"
    ref_pred = _predictions(ref)
    assert set(ref_pred) == set(after)
    for name in ref_pred:
        pd.testing.assert_frame_equal(after[name], ref_pred[name])
    assert _records(out) == _records(ref)
    html = (out / "report.html").read_text()
    assert all(m in html for m in METHODS)


def test_kept_results_of_a_method_retrained_since_are_named(tmp_path, caplog):
    cfg = _config(tmp_path, "results")
    for m in METHODS:
        _save_runs(cfg, m, weights_seed=1)
    evaluate_pipeline(cfg, progress=False)
    written = (tmp_path / "results" / "t" / "metrics.json").stat().st_mtime
    os.utime(cfg.run_dir("mean", 1) / "done", (written + 60, written + 60))  # mean seed 1 finished again since
    with caplog.at_level("WARNING", logger="wsi_pipeline.evaluation.evaluate"):
        evaluate_pipeline(with_eval(cfg, methods=["attention"]), progress=False)
    warned = [r.getMessage() for r in caplog.records if "predate" in r.getMessage()]
    assert len(warned) == 1 and "mean seed 1" in warned[0] and "mean seed 0" not in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="wsi_pipeline.evaluation.evaluate"):
        evaluate_pipeline(with_eval(cfg, methods=["mean"]), progress=False)  # attention's kept rows are current
    assert not [r for r in caplog.records if "predate" in r.getMessage()]


def test_a_full_eval_writes_the_folder_afresh(tmp_path):
    cfg = _config(tmp_path, "results")
    for m in METHODS:
        _save_runs(cfg, m, weights_seed=1)
    evaluate_pipeline(cfg, progress=False)
    # the pipeline now lists one method: a full eval of it leaves no row of the dropped one
    only = dataclasses.replace(cfg, methods=type(cfg.methods)(cfg.methods[:1]))
    evaluate_pipeline(only, progress=False)
    out = tmp_path / "results" / "t"
    for df in _predictions(out).values():
        assert set(df["method"]) == {"attention"}
    assert {json.loads(r)["method"] for r in _records(out)} == {"attention"}


def test_a_damaged_earlier_metrics_file_stops_before_scoring(tmp_path, monkeypatch):
    cfg = _config(tmp_path, "results")
    for m in METHODS:
        _save_runs(cfg, m, weights_seed=1)
    out = tmp_path / "results" / "t"
    out.mkdir(parents=True)
    (out / "metrics.json").write_text('{"records": [{"method": "mean"}]}')
    import wsi_pipeline.evaluation.evaluate as ev

    def no_scoring(*a, **k):
        raise AssertionError("a slide was scored before the earlier results were read")

    monkeypatch.setattr(ev, "_evaluate_run", no_scoring)
    with pytest.raises(ValueError, match=r"metrics\.json.*record 0"):
        evaluate_pipeline(with_eval(cfg, methods=["attention"]), progress=False)
