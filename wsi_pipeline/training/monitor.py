"""Training you can watch: one record per optimiser step, in the run folder and optionally in TensorBoard.

Each step records its mean bag loss, the learning rate, the gradient norm (before clipping), the
tiles it trained on, tiles/s (of the whole step: reading, conversion, compute), the share of the step
the training thread spent waiting for the next bag, and the process's peak memory so far (CUDA: the
device's peak allocated bytes; CPU: the peak resident set). They go to ``steps.csv`` in the run
folder (rewritten atomically at each epoch's end, so a log viewer always sees whole epochs) and, with
``train.log: tensorboard``, to TensorBoard event files in ``<run>/tensorboard`` (per step under
``train/``, per epoch under ``epoch/`` and ``val/``). Under torchrun only rank 0 records.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.training.memory import measured_peak

__all__ = ["MEASURED_COLUMNS", "STEP_COLUMNS", "StepInfo", "StepMonitor", "gradient_norm", "peak_memory_mb"]

log = logging.getLogger(__name__)

#: ``history.csv`` columns that measure the machine (time, rates, memory), not the model: they differ
#: between two runs that train the same weights.
MEASURED_COLUMNS = ("seconds", "tiles_per_s", "data_wait_share", "peak_mem_mb", "val_seconds")
#: Columns of ``steps.csv``.
STEP_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "tiles", "seconds", "tiles_per_s", "data_wait_share",
                "peak_mem_mb")


@dataclass(frozen=True)
class StepInfo:
    """What an epoch knows of one optimiser step: the mean loss of its bags, its tiles, and the
    seconds the training thread waited for them (the loader's share of the step)."""

    loss: float = math.nan
    tiles: int = 0
    data_wait_s: float = 0.0


def gradient_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The global L2 norm of the gradients of ``params`` (0 when none has one)."""
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far in MiB: CUDA allocated bytes on ``device``, else this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return measured_peak() / 2**20


class StepMonitor:
    """Per-step records of one run (module docstring).

    Parameters
    ----------
    run_dir : the run folder (``steps.csv``, ``tensorboard/``).
    device : the training device (for peak memory).
    kind : ``train.log``: ``none`` or ``tensorboard``.
    enabled : False records nothing (ranks other than 0).
    start_epoch : epochs already done (a resumed run keeps their rows and drops any later ones).
    """

    def __init__(self, run_dir: Path, device: torch.device, kind: str = "none", *, enabled: bool = True,
                 start_epoch: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.device = torch.device(device)
        self.enabled = enabled
        self.epoch = start_epoch
        self.rows: list[dict[str, Any]] = []
        self.writer: Any = None
        self._last = time.perf_counter()
        if not enabled:
            return
        old = self.run_dir / "steps.csv"
        if old.is_file() and start_epoch > 0:
            prior = pd.read_csv(old)
            self.rows = prior[prior["epoch"] <= start_epoch].to_dict("records")
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "train.log: tensorboard needs the tensorboard package; install it with "
                    "`pip install 'wsi-pipeline[tensorboard]'` (or `pip install tensorboard`), or set train.log: none"
                ) from e
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=len(self.rows) or None)

    @property
    def global_step(self) -> int:
        return len(self.rows)

    def begin_epoch(self, epoch: int) -> None:
        """Steps that follow belong to epoch ``epoch + 1`` (1-based, as ``history.csv``)."""
        self.epoch = epoch + 1
        self._last = time.perf_counter()

    def step(self, info: StepInfo | None, *, lr: float, grad_norm: float | None) -> None:
        """Record one optimiser step (``info``: None when the epoch does not say, e.g. PatchGD)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if not self.enabled:
            return
        info = info or StepInfo()
        row = {
            "step": self.global_step + 1, "epoch": self.epoch, "loss": float(info.loss), "lr": float(lr),
            "grad_norm": math.nan if grad_norm is None else float(grad_norm), "tiles": int(info.tiles),
            "seconds": round(seconds, 4), "tiles_per_s": round(info.tiles / seconds, 2) if seconds > 0 else math.nan,
            "data_wait_share": round(min(1.0, info.data_wait_s / seconds), 4) if seconds > 0 else math.nan,
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
        }
        self.rows.append(row)
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tiles_per_s", "data_wait_share", "peak_mem_mb"):
                if not math.isnan(row[key]):
                    self.writer.add_scalar(f"train/{key}", row[key], row["step"])

    def end_epoch(self, history_row: Mapping[str, Any]) -> None:
        """Write ``steps.csv`` (all steps so far) and the epoch's values to TensorBoard."""
        if not self.enabled:
            return
        with atomic_path(self.run_dir / "steps.csv") as tmp:
            pd.DataFrame(self.rows, columns=list(STEP_COLUMNS)).to_csv(tmp, index=False)
        if self.writer is not None:
            epoch = int(history_row["epoch"])
            for key, value in history_row.items():
                if key == "epoch" or not isinstance(value, (int, float)) or math.isnan(float(value)):
                    continue
                tag = f"val/{key[4:]}" if key.startswith("val_") else f"epoch/{key}"
                self.writer.add_scalar(tag, float(value), epoch)
            self.writer.flush()

    def summary(self) -> dict[str, float]:
        """Means over the current epoch's steps: tiles/s, data-wait share, and the peak memory."""
        rows = [r for r in self.rows if r["epoch"] == self.epoch]
        if not rows:
            return {}
        tiles = sum(r["tiles"] for r in rows)
        secs = sum(r["seconds"] for r in rows)
        waits = [r["data_wait_share"] * r["seconds"] for r in rows if not math.isnan(r["data_wait_share"])]
        return {"tiles_per_s": tiles / secs if secs else math.nan, "data_wait_share": sum(waits) / secs if secs else math.nan,
                "peak_mem_mb": max(r["peak_mem_mb"] for r in rows)}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
