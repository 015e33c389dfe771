"""Fused runs: a whole unit (the stem, or a residual block) chunk by chunk on the device.

Only the unit's input and output exist whole (on the device or in host memory, as the plan
places them, :mod:`wsi_pipeline.bigl.budget`); every intermediate tensor (convolution outputs,
BatchNorm outputs, ReLUs, the max-pool's input) exists only as the rows of one chunk
(:mod:`wsi_pipeline.bigl.units`). Nothing is saved for backward but the input: the backward pass
recomputes each chunk's forward from it (activation checkpointing, chunk by chunk).

Passes over the chunks, in order (``L`` = most batch-statistics BatchNorms before, or after, one
BatchNorm on its path through the unit: 0 for the stem, 1 for a BasicBlock, 2 for a Bottleneck;
without batch statistics, e.g. ``bn: frozen``, only the two unnamed passes run):

- ``stats0 .. statsL`` (forward, training BatchNorm only): pass ``l`` computes each chunk up to
  the inputs of the BatchNorms with ``l`` batch-statistics BatchNorms before them (recomputing the
  earlier layers, whose statistics the earlier passes found) and merges their per-channel count,
  mean and M2 over the chunk's *owned* rows (Chan et al.), the Big-Layers paper's two-pass
  scheme extended to a chain; running statistics are then updated once, as ``nn.BatchNorm2d``.
- ``forward``: each chunk's output rows, written to the output.
- ``backward-sums0 .. sumsL`` (training BatchNorm only): pass ``l`` recomputes each chunk, takes
  the gradient at the outputs of the BatchNorms with ``l`` batch-statistics BatchNorms after them
  (those after use the sums found already) and adds ``sum(dy)`` and ``sum(dy * xhat)`` over the
  chunk's rows (linear in ``dy``, so the halo rows' partial gradients add up exactly).
- ``backward``: each chunk recomputed with autograd, its input gradient (halo rows summed, as
  for one convolution) and the parameter gradients. A batch-statistics BatchNorm's input
  gradient is ``gamma * invstd * (dy - (sum_dy + xhat * sum_dy_xhat) / N)``: the linear part on
  every row the chunk computes, the constant part on its owned rows only, so each row gets it
  once.

Exact up to rounding, in every dtype: the same operations on the same values as the whole
tensor, in another summation order. Under autocast (of the compute device) the convolutions run
in the autocast dtype, BatchNorm keeps its input's dtype with float32 statistics, as plain autocast
(:mod:`wsi_pipeline.bigl.precision`); the parameters' gradients are in their own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from wsi_pipeline.bigl.batchnorm import Moments, finish_stats, momentum_factor, uses_batch_stats
from wsi_pipeline.bigl.conv import GradStitcher, pad_rows
from wsi_pipeline.bigl.precision import math_dtype
from wsi_pipeline.bigl.chunk_loop import ChunkRunner
from wsi_pipeline.bigl.units import Op, OpRange, Unit, UnitChunk, UnitGeometry, conv_padding, plan_unit

__all__ = ["FusedRun", "bn_levels"]

_DIMS = (0, 2, 3)


def _c4(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1)


def bn_levels(ops: list[Op], batch: set[int]) -> tuple[dict[int, int], dict[int, int]]:
    """For every batch-statistics BatchNorm of a chain (ids in ``batch``): how many such
    BatchNorms come before it, and how many after it."""
    idx = [id(op) for op in ops if op.kind == "bn" and id(op) in batch]
    return {k: i for i, k in enumerate(idx)}, {k: len(idx) - 1 - i for i, k in enumerate(idx)}


@dataclass(eq=False)
class _BNState:
    """One BatchNorm of a run: its module, whether it uses batch statistics, and per call the
    statistics (math dtype) and the backward sums."""

    op: Op
    batch: bool
    mean: torch.Tensor | None = None
    invstd: torch.Tensor | None = None
    count: int = 0
    s_dy: torch.Tensor | None = None
    s_dy_xhat: torch.Tensor | None = None
    moments: Moments = field(default_factory=Moments)

    @property
    def module(self) -> nn.BatchNorm2d:
        return self.op.bn

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, invstd)`` of this call (set by the statistics passes)."""
        if self.mean is None or self.invstd is None:
            raise RuntimeError(f"internal error in a fused run: {self.op.name} is used before its statistics pass")
        return self.mean, self.invstd

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum(dy), sum(dy * xhat))`` of this call (set by the backward-sums passes)."""
        if self.s_dy is None or self.s_dy_xhat is None:
            raise RuntimeError(f"internal error in a fused run: {self.op.name} is used before its backward-sums pass")
        return self.s_dy, self.s_dy_xhat


class _BNChunkFn(torch.autograd.Function):
    """Batch-statistics BatchNorm on one chunk, with the exact whole-tensor input gradient.

    Forward: ``(x - mean) * invstd * gamma + beta`` with the whole tensor's statistics. Backward:
    ``gamma * invstd * dy`` on every row, minus ``gamma * invstd * (s_dy + xhat * s_dy_xhat) / N``
    on the owned rows ``[own0, own1)`` (relative to the chunk); ``dgamma = sum(dy * xhat)``,
    ``dbeta = sum(dy)`` over the chunk (they add up over chunks).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, st: _BNState,
                own0: int, own1: int) -> torch.Tensor:
        mean, invstd = st.stats()
        xhat = (x.to(math_dtype(x.dtype)) - _c4(mean)) * _c4(invstd)
        y = xhat if weight is None else xhat * _c4(weight)
        if bias is not None:
            y = y + _c4(bias)
        ctx.save_for_backward(x, weight)
        ctx.st, ctx.own, ctx.bias_dtype = st, (own0, own1), None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        st: _BNState = ctx.st
        acc = math_dtype(x.dtype)
        dym = dy.to(acc)
        mean, invstd = st.stats()
        xhat = (x.to(acc) - _c4(mean)) * _c4(invstd)
        k = invstd if weight is None else invstd * weight.to(acc)
        dx = dym * _c4(k)
        o0, o1 = ctx.own
        if o1 > o0:
            s_dy, s_dy_xhat = st.sums()
            corr = (_c4(s_dy) + xhat[:, :, o0:o1] * _c4(s_dy_xhat)) * _c4(k / st.count)
            dx[:, :, o0:o1] -= corr
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g_w = (dym * xhat).sum(dim=_DIMS).to(weight.dtype) if need_w and weight is not None else None
        g_b = dym.sum(dim=_DIMS).to(ctx.bias_dtype) if need_b and ctx.bias_dtype is not None else None
        return (dx.to(x.dtype) if need_x else None), g_w, g_b, None, None, None


