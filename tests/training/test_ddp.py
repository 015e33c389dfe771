"""Data-parallel training under torchrun (2 ranks, gloo, CPU) against one process over the same bags.

Every strategy is trained for one optimiser step over 4 bags (4 training slides; PatchGD: one
batch of 4 slides), in float64, once by ``python -m torch.distributed.run --nproc_per_node=2``
and once by a plain single process: the parameters, the BatchNorm running statistics and the
Adam moments (which hold the step's gradient: after one step ``exp_avg = (1 - beta1) (g + wd p)``,
so a wrong gradient scale shows there even though Adam's first update is almost sign(g)) must
agree to a relative difference <= 1e-10. The two computations differ only in the order in which
the bags' float64 gradients are summed (about 1e-16 relative), so 1e-10 leaves a wide margin
while a wrong normalisation (mean instead of sum over ranks: 0.5), a bag trained twice or missed,
or rank-local BatchNorm statistics would be off by far more.

A 2-rank run killed (SIGKILL on rank 0) after its first epoch is resumed by one process and must
end where an uninterrupted single process ends.

The worker runs the real CLI (``wsi-pipeline train``) with float64 as the default dtype and a
global forward pre-hook that casts float32 inputs (tiles, features) to float64.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from wsi_pipeline.training.monitor import MEASURED_COLUMNS
from wsi_pipeline.training.distributed import DistContext, shard, shard_plan

STRATEGIES = ("frozen", "full", "accumulate", "bigl", "patchgd")
REL_TOL = 1e-10

WORKER = textwrap.dedent(r"""
    import os, signal, sys
    import torch

    torch.set_default_dtype(torch.float64)

    def _to_double(module, args):
        return tuple(a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args)

    torch.nn.modules.module.register_module_forward_pre_hook(_to_double)

    kill = os.environ.get("DDP_TEST_KILL")  # "<method>:<epoch>": rank 0 dies right after that checkpoint
    if kill:
        import wsi_pipeline.training.loop as loop
        name, epoch = kill.split(":")
        save = loop.save_run_checkpoint

        def save_then_die(path, ckpt):
            out = save(path, ckpt)
            if path.name == "last.pt" and ckpt.method["name"] == name and ckpt.epoch == int(epoch):
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        loop.save_run_checkpoint = save_then_die

    from wsi_pipeline.cli.main import main

    sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
