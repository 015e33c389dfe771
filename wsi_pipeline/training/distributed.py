"""Data-parallel training over several processes (``torchrun``): which bags a rank trains, and the sums.

``wsi-pipeline train`` started by ``torchrun --nproc_per_node=G [--nnodes N ...]`` finds ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment and joins a process group
(:func:`init_from_env`): NCCL for CUDA tensors and gloo for CPU tensors. Without those variables
(or with ``WORLD_SIZE=1``) everything here is a no-op and training is the single-process loop.

What G ranks do, so that they compute the update one process computes over the same bags:

- every rank draws the same epoch plan (it depends on seed and epoch only) and trains the bags
  of each optimiser step's group at positions ``rank, rank + G, ...`` (:func:`shard_plan`); a bag
  keeps its global number, so its augmentation and dropout seeds are those of the single process;
- each bag's loss is scaled by ``1 / (size of the whole group)`` as in the single process, so the
  step's gradient is the SUM over ranks of the ranks' gradients: :meth:`StepSync.reduce` sums
  them with ``all_reduce`` before clipping and the optimiser step (a parameter that got no
  gradient on any rank keeps ``grad = None``, as in the single process, so Adam leaves it alone);
- BatchNorm running statistics updated in train mode: every update ``r <- (1 - m) r + m x`` of a
  bag is affine in ``r`` and ``x`` does not depend on ``r`` (train-mode BatchNorm normalises with
  the batch's statistics), so each rank records, per bag, ``(u, c)`` with ``r_after = (1 - m)^u
  r_before + c``; the step's records are summed over ranks and composed in global bag order,
  which gives the running statistics of the single process (layers with ``momentum=None``, a
  cumulative average, are taken from rank 0 instead);
- PatchGD (a strategy that steps itself): a batch of ``slides_per_batch`` slides is split the
  same way; the tile plans of the whole batch are drawn on every rank and each slide's loss is
  divided by the whole batch's size (see :meth:`~wsi_pipeline.training.patchgd.PatchGDTrainer.batch_step`).

Rank 0 alone writes the run folder (checkpoints, history, ``done``) and logs; it also validates
(the other ranks wait and receive the metrics, so early stopping agrees) and extracts missing
frozen features. Every rank starts each run from rank 0's models (:func:`broadcast_states`), so a
run resumes from ``last.pt`` under any number of ranks.

Exact (to rounding) for every strategy whose bags do not share batch statistics: frozen
features, ``full``, ``accumulate``, ``bigl`` with ``encoder.bn`` ``frozen``/``chunk``/``train``
(BatchNorm statistics are per bag) and PatchGD with frozen encoder BatchNorm and a head without
batch statistics (``norm: layer``/``none``, no dropout: a rank draws dropout masks for its own
slides only). Everything is checked by ``tests/training/test_ddp.py`` against one process in float64.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "DistContext",
    "StepSync",
    "all_sum",
    "barrier",
    "broadcast_object",
    "broadcast_states",
    "current",
    "device_for",
    "env_rank",
    "gather_in_order",
    "init_from_env",
    "is_main",
    "shard",
    "shard_plan",
    "shutdown",
]

log = logging.getLogger(__name__)

#: Seconds a rank waits in a collective (e.g. while rank 0 validates or extracts features).
#: ``WSI_DDP_TIMEOUT_S`` overrides it.
DEFAULT_TIMEOUT_S = 3 * 3600


@dataclass(frozen=True)
class DistContext:
    """This process's place: ``rank`` of ``world_size`` processes, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        """True when several processes train together."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes checkpoints, history and logs."""
        return self.rank == 0


_CONTEXT = DistContext()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer (as torchrun sets it)") from e


def env_rank() -> int:
    """The rank torchrun gave this process (``RANK``; 0 without torchrun), known before :func:`init_from_env`."""
    return _env_int("RANK", 0)


