"""A run folder ``<runs_dir>/<pipeline>/<method>/seed<k>/``: its config, resuming it, its history and ``done`` marker.

Checkpoints themselves are written by the loop (:func:`wsi_pipeline.checkpoints.files.save_run_checkpoint`).
One process trains a run folder at a time: :func:`run_lock` holds ``training.lock`` in it (the
tiler's lock files: a lock whose process is gone is taken over), and the holder removes the
temporary files a killed run left (:func:`clean_temporary_files`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from wsi_pipeline.config.compare import config_differences
from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig, config_to_dict, upgrade_saved_config
from wsi_pipeline.checkpoints.files import load_run_checkpoint, restore_rng
from wsi_pipeline.io_atomic import atomic_path, write_text_atomic

__all__ = [
    "DONE", "LOCK_NAME", "changed_since_finished", "check_resumable", "clean_temporary_files", "resume", "run_config",
    "run_holder", "run_lock", "write_done", "write_history",
]

log = logging.getLogger(__name__)

#: The marker of a finished run (a JSON summary, written last); a run with it is skipped.
DONE = "done"

#: The lock held in a run folder by the process training it (``training.lock``).
LOCK_NAME = "training"


def run_config(config: PipelineConfig, method: MethodConfig, seed: int) -> PipelineConfig:
    """The resolved config of one run: ``config`` with only this method and this seed."""
    return dataclasses.replace(config, methods=(method,), seeds=(int(seed),))


def check_resumable(run_dir: Path, config: PipelineConfig) -> None:
    """Before any training: raise ``ValueError`` listing the differences when the interrupted run in ``run_dir``
    was trained with another config than ``config`` (the run's, :func:`run_config`); device and output folders
    may differ.

    Read from the run's ``config.yaml``, written at every start of the run once this same check passed, so
    ``last.pt`` (gigabytes for a foundation model) is read once, by :func:`resume`, which checks the config
    inside it again. A run without ``config.yaml`` is left to :func:`resume`.
    """
    from wsi_pipeline.config.io import read_yaml

    path = run_dir / "config.yaml"
    if path.is_file():
        # through today's builder: keys added since the run was saved (e.g. a method's task) take their defaults
        _refuse_other_config(run_dir, upgrade_saved_config(read_yaml(path, what="saved run config")), config)


def _refuse_other_config(run_dir: Path, saved: dict[str, Any], config: PipelineConfig) -> None:
    diff = config_differences(saved, config_to_dict(config))
    if diff:
        raise ValueError(
            f"cannot resume {run_dir}: its config differs from the current one ({'; '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}); restore the config, or delete the run folder to start over"
        )


def resume(
    last: Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer, schedule: Any, *,
    config: PipelineConfig | None = None, restore_encoder: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Load ``last.pt`` into the models, optimiser, schedule and RNGs; return ``(history, best, epochs done)``.

    With ``config`` (the run's), a checkpoint trained with another config is refused first
    (``ValueError`` listing the differences, as :func:`check_resumable`).

    ``restore_encoder(encoder, state, info)`` loads the encoder's state when given (a checkpoint
    holding only a foundation encoder's trained tensors, see
    :func:`wsi_pipeline.methods.models.encoder_checkpoint`); else every module loads strictly.
    """
    ckpt = load_run_checkpoint(last)  # on the CPU: RNG states must stay there; load_state_dict moves the rest
    if ckpt.resume is None or ckpt.best is None:
        raise ValueError(f"{last} holds no optimiser, schedule and RNG states (a best.pt copied over it?); "
                         "delete it to start the run over")
    if config is not None:
        _refuse_other_config(last.parent, config_to_dict(ckpt.pipeline_config()), config)
    for name, module in modules.items():
        if name == "encoder" and restore_encoder is not None:
            restore_encoder(module, ckpt.models[name], ckpt.encoder_info)
        else:
            module.load_state_dict(ckpt.models[name])
    optimizer.load_state_dict(ckpt.resume.optimizer)
    schedule.load_state_dict(ckpt.resume.scheduler)
    restore_rng(ckpt.resume.rng)
    return list(ckpt.resume.history), dict(ckpt.best), ckpt.epoch


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[bool]:
    """Hold ``run_dir/training.lock`` while the body runs, refreshed by the lock's heartbeat however long
    the run (:class:`~wsi_pipeline.tiling.locks.LockDir`); yields False (and holds nothing) when
    another live process holds it. Under torchrun only rank 0 takes it; every rank gets its answer."""
    from wsi_pipeline.tiling.locks import LockDir
    from wsi_pipeline.training import distributed

    locks = None
    held = True
    if distributed.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        locks = LockDir(run_dir)
        held = locks.try_acquire(LOCK_NAME)
    if distributed.current().enabled:
        held = bool(distributed.broadcast_object(held))
    try:
        yield held
    finally:
        if locks is not None:
            locks.release_all()


def run_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s training lock (host, pid, since), or None when no live process does.

    A lock file that is empty or unreadable (its writer crashed between creating and writing it)
    counts as held by an unknown process until it goes stale, never as free."""
    from wsi_pipeline.tiling.locks import LockDir

    path = run_dir / f"{LOCK_NAME}.lock"
    if not path.exists():
        return None
    locks = LockDir(run_dir)
    if locks.stale_reason(LOCK_NAME) is not None:
        return None
    info = locks.holder(LOCK_NAME)
    if info is None:
        return (f"an unknown process: {path} is empty or unreadable; it is taken over once not refreshed for "
                f"{locks.stale_after_s:g} s, or delete it if no run is alive")
    return info.describe()


def clean_temporary_files(run_dir: Path) -> list[Path]:
    """Remove the temporary files (``.<name>.tmp-*``) a killed run left in ``run_dir``; call it holding
    :func:`run_lock`, so no live writer owns them. Returns what was removed."""
    removed = []
    for p in run_dir.glob(".*.tmp-*"):
        if p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    if removed:
        log.info("%s: removed %d temporary file(s) left by an interrupted run", run_dir, len(removed))
    return removed


def changed_since_finished(run_dir: Path, config: PipelineConfig) -> list[str]:
    """The settings that differ between a finished run's saved ``config.yaml`` and ``config`` (the
    run's, :func:`run_config`; device and output folders excluded); empty when unknown or equal."""
    from wsi_pipeline.config.io import read_yaml

    try:
        saved = read_yaml(run_dir / "config.yaml", what="saved run config")
    except (OSError, ValueError, TypeError):
        return []
    return config_differences(upgrade_saved_config(saved), config_to_dict(config))


def write_history(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """``history.csv``: one row per epoch, written atomically."""
    with atomic_path(path) as tmp:
        pd.DataFrame(list(rows)).to_csv(tmp, index=False)


def write_done(run_dir: Path, history: list[dict[str, Any]], best: dict[str, Any]) -> None:
    """The ``done`` marker: epochs, selection metric, best epoch, its value and validation loss (the
    tie-break between runs whose values tie), finishing time (JSON, atomic)."""
    loss = best.get("loss")
    summary = {
        "epochs": len(history), "select_metric": best["metric"], "best_epoch": best["epoch"],
        "best_value": best["value"] if best["value"] is not None and math.isfinite(best["value"]) else None,
        "best_loss": float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_text_atomic(run_dir / DONE, json.dumps(summary, indent=2))
