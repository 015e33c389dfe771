"""The evaluation's scoring pass as one Dask task per slide gives the same results as in process."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from wsi_pipeline.config.pipeline import config_from_dict, config_to_dict
from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
from wsi_pipeline.checkpoints.files import save_run_checkpoint
from wsi_pipeline.checkpoints.run import RunCheckpoint
from wsi_pipeline.methods.models import build_models
from wsi_pipeline.manifests.schema import read_manifest, write_manifest

pytestmark = pytest.mark.slow


def _cohort_and_runs(tmp):
    from wsi_pipeline.synthetic.stores import make_store_cohort

    internal = read_manifest(make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(10, 16), seed=0))
    external = read_manifest(make_store_cohort(tmp / "data", n_slides=3, tiles_per_slide=(10, 16), cohort="ext",
                                              splits={"test": 1.0}, seed=1))
    manifest = write_manifest(pd.concat([internal, external]), tmp / "data" / "all.csv")
    cfg = config_from_dict({
        "name": "t", "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "n_classes": 2},
        "eval": {"protocols": ["all", "sub4x3", "ens4x3"], "seed": 0}, "seeds": [0, 1],
        "methods": [{"name": "m", "strategy": "full", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"},
                     "chunk_size": 16}],
        "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results"),
    })
    for seed in (0, 1):
        torch.manual_seed(seed)
        enc, agg = build_models(cfg.methods[0], 2, for_training=False)
        d = cfg.run_dir("m", seed)
        save_run_checkpoint(d / "best.pt", RunCheckpoint.build(
            cfg, cfg.methods[0], seed=seed, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()}))
        (d / "done").touch()
    (tmp / "data" / "tiles" / "synthetic_006.zarr" / "zarr.json").unlink()  # one store broken: skipped on both paths
    return cfg


def test_eval_on_a_dask_cluster_equals_the_local_pass(tmp_path, one_thread):
    cfg = _cohort_and_runs(tmp_path)
    local = evaluate_pipeline(cfg, device="cpu", n_boot=0, progress=False, results_dir=tmp_path / "local")
    dask = evaluate_pipeline(cfg, device="cpu", n_boot=0, progress=False, results_dir=tmp_path / "dask", cluster="local:1")
    assert local.missing_stores == dask.missing_stores == ["synthetic_006"]
    assert local.models == dask.models == [("m", 0), ("m", 1)]
    for name in ("metrics.json", "predictions_synthetic_all.csv", "predictions_synthetic_sub4x3.csv",
                 "predictions_ext_ens4x3.csv"):
        a, b = (tmp_path / "local" / name).read_bytes(), (tmp_path / "dask" / name).read_bytes()
        assert a == b, name
    assert json.loads((tmp_path / "dask" / "metrics.json").read_text())["records"]
    heat_local = sorted(p.name for p in (tmp_path / "local" / "heatmaps").iterdir())
    heat_dask = sorted(p.name for p in (tmp_path / "dask" / "heatmaps").iterdir())
    assert heat_local == heat_dask and heat_local


def test_eval_under_torchrun_shards_the_slides_and_equals_one_process(tmp_path, free_port):
    """2 ranks (gloo, CPU) each score half the slides; rank 0 writes what one process writes."""
    import os
    import subprocess
    import sys

    import yaml

    cfg = _cohort_and_runs(tmp_path)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's per-rank default; the same for the single process
    env.pop("WORLD_SIZE", None)
    common = ["-m", "wsi_pipeline.cli.main", "eval", "--config", str(path), "--device", "cpu", "--bootstrap", "0",
              "--no-progress"]
    one = subprocess.run([sys.executable, *common, "--results", str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port}", *common,
                          "--results", str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("Evaluated 2 model(s)") == 1  # rank 0 alone reports
    for name in ("metrics.json", "predictions_synthetic_all.csv", "predictions_synthetic_sub4x3.csv",
                 "predictions_ext_ens4x3.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "two" / "heatmaps").iterdir()) == \
        sorted(p.name for p in (tmp_path / "one" / "heatmaps").iterdir())
