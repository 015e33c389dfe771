"""Training: exact gradient accumulation, strategies, the training loop, optimisers, checkpoints."""

from __future__ import annotations

from typing import Any

__all__ = ["accumulate_step", "full_step"]

_LAZY = {"accumulate_step": "wsi_pipeline.training.accumulate", "full_step": "wsi_pipeline.training.accumulate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'wsi_pipeline.training' has no attribute {name!r}")
