"""``make bench-tissue``: one whole-image training step of the paper's tissue U-Net, against image area.

For each image size (default 4,000 x 16,000, 8,000 x 32,000 and 16,000 x 64,000 px: 0.064, 0.256
and 1.024 gigapixels, the last the paper's input) one training step (forward, backward, Adam) on a
whole generated image runs in its own process through
:class:`~wsi_pipeline.tissue_seg.chunked.ChunkedTissueUNet`, and reports

* wall time of the step (s), after one untimed warm-up step on a 1,024 x 1,024 px image, and the
  process CPU time of the step (user + system, all threads; on a shared machine the wall time
  depends on the other load, given as the 1-minute load average);
* peak host RSS of the process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), and the RSS held
  before the step (the uint8 image and label: 2 bytes per px);
* peak elements resident on the compute device (chunk inputs, outputs and the fused layers'
  temporaries, counted by the Big-Layers instrumentation), given as bytes at 4 bytes per element
  (an upper bound: uint8 chunks count 4 bytes per px too);
* elements moved host <-> device in the step (same instrumentation; bytes at 4 per element);

then the power law ``y = a A^b`` fitted by least squares in log-log space to time, peak RSS and
bytes moved (A = px). Plain PyTorch (the whole float32 image as one tensor, ordinary autograd) runs
beside it for the sizes given by ``--plain-sizes`` (default: the smallest only, for host memory).
The paper's figures (1.024 gigapixels, TensorFlow on an M1 Ultra): 103.61 GB peak unified memory,
81 s per step. A size is skipped when the RSS extrapolated linearly from the previous size would
exceed ``--max-rss-gb`` (default 16, the issue's target) or the memory available now.

    python -m benchmarks.tissue                       # all three sizes
    python -m benchmarks.tissue --sizes 1000x4000 2000x8000 4000x16000   # quick
    python -m benchmarks.tissue --device cuda         # chunks on the GPU
"""

from __future__ import annotations
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.training.memory import available_host_bytes

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "fit_loglog", "synthetic_image"]

DEFAULT_SIZES = ((4000, 16000), (8000, 32000), (16000, 64000))
PAPER = {"pixels": 16000 * 64000, "peak_memory_gb": 103.61, "seconds_per_step": 81.0, "hardware": "Apple M1 Ultra, 128 GB unified"}


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW (px), e.g. 4000x16000") from None
    if h % 32 or w % 32 or h <= 0 or w <= 0:
        raise argparse.ArgumentTypeError(f"{text}: height and width must be positive multiples of 32 px")
    return h, w


