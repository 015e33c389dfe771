"""Scaling out the tiling: `--shard K/N` subsets, Dask clusters (a LocalCluster of worker processes,
a worker killed mid-slide) and the SLURM job script dask-jobqueue would submit (no submission)."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.cli.main import build_parser, main
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.partition import parse_shard, shard_indices
from wsi_pipeline.tiling.sources import jobs_from_folder
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.config.tiling import TilingConfig

#: report columns that measure this run rather than describe its result
TIMING_COLUMNS = ("seconds", "cpu_seconds")
#: store attributes that record when the store was written and how long it took (CPU seconds per thread)
TIME_ATTRS = ("created", "timing")
#: 128 px tiles: a few hundred tiles over the small cohort below
CFG = TilingConfig(method="greyscale", qc_mode="off", tile_size=128)


def _report_rows(out: Path) -> dict[str, dict]:
    df = pd.read_csv(out / "tiling_report.csv", dtype=str, keep_default_na=False)
    assert df["slide_id"].is_unique
    return {row["slide_id"]: {k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in df.to_dict("records")}


def _drop_times(meta: dict) -> dict:
    meta = dict(meta)
    if "attributes" in meta:
        meta["attributes"] = {k: v for k, v in meta["attributes"].items() if k not in TIME_ATTRS}
    return meta


def assert_same_outputs(a: Path, b: Path) -> None:
    """Every file of two tiles folders byte-for-byte equal, except the write time in each store's
    zarr.json (compared as JSON without it) and the report's timing columns; the locks are left out."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".locks" not in p.parts}

    fa, fb = files(a), files(b)
    assert fa == fb
    assert any(f.endswith(".zarr/zarr.json") for f in fa)
    for rel in sorted(fa):
        if rel == "tiling_report.csv":
            continue
        da, db = (a / rel).read_bytes(), (b / rel).read_bytes()
        if rel.endswith("zarr.json"):
            assert _drop_times(json.loads(da)) == _drop_times(json.loads(db)), rel
        else:
            assert da == db, rel
    assert _report_rows(a) == _report_rows(b)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cohort")
    for i, (size, frac) in enumerate([(512, 0.5), (768, 0.4), (512, 0.6), (640, 0.5), (512, 0.3)]):
        make_slide(folder / f"s{i}.svs", size=size, seed=70 + i, tissue_fraction=frac)
    make_slide(folder / "blank.svs", size=384, seed=79, blank=True)
    return folder


@pytest.fixture(scope="module")
def reference(cohort: Path, tmp_path_factory) -> Path:
    """The local runner's output (one worker process)."""
    out = tmp_path_factory.mktemp("ref") / "tiles"
    rep = tile_cohort(cohort, out, CFG, workers=1, progress=False)
    assert rep.ok and rep.count("ok") == 6 and rep.n_tiles > 0
    return out


# --------------------------------------------------------------------------------- --shard K/N


