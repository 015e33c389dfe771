"""Memory known before it is needed: a run's peak host (and device) memory, predicted before training.

The prediction adds up what a training step holds, from the counts the Big-Layers planner uses
(:func:`wsi_pipeline.bigl.budget.unit_memory`: the bytes autograd saves and the largest activation
of each unit, counted on meta tensors, nothing allocated):

- ``baseline``: this process's resident memory when the prediction is made (libraries, caches);
- ``state``: the trained modules' weights, gradients and Adam's two moments (4 x their parameter
  bytes; the frozen strategy trains the aggregator only);
- ``bags``: the bag being trained and the next one the loader thread prepares, uint8 and float
  (the float input lives on the host when the step converts there: the CPU, Big-Layers), plus
  one float copy while a bag is converted;
- ``activations``: one step's activations: of ``chunk_size`` tiles (exact accumulation), of the
  whole bag (``full``; ``bigl`` on the CPU, where its host activations are the whole bag's, but its
  Big-Layers' backward runs chunk by chunk, so only the later units' largest activation is held
  twice), of a feature-extraction batch (``frozen``);
- ``validation``: embedding a validation slide, ``chunk_size`` tiles at a time (every strategy), when
  that exceeds the step's.

The peak is ``baseline + state + max(bags + activations, validation)``. :func:`check_fits` refuses a
run whose prediction exceeds the memory available (``MemAvailable`` plus what the process already
holds) with what it needs, what there is and which setting to change; :func:`measured_peak` is
recorded beside the prediction in ``<run>/memory.json`` at the end of the run. Encoders other than
the ResNets (foundation ViTs) get no activation count: their prediction says so.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.config.strategy_traits import strategy_traits

__all__ = ["MemoryPrediction", "available_host_bytes", "check_fits", "measured_peak", "predict_memory", "rss_bytes",
           "write_memory_record"]

log = logging.getLogger(__name__)

GiB = 2**30


@dataclass
class MemoryPrediction:
    """A run's predicted peak host memory (bytes) and its parts; ``device_bytes`` on CUDA (else 0)."""

    method: str
    bag_tiles: int
    tile_size: int
    parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    device_bytes: int = 0
    note: str = ""

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items())
        return (f"method {self.method}: predicted peak host memory {self.host_bytes / GiB:.2f} GiB for bags of {self.bag_tiles} "
                f"tiles of {self.tile_size} px ({parts} GiB){'; ' + self.note if self.note else ''}")


def rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; the peak so far elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return measured_peak()


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key:`` line of a ``/proc`` file (given in KiB there) in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measured_peak() -> int:
    """This process's peak resident memory so far, in bytes: Linux's ``VmHWM`` (the high-water mark of
    this program's own memory), else ``ru_maxrss``. Not ``ru_maxrss`` on Linux: it survives ``exec``,
    so a run started from a large process (a test runner, a notebook) would report that process's peak."""
    hwm = _proc_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")
    return None


def _param_bytes(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() * p.element_size() for p in module.parameters())


def _activations(encoder: nn.Module, n: int, tile: int, *, grad: bool, big_stages: int | None = None) -> int | None:
    """Bytes of a forward of ``n`` tiles (saved + twice the largest activation with gradient; three
    times the largest without), or None for an encoder the count does not know (not our ResNet).

    ``big_stages``: the stem and that many residual stages are Big-Layers, which run their backward
    chunk by chunk and free each saved input as they go: their largest activation is held once more
    (its gradient), the other units' largest twice, whichever is more. (Counting the stem's twice
    over-predicted a ResNet-18 step on 512 tiles of 256 px by 27 %: 20.2 GiB for 15.9 measured.)"""
    from wsi_pipeline.bigl.budget import unit_memory
    from wsi_pipeline.models.encoders import ResNet

    if not isinstance(encoder, ResNet) or n <= 0:
        return None
    mem = unit_memory(encoder, (n, 3, tile, tile), torch.get_default_dtype(), grad=grad)
    largest = max(m.largest for m in mem)
    if not grad:
        return 3 * largest
    held = 2 * largest
    if big_stages is not None:
        big = ("stem", *(f"layer{i}." for i in range(1, big_stages + 1)))
        held = max(largest, 2 * max((m.largest for m in mem if not m.name.startswith(big)), default=0))
    return sum(m.saved for m in mem) + held


