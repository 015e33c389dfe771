"""Partitioned BatchNorm2d, exact over the whole host input.

Training forward, two passes over the chunks: (1) per-chunk count, mean and M2 (sum of squared
deviations) merged with Chan et al.'s parallel Welford update; (2) ``y = (x - mean) * invstd *
gamma + beta`` with the biased variance. Running statistics are updated once, as
``nn.BatchNorm2d`` does (momentum or cumulative average, unbiased variance).
Training backward, two passes: (1) ``sum_dy`` and ``sum_dy_xmu`` per channel;
(2) ``dx = gamma * invstd * (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N)``;
``dgamma = sum_dy_xmu * invstd``, ``dbeta = sum_dy``. Eval mode uses the running statistics
and needs one pass each way.

Precision as ``nn.BatchNorm2d`` (also under autocast, where BatchNorm is on no cast list): the
output and the input gradient are in the input's dtype; statistics and arithmetic run in
float32 for bfloat16/float16 inputs (:func:`~wsi_pipeline.bigl.precision.math_dtype`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from wsi_pipeline.bigl.plan import RowChunk, Window, plan_rows
from wsi_pipeline.bigl.precision import math_dtype
from wsi_pipeline.bigl.chunk_loop import ChunkRunner

__all__ = ["BigBatchNorm2d", "Moments", "momentum_factor", "uses_batch_stats", "finish_stats"]

_DIMS = (0, 2, 3)


def _per_channel(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1)


def _plan(layer: BigBatchNorm2d, x: torch.Tensor, n_in: int, n_out: int) -> list[RowChunk]:
    n, c, h, w = x.shape
    return plan_rows(n, h, Window(), in_row=c * w, out_row=c * w, max_elements=layer.max_elements,
                     in_factor=n_in, out_factor=n_out, what=layer.qualname)


def _load_x(x: torch.Tensor):
    return lambda i, ch: (x[ch.n0 : ch.n1, :, ch.a : ch.b],)


def _load_x_dy(x: torch.Tensor, dy: torch.Tensor):
    return lambda i, ch: (x[ch.n0 : ch.n1, :, ch.a : ch.b], dy[ch.n0 : ch.n1, :, ch.a : ch.b])


def _up(t: torch.Tensor) -> torch.Tensor:
    """A chunk in BatchNorm's arithmetic dtype (no copy for float32/float64)."""
    return t.to(math_dtype(t.dtype))


def _rows(t: torch.Tensor):
    return lambda i, ch: (t[ch.n0 : ch.n1, :, ch.a : ch.b],)