""")

METHODS = [
    {"name": "frozen", "strategy": "frozen", "chunk_size": 16},
    {"name": "full", "strategy": "full", "encoder": {"bn": "train"}},
    {"name": "accumulate", "strategy": "accumulate", "chunk_size": 3, "encoder": {"bn": "chunk"}},
    {"name": "bigl", "strategy": "bigl", "encoder": {"bn": "train"}, "chunk_size": 16,
     "bigl": {"stages": 1, "max_elements": 2**22}},
    # a head without batch statistics or dropout: PatchGD's batch is then exactly splittable
    {"name": "patchgd", "strategy": "patchgd", "chunk_size": 16,
     "patchgd": {"fraction": 0.5, "slides_per_batch": 4, "head_options": {"width": 8, "norm": "layer", "dropout": 0.0}}},
    # two epochs of two steps each, killed after the first epoch in the 2-rank run
    {"name": "resume", "strategy": "full", "encoder": {"bn": "train"}, "train": {"epochs": 2, "batch_bags": 2}},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    print(f"DDP-RUN wall {time.perf_counter() - t0:.1f} s, cpu {cpu:.1f} s: {' '.join(cmd[1:4])}")
    return out


def _config(tmp: Path, store_cohort: Path, runs: str) -> Path:
    df = pd.read_csv(store_cohort)
    train = ["synthetic_003", "synthetic_004", "synthetic_006", "synthetic_009"]  # labels 1, 0, 0, 1
    val = ["synthetic_000", "synthetic_005"]  # labels 0, 1
    df["split"] = np.where(df["slide_id"].isin(train), "train", np.where(df["slide_id"].isin(val), "val", "test"))
    manifest = tmp / "manifest.csv"
    df.to_csv(manifest, index=False)
    raw = {
        "name": "ddp",
        "data": {"manifest": str(manifest), "tiles_dir": str(store_cohort.parent / "tiles"),
                 "features_dir": str(tmp / "features"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 4, "lr": 1e-3},
        "seeds": [0],
        "runs_dir": str(tmp / runs),
        "methods": METHODS,
    }
    path = tmp / f"{runs}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, store_cohort):
    """(2-rank run folder, single-process run folder, the 2-rank run's stderr, the resume's result)."""
    tmp = tmp_path_factory.mktemp("ddp")
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    one = _config(tmp, store_cohort, "one")
    two = _config(tmp, store_cohort, "two")
    # the single process first: it extracts the frozen features both runs read
    ref = _run([sys.executable, str(worker), str(one)], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    port = _free_port()
    ddp = _run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={port}", str(worker), str(two)],
               timeout=300, DDP_TEST_KILL="resume:1")
    killed = tmp / "two" / "ddp" / "resume" / "seed0"
    assert ddp.returncode != 0, "rank 0 was to be killed after the first epoch of method 'resume'"
    assert (killed / "last.pt").is_file() and not (killed / "done").exists(), ddp.stderr[-3000:]
    assert torch.load(killed / "last.pt", weights_only=True)["epoch"] == 1
    resumed = _run([sys.executable, str(worker), str(two)], timeout=300)
    return tmp / "two" / "ddp", tmp / "one" / "ddp", ddp.stderr, resumed


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].double().reshape(-1) for k in sorted(tensors)]) if tensors else torch.zeros(0)


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    fa, fb = _flat(a), _flat(b)
    return float((fa - fb).norm() / fb.norm()) if fb.norm() > 0 else float((fa - fb).norm())


def _states(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters and buffers of each model, and the Adam moments (flattened over parameters)."""
    last = torch.load(run / "last.pt", weights_only=True)
    out = {}
    for name, sd in last["models"].items():
        if sd is None:
            continue
        out[f"{name}.float"] = {k: v for k, v in sd.items() if v.is_floating_point()}
        counts = {k: v for k, v in sd.items() if not v.is_floating_point()}
        if counts:
            out[f"{name}.counts"] = counts
    opt = last["optimizer"]["state"]
    out["exp_avg"] = {str(k): v["exp_avg"] for k, v in opt.items()}
    out["exp_avg_sq"] = {str(k): v["exp_avg_sq"] for k, v in opt.items()}
    return out