class _Stop(Exception):
    pass


class FusedRun:
    """Runs one unit as a fused run on ``runner``'s device within ``max_elements`` per chunk.

    Parameters
    ----------
    unit
        The unit (:func:`~wsi_pipeline.bigl.units.resnet_units`); its modules hold the parameters
        and BatchNorm buffers (shared with the model).
    runner
        Compute device and transfer machinery.
    max_elements
        Working elements of one chunk step (:meth:`UnitGeometry.working_elements`).
    """

    def __init__(self, unit: Unit, runner: ChunkRunner, max_elements: int) -> None:
        self.unit, self.runner, self.max_elements = unit, runner, int(max_elements)
        self._plans: dict[tuple[int, ...], tuple[UnitGeometry, list[UnitChunk]]] = {}

    def plan(self, shape: tuple[int, ...]) -> tuple[UnitGeometry, list[UnitChunk]]:
        """Geometry and chunks for an input of ``shape`` (cached)."""
        key = tuple(int(s) for s in shape)
        if key not in self._plans:
            n, c, h, w = key
            geo = UnitGeometry(self.unit, c, h, w)
            self._plans[key] = (geo, plan_unit(geo, n, self.max_elements))
        return self._plans[key]

    def __call__(self, x: torch.Tensor, *, cast: torch.dtype | None, x_resident: bool, y_resident: bool) -> torch.Tensor:
        """Output of the unit for input ``x`` (differentiable in ``x`` and the unit's parameters).

        ``x_resident`` / ``y_resident``: the input lives / the output is to live on the compute
        device (else in host memory, the output in a buffer of ``runner.buffers``).
        """
        params = self.unit.parameters()
        return _FusedFn.apply(x, _Call(self, cast, x_resident, y_resident), *params)