def init_from_env() -> DistContext:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``); idempotent. Returns the single-process context without them.

    Backend: ``cpu:gloo,cuda:nccl`` when this rank has a GPU (``cuda:LOCAL_RANK``), else ``gloo``
    (a rank without a GPU of its own can still train on the CPU).
    """
    global _CONTEXT
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        _CONTEXT = DistContext()
        return _CONTEXT
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"environment: RANK={rank} outside [0, WORLD_SIZE={world})")
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} asks for distributed training but this torch build has no torch.distributed")
    if not dist.is_initialized():
        cuda = torch.cuda.is_available() and local < torch.cuda.device_count()
        if cuda:
            torch.cuda.set_device(local)
        timeout = datetime.timedelta(seconds=_env_int("WSI_DDP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timeout)
    _CONTEXT = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local)
    if _CONTEXT.is_main:
        log.info("distributed training: %d processes (%s)", _CONTEXT.world_size, dist.get_backend())
    return _CONTEXT


def shutdown() -> None:
    """Leave the process group (when one was joined)."""
    global _CONTEXT
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CONTEXT = DistContext()


def current() -> DistContext:
    """The context set by :func:`init_from_env` (single process before it)."""
    return _CONTEXT


def is_main() -> bool:
    """True on rank 0 (and in a single process)."""
    return _CONTEXT.is_main


def device_for(device: torch.device) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` for a CUDA ``device`` when distributed, else ``device``."""
    if _CONTEXT.enabled and device.type == "cuda":
        if _CONTEXT.local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={_CONTEXT.local_rank} but this node has {torch.cuda.device_count()} CUDA device(s); start at "
                "most that many processes per node (torchrun --nproc_per_node), or train on the CPU (--device cpu)"
            )
        return torch.device("cuda", _CONTEXT.local_rank)
    return device


def shard(n: int, ctx: DistContext | None = None) -> list[int]:
    """This rank's positions of ``n`` items: ``rank, rank + G, ...`` (all of them in a single process)."""
    ctx = ctx or _CONTEXT
    return list(range(ctx.rank, int(n), ctx.world_size))


def shard_plan(plan: Sequence[Sequence[Any]], ctx: DistContext | None = None) -> tuple[list[list[Any]], list[list[int]]]:
    """This rank's bags of every group of an epoch plan, and their global bag numbers.

    Returns ``(local, numbers)``: ``local[g]`` holds the group's items at :func:`shard`
    positions and ``numbers[g]`` their positions in the flattened plan (the single process's
    bag number ``b``). Every rank gets one (possibly empty) entry per group.
    """
    local: list[list[Any]] = []
    numbers: list[list[int]] = []
    start = 0
    for group in plan:
        mine = shard(len(group), ctx)
        local.append([group[j] for j in mine])
        numbers.append([start + j for j in mine])
        start += len(group)
    return local, numbers


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _CONTEXT.enabled:
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable objects; returned unchanged in a single process)."""
    if not _CONTEXT.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process; picklable objects)."""
    if not _CONTEXT.enabled:
        return [obj]
    out: list[Any] = [None] * _CONTEXT.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_in_order(positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """Every rank's ``values``, each at its ``positions`` of the whole list (e.g. from :func:`shard`),
    gathered and put in position order on every rank (``values`` in position order in a single process)."""
    pairs = (pair for part in all_gather_object(list(zip(positions, values))) for pair in part)
    return [value for _, value in sorted(pairs, key=lambda pair: pair[0])]


def all_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks of equally long lists of numbers (float64; unchanged in a single process)."""
    if not _CONTEXT.enabled:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    for t in tensors:
        return t.device
    return torch.device("cpu")


def broadcast_states(modules: Iterable[nn.Module]) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``modules`` (no-op in a single process)."""
    if not _CONTEXT.enabled:
        return
    with torch.no_grad():
        for module in modules:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)


def _bn_layers(modules: Iterable[nn.Module]) -> list[_BatchNorm]:
    seen: dict[int, _BatchNorm] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None:
                seen.setdefault(id(m), m)
    return list(seen.values())