def _report(name: str, a: Path, b: Path) -> dict[str, float]:
    sa, sb = _states(a), _states(b)
    assert sorted(sa) == sorted(sb)
    rel = {}
    for key in sa:
        if key.endswith(".counts"):
            for k in sa[key]:
                assert torch.equal(sa[key][k], sb[key][k]), f"{name}: {key}.{k}"
        else:
            rel[key] = _rel(sa[key], sb[key])
    print(f"DDP-EQUIV {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(rel.items())))
    return rel


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_take_the_step_of_one_process(ddp_runs, strategy):
    two, one, _, _ = ddp_runs
    a, b = two / strategy / "seed0", one / strategy / "seed0"
    assert (a / "done").is_file() and (b / "done").is_file()
    rel = _report(strategy, a, b)
    assert all(v <= REL_TOL for v in rel.values()), rel
    # one step was taken (Adam's moments are set), in float64
    st = torch.load(a / "last.pt", weights_only=True)
    assert st["epoch"] == 1
    assert any(float(v["exp_avg"].abs().max()) > 0 for v in st["optimizer"]["state"].values())
    assert all(v.dtype == torch.float64 for sd in st["models"].values() if sd for v in sd.values() if v.is_floating_point())
    # the history (written by rank 0 only) holds the same losses and validation metrics
    ha, hb = pd.read_csv(a / "history.csv"), pd.read_csv(b / "history.csv")
    assert len(ha) == 1
    cols = [c for c in ha.columns if c not in MEASURED_COLUMNS]
    np.testing.assert_allclose(ha[cols].to_numpy(float), hb[cols].to_numpy(float), rtol=REL_TOL, atol=0)


@pytest.mark.slow
def test_only_rank_zero_logs(ddp_runs):
    _, _, stderr, _ = ddp_runs
    for name in STRATEGIES:
        assert stderr.count(f"{name} seed 0 epoch 1/1") == 1, stderr[-3000:]


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_exactly_with_one_rank(ddp_runs):
    two, one, _, resumed = ddp_runs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    a, b = two / "resume" / "seed0", one / "resume" / "seed0"
    assert json.loads((a / "done").read_text())["epochs"] == 2
    rel = _report("resume (2 ranks, killed after epoch 1, resumed with 1)", a, b)
    assert all(v <= REL_TOL for v in rel.values()), rel
    ha, hb = pd.read_csv(a / "history.csv"), pd.read_csv(b / "history.csv")
    assert ha["epoch"].tolist() == [1, 2]
    cols = [c for c in ha.columns if c not in MEASURED_COLUMNS]
    np.testing.assert_allclose(ha[cols].to_numpy(float), hb[cols].to_numpy(float), rtol=REL_TOL, atol=0)


# ----------------------------------------------------------------------------------------------
# The split itself (no processes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_plan_gives_every_bag_to_exactly_one_rank(world):
    plan = [[("a", 0), ("b", 1), ("c", 2), ("d", 3)], [("e", 4)], [("f", 5), ("g", 6)]]
    flat = [item for group in plan for item in group]
    seen: dict[int, object] = {}
    for rank in range(world):
        ctx = DistContext(rank=rank, world_size=world)
        local, numbers = shard_plan(plan, ctx)
        assert len(local) == len(plan) and [len(n) for n in numbers] == [len(g) for g in local]
        for g, (items, nums) in enumerate(zip(local, numbers)):
            for item, b in zip(items, nums):
                assert b not in seen and flat[b] == item and item in plan[g]
                seen[b] = item
        assert shard(5, ctx) == list(range(rank, 5, world))
    assert sorted(seen) == list(range(len(flat)))


class _TinyEncoder(torch.nn.Module):
    """Conv -> frozen-mode BatchNorm -> ReLU -> mean pool: [k, 3, T, T] -> [k, 6]."""

    num_features = 6

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=4)
        self.bn = torch.nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x.double()))).mean((2, 3))


def test_patchgd_batch_parts_add_up_to_the_whole_batch(store_cohort):
    """PatchGD's ``part``: the parts' gradients (each slide's loss over the whole batch's size, Z
    padded to the whole batch's shape) sum to the whole batch's gradient, float64. The slides' grids
    differ in shape, so a part padded only to its own slides' shape would differ (the CNN head's
    stride-2 mask is not invariant to bottom/right padding)."""
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.training.patchgd import PatchGDTrainer

    tiles = store_cohort.parent / "tiles"
    stores = [open_store(tiles / f"synthetic_{i:03d}.zarr") for i in (3, 4, 6, 9)]
    assert len({s.grid.max(0).tobytes() for s in stores}) > 1  # Z shapes differ: padding matters
    labels = [1, 0, 0, 1]
    torch.manual_seed(0)
    enc = _TinyEncoder().double()
    strat = PatchGDTrainer({"fraction": 0.5, "slides_per_batch": 4, "head_options": {"width": 8, "norm": "layer", "dropout": 0.0}},
                            enc, None, 2)
    strat.head.double()
    params = list(enc.parameters()) + list(strat.head.parameters())

    def grads(split):
        for p in params:
            p.grad = None
        steps, total = [0], 0.0
        for part in split:
            total += strat.batch_step(stores, labels, lambda: steps.__setitem__(0, steps[0] + 1),
                                      torch.Generator().manual_seed(5), part=part)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]), total, steps[0]

    whole, loss, steps = grads([None])
    for parts in ([[0, 2], [1, 3]], [[0], [1], [2], [3]], [[2], [3, 1, 0], []]):
        split, split_loss, split_steps = grads(parts)
        # float64: the parts differ from the whole batch only in summation order (~1e-16 relative)
        assert float((split - whole).norm() / whole.norm()) <= REL_TOL, parts
        assert split_loss == pytest.approx(loss, rel=REL_TOL)
        assert split_steps == steps * len(parts)  # every part calls optimizer_step after every window
