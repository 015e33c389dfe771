"""``make bench-bigl``: what Big-Layers cost, predicted from counts and measured, as the paper's Table 4.

Part 1, predicted: device-budget plans (``bigl.device_budget_gb``, :mod:`wsi_pipeline.bigl.budget`).
For ResNet-18 and -50 (``--predict-models``), bags of 256..2048 tiles of 256 px and whole images of
4096..32768 px (``--budget-configs``), device budgets of 8, 24 and 80 GB (``--budgets``) and
batch-statistics and frozen BatchNorm (``--bn``): one training step counted on meta tensors (the
plan, bytes each way, the plan's minimum and the ratio, FLOPs with the recomputation, bytes under
bf16 autocast), its predicted time on PCIe 4 and 5 (overlapped as the runner does), over the
plain step's compute time, beside the plain step (where it fits the budget) and exact
accumulation (bags). Counts, not timings: they do not depend on the machine running the bench.

Part 1b, predicted: the fixed plan (``bigl.device_budget_gb: null``, the paper's; ``--predict-models``, ``--predict-sides``, default
4096..32768 px; plain and 0..4 Big-Layer stages): one training step (forward + backward, batch 1,
float32) is run on meta tensors (:mod:`wsi_pipeline.bigl.traffic`: shapes only, seconds per
step) under the transfer instrumentation and ``torch.utils.flop_counter``. Printed per
configuration and side: bytes host -> device and device -> host (chunks with their halo rows,
BatchNorm's second sweeps, the hand-off to the device stages and its gradient), that volume over
the plan's minimum (each Big-Layer's input and output moved once per pass: forward ``x + y``,
backward ``x + dy`` in and ``dx`` out), the step's FLOPs, and predicted step times of the plain
and the Big-Layers model on stated devices: PCIe 4.0 x16 at 25 GB/s and PCIe 5.0 x16 at 50 GB/s
per direction, compute at ``--efficiency`` (default 0.3) of an H100 SXM's dense TF32 peak,
494.7 TFLOP/s (PyTorch runs float32 convolutions as TF32 on it by default), serial and with the
runner's copy-compute overlap. With the pointwise layers on the host (bigify's default), their
ReLU, max-pool and residual add run on host memory between the passes: the bytes those ops read
and write (``host GB``) are added, serially, at ``--host-rate`` GB/s, by default the rate a probe
measures on the machine running the bench (the stem's ReLU and max-pool, forward and backward;
printed first). The counts are not timings: they do not depend on the load of the machine that
runs the bench; the host rate does. The plain step's input upload is part of its time; its
activations are not checked against device memory, so at large sides the plain time (and the
``/ plain`` ratio) is that of a device big enough to hold them.

Row labels count Big-Layers as the paper does: its Table 4 labels ResNet-18 with 0..3 stages
2/6/10/14 and ResNet-50 with 0..4 stages 2/11/23/41/50, which is 2 for the stem (conv1 and bn1)
plus one per main-path convolution of each converted block, the 1x1 downsample shortcut not
counted (:func:`wsi_pipeline.bigl.traffic.paper_big_layers`). This project's modules (every
BigConv2d and BigBatchNorm2d, shortcuts included: 2/10/20/30/40 and 2/22/48/86/106) are given
beside it. The paper's exponents b and doubling factors are printed beside ours.

Part 2, measured (``--model``; skipped with ``--no-timing``): for the plain encoder and for 0..k Big-Layer stages, the per-iteration time (forward +
backward + Adam step) of one image ``[batch, 3, S, S]`` is measured against the side S
(``--warmup`` untimed + ``--repeats`` timed iterations per point, 5 + 10 by default as in the
paper). For each configuration the fit ``t(A) = a A^b + c`` (A = S^2 px, a, b, c >= 0) gives
a, b, c, R^2 and the doubling factor ``F = t(2 A_med) / t(A_med)`` at the median tested area.
At the largest side every configuration ran, the Big-Layers / plain time ratio is printed,
with (on CUDA) the peak device memory, the host<->device volume of one iteration and the rate
it implies next to the measured pinned-memory bandwidth. On CUDA every measured point is then
printed beside part 1b's prediction of the same step on this machine (copies at the measured
pinned bandwidth, host work at the probe's rate) and beside the prediction without host work.

Defaults follow the device: on CPU small sides (the whole run takes a few minutes on two
cores); on CUDA sides up to 16384 px, where the plain model runs out of memory first. The
input lives in host memory for every configuration (the plain model copies it to the device
inside the timed iteration). Examples::

    python -m benchmarks.bigl                                   # device defaults
    python -m benchmarks.bigl --quick                           # predictions at 4096, 8192 px; short timing
    python -m benchmarks.bigl --warmup 1 --repeats 2 --sides 96 128 160   # quick
    python -m benchmarks.bigl --device cuda --memory-fraction 0.25 --sides 8192 16384
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["PowerLawFit", "fit_power_law", "main"]

CPU_SIDES = (256, 320, 384, 448, 512)
CUDA_SIDES = (2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384)
CPU_MAX_ELEMENTS = 1 << 18  # 1 MiB of float32: chunking happens at every CPU side
CUDA_MAX_ELEMENTS = 1 << 27  # 512 MiB of float32 per chunk step
PREDICT_SIDES = (4096, 8192, 16384, 32768)
QUICK_PREDICT_SIDES = (4096, 8192)
QUICK_CPU_SIDES = (96, 128, 160)
#: part 1's inputs: bags of 256 px tiles and whole images
BUDGET_CONFIGS = ("256x256", "512x256", "1024x256", "2048x256", "4096", "8192", "16384", "32768")
QUICK_BUDGET_CONFIGS = ("512x256", "8192")
BUDGETS_GB = (8.0, 24.0, 80.0)
#: chunk cap of the budget table (working elements); the budget itself bounds it too
BUDGET_MAX_ELEMENTS = 1 << 30
#: H100 SXM5 dense TF32 tensor-core peak (FLOP/s); float32 convolutions run as TF32 by default
H100_TF32_PEAK = 494.7e12
#: effective host <-> device bandwidth per direction (bytes/s) of x16 links
LINKS = (("PCIe4 x16", 25e9), ("PCIe5 x16", 50e9))
#: The paper's Table 4: stages (None = baseline) -> (its Big-Layer count, b, F_dbl)
PAPER_TABLE4: dict[str, dict[int | None, tuple[int, float, float]]] = {
    "resnet18": {None: (0, 1.03, 2.00), 0: (2, 0.83, 1.78), 1: (6, 1.48, 2.48), 2: (10, 1.24, 2.36), 3: (14, 1.41, 2.57)},
    "resnet50": {None: (0, 1.00, 1.98), 0: (2, 0.83, 1.77), 1: (11, 2.57, 5.04), 2: (23, 1.90, 3.74), 3: (41, 2.01, 3.77),
                 4: (50, 1.68, 3.20)},
}


@dataclass(frozen=True)
class PowerLawFit:
    """``t(A) = a * A**b + c`` fitted to mean iteration times (s) against areas (px)."""

    n: int
    a: float
    b: float
    c: float
    r2: float
    f_dbl: float

    def __call__(self, area: float) -> float:
        return self.a * area**self.b + self.c


def _nonneg_linear(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Least squares ``t ~ a x + c`` with a, c >= 0 (two unknowns: check the boundaries)."""
    candidates = []
    design = np.stack([x, np.ones_like(x)], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, t, rcond=None)
    if a >= 0 and c >= 0:
        candidates.append((a, c))
    candidates.append((max(0.0, float(x @ t / (x @ x))) if x @ x > 0 else 0.0, 0.0))
    candidates.append((0.0, max(0.0, float(t.mean()))))
    return min(candidates, key=lambda ac: float(((ac[0] * x + ac[1] - t) ** 2).sum()))


