"""Training's data path (``make bench-loader``): tiles/s from a tile store to a device-ready tensor.

A store of real tissue (256 px tiles of ``../shared/slides/CMU-1-Small-Region.svs`` in their eight
rotations / mirrors, zstd, 1024-tile shards, as ``wsi-pipeline tile`` writes it; a generated slide's
tiles without the real slides) is read in bags of 256 random tiles, the way training draws them:

- ``host (new)``: what the host does now for a device: read, decompress, check and place the uint8
  tiles in a contiguous (on CUDA: pinned) buffer; conversion to float happens on the device;
- ``host + float (old)``: what training did on the host before, in the training thread: the same,
  then the uint8 -> normalised float32 conversion (:func:`~wsi_pipeline.data.tensors.tiles_to_tensor`).

Each is timed on 1 thread, then on 2 and on all cores (threads reading separate bags: zstd, the
checksum and the copies release the GIL), as tiles/s per core. Then: bytes per tile sent to the
device by exact accumulation before (float32, both passes) and now (uint8, once); the cores needed
to feed a GPU at the stated rates; and, on this machine, one epoch of exact accumulation (ResNet-18,
bags of 64 tiles, 16 per chunk) with the loader thread, reporting the share of the step time the
training thread waited for data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

REAL_SLIDE = Path(__file__).resolve().parents[1].parent / "shared" / "slides" / "CMU-1-Small-Region.svs"
#: Tiles/s of 256 px tiles an H100 trains on (README "Real scale"; scaled from ~3,000 img/s at 224 px).
GPU_RATES = {"ResNet-50, mixed precision": 2300, "ResNet-18": 5000}


def _tissue_tiles(slide: Path | None, n: int, tmp: Path) -> np.ndarray:
    """``n`` 256 px tissue tiles: the slide's, rotated and mirrored, repeated."""
    from wsi_pipeline.slides import open_slide

    if slide is None or not slide.is_file():
        from wsi_pipeline.synthetic.slides import make_slide

        slide = tmp / "generated.svs"
        make_slide(slide, size=4096, mpp=0.5, seed=3, tile_size=256)
    with open_slide(slide) as s:
        img = s.read_region((0, 0), 0, s.dimensions)
    h, w = (v // 256 * 256 for v in img.shape[:2])
    tiles = img[:h, :w].reshape(h // 256, 256, w // 256, 256, 3).swapaxes(1, 2).reshape(-1, 256, 256, 3)
    tissue = tiles[tiles.mean(axis=(1, 2, 3)) < 215]
    variants = [np.rot90(t, k) if k < 4 else np.rot90(t[::-1], k - 4) for k in range(8) for t in tissue]
    return np.ascontiguousarray(np.stack([variants[i % len(variants)] for i in range(n)]))


def _write_store(path: Path, tiles: np.ndarray) -> None:
    from wsi_pipeline.data.store import StoreWriter

    w = StoreWriter(path, tile_size=256, capacity=len(tiles), attrs={"slide_id": path.stem})
    coords = np.stack([np.arange(len(tiles)) * 256, np.zeros(len(tiles), int)], axis=1)
    for a in range(0, len(tiles), 256):
        w.append(tiles[a : a + 256], coords[a : a + 256], coords[a : a + 256] // 256, np.ones(min(256, len(tiles) - a), np.float32))
    w.commit()


def _bags(n_tiles: int, n_bags: int, k: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(n_tiles, k, replace=False)) for _ in range(n_bags)]


def _load(store_path: Path, idx: np.ndarray, convert: bool) -> int:
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.data.tensors import tiles_to_tensor

    store = open_store(store_path)
    tiles = store.read(idx)
    buf = torch.empty(tiles.shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    buf.copy_(torch.from_numpy(tiles))  # the pinned (or contiguous) buffer the device copies from
    if convert:
        tiles_to_tensor(buf, dtype=torch.float32)
    return len(idx)


def _rate(store_path: Path, bags: list[np.ndarray], threads: int, convert: bool, repeats: int) -> float:
    """Median tiles/s over ``repeats`` passes over ``bags`` with ``threads`` threads."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            n = sum(pool.map(lambda idx: _load(store_path, idx, convert), bags))
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def _epoch_wait(store_path: Path, n_tiles: int, tmp: Path) -> dict[str, float]:
    """One epoch of exact accumulation over 4 "slides" (bags of 64 of the store's tiles): step seconds
    and the share of them the training thread waited for the next bag."""
    from wsi_pipeline.config.pipeline import MethodConfig
    from wsi_pipeline.config.train import TrainConfig
    from wsi_pipeline.data.bags import Slide, TileReader
    from wsi_pipeline.training.epoch import bag_epoch
    from wsi_pipeline.training.monitor import StepInfo
    from wsi_pipeline.training.strategies import build_strategy

    torch.manual_seed(0)
    method = MethodConfig(name="bench", strategy="accumulate", chunk_size=16)
    strategy = build_strategy(method, 2, "cpu")
    strategy.train()
    reader = TileReader([Slide(f"s{i}", i % 2, store_path) for i in range(4)])
    infos: list[StepInfo] = []
    tc = TrainConfig(bag_size=64, batch_bags=1)
    t0 = time.perf_counter()
    bag_epoch(strategy, reader, reader.n_tiles(), tc, 0, 0, lambda info=None: infos.append(info), _NoBar())
    total = time.perf_counter() - t0
    wait = sum(i.data_wait_s for i in infos)
    return {"steps": len(infos), "step_s": total / max(len(infos), 1), "wait_share": wait / total}


class _NoBar:
    def __call__(self, *a: Any, **k: Any) -> _NoBar:
        return self

    def update(self, *a: Any) -> None: ...

    def set_postfix(self, **k: Any) -> None: ...

    def close(self) -> None: ...


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loader", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slide", type=Path, default=REAL_SLIDE, help="slide whose tissue tiles fill the store")
    p.add_argument("--tiles", type=int, default=2048, help="tiles in the store")
    p.add_argument("--bags", type=int, default=8, help="bags of 256 tiles read per pass")
    p.add_argument("--repeats", type=int, default=3, help="passes per figure (median)")
    p.add_argument("--no-epoch", action="store_true", help="skip the training epoch (the data-wait share)")
    args = p.parse_args(argv)
    cores = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tiles = _tissue_tiles(args.slide, args.tiles, tmp)
        store = tmp / "bench.zarr"
        _write_store(store, tiles)
        bags = _bags(len(tiles), args.bags, 256, seed=0)
        _rate(store, bags[:2], 1, False, 1)  # page cache and imports
        counts = sorted({1, 2, cores})
        print(f"store: {len(tiles)} tiles of 256 px, {sum(f.stat().st_size for f in store.rglob('*') if f.is_file()) / len(tiles) / 1024:.0f} "
              f"KiB per tile (zstd); bags of 256 random tiles; {cores} cores here; pinned memory: {torch.cuda.is_available()}")
        print("| path | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}: tiles/s (per core)" for t in counts) + " |")
        print("|---|" + "---|" * len(counts))
        per_core = {}
        for label, convert in (("host (new: read, decompress, check, pin)", False), ("host + float (old: and convert on the host)", True)):
            cells = []
            for t in counts:
                r = _rate(store, bags, t, convert, args.repeats)
                cells.append(f"{r:,.0f} ({r / min(t, cores):,.0f})")
                if t == 1:
                    per_core[convert] = r
            print(f"| {label} | " + " | ".join(cells) + " |")
        tile = 256 * 256 * 3
        print(f"\nbytes per tile to the device, exact accumulation: before {2 * 4 * tile:,} (float32, both passes), "
              f"now {tile:,} (uint8, once): {8:.0f}x fewer")
        target = 2500
        print(f"host side per core (new): {per_core[False]:,.0f} tiles/s; target >= {target:,}: "
              f"{'PASS' if per_core[False] >= target else 'below'}")
        for name, rate in GPU_RATES.items():
            print(f"cores to feed an H100 at {rate:,} tiles/s ({name}): new {rate / per_core[False]:.1f}, "
                  f"old {rate / per_core[True]:.1f}")
        if not args.no_epoch:
            w = _epoch_wait(store, len(tiles), tmp)
            print(f"\none epoch of exact accumulation here (ResNet-18, CPU, bags of 64, chunks of 16): {w['steps']} steps of "
                  f"{w['step_s']:.1f} s; the training thread waited for data {100 * w['wait_share']:.2f} % of the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
