"""The small patch encoder (ilse_cnn) and the mean / max pooling aggregators through train and eval:
frozen, full and accumulate train them; the trained models come back and predict."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from wsi_pipeline.cli.main import main
from wsi_pipeline.checkpoints.files import load_run_checkpoint
from wsi_pipeline.inference.trained import load_trained_model

from pipeline_helpers import make_config

METHODS = [
    {"name": "frozen_max", "strategy": "frozen", "encoder": {"name": "ilse_cnn"}, "aggregator": {"name": "max"}},
    {"name": "full_mean", "strategy": "full", "encoder": {"name": "ilse_cnn"}, "aggregator": {"name": "mean"}},
    {"name": "acc_gated", "strategy": "accumulate", "chunk_size": 5, "encoder": {"name": "ilse_cnn"},
     "aggregator": {"name": "abmil", "options": {"attn_dim": 128}}},
]


@pytest.mark.slow
def test_ilse_cnn_with_pooling_aggregators_trains_and_evaluates(tmp_path, store_cohort) -> None:
    cfg = make_config(tmp_path, store_cohort, METHODS, train={"augment": {"enabled": True, "jitter_p": 0.0, "blur_p": 0.0}},
                      eval={"protocols": ["all"], "val_protocol": "all", "bootstrap": 20},
                      results_dir=str(tmp_path / "results"))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    for m in METHODS:
        run = tmp_path / "runs" / "t" / m["name"] / "seed0"
        assert (run / "done").is_file()
        hist = pd.read_csv(run / "history.csv")
        assert hist["train_loss"].notna().all() and hist["val_loss"].notna().all()
        tm = load_trained_model(run, which="best")
        assert type(tm.encoder).__name__ == "IlseCNN" and tm.encoder.num_features == 512
        saved = load_run_checkpoint(run / "best.pt").models
        if m["strategy"] != "frozen":  # the encoder trained, and the checkpoint holds it
            assert saved["encoder"] is not None
            for k, v in tm.encoder.state_dict().items():
                assert torch.equal(v, saved["encoder"][k])
    assert main(["eval", "--config", str(cfg), "--no-progress"]) == 0
    preds = list((tmp_path / "results" / "t").rglob("predictions_*_all.csv"))
    assert preds, "eval wrote no predictions"
    df = pd.concat(pd.read_csv(p) for p in preds)
    assert df["prob_1"].between(0, 1).all()
