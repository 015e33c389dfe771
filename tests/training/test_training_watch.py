"""Training you can watch and a data path that feeds a device: per-step records (steps.csv,
TensorBoard), the final values in a log file, and bags converted off the training thread with the
same values the training thread computes."""

from __future__ import annotations

import logging
import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline_helpers import make_config
from wsi_pipeline.cli.main import main


# ----------------------------------------------------------------------------------------------
# The data path: the same numbers, converted elsewhere
# ----------------------------------------------------------------------------------------------


def _bag(seed: int = 0, k: int = 7, t: int = 16):
    from wsi_pipeline.data.bags import Bag, Slide

    tiles = np.random.default_rng(seed).integers(0, 256, (k, t, t, 3), dtype=np.uint8)
    return Bag(Slide("s", 1, None), np.arange(k), tiles)  # type: ignore[arg-type]


def test_device_tiles_slices_equal_the_whole_bag_converted(float64):
    from wsi_pipeline.data.tensors import DeviceTiles, tiles_to_tensor

    bag = _bag()
    whole = tiles_to_tensor(bag.data)
    lazy = DeviceTiles(torch.from_numpy(bag.data), "cpu")
    assert lazy.shape == whole.shape and len(lazy) == 7 and lazy.dtype == torch.float64
    for a, b in ((0, 3), (3, 6), (6, 7)):
        assert torch.equal(lazy[a:b], whole[a:b])
    assert torch.equal(lazy.to("cpu"), whole)
    with pytest.raises(ValueError, match="uint8"):
        DeviceTiles(torch.zeros(2, 4, 4, 3), "cpu")


def test_prepared_bags_equal_what_the_training_thread_computes():
    """CPU, no augmentation: the loader thread's input is bit-identical to the training thread's;
    with augmentation nothing is prepared (the draw belongs to the training thread)."""
    from wsi_pipeline.config.model import BiglConfig
    from wsi_pipeline.config.pipeline import MethodConfig
    from wsi_pipeline.data.augment import build_augment, tiles_to_input
    from wsi_pipeline.config.train import AugmentConfig
    from wsi_pipeline.training.strategies import build_strategy

    bag = _bag(seed=3)
    for name in ("full", "accumulate", "bigl"):
        options = {"bigl": BiglConfig(stages=1, max_elements=2**20)} if name == "bigl" else {}
        method = MethodConfig(name="m", strategy=name, chunk_size=3, **options)  # type: ignore[arg-type]
        strategy = build_strategy(method, 2, "cpu")
        prepared = strategy.prepare_bag(bag)
        assert prepared is not None and prepared.dtype == torch.get_default_dtype()
        assert torch.equal(prepared, tiles_to_input(bag.data, None, device="cpu", chunk=3)), name
        strategy.augment = build_augment(AugmentConfig(enabled=True))
        assert strategy.prepare_bag(bag) is None, name


