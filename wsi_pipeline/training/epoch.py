"""One training epoch: the two ways a strategy's epoch passes over the training slides.

A strategy's :meth:`~wsi_pipeline.training.strategies.Strategy.train_epoch` runs one of these,
so the loop calls the same method whatever the strategy:

- :func:`bag_epoch` (``frozen``, ``full``, ``accumulate``, ``bigl``): the epoch's bags
  (:func:`wsi_pipeline.data.bags.epoch_plan`) in groups of ``bags_per_step``; each bag's
  gradient of ``loss / group size`` is added by ``strategy.bag_step`` and the loop's
  ``optimizer_step`` follows each group;
- :func:`slide_batch_epoch` (PatchGD): the slides in the plan's order, ``slides_per_batch`` at a
  time, each batch run by ``strategy.run_batch``, which calls ``optimizer_step`` itself.

Random numbers: every bag starts from its own torch seed ``(seed, epoch, bag)``; PatchGD's tile
sampling has its own generator seeded from ``(seed, epoch, 2)``. Under torchrun each rank trains
its share of every group (:mod:`wsi_pipeline.training.distributed`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.data.bags import Bag, FeatureReader, TileReader, epoch_plan, iter_bags
from wsi_pipeline.tasks import Endpoint
from wsi_pipeline.training.monitor import StepInfo
from wsi_pipeline.training import distributed
from wsi_pipeline import interrupt

__all__ = ["BagSteps", "SlideBatchSteps", "bag_epoch", "seed_everything", "seed_torch", "slide_batch_epoch"]


class BagSteps(Protocol):
    """What :func:`bag_epoch` asks of a strategy (every bag strategy of :mod:`~wsi_pipeline.training.strategies`)."""

    method: MethodConfig
    endpoint: Endpoint

    def prepare_bag(self, bag: Bag) -> Any: ...

    def bag_step(self, bag: Bag, scale: float) -> float: ...

    def group_step(self, bags: Sequence[tuple[int, Bag]], seed: int, epoch: int) -> float: ...


class SlideBatchSteps(Protocol):
    """What :func:`slide_batch_epoch` asks of a strategy (PatchGD's)."""

    @property
    def slides_per_batch(self) -> int: ...

    def run_batch(self, stores: list[Any], labels: list[int], optimizer_step: Callable[[], None], generator: torch.Generator,
                  *, part: list[int] | None = None) -> float: ...


def _seed_of(*keys: int) -> int:
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1)[0])


def seed_everything(*keys: int) -> None:
    """Seed Python's, NumPy's and torch's global generators from ``keys`` (e.g. ``(seed, epoch + 1)``)."""
    s = _seed_of(*keys)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def seed_torch(*keys: int) -> None:
    """Seed torch's global generator from ``keys`` (e.g. ``(seed, epoch, bag)``)."""
    torch.manual_seed(_seed_of(*keys))


