"""A run folder ``<runs_dir>/<pipeline>/<method>/seed<k>/``: its config, resuming it, its history and ``done`` marker.

Checkpoints themselves are written by the loop (:func:`wsi_pipeline.inference.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig, config_to_dict, upgrade_saved_config
from wsi_pipeline.inference.checkpoint import load_checkpoint, restore_rng
from wsi_pipeline.io_atomic import atomic_path, write_text_atomic

__all__ = ["DONE", "check_resumable", "resume", "run_config", "write_done", "write_history"]

log = logging.getLogger(__name__)

#: The marker of a finished run (a JSON summary, written last); a run with it is skipped.
DONE = "done"

#: Settings a resumed run may change: where it runs and where runs and results are kept.
_RESUME_FREE = ("device", "runs_dir", "results_dir")


def run_config(config: PipelineConfig, method: MethodConfig, seed: int) -> PipelineConfig:
    """The resolved config of one run: ``config`` with only this method and this seed."""
    return dataclasses.replace(config, methods=(method,), seeds=(int(seed),))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


def _config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    a, b = _flatten(saved), _flatten(now)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k, '<absent>')!r} (saved) vs {b.get(k, '<absent>')!r} (now)"
        for k in keys
        if a.get(k) != b.get(k) and k.rsplit(".", 1)[-1] not in _RESUME_FREE
    ]


def check_resumable(run_dir: Path, config: PipelineConfig) -> None:
    """Raise ``ValueError`` listing the differences when ``run_dir/last.pt`` was trained with another config
    than ``config`` (the run's, :func:`run_config`); device and output folders may differ."""
    state = load_checkpoint(run_dir / "last.pt")
    diff = _config_diff(upgrade_saved_config(state["config"]), config_to_dict(config))
    if diff:
        raise ValueError(
            f"cannot resume {run_dir}: its config differs from the current one ({'; '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}); restore the config, or delete the run folder to start over"
        )


def resume(
    last: Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer, schedule: Any, *,
    restore_encoder: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Load ``last.pt`` into the models, optimiser, schedule and RNGs; return ``(history, best, epochs done)``.

    ``restore_encoder(encoder, state, info)`` loads the encoder's state when given (a checkpoint
    holding only a foundation encoder's trained tensors, see
    :func:`wsi_pipeline.inference.models.encoder_checkpoint`); else every module loads strictly.
    """
    state = load_checkpoint(last)  # on the CPU: RNG states must stay there; load_state_dict moves the rest
    for name, module in modules.items():
        if name == "encoder" and restore_encoder is not None:
            restore_encoder(module, state["models"][name], state.get("encoder_info"))
        else:
            module.load_state_dict(state["models"][name])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    return list(state["history"]), dict(state["best"]), int(state["epoch"])


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