def test_accumulating_device_tiles_is_the_same_step(float64):
    """Exact accumulation fed uint8 tiles converted chunk by chunk gives the gradient of the float bag."""
    from wsi_pipeline.data.tensors import DeviceTiles, tiles_to_tensor
    from wsi_pipeline.models import build_aggregator, build_encoder
    from wsi_pipeline.training.accumulate import accumulate_step

    torch.manual_seed(0)
    enc, agg = build_encoder("resnet18").eval(), build_aggregator("abmil", 512, 2).eval()
    bag = _bag(seed=5, k=9, t=32)
    grads = []
    for tiles in (tiles_to_tensor(bag.data), DeviceTiles(torch.from_numpy(bag.data), "cpu")):
        for p in [*enc.parameters(), *agg.parameters()]:
            p.grad = None
        loss = accumulate_step(enc, agg, tiles, 1, 4)
        grads.append((loss, [p.grad.clone() for p in [*enc.parameters(), *agg.parameters()]]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


# ----------------------------------------------------------------------------------------------
# Watching: steps.csv, TensorBoard, the last line of a log
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_epoch_writes_steps_and_a_tensorboard_event_file(tmp_path, store_cohort):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from wsi_pipeline.data.bags import epoch_plan
    from wsi_pipeline.data.store import open_store, store_path
    from wsi_pipeline.manifests.schema import read_manifest

    method = [{"name": "m", "strategy": "accumulate", "chunk_size": 4}]
    cfg = make_config(tmp_path, store_cohort, method, train={"epochs": 1, "log": "tensorboard", "bag_size": 8, "batch_bags": 2})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    steps = pd.read_csv(run / "steps.csv")
    hist = pd.read_csv(run / "history.csv")
    # the epoch's plan, recomputed: groups of 2 bags of min(8, tiles) tiles
    manifest = read_manifest(store_cohort)
    train = manifest[manifest["split"] == "train"]["slide_id"].tolist()
    n_tiles = [len(open_store(store_path(store_cohort.parent / "tiles", s))) for s in train]
    plan = epoch_plan(n_tiles, bag_size=8, bags_per_step=2, seed=0, epoch=0)
    assert steps["step"].tolist() == list(range(1, len(plan) + 1)) and (steps["epoch"] == 1).all()
    assert steps["tiles"].tolist() == [sum(min(8, n_tiles[i]) for i, _ in group) for group in plan]
    sizes = np.array([len(group) for group in plan])
    assert np.average(steps["loss"], weights=sizes) == pytest.approx(hist["train_loss"].iloc[0], rel=1e-9)
    assert (steps["grad_norm"] > 0).all() and np.isfinite(steps["tiles_per_s"]).all()
    assert ((steps["data_wait_share"] >= 0) & (steps["data_wait_share"] <= 1)).all()
    assert (steps["peak_mem_mb"] > 0).all() and steps["lr"].iloc[0] == pytest.approx(1e-4)
    assert hist["tiles_per_s"].iloc[0] > 0 and 0 <= hist["data_wait_share"].iloc[0] <= 1 and hist["val_seconds"].iloc[0] > 0
    # the event file, read back with TensorBoard's own reader
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == steps["step"].tolist()
    np.testing.assert_allclose(loss, steps["loss"], rtol=2**-23)  # stored as float32
    assert [e.value for e in events.Scalars("val/auc")] == pytest.approx([hist["val_auc"].iloc[0]], rel=2**-23)


def test_the_step_warmup_reaches_the_optimiser_of_a_training_run(tmp_path, store_cohort):
    """train.warmup_steps through the CLI: steps.csv's rate at global step k (0-based) is the epoch's
    scheduled rate x (k + 1) / (N + 1) for k < N and the epoch's rate after, across an epoch boundary."""
    from wsi_pipeline.config.train import TrainConfig
    from wsi_pipeline.training.optim import lr_at_epoch

    n = 8
    method = [{"name": "m", "strategy": "full", "encoder": {"name": "ilse_cnn"},
               "aggregator": {"name": "abmil", "options": {"projection": False}}}]
    train = {"epochs": 2, "lr": 1e-3, "schedule": "cosine", "bag_size": 4, "batch_bags": 1, "warmup_steps": n}
    cfg = make_config(tmp_path, store_cohort, method, train=train)
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    steps = pd.read_csv(tmp_path / "runs" / "t" / "m" / "seed0" / "steps.csv")
    per_epoch = int((steps["epoch"] == 1).sum())
    assert 1 < per_epoch < n + 1 < len(steps)  # the ramp crosses into epoch 2
    t = TrainConfig(epochs=2, lr=1e-3, schedule="cosine")
    want = [lr_at_epoch(e - 1, t) * ((k + 1) / (n + 1) if k < n else 1.0) for k, e in enumerate(steps["epoch"])]
    assert steps["lr"].tolist() == pytest.approx(want, rel=1e-12)


def test_tensorboard_without_the_package_is_one_clear_error(tmp_path, monkeypatch):
    from wsi_pipeline.training.monitor import StepMonitor

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"wsi-pipeline\[tensorboard\]"):
        StepMonitor(tmp_path, torch.device("cpu"), "tensorboard")


def test_the_last_log_line_holds_the_final_values(caplog, monkeypatch):
    """Off a terminal a bar logs every 30 s; its last line must show the final loss, not the one of
    its last periodic line (the issue: 0.6661 after bag 1 while the epoch's loss was 1.9927)."""
    from wsi_pipeline.progress import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="wsi_pipeline.progress"):
        with progress_bar(total=20, desc="epoch 1", unit="bag", leave=False, log_every=3600) as bar:
            for i in range(20):
                bar.update(1)
                bar.set_postfix(loss=f"{0.5 + i / 10:.4f}")
    lines = [r.getMessage() for r in caplog.records if r.name == "wsi_pipeline.progress"]
    assert "20/20" in lines[-1] and "loss=2.4000" in lines[-1], lines


def test_step_monitor_keeps_the_finished_epochs_of_a_resumed_run(tmp_path):
    from wsi_pipeline.training.monitor import StepInfo, StepMonitor

    mon = StepMonitor(tmp_path, torch.device("cpu"))
    for epoch in range(2):
        mon.begin_epoch(epoch)
        for _ in range(3):
            mon.step(StepInfo(1.0, 10, 0.0), lr=0.1, grad_norm=2.0)
        mon.end_epoch({"epoch": epoch + 1, "train_loss": 1.0})
    mon.begin_epoch(2)
    mon.step(StepInfo(1.0, 10, 0.0), lr=0.1, grad_norm=None)  # killed inside epoch 3: not written
    again = StepMonitor(tmp_path, torch.device("cpu"), start_epoch=2)
    assert len(again.rows) == 6 and again.global_step == 6 and math.isnan(StepInfo().loss)
