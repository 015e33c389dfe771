"""The training stage end to end on synthetic tile stores: every strategy through the CLI, exactness of
accumulation, exact resume after SIGKILL, clear errors before training, bags, augmentation, learning.

References are independent of the loop: a plain-autograd training loop written here, numpy
rotations and flips, scikit-learn's AUC on the loaded model's own predictions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from wsi_pipeline.training.monitor import MEASURED_COLUMNS
from wsi_pipeline.cli.main import main
from wsi_pipeline.data.augment import AugmentParams, SlideAugment, tiles_to_input
from wsi_pipeline.data.bags import epoch_plan
from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.manifests import ManifestError
from wsi_pipeline.checkpoints.files import load_checkpoint, load_run_checkpoint
from wsi_pipeline.inference.trained import load_trained_model
from wsi_pipeline.config.pipeline import AugmentConfig, BagStatisticsWarning, load_config
from wsi_pipeline.training.loop import train_pipeline

from pipeline_helpers import make_config

HISTORY = ["epoch", "train_loss", "val_loss", "val_auc", "val_qwk", "val_accuracy", "val_balanced_accuracy", "lr", "seconds",
           "tiles_per_s", "data_wait_share", "peak_mem_mb", "val_seconds"]


def models_of(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {k: v for k, v in load_run_checkpoint(path).models.items() if v is not None}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[m][k].double() - b[m][k].double()).abs().max()) for m in a for k in a[m] if a[m][k].is_floating_point())


# ----------------------------------------------------------------------------------------------
# Every strategy through the CLI
# ----------------------------------------------------------------------------------------------

STRATEGY_METHODS = {
    "frozen": {"name": "m", "strategy": "frozen", "chunk_size": 16},
    "full": {"name": "m", "strategy": "full", "encoder": {"bn": "train"}},
    "accumulate": {"name": "m", "strategy": "accumulate", "chunk_size": 3, "encoder": {"bn": "frozen"}},
    "bigl": {"name": "m", "strategy": "bigl", "encoder": {"bn": "train"}, "chunk_size": 16, "bigl": {"stages": 1, "max_elements": 2**22}},
    "patchgd": {"name": "m", "strategy": "patchgd", "chunk_size": 16, "patchgd": {"fraction": 1.0, "head_options": {"width": 16}}},
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGY_METHODS))
def test_each_strategy_trains_two_epochs_through_the_cli(tmp_path, store_cohort, strategy, caplog):
    cfg_path = make_config(tmp_path, store_cohort, [STRATEGY_METHODS[strategy]], train={"augment": {"enabled": strategy not in ("frozen", "patchgd")}})
    # BatchNorm on bag statistics (full, bigl here) is trained as asked, with the warning that says its risk
    bag_bn = STRATEGY_METHODS[strategy].get("encoder", {}).get("bn") in ("train", "chunk")
    def warns():  # said by every train command of such a method, a rerun included
        return pytest.warns(BagStatisticsWarning, match="encoder.bn=") if bag_bn else contextlib.nullcontext()

    with caplog.at_level(logging.INFO, logger="wsi_pipeline"), warns():
        assert main(["train", "--config", str(cfg_path), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    plan = ["bigl_plan.txt"] if strategy == "bigl" else []  # where its activations live, logged before training
    assert sorted(p.name for p in run.iterdir()) == sorted(["best.pt", "best.pt.sha256", "config.yaml", "done", "history.csv", "last.pt",
                                                            "last.pt.sha256", "memory.json", "steps.csv"] + plan)
    saved = load_config(run / "config.yaml")
    assert [m.name for m in saved.methods] == ["m"] and saved.methods[0].strategy == strategy and saved.seeds == (0,)
    hist = pd.read_csv(run / "history.csv")
    assert list(hist.columns) == HISTORY and hist["epoch"].tolist() == [1, 2]
    assert np.isfinite(hist["train_loss"]).all() and np.isfinite(hist["val_loss"]).all()
    assert hist["lr"].iloc[0] == pytest.approx(1e-4) and hist["lr"].iloc[1] == pytest.approx(5e-5)  # cosine over 2 epochs
    last = torch.load(run / "last.pt", weights_only=True)
    assert last["epoch"] == 2 and last["method"]["strategy"] == strategy and len(last["history"]) == 2
    assert json.loads((run / "done").read_text())["epochs"] == 2
    # the run's model comes back for evaluation and prediction
    tm = load_trained_model(run, which="best")
    best = load_checkpoint(run / "best.pt")
    for k, v in tm.aggregator.state_dict().items():
        assert torch.equal(v, best["models"]["aggregator"][k])
    assert tm.tiling.tile_size == 32 and tm.n_classes == 2 and not tm.encoder.training
    if strategy == "frozen":
        # features were extracted automatically, and the log says so
        assert any("extracting them now" in r.getMessage() for r in caplog.records)
        h5 = sorted(p.name for p in (tmp_path / "features" / "resnet18").glob("*.h5"))
        df = pd.read_csv(store_cohort)
        assert h5 == sorted(f"{s}.h5" for s in df.loc[df["split"].isin(["train", "val"]), "slide_id"])
        # the rebuilt frozen encoder embeds tiles exactly as the features were extracted
        from wsi_pipeline.inference.features import read_features
        from wsi_pipeline.data.store import open_store

        store = open_store(store_cohort.parent / "tiles" / h5[0].replace(".h5", ".zarr"))
        feats = read_features(tmp_path / "features" / "resnet18" / h5[0])[0]
        with torch.no_grad():
            again = tm.encoder(tiles_to_tensor(store.read())).numpy()
        # float32 ResNet-18 in other batches: ~20 layers of sums of <= 4608 products, rounding
        # errors (2**-24, random signs) ~ sqrt(4608) * 2**-24 ~ 4e-6 per layer, ~1e-4 in all
        np.testing.assert_allclose(again, feats, rtol=1e-4, atol=1e-5)
    else:
        assert last["models"]["encoder"] is not None
    # a finished run is skipped
    mtime = (run / "last.pt").stat().st_mtime_ns
    with warns():
        assert main(["train", "--config", str(cfg_path), "--no-progress"]) == 0
    assert (run / "last.pt").stat().st_mtime_ns == mtime


# The loop-level exactness claims below are checked in float64. In float32 they hold only to
# rounding, and Adam turns rounding into differences no rounding argument bounds usefully: it
# divides each element's step by that element's running RMS gradient, so an element whose total
# gradient (loss + weight decay) cancels to the order of float32 rounding (~1e-8 here, as large as
# Adam's eps = 1e-8) takes a step of arbitrary sign whose size is the learning rate. Such elements
# made the float32 comparisons differ by 1.2e-6 with AVX-512 kernels against < 1e-6 with AVX2
# ones, and by 1e-5 at lr = 1e-4 (measured). In float64 the same cancellation leaves gradients of
# ~1e-17, far below eps, so Adam's step of an element is at most lr * |g| / eps and a gradient
# difference dg moves a weight by at most lr * dg / eps per step: with the gradients' float64
# agreement (dg <= 1e-13 relative to gradients of order 1, see test_accumulate.py, which checks
# 1e-9 absolute) and lr = 1e-4 that is <= 1e-9 per step. The bound below, 1e-9 over a handful of
# steps, is thus loose for correct code and 5 orders of magnitude below a wiring error (a
# missing, doubled or mis-scaled bag moves weights by ~lr = 1e-4 per step).
EXACT_F64 = 1e-9


@pytest.mark.slow
def test_full_and_accumulate_with_frozen_bn_give_the_same_weights(tmp_path, store_cohort, float64):
    """One epoch, same seed, float64: the whole bag at once vs chunks of 3 tiles (not a divisor of the bag).

    The two gradients are equal in exact arithmetic; in float64 they agree to rounding, so the
    weights after Adam agree to ``EXACT_F64`` (see the comment above it).
    """
    methods = [
        {"name": "full", "strategy": "full", "encoder": {"bn": "frozen"}},
        {"name": "acc", "strategy": "accumulate", "chunk_size": 3, "encoder": {"bn": "frozen"}},
    ]
    cfg = load_config(make_config(tmp_path, store_cohort, methods, train={"epochs": 1, "lr": 1e-4}))
    train_pipeline(cfg, progress=False)
    full = models_of(tmp_path / "runs" / "t" / "full" / "seed0" / "last.pt")
    acc = models_of(tmp_path / "runs" / "t" / "acc" / "seed0" / "last.pt")
    assert all(v.dtype == torch.float64 for m in full.values() for v in m.values() if v.is_floating_point())
    assert max_diff(full, acc) <= EXACT_F64
    # and training did move the weights (the comparison is not between two untouched models)
    from wsi_pipeline.training.loop import _seed_everything
    from wsi_pipeline.methods.models import build_models

    _seed_everything(0)
    enc0, agg0 = build_models(cfg.methods[0], 2, for_training=False)
    init = {"encoder": enc0.state_dict(), "aggregator": agg0.state_dict()}
    assert max_diff(full, init) > 1e-5
    h_full = pd.read_csv(tmp_path / "runs" / "t" / "full" / "seed0" / "history.csv")
    h_acc = pd.read_csv(tmp_path / "runs" / "t" / "acc" / "seed0" / "history.csv")
    # the losses are sums of a few float64 cross-entropies of order 1 (history.csv keeps 17 digits)
    assert h_full["train_loss"].iloc[0] == pytest.approx(h_acc["train_loss"].iloc[0], abs=1e-12)


def test_loop_matches_a_plain_autograd_reference(tmp_path, store_cohort, float64):
    """Frozen features, B x S = 2 x 2 bags per step (6 slides: steps of 4 and 2 bags), exponential
    schedule, clipping: the loop's weights equal a training loop written here with plain autograd.

    float64 (features read as float32 and widened exactly): the two loops add the same terms in
    different orders, so they agree to float64 rounding amplified by Adam, <= ``EXACT_F64``.
    """
    from wsi_pipeline.inference.features import features_path, read_features
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.models import build_aggregator
    from wsi_pipeline.training.loop import _seed_everything

    method = {"name": "m", "strategy": "frozen", "chunk_size": 32, "aggregator": {"name": "abmil", "options": {"dropout": 0.0}}}
    train = {"epochs": 2, "lr": 1e-3, "batch_bags": 2, "accumulate_batches": 2, "schedule": "exponential", "gamma": 0.5,
             "clip_grad_norm": 0.5}
    cfg = load_config(make_config(tmp_path, store_cohort, [method], train=train))
    train_pipeline(cfg, progress=False)

    df = read_manifest(store_cohort)
    train_rows = df[(df["split"] == "train") & df["label"].notna()]
    feats = [torch.from_numpy(read_features(features_path(tmp_path / "features" / "resnet18", s))[0]).double()
             for s in train_rows["slide_id"]]
    labels = [int(v) for v in train_rows["label"]]
    _seed_everything(0)  # the run's initialisation seed
    agg = build_aggregator("abmil", 512, 2, dropout=0.0)
    init = {k: v.clone() for k, v in agg.state_dict().items()}
    opt = torch.optim.Adam(agg.parameters(), lr=1e-3, weight_decay=1e-4)
    for epoch in range(2):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * 0.5**epoch
        for bags in epoch_plan([len(f) for f in feats], bag_size=8, bags_per_step=4, seed=0, epoch=epoch):
            opt.zero_grad()
            loss = sum(
                torch.nn.functional.cross_entropy(agg(feats[i][idx]).logits[None], torch.tensor([labels[i]]))
                for i, idx in bags
            ) / len(bags)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agg.parameters(), 0.5)
            opt.step()
    ours = models_of(tmp_path / "runs" / "t" / "m" / "seed0" / "last.pt")["aggregator"]
    ref = agg.state_dict()
    assert all(v.dtype == torch.float64 for v in ours.values() if v.is_floating_point())
    assert max_diff({"a": ours}, {"a": ref}) <= EXACT_F64
    assert max_diff({"a": ref}, {"a": init}) > 1e-4  # the weights moved: the comparison is not vacuous


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------

KILL_AFTER_EPOCH_1 = r"""
import os, sys, time
import wsi_pipeline.training.loop as loop
config, flag = sys.argv[1], sys.argv[2]
real = loop.save_run_checkpoint
def save_then_hang(path, ckpt):
    out = real(path, ckpt)
    if os.path.basename(str(path)) == "last.pt" and ckpt.epoch == 1:
        open(flag, "w").close()
        time.sleep(600)  # killed here
    return out