def fit_power_law(areas: list[float], times: list[float]) -> PowerLawFit:
    """Fit ``t(A) = a A^b + c`` with a, b, c >= 0.

    A grid over b (each b solved exactly for a, c >= 0) starts scipy's bounded least squares.

    Parameters
    ----------
    areas
        Image areas A (px, S^2 per sample), at least 3 distinct values.
    times
        Mean seconds per iteration at each area.

    Returns
    -------
    PowerLawFit
        With R^2 on the original scale and F_dbl = t(2 A_med) / t(A_med).
    """
    if len(areas) < 3:
        raise ValueError(f"need at least 3 sizes to fit a, b and c, got {len(areas)}; pass more --sides")
    A = np.asarray(areas, dtype=float)
    t = np.asarray(times, dtype=float)
    scale = float(np.median(A))
    x = A / scale  # fit in units of the median area: a is then of order t

    def sse(b: float) -> tuple[float, float, float]:
        xb = x**b
        a, c = _nonneg_linear(xb, t)
        return float(((a * xb + c - t) ** 2).sum()), a, c

    best = min((sse(b) + (b,) for b in np.linspace(0.0, 4.0, 401)), key=lambda r: r[0])
    _, a_s, c_s, b = best
    try:
        from scipy.optimize import OptimizeWarning, curve_fit

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)  # covariance unused
            (a_s, b, c_s), _ = curve_fit(
                lambda xx, a, bb, c: a * xx**bb + c, x, t, p0=(max(a_s, 1e-12), b, max(c_s, 0.0)),
                bounds=([0.0, 0.0, 0.0], [np.inf, 6.0, np.inf]), maxfev=20000,
            )
    except (ImportError, RuntimeError, ValueError):
        pass  # the grid solution stands
    pred = a_s * x**b + c_s
    ss_res = float(((t - pred) ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    a = float(a_s) / scale**b
    fit = PowerLawFit(len(A), a, float(b), float(c_s), r2, 1.0)
    a_med = scale
    return PowerLawFit(fit.n, fit.a, fit.b, fit.c, fit.r2, fit(2 * a_med) / fit(a_med))


@dataclass
class Point:
    """Measurements of one configuration at one side."""

    side: int
    times: list[float] = field(default_factory=list)  # by the clock chosen with --clock (s)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    oom: bool = False
    peak_mib: float | None = None
    moved_mib: float | None = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        return statistics.stdev(self.times) if len(self.times) > 1 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _build(name: str, stages: int | None, device: torch.device, max_elements: int,
           pointwise: str = "host") -> torch.nn.Module:
    from wsi_pipeline.bigl import bigify
    from wsi_pipeline.models import build_encoder

    torch.manual_seed(0)
    model = build_encoder(name)
    if stages is None:
        return model.to(device).train()
    return bigify(model, stages=stages, max_elements=max_elements, device=device, pointwise=pointwise).train()


def _count_big_layers(model: torch.nn.Module) -> tuple[int, int]:
    """(the paper's count, this project's module count) of Big-Layers in ``model``."""
    from wsi_pipeline.bigl.traffic import module_big_layers, paper_big_layers

    return paper_big_layers(model), module_big_layers(model)


def measure(model: torch.nn.Module, big: bool, side: int, batch: int, device: torch.device, warmup: int, repeats: int,
            clock: str = "wall") -> Point:
    """Time ``warmup + repeats`` iterations (forward, backward, Adam step) at one side.

    ``clock="wall"`` (the paper's) times wall-clock seconds; ``"cpu"`` the process CPU seconds,
    which on a shared machine measure the work without other processes' interference (CPU
    device only; on CUDA wall time is the measure).
    """
    from wsi_pipeline.bigl import monitor_transfers

    point = Point(side)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, weight_decay=1e-4)
    x = torch.randn(batch, 3, side, side)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last).pin_memory() if big else x.pin_memory()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        y = model(x if big else x.to(device, non_blocking=True))
        y.float().square().mean().backward()
        opt.step()

    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            step()
        _sync(device)
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            _sync(device)
            point.wall.append(time.perf_counter() - t0)
            point.cpu.append(time.process_time() - c0)
        point.times = list(point.cpu if clock == "cpu" else point.wall)
        if device.type == "cuda":
            point.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
        if big:
            with monitor_transfers() as mon:
                step()
                _sync(device)
            point.moved_mib = (mon.to_device_bytes() + mon.to_host_bytes()) / 2**20  # chunks and the hand-off
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        point.oom, point.times, point.wall, point.cpu = True, [], [], []
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return point


