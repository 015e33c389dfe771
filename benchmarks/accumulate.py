"""``make bench-accumulate``: exact gradient accumulation vs the full step, resnet18 + ABMIL.

For each bag size, one untimed warm-up step of each method measures the peak bytes saved for
backward (``torch.autograd.graph.saved_tensors_hooks``: live saved tensors, counted when packed
and released when the graph frees them; on CUDA also the peak allocated device memory), then
``--repeats`` timed steps give the median step time. Printed: step times, the ratio
accumulate / full (target <= 1.6 where the full step fits; the theory is about
(2 forwards + 1 backward) / (1 forward + 1 backward) ~ 1.3) and the saved-activation peaks.

Defaults follow the device: on CUDA 256 px tiles and bags 64 / 256 / 1024; on CPU 64 px tiles
and bags 64 / 256 / 1024 so the run finishes in a few minutes. Examples::

    python -m benchmarks.accumulate                      # device defaults
    python -m benchmarks.accumulate --tile-size 256 --bags 16 64 --chunk-size 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks.memory import SavedTensorMeter

__all__ = ["main"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mib(b: float) -> str:
    return f"{b / 2**20:9.1f}"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.accumulate",
        description="Step time and saved-activation memory of accumulate_step vs full_step (resnet18 + ABMIL).",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--bags", type=int, nargs="+", default=None, help="bag sizes in tiles (default 64 256 1024)")
    p.add_argument("--tile-size", type=int, default=None, help="tile side in px (default 256 on cuda, 64 on cpu)")
    p.add_argument("--chunk-size", type=int, default=None, help="tiles per chunk (default 64 on cuda, 32 on cpu)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per method and bag (default 5 cuda, 1 cpu)")
    p.add_argument("--max-full-bag", type=int, default=None,
                   help="skip full_step above this bag size (default: none on cuda, where OOM is caught; 1024 on cpu)")
    p.add_argument("--encoder", default="resnet18", help="registered encoder (default resnet18)")
    p.add_argument("--aggregator", default="abmil", help="registered aggregator (default abmil)")
    p.add_argument("--bn", default="frozen", choices=("frozen", "chunk"), help="BatchNorm policy of accumulate_step")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one row per bag size; return 0."""
    from wsi_pipeline.devices import resolve_device
    from wsi_pipeline.models import build_aggregator, build_encoder
    from wsi_pipeline.training.accumulate import accumulate_step, full_step

    args = _parse(argv)
    device = torch.device(resolve_device(args.device) if args.device == "auto" else args.device)
    if device.type == "mps":
        device = torch.device("cpu")
    gpu = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    bags = args.bags or [64, 256, 1024]
    tile = args.tile_size or (256 if gpu else 64)
    chunk = args.chunk_size or (64 if gpu else 32)
    repeats = args.repeats or (5 if gpu else 1)
    max_full = args.max_full_bag if args.max_full_bag is not None else (None if gpu else 1024)

    torch.manual_seed(0)
    enc = build_encoder(args.encoder).to(device).train()
    agg = build_aggregator(args.aggregator, enc.num_features, 2).to(device).train()
    print(f"bench-accumulate: {args.encoder} + {args.aggregator}, device {device}, tiles {tile} px, chunk {chunk}, "
          f"bn {args.bn}, median of {repeats} step(s), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'bag':>6} {'acc s':>8} {'full s':>8} {'acc/full':>8} {'acc saved MiB':>14} {'full saved MiB':>15}"
          + (f" {'acc peak MiB':>13} {'full peak MiB':>14}" if gpu else ""))

    def one(kind: str, tiles: torch.Tensor, meter: bool) -> tuple[float, int, int]:
        enc.zero_grad(set_to_none=True)
        agg.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        m = SavedTensorMeter(exclude=(enc, agg))
        if meter:
            m.__enter__()
        try:
            if kind == "acc":
                accumulate_step(enc, agg, tiles, 1, chunk, bn=args.bn)
            else:
                full_step(enc, agg, tiles, 1)
        finally:
            if meter:
                m.__exit__(None, None, None)
        _sync(device)
        dt = time.perf_counter() - t0
        peak_dev = torch.cuda.max_memory_allocated(device) if gpu else 0
        return dt, m.peak, peak_dev

    for n in bags:
        tiles = torch.randn(n, 3, tile, tile, device=device)
        row: dict[str, tuple[float, int, int] | None] = {}
        for kind in ("acc", "full"):
            if kind == "full" and max_full is not None and n > max_full:
                row[kind] = None
                continue
            try:
                _, saved, peak_dev = one(kind, tiles, meter=True)
                times = [one(kind, tiles, meter=False)[0] for _ in range(repeats)]
                row[kind] = (statistics.median(times), saved, peak_dev)
            except torch.cuda.OutOfMemoryError:
                row[kind] = None
                torch.cuda.empty_cache()
        a, f = row["acc"], row["full"]
        fmt = lambda r, i: (f"{r[i]:8.3f}" if i == 0 else _mib(r[i])) if r else f"{'-':>8}"  # noqa: E731
        ratio = f"{a[0] / f[0]:8.2f}" if a and f else f"{'n/a':>8}"
        line = f"{n:6d} {fmt(a, 0)} {fmt(f, 0)} {ratio} {fmt(a, 1):>14} {fmt(f, 1):>15}"
        if gpu:
            line += f" {fmt(a, 2):>13} {fmt(f, 2):>14}"
        print(line, flush=True)
        del tiles
    print("'-' = not run (skipped above --max-full-bag or out of memory). Target: acc/full <= 1.6.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
