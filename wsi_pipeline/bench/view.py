"""``make bench-view``: the viewer's speed on a 28,672 px slide and its memory with 1,000 slides listed.

1. A synthetic 28,672 x 28,672 px SVS (:func:`wsi_pipeline.synthetic.slides.make_slide`, cached in ``--work``).
   For each tile path (OpenSlide's DeepZoom generator; our reader's ``read_region`` through tiffslide, the path
   of OME-TIFF and DICOM), a fresh server: **time to first tile** (catalog built, server bound, the slide opened
   and the zoom-0 tile served over HTTP), then **per tile at level 0**: ``--tiles`` random level-0 tiles over
   the tissue, fetched one at a time over HTTP (median and 95th percentile, ms), and zoomed-out tiles (zoom
   max - 3, each 2,048 level-0 px square).
2. Memory: ``--slides`` slide files (links to one small slide) with a predictions CSV; resident memory after
   building the list and fetching every page of it (which opens each slide once to mark the ones that fail; at
   most 16 stay open), against the same with a tenth of the slides.

Prints a table and writes ``<work>/bench_view.json``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.training.memory import measured_peak, rss_bytes
from wsi_pipeline.viewer import build_catalog, make_server
from wsi_pipeline.viewer.tiles import TILE, max_zoom

__all__ = ["main"]

MiB = 1024 * 1024


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.read()


def _serve(catalog: Any, backend: str = "auto") -> Any:
    server = make_server(catalog, port=0, backend=backend)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def _tile_times(slide_dir: Path, tissue: np.ndarray, mask_ds: int, backend: str, n: int, seed: int) -> dict[str, Any]:
    """Time to first tile and per-tile times through a fresh server whose slides open with ``backend``."""
    t0 = time.perf_counter()
    cat = build_catalog(slides=slide_dir)
    server = _serve(cat, backend)
    try:
        _get(server.url + "tile/big/0/0/0.jpg")
        first = time.perf_counter() - t0
        zmax = max_zoom(server.slides.get("big").source.dimensions)
        rng = np.random.default_rng(seed)
        ys, xs = np.nonzero(tissue)
        pick = rng.choice(len(xs), size=n, replace=False)
        level0, zoomed = [], []
        for i in pick:
            x, y = xs[i] * mask_ds, ys[i] * mask_ds
            t = time.perf_counter()
            _get(server.url + f"tile/big/{zmax}/{x // TILE}/{y // TILE}.jpg")
            level0.append(time.perf_counter() - t)
        for i in pick[: max(5, n // 5)]:
            x, y = xs[i] * mask_ds, ys[i] * mask_ds
            t = time.perf_counter()
            _get(server.url + f"tile/big/{zmax - 3}/{x // (TILE * 8)}/{y // (TILE * 8)}.jpg")
            zoomed.append(time.perf_counter() - t)
        return {"backend": backend, "source": server.slides.get("big").kind, "first_tile_s": round(first, 3),
                "level0_median_ms": round(1000 * float(np.median(level0)), 1),
                "level0_p95_ms": round(1000 * float(np.percentile(level0, 95)), 1),
                "zoom_minus3_median_ms": round(1000 * float(np.median(zoomed)), 1), "n_tiles": n}
    finally:
        server.shutdown()
        server.server_close()


def _list_memory(work: Path, n: int) -> dict[str, Any]:
    """RSS growth from listing ``n`` slides: the list built, every page fetched (each slide opened for its status)."""
    small = work / "small.svs"
    if not small.is_file():
        make_slide(small, size=1536, seed=2)
    folder = work / f"list{n}"
    (folder / "slides").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        link = folder / "slides" / f"s{i:05d}.svs"
        if not link.exists():
            link.symlink_to(small)
    rng = np.random.default_rng(0)
    p = rng.random(n)
    pd.DataFrame({"slide_id": [f"s{i:05d}" for i in range(n)], "label": rng.integers(0, 2, n), "pred": (p > 0.5).astype(int),
                  "prob_0": 1 - p, "prob_1": p}).to_csv(folder / "predictions.csv", index=False)
    before = rss_bytes()
    t0 = time.perf_counter()
    cat = build_catalog(slides=folder / "slides", predictions=folder)
    built = time.perf_counter() - t0
    server = _serve(cat)
    try:
        t0 = time.perf_counter()
        pages = 0
        for offset in range(0, n, 50):
            rows = json.loads(_get(server.url + f"api/slides?sort=prob&order=desc&offset={offset}&limit=50"))["rows"]
            assert all(r["status"] == "ok" for r in rows)
            pages += 1
        listed = time.perf_counter() - t0
        return {"slides": n, "pages": pages, "build_list_s": round(built, 3), "all_pages_s": round(listed, 2),
                "rss_growth_mb": round((rss_bytes() - before) / MiB, 1), "open_slides": server.slides.n_open}
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wsi_pipeline.bench.view", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=28672, help="level-0 side of the slide, px (default 28672)")
    p.add_argument("--tiles", type=int, default=50, help="level-0 tiles timed per reader (default 50)")
    p.add_argument("--slides", type=int, default=1000, help="slides listed for the memory check (default 1000)")
    p.add_argument("--work", type=Path, default=Path(".bench-cache") / "view", help="where the slides are kept")
    args = p.parse_args(argv)
    work = args.work
    slide_dir = work / f"big{args.size}"
    path = slide_dir / "big.svs"
    t0 = time.perf_counter()
    if not path.is_file():
        made = make_slide(path, size=args.size, seed=1, tissue_fraction=0.5)
        np.save(slide_dir.parent / f"tissue{args.size}.npy", made.tissue)
        print(f"slide {path}: written in {time.perf_counter() - t0:.0f} s")
    tissue = np.load(slide_dir.parent / f"tissue{args.size}.npy")
    mask_ds = args.size // tissue.shape[1]
    rows = [_tile_times(slide_dir, tissue, mask_ds, b, args.tiles, seed) for seed, b in enumerate(("openslide", "tiffslide"))]
    mem = [_list_memory(work, n) for n in (max(1, args.slides // 10), args.slides)]
    print(f"\nviewer tiles, {args.size} x {args.size} px slide (over HTTP, one request at a time):")
    print(pd.DataFrame(rows).to_string(index=False))
    print("\nmemory with the list (every page fetched; at most 16 slides open):")
    print(pd.DataFrame(mem).to_string(index=False))
    print(f"\npeak resident memory of this process: {measured_peak() / MiB:.0f} MiB")
    out = work / "bench_view.json"
    write_text_atomic(out, json.dumps({"tiles": rows, "memory": mem, "peak_mb": round(measured_peak() / MiB)}, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