def pinned_bandwidth(device: torch.device, mib: int = 256) -> tuple[float, float]:
    """Measured host->device and device->host bandwidth (GB/s) with pinned host memory."""
    n = mib * 2**20 // 4
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device=device)
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        _sync(device)
        rates.append(5 * n * 4 / (time.perf_counter() - t0) / 1e9)
    return rates[0], rates[1]


def host_rate_probe(side: int = 2048, repeats: int = 3) -> float:
    """Bytes per second (read plus written) this machine's CPU achieves on the work a fixed plan leaves on the host.

    The stem's ReLU (in place) and 3x3 / 2 max-pool of a ``[1, 64, side / 2, side / 2]`` float32 channels-last
    activation (made by a multiplication, as the BatchNorm output the ReLU overwrites), forward and backward through
    autograd as a Big-Layers step runs them, outputs newly allocated each time as there; bytes as
    :class:`~wsi_pipeline.bigl.traffic.HostWork` counts them (every argument and result, the multiplication's and the
    gradient's accumulation included), counted in one untimed run; the median wall time of ``repeats`` timed runs
    after one more untimed.
    """
    import torch.nn.functional as F

    from wsi_pipeline.bigl.traffic import HostWork

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, side // 2, side // 2, generator=gen).contiguous(memory_format=torch.channels_last)
    g = torch.randn(1, 64, side // 4, side // 4, generator=gen).contiguous(memory_format=torch.channels_last)

    def run() -> None:
        a = x.detach().requires_grad_(True) * 1.0  # a non-leaf activation, as the BatchNorm output the ReLU overwrites
        F.max_pool2d(torch.relu_(a), 3, 2, 1).backward(g)

    with HostWork(on_host=True) as counter:
        run()
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return counter.total / statistics.median(times)


def _label(stages: int | None, n_big: tuple[int, int]) -> str:
    """The paper's row label (its Big-Layer count), with this project's module count beside it."""
    if stages is None:
        return "Baseline (whole model on device)"
    return f"No. of Big-Layer stages = {stages} ({n_big[0]} Big-Layers; {n_big[1]} modules)"


def _paper(model: str, stages: int | None) -> tuple[int, float, float] | None:
    return PAPER_TABLE4.get(model, {}).get(stages)


def _host_rate_words(host_rate: float, probed: bool) -> str:
    if math.isinf(host_rate):
        return "host work (the pointwise layers a fixed plan leaves on the host) not counted (--host-rate inf)"
    how = "measured on this machine's CPU by the probe (--host-rate to state one)" if probed else "as given (--host-rate)"
    return f"host work (the pointwise layers a fixed plan leaves on the host) at {host_rate / 1e9:.1f} GB/s read + written, {how}"


def predict_table(models: list[str], stages: list[int], sides: list[int], efficiency: float, max_elements: int,
                  host_rate: float = math.inf, probed: bool = False) -> list[dict]:
    """Part 1: count every configuration on meta tensors, print the predicted-overhead table, return its rows.
    ``host_rate``: bytes/s of the host's pointwise work (``inf``: not counted); ``probed``: it was measured here."""
    from wsi_pipeline.bigl.traffic import DeviceModel, dry_step, predict

    rate = efficiency * H100_TF32_PEAK
    devices = [DeviceModel(f"{link}, H100 at {efficiency:.0%} of TF32 peak", bw, rate, host_rate) for link, bw in LINKS]
    print(f"Predicted training step (forward + backward, [1, 3, S, S] float32, max_elements {max_elements}), from counts on meta "
          f"tensors; compute at {efficiency:.0%} of an H100 SXM's {H100_TF32_PEAK / 1e12:.1f} TFLOP/s dense TF32 peak = "
          f"{rate / 1e12:.0f} TFLOP/s; copies at " + ", ".join(f"{d.bandwidth / 1e9:.0f} GB/s ({link})" for (link, _), d in zip(LINKS, devices))
          + f" per direction; {_host_rate_words(host_rate, probed)}, serial with the rest. x min: bytes moved over the plan's "
          "minimum (each Big-Layer's input and output once per pass). host GB: bytes the host's pointwise ops read and write. "
          "serial / overlap: predicted seconds without / with copy-compute overlap; / plain: overlap over the plain step.")
    rows: list[dict] = []
    for name in models:
        print(f"\n{name}")
        head = f"{'configuration':<56} {'side':>6} {'H2D GB':>8} {'D2H GB':>8} {'x min':>6} {'host GB':>8} {'TFLOP':>7}"
        for link, _ in LINKS:
            head += f" | {link + ' serial':>17} {'overlap':>8} {'/ plain':>7}"
        print(head)
        plain_time: dict[tuple[int, str], float] = {}
        for cfg in [None, *stages]:
            for side in sides:
                t0 = time.perf_counter()
                tr = dry_step(name, cfg, side, max_elements=max_elements)
                n_big = (0, 0)
                if cfg is not None:
                    n_big = _count_big_layers(_dry_model(name, cfg, max_elements))
                line = (f"{_label(cfg, n_big):<56} {side:>6} {tr.h2d / 1e9:>8.2f} {tr.d2h / 1e9:>8.2f} {tr.over_minimum:>6.2f} "
                        f"{tr.host_bytes / 1e9:>8.2f} {tr.flops / 1e12:>7.2f}")
                row: dict[str, Any] = {"model": name, "stages": cfg, "label": _label(cfg, n_big), "side": side, "h2d_bytes": tr.h2d,
                       "d2h_bytes": tr.d2h, "minimum_bytes": tr.minimum, "host_bytes": tr.host_bytes, "flops": tr.flops,
                       "predicted": {}}
                for dev, (link, _) in zip(devices, LINKS):
                    serial, overlap = predict(tr, dev, plain=cfg is None)
                    if cfg is None:
                        plain_time[(side, link)] = overlap
                    ratio = overlap / plain_time[(side, link)] if (side, link) in plain_time else math.nan
                    line += f" | {serial:>17.3f} {overlap:>8.3f} {ratio:>7.1f}"
                    row["predicted"][link] = {"serial_s": serial, "overlap_s": overlap, "over_plain": ratio}
                print(line + f"   ({time.perf_counter() - t0:.0f} s to count)", flush=True)
                rows.append(row)
    _predicted_exponents(rows, models, stages, sides)
    return rows


def _parse_config(text: str) -> tuple[int, int]:
    """``512x256`` (a bag of 512 tiles of 256 px) or ``8192`` (one whole image of 8192 px) -> (batch, side)."""
    try:
        if "x" in text:
            n, side = text.split("x")
            return int(n), int(side)
        return 1, int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxS (a bag of N tiles of S px) or S (one image of S px)") from None


def _config_label(n: int, side: int) -> str:
    return f"{n} tiles x {side} px" if n > 1 else f"{side} px image"


def budget_table(models: list[str], configs: list[tuple[int, int]], budgets: list[float], efficiency: float,
                 max_elements: int, bn_modes: list[str], bf16: bool) -> list[dict]:
    """Part 1: device-budget plans, counted on meta tensors; print the table, return its rows."""
    from wsi_pipeline.bigl.budget import GB
    from wsi_pipeline.bigl.traffic import DeviceModel, dry_budget_step, dry_forward_flops, predict

    rate = efficiency * H100_TF32_PEAK
    devices = [DeviceModel(link, bw, rate) for link, bw in LINKS]
    pcie5 = devices[-1]
    print(f"Device-budget plans (bigl.device_budget_gb), predicted from counts on meta tensors: one training step (forward + "
          f"backward, float32) of the encoder; compute at {efficiency:.0%} of an H100 SXM's {H100_TF32_PEAK / 1e12:.1f} TFLOP/s dense "
          f"TF32 peak = {rate / 1e12:.0f} TFLOP/s (convolutions only, recomputation included; BatchNorm, ReLU and pooling not "
          "modelled), copies at " + ", ".join(f"{d.bandwidth / 1e9:.0f} GB/s ({d.name})" for d in devices)
          + " per direction, overlapped with compute as the runner does. GB = 1e9 bytes.\n"
          "plan: 'plain' (the step fits) or 'k fused' units (stem, blocks) recomputed chunk by chunk, 'h host' of their checkpoints "
          "in host memory; min: the bytes the plan cannot do without (the image once, or once per pass from the host; host "
          "checkpoints out and in, their gradients out and in); x min: moved / min; step: predicted seconds; / comp: over the plain "
          "step's compute time (PCIe5); plain: the plain step (compute + input upload) where it fits the budget, else the memory it "
          "needs; accum: exact accumulation (an extra forward without gradient, the bag uploaded twice, exact with frozen BatchNorm "
          "only; bags only)" + ("; bf16 GB: bytes moved (both ways) when the step runs under bf16 autocast, planned for bf16"
                                 if bf16 else "") + ".")
    rows: list[dict] = []
    for bn in bn_modes:
        for name in models:
            print(f"\n{name}, BatchNorm {'batch statistics (bn: train)' if bn == 'train' else 'running statistics (bn: frozen)'}")
            head = (f"{'input':<22} {'budget':>6} {'plan':<16} {'H2D GB':>7} {'D2H GB':>7} {'min GB':>7} {'x min':>6} {'TFLOP':>7} "
                    + " ".join(f"{d.name.split()[0] + ' step':>11}" for d in devices)
                    + f" {'/ comp':>7} {'plain':>13} {'accum':>7}" + (f" {'bf16 GB':>8}" if bf16 else ""))
            print(head)
            for n, side in configs:
                t0 = time.perf_counter()
                plain, plain_plan = dry_budget_step(name, n, side, None, bn=bn, max_elements=max_elements)
                comp = plain.flops / rate
                plain_step = comp + plain.h2d / pcie5.bandwidth
                acc = None
                if n > 1:
                    fwd = dry_forward_flops(name, n, side)
                    acc = (plain.flops + fwd) / rate + 2 * plain.h2d / pcie5.bandwidth
                for budget in budgets:
                    b = int(budget * GB)
                    try:
                        tr, plan = dry_budget_step(name, n, side, b, bn=bn, max_elements=max_elements)
                    except ValueError as e:
                        print(f"{_config_label(n, side):<22} {budget:>6g} does not fit: {e}")
                        continue
                    steps = [predict(tr, d, plain=plan.plain)[1] for d in devices]
                    what = "plain" if plan.plain else f"{plan.offloaded} fused, {plan.places.count('host')} host"
                    fits = plain_plan.plain_estimate <= b
                    plain_cell = f"{plain_step:.3f}" if fits else f"needs {plain_plan.plain_estimate / GB:.0f} GB"
                    acc_cell = f"{acc:.3f}" if acc is not None else "-"
                    line = (f"{_config_label(n, side):<22} {budget:>6g} {what:<16} {tr.h2d / GB:>7.2f} {tr.d2h / GB:>7.2f} "
                            f"{tr.minimum / GB:>7.2f} {tr.over_minimum:>6.2f} {tr.flops / 1e12:>7.2f} "
                            + " ".join(f"{t:>11.3f}" for t in steps) + f" {steps[-1] / comp:>7.2f} {plain_cell:>13} {acc_cell:>7}")
                    row = {"model": name, "bn": bn, "batch": n, "side": side, "budget_gb": budget, "plan": plan.to_dict(),
                           "h2d_bytes": tr.h2d, "d2h_bytes": tr.d2h, "minimum_bytes": tr.minimum, "flops": tr.flops,
                           "plain_flops": plain.flops, "plain_estimate_bytes": plain_plan.plain_estimate,
                           "predicted_s": {d.name: t for d, t in zip(devices, steps)}, "plain_compute_s": comp,
                           "plain_step_s": plain_step if fits else None, "accumulate_step_s": acc}
                    if bf16:
                        tb, _ = dry_budget_step(name, n, side, b, bn=bn, max_elements=max_elements, cast=torch.bfloat16)
                        line += f" {(tb.h2d + tb.d2h) / GB:>8.2f}"
                        row["bf16_moved_bytes"] = tb.h2d + tb.d2h
                    print(line, flush=True)
                    rows.append(row)
                print(f"{'':<22} ({time.perf_counter() - t0:.0f} s to count)", flush=True)
    return rows


def _dry_model(name: str, stages: int, max_elements: int) -> torch.nn.Module:
    from wsi_pipeline.bigl import bigify
    from wsi_pipeline.models import build_encoder

    with torch.device("meta"):
        model = build_encoder(name)
    return bigify(model, stages=stages, max_elements=max_elements, device="meta")


def _predicted_exponents(rows: list[dict], models: list[str], stages: list[int], sides: list[int]) -> None:
    """Fit t(A) = a A^b + c to the predicted (overlapped, PCIe 4) times; print b beside the paper's."""
    if len(sides) < 3:
        print("\n(predicted exponents need >= 3 --predict-sides; the paper's b per row: "
              + "; ".join(f"{m} " + ", ".join(f"{'plain' if c is None else c}: {v[1]:.2f}" for c, v in PAPER_TABLE4.get(m, {}).items())
                          for m in models) + ")")
        return
    link = LINKS[0][0]
    print(f"\nExponent b of t(A) = a A^b + c fitted to the predicted times ({link}, overlapped) beside the paper's Table 4 b and F_dbl")
    for name in models:
        for cfg in [None, *stages]:
            pts = [r for r in rows if r["model"] == name and r["stages"] == cfg]
            fit = fit_power_law([r["side"] ** 2 for r in pts], [r["predicted"][link]["overlap_s"] for r in pts])
            paper = _paper(name, cfg)
            ref = f"paper b {paper[1]:.2f}, F_dbl {paper[2]:.2f}" if paper else "paper: no row"
            print(f"  {name:<9} {pts[0]['label']:<56} predicted b {fit.b:.2f}, F_dbl {fit.f_dbl:.2f}   {ref}")


def _write_json(path: Path, payload: dict) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bigl",
        description="Per-iteration time of plain vs Big-Layers ResNets against input side, with the power-law fit of the Big-Layers paper's Table 4.",
    )
    p.add_argument("--model", default="resnet18", help="encoder name (resnet18, resnet50, ...); default resnet18")
    p.add_argument("--device", default=None, help="compute device (cpu, cuda, cuda:1); default cuda when available, else cpu")
    p.add_argument("--sides", type=int, nargs="+", default=None,
                   help=f"input sides S in px (image [batch, 3, S, S]); default CPU {list(CPU_SIDES)}, CUDA {list(CUDA_SIDES)}")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="Big-Layer stage counts to run (0..4); default 0 1 2 3")
    p.add_argument("--no-plain", action="store_true", help="skip the plain (baseline) model")
    p.add_argument("--pointwise", choices=("host", "device"), default="host",
                   help="where the Big-Layers' ReLU, max-pool and residual add run: host (default, as bigl.pointwise) or "
                        "device (chunked there too)")
    p.add_argument("--batch", type=int, default=1, help="images per iteration (a bag is e.g. --batch 256 --sides 256); default 1")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per point; default 5 (paper)")
    p.add_argument("--repeats", type=int, default=10, help="timed iterations per point; default 10 (paper)")
    p.add_argument("--max-elements", type=int, default=None,
                   help=f"Big-Layer chunk budget in elements; default CPU {CPU_MAX_ELEMENTS}, CUDA {CUDA_MAX_ELEMENTS}")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="CUDA only: cap this process at this fraction of device memory (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what is timed: wall-clock seconds (default, as the paper) or process CPU seconds "
                        "(robust on a busy shared CPU machine; CPU device only)")
    p.add_argument("--out", type=Path, default=None, help="also write all measurements and fits to this JSON file (atomically)")
    p.add_argument("--quick", action="store_true",
                   help=f"predictions at sides {list(QUICK_PREDICT_SIDES)} only; timing (CPU) at {list(QUICK_CPU_SIDES)} px with "
                        "1 warm-up + 2 timed iterations and stages 0 1 2 (explicit flags still win)")
    p.add_argument("--predict-models", nargs="+", default=["resnet18", "resnet50"],
                   help="encoders of the predicted table (part 1); default resnet18 resnet50")
    p.add_argument("--predict-sides", type=int, nargs="+", default=None,
                   help=f"input sides of the predicted table in px; default {list(PREDICT_SIDES)} ({list(QUICK_PREDICT_SIDES)} with --quick)")
    p.add_argument("--predict-stages", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="Big-Layer stages of the predicted table; default 0..4")
    p.add_argument("--predict-max-elements", type=int, default=CUDA_MAX_ELEMENTS,
                   help=f"chunk budget (elements) of the predicted table; default {CUDA_MAX_ELEMENTS} (the CUDA default)")
    p.add_argument("--host-rate", type=float, default=None, metavar="GB_PER_S",
                   help="bytes (1e9) per second the host reads and writes for the pointwise layers a fixed plan leaves there "
                        "(pointwise on the host); default: measured on this machine by a probe (the stem's ReLU and max-pool, "
                        "forward and backward, about a second); inf leaves host work out of the predictions")
    p.add_argument("--efficiency", type=float, default=0.3,
                   help="share of the H100's dense TF32 peak the predicted compute reaches; default 0.3")
    p.add_argument("--budget-configs", type=_parse_config, nargs="+", default=None,
                   help="inputs of the device-budget table: NxS = a bag of N tiles of S px, S = one image of S px; default "
                        f"{' '.join(BUDGET_CONFIGS)} ({' '.join(QUICK_BUDGET_CONFIGS)} with --quick)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS_GB),
                   help=f"device budgets in GB (1e9 bytes) of the device-budget table; default {' '.join(f'{b:g}' for b in BUDGETS_GB)}")
    p.add_argument("--bn", nargs="+", choices=("train", "frozen"), default=["train", "frozen"],
                   help="BatchNorm of the device-budget table: train (batch statistics) and/or frozen; default both")
    p.add_argument("--budget-max-elements", type=int, default=BUDGET_MAX_ELEMENTS,
                   help=f"chunk cap (working elements) of the device-budget table; default {BUDGET_MAX_ELEMENTS}")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 column of the device-budget table (one more count per row)")
    p.add_argument("--no-budget", action="store_true", help="skip the device-budget table (part 1)")
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed-plan table (part 1b, the paper's plan)")
    p.add_argument("--no-predict", action="store_true", help="skip the predicted tables (parts 1 and 1b)")
    p.add_argument("--no-timing", action="store_true", help="skip part 2 (the measured timings)")
    return p


def _measure_all(args: argparse.Namespace, configs: list[int | None], sides: list[int], device: torch.device,
                 max_elements: int) -> tuple[dict[int | None, list[Point]], dict[int | None, str]]:
    """Time every configuration (plain, or Big-Layers in the first k stages) at every side, smallest first,
    stopping a configuration at its first out-of-memory side; returns (points, labels) per configuration."""
    cuda = device.type == "cuda"
    results: dict[int | None, list[Point]] = {}
    labels: dict[int | None, str] = {}
    for cfg in configs:
        model = _build(args.model, cfg, device, max_elements, args.pointwise)
        labels[cfg] = _label(cfg, _count_big_layers(model))
        results[cfg] = []
        for side in sides:
            t0 = time.perf_counter()
            pt = measure(model, cfg is not None, side, args.batch, device, args.warmup, args.repeats, args.clock)
            results[cfg].append(pt)
            status = "out of memory" if pt.oom else f"{pt.mean:.4f} s +- {pt.std:.4f}"
            print(f"  {labels[cfg]:<56s} S={side:<6d} {status}   ({time.perf_counter() - t0:.0f} s)", flush=True)
            if pt.oom:
                break  # larger sides will not fit either
        del model
        if cuda:
            torch.cuda.empty_cache()
    return results, labels


def _print_per_side(results: dict[int | None, list[Point]], configs: list[int | None], sides: list[int], batch: int,
                    clock: str) -> None:
    """The per-side table: time per iteration (s), mean +- std, of every configuration."""
    print(f"\nPer-iteration time (s, {clock} clock), mean +- std over the timed iterations")
    head = f"{'side':>6} {'area (px)':>12} " + " ".join(f"{('plain' if c is None else f'{c} stages'):>17}" for c in configs)
    print(head)
    for i, side in enumerate(sides):
        cells = []
        for c in configs:
            pts = results[c]
            if i >= len(pts):
                cells.append(f"{'-':>17}")
            elif pts[i].oom:
                cells.append(f"{'OOM':>17}")
            else:
                cells.append(f"{pts[i].mean:>9.4f} +-{pts[i].std:>6.4f}")
        print(f"{side:>6} {side * side * batch:>12} " + " ".join(cells))


def _print_fits(results: dict[int | None, list[Point]], configs: list[int | None], labels: dict[int | None, str],
                sides: list[int], model: str) -> dict[int | None, PowerLawFit | None]:
    """The paper's Table 4: the power-law-plus-offset fit of each configuration (3 sizes or more), beside the paper's."""
    print("\nPower-law-plus-offset fit t(A) = a A^b + c (A = image area in px, t in s)")
    print(f"{'Model':<56} {'n':>3} {'a':>10} {'b':>6} {'c':>10} {'R^2':>6} {'F_dbl':>6} {'b paper':>8} {'F paper':>8}")
    print(model)
    fits: dict[int | None, PowerLawFit | None] = {}
    for c in configs:
        ok = [p for p in results[c] if not p.oom]
        fit = None
        if len(ok) >= 3:
            fit = fit_power_law([p.side**2 for p in ok], [p.mean for p in ok])
            paper = _paper(model, c)
            ref = f" {paper[1]:>8.2f} {paper[2]:>8.2f}" if paper else f" {'-':>8} {'-':>8}"
            print(f"{labels[c]:<56} {fit.n:>3} {fit.a:>10.3e} {fit.b:>6.2f} {fit.c:>10.3e} {fit.r2:>6.2f} {fit.f_dbl:>6.2f}{ref}")
        else:
            print(f"{labels[c]:<56} {len(ok):>3}   (fewer than 3 sizes ran: no fit)")
        fits[c] = fit
    if len(sides) < 4:
        print("note: with 3 sizes a 3-parameter fit is exact (R^2 = 1); use more --sides for a meaningful R^2")
    return fits


def _print_shared_size(results: dict[int | None, list[Point]], configs: list[int | None], labels: dict[int | None, str],
                       sides: list[int], device: torch.device) -> tuple[float, float] | None:
    """At the largest side every configuration ran: time, ratio to plain, (CUDA) peak memory and bytes moved;
    returns the pinned-memory bandwidth (GB/s host->device, device->host) on CUDA, else None."""
    cuda = device.type == "cuda"
    common = [s for s in sides if all(any(p.side == s and not p.oom for p in results[c]) for c in configs)]
    bandwidth = pinned_bandwidth(device) if cuda else None
    if common:
        s = common[-1]
        print(f"\nAt side {s} px (the largest every configuration ran):")
        plain_pt = next((p for p in results.get(None, []) if p.side == s), None)
        cols = f"{'configuration':<56} {'time (s)':>9} {'/ plain':>8}"
        if cuda:
            cols += f" {'peak device MiB':>16}"
        cols += f" {'moved MiB/iter':>15}"
        if cuda:
            cols += f" {'moved GB/s':>11}"
        print(cols)
        for c in configs:
            p = next(p for p in results[c] if p.side == s)
            ratio = f"{p.mean / plain_pt.mean:>8.2f}" if plain_pt else f"{'-':>8}"
            line = f"{labels[c]:<56} {p.mean:>9.4f} {ratio}"
            if cuda:
                line += f" {p.peak_mib:>16.0f}"
            line += f" {p.moved_mib:>15.1f}" if p.moved_mib is not None else f" {'-':>15}"
            if cuda:
                rate = p.moved_mib * 2**20 / p.mean / 1e9 if p.moved_mib else math.nan
                line += f" {rate:>11.2f}"
            print(line)
        if bandwidth:
            print(f"pinned-memory bandwidth: host->device {bandwidth[0]:.1f} GB/s, device->host {bandwidth[1]:.1f} GB/s "
                  f"('moved GB/s' over the whole iteration is a lower bound of what the big layers achieve)")
    else:
        print("\nno side ran in every configuration: no ratio table")
    return bandwidth


def _print_measured_vs_predicted(results: dict[int | None, list[Point]], configs: list[int | None], labels: dict[int | None, str],
                                  args: argparse.Namespace, max_elements: int, bandwidth: tuple[float, float],
                                  host_rate: float) -> list[dict]:
    """CUDA: every measured point beside the fixed plan's prediction of the same step (counted on meta tensors with the
    same stages, chunk budget and pointwise side) on this machine: copies at the slower of the two measured pinned
    bandwidths, compute at ``--efficiency`` of an H100 SXM's dense TF32 peak, host work at ``host_rate``, and without
    the host work (what the prediction was before it was counted). Returns the rows."""
    from wsi_pipeline.bigl.traffic import DeviceModel, dry_step, predict

    bw = min(bandwidth) * 1e9
    dev = DeviceModel("this machine", bw, args.efficiency * H100_TF32_PEAK, host_rate)
    bare = DeviceModel("this machine, host work not counted", bw, args.efficiency * H100_TF32_PEAK)
    print(f"\nMeasured against predicted (copies at {bw / 1e9:.1f} GB/s, the slower pinned direction measured here; compute at "
          f"{args.efficiency:.0%} of {H100_TF32_PEAK / 1e12:.1f} TFLOP/s; host work at {host_rate / 1e9:.1f} GB/s; the measured "
          "iteration also holds the Adam step, which the prediction leaves out)")
    print(f"{'configuration':<56} {'side':>6} {'measured s':>11} {'predicted s':>12} {'meas / pred':>12} {'without host work':>18} "
          f"{'meas / pred':>12}")
    rows = []
    for c in configs:
        for pt in results[c]:
            if pt.oom:
                continue
            tr = dry_step(args.model, c, pt.side, batch=args.batch, max_elements=max_elements, pointwise=args.pointwise)
            with_host = predict(tr, dev, plain=c is None)[1]
            without = predict(tr, bare, plain=c is None)[1]
            print(f"{labels[c]:<56} {pt.side:>6} {pt.mean:>11.4f} {with_host:>12.4f} {pt.mean / with_host:>12.2f} {without:>18.4f} "
                  f"{pt.mean / without:>12.2f}")
            rows.append({"stages": c, "side": pt.side, "measured_s": pt.mean, "predicted_s": with_host,
                         "predicted_without_host_s": without, "host_bytes": tr.host_bytes})
    return rows


def _host_rate(args: argparse.Namespace) -> tuple[float, bool]:
    """The host rate (bytes/s) the predictions use and whether the probe measured it: ``--host-rate``, else the probe's
    (printed) where a prediction uses it (the fixed-plan table, or CUDA timings beside their prediction), else inf."""
    probed = args.host_rate is None
    cuda_timing = not args.no_timing and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not ((not args.no_predict and not args.no_fixed) or cuda_timing):
        return math.inf, probed
    if not probed:
        return args.host_rate * 1e9, probed
    rate = host_rate_probe()
    print(f"host pointwise work (probe: ReLU and max-pool of [1, 64, 1024, 1024] float32, forward and backward, "
          f"{torch.get_num_threads()} threads): {rate / 1e9:.1f} GB/s read + written\n")
    return rate, probed


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--warmup" not in given:
            args.warmup = 1
        if "--repeats" not in given:
            args.repeats = 2
        if "--stages" not in given:
            args.stages = [0, 1, 2]
    if not 0 < args.efficiency <= 1:
        print(f"--efficiency {args.efficiency} must be in (0, 1]", file=sys.stderr)
        return 2
    bad = [s for s in args.predict_stages if not 0 <= s <= 4]
    if bad:
        print(f"--predict-stages {bad} out of range; use 0..4", file=sys.stderr)
        return 2
    if args.host_rate is not None and not args.host_rate > 0:
        print(f"--host-rate {args.host_rate} must be a positive number of GB/s (inf: host work not counted)", file=sys.stderr)
        return 2
    predicted: list[dict] = []
    budget_rows: list[dict] = []
    if not args.no_predict and not args.no_budget:
        budget_configs = args.budget_configs or [_parse_config(c) for c in (QUICK_BUDGET_CONFIGS if args.quick else BUDGET_CONFIGS)]
        budget_rows = budget_table(args.predict_models, budget_configs, args.budgets, args.efficiency, args.budget_max_elements,
                                   args.bn, not args.no_bf16)
        print()
    host_rate, probed = _host_rate(args)
    if not args.no_predict and not args.no_fixed:
        sides_p = sorted(args.predict_sides or (QUICK_PREDICT_SIDES if args.quick else PREDICT_SIDES))
        print("Part 1b: the fixed plan (bigl.device_budget_gb: null, the paper's): every layer of the stem and of the big stages "
              "offloaded, whatever the device holds")
        predicted = predict_table(args.predict_models, sorted(set(args.predict_stages)), sides_p, args.efficiency,
                                  args.predict_max_elements, host_rate, probed)
    if args.no_timing:
        if args.out:
            _write_json(args.out, {"budget": budget_rows, "predicted": predicted, "efficiency": args.efficiency,
                                   "links": dict(LINKS), "h100_tf32_peak": H100_TF32_PEAK, "host_rate": host_rate})
            print(f"\nwrote {args.out}")
        return 0
    print()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda given but CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_fraction is not None:
        if device.type != "cuda":
            print("--memory-fraction applies to CUDA only", file=sys.stderr)
            return 2
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    bad = [s for s in args.stages if not 0 <= s <= 4]
    if bad:
        print(f"--stages {bad} out of range; use 0..4", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    if cuda and args.clock == "cpu":
        print("--clock cpu measures host CPU time only; on CUDA use --clock wall", file=sys.stderr)
        return 2
    sides = sorted(args.sides or (CUDA_SIDES if cuda else (QUICK_CPU_SIDES if args.quick else CPU_SIDES)))
    max_elements = args.max_elements or (CUDA_MAX_ELEMENTS if cuda else CPU_MAX_ELEMENTS)
    configs: list[int | None] = ([] if args.no_plain else [None]) + sorted(set(args.stages))

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"Big-Layers runtime scaling: {args.model}, {device} ({where}), input [{args.batch}, 3, S, S] float32, "
          f"max_elements {max_elements}, pointwise on the {args.pointwise}, {args.warmup} warm-up + {args.repeats} timed iterations per point, "
          f"{args.clock} clock")
    if cuda and args.memory_fraction is not None:
        print(f"device memory capped at {args.memory_fraction:.2f} of {torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB")

    results, labels = _measure_all(args, configs, sides, device, max_elements)

    _print_per_side(results, configs, sides, args.batch, args.clock)
    fits = _print_fits(results, configs, labels, sides, args.model)

    bandwidth = _print_shared_size(results, configs, labels, sides, device)
    against: list[dict] = []
    if bandwidth:
        against = _print_measured_vs_predicted(results, configs, labels, args, max_elements, bandwidth, host_rate)

    if args.out:
        payload = {
            "model": args.model, "device": str(device), "clock": args.clock, "device_name": where, "batch": args.batch,
            "max_elements": max_elements, "warmup": args.warmup, "repeats": args.repeats,
            "memory_fraction": args.memory_fraction,
            "bandwidth_gbps": bandwidth,
            "budget": budget_rows, "predicted": predicted, "efficiency": args.efficiency, "links": dict(LINKS), "h100_tf32_peak": H100_TF32_PEAK,
            "host_rate": host_rate, "measured_vs_predicted": against,
            "configs": [
                {"stages": c, "label": labels[c], "points": [asdict(p) for p in results[c]],
                 "fit": asdict(fits[c]) if fits[c] else None}
                for c in configs
            ],
        }
        _write_json(args.out, payload)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
