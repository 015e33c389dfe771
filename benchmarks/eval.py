"""``make bench-eval``: embed-once evaluation of R x k tile subsets against the naive alternatives.

One synthetic slide of N tiles (default 5000 random-texture tiles, written to a zarr store in a
temporary folder; tiles of 32 px on CPU, which keeps the run to minutes, and 256 px on CUDA) is scored
under the subsample protocol R x k (default 100 x 256) by a ResNet-18 + ABMIL model in eval mode:

- embed-once: read and embed every tile once, then R aggregator passes on index subsets
  (:func:`wsi_pipeline.inference.protocols.embed_slide` + ``predict_slide``);
- naive: for each repeat, read the k subset tiles from the store and embed them again;
- one pass: read and embed every tile once, one aggregator pass over all tiles (protocol ``all``).

Each phase is timed ``--trials`` times (median kept; naive: median time per repeat x R), as the
machine may be shared. Printed: the three times, the ratios naive / embed-once (target >= 20x) and embed-once /
one pass (target <= 1.2x), the largest difference between the two methods' probabilities
(they must agree), and the tile-count ratio R * k / N that the naive ratio follows: naive
embeds R * k tiles, embed-once N, so with 100 x 256 on 5000 tiles naive embeds 5.1x more tiles
(its smaller batches and scattered reads add a little more).
The cost of re-running the whole model on the slide for every repeat (R all-tiles passes) is
printed as an estimate, R x the measured one-pass time.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.config.evaluation import ALL, EvalProtocol
from wsi_pipeline.inference.protocols import embed_slide, predict_slide, protocol_rng, subset_indices
from wsi_pipeline.data.store import StoreWriter, open_store


def _make_store(path: Path, n: int, tile: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cols = int(np.ceil(np.sqrt(n)))
    grid = np.stack([np.arange(n) % cols, np.arange(n) // cols], 1).astype(np.int32)
    w = StoreWriter(path, tile_size=tile, capacity=n, attrs={"slide_id": "bench", "downsample": 1.0, "tile_size": tile})
    base = rng.integers(120, 230, (1, 1, 1, 3))
    for s in range(0, n, 500):
        k = min(500, n - s)
        tiles = np.clip(base + rng.normal(0, 30, (k, tile, tile, 3)), 0, 255).astype(np.uint8)
        w.append(tiles, grid[s : s + k].astype(np.int64) * tile, grid[s : s + k], np.ones(k, np.float32))
    w.commit()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--n-tiles", type=int, default=5000, help="tiles in the slide (default 5000)")
    p.add_argument("--tile-size", type=int, default=None, help="tile side in px (default: 32 on CPU, 256 on CUDA)")
    p.add_argument("--k", type=int, default=256, help="tiles per repeat (default 256)")
    p.add_argument("--repeats", type=int, default=100, help="repeats R (default 100)")
    p.add_argument("--encoder", default="resnet18", help="encoder name (default resnet18)")
    p.add_argument("--batch-size", type=int, default=128, help="tiles per encoder call (default 128)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--trials", type=int, default=3, help="timings per phase, median kept (default 3)")
    p.add_argument("--naive-repeats", type=int, default=None,
                   help="time only this many naive repeats and scale to R (default: all R)")
    args = p.parse_args(argv)

    from wsi_pipeline.devices import resolve_device
    from wsi_pipeline.models import build_aggregator, build_encoder

    device = torch.device(resolve_device(args.device))
    if args.tile_size is None:
        args.tile_size = 256 if device.type == "cuda" else 32
    torch.manual_seed(0)
    encoder = build_encoder(args.encoder).to(device).eval()
    aggregator = build_aggregator("abmil", encoder.num_features, 2).to(device).eval()
    prot = EvalProtocol(args.k, args.repeats)
    print(f"bench-eval: {args.n_tiles} tiles of {args.tile_size} px, protocol {prot.name} ({args.repeats} x {args.k}), "
          f"{args.encoder} + abmil, device {device}, torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        path = Path(tmp) / "bench.zarr"
        _make_store(path, args.n_tiles, args.tile_size, 0)
        store = open_store(path)
        with torch.no_grad():  # warm-up: first calls allocate and pick kernels
            encoder(tiles_to_tensor(store.read(np.arange(min(args.batch_size, len(store)))), device=device))

        def timed(fn):
            _sync(device)
            t = time.perf_counter()
            out = fn()
            _sync(device)
            return time.perf_counter() - t, out

        # Each phase is timed `trials` times and the median kept: the machine may be shared.
        # one pass = embed + one all-tiles aggregator pass; embed-once = embed + R subset passes.
        t_embed, t_agg_all, t_agg_r = [], [], []
        fast = None
        for _ in range(args.trials):
            dt, z = timed(lambda: embed_slide(encoder, store, batch_size=args.batch_size, device=device))
            t_embed.append(dt)
            t_agg_all.append(timed(lambda z=z: predict_slide(aggregator, z, None, ALL, with_attention=False))[0])
            dt, fast = timed(lambda z=z: predict_slide(aggregator, z, None, prot, protocol_rng(0, "bench", prot), with_attention=False))
            t_agg_r.append(dt)
        t_one = float(np.median(t_embed) + np.median(t_agg_all))
        t_once = float(np.median(t_embed) + np.median(t_agg_r))

        # naive: re-read and re-embed each subset (median time per repeat x R)
        subsets = subset_indices(len(store), prot, protocol_rng(0, "bench", prot))
        n_naive = min(len(subsets), args.naive_repeats or len(subsets))
        probs, per_repeat = [], []
        with torch.no_grad():
            for idx in subsets[:n_naive]:
                def naive_repeat(idx=idx):
                    zs = torch.cat([encoder(tiles_to_tensor(store.read(idx[s : s + args.batch_size]), device=device))
                                    for s in range(0, len(idx), args.batch_size)])
                    return torch.softmax(aggregator(zs).logits.float(), 0).cpu().double().numpy()

                dt, pr = timed(naive_repeat)
                per_repeat.append(dt)
                probs.append(pr)
        t_naive = float(np.median(per_repeat)) * len(subsets)
    diff = float(np.abs(np.mean(probs, 0) - fast.probs).max()) if n_naive == len(subsets) else math.nan
    bound = args.repeats * min(args.k, args.n_tiles) / args.n_tiles
    r_naive, r_one = t_naive / t_once, t_once / t_one
    print(f"  embedding all tiles       {np.median(t_embed):8.2f} s   (median of {args.trials})")
    print(f"  aggregator: 1 all-tiles pass {np.median(t_agg_all):.3f} s, {args.repeats} subset passes {np.median(t_agg_r):.3f} s")
    print(f"  one all-tiles pass        {t_one:8.2f} s")
    print(f"  embed-once, {prot.name:<12} {t_once:8.2f} s")
    print(f"  naive re-embedding        {t_naive:8.2f} s" + (f" (from {n_naive} repeats, scaled)" if n_naive < len(subsets) else ""))
    print(f"  naive / embed-once        {r_naive:8.2f} x   (target >= 20x: {'met' if r_naive >= 20 else 'NOT met'}; "
          f"tiles embedded R*k = {args.repeats * args.k} vs N = {args.n_tiles}, ratio {bound:.2f}x)")
    print(f"  embed-once / one pass     {r_one:8.2f} x   (target <= 1.2x: {'met' if r_one <= 1.2 else 'NOT met'})")
    print(f"  whole model re-run per repeat (estimate R x one pass) / embed-once: {args.repeats * t_one / t_once:6.1f} x")
    if n_naive == len(subsets):
        print(f"  max |p_naive - p_embed_once| = {diff:.2e} (the two methods agree)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    raise SystemExit(main())
