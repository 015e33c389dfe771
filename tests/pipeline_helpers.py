"""Helpers the training tests share: a tiny pipeline YAML over a generated store cohort.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

#: Two epochs of 8-tile bags, 2 bags per step: enough to train and resume, fast on a CPU.
TINY_TRAIN = {"epochs": 2, "bag_size": 8, "batch_bags": 2, "lr": 1e-4}


def make_config(tmp_path: Path, manifest: Path, methods: list[dict], *, name: str = "t", train: dict | None = None,
                runs: str = "runs", **extra) -> Path:
    """A pipeline YAML over a store cohort, every path absolute."""
    root = manifest.parent
    raw = {
        "name": name,
        "data": {"manifest": str(manifest), "tiles_dir": str(root / "tiles"), "features_dir": str(tmp_path / "features"),
                 "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {**TINY_TRAIN, **(train or {})},
        "seeds": [0],
        "runs_dir": str(tmp_path / runs),
        "methods": methods,
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def published_copy(folder: Path, arch: str, seed: int = 3) -> tuple[Path, dict]:
    """A torchvision-layout checkpoint of ``arch`` named as torchvision names its files (``<arch>-<sha256 prefix>.pth``)."""
    import hashlib

    import torch
    import torchvision

    torch.manual_seed(seed)
    state = getattr(torchvision.models, arch)().state_dict()
    tmp = folder / "tmp.pth"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    path = folder / f"{arch}-{digest[:8]}.pth"
    tmp.rename(path)
    return path, state


def replace_best(shared: Path, tmp_path: Path, change: Any) -> Path:
    """A copy of ``shared``'s finished run ``runs/t/m/seed0`` under ``tmp_path`` whose ``best.pt`` is rewritten
    by ``change(checkpoint) -> checkpoint`` (atomically, with its integrity files)."""
    import shutil

    from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint

    run = tmp_path / "runs" / "t" / "m" / "seed0"
    shutil.copytree(shared / "runs" / "t" / "m" / "seed0", run)
    ckpt = load_run_checkpoint(run / "best.pt")
    for p in run.glob("best.pt*"):
        p.unlink()
    save_run_checkpoint(run / "best.pt", change(ckpt))
    return run
