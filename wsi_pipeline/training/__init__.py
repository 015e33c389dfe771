"""Training: the loop and what it is made of.

``loop`` (train_pipeline, train_run) <- ``preflight`` (checks before training), ``rundir`` (run
folder, resume, history), ``epoch`` (one epoch), ``validation`` (per-epoch metrics, best epoch),
``calibration`` (BatchNorm statistics), ``frozen_features``; ``strategies`` (one interface for
frozen, full, accumulate, bigl, patchgd) <- ``accumulate`` (exact gradient accumulation),
``patchgd`` / ``patchgd_plan`` (PatchGD's engine and plan); ``optim``, ``distributed`` (torchrun).
"""

from __future__ import annotations

from typing import Any

__all__ = ["accumulate_step", "full_step"]

_LAZY = {"accumulate_step": "wsi_pipeline.training.accumulate", "full_step": "wsi_pipeline.training.accumulate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'wsi_pipeline.training' has no attribute {name!r}")