def predict_memory(method: MethodConfig, encoder: nn.Module | None, aggregator: nn.Module, *, bag_tiles: int, tile_size: int,
                   val_tiles: int, device: torch.device, augment: bool, baseline: int | None = None) -> MemoryPrediction:
    """The run's peak memory (module docstring) for bags of ``bag_tiles`` tiles of ``tile_size`` px and
    a largest validation slide of ``val_tiles`` tiles; ``encoder``/``aggregator``: the method's models
    (built on the CPU, for their sizes and the activation count)."""
    traits = strategy_traits(method.strategy)
    esize = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    pred = MemoryPrediction(method.name, int(bag_tiles), int(tile_size))
    trains_encoder = traits.trains_encoder and encoder is not None
    state = 4 * (_param_bytes(aggregator) + (_param_bytes(encoder) if trains_encoder else 0))
    state += 0 if trains_encoder else _param_bytes(encoder)  # a frozen encoder: its weights only
    u8 = bag_tiles * tile_size * tile_size * 3
    fl = u8 * esize
    cuda = device.type == "cuda"
    host_float = (not cuda or traits.big_layers) and traits.trains_encoder
    bags = 2 * u8 + (3 * fl if host_float and not augment else 2 * fl if host_float else 0)
    chunk = int(getattr(method, "chunk_size", 64) or 64)
    act: int | None
    if not traits.trains_encoder:  # frozen: feature extraction in batches, then the aggregator on features
        act = _activations(encoder, chunk, tile_size, grad=False) if encoder is not None else 0
        bags = 2 * u8 + 2 * chunk * 3 * tile_size * tile_size * esize
    elif traits.big_layers:
        act = _activations(encoder, bag_tiles, tile_size, grad=True, big_stages=int(method.bigl.stages)) if encoder is not None else 0
    elif traits.embeds_per == "chunk":  # exact accumulation: one chunk's activations at a time
        act = _activations(encoder, min(chunk, bag_tiles), tile_size, grad=True) if encoder is not None else 0
    else:  # the whole bag through the encoder with gradient
        act = _activations(encoder, bag_tiles, tile_size, grad=True) if encoder is not None else 0
    if act is None:
        pred.note = f"no activation count for encoder {method.encoder.name!r} (ResNets only): activations left out"
        act = 0
    val_n = min(chunk, val_tiles)  # validation embeds each slide chunk_size tiles at a time (every strategy)
    val = 0
    if val_tiles > 0 and encoder is not None:
        v = _activations(encoder, val_n, tile_size, grad=False)
        val = (v or 0) + val_n * tile_size * tile_size * 3 * (1 + esize)
    z = 3 * bag_tiles * int(getattr(encoder, "num_features", 0) or 0) * esize
    base = rss_bytes() if baseline is None else int(baseline)
    step = bags + act + z
    pred.parts = {"baseline": base, "state": state, "bags": bags, "activations": act, "validation": val}
    if cuda:  # the device holds the state, the step's activations and (accumulate) the uint8 bag
        pred.device_bytes = state + act + {"uint8": u8, "float": fl, "none": 0}[traits.device_bag]
        pred.host_bytes = base + bags
    else:
        pred.host_bytes = base + state + max(step, val)
    return pred


def check_fits(pred: MemoryPrediction, *, device: torch.device, available: int | None = None) -> None:
    """Raise ``MemoryError``-like ``ValueError`` when the prediction exceeds what there is (module docstring)."""
    have = available_host_bytes() if available is None else available
    if have is not None:
        have += pred.parts.get("baseline", 0)
        if pred.host_bytes > have:
            raise ValueError(_advice(pred, "host", pred.host_bytes, have))
    if device.type == "cuda" and pred.device_bytes:
        free, _ = torch.cuda.mem_get_info(device)
        if pred.device_bytes > free:
            raise ValueError(_advice(pred, f"device {device}", pred.device_bytes, free))


def _advice(pred: MemoryPrediction, where: str, need: int, have: int) -> str:
    per_tile = (pred.parts.get("bags", 0) + pred.parts.get("activations", 0)) / max(pred.bag_tiles, 1)
    spare = have - (need - pred.parts.get("bags", 0) - pred.parts.get("activations", 0))
    fits = max(0, int(spare / per_tile)) if per_tile > 0 else 0
    return (f"{pred.describe()}: needs {need / GiB:.1f} GiB of {where} memory, {have / GiB:.1f} GiB available. Lower "
            f"train.bag_size (about {fits} tiles would fit), or use strategy accumulate (memory of one chunk), a smaller "
            "chunk_size, fewer bigl.stages, or a machine with more memory; `train --no-memory-check` trains anyway")


def write_memory_record(run_dir: Path, pred: MemoryPrediction, device: torch.device) -> Path:
    """``<run>/memory.json``: the prediction, its parts, and the measured peak (host; device on CUDA)."""
    measured: dict[str, Any] = {"host_peak_bytes": measured_peak()}
    if device.type == "cuda":
        measured["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    record = {"predicted": asdict(pred), "measured": measured,
              "host_ratio": round(measured["host_peak_bytes"] / pred.host_bytes, 4) if pred.host_bytes else math.nan}
    return write_text_atomic(Path(run_dir) / "memory.json", json.dumps(record, indent=2))