def synthetic_image(h: int, w: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 greyscale (H, W) with tissue blobs on glass and its uint8 {0, 1} label, built in row
    blocks so that no full-size array other than the two outputs exists (px)."""
    import cv2

    rng = np.random.default_rng(seed)
    lh, lw = h // 8, w // 8
    noise = cv2.GaussianBlur(rng.standard_normal((lh, lw)).astype(np.float32), (0, 0), sigmaX=max(2.0, lw / 200))
    low = (noise > np.quantile(noise, 0.6)).astype(np.uint8)  # ~40 % tissue, at 1/8 scale
    grey = np.empty((h, w), np.uint8)
    label = np.empty((h, w), np.uint8)
    texture = rng.integers(0, 40, (64, w), dtype=np.uint8)
    for r0 in range(0, lh, 64):
        r1 = min(lh, r0 + 64)
        block = np.repeat(np.repeat(low[r0:r1], 8, axis=0), 8, axis=1)
        rows = slice(r0 * 8, r1 * 8)
        label[rows] = block
        tex = np.resize(texture, (block.shape[0], w))
        grey[rows] = np.where(block == 1, 130 + tex, 228 + tex // 8)
    return grey, label


def _rss_bytes() -> int:
    """Peak resident set of this process so far (Linux reports kB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def _current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _rss_bytes()


def _one(h: int, w: int, device: str, max_elements: int, plain: bool, threads: int | None) -> dict[str, Any]:
    """Measure one step in this process (called in a child process per size)."""
    import torch
    import torch.nn.functional as F

    from wsi_pipeline.bigl.instrument import monitor_transfers
    from wsi_pipeline.bigl.chunk_loop import ChunkRunner
    from wsi_pipeline.tissue_seg.chunked import ChunkedTissueUNet
    from wsi_pipeline.tissue_seg.model import TissueUNet, prepare_input

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TissueUNet().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    big = ChunkedTissueUNet(model, ChunkRunner(device), max_elements)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step_big(g: np.ndarray, lab: np.ndarray) -> float:
        opt.zero_grad(set_to_none=True)
        loss = big.loss(g, lab)
        loss.backward()
        opt.step()
        sync()
        return float(loss.detach())

    def step_plain(g: np.ndarray, lab: np.ndarray) -> float:
        opt.zero_grad(set_to_none=True)
        x = prepare_input(torch.from_numpy(g).to(device)[None, None])
        y = torch.from_numpy(lab).to(device)[None, None].float()
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        sync()
        return float(loss.detach())

    step = step_plain if plain else step_big
    wg, wl = synthetic_image(1024, 1024, seed=1)
    step(wg, wl)  # warm-up
    grey, label = synthetic_image(h, w)
    rss_before = _current_rss()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with monitor_transfers() as mon:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss = step(grey, label)
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    moved = sum(e.numel for e in mon.events if e.kind == "chunk")
    out = {
        "height": h, "width": w, "pixels": h * w, "mode": "plain" if plain else "chunked", "device": device,
        "max_elements": max_elements, "seconds": seconds, "loss": loss,
        "cpu_seconds": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "loadavg_1min": os.getloadavg()[0],
        "peak_rss_bytes": _rss_bytes(), "rss_before_step_bytes": rss_before,
        "device_peak_elements": mon.peak_resident, "device_peak_bytes_at_4B": 4 * mon.peak_resident,
        "moved_elements": moved, "moved_bytes_at_4B": 4 * moved, "chunk_steps": mon.count("chunk"),
        "threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def fit_loglog(areas: list[float], values: list[float]) -> dict[str, float]:
    """Least-squares ``log y = log a + b log A``: returns ``{"a", "b", "r2"}`` (needs 2+ points)."""
    x, y = np.log(np.asarray(areas, float)), np.log(np.asarray(values, float))
    b, loga = np.polyfit(x, y, 1)
    pred = loga + b * x
    ss = float(((y - y.mean()) ** 2).sum())
    return {"a": float(np.exp(loga)), "b": float(b), "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0}


def _run_child(h: int, w: int, args: argparse.Namespace, plain: bool) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "benchmarks.tissue", "--one", f"{h}x{w}", "--device", args.device,
           "--max-elements", str(args.max_elements)] + (["--plain"] if plain else []) + (
           ["--threads", str(args.threads)] if args.threads else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        print(f"  {h}x{w} {'plain' if plain else 'chunked'}: failed (exit {proc.returncode}): {' | '.join(tail)}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gb(b: float) -> str:
    return f"{b / 1e9:.3f}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and write ``--out`` (JSON)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.tissue", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_size, nargs="+", default=list(DEFAULT_SIZES), help="HxW px, smallest first")
    p.add_argument("--plain-sizes", type=_size, nargs="*", default=None, help="sizes also run in plain PyTorch (default: the smallest)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-elements", type=int, default=64 * 1024 * 1024, help="chunk budget (elements); default 64 Mi")
    p.add_argument("--max-rss-gb", type=float, default=16.0, help="skip a size whose extrapolated RSS exceeds this (GB)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("results/bench_tissue.json"))
    p.add_argument("--one", type=_size, default=None, help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        h, w = args.one
        print(json.dumps(_one(h, w, args.device, args.max_elements, args.plain, args.threads)))
        return 0
    sizes = sorted(args.sizes, key=lambda s: s[0] * s[1])
    plain_sizes = set(map(tuple, args.plain_sizes)) if args.plain_sizes is not None else {sizes[0]}
    rows: list[dict[str, Any]] = []
    print(f"{'px':>14} {'mode':>8} {'s/step':>8} {'CPU s':>8} {'load':>5} {'peak RSS GB':>12} {'device peak GB':>15} {'moved GB':>9}")
    for mode_plain in (False, True):
        prev = None
        for h, w in sizes:
            if mode_plain and (h, w) not in plain_sizes:
                continue
            if prev is not None:
                need = prev["peak_rss_bytes"] * (h * w) / prev["pixels"]
                avail = available_host_bytes()
                if need > args.max_rss_gb * 1e9 or (avail is not None and need > 0.8 * avail):
                    print(f"{h * w:>14,} {'plain' if mode_plain else 'chunked':>8}  skipped: extrapolated RSS {_gb(need)} GB "
                          f"(limit {args.max_rss_gb} GB, available {_gb(avail or 0)} GB)")
                    continue
            r = _run_child(h, w, args, mode_plain)
            if r is None:
                continue
            rows.append(r)
            prev = r
            print(f"{h * w:>14,} {r['mode']:>8} {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} {r['loadavg_1min']:>5.1f} {_gb(r['peak_rss_bytes']):>12} "
                  f"{_gb(r['device_peak_bytes_at_4B']):>15} {_gb(r['moved_bytes_at_4B']):>9}", flush=True)
    chunked = [r for r in rows if r["mode"] == "chunked"]
    fits = {}
    if len(chunked) >= 2:
        a = [r["pixels"] for r in chunked]
        for key in ("seconds", "cpu_seconds", "peak_rss_bytes", "moved_elements"):
            fits[key] = fit_loglog(a, [r[key] for r in chunked])
        print("scaling exponents b in y = a A^b: " + ", ".join(f"{k} {v['b']:.3f} (R^2 {v['r2']:.3f})" for k, v in fits.items()))
    print(f"paper (1.024 gigapixels, {PAPER['hardware']}): {PAPER['peak_memory_gb']} GB, {PAPER['seconds_per_step']:.0f} s/step")
    payload = {"rows": rows, "fits": fits, "paper": PAPER, "cpu_count": os.cpu_count()}
    write_text_atomic(args.out, json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
