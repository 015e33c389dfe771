"""``make bench-encoders``: the foundation-model presets (every one in the registry, a row each) at their real size,
with random weights.

Per preset, in its own process (so that its peak RSS is its own):

* parameters; GFLOPs per 224 px tile, counted by ``torch.utils.flop_counter.FlopCounterMode`` on
  the meta device (no compute): the forward, and one tile's share of an accumulated training step
  (a forward without gradient, then forward and backward with activation checkpointing, whose
  backward recomputes each block's forward);
* frozen tiles/s on this CPU: float32, eval mode, one batch of ``--batch`` tiles after a
  one-tile warm-up (a single timing: the machine is shared, read it as a rate, not a benchmark);
* peak RSS of one accumulated training step (:func:`~wsi_pipeline.training.accumulate_step`,
  full fine-tuning, activation checkpointing on, ABMIL) at a bag of two chunks, measured, and at
  bags of 64, 256 and 1024 tiles predicted from it: the step's memory beyond the bag's own
  tensors (the float32 tiles, the embeddings and their gradient) is set by the chunk, not by
  the bag (the encoder sees one chunk at a time), so the prediction adds only those tensors'
  bytes. A 1024-tile step of a ViT-g on this 2-core CPU would take hours (about 5 forwards per
  tile at ~600 GFLOP each), so every preset is measured at bag = 2 chunks of ``--chunk`` tiles
  (:data:`DEFAULT_CHUNK`: 8 for the ViT-S/B, 4 for UNI and the ViT-L, 2 for the larger ones), and the prediction is checked by measuring
  ``--sweep-model`` (a small ViT through the same code) at every bag size. The workers run with
  glibc handing blocks of 128 KiB or more back at once (:data:`MALLOC_FREE_ENV`), so that RSS
  follows the live tensors rather than the heap's retained free blocks;
* predicted time of one accumulated 1024-tile step on a GPU from the FLOP count at a stated share
  of its dense bfloat16 peak (default: H100 SXM, 989 TFLOP/s, 23 %: what an H200 reached on UNI and Virchow2,
  docs/gpu-check.md), and the memory of full
  fine-tuning with Adam there (16 bytes per parameter: float32 weights, gradients, two moments,
  plus ``--gpu-chunk`` tiles' activations, per tile as measured here in float32: the step's RSS
  growth less the gradients and the bag's tensors, over the chunk).

    python -m benchmarks.encoders                     # every preset and the sweep (~30 min on a shared 2-core CPU)
    python -m benchmarks.encoders --presets uni_v1 --no-sweep
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: Tiles per accumulation chunk in the RSS measurement, by preset (the giants at reduced chunk on this CPU).
DEFAULT_CHUNK = {"uni_v1": 4, "uni_v2": 2, "virchow2": 2, "hoptimus0": 2, "hoptimus1": 2, "gigapath": 2, "virchow": 2,
                 "h0_mini": 8, "kaiko_vits8": 8, "kaiko_vits16": 8, "kaiko_vitb8": 4, "kaiko_vitb16": 8, "kaiko_vitl14": 4,
                 "lunit_vits8": 8, "lunit_vits16": 8, "gpfm": 4, "phikon": 8, "phikon_v2": 4, "midnight": 2}
BAGS = (64, 256, 1024)
TILE = 224
#: Share of the GPU's dense bf16 peak an accumulated ViT step reaches: 0.21-0.25 measured on an H200 for UNI and
#: Virchow2 at a bag of 256 in chunks of 32 (benchmarks/encoders_gpu.py, docs/gpu-check.md).
GPU_SHARE = 0.23
#: glibc keeps freed heap blocks for reuse, so a process's RSS creeps up with the number of chunks
#: even when the live tensors do not (measured: +0.1 GiB from bag 32 to 256 for ViT-Ti); the workers
#: hand allocations of 128 KiB or more back to the system at once, so RSS follows the tensors.
MALLOC_FREE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _rss_bytes() -> int:
    """Peak RSS of this process so far (bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _rss_now() -> int:
    """Current RSS of this process (bytes; Linux ``/proc/self/statm``, else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _rss_bytes()


def _flops(name: str) -> tuple[int, int, int]:
    """(parameters, forward FLOPs, accumulated-step FLOPs) per 224 px tile, on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from wsi_pipeline.models import build_encoder

    with torch.device("meta"):
        enc = build_encoder(name)
        n_params = sum(p.numel() for p in enc.parameters())
        x = torch.empty(1, 3, TILE, TILE)
        with FlopCounterMode(display=False) as fwd:
            with torch.no_grad():
                enc(x)
        enc.model.set_grad_checkpointing(True)
        with FlopCounterMode(display=False) as train:
            enc(x).sum().backward()
    return n_params, int(fwd.get_total_flops()), int(fwd.get_total_flops() + train.get_total_flops())


def _worker(name: str, chunk: int, bag: int, batch: int, threads: int | None, measure_speed: bool) -> dict[str, Any]:
    """One preset in this process: counts, frozen speed, one accumulated step's peak RSS."""
    import torch

    from wsi_pipeline.models import build_aggregator, build_encoder
    from wsi_pipeline.training.accumulate import accumulate_step

    if threads:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"preset": name, "chunk": chunk, "bag": bag, "threads": torch.get_num_threads()}
    out["params"], out["fwd_flops"], out["step_flops"] = _flops(name)
    rss0 = _rss_bytes()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    enc = build_encoder(name)  # timm's own random initialisation
    out["build_s"] = time.perf_counter() - t0
    out["weights_bytes"] = sum(p.numel() * p.element_size() for p in enc.parameters())
    if measure_speed:
        enc.eval()
        with torch.no_grad():
            enc(torch.randn(1, 3, TILE, TILE))
            x = torch.randn(batch, 3, TILE, TILE)
            t0 = time.perf_counter()
            enc(x)
            out["tiles_per_s"] = batch / (time.perf_counter() - t0)
    enc.train()
    enc.model.set_grad_checkpointing(True)  # as training sets it (encoder.checkpointing default)
    agg = build_aggregator("abmil", enc.num_features, 2)
    tiles = torch.randn(bag, 3, TILE, TILE)
    out["bag_tensor_bytes"] = tiles.numel() * tiles.element_size()
    out["rss_before_step"] = _rss_now()
    t0 = time.perf_counter()
    accumulate_step(enc, agg, tiles, 1, chunk)
    out["step_s"] = time.perf_counter() - t0
    out["peak_rss"] = _rss_bytes()
    out["rss_start"] = rss0
    out["embed_dim"] = int(enc.num_features)
    return out


