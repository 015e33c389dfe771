"""``make bench-feature-scale``: training and cross-validation cost on many large precomputed feature files.

A lab that already holds TRIDENT features asks how long a cross-validation of an attention MIL model
takes here and how much memory it needs. This bench writes ``--slides`` generated TRIDENT-layout files
(``features_<encoder>/<slide>.h5``: ``features`` float32 [``--tiles``, ``--dim``], ``coords`` with
TRIDENT's attributes), in which the positive slides carry a weak shift in a few tiles, then runs, as
shell commands in ``--work`` (subprocesses): ``manifest folder --features --crossval K``, and
``train`` of fold 0 for ``--epochs`` epochs (``abmil`` on ``encoder: {name: precomputed}``). It
records each command's wall time and the peak resident memory of its process, the time of one
epoch (``history.csv``'s ``seconds``), and the estimate of a K-fold cross-validation (K x the fold's
training time). Writes ``<work>/bench_feature_scale.json`` and prints a table.

    python -m benchmarks.feature_scale --work /tmp/fs --slides 1000 --tiles 10000 --dim 1024   # ~41 GB of files
    python -m benchmarks.feature_scale --work /tmp/fs --slides 40 --tiles 500 --dim 64         # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "write_feature_files"]

ENCODER = "bench"
TILE_LEVEL0 = 512  # px: 256 px tiles at 20x of a 40x scan


def write_feature_files(out: Path, n_slides: int, n_tiles: int, dim: int, seed: int = 0) -> tuple[Path, Path]:
    """Write ``n_slides`` TRIDENT-layout files under ``out/features_bench/`` and ``out/labels.csv``; return both.

    Slide i is positive when i is odd; its first 5 % of tiles have feature 0 shifted by +1 (a weak
    instance signal, so training has something to find). Files already complete are kept (a rerun
    resumes).
    """
    import h5py

    from wsi_pipeline.io_atomic import atomic_path

    folder = out / f"features_{ENCODER}"
    folder.mkdir(parents=True, exist_ok=True)
    side = int(np.ceil(np.sqrt(n_tiles)))
    grid = np.stack(np.meshgrid(np.arange(side), np.arange(side)), -1).reshape(-1, 2)[:n_tiles]
    coords = (grid * TILE_LEVEL0).astype(np.int64)
    labels = []
    for i in range(n_slides):
        sid, label = f"s{i:05d}", i % 2
        labels.append(f"{sid},{label}")
        path = folder / f"{sid}.h5"
        if path.is_file():
            continue
        rng = np.random.default_rng(seed + i)
        feats = rng.standard_normal((n_tiles, dim), dtype=np.float32)
        if label:
            feats[: max(1, n_tiles // 20), 0] += 1.0
        with atomic_path(path) as tmp:
            with h5py.File(tmp, "w") as f:
                f.create_dataset("features", data=feats)
                c = f.create_dataset("coords", data=coords)
                c.attrs.update({"patch_size": 256, "patch_size_level0": TILE_LEVEL0, "level0_magnification": 40,
                                "target_magnification": 20, "overlap": 0, "level0_width": side * TILE_LEVEL0,
                                "level0_height": side * TILE_LEVEL0})
    labels_csv = out / "labels.csv"
    labels_csv.write_text("slide_id,label\n" + "\n".join(labels) + "\n")
    return folder, labels_csv


def _run(cmd: list[str], cwd: Path) -> dict[str, Any]:
    """Run ``cmd``; its wall seconds and the peak resident memory (GiB) of the largest child so far."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    return {"command": " ".join(cmd[2:5]), "wall_s": round(wall, 1), "peak_rss_gib_so_far": round(peak, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="work folder (files, manifest, runs)")
    p.add_argument("--slides", type=int, default=1000, help="feature files (default 1000)")
    p.add_argument("--tiles", type=int, default=10000, help="tiles per slide N (default 10000)")
    p.add_argument("--dim", type=int, default=1024, help="feature width D (default 1024)")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds K (default 5)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of the fold trained (default 1)")
    args = p.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder, labels = write_feature_files(work, args.slides, args.tiles, args.dim)
    gen_s = time.perf_counter() - t0
    cli = [sys.executable, "-m", "wsi_pipeline"]
    steps = [_run([*cli, "manifest", "folder", "--features", str(folder), "--labels", str(labels), "--crossval",
                   str(args.folds), "--out", str(work / "cohort.csv")], work)]
    import pandas as pd

    fold0 = pd.read_csv(work / "cohort_fold0.csv")  # fold 0 alone: its split without the fold column
    fold0.drop(columns=[c for c in fold0.columns if c.startswith("cv_fold")]).to_csv(work / "fold0.csv", index=False)
    config = work / "features.yaml"
    config.write_text(
        f"name: fs\ndata: {{manifest: {work / 'fold0.csv'}, features: {{dir: {folder}, format: trident}}, n_classes: 2}}\n"
        f"runs_dir: {work / 'runs'}\nresults_dir: {work / 'results'}\n"
        f"train: {{epochs: {args.epochs}, lr: 2.0e-4, bag_size: all, batch_bags: 1}}\neval: {{protocols: [all], val_protocol: all}}\n"
        "seeds: [0]\nmethods:\n  - {name: abmil, strategy: frozen, encoder: {name: precomputed}, aggregator: {name: abmil}}\n")
    steps.append(_run([*cli, "train", "--config", str(config), "--no-progress"], work))
    hist = (work / "runs" / "fs" / "abmil" / "seed0" / "history.csv").read_text().splitlines()
    header, rows = hist[0].split(","), [r.split(",") for r in hist[1:]]
    epoch_s = [float(r[header.index("seconds")]) for r in rows]
    fold_s = steps[-1]["wall_s"]
    size_gib = sum(f.stat().st_size for f in folder.glob("*.h5")) / 2**30
    result = {
        "slides": args.slides, "tiles": args.tiles, "dim": args.dim, "files_gib": round(size_gib, 1),
        "generate_s": round(gen_s, 1), "steps": steps, "epoch_s": epoch_s,
        "fold_train_s": fold_s, "estimated_cv_train_s": round(args.folds * fold_s, 1),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(),
    }
    (work / "bench_feature_scale.json").write_text(json.dumps(result, indent=1))
    print(f"{args.slides} files of {args.tiles} x {args.dim} float32 ({size_gib:.1f} GiB), written in {gen_s:.0f} s")
    for s in steps:
        print(f"  {s['command']:<22} {s['wall_s']:>8.1f} s   peak RSS so far {s['peak_rss_gib_so_far']:.2f} GiB")
    print(f"  epochs of fold 0: {', '.join(f'{e:.1f}' for e in epoch_s)} s; "
          f"a {args.folds}-fold cross-validation of {args.epochs} epoch(s): ~{args.folds * fold_s:.0f} s of training")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
