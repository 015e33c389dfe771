"""The device-budget plan of a Big-Layers step: offload only what does not fit.

Memory model (bytes, estimated on meta tensors for the step's input shape and dtype, so nothing
is allocated): for every unit (the stem, then each residual block; :mod:`wsi_pipeline.bigl.units`)
the bytes plain autograd saves for the backward pass (``saved``; zero without gradient), its
output and its largest activation. A plain step needs

    ``state + input + sum(saved) + work``,

``state`` = 4 x the encoder's parameter bytes (weights, gradients, two Adam moments), ``work`` =
2 x the largest activation (a gradient and the activation it flows into; 3 x without gradient:
a block's identity, its running output and the layer being computed).

The rule:

1. If the plain step fits the budget, the step is the plain step: nothing is offloaded and only
   the input crosses the bus, once.
2. Otherwise a prefix of ``k`` units runs as fused runs (:mod:`wsi_pipeline.bigl.fused`): they
   save nothing on the device and recompute their layers chunk by chunk in the backward pass;
   the device holds the later units' ``saved`` and ``work``, the *checkpoints* it keeps and one
   chunk step's working set. Checkpoints are the inputs of the runs: the image (in the transfer
   dtype) and the outputs of runs 1 .. k-1 (run k's output is the device part's input, counted in
   its ``saved``).
3. For a given ``k``, checkpoints stay on the device while they fit beside the smallest chunk
   step (one output row, or one sample, of the largest run), the costliest on the host first;
   when some must go to the host anyway, they leave room for chunk steps of 64 output rows (or
   one sample), so that halo rows re-read from the host stay a few per cent (where that fits).
   On the host a checkpoint is read by every pass of the run it feeds (one forward and one
   backward pass, plus one statistics and one sums pass per batch-statistics BatchNorm on the
   run's longest chain: 4 for the stem, 6 for a BasicBlock, 8 for a Bottleneck in ``bn: train``),
   written once, and its gradient written once and read by every backward pass of the run
   before. The rest live in host memory (pinned on CUDA, reused across steps) and cross the bus.
4. ``k`` is the smallest for which nothing but the image's single upload crosses the bus; where
   no ``k`` achieves that, the ``k`` whose host checkpoints cost the fewest bytes (the smaller
   on a tie). Bytes
   over the bus cost far more time than recomputing an early unit (50 GB/s against hundreds of
   TFLOP/s), so the rule minimises transfers first and recomputation second.
5. Chunks get what is left of the budget (at most ``max_elements`` elements per chunk step).

The budget: ``bigl.device_budget_gb`` (GB = 10^9 bytes), default ``auto``: on CUDA the device's
free memory when the encoder is built minus a margin of 10 % of its total memory (at least
1 GiB: allocator fragmentation, cuDNN workspaces, the aggregator); on the CPU the host *is* the
device, so ``auto`` sets no budget (the configured ``bigl.stages`` plan, the paper's, runs as
before), while a number bounds the step's activation memory by recomputation, on the same code
path a GPU takes.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from wsi_pipeline.bigl.batchnorm import uses_batch_stats
from wsi_pipeline.bigl.units import Unit, UnitGeometry, resnet_units
from wsi_pipeline.models.encoders import ResNet

__all__ = ["StepPlan", "UnitMemory", "unit_memory", "plan_step", "manual_plan", "default_budget_bytes", "resolve_budget", "GB"]

GB = 10**9
#: Adam: weights, gradients and two moments per parameter
STATE_FACTOR = 4
#: output rows of a chunk step the checkpoints leave room for (halo rows then cost a few per cent)
PREFERRED_ROWS = 64
#: the default budget's margin: this share of the CUDA device's memory, at least MIN_MARGIN bytes
MARGIN_FRACTION = 0.10
MIN_MARGIN = 1 << 30


def default_budget_bytes(device: torch.device | str) -> int | None:
    """``auto``: the CUDA device's free memory minus the margin; None (no budget) elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(free - max(MIN_MARGIN, MARGIN_FRACTION * total)))