@dataclass(eq=False)
class _Call:
    run: FusedRun
    cast: torch.dtype | None
    x_resident: bool
    y_resident: bool
    bns: dict[int, _BNState] = field(default_factory=dict)


# ---- one chunk ----------------------------------------------------------------------------------
class _Chunk:
    """Computes one chunk: the chains of ops on row ranges, with the BatchNorm behaviour of a pass."""

    def __init__(self, call: _Call, ch: UnitChunk, *, params_grad: bool, mode: str, targets: set[int] | None = None,
                 known: set[int] | None = None) -> None:
        self.call, self.ch, self.params_grad, self.mode = call, ch, params_grad, mode
        self.targets = targets or set()
        self.known = known or set()
        self.cut: list[tuple[_BNState, torch.Tensor, torch.Tensor]] = []  # sums passes: (bn, output leaf, input)

    @overload
    def _p(self, p: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _p(self, p: None) -> None: ...
    def _p(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None:
            return None
        return p if self.params_grad else p.detach()

    @overload
    def _cast(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _cast(self, t: None) -> None: ...
    def _cast(self, t: torch.Tensor | None) -> torch.Tensor | None:
        cast = self.call.cast
        return t if t is None or cast is None or t.dtype == cast else t.to(cast)

    def _window(self, op: Op, t: torch.Tensor, r: OpRange) -> torch.Tensor:
        if op.kind == "conv":
            m = op.conv
            padding = conv_padding(m, op.name)
            w, b = self._cast(self._p(m.weight)), self._cast(self._p(m.bias))
            t = self._cast(t)
            if r.native:
                return F.conv2d(t, w, b, m.stride, padding, m.dilation, m.groups)
            t = pad_rows(t, r.pad_top, r.pad_bottom)
            return F.conv2d(t, w, b, m.stride, (0, padding[1]), m.dilation, m.groups)
        pool = op.pool
        k, s, p, d = (op._pair(v) for v in (pool.kernel_size, pool.stride, pool.padding, pool.dilation))
        if r.native:
            return F.max_pool2d(t, k, s, p, d)
        t = pad_rows(t, r.pad_top, r.pad_bottom, value=float("-inf"))
        return F.max_pool2d(t, k, s, (0, p[1]), d)

    def _bn(self, st: _BNState, t: torch.Tensor, r: OpRange) -> torch.Tensor:
        bn = st.module
        w, b = self._p(bn.weight), self._p(bn.bias)
        key = id(st.op)
        if t.is_meta:
            return self._bn_meta(st, t, r)
        if not st.batch:  # running statistics: an affine map autograd differentiates directly
            if bn.running_mean is None or bn.running_var is None:
                raise ValueError(f"{st.op.name}: running statistics are not tracked; expected batch statistics")
            acc = math_dtype(t.dtype)
            mean = bn.running_mean.to(acc)
            invstd = torch.rsqrt(bn.running_var.to(acc) + bn.eps)
            y = (t.to(acc) - _c4(mean)) * _c4(invstd)
            if w is not None:
                y = y * _c4(w)
            if b is not None:
                y = y + _c4(b)
            return y.to(t.dtype)
        own0, own1 = _owned(st, r)
        if self.mode == "stats" and key in self.targets:
            st.moments.add(t[:, :, own0:own1])
            raise _Stop
        if self.mode == "sums" and key in self.targets:
            with torch.no_grad():
                y = _BNChunkFn.apply(t, w, b, st, own0, own1)
            y = y.detach().requires_grad_(True)
            self.cut.append((st, y, t))
            return y
        if self.mode in ("sums", "backward") and key in self.known:
            return _BNChunkFn.apply(t, w, b, st, own0, own1)
        with torch.no_grad():  # forward passes: statistics known, nothing to differentiate
            return _BNChunkFn.apply(t, w, b, st, own0, own1)

    def _bn_meta(self, st: _BNState, t: torch.Tensor, r: OpRange) -> torch.Tensor:
        """Dry runs: the same passes, shapes and dtypes with BatchNorm as the identity (it moves no
        bytes and FlopCounterMode counts no FLOPs for it; meta elementwise kernels are slow)."""
        key = id(st.op)
        if self.mode == "stats" and key in self.targets:
            own0, own1 = _owned(st, r)
            st.moments.n += t.shape[0] * (own1 - own0) * t.shape[3]
            if st.moments.mean is None:
                st.moments.mean = st.moments.m2 = torch.zeros(t.shape[1], dtype=math_dtype(t.dtype), device=t.device)
            raise _Stop
        if self.mode == "sums" and key in self.targets:
            y = t.detach().requires_grad_(True)
            self.cut.append((st, y, t))
            return y
        return t

    def chain(self, ops: list[Op], ranges: tuple[OpRange, ...], x: torch.Tensor, off: int) -> tuple[torch.Tensor, int]:
        """Run ``ops`` on ``x`` (rows ``[off, off + x.shape[2])``); returns the output and its first row."""
        t = x
        for op, r in zip(ops, ranges):
            sl = t[:, :, r.a - off : r.b - off]
            if op.kind in ("conv", "maxpool"):
                win = op.geometry(0)
                t = self._window(op, sl, r)
                off = (r.a - r.pad_top + win.padding) // win.stride
            elif op.kind == "bn":
                t = self._bn(self.call.bns[id(op)], sl, r)
                off = r.a
            else:  # relu
                t = sl if sl.is_meta else F.relu(sl)
                off = r.a
        return t, off

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """The chunk's output rows ``[o0, o1)`` (None in a statistics pass)."""
        unit, ch = self.call.run.unit, self.ch
        outs = []
        for ops, ranges in ((unit.main, ch.main), (unit.shortcut or [], ch.shortcut)):
            if ops and self.mode == "stats" and not any(id(op) in self.targets for op in ops):
                continue  # nothing to measure on this path in this pass
            try:
                outs.append(self.chain(ops, ranges, x, ch.a) if ops else (x, ch.a))
            except _Stop:
                pass
        if self.mode == "stats":
            return None
        main, m_off = outs[0]
        y = main[:, :, ch.o0 - m_off : ch.o1 - m_off]
        if unit.residual:
            short, s_off = outs[1]
            y = torch.add(y, short[:, :, ch.o0 - s_off : ch.o1 - s_off]).to(y.dtype)  # as plain ``out += identity``
            return y if y.is_meta else F.relu(y)
        return y


    def output(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`run` in a pass that has an output (every pass but a statistics pass)."""
        y = self.run(x)
        if y is None:
            raise RuntimeError(f"internal error in fused run {self.call.run.unit.name}: a {self.mode} pass has no output")
        return y


def _owned(st: _BNState, r: OpRange) -> tuple[int, int]:
    """The rows of the chunk BatchNorm ``st`` owns, relative to the rows it reads."""
    if r.own is None:
        raise RuntimeError(f"internal error in a fused run: {st.op.name} has no owned rows")
    return r.own[0] - r.a, r.own[1] - r.a


# ---- the autograd Function ----------------------------------------------------------------------
class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: _Call, *params: torch.Tensor) -> torch.Tensor:
        run, runner = call.run, call.run.runner
        unit = run.unit
        geo, chunks = run.plan(tuple(x.shape))
        n = x.shape[0]
        name = unit.name
        # BatchNorm modes of this call, and the running-statistics factors (counted once per call)
        factors = {}
        batch_ids: set[int] = set()
        for op in unit.ops():
            if op.kind == "bn":
                st = _BNState(op, uses_batch_stats(op.bn))
                call.bns[id(op)] = st
                if st.batch:
                    batch_ids.add(id(op))
                    factors[id(op)] = momentum_factor(op.bn)
        levels = {}
        for ops in (unit.main, unit.shortcut or []):
            levels.update(bn_levels(ops, batch_ids)[0])
        def load_x(i: int, ch: UnitChunk) -> tuple[torch.Tensor]:
            return (x[ch.n0 : ch.n1, :, ch.a : ch.b],)

        with torch.no_grad():
            for lev in range(max(levels.values(), default=-1) + 1):
                targets = {k for k, v in levels.items() if v == lev}

                def stats(i: int, ch: UnitChunk, ins, targets=targets):
                    _Chunk(call, ch, params_grad=False, mode="stats", targets=targets).run(ins[0])
                    return ()

                runner.run(f"{name}/stats{lev}", chunks, load_x, stats, resident_in=(call.x_resident,), signature=_sig)
                for k in targets:
                    st = call.bns[k]
                    count = n * geo_rows(geo, st.op)
                    st.mean, st.count = st.moments.mean, count
                    if st.moments.n != count and not x.is_meta:  # (dry runs replay chunks without counting them)
                        raise RuntimeError(f"internal error in fused run {name}: {st.op.name} statistics over "
                                           f"{st.moments.n} values, expected {count}")
                    if st.moments.mean is None or st.moments.m2 is None:
                        raise RuntimeError(f"internal error in fused run {name}: no statistics for {st.op.name}")
                    st.invstd = finish_stats(st.module, st.op.name, st.moments.mean, st.moments.m2, count, factors[k],
                                             [n, st.module.num_features])
                    st.moments = Moments()
            out_shape = (n, geo.c_out, geo.h_out, geo.w_out)
            dtype = _out_dtype(call, x)
            if call.y_resident:
                y = torch.empty(out_shape, dtype=dtype, device=runner.device, memory_format=torch.channels_last)
            else:
                y = runner.buffers.acquire(f"{name}/out", out_shape, dtype)

            def forward(i: int, ch: UnitChunk, ins: Sequence[torch.Tensor]) -> tuple[torch.Tensor]:
                return (_Chunk(call, ch, params_grad=False, mode="forward").output(ins[0]),)

            runner.run(f"{name}/forward", chunks, load_x, forward,
                       lambda i, ch: (y[ch.n0 : ch.n1, :, ch.o0 : ch.o1],),
                       resident_in=(call.x_resident,), resident_out=(call.y_resident,), signature=_sig)
        ctx.call, ctx.batch_ids, ctx.n_params = call, batch_ids, len(params)
        ctx.save_for_backward(x)
        if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
            runner.buffers.release(x)  # no backward will read it
        return y if call.y_resident else y.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor):
        (x,) = ctx.saved_tensors
        call: _Call = ctx.call
        run, runner = call.run, call.run.runner
        unit = run.unit
        name = unit.name
        geo, chunks = run.plan(tuple(x.shape))
        params = unit.parameters()
        need_x = ctx.needs_input_grad[0]
        need_p = list(ctx.needs_input_grad[2 : 2 + len(params)])
        rlevels = {}
        for ops in (unit.main, unit.shortcut or []):
            rlevels.update(bn_levels(ops, ctx.batch_ids)[1])
        gy_res = call.y_resident
        def load(i: int, ch: UnitChunk) -> tuple[torch.Tensor, torch.Tensor]:
            return x[ch.n0 : ch.n1, :, ch.a : ch.b], gy[ch.n0 : ch.n1, :, ch.o0 : ch.o1]

        res_in = (call.x_resident, gy_res)
        known: set[int] = set()
        for k in ctx.batch_ids:
            st = call.bns[k]
            st.s_dy = st.s_dy_xhat = None
        for lev in range(max(rlevels.values(), default=-1) + 1):
            targets = {k for k, v in rlevels.items() if v == lev}

            def sums(i: int, ch: UnitChunk, ins, targets=targets):
                xc, gc = ins
                c = _Chunk(call, ch, params_grad=False, mode="sums", targets=targets, known=known)
                with torch.enable_grad():
                    out = c.output(xc)
                    grads = torch.autograd.grad(out, [leaf for _, leaf, _ in c.cut], gc.to(out.dtype))
                for (st, _, xin), g in zip(c.cut, grads):
                    if g.is_meta:
                        st.s_dy = st.s_dy_xhat = torch.zeros(g.shape[1], dtype=math_dtype(g.dtype), device=g.device)
                        continue
                    acc = math_dtype(xin.dtype)
                    gm = g.to(acc)
                    mean, invstd = st.stats()
                    xhat = (xin.to(acc) - _c4(mean)) * _c4(invstd)
                    s1, s2 = gm.sum(dim=_DIMS), (gm * xhat).sum(dim=_DIMS)
                    st.s_dy = s1 if st.s_dy is None else st.s_dy + s1
                    st.s_dy_xhat = s2 if st.s_dy_xhat is None else st.s_dy_xhat + s2
                return ()

            runner.run(f"{name}/backward-sums{lev}", chunks, load, sums, resident_in=res_in, signature=_sig)
            known.update(targets)
        grads: list[torch.Tensor | None] = [None] * len(params)
        gx = None
        if need_x:
            if call.x_resident:
                gx = torch.empty(x.shape, dtype=x.dtype, device=runner.device, memory_format=torch.channels_last)
            else:
                gx = runner.buffers.acquire(f"{name}/grad_in", tuple(x.shape), x.dtype)
        stitch = GradStitcher(chunks, x.shape[2])
        if gx is not None:
            stitch.zero_gaps(gx)
        wanted = [p for p, need in zip(params, need_p) if need]

        def backward(i: int, ch: UnitChunk, ins):
            xc, gc = ins
            c = _Chunk(call, ch, params_grad=True, mode="backward", known=known)
            with torch.enable_grad():
                xg = xc.detach().requires_grad_(need_x)
                out = c.output(xg)
                inputs = ([xg] if need_x else []) + wanted
                got = list(torch.autograd.grad(out, inputs, gc.to(out.dtype), allow_unused=True) if inputs else ())
            g_in = got.pop(0) if need_x else None
            j = 0
            for k, need in enumerate(need_p):
                if need:
                    g = got[j]
                    j += 1
                    if g is not None:
                        prev = grads[k]
                        grads[k] = g if prev is None else prev.add_(g)
            if not need_x:
                return ()
            if g_in is None:
                g_in = torch.zeros_like(xc)
            return (stitch.take(i, g_in.to(x.dtype)),)

        runner.run(f"{name}/backward", chunks, load, backward,
                   (lambda i, ch: (stitch.dest(i, ch, gx),)) if gx is not None else None,  # gx exists exactly when need_x
                   resident_in=res_in, resident_out=(call.x_resident,),
                   signature=lambda i, ch: (_sig(i, ch), stitch.writes[i].end - ch.a, stitch.writes[i].keep))
        for k, (p, need) in enumerate(zip(params, need_p)):
            if need and grads[k] is None:
                grads[k] = torch.zeros_like(p)
        runner.buffers.release(x)
        runner.buffers.release(gy)
        return (gx if (gx is None or call.x_resident) else gx.detach(), None, *grads)


def _sig(i: int, ch: UnitChunk) -> tuple:
    """Chunks with equal signatures load, compute and return tensors of equal shapes (dry-run replay)."""
    return (ch.samples, ch.o1 - ch.o0, ch.b - ch.a,
            tuple((r.b - r.a, r.pad_top, r.pad_bottom, r.native) for r in ch.main + ch.shortcut))


def geo_rows(geo: UnitGeometry, op: Op) -> int:
    """Height x width of the tensor BatchNorm ``op`` normalises (values per channel per sample)."""
    for ops, shapes in ((geo.unit.main, geo.main), (geo.unit.shortcut or [], geo.shortcut)):
        for j, o in enumerate(ops):
            if o is op:
                _, h, w = shapes[j + 1]
                return h * w
    raise KeyError(op.name)


def _out_dtype(call: _Call, x: torch.Tensor) -> torch.dtype:
    """The unit's output dtype: the convolutions' (autocast dtype, else the input's)."""
    return call.cast if call.cast is not None else x.dtype

