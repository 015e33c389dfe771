"""Memory known before it is needed: the predicted peak against the measured one, and the refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_helpers import make_config
from wsi_pipeline.cli.main import main


@pytest.fixture(scope="module")
def cohort_128(tmp_path_factory) -> Path:
    """6 slides of 130-160 tiles of 128 px: bags whose activations dominate the process's memory."""
    from wsi_pipeline.synthetic.stores import make_store_cohort

    return make_store_cohort(tmp_path_factory.mktemp("mem") / "data", n_slides=6, tile_size=128,
                             tiles_per_slide=(130, 160), seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("bag", [32, 64, 128])
def test_the_predicted_peak_is_within_15_percent_of_the_measured_one(bag, cohort_128, tmp_path):
    """Big-Layers on the CPU keeps the whole bag's activations: its peak grows with the bag (1.4 to 2.2 GiB
    here). Each run is its own process, so its measured peak (ru_maxrss) is the run's alone."""
    method = {"name": "m", "strategy": "bigl", "encoder": {"bn": "train"}, "bigl": {"stages": 1, "max_elements": 2**22}}
    cfg = make_config(tmp_path, cohort_128, [method], train={"epochs": 1, "bag_size": bag, "batch_bags": 1})
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["tiling"]["tile_size"] = 128
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-m", "wsi_pipeline.cli.main", "train", "--config", str(cfg), "--quiet",
                        "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "t" / "m" / "seed0" / "memory.json").read_text())
    predicted, measured = record["predicted"]["host_bytes"], record["measured"]["host_peak_bytes"]
    assert record["predicted"]["bag_tiles"] == bag
    assert abs(measured / predicted - 1) <= 0.15, record


def test_a_bag_that_does_not_fit_is_refused_before_training(store_cohort, tmp_path, monkeypatch, capsys):
    import wsi_pipeline.training.memory as memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 64 * 2**20)  # 64 MiB free beside the process
    method = {"name": "m", "strategy": "full", "encoder": {"bn": "frozen"}}
    cfg = make_config(tmp_path, store_cohort, [method], train={"epochs": 1, "bag_size": 1000})
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "predicted peak host memory" in err and "available" in err and "train.bag_size" in err and "--no-memory-check" in err
    assert not (tmp_path / "runs" / "t" / "m" / "seed0" / "last.pt").exists()  # nothing trained
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 64 * 2**30)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0


def test_the_prediction_adds_up_its_parts(store_cohort):
    """The parts are the counts the Big-Layers planner uses: recomputed here from unit_memory."""
    import torch

    from wsi_pipeline.bigl.budget import unit_memory
    from wsi_pipeline.config.pipeline import MethodConfig
    from wsi_pipeline.models import build_aggregator, build_encoder
    from wsi_pipeline.training.memory import predict_memory

    enc, agg = build_encoder("resnet18"), build_aggregator("abmil", 512, 2)
    method = MethodConfig(name="m", strategy="accumulate", chunk_size=8)  # type: ignore[arg-type]
    pred = predict_memory(method, enc, agg, bag_tiles=100, tile_size=64, val_tiles=50, device=torch.device("cpu"),
                          augment=False, baseline=10**9)
    mem = unit_memory(enc, (8, 3, 64, 64), torch.float32, grad=True)
    assert pred.parts["activations"] == sum(m.saved for m in mem) + 2 * max(m.largest for m in mem)
    params = sum(p.numel() * 4 for p in [*enc.parameters(), *agg.parameters()])
    assert pred.parts["state"] == 4 * params
    u8 = 100 * 64 * 64 * 3
    assert pred.parts["bags"] == 2 * u8 + 3 * 4 * u8
    step = pred.parts["bags"] + pred.parts["activations"] + 3 * 100 * 512 * 4
    assert pred.host_bytes == 10**9 + pred.parts["state"] + max(step, pred.parts["validation"])


def test_the_measured_peak_is_the_run_s_own_when_a_large_process_starts_it():
    """Linux keeps ru_maxrss across exec: a run started by a process holding 1 GiB would report it.
    measured_peak reads the program's own high-water mark (VmHWM) instead."""
    import numpy as np

    if not Path("/proc/self/status").is_file():
        pytest.skip("no /proc: measured_peak falls back to ru_maxrss there")
    held = np.ones(2**27)  # 1 GiB, every page touched
    code = ("import resource; from wsi_pipeline.training.memory import measured_peak; "
            "print(measured_peak(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    own, inherited = int(out[0]), int(out[1])
    assert held.sum() == 2**27
    assert inherited > 2**30  # the parent's peak (over 1 GiB: it holds one), carried across exec
    assert own < 2**30, own  # the child's own: an interpreter with torch imported (about 0.5 GiB here)