def _running(m: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tracked BatchNorm's running mean, running variance and batch count (:func:`_bn_layers` keeps only those)."""
    if m.running_mean is None or m.running_var is None or m.num_batches_tracked is None:
        raise ValueError(f"{type(m).__name__} does not track running statistics")
    return m.running_mean, m.running_var, m.num_batches_tracked


def _momentum(m: _BatchNorm) -> float:
    """The exponential-average momentum of a BatchNorm (``StepSync.ema`` keeps only those that have one)."""
    if m.momentum is None:
        raise ValueError(f"{type(m).__name__} has momentum=None (a cumulative average), not an exponential one")
    return float(m.momentum)


class StepSync:
    """Sums one optimiser step's gradients over ranks and merges BatchNorm running statistics.

    Parameters
    ----------
    params : the parameters the optimiser steps.
    modules : the modules whose BatchNorm running statistics train mode updates (checkpointed).

    Use: :meth:`begin_group` before an optimiser step's bags, :meth:`bag` around each bag this
    rank trains, :meth:`reduce` right before clipping and the optimiser step. With no group begun
    (PatchGD), :meth:`reduce` copies rank 0's BatchNorm statistics to every rank instead. In a
    single process every method returns at once.
    """

    def __init__(self, params: Sequence[nn.Parameter], modules: Iterable[nn.Module]) -> None:
        self.params = list(params)
        self.ctx = _CONTEXT
        self.layers = _bn_layers(modules) if self.ctx.enabled else []
        self.ema = [m for m in self.layers if m.momentum is not None]
        self.cumulative = [m for m in self.layers if m.momentum is None]
        if self.cumulative and self.ctx.is_main:
            log.warning(
                "%d BatchNorm layer(s) with momentum=None (cumulative average): their running statistics are rank 0's, "
                "not those of one process over all bags", len(self.cumulative),
            )
        self._group: tuple[int, int] | None = None
        self._records: dict[int, torch.Tensor] = {}
        self._start: list[torch.Tensor] = []

    # -- BatchNorm running statistics -------------------------------------------------------

    def _stats(self) -> list[torch.Tensor]:
        return [t for m in self.ema for t in _running(m)[:2]]

    def _counts(self) -> list[int]:
        return [int(_running(m)[2]) for m in self.ema]

    def begin_group(self, first: int, count: int) -> None:
        """The next optimiser step trains bags ``first .. first + count - 1`` (global numbers) over all ranks."""
        if not self.ctx.enabled:
            return
        self._group = (int(first), int(count))
        self._records = {}
        self._start = [t.detach().clone() for t in self._stats()]
        self._start_counts = self._counts()

    @contextmanager
    def bag(self, number: int) -> Iterator[None]:
        """Record how the bag with global ``number`` (run inside the block) changed the running statistics."""
        if not self.ctx.enabled or not self.ema:
            yield
            return
        before = [t.detach().clone() for t in self._stats()]
        counts = self._counts()
        yield
        u = [a - b for a, b in zip(self._counts(), counts)]
        after = self._stats()
        parts = []
        for i, m in enumerate(self.ema):
            factor = (1.0 - _momentum(m)) ** u[i]  # r_after = factor * r_before + c
            for k in (2 * i, 2 * i + 1):
                parts.append((after[k].detach().double() - factor * before[k].double()).reshape(-1))
        parts.append(torch.tensor(u, dtype=torch.float64, device=parts[0].device if parts else "cpu"))
        self._records[int(number)] = torch.cat(parts)

    def _merge_statistics(self) -> None:
        if self._group is None:
            return
        first, count = self._group
        self._group = None
        if not self.ema:
            return
        stats = self._stats()
        width = sum(t.numel() for t in stats) + len(self.ema)
        rows = torch.zeros(count, width, dtype=torch.float64, device=_device_of(stats))
        for number, row in self._records.items():
            rows[number - first] = row
        dist.all_reduce(rows)
        n_stats = width - len(self.ema)
        us = rows[:, n_stats:].round().long()
        with torch.no_grad():
            offset = 0
            for i, m in enumerate(self.ema):
                mom = _momentum(m)
                for k in (0, 1):
                    t = stats[2 * i + k]
                    r = self._start[2 * i + k].double().reshape(-1)
                    n = t.numel()
                    for j in range(count):
                        r = (1.0 - mom) ** int(us[j, i]) * r + rows[j, offset : offset + n]
                    t.copy_(r.reshape(t.shape).to(t.dtype))
                    offset += n
                _running(m)[2].fill_(self._start_counts[i] + int(us[:, i].sum()))
        self._records = {}

    # -- the step ---------------------------------------------------------------------------

    def reduce(self) -> None:
        """Sum every parameter's ``.grad`` over ranks (``all_reduce``) and merge the BatchNorm statistics.

        A parameter whose gradient is ``None`` on every rank stays ``None``. BatchNorm layers
        not merged exactly (``momentum=None``; every layer when no group was begun) get rank 0's
        running statistics.
        """
        if not self.ctx.enabled:
            return
        merged = self._group is not None
        self._merge_statistics()
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float64,
                               device=_device_of(self.params))
        dist.all_reduce(present)
        for ps in groups.values():
            flat = torch.cat([
                (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps
            ])
            dist.all_reduce(flat)
            offset = 0
            for p in ps:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        for p, flag in zip(self.params, present.tolist()):
            if flag == 0:
                p.grad = None
        with torch.no_grad():
            for m in self.cumulative if merged else self.layers:
                for t in _running(m):
                    dist.broadcast(t, src=0)
