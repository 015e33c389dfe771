"""Tiling benchmark (``make bench-tile``): tiling speed against the decode limit.

First, real tissue: the 24576 x 24576 px pyramidal JPEG TIFF mosaic of CMU-1-Small-Region tissue that
``make bench-decode`` builds (once, cached in ``.bench-cache/``; :func:`benchmarks.decode.build_mosaic`),
tiled by one worker (greyscale, no tile QC, lossless zstd; and, timed beside it, the default: the
``tissue`` method with tile QC), alternated with two references, medians of
``--repeats``: the OpenSlide decode limit of the kept tiles (``read_region`` of only those, one call
each) and the direct-decode floor (every stored tile the tiler decodes, decoded once on one thread).
It prints tiling wall and CPU time, tiles kept and decoded, both references, the ratios (targets on 2
cores: <= 1.0x the OpenSlide limit and <= 1.5x the floor, in wall time) and the store's files and
bytes. ``--mosaic-only`` stops there; ``--skip-mosaic`` skips it.

Then the synthetic case. Generates (once, cached) two large synthetic slides (default 20000 x 20000 px, 256 px JPEG
tiles, 4x pyramid) and measures, in one run:

1. one worker tiling slide A (greyscale, level 0, lossless zstd): tiles kept, tiles/s;
2. the decode limit: the time to only ``read_region`` the same kept tiles of slide A, one
   256 x 256 read each, in this process with a fresh slide handle;
3. the ratio tiling wall time / decode limit (target <= 1.3);
4. one worker vs two workers on slides A and B: throughput ratio (target >= 1.6), for the
   chosen compression and (``--also-compare``) without compression, next to the bound the
   CPU sets: two workers on two cores cannot exceed 2 / (their CPU s per tile x one-worker tiles/s).
   A worker compresses in a second thread only while cores are left over, so with one worker
   on two cores the one-worker figure already uses both cores when compression is costly;
5. reading 256 random tiles back from the store: straight from the chunk files vs through zarr;
6. store layouts: slide A's kept tiles written one file per tile (older stores) and in shards of
   ``--shard-tiles`` tiles (new stores): files per slide (target: >= 100x fewer) and the random
   read time per tile, one tile per call and 256 per call (target: sharded <= 1.2x per-tile).
   ``--store-only`` tiles slide A once and runs only this part.

The page cache is warmed before each measurement, so the figures are CPU-bound, as on a
cluster node reading from a fast file system.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.io_atomic import write_text_atomic


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def _slides(cache: Path, size: int, regenerate: bool) -> list[Path]:
    from wsi_pipeline.synthetic.slides import make_slide

    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, seed in (("bench_a", 101), ("bench_b", 202)):
        path = cache / f"{name}_{size}.svs"
        meta = path.with_suffix(".json")
        spec = {"size": size, "seed": seed, "tile_size": 256, "quality": 90, "version": 1}
        if regenerate or not path.exists() or not meta.exists() or json.loads(meta.read_text()) != spec:
            t = time.perf_counter()
            print(f"generating {path} ({size} x {size} px) ...", flush=True)
            make_slide(path, size=size, seed=seed, tile_size=256, quality=90, n_lesions=3, pen_marks=1, tissue_fraction=0.4)
            write_text_atomic(meta, json.dumps(spec))
            print(f"  done in {time.perf_counter() - t:.1f} s, {path.stat().st_size / 2**20:.0f} MiB", flush=True)
        paths.append(path)
    return paths


def _count_files(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


def _store_layouts(src_path: Path, work: Path, compression: str, shard_tiles: int, n_reads: int, repeats: int) -> None:
    """Part 6: the same tiles in both layouts; files per slide and random-read time per tile."""
    from wsi_pipeline.data.store import StoreWriter, open_store

    src = open_store(src_path)
    n, T = len(src), src.tile_size
    if n == 0:
        print("store layouts: no tiles kept, nothing to compare")
        return
    layouts = {"per-tile": 0, "sharded": shard_tiles}
    paths, files, writes = {}, {}, {}
    for name, S in layouts.items():
        paths[name] = work / f"layout-{name}.zarr"
        w = StoreWriter(paths[name], tile_size=T, capacity=n, attrs=src.attrs, compression=compression, shard_tiles=S)
        t = time.perf_counter()
        for i in range(0, n, 256):
            k = min(256, n - i)
            w.append(src.read(np.arange(i, i + k)), src.coords[i : i + k], src.grid[i : i + k], src.foreground[i : i + k])
        w.commit()
        writes[name] = time.perf_counter() - t  # includes reading the source tiles back
        files[name] = _count_files(paths[name])
    size = {name: sum(p.stat().st_size for p in paths[name].rglob("*") if p.is_file()) for name in layouts}
    print(f"the tiler's store of slide A ({f'{src.shard_tiles} tiles per shard' if src.shard_tiles else 'one file per tile'}): "
          f"{_count_files(src_path)} files for {n} tiles")
    print(f"store layouts, {n} tiles of {T} px, {compression}: files per slide {files['per-tile']} one file per tile, "
          f"{files['sharded']} sharded ({shard_tiles} tiles per shard, {-(-n // shard_tiles)} shard files, "
          f"{size['sharded'] / n * shard_tiles / 2**20:.0f} MiB per full shard); "
          f"{files['per-tile'] / files['sharded']:.0f}x fewer   target >= 100x: "
          f"{'PASS' if files['per-tile'] >= 100 * files['sharded'] else 'FAIL'}")
    print(f"  copying the tiles into each layout: {1e3 * writes['per-tile'] / n:.2f} ms per tile one file per tile, "
          f"{1e3 * writes['sharded'] / n:.2f} ms sharded")
    rng = np.random.default_rng(0)
    single: dict[str, list[float]] = {k: [] for k in layouts}
    batch: dict[str, list[float]] = {k: [] for k in layouts}
    k = min(n_reads, n)
    for _ in range(repeats):  # alternated, each with a freshly opened store (shard indexes read again)
        for name in layouts:
            store = open_store(paths[name])
            idx = rng.choice(n, k, replace=False)
            t = time.perf_counter()
            for i in idx:
                store.read([int(i)])
            single[name].append((time.perf_counter() - t) / k)
            store = open_store(paths[name])
            idx = rng.choice(n, k, replace=False)
            t = time.perf_counter()
            store.read(idx)
            batch[name].append((time.perf_counter() - t) / k)
    for label, res in (("one tile per call", single), (f"{k} tiles per call", batch)):
        a, b = statistics.median(res["per-tile"]), statistics.median(res["sharded"])
        print(f"  random reads, {label} (median of {repeats}): {1e3 * a:.3f} ms per tile one file per tile, "
              f"{1e3 * b:.3f} ms sharded = {b / a:.2f}x   target <= 1.2x: {'PASS' if b <= 1.2 * a else 'FAIL'}")


def _dir_files_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _decode_floor(path: Path, config: Any) -> tuple[float, float, int]:
    """Decode once, on this thread, every stored tile under the tiler's candidate tiles: (wall s, CPU s, stored tiles)."""
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.tiling.plan import plan_tiles

    with open_slide(path, backend="openslide") as slide:
        plan = plan_tiles(slide, SlideJob("mosaic", str(path)), config)
        grid = plan.grid
        rows, cols = np.nonzero(plan.candidates)
        Sx, Sy = grid.source_shape
        with DirectTiles.from_slide(slide, cache_bytes=0) as reader:
            if not reader.supports(grid.level):
                raise ValueError(f"{path}: level {grid.level} is not read directly: {reader.reason(grid.level)}")
            tw, th = reader.stored_tile_size(grid.level)
            cells = sorted({(r, c) for x, y in grid.level_coords(cols, rows).tolist()
                            for r in range(y // th, (y + Sy - 1) // th + 1) for c in range(x // tw, (x + Sx - 1) // tw + 1)})
            t, c = time.perf_counter(), time.thread_time()
            for r, col in cells:
                reader.stored_tile(grid.level, col, r)
            return time.perf_counter() - t, time.thread_time() - c, len(cells)


def _mosaic(args: argparse.Namespace, work: Path) -> bool:
    """The real-tissue mosaic case: one worker, lossless, against the OpenSlide decode limit of the
    kept tiles and the direct-decode floor (medians of alternated runs). True when both targets pass."""
    from benchmarks.decode import build_mosaic
    from wsi_pipeline.slides import open_slide
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.config.tiling import TilingConfig

    if not args.mosaic_source.is_file():
        print(f"mosaic: source slide not found: {args.mosaic_source} (pass --mosaic-source or set WSI_TEST_SLIDES); skipped")
        return True
    path = args.mosaic_cache / f"cmu1_mosaic_{args.mosaic_size}.tif"
    spec = build_mosaic(path, args.mosaic_source, size=args.mosaic_size)
    # the paper's exact rule, whose pre-screen and top-row decoding the targets below are about; the default
    # (tissue method with tile QC) is timed beside it
    cfg = TilingConfig(compression="zstd", method="greyscale", qc_mode="off")
    runs: dict[str, list[float]] = {k: [] for k in ("wall", "worker", "cpu", "limit", "limit_cpu", "floor", "floor_cpu",
                                                    "default", "default_cpu")}
    out = work / "mosaic"
    attrs: dict[str, Any] = {}
    n = floor_tiles = n_default = 0
    for i in range(args.repeats):
        _warm(path)
        cpu0 = _child_cpu()
        t0 = time.perf_counter()
        rep = tile_cohort([SlideJob("mosaic", str(path))], out, cfg, workers=1, overwrite=True, progress=False)
        runs["wall"].append(time.perf_counter() - t0)
        runs["cpu"].append(_child_cpu() - cpu0)
        r = rep.results[0]
        if r.status != "ok":
            print(f"mosaic tiling failed: {r.error}")
            return False
        runs["worker"].append(r.seconds)
        store = open_store(out / "mosaic.zarr")
        attrs, n = dict(store.attrs), len(store)
        coords, T = store.coords, store.tile_size
        # the OpenSlide decode limit: only read_region of the kept tiles, one call each, fresh handle
        _warm(path)
        with open_slide(path, backend="openslide") as slide:
            t1, c1 = time.perf_counter(), time.process_time()
            for x, y in coords:
                slide.read_region((int(x), int(y)), 0, (T, T))
            runs["limit"].append(time.perf_counter() - t1)
            runs["limit_cpu"].append(time.process_time() - c1)
        _warm(path)
        cpu0 = _child_cpu()
        t0 = time.perf_counter()
        rep_d = tile_cohort([SlideJob("mosaic", str(path))], work / "mosaic_default", TilingConfig(compression="zstd"), workers=1,
                            overwrite=True, progress=False)
        runs["default"].append(time.perf_counter() - t0)
        runs["default_cpu"].append(_child_cpu() - cpu0)
        n_default = rep_d.results[0].n_tiles
        wall_f, cpu_f, floor_tiles = _decode_floor(path, cfg)
        runs["floor"].append(wall_f)
        runs["floor_cpu"].append(cpu_f)
        tm = attrs.get("timing", {})
        print(f"  run {i + 1}: tiling {runs['wall'][-1]:.2f} s wall ({r.seconds:.2f} s in the worker, process CPU {runs['cpu'][-1]:.2f} s: "
              f"decode+test {tm.get('decode_test_cpu', float('nan')):.2f} s on {tm.get('threads')} thread(s), writer {tm.get('writer_thread_cpu', float('nan')):.2f} s); "
              f"OpenSlide limit {runs['limit'][-1]:.2f} s (CPU {runs['limit_cpu'][-1]:.2f} s); floor {wall_f:.2f} s (CPU {cpu_f:.2f} s)", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    grid_tiles = attrs["grid_shape"][0] * attrs["grid_shape"][1]
    files, nbytes = _dir_files_bytes(out / "mosaic.zarr")
    tm = attrs.get("timing", {})
    print(f"mosaic {path.name}: {spec['size']} x {spec['size']} px, tissue {100 * spec['tissue_fraction']:.1f} %, {grid_tiles} grid tiles of {T} px; "
          f"read by {attrs.get('tile_decoder')}; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    top = int(tm.get("decided_by_top_rows") or 0)
    print(f"  tiles kept {n} of {grid_tiles} grid tiles; decided without decoding: {grid_tiles - attrs['n_candidates']} by the overview bound; "
          f"decided from their top rows alone: {top} ({tm.get('stored_tiles_top_decoded')} top-row decodes); "
          f"decoded whole: {attrs['n_candidates'] - top} (stored tiles decoded whole {tm.get('stored_tiles_decoded')}); "
          f"store: {files} files, {nbytes / 2**20:.1f} MiB (zstd)")
    print(f"  medians of {args.repeats} alternated runs        wall s    CPU s")
    for label, w, c in (("tiling, 1 worker, lossless (greyscale, no QC)", med["wall"], med["cpu"]),
                        (f"default: tissue method + tile QC ({n_default} tiles)", med["default"], med["default_cpu"]),
                        (f"OpenSlide read_region of the {n} kept tiles", med["limit"], med["limit_cpu"]),
                        (f"direct-decode floor ({floor_tiles} stored tiles, 1 thread)", med["floor"], med["floor_cpu"])):
        print(f"  {label:<52} {w:>7.2f} {c:>8.2f}")
    ok_limit, ok_floor = med["wall"] <= 1.0 * med["limit"], med["wall"] <= 1.5 * med["floor"]
    print(f"  tiling / OpenSlide limit: {med['wall'] / med['limit']:.2f}x wall ({med['worker'] / med['limit']:.2f}x the slide alone), "
          f"{med['cpu'] / med['limit_cpu']:.2f}x CPU   target <= 1.0x wall: {'PASS' if ok_limit else 'FAIL'}")
    print(f"  tiling / direct-decode floor: {med['wall'] / med['floor']:.2f}x wall ({med['worker'] / med['floor']:.2f}x the slide alone), "
          f"{med['cpu'] / med['floor_cpu']:.2f}x CPU   target <= 1.5x wall: {'PASS' if ok_floor else 'FAIL'}")
    print("  (wall ratios need the cores free: on a loaded machine the threaded tiler gets less than its 2 cores while the "
          "one-thread references lose less; CPU ratios are the steadier figure there)")
    return ok_limit and ok_floor


def _store_reads(store: Any) -> None:
    """Print the time per tile of reading 256 random tiles back (training and evaluation draw random subsets):
    from the chunk/shard files directly against through zarr (best of 2 alternated runs each)."""
    n = len(store)
    reads: dict[str, list[float]] = {}
    direct = store._direct
    rng = np.random.default_rng(0)
    for name in ("zarr", "direct", "zarr", "direct"):
        store._direct = direct if name == "direct" else None
        idx = rng.choice(n, min(256, n), replace=False)
        t2 = time.perf_counter()
        store.read(idx)
        reads.setdefault(name, []).append((time.perf_counter() - t2) / len(idx))
    store._direct = direct
    if direct is not None:
        z, d = min(reads["zarr"]), min(reads["direct"])
        print(f"store reads, {min(256, n)} random tiles ({'sharded' if store.shard_tiles else 'one file per tile'}): "
              f"{1e3 * d:.2f} ms per tile from the chunk/shard files, {1e3 * z:.2f} ms through zarr ({z / d:.1f}x)")


def _two_workers(args: argparse.Namespace, a: Path, b: Path, layout: dict[str, Any], work: Path, cores: int) -> int:
    """Slides A and B with one worker, then two, per compression: throughput ratio against the 1.6x target; 1 when
    a tiling failed."""
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.tiling.job import SlideJob

    jobs = [SlideJob("bench_a", str(a)), SlideJob("bench_b", str(b))]
    compressions = [args.compression] + [c for c in args.also_compare if c != args.compression]
    for comp in compressions:
        res, cpu = {}, {}
        for w in (1, 2):
            _warm(a)
            _warm(b)
            t = time.perf_counter()
            rep = tile_cohort(jobs, work / f"w{w}-{comp}", TilingConfig(compression=comp, **layout), workers=w,
                              overwrite=True, progress=False)
            dt = time.perf_counter() - t
            if not rep.ok:
                print(rep.summary())
                return 1
            res[w] = rep.n_tiles / dt
            cpu[w] = sum(r.cpu_seconds for r in rep.results) / rep.n_tiles
            print(f"2 slides, {comp}, {w} worker(s){' (writer thread)' if w < cores else ' (no writer thread)'}: "
                  f"{rep.n_tiles} tiles in {dt:.2f} s, {res[w]:.0f} tiles/s, {1e3 * cpu[w]:.2f} ms CPU per tile")
        speed = res[2] / res[1]
        # two workers on `cores` cores cannot tile faster than min(cores, 2) / (their CPU s per tile)
        bound = min(2.0, min(cores, 2) / (cpu[2] * res[1])) if cpu[2] > 0 else float("nan")
        print(f"two workers / one worker throughput, {comp}: {speed:.2f}x   target >= 1.6: {'PASS' if speed >= 1.6 else 'FAIL'}"
              f"   (CPU bound on {cores} cores: {bound:.2f}x = min(cores, 2) / (two-worker CPU s per tile x one-worker tiles/s))")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line of ``make bench-tile``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.tile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=20000, help="level-0 side of the synthetic slides in px")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("WSI_BENCH_CACHE", Path(tempfile.gettempdir()) / "wsi-pipeline-bench")),
                   help="folder for the generated slides (reused between runs; env WSI_BENCH_CACHE)")
    p.add_argument("--regenerate", action="store_true", help="regenerate the slides even if cached")
    p.add_argument("--compression", choices=("zstd", "jpeg", "none"), default="zstd", help="tile store compression")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of tiling and decode limit; medians are compared")
    p.add_argument("--skip-two", action="store_true", help="skip the one- vs two-worker comparison")
    p.add_argument("--also-compare", nargs="*", default=["none"], choices=("zstd", "jpeg", "none"),
                   help="compressions whose one- vs two-worker scaling is measured as well (default: none)")
    p.add_argument("--shard-tiles", type=int, default=None, metavar="N",
                   help="tiles per shard file of the stores written [default: the tiler's]; 0 = one file per tile")
    p.add_argument("--store-only", action="store_true",
                   help="tile slide A once and only compare the store layouts (part 6)")
    p.add_argument("--read-repeats", type=int, default=9, help="alternated repeats of the layout read comparison")
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--mosaic-source", type=Path,
                   default=Path(os.environ.get("WSI_TEST_SLIDES", here.parent / "shared" / "slides")) / "CMU-1-Small-Region.svs",
                   help="the real slide the mosaic is cut from (default ../shared/slides/CMU-1-Small-Region.svs)")
    p.add_argument("--mosaic-cache", type=Path, default=Path(os.environ.get("WSI_BENCH_CACHE", here / ".bench-cache")),
                   help="folder of the mosaic, shared with make bench-decode (env WSI_BENCH_CACHE; default .bench-cache/)")
    p.add_argument("--mosaic-size", type=int, default=24576, help="level-0 side of the mosaic in px (multiple of 4096)")
    p.add_argument("--mosaic-only", action="store_true", help="run only the real-tissue mosaic case")
    p.add_argument("--skip-mosaic", action="store_true", help="skip the real-tissue mosaic case")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    if not args.skip_mosaic:
        work = Path(tempfile.mkdtemp(prefix="wsi-bench-mosaic-"))
        try:
            print(f"cores: {os.cpu_count()}; load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
            ok = _mosaic(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if args.mosaic_only:
            return 0 if ok else 1

    from wsi_pipeline.slides import open_slide
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.config.tiling import TilingConfig

    a, b = _slides(args.cache, args.size, args.regenerate)
    layout = {} if args.shard_tiles is None else {"shard_tiles": args.shard_tiles}
    cfg = TilingConfig(compression=args.compression, **layout)
    shard_tiles = cfg.shard_tiles or TilingConfig().shard_tiles  # the sharded side of part 6
    work = Path(tempfile.mkdtemp(prefix="wsi-bench-tile-"))
    cores = os.cpu_count() or 1
    print(f"cores: {cores}; load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    try:
        if args.store_only:
            rep = tile_cohort([SlideJob("bench_a", str(a))], work / "one", cfg, workers=1, overwrite=True, progress=False)
            if rep.results[0].status != "ok":
                print(f"tiling failed: {rep.results[0].error}")
                return 1
            _store_layouts(work / "one" / "bench_a.zarr", work, args.compression, shard_tiles, 256, args.read_repeats)
            print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
            return 0
        # 1 + 2, alternated `repeats` times (medians): one worker tiling slide A, then the decode
        # limit, i.e. only read_region of the same kept tiles, one call each, fresh handle
        walls, inner, decodes, decode_cpus = [], [], [], []
        for rep_i in range(args.repeats):
            _warm(a)
            cpu0 = _child_cpu()
            t0 = time.perf_counter()
            rep = tile_cohort([SlideJob("bench_a", str(a))], work / "one", cfg, workers=1, overwrite=True, progress=False)
            walls.append(time.perf_counter() - t0)
            cpu_tile = _child_cpu() - cpu0
            r = rep.results[0]
            if r.status != "ok":
                print(f"tiling failed: {r.error}")
                return 1
            inner.append(r.seconds)
            store = open_store(work / "one" / "bench_a.zarr")
            n = len(store)
            if rep_i == 0:
                print(f"slide A: {args.size} x {args.size} px, {store.attrs['grid_shape'][0] * store.attrs['grid_shape'][1]} grid tiles, "
                      f"{store.attrs['n_candidates']} candidates after pre-screen, {n} tiles kept")
            timing = store.attrs.get("timing", {})
            print(f"  run {rep_i + 1}: tiling {walls[-1]:.2f} s wall ({r.seconds:.2f} s in the worker); "
                  f"slide CPU {r.cpu_seconds:.2f} s = decode/filter threads {timing.get('main_thread_cpu', float('nan')):.2f} s "
                  f"+ writer thread {timing.get('writer_thread_cpu', float('nan')):.2f} s (+ overview, QC); worker process CPU {cpu_tile:.2f} s",
                  flush=True)
            _warm(a)
            coords = store.coords
            T = store.tile_size
            t1 = time.perf_counter()
            c1 = time.process_time()
            with open_slide(a) as slide:
                for x, y in coords:
                    slide.read_region((int(x), int(y)), 0, (T, T))
            decodes.append(time.perf_counter() - t1)
            decode_cpus.append(time.process_time() - c1)
            print(f"  run {rep_i + 1}: decode limit {decodes[-1]:.2f} s for {n} read_region calls (CPU {decode_cpus[-1]:.2f} s)", flush=True)
        wall, decode, decode_cpu = statistics.median(walls), statistics.median(decodes), statistics.median(decode_cpus)
        r_seconds = statistics.median(inner)
        print(f"tiling, 1 worker (median of {args.repeats}): {wall:.2f} s wall ({r_seconds:.2f} s in the worker), {n / wall:.0f} tiles/s")
        print(f"decode limit (median of {args.repeats}): {decode:.2f} s ({n / decode:.0f} tiles/s)")
        ratio_wall = wall / decode
        print(f"ratio tiling / decode limit (wall): {ratio_wall:.2f} whole run incl. worker start, {r_seconds / decode:.2f} slide only"
              f"   target <= 1.3: {'PASS' if ratio_wall <= 1.3 else 'FAIL'}")
        _store_reads(store)
        crit = max(timing.get("main_thread_cpu", 0.0) / max(1, timing.get("threads", 1)), timing.get("writer_thread_cpu", 0.0))
        print(f"ratio in CPU time: {r.cpu_seconds / decode_cpu:.2f} total slide CPU / decode CPU; "
              f"{crit / decode_cpu:.2f} busiest thread / decode CPU (the wall ratio when the cores are free)")

        _store_layouts(work / "one" / "bench_a.zarr", work, args.compression, shard_tiles, 256, args.read_repeats)

        if not args.skip_two:
            return _two_workers(args, a, b, layout, work, cores)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