loop.save_run_checkpoint = save_then_hang
from wsi_pipeline.cli.main import main
sys.exit(main(["train", "--config", config, "--no-progress"]))
"""


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path, store_cohort, capsys):
    method = [{"name": "m", "strategy": "accumulate", "chunk_size": 4}]  # dropout in ABMIL, augmentation on: RNG matters
    train = {"epochs": 2, "augment": {"enabled": True}, "demon": {"beta_init": 0.9}}
    straight = make_config(tmp_path, store_cohort, method, name="t", train=train, runs="straight")
    (tmp_path / "k").mkdir()
    killed = make_config(tmp_path / "k", store_cohort, method, name="t", train=train, runs="killed")
    assert main(["train", "--config", str(straight), "--no-progress"]) == 0

    flag = tmp_path / "epoch1.flag"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # same summation order as this process
    proc = subprocess.Popen([sys.executable, "-c", KILL_AFTER_EPOCH_1, str(killed), str(flag)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not flag.exists():
        if proc.poll() is not None:
            pytest.fail(f"training subprocess ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "training subprocess did not finish its first epoch in time"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    run_k = tmp_path / "k" / "killed" / "t" / "m" / "seed0"
    assert load_run_checkpoint(run_k / "last.pt").epoch == 1 and not (run_k / "done").exists()

    # with --no-resume an interrupted run is an error, before any training; by default it resumes
    assert main(["train", "--config", str(killed), "--no-progress", "--no-resume"]) == 2
    assert "unfinished run(s) found" in capsys.readouterr().err and load_run_checkpoint(run_k / "last.pt").epoch == 1
    assert main(["train", "--config", str(killed), "--no-progress"]) == 0

    run_s = tmp_path / "straight" / "t" / "m" / "seed0"
    a, b = models_of(run_s / "last.pt"), models_of(run_k / "last.pt")
    for m in a:
        for k in a[m]:
            assert torch.equal(a[m][k], b[m][k]), (m, k)
    assert max_diff(models_of(run_s / "best.pt"), models_of(run_k / "best.pt")) == 0.0
    ha = pd.read_csv(run_s / "history.csv").drop(columns=list(MEASURED_COLUMNS))
    hb = pd.read_csv(run_k / "history.csv").drop(columns=list(MEASURED_COLUMNS))
    pd.testing.assert_frame_equal(ha, hb, check_exact=True)
    assert len(ha) == 2


def test_early_stopping_stops_and_marks_the_run_done(tmp_path, store_cohort):
    # a learning rate too small to change any prediction: validation accuracy never improves
    method = [{"name": "m", "strategy": "frozen", "chunk_size": 32}]
    cfg = make_config(tmp_path, store_cohort, method,
                      train={"epochs": 6, "lr": 1e-12, "select_metric": "accuracy", "early_stopping_patience": 2})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    done = json.loads((run / "done").read_text())
    assert done["epochs"] == 3 and done["best_epoch"] == 1 and done["select_metric"] == "accuracy"
    assert pd.read_csv(run / "history.csv")["epoch"].tolist() == [1, 2, 3]
    assert load_run_checkpoint(run / "best.pt").epoch == 1


def test_resume_refuses_a_changed_config(tmp_path, store_cohort, capsys):
    method = [{"name": "m", "strategy": "frozen", "chunk_size": 32}]
    cfg = make_config(tmp_path, store_cohort, method, train={"epochs": 1})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    (run / "done").unlink()  # pretend it was interrupted
    assert main(["train", "--config", str(cfg), "--no-progress", "--set", "train.lr=3e-4"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "lr: 0.0001 (saved) vs 0.0003 (now)" in err
    # without config.yaml the check falls to the checkpoint's own config, read when the run resumes
    (run / "config.yaml").unlink()
    assert main(["train", "--config", str(cfg), "--no-progress", "--set", "train.lr=3e-4"]) == 2
    assert "lr: 0.0001 (saved) vs 0.0003 (now)" in capsys.readouterr().err


def test_a_resumed_run_reads_last_pt_once(tmp_path, store_cohort, monkeypatch):
    """The config check before training reads the run's config.yaml; only the resume itself reads last.pt
    (gigabytes for a foundation model), and every other checkpoint read is of best.pt."""
    from wsi_pipeline.checkpoints import files

    method = [{"name": "m", "strategy": "frozen", "chunk_size": 32}]
    cfg = make_config(tmp_path, store_cohort, method, train={"epochs": 1})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    (run / "done").unlink()  # pretend it was interrupted after its last epoch
    reads: list[str] = []
    real = files.load_checkpoint

    def counting(path, **kw):
        reads.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(files, "load_checkpoint", counting)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    assert reads.count("last.pt") == 1 and set(reads) <= {"last.pt", "best.pt"}, reads
    assert (run / "done").is_file()


# ----------------------------------------------------------------------------------------------
# Clear errors before any training
# ----------------------------------------------------------------------------------------------


def _no_training(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists()


def test_unknown_config_key_is_rejected_by_the_cli(tmp_path, store_cohort, capsys):
    cfg = make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "full"}], train={"lrate": 1.0})
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown key 'lrate' in section 'train'; valid keys: [" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown key 'lrate' in section 'train'; valid keys: \[.*'lr'"):
        load_config(cfg)
    _no_training(tmp_path)


def test_missing_manifest(tmp_path, store_cohort):
    cfg = load_config(make_config(tmp_path, tmp_path / "nowhere" / "manifest.csv", [{"name": "m", "strategy": "full"}]))
    with pytest.raises(FileNotFoundError, match=r"data.manifest .*nowhere/manifest.csv not found .*wsi-pipeline manifest"):
        train_pipeline(cfg, progress=False)
    _no_training(tmp_path)


def test_label_outside_the_classes(tmp_path, store_cohort):
    df = pd.read_csv(store_cohort)
    df.loc[2, "label"] = 2
    bad = tmp_path / "cohort" / "manifest.csv"
    bad.parent.mkdir()
    df.to_csv(bad, index=False)
    (bad.parent / "tiles").symlink_to(store_cohort.parent / "tiles")
    cfg = load_config(make_config(tmp_path, bad, [{"name": "m", "strategy": "full"}]))
    with pytest.raises(ManifestError, match=rf"label outside \[0, 2\) for slide\(s\) {df.loc[2, 'slide_id']}"):
        train_pipeline(cfg, progress=False)
    _no_training(tmp_path)


def test_slides_without_a_complete_tile_store(tmp_path, store_cohort):
    import zarr

    df = pd.read_csv(store_cohort)
    extra = pd.DataFrame([{**df.iloc[0].to_dict(), "slide_id": "ghost"}, {**df.iloc[0].to_dict(), "slide_id": "half", "split": "val"}])
    root = tmp_path / "cohort"
    (root / "tiles").mkdir(parents=True)
    for sid in df["slide_id"]:
        (root / "tiles" / f"{sid}.zarr").symlink_to(store_cohort.parent / "tiles" / f"{sid}.zarr")
    zarr.open_group(str(root / "tiles" / "half.zarr"), mode="w").attrs["complete"] = False  # an interrupted tiling
    pd.concat([df, extra]).to_csv(root / "manifest.csv", index=False)
    cfg = load_config(make_config(tmp_path, root / "manifest.csv", [{"name": "m", "strategy": "accumulate"}]))
    with pytest.raises(FileNotFoundError, match=r"2 slide\(s\) of the manifest have no complete tile store .*no store for 1: ghost.*"
                       r"partial store .* for 1: half.*wsi-pipeline tile"):
        train_pipeline(cfg, progress=False)
    _no_training(tmp_path)


def test_unknown_strategy(tmp_path, store_cohort):
    with pytest.raises(ValueError, match=r"methods.m.strategy='fancy'; expected one of \['frozen', 'full', 'accumulate', 'bigl', 'patchgd'\]"):
        load_config(make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "fancy"}]))
    _no_training(tmp_path)


def test_bad_options_fail_before_training(tmp_path, store_cohort):
    cfg = load_config(make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "accumulate", "encoder": {"bn": "train"}}]))
    with pytest.raises(ValueError, match=r"encoder.bn='train' is not supported by strategy 'accumulate'; use one of \['frozen', 'chunk'\]"):
        train_pipeline(cfg, progress=False)
    cfg = load_config(make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "full", "aggregator": {"name": "abmil", "options": {"depth": 3}}}]))
    with pytest.raises(TypeError, match=r"method 'm': cannot build its models: .*depth"):
        train_pipeline(cfg, progress=False)
    _no_training(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda(tmp_path, store_cohort):
    cfg = load_config(make_config(tmp_path, store_cohort, [{"name": "m", "strategy": "full"}], train={"device": "cuda"}))
    with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available on this machine; use device auto or cpu"):
        train_pipeline(cfg, progress=False)
    _no_training(tmp_path)


# ----------------------------------------------------------------------------------------------
# Bags and augmentation
# ----------------------------------------------------------------------------------------------


def test_epoch_plan_draws_every_slide_once_in_steps_of_b_times_s():
    n_tiles = [5, 40, 12, 300, 8, 9, 100]
    plan = epoch_plan(n_tiles, bag_size=10, bags_per_step=3, seed=4, epoch=2)
    assert [len(g) for g in plan] == [3, 3, 1]
    seen = [i for g in plan for i, _ in g]
    assert sorted(seen) == list(range(7))
    for g in plan:
        for i, idx in g:
            assert len(idx) == min(10, n_tiles[i]) and len(set(idx.tolist())) == len(idx)
            assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n_tiles[i]
    again = epoch_plan(n_tiles, bag_size=10, bags_per_step=3, seed=4, epoch=2)
    assert all(np.array_equal(a[1], b[1]) for ga, gb in zip(plan, again) for a, b in zip(ga, gb))
    other = epoch_plan(n_tiles, bag_size=10, bags_per_step=3, seed=4, epoch=3)
    assert [i for g in other for i, _ in g] != seen or any(
        not np.array_equal(a[1], b[1]) for ga, gb in zip(plan, other) for a, b in zip(ga, gb)
    )


def test_augmentation_is_one_transform_per_bag(float64):
    rng = np.random.default_rng(0)
    tiles = rng.integers(0, 256, (7, 16, 16, 3), dtype=np.uint8)
    aug = SlideAugment(AugmentConfig(enabled=True, blur_p=1.0, jitter_p=1.0))
    assert torch.equal(tiles_to_input(tiles, None), tiles_to_tensor(tiles))  # off = the plain conversion
    torch.manual_seed(1)
    params = aug.draw()
    whole = tiles_to_input(tiles, aug, params)
    assert whole.dtype == torch.float64
    # the same parameters on each tile alone and in chunks give the same result: one draw per bag.
    # Exact in exact arithmetic; in float64 a blur of <= 49 taps and a few colour operations on
    # values of magnitude <= 3 err by < 100 * 3 * 2**-53 ~ 3e-14, so 1e-12 bounds it.
    alone = torch.cat([tiles_to_input(tiles[i : i + 1], aug, params) for i in range(7)])
    torch.testing.assert_close(alone, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(tiles_to_input(tiles, aug, params, chunk=3), whole, rtol=0, atol=1e-12)
    # flips and right-angle rotations against numpy
    geo = AugmentParams(hflip=True, rot90=1)
    expected = np.ascontiguousarray(np.rot90(tiles[:, :, ::-1], 1, axes=(1, 2)))
    assert torch.equal(tiles_to_input(tiles, aug, geo), tiles_to_tensor(expected))
    # draws differ between bags, and every draw consumes the same random numbers whatever it decides
    torch.manual_seed(1)
    a, b = aug.draw(), aug.draw()
    assert a != b
    torch.manual_seed(2)
    SlideAugment(AugmentConfig(enabled=True, blur_p=0.0, jitter_p=0.0, flips=False, rotation=False)).draw()
    x = torch.rand(())
    torch.manual_seed(2)
    aug.draw()
    assert torch.rand(()) == x


# ----------------------------------------------------------------------------------------------
# Learning
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_accumulate_abmil_resnet18_learns_planted_lesions(tmp_path):
    from sklearn.metrics import roc_auc_score

    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.training.loop import _seed_everything
    from wsi_pipeline.methods.models import build_models

    manifest = make_store_cohort(tmp_path / "cohort", n_slides=24, tile_size=32, seed=1)
    method = {"name": "e2e", "strategy": "accumulate", "chunk_size": 8, "encoder": {"name": "resnet18", "bn": "frozen"},
              "aggregator": {"name": "abmil"}}
    cfg = load_config(make_config(tmp_path, manifest, [method], train={"epochs": 3, "bag_size": 16, "lr": 1e-4}))
    train_pipeline(cfg, progress=False)
    run = tmp_path / "runs" / "t" / "e2e" / "seed0"
    hist = pd.read_csv(run / "history.csv")
    best_auc = hist["val_auc"].max()
    assert best_auc >= 0.9, hist
    assert hist["train_loss"].iloc[-1] < hist["train_loss"].iloc[0]

    # the reported AUC is what the saved model computes (scikit-learn on its own predictions)
    tm = load_trained_model(run)
    df = read_manifest(manifest)
    val = df[df["split"] == "val"]
    probs = []
    with torch.no_grad():
        for sid in val["slide_id"]:
            x = tiles_to_tensor(open_store(manifest.parent / "tiles" / f"{sid}.zarr").read())
            probs.append(torch.softmax(tm.aggregator(tm.encoder(x)).logits, 0)[1].item())
    assert roc_auc_score(val["label"].astype(int), probs) == pytest.approx(best_auc, abs=1e-6)

    # end to end: the encoder itself learned
    _seed_everything(0)
    enc0, _ = build_models(cfg.methods[0], 2, for_training=False)
    init = enc0.state_dict()
    trained = tm.encoder.state_dict()
    num = sum(float((trained[k] - init[k]).pow(2).sum()) for k in init if init[k].is_floating_point() and "running" not in k)
    den = sum(float(init[k].pow(2).sum()) for k in init if init[k].is_floating_point() and "running" not in k)
    assert (num / den) ** 0.5 > 1e-3


def test_best_checkpoint_ties_are_broken_by_validation_loss():
    from wsi_pipeline.training.validation import improves

    best = {"value": 1.0, "loss": 0.69, "epoch": 1}
    assert improves(1.0, 0.05, best, higher=True)  # same AUC, much lower loss: a better model
    assert not improves(1.0, 0.70, best, higher=True)
    assert not improves(0.9, 0.01, best, higher=True)  # the selection metric comes first
    assert improves(0.95, 0.99, {"value": 0.9, "loss": 0.1}, higher=True)
    assert improves(0.2, None, {"value": 0.3, "loss": None}, higher=False)  # lower is better (loss as metric)
    assert not improves(float("nan"), 0.01, best, higher=True)


@pytest.mark.slow
def test_recalibrate_bn_reestimates_the_statistics_from_the_weights_of_each_epoch(tmp_path, store_cohort):
    """Two epochs with ``recalibrate_bn``: the statistics at the end equal a calibration of the
    weights after epoch 1 (taken from a one-epoch run of the same seed: epoch 1 is identical)."""
    from wsi_pipeline.training.calibration import calibrate_encoder
    from wsi_pipeline.training.preflight import preflight
    from wsi_pipeline.methods.models import build_models

    def method(recal: bool) -> dict:
        return {"name": "acc", "strategy": "accumulate", "chunk_size": 4,
                "encoder": {"bn": "frozen", "calibrate_bn": 32, "recalibrate_bn": recal}}

    runs = {}
    for name, epochs, recal in (("one", 1, True), ("two", 2, True), ("fixed", 2, False)):
        cfg = load_config(make_config(tmp_path, store_cohort, [method(recal)], name=name, train={"epochs": epochs, "lr": 1e-3}))
        train_pipeline(cfg, progress=False)
        runs[name] = (cfg, models_of(tmp_path / "runs" / name / "acc" / "seed0" / "last.pt")["encoder"])
    cfg, two = runs["two"]
    enc, _ = build_models(cfg.methods[0], 2, for_training=False)
    enc.load_state_dict(runs["one"][1])
    calibrate_encoder(enc, cfg.methods[0], preflight(cfg, cfg.methods, [0]).train, torch.device("cpu"))
    ref = enc.state_dict()
    stats = [k for k in ref if k.endswith(("running_mean", "running_var"))]
    assert stats
    for k in stats:
        torch.testing.assert_close(two[k], ref[k], rtol=1e-5, atol=1e-6)
    # without recalibration the statistics stay those of the first calibration: different
    fixed = runs["fixed"][1]
    assert max(float((fixed[k] - two[k]).abs().max()) for k in stats) > 1e-4
    with pytest.raises(ValueError, match="calibrate_bn > 0"):
        load_config(make_config(tmp_path, store_cohort, [{"name": "x", "strategy": "accumulate",
                                                           "encoder": {"recalibrate_bn": True}}], name="bad"))