class Moments:
    """Per-channel count, mean and M2 (sum of squared deviations) over ``[N, H, W]``, merged chunk
    by chunk with Chan, Golub & LeVeque's parallel update (exact up to rounding, any order)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, xc: torch.Tensor) -> None:
        """Merge chunk ``xc`` ``[n, C, h, w]`` (any floating dtype; computed in BatchNorm's arithmetic dtype)."""
        xc = _up(xc)
        m = xc.numel() // xc.shape[1]
        if m == 0:
            return
        var_b, mean_b = torch.var_mean(xc, dim=_DIMS, correction=0)
        m2_b = var_b * m
        if self.n == 0:
            self.mean, self.m2 = mean_b, m2_b
        else:
            if self.mean is None or self.m2 is None:
                raise RuntimeError(f"internal error: moments over {self.n} values without a mean and M2")
            n_a = self.n
            tot = n_a + m
            delta = mean_b - self.mean
            self.mean = self.mean + delta * (m / tot)
            self.m2 = self.m2 + m2_b + delta * delta * (n_a * m / tot)
        self.n += m


def batch_stats(layer: BigBatchNorm2d, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and M2 over ``[N, H, W]`` of host ``x`` (pass 1), and the count N*H*W."""
    acc = Moments()

    def compute(i: int, ch: RowChunk, ins):
        acc.add(ins[0])
        return ()

    layer.runner.run(f"{layer.qualname}/stats", _plan(layer, x, 1, 0), _load_x(x), compute)
    if acc.mean is None or acc.m2 is None:
        raise ValueError(f"{layer.qualname}: batch statistics of an empty input, shape {tuple(x.shape)}")
    return acc.mean, acc.m2, acc.n


def momentum_factor(bn: nn.BatchNorm2d) -> float:
    """The running-statistics factor of this call, counting the batch as ``nn.BatchNorm2d`` does
    (``num_batches_tracked += 1`` in training; ``momentum=None``: cumulative average)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


def uses_batch_stats(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn`` normalises with batch statistics now (training, or no running statistics)."""
    return bn.training or (bn.running_mean is None and bn.running_var is None)


def finish_stats(bn: nn.BatchNorm2d, name: str, mean: torch.Tensor, m2: torch.Tensor, count: int, factor: float,
                 shape: list[int]) -> torch.Tensor:
    """``invstd`` from merged moments (biased variance), after updating ``bn``'s running statistics
    once, as ``nn.BatchNorm2d`` (unbiased variance); ``shape`` is the input's, for the error."""
    if count <= 1:
        raise ValueError(
            f"{name}: expected more than 1 value per channel when training, got input size {shape}; "
            "use a batch or image with more than one value per channel"
        )
    invstd = torch.rsqrt(m2 / count + bn.eps)
    running_mean, running_var = bn.running_mean, bn.running_var  # both or neither (track_running_stats)
    if running_mean is not None and running_var is not None and bn.training:
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        unbiased = (m2 / (count - 1)).to(running_var.dtype)
        running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
    return invstd


def _summed(sums: dict[str, torch.Tensor | None], key: str, layer: BigBatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """A backward sum every chunk added to (an error when no chunk ran: an empty input)."""
    s = sums[key]
    if s is None:
        raise ValueError(f"{layer.qualname}: backward of an empty input, shape {tuple(x.shape)}")
    return s


class _BigBatchNorm2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                layer: BigBatchNorm2d, use_batch_stats: bool, factor: float) -> torch.Tensor:
        eps = layer.eps
        with torch.no_grad():
            if use_batch_stats:
                mean, m2, count = batch_stats(layer, x)
                invstd = finish_stats(layer, layer.qualname, mean, m2, count, factor, list(x.shape))
            else:
                if layer.running_mean is None or layer.running_var is None:
                    raise ValueError(f"{layer.qualname}: running statistics are not tracked; expected batch statistics")
                acc = math_dtype(x.dtype)
                mean = layer.running_mean.to(acc)
                invstd = torch.rsqrt(layer.running_var.to(acc) + eps)
            scale = invstd if weight is None else invstd * weight
            shift = None if bias is None else bias
            scale4, mean4 = _per_channel(scale), _per_channel(mean)
            shift4 = None if shift is None else _per_channel(shift)
            y = layer.runner.host_empty(x.shape, x.dtype)

            def compute(i: int, ch: RowChunk, ins):
                out = (_up(ins[0]) - mean4) * scale4
                if shift4 is not None:
                    out += shift4
                return (out.to(x.dtype),)

            layer.runner.run(f"{layer.qualname}/normalize", _plan(layer, x, 1, 1), _load_x(x), compute, _rows(y))
        ctx.layer, ctx.use_batch_stats = layer, use_batch_stats
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight, mean, invstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, mean, invstd = ctx.saved_tensors
        layer: BigBatchNorm2d = ctx.layer
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        runner = layer.runner
        mean4 = _per_channel(mean)
        sums: dict[str, torch.Tensor | None] = {"dy": None, "dy_xmu": None}
        gamma_invstd = invstd if weight is None else invstd * weight
        count = x.numel() // x.shape[1]

        def add_sums(xc: torch.Tensor, gc: torch.Tensor) -> None:
            xc, gc = _up(xc), _up(gc)
            s_dy = gc.sum(dim=_DIMS)
            s_dy_xmu = (gc * (xc - mean4)).sum(dim=_DIMS)
            acc_dy, acc_dy_xmu = sums["dy"], sums["dy_xmu"]
            if acc_dy is None or acc_dy_xmu is None:
                sums["dy"], sums["dy_xmu"] = s_dy, s_dy_xmu
            else:  # in place: the tensors in `sums`
                acc_dy += s_dy
                acc_dy_xmu += s_dy_xmu

        gx = runner.host_empty(x.shape, x.dtype) if need_x else None
        if ctx.use_batch_stats:
            # pass 1: the two per-channel reductions every dx depends on
            def reduce(i: int, ch: RowChunk, ins):
                add_sums(*ins)
                return ()

            runner.run(f"{layer.qualname}/backward-sums", _plan(layer, x, 2, 0), _load_x_dy(x, dy), reduce)
            if gx is not None:  # (exactly when need_x)
                k_dy = _per_channel(gamma_invstd)
                mean_dy = _per_channel(_summed(sums, "dy", layer, x) / count)
                k_xmu = _per_channel(invstd * invstd * _summed(sums, "dy_xmu", layer, x) / count)

                def dx(i: int, ch: RowChunk, ins):
                    xc, gc = _up(ins[0]), _up(ins[1])
                    return ((((gc - mean_dy) - (xc - mean4) * k_xmu) * k_dy).to(x.dtype),)

                runner.run(f"{layer.qualname}/backward-dx", _plan(layer, x, 2, 1), _load_x_dy(x, dy), dx, _rows(gx))
        else:
            # running statistics are constants: dx = dy * gamma * invstd, one pass
            k_dy = _per_channel(gamma_invstd)
            want_sums = need_w or need_b

            def dx_eval(i: int, ch: RowChunk, ins):
                xc, gc = ins
                if want_sums:
                    add_sums(xc, gc)
                return ((_up(gc) * k_dy).to(x.dtype),) if need_x else ()

            runner.run(f"{layer.qualname}/backward", _plan(layer, x, 2, 1 if need_x else 0), _load_x_dy(x, dy), dx_eval,
                       _rows(gx) if gx is not None else None)
        g_w = (_summed(sums, "dy_xmu", layer, x) * invstd).to(weight.dtype) if (need_w and weight is not None) else None
        g_b = _summed(sums, "dy", layer, x).to(ctx.bias_dtype) if (need_b and ctx.bias_dtype is not None) else None
        return gx, g_w, g_b, None, None, None


class BigBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` over a host tensor, statistics exact over the whole input.

    Built with :meth:`from_bn`, sharing the Parameters and the running-statistics buffers of
    the wrapped layer (same names; in-place updates are seen by both). Behaves as
    ``nn.BatchNorm2d``: batch statistics in training (and when running statistics are not
    tracked), running statistics in eval mode; ``num_batches_tracked`` and ``momentum=None``
    (cumulative average) as in PyTorch.
    """

    runner: ChunkRunner
    max_elements: int
    qualname: str

    @classmethod
    def from_bn(cls, bn: nn.BatchNorm2d, runner: ChunkRunner, max_elements: int, qualname: str = "bn") -> BigBatchNorm2d:
        """Wrap ``bn`` (its Parameters and buffers are shared, not copied)."""
        big = cls.__new__(cls)
        nn.Module.__init__(big)
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            setattr(big, attr, getattr(bn, attr))
        for name in ("weight", "bias"):
            p = getattr(bn, name)
            if p is None:
                big.register_parameter(name, None)
            else:
                setattr(big, name, p)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            big.register_buffer(name, getattr(bn, name))
        big.runner, big.max_elements, big.qualname = runner, int(max_elements), qualname
        big.train(bn.training)
        return big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` host tensor -> same shape, normalised per channel (host, channels-last)."""
        if x.dim() != 4:
            raise ValueError(f"{self.qualname}: expected a 4-D input [N, C, H, W], got shape {tuple(x.shape)}")
        if not self.runner.is_host(x):
            x = self.runner.to_host(x)
        factor = momentum_factor(self)
        use_batch_stats = uses_batch_stats(self)
        return _BigBatchNorm2dFn.apply(x, self.weight, self.bias, self, use_batch_stats, factor)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_elements={self.max_elements}, device={self.runner.device}"
