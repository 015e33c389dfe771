"""Scale-out benchmark (``make bench-scale``): the local process pool vs a Dask LocalCluster.

Generates (once, cached) a folder of 8 synthetic slides (default 6144 x 6144 px) and tiles the
whole folder, into a fresh output folder each time, with

- the local process pool (``tile --workers W``), its worker start included as in every run;
- a Dask :class:`distributed.LocalCluster` of W single-threaded worker processes
  (``tile --cluster local:W``): the cluster is started once per W and reused, so its start-up
  is reported apart (a real run pays it once per run, a cluster attached with ``tcp://`` never);

for W = 1 and 2, alternating the four set-ups over ``--repeats`` rounds, and prints the median
throughput (tiles/s) side by side and Dask's throughput relative to the pool's at the same W
(target: >= 0.90). The page cache is warmed first, so the figures are CPU-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from wsi_pipeline.io_atomic import write_text_atomic


def _slides(cache: Path, n: int, size: int, regenerate: bool) -> Path:
    from wsi_pipeline.synthetic.slides import make_slide

    folder = cache / f"scale_{n}x{size}"
    stamp = folder / ".complete"
    if regenerate and folder.exists():
        shutil.rmtree(folder)
    if not stamp.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            t0 = time.perf_counter()
            make_slide(folder / f"slide_{i:02d}.svs", size=size, seed=500 + i, tissue_fraction=0.35)
            print(f"generated slide_{i:02d}.svs ({size} px) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        write_text_atomic(stamp, json.dumps({"n": n, "size": size}))
    for p in folder.glob("*.svs"):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slides", type=int, default=8, help="slides in the folder")
    p.add_argument("--size", type=int, default=6144, help="level-0 side of the synthetic slides in px")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds of all set-ups; medians are compared")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("WSI_BENCH_CACHE", Path(tempfile.gettempdir()) / "wsi-pipeline-bench")),
                   help="where the generated slides are kept between runs")
    p.add_argument("--regenerate", action="store_true", help="regenerate the slides even if cached")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)

    import logging

    logging.getLogger("distributed").setLevel(logging.ERROR)
    from wsi_pipeline.jobs.cluster import ClusterSpec, dask_client
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.tiling import TilingConfig

    folder = _slides(args.cache, args.slides, args.size, args.regenerate)
    config = TilingConfig(qc=False)
    work = Path(tempfile.mkdtemp(prefix="wsi-bench-scale-"))
    times: dict[tuple[str, int], list[float]] = {}
    tiles: dict[tuple[str, int], int] = {}
    startup: dict[int, float] = {}

    def run(kind: str, w: int, cluster: object = None) -> None:
        out = work / f"{kind}{w}-{len(times.get((kind, w), []))}"
        t0 = time.perf_counter()
        rep = tile_cohort(folder, out, config, workers=w, progress=False, cluster=cluster)
        dt = time.perf_counter() - t0
        if not rep.ok or rep.count("ok") != args.slides:
            raise RuntimeError(f"{kind} with {w} workers: {rep.summary()}")
        times.setdefault((kind, w), []).append(dt)
        tiles[(kind, w)] = rep.n_tiles
        shutil.rmtree(out, ignore_errors=True)
        print(f"  {kind:5s} W={w}: {dt:6.2f} s, {rep.n_tiles} tiles", file=sys.stderr)

    try:
        for w in args.workers:
            t0 = time.perf_counter()
            with dask_client(ClusterSpec("local", workers=w)) as client:
                client.wait_for_workers(w)
                startup[w] = time.perf_counter() - t0
                for r in range(args.repeats):  # alternate, so drifting machine load hits both alike
                    order = ("pool", "dask") if r % 2 == 0 else ("dask", "pool")
                    for kind in order:
                        run(kind, w, client if kind == "dask" else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n_tiles = {tiles[k] for k in tiles}
    if len(n_tiles) != 1:
        raise RuntimeError(f"the set-ups kept different numbers of tiles: {tiles}")
    total = n_tiles.pop()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntiling {args.slides} slides of {args.size} x {args.size} px ({total} tiles kept), {cores} cores, "
          f"load average {load:.1f}; medians of {args.repeats} alternated runs")
    print(f"{'workers':>7}  {'local pool tiles/s':>18}  {'Dask tiles/s':>12}  {'Dask / pool':>11}  {'Dask cluster start s':>20}"
          f"  {'Dask incl. start / pool':>23}")
    figures = []
    for w in args.workers:
        pool_s, dask_s = statistics.median(times[("pool", w)]), statistics.median(times[("dask", w)])
        ratio = pool_s / dask_s
        ratio_cold = pool_s / (dask_s + startup[w])
        print(f"{w:>7}  {total / pool_s:>18.1f}  {total / dask_s:>12.1f}  {ratio:>11.3f}  {startup[w]:>20.2f}  {ratio_cold:>23.3f}")
        figures.append({"workers": w, "pool_s": times[("pool", w)], "dask_s": times[("dask", w)],
                        "pool_tiles_per_s": total / pool_s, "dask_tiles_per_s": total / dask_s,
                        "dask_over_pool": ratio, "dask_start_s": startup[w],
                        "dask_with_start_over_pool": ratio_cold})
    ok = all(f["dask_over_pool"] >= 0.9 for f in figures)
    print(f"target: Dask throughput (cluster up) >= 0.90 x the local pool's at the same worker count: {'met' if ok else 'NOT met'}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"slides": args.slides, "size": args.size, "tiles": total, "cores": cores,
                                         "load_average": load, "results": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