def _run_worker(name: str, chunk: int, bag: int, batch: int, threads: int | None, speed: bool,
                glibc_default: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.encoders", "--worker", name, "--chunk", str(chunk), "--bag", str(bag),
           "--batch", str(batch)] + (["--threads", str(threads)] if threads else []) + ([] if speed else ["--no-speed"])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if not glibc_default:
        env.update(MALLOC_FREE_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {name} (bag {bag}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _per_tile_bytes(embed_dim: int) -> int:
    """Bytes a bag holds per tile beyond the chunk's: its float32 224 px tile, embedding and embedding gradient."""
    return 3 * TILE * TILE * 4 + 2 * embed_dim * 4


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from wsi_pipeline.models.foundation import PRESETS

    p = argparse.ArgumentParser(prog="python -m benchmarks.encoders", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), help="presets to measure (default: all)")
    p.add_argument("--chunk", type=int, default=None, help="tiles per chunk of the measured step (default: 4 for UNI, 2 for the others)")
    p.add_argument("--batch", type=int, default=None, help="tiles of the frozen-speed batch (default: 4, giants 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU of the prediction (H100 SXM: 989)")
    p.add_argument("--gpu-share", type=float, default=GPU_SHARE,
                   help=f"share of that peak assumed reached (default {GPU_SHARE}, measured on an H200: docs/gpu-check.md)")
    p.add_argument("--gpu-chunk", type=int, default=32, help="tiles per chunk of the GPU memory prediction (default 32)")
    p.add_argument("--sweep-model", default="timm:vit_tiny_patch16_224", help="encoder measured at every bag size")
    p.add_argument("--sweep-chunk", type=int, default=16)
    p.add_argument("--no-sweep", action="store_true", help="skip the measured bag-size sweep")
    p.add_argument("--glibc-default", action="store_true",
                   help="run the workers with glibc's default heap (freed blocks kept: RSS creeps with the chunk count)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bag", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-speed", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (each measurement in a child process) and print the tables; return 0."""
    args = _parse(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.chunk, args.bag, args.batch or 2, args.threads, not args.no_speed)))
        return 0
    import torch

    from wsi_pipeline.models.foundation import PRESETS

    heap = "glibc default heap" if args.glibc_default else "large blocks freed at once (" + " ".join(
        f"{k}={v}" for k, v in MALLOC_FREE_ENV.items()) + ")"
    print(f"bench-encoders: random weights, float32, {TILE} px tiles, CPU, torch {torch.__version__}, "
          f"threads {args.threads or torch.get_num_threads()}, 1-min load {os.getloadavg()[0]:.1f}, {heap}")
    gpu = args.gpu_tflops * 1e12 * args.gpu_share
    rows = []
    done: dict[str, dict[str, Any]] = {}
    for name in args.presets:
        preset = PRESETS[name]
        same = next((d for n, d in done.items() if PRESETS[n].architecture == preset.architecture
                     and dict(PRESETS[n].timm_kwargs) == dict(preset.timm_kwargs)), None)
        chunk = args.chunk or DEFAULT_CHUNK.get(name, 2)
        giant = preset.architecture.startswith("vit_giant") or "giant" in preset.architecture
        r = dict(same, preset=name) if same else _run_worker(name, chunk, 2 * chunk, args.batch or (2 if giant else 4),
                                                             args.threads, True, args.glibc_default)
        done[name] = r
        rows.append(r)
        print(f"  measured {name}{' (same architecture as ' + same['preset'] + ')' if same else ''}: "
              f"step {r['step_s']:.0f} s, peak RSS {_gib(r['peak_rss'])} GiB", flush=True)

    print(f"\nPer preset (accumulated step: full fine-tuning, activation checkpointing, ABMIL; measured at a bag of 2 chunks;"
          f" 64 / 256 / 1024 predicted = measured + the bag's own tensors; GPU: {args.gpu_share:.0%} of {args.gpu_tflops:g} TFLOP/s)")
    head = (f"| preset | params (M) | D | GFLOPs/tile fwd | GFLOPs/tile step | frozen tiles/s (CPU) | chunk | peak RSS at 2 chunks (GiB) "
            f"| RSS bag 64 / 256 / 1024 (GiB) | activations MiB/tile | GPU s per 1024-tile step "
            f"| GPU GiB full FT + Adam, chunk {args.gpu_chunk} |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        per_tile = _per_tile_bytes(r["embed_dim"])
        measured_bag = r["bag"]
        pred = [r["peak_rss"] + (n - measured_bag) * per_tile for n in BAGS]
        # the step's own growth: the gradients (one float32 copy of the weights), embeddings, one chunk's activations
        growth = max(0, r["peak_rss"] - r["rss_before_step"])  # the tiles were in memory before the step
        act_tile = max(0, growth - r["weights_bytes"] - r["bag"] * 2 * r["embed_dim"] * 4) / r["chunk"]
        gpu_mem = 16 * r["params"] + args.gpu_chunk * act_tile
        print(f"| `{r['preset']}` | {r['params'] / 1e6:.0f} | {r['embed_dim']} | {r['fwd_flops'] / 1e9:.0f} | "
              f"{r['step_flops'] / 1e9:.0f} | {r.get('tiles_per_s', float('nan')):.2f} | {r['chunk']} | {_gib(r['peak_rss'])} | "
              f"{' / '.join(_gib(p) for p in pred)} | {act_tile / 2**20:.0f} | {1024 * r['step_flops'] / gpu:.1f} | {_gib(gpu_mem)} |")

    if not args.no_sweep:
        print(f"\nBag-size sweep, measured: {args.sweep_model}, chunk {args.sweep_chunk}, one accumulated step per process")
        base = _run_worker(args.sweep_model, args.sweep_chunk, 2 * args.sweep_chunk, 4, args.threads, False, args.glibc_default)
        per_tile = _per_tile_bytes(base["embed_dim"])
        print(f"| bag | step s | peak RSS (GiB) | predicted from bag {base['bag']} (GiB) | bag tensors (GiB) | RSS - bag tensors (GiB) |")
        print("|---|---|---|---|---|---|")
        for n in (base["bag"], *BAGS):
            r = base if n == base["bag"] else _run_worker(args.sweep_model, args.sweep_chunk, n, 4, args.threads, False,
                                                          args.glibc_default)
            pred = base["peak_rss"] + (n - base["bag"]) * per_tile
            own = n * per_tile
            print(f"| {n} | {r['step_s']:.1f} | {_gib(r['peak_rss'])} | {_gib(pred)} | {_gib(own)} | {_gib(r['peak_rss'] - own)} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
