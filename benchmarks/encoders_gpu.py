"""``python -m benchmarks.encoders_gpu``: foundation encoders on a CUDA device in bfloat16, measured beside the prediction.

``make bench-encoders`` measures the presets on the CPU and *predicts* the time of an accumulated
step on a GPU from its FLOP count at a stated share of the GPU's dense bfloat16 peak. This command
measures the same step on the GPU it runs on, per preset (random weights, 224 px tiles):

* frozen tiles/s: eval mode, bf16 autocast, one batch of ``--batch`` tiles after a warm-up batch;
* one accumulated training step (:func:`~wsi_pipeline.training.accumulate_step`: full fine-tuning,
  activation checkpointing, ABMIL) on a bag of ``--bag`` tiles in chunks of ``--chunk``, under bf16
  autocast, after one warm-up step: wall seconds (the device synchronised), achieved TFLOP/s
  (the FLOP count of ``benchmarks.encoders``, counted on the meta device, over the wall time),
  and peak device memory (``torch.cuda.max_memory_allocated``, the step's own, Adam not included);
* beside them the prediction ``benchmarks.encoders`` makes: ``bag x step FLOPs / (share x peak)``.

    python -m benchmarks.encoders_gpu --presets uni_v1 virchow2 --bag 256 --chunk 32
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from benchmarks.encoders import GPU_SHARE, TILE, _flops

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.encoders_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["uni_v1", "virchow2"], help="presets to measure (default: uni_v1 virchow2)")
    p.add_argument("--bag", type=int, default=256, help="tiles in the accumulated step's bag (default 256)")
    p.add_argument("--chunk", type=int, default=32, help="tiles per accumulation chunk (default 32)")
    p.add_argument("--batch", type=int, default=256, help="tiles of the frozen-speed batch (default 256)")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak of the prediction (H100/H200 SXM: 989)")
    p.add_argument("--gpu-share", type=float, default=GPU_SHARE,
                   help=f"share of that peak the prediction assumes (default {GPU_SHARE}, bench-encoders'; its first run "
                        "on an H200 used 0.4)")
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every preset and print one table; return 0 (2 without a CUDA device)."""
    args = _parse(argv)
    import torch

    from wsi_pipeline.models import build_aggregator, build_encoder
    from wsi_pipeline.training.accumulate import accumulate_step

    if not torch.cuda.is_available():
        print("bench encoders-gpu: no CUDA device here; this bench measures a GPU (make bench-encoders predicts one)")
        return 2
    dev = torch.device(args.device)
    print(f"bench encoders-gpu: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, random weights, {TILE} px "
          f"tiles, bf16 autocast; prediction at {args.gpu_share:.0%} of {args.gpu_tflops:g} TFLOP/s")
    head = ("| preset | params (M) | frozen tiles/s | step bag/chunk | step s measured | step s predicted | measured / predicted "
            "| achieved TFLOP/s | peak GiB of the step |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in args.presets:
        n_params, _, step_flops = _flops(name)
        torch.manual_seed(0)
        enc = build_encoder(name).to(dev)
        agg = build_aggregator("abmil", enc.num_features, 2).to(dev)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            enc.eval()
            x = torch.randn(args.batch, 3, TILE, TILE, device=dev)
            enc(x)
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            enc(x)
            torch.cuda.synchronize(dev)
            frozen = args.batch / (time.perf_counter() - t0)
        del x
        enc.train()
        enc.model.set_grad_checkpointing(True)  # as training sets it (encoder.checkpointing default)
        tiles = torch.randn(args.bag, 3, TILE, TILE, pin_memory=True)  # the bag on the host, as training holds it
        times = []
        for _ in range(2):  # a warm-up step (kernel selection, allocator), then the measured one
            enc.zero_grad(set_to_none=True)
            agg.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                accumulate_step(enc, agg, tiles, 1, args.chunk)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(dev) - base
        step_s = times[-1]
        predicted = args.bag * step_flops / (args.gpu_tflops * 1e12 * args.gpu_share)
        print(f"| `{name}` | {n_params / 1e6:.0f} | {frozen:,.0f} | {args.bag}/{args.chunk} | {step_s:.2f} | {predicted:.2f} | "
              f"{step_s / predicted:.2f} | {args.bag * step_flops / step_s / 1e12:.0f} | {peak / 2**30:.2f} |", flush=True)
        del enc, agg, tiles
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