def test_parse_shard_accepts_k_of_n_and_names_bad_values() -> None:
    assert parse_shard("3/8") == (3, 8)
    assert parse_shard(" 1/1 ") == (1, 1)
    for bad in ("0/2", "3/2", "a/2", "2", "1/2/3", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_shards_are_disjoint_cover_balanced_and_independent_of_order() -> None:
    rng = np.random.default_rng(0)
    keys = [(f"slide{i:03d}", f"/d/slide{i:03d}.svs") for i in rng.permutation(23)]
    for n in (1, 2, 3, 7, 23, 30):
        parts = [shard_indices(keys, k, n) for k in range(1, n + 1)]
        flat = [i for p in parts for i in p]
        assert sorted(flat) == list(range(len(keys)))  # disjoint and covering
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        # the same slides land in the same shard however the list is ordered (e.g. manifest rows)
        perm = rng.permutation(len(keys))
        shuffled = [keys[i] for i in perm]
        for k in range(1, n + 1):
            assert {keys[i] for i in parts[k - 1]} == {shuffled[i] for i in shard_indices(shuffled, k, n)}


@pytest.mark.slow
def test_shard_1_of_2_plus_2_of_2_equals_one_full_run(cohort: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    base = ["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(out), "--workers", "1", "--no-progress", "--tile-size", "128"]
    assert main(base + ["--shard", "1/2"]) == 0
    first = set(_report_rows(out))
    assert main(base + ["--shard", "2/2"]) == 0
    both = set(_report_rows(out))
    ids = {j.slide_id for j in jobs_from_folder(cohort)}
    assert both == ids and first and first != ids  # each shard tiled a part; the report merged both
    assert {p.name for p in out.glob("*.zarr")} >= {f"{i}.zarr" for i in first}
    assert_same_outputs(out, reference)


def test_bad_shard_and_cluster_flags_exit_2(cohort: Path, tmp_path: Path, capsys) -> None:
    base = ["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(tmp_path / "t"), "--no-progress"]
    assert main(base + ["--shard", "3/2"]) == 2
    assert "--shard '3/2'" in capsys.readouterr().err
    assert main(base + ["--cluster", "yarn"]) == 2
    assert "--cluster 'yarn'" in capsys.readouterr().err
    assert main(base + ["--slurm-queue", "gpu"]) == 2
    assert "need --cluster slurm" in capsys.readouterr().err
    assert main(base + ["--cluster", "local:2", "--slurm-cores", "4"]) == 2
    assert main(base + ["--cluster", "slurm", "--cluster-option", "no equals sign"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    # predict tiles on the cluster too; its flags are checked before the model is loaded
    assert main(["predict", "--model", str(tmp_path / "none.pt"), "--slides", str(cohort), "--out", str(tmp_path / "p"),
                 "--cluster", "local:0"]) == 2
    assert "count must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------- Dask clusters


@pytest.mark.slow
def test_dask_local_cluster_of_2_workers_equals_local_runner(cohort: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    assert main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(out), "--no-progress", "--tile-size", "128", "--cluster", "local:2"]) == 0
    assert_same_outputs(out, reference)
    # a second run on the cluster finds every store current
    rep = tile_cohort(cohort, out, CFG, progress=False, cluster="local:1")
    assert {r.status for r in rep.results} == {"skipped"}


@pytest.mark.slow
def test_worker_killed_mid_slide_is_retried_and_correct(tmp_path: Path) -> None:
    from distributed import Client

    from wsi_pipeline.jobs.cluster import ClusterSpec, dask_client

    folder = tmp_path / "slides"
    make_slide(folder / "a_small.svs", size=512, seed=31, tissue_fraction=0.5)
    make_slide(folder / "b_big.svs", size=1024, seed=32, tissue_fraction=0.6)
    # 32 px tiles in shards of 32: ~600 kept tiles on b_big, written over many shard files, so it is easy
    # to catch mid-slide
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=32, shard_tiles=32)
    ref = tmp_path / "ref"
    assert tile_cohort(folder, ref, cfg, workers=0, progress=False).ok

    out = tmp_path / "tiles"
    with dask_client(ClusterSpec("local", workers=2), retries=2) as client:
        assert isinstance(client, Client)
        worker_pids = set(client.run(os.getpid).values())
        box: dict = {}
        runner = threading.Thread(target=lambda: box.update(rep=tile_cohort(folder, out, cfg, progress=False, cluster=client)))
        runner.start()
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and time.monotonic() < deadline and runner.is_alive():
            temps = list(out.glob(".b_big.zarr.tmp-*")) if out.exists() else []
            shards = [p for p in (temps[0] / "tiles").rglob("*") if p.is_file() and p.name != "zarr.json"] if temps else []
            if len(shards) >= 3:  # mid-slide: tile shards are being written
                killed = int(temps[0].name.rsplit("-", 1)[1])
                assert killed in worker_pids
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.005)
        runner.join(timeout=180)
        assert killed is not None, "never caught b_big mid-slide"
        rep = box["rep"]
    assert rep.ok, rep.summary()
    assert {r.slide_id: r.status for r in rep.results} == {"a_small": "ok", "b_big": "ok"}
    assert not list(out.glob(".b_big.zarr.tmp-*"))  # the killed attempt's temporary store is gone
    assert_same_outputs(out, ref)


# ------------------------------------------------------------------------------------ SLURM path


def test_slurm_job_script_has_the_requested_resources() -> None:
    from dask_jobqueue import SLURMCluster

    from wsi_pipeline.cli._cluster import cluster_from_args
    from wsi_pipeline.jobs.cluster import slurm_cluster_kwargs

    args = build_parser().parse_args([
        "tile", "--slides", "x", "--out", "y", "--cluster", "slurm:3", "--slurm-queue", "gpu", "--slurm-account", "lab",
        "--slurm-cores", "8", "--slurm-memory", "32GB", "--slurm-walltime", "02:00:00", "--slurm-gpus", "2",
        "--cluster-option", 'job_extra_directives=["--constraint=a100"]', "--cluster-option", "local_directory=/scratch/dask",
    ])
    spec = cluster_from_args(args)
    assert spec.kind == "slurm" and spec.slurm.jobs == 3
    with SLURMCluster(**slurm_cluster_kwargs(spec.slurm)) as cluster:
        script = cluster.job_script()
    lines = script.splitlines()
    sbatch = {ln for ln in lines if ln.startswith("#SBATCH")}
    assert {"#SBATCH -p gpu", "#SBATCH -A lab", "#SBATCH --cpus-per-task=8", "#SBATCH -t 02:00:00",
            "#SBATCH --gres=gpu:2", "#SBATCH --constraint=a100"} <= sbatch
    # dask-jobqueue asks SLURM for whole GiB, rounding the requested bytes up
    assert f"#SBATCH --mem={math.ceil(32e9 / 2**30)}G" in sbatch
    worker = next(ln for ln in lines if "dask_worker" in ln)
    # one single-threaded worker process per core, as the local pool runs them
    assert "--nworkers 8" in worker and "--nthreads 1" in worker and "--local-directory /scratch/dask" in worker


# ------------------------------------------------------------------------------ examples/slurm


@pytest.mark.slow
def test_tile_array_sbatch_tasks_together_equal_one_run(cohort: Path, reference: Path, tmp_path: Path) -> None:
    """examples/slurm/tile_array.sbatch run by bash with the variables SLURM sets for array tasks 1 and 2 of 2."""
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    exe = shutil.which("wsi-pipeline", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the wsi-pipeline console script is not installed beside this python")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{Path(exe).parent}:$PATH"\n')
    out = tmp_path / "tiles"
    for k in (1, 2):
        env = {**os.environ, "PYTHONPATH": str(repo), "VENV": str(venv), "SLURM_ARRAY_TASK_ID": str(k),
               "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_CPUS_PER_TASK": "1"}
        proc = subprocess.run(["bash", str(repo / "examples/slurm/tile_array.sbatch"), str(cohort), str(out), "--tile-size", "128",
                                   "--method", "greyscale", "--qc", "off"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "3 slides" in proc.stdout  # 6 slides, 2 shards
    assert_same_outputs(out, reference)