def bag_epoch(
    strategy: BagSteps,
    reader: TileReader | FeatureReader,
    n_tiles: list[int],
    tc: Any,
    seed: int,
    epoch: int,
    optimizer_step: Callable[..., None],
    bar: Any,
    sync: distributed.StepSync | None = None,
) -> float:
    """One pass of bags of ``tc.bag_size`` tiles; returns the mean bag loss (over all ranks under torchrun).

    A loss that couples the bags of a step (``strategy.endpoint.coupled``: Cox) takes each group's bags
    together (:meth:`~wsi_pipeline.training.strategies.Strategy.group_step`); the loss returned is
    then the mean over the steps of each step's loss.
    """
    losses: list[float] = []
    plan = epoch_plan(n_tiles, bag_size=tc.bag_size, bags_per_step=tc.bags_per_step, seed=seed, epoch=epoch)
    if strategy.endpoint.coupled:
        return _coupled_epoch(strategy, reader, plan, seed, epoch, optimizer_step, bar)
    local, numbers = distributed.shard_plan(plan)  # this rank's bags (all of them in a single process)
    bags = bar(total=sum(map(len, local)), desc=f"epoch {epoch + 1}", unit="bag", leave=False)
    loaded = iter_bags(local, reader, prepare=strategy.prepare_bag)
    first = 0
    for g, group in enumerate(plan):
        if sync is not None:
            sync.begin_group(first, len(group))
        step_losses: list[float] = []
        tiles, wait = 0, 0.0
        for b in numbers[g]:
            interrupt.check()
            t0 = time.perf_counter()
            _, bag = next(loaded)
            wait += time.perf_counter() - t0  # the training thread idle, waiting for the loader
            tiles += len(bag.indices)
            # every bag starts from its own seed: its augmentation and dropout draws depend on
            # (seed, epoch, bag) only, not on how many numbers earlier bags consumed, so strategies
            # that draw differently per bag still give a bag the same augmentation (and so does
            # the rank that trains it under torchrun)
            seed_torch(seed, epoch, b)
            with sync.bag(b) if sync is not None else nullcontext():
                step_losses.append(strategy.bag_step(bag, 1.0 / len(group)))
            losses.append(step_losses[-1])
            bags.update()
            bags.set_postfix(loss=f"{np.mean(losses):.4f}")
        optimizer_step(StepInfo(float(np.mean(step_losses)) if step_losses else float("nan"), tiles, wait))
        first += len(group)
    bags.close()
    if not distributed.current().enabled:
        return float(np.mean(losses))
    total, count = distributed.all_sum([sum(losses), len(losses)])
    return total / count


def _coupled_epoch(strategy: BagSteps, reader: TileReader | FeatureReader, plan: list, seed: int, epoch: int,
                   optimizer_step: Callable[..., None], bar: Any) -> float:
    """:func:`bag_epoch` for a loss over each step's bags (Cox): one :meth:`group_step` per group."""
    if distributed.current().enabled:
        raise ValueError(f"method {strategy.method.name!r}: loss {strategy.endpoint.loss!r} couples the bags of a step, "
                         "which torchrun would split over ranks; train it in one process")
    losses: list[float] = []
    bags = bar(total=sum(map(len, plan)), desc=f"epoch {epoch + 1}", unit="bag", leave=False)
    loaded = iter_bags(plan, reader)
    number = 0
    for group in plan:
        interrupt.check()
        step = []
        t0 = time.perf_counter()
        for _ in group:
            step.append((number, next(loaded)[1]))
            number += 1
        wait = time.perf_counter() - t0
        losses.append(strategy.group_step(step, seed, epoch))
        optimizer_step(StepInfo(losses[-1], sum(len(bag.indices) for _, bag in step), wait))
        bags.update(len(group))
        bags.set_postfix(loss=f"{np.mean(losses):.4f}")
    bags.close()
    return float(np.mean(losses))


def slide_batch_epoch(
    strategy: SlideBatchSteps,
    reader: TileReader,
    n_tiles: list[int],
    seed: int,
    epoch: int,
    optimizer_step: Callable[[], None],
    bar: Any,
) -> float:
    """One pass of the slides, ``strategy.slides_per_batch`` at a time, each batch run by
    ``strategy.run_batch`` (which steps the optimiser); returns the mean batch loss."""
    # the slides' order is the epoch plan's (bags of whole slides, one per group)
    plan = epoch_plan(n_tiles, bag_size=max(n_tiles), bags_per_step=1, seed=seed, epoch=epoch)
    gen = torch.Generator().manual_seed(_seed_of(seed, epoch, 2))
    bags = bar(total=len(plan), desc=f"epoch {epoch + 1}", unit="slide", leave=False)
    order = [i for (i, _), in plan]
    per = strategy.slides_per_batch
    ddp = distributed.current()
    losses: list[float] = []
    for a in range(0, len(order), per):
        interrupt.check()
        group = order[a : a + per]
        part = {"part": distributed.shard(len(group))} if ddp.enabled else {}  # this rank's slides of the batch
        stores = [reader.store(i) for i in group]
        losses.append(strategy.run_batch(stores, [reader.slides[i].label for i in group], optimizer_step, gen, **part))
        bags.update(len(group))
        bags.set_postfix(loss=f"{np.mean(losses):.4f}")
    bags.close()
    return float(np.mean(distributed.all_sum(losses)))  # a rank's batch loss is its share of the batch's