def resolve_budget(value: float | str | None, device: torch.device | str) -> int | None:
    """Budget in bytes from ``bigl.device_budget_gb``: a number of GB, ``"auto"`` or None (no budget)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"bigl.device_budget_gb={value!r}; expected a number of GB, 'auto' or null")
        return default_budget_bytes(device)
    if isinstance(value, bool) or not value > 0:
        raise ValueError(f"bigl.device_budget_gb={value!r}; expected a number of GB > 0, 'auto' or null")
    return int(value * GB)


@dataclass(frozen=True)
class UnitMemory:
    """Per-unit bytes of a step (see the module docstring)."""

    name: str
    saved: int
    output: int
    largest: int


def unit_memory(model: ResNet, shape: tuple[int, ...], dtype: torch.dtype, *, grad: bool = True) -> list[UnitMemory]:
    """Saved, output and largest-activation bytes of every unit for an input of ``shape`` in ``dtype``.

    A plain forward on meta tensors (the model's current train/eval modes; nothing allocated, the
    model's own tensors untouched) under saved-tensor hooks: each storage autograd saves is
    counted once, in the unit where it is first saved.
    """
    meta = {k: torch.empty_like(v, device="meta", dtype=dtype if v.is_floating_point() else v.dtype)
            for k, v in itertools.chain(model.named_parameters(), model.named_buffers())}
    seen: dict[int, int] = {}
    params = {v.untyped_storage()._cdata for v in meta.values()}  # counted in the state, not here

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t

    marks: list[tuple[str, int, int, int]] = []
    largest = [0]

    def leaf_hook(_m, _i, out) -> None:
        if isinstance(out, torch.Tensor):
            largest[0] = max(largest[0], out.numel() * out.element_size())

    def unit_hook(name: str):
        def hook(_m, _i, out) -> None:
            marks.append((name, sum(seen.values()), out.numel() * out.element_size(), largest[0]))
            largest[0] = 0
        return hook

    ends: list[tuple[nn.Module, str]] = [(model.maxpool, "stem")]
    for i, stage in enumerate(model.stages(), start=1):
        ends += [(b, f"layer{i}.{k}") for k, b in stage.named_children()]
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(leaf_hook) for m in leaves] + [m.register_forward_hook(unit_hook(n)) for m, n in ends]
    x = torch.empty(tuple(shape), dtype=dtype, device="meta", requires_grad=grad)
    # a cumulative average (momentum None, as BatchNorm calibration sets it) reads the batch count as
    # a number, which a meta tensor has not; the count does not change what is saved or its size
    cumulative = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None]
    for m in cumulative:
        m.momentum = 0.1
    try:
        # outside any active dispatch mode (a FLOP counter, a test's recorder): this forward is
        # bookkeeping, not part of the step
        with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.set_grad_enabled(grad):
            torch.func.functional_call(model, meta, (x,))
    finally:
        for h in handles:
            h.remove()
        for m in cumulative:
            m.momentum = None
    out, prev = [], 0
    for name, cum, o, big in marks:
        out.append(UnitMemory(name, cum - prev if grad else 0, o, big))
        prev = cum
    return out


@dataclass(frozen=True)
class StepPlan:
    """Where a step's activations live (see the module docstring for the rule).

    Attributes
    ----------
    shape, dtype, transfer_dtype
        The input; the dtype the image and the checkpoints travel and rest in.
    budget
        Bytes (None: no budget, plain).
    units
        Names of all units, in order.
    offloaded
        How many units (a prefix) run as fused runs; 0: the plain step.
    places
        ``"device"`` or ``"host"`` for each checkpoint: the image, then the outputs of runs
        1 .. offloaded-1.
    checkpoint_bytes
        Bytes of each checkpoint.
    chunk_elements
        Working elements of one chunk step.
    plain_estimate, estimate
        Estimated device peak (bytes) of the plain step and of this plan.
    grad
        Whether the plan is for a training step (False: a forward without gradient).
    """

    shape: tuple[int, ...]
    dtype: str
    transfer_dtype: str
    budget: int | None
    units: tuple[str, ...]
    offloaded: int
    places: tuple[str, ...]
    checkpoint_bytes: tuple[int, ...]
    chunk_elements: int
    plain_estimate: int
    estimate: int
    grad: bool = True

    @property
    def plain(self) -> bool:
        return self.offloaded == 0

    def minimum_bytes(self, input_grad: bool = False) -> tuple[int, int]:
        """``(host -> device, device -> host)`` bytes the plan cannot do without.

        Plain: the input once. Else: the image once when it stays on the device, once per pass
        (forward, backward) when it lives on the host; every host checkpoint out and in forward,
        in (for the recompute) in backward, and its gradient out and in; the image's gradient out
        when it needs one.
        """
        img = self.checkpoint_bytes[0] if self.checkpoint_bytes else 0
        if self.plain:
            return img, img if (input_grad and self.grad) else 0
        passes = 2 if self.grad else 1
        h2d = img if self.places[0] == "device" else passes * img
        d2h = img if (input_grad and self.grad) else 0
        for place, b in zip(self.places[1:], self.checkpoint_bytes[1:]):
            if place == "host":
                h2d += (3 if self.grad else 1) * b
                d2h += (2 if self.grad else 1) * b
        return h2d, d2h

    def describe(self) -> str:
        """A few lines for the log and the run folder."""
        n, *rest = self.shape
        what = f"input [{n}, {', '.join(map(str, rest))}] {self.dtype}"
        budget = "no device budget" if self.budget is None else f"device budget {self.budget / GB:.2f} GB"
        head = f"Big-Layers plan ({what}, {budget}; {'training step' if self.grad else 'forward only'}): "
        if self.plain:
            return head + (f"plain step, nothing offloaded (estimated {self.plain_estimate / GB:.2f} GB"
                           + (" fits)" if self.budget is not None else ")"))
        runs = ", ".join(self.units[: self.offloaded])
        lines = [head + f"the plain step needs an estimated {self.plain_estimate / GB:.2f} GB; "
                 f"{self.offloaded} of {len(self.units)} units run as fused runs ({runs}), estimated {self.estimate / GB:.2f} GB",
                 f"  checkpoints ({self.transfer_dtype}): "
                 + "; ".join(f"{'image' if i == 0 else self.units[i - 1] + ' output'} {b / GB:.2f} GB on the {p}"
                             for i, (p, b) in enumerate(zip(self.places, self.checkpoint_bytes))),
                 f"  chunk steps of at most {self.chunk_elements} elements; the rest of the network runs plain on the device"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def manual_plan(model: ResNet, shape: tuple[int, ...], offloaded: int, places: tuple[str, ...], chunk_elements: int, *,
                dtype: torch.dtype = torch.float32, cast: torch.dtype | None = None, grad: bool = True) -> StepPlan:
    """A plan chosen by hand (experiments, tests): ``offloaded`` units as fused runs, checkpoint
    ``places`` (``"device"``/``"host"``, the image first), ``chunk_elements`` per chunk step."""
    shape = tuple(int(s) for s in shape)
    units = resnet_units(model)
    if not 0 <= offloaded <= len(units):
        raise ValueError(f"offloaded={offloaded}; expected 0..{len(units)} units")
    if len(places) != offloaded or any(p not in ("device", "host") for p in places):
        raise ValueError(f"places={places!r}; expected {offloaded} of 'device' or 'host'")
    if offloaded and chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements}; expected >= 1")
    act = cast or dtype
    mem = unit_memory(model, shape, act, grad=grad)
    n_in = 1
    for s in shape:
        n_in *= s
    ckpts = (n_in * torch.empty((), dtype=act).element_size(),) + tuple(m.output for m in mem[: max(offloaded - 1, 0)])
    return StepPlan(shape=shape, dtype=str(dtype).replace("torch.", ""), transfer_dtype=str(act).replace("torch.", ""),
                    budget=None, units=tuple(u.name for u in units), offloaded=offloaded, places=tuple(places),
                    checkpoint_bytes=ckpts, chunk_elements=int(chunk_elements), plain_estimate=0, estimate=0, grad=grad)


def _state_bytes(model: nn.Module) -> int:
    return STATE_FACTOR * sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class _UnitCosts:
    """Per unit, run as a fused run: working elements of its smallest chunk step (one output row
    of one sample; ``0`` rows for an empty unit), of the smallest chunk step and of the chunk step
    checkpoints leave room for, and the passes over its input (all; backward only)."""

    row_min: list[int]
    sample_min: list[int]
    sample_pref: list[int]
    reads: list[int]
    grad_reads: list[int]


def _unit_costs(units: list[Unit], shape: tuple[int, ...], grad: bool, max_elements: int) -> _UnitCosts:
    # geometry of every unit for this input, for the minimum chunk of each
    n, c, h, w = shape
    geos = []
    for u in units:
        g = UnitGeometry(u, c, h, w)
        geos.append(g)
        c, h, w = g.c_out, g.h_out, g.w_out
    row_min = [g.row_elements(1) if g.sample_elements() > 0 else 0 for g in geos]
    # passes over its input of each unit as a fused run: 1 + (batch-statistics BatchNorms on its
    # longest chain) forward, as many backward (statistics / sums passes, then the pass itself)
    levels = [max(sum(op.kind == "bn" and uses_batch_stats(op.bn) for op in ops) for ops in (u.main, u.shortcut or []))
              for u in units]
    grad_reads = [1 + lv for lv in levels] if grad else [0] * len(units)
    reads = [1 + lv + g for lv, g in zip(levels, grad_reads)]
    sample_min = [min(g.sample_elements(), g.row_elements(1)) for g in geos]
    # the chunk step checkpoints leave room for: PREFERRED_ROWS output rows (or one sample) of
    # every run, so that halo rows stay a small share; one row where that does not fit
    sample_pref = [min(g.sample_elements(), g.row_elements(min(PREFERRED_ROWS, g.h_out)), max_elements) for g in geos]
    return _UnitCosts(row_min, sample_min, sample_pref, reads, grad_reads)


class _Option(NamedTuple):
    """A plan with ``k`` units offloaded: host-checkpoint bytes moved, checkpoint places and bytes,
    chunk elements and the estimated device peak (bytes)."""

    moved: int
    k: int
    places: tuple[str, ...]
    ckpts: tuple[int, ...]
    chunk: int
    estimate: int


def _offload_option(k: int, mem: list[UnitMemory], costs: _UnitCosts, *, image: int, budget: int, state: int,
                    work_f: int, esize: int, grad: bool, max_elements: int) -> _Option | None:
    """The checkpoint places for ``k`` units as fused runs (module docstring, rules 2-3; None: it does not fit)."""
    rest = mem[k:]
    device_part = sum(m.saved for m in rest) + (work_f * max(m.largest for m in rest) if rest else mem[-1].output)
    ckpts = [image] + [m.output for m in mem[: k - 1]]
    reads, grad_reads = costs.reads, costs.grad_reads
    # what a checkpoint costs on the host: read by every pass of the run it feeds, written
    # once, its gradient written once and read by every backward pass of the run before
    cost = [reads[0] * ckpts[0]] + [(reads[j] + 1 + (grad_reads[j - 1] + 1 if grad else 0)) * b
                                    for j, b in enumerate(ckpts[1:], start=1)]
    option = None
    for reserve in (max(costs.sample_min[:k]), max(max(costs.sample_pref[:k]), max(costs.sample_min[:k]))):
        free = budget - state - device_part - reserve * esize
        if free < 0:
            break
        places = ["host"] * len(ckpts)
        for j in sorted(range(len(ckpts)), key=lambda j: (-cost[j], j)):
            if ckpts[j] <= free:
                places[j] = "device"
                free -= ckpts[j]
        moved = sum(c for c, p in zip(cost, places) if p == "host")
        chunk = min(max_elements, free // esize + reserve)
        resident = sum(b for b, p in zip(ckpts, places) if p == "device")
        option = _Option(moved, k, tuple(places), tuple(ckpts), int(chunk), state + device_part + resident + chunk * esize)
        if moved == 0:
            break  # nothing but the image crosses the bus: small chunks only cost halo recomputation
    return option


def plan_step(
    model: ResNet,
    shape: tuple[int, ...],
    budget: int | None,
    *,
    dtype: torch.dtype = torch.float32,
    cast: torch.dtype | None = None,
    grad: bool = True,
    max_elements: int = 2**27,
) -> StepPlan:
    """The plan for one step of ``model`` on an input of ``shape`` (see the module docstring).

    Parameters
    ----------
    budget
        Device bytes (None: no budget: the plain step).
    dtype
        The input's dtype; ``cast``: the autocast dtype the convolutions compute in (None:
        ``dtype``), in which activations, checkpoints and the image travel.
    grad
        A training step (True) or a forward without gradient.
    max_elements
        Most working elements of one chunk step.

    Raises
    ------
    ValueError
        When the step does not fit even with every unit offloaded and every checkpoint on the host.
    """
    shape = tuple(int(s) for s in shape)
    act = cast or dtype
    esize = torch.empty((), dtype=act).element_size()
    mem = unit_memory(model, shape, act, grad=grad)
    units = resnet_units(model)
    names = tuple(u.name for u in units)
    n_in = 1
    for s in shape:
        n_in *= s
    image = n_in * esize
    x_host = n_in * torch.empty((), dtype=dtype).element_size()
    state = _state_bytes(model) if grad else sum(p.numel() * p.element_size() for p in model.parameters())
    work_f = 2 if grad else 3
    plain = state + x_host + sum(m.saved for m in mem) + work_f * max(m.largest for m in mem)
    plain_plan = StepPlan(shape=shape, dtype=str(dtype).replace("torch.", ""), transfer_dtype=str(act).replace("torch.", ""),
                          budget=budget, units=names, offloaded=0, places=(), checkpoint_bytes=(image,), chunk_elements=0,
                          plain_estimate=plain, estimate=plain, grad=grad)
    if budget is None or plain <= budget:
        return plain_plan
    costs = _unit_costs(units, shape, grad, max_elements)
    best: _Option | None = None
    for k in range(1, len(units) + 1):
        option = _offload_option(k, mem, costs, image=image, budget=budget, state=state, work_f=work_f, esize=esize,
                                 grad=grad, max_elements=max_elements)
        if option is not None and (best is None or option.moved < best.moved):
            best = option
        if best is not None and best.moved == 0:
            break
    if best is not None:
        short = [(name, m) for name, m in zip(names[: best.k], costs.sample_min[: best.k]) if m > max_elements]
        if short:
            name, m = max(short, key=lambda um: um[1])
            raise ValueError(f"max_elements={max_elements} is too small for the fused run {name}: one output row of one sample "
                             f"needs {m} working elements; use max_elements >= {m}")
        return replace(plain_plan, offloaded=best.k, places=best.places, checkpoint_bytes=best.ckpts,
                       chunk_elements=best.chunk, estimate=best.estimate)
    need = state + mem[-1].output + max(costs.row_min) * esize
    raise ValueError(
        f"device budget {budget / GB:.3f} GB is too small for a step on input {list(shape)}: even with every unit "
        f"offloaded and every checkpoint in host memory it needs about {need / GB:.3f} GB; raise bigl.device_budget_gb"
    )
