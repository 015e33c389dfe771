"""``make bench-eval``: embed-once evaluation of R x k tile subsets against the naive alternatives.

One synthetic slide of N tiles (default 5000 random-texture tiles of 64 px, written to a zarr
store in a temporary folder; 64 px rather than 256 px keeps the CPU run to minutes) is scored
under the subsample protocol R x k (default 100 x 256) by a ResNet-18 + ABMIL model in eval mode:

- embed-once: read and embed every tile once, then R aggregator passes on index subsets
  (:func:`wsi_pipeline.evaluation.protocols.embed_slide` + ``predict_slide``);
- naive: for each repeat, read the k subset tiles from the store and embed them again;
- one pass: read and embed every tile once, one aggregator pass over all tiles (protocol ``all``).

Printed: the three times, the ratios naive / embed-once (target >= 20x) and embed-once /
one pass (target <= 1.2x), the largest difference between the two methods' probabilities
(they must agree), and the bound R * k / N that limits the naive ratio: naive embeds R * k
tiles, embed-once N, so with 100 x 256 on 5000 tiles naive cannot be more than 5.1x slower.
The cost of re-running the whole model on the slide for every repeat (R all-tiles passes) is
printed as an estimate, R x the measured one-pass time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.evaluation.protocols import ALL, Protocol, embed_slide, predict_slide, protocol_rng, subset_indices
from wsi_pipeline.tiling.store import StoreWriter, open_store


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
    p = argparse.ArgumentParser(prog="python -m wsi_pipeline.bench.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--n-tiles", type=int, default=5000, help="tiles in the slide (default 5000)")
    p.add_argument("--tile-size", type=int, default=64, help="tile side in px (default 64 on CPU; use 256 on a GPU)")
    p.add_argument("--k", type=int, default=256, help="tiles per repeat (default 256)")
    p.add_argument("--repeats", type=int, default=100, help="repeats R (default 100)")
    p.add_argument("--encoder", default="resnet18", help="encoder name (default resnet18)")
    p.add_argument("--batch-size", type=int, default=128, help="tiles per encoder call (default 128)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--naive-repeats", type=int, default=None,
                   help="time only this many naive repeats and scale to R (default: all R)")
    args = p.parse_args(argv)

    from wsi_pipeline.data.features import resolve_device
    from wsi_pipeline.models import build_aggregator, build_encoder

    device = torch.device(resolve_device(args.device))
    torch.manual_seed(0)
    encoder = build_encoder(args.encoder).to(device).eval()
    aggregator = build_aggregator("abmil", encoder.num_features, 2).to(device).eval()
    prot = Protocol(args.k, args.repeats)
    print(f"bench-eval: {args.n_tiles} tiles of {args.tile_size} px, protocol {prot.name} ({args.repeats} x {args.k}), "
          f"{args.encoder} + abmil, device {device}, torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        path = Path(tmp) / "bench.zarr"
        _make_store(path, args.n_tiles, args.tile_size, 0)
        store = open_store(path)
        with torch.no_grad():  # warm-up: first calls allocate and pick kernels
            encoder(tiles_to_tensor(store.read(np.arange(min(args.batch_size, len(store)))), device=device))

        # one all-tiles pass
        _sync(device)
        t = time.perf_counter()
        z = embed_slide(encoder, store, batch_size=args.batch_size, device=device)
        predict_slide(aggregator, z, None, ALL, with_attention=False)
        _sync(device)
        t_one = time.perf_counter() - t

        # embed once, R aggregator passes on subsets
        _sync(device)
        t = time.perf_counter()
        z = embed_slide(encoder, store, batch_size=args.batch_size, device=device)
        fast = predict_slide(aggregator, z, None, prot, protocol_rng(0, "bench", prot), with_attention=False)
        _sync(device)
        t_once = time.perf_counter() - t

        # naive: re-read and re-embed each subset
        subsets = subset_indices(len(store), prot, protocol_rng(0, "bench", prot))
        n_naive = min(len(subsets), args.naive_repeats or len(subsets))
        probs = []
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            for idx in subsets[:n_naive]:
                zs = torch.cat([encoder(tiles_to_tensor(store.read(idx[s : s + args.batch_size]), device=device))
                                for s in range(0, len(idx), args.batch_size)])
                probs.append(torch.softmax(aggregator(zs).logits.float(), 0).cpu().double().numpy())
        _sync(device)
        t_naive = (time.perf_counter() - t) * len(subsets) / n_naive
    diff = float(np.abs(np.mean(probs, 0) - fast.probs).max()) if n_naive == len(subsets) else float(
        np.abs(np.stack(probs) - np.stack(probs)).max())
    bound = args.repeats * min(args.k, args.n_tiles) / args.n_tiles
    r_naive, r_one = t_naive / t_once, t_once / t_one
    print(f"  one all-tiles pass        {t_one:8.2f} s")
    print(f"  embed-once, {prot.name:<12} {t_once:8.2f} s")
    print(f"  naive re-embedding        {t_naive:8.2f} s" + (f" (from {n_naive} repeats, scaled)" if n_naive < len(subsets) else ""))
    print(f"  naive / embed-once        {r_naive:8.2f} x   (target >= 20x: {'met' if r_naive >= 20 else 'NOT met'}; "
          f"upper bound R*k/N = {bound:.2f}x, tiles embedded {args.repeats * args.k} vs {args.n_tiles})")
    print(f"  embed-once / one pass     {r_one:8.2f} x   (target <= 1.2x: {'met' if r_one <= 1.2 else 'NOT met'})")
    print(f"  whole model re-run per repeat (estimate R x one pass) / embed-once: {args.repeats * t_one / t_once:6.1f} x")
    if n_naive == len(subsets):
        print(f"  max |p_naive - p_embed_once| = {diff:.2e} (the two methods agree)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    raise SystemExit(main())
