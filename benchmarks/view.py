"""``make bench-view``: the viewer's speed on a 28,672 px slide and its memory with 1,000 slides listed.

1. A synthetic 28,672 x 28,672 px SVS (:func:`wsi_pipeline.synthetic.slides.make_slide`, cached in ``--work``).
   For each tile path (OpenSlide's DeepZoom generator; our reader's ``read_region`` through tiffslide, the path
   of OME-TIFF and DICOM), a fresh server: **time to first tile** (catalog built, server bound, the slide opened
   and the zoom-0 tile served over HTTP), then **per tile at level 0**: ``--tiles`` random level-0 tiles over
   the tissue, fetched one at a time over HTTP (median and 95th percentile, ms), and zoomed-out tiles (zoom
   max - 3, each 2,048 level-0 px square).
2. Memory: ``--slides`` slide files (links to one small slide) with a predictions CSV, listed by a
   ``wsi-pipeline view`` process; its resident memory (``/proc/<pid>/status`` VmRSS, peak VmHWM) at start and
   after every page of the list was fetched (which opens each slide once to mark the ones that fail; at most 16
   stay open), against the same with a tenth of the slides.

Prints a table and writes ``<work>/bench_view.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.export.scores import tile_scores_frame, write_tile_scores
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.slides import open_slide
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.viewer import build_catalog, make_server
from wsi_pipeline.viewer.tiles import TILE, max_zoom

__all__ = ["main"]

def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.read()


def _serve(catalog: Any, backend: str = "auto") -> Any:
    server = make_server(catalog, port=0, backend=backend)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def _tile_times(slide_dir: Path, tissue: np.ndarray, mask_ds: float, backend: str, n: int, seed: int) -> dict[str, Any]:
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
            x, y = int(xs[i] * mask_ds), int(ys[i] * mask_ds)
            t = time.perf_counter()
            _get(server.url + f"tile/big/{zmax}/{x // TILE}/{y // TILE}.jpg")
            level0.append(time.perf_counter() - t)
        for i in pick[: max(5, n // 5)]:
            x, y = int(xs[i] * mask_ds), int(ys[i] * mask_ds)
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


def _overlay_times(work: Path, slide_dir: Path, tissue: np.ndarray, mask_ds: float, n: int) -> dict[str, Any]:
    """Heatmap overlay tiles of the big slide with one scored 256 px tile per tissue cell of the level-0 grid."""
    size = int(round(tissue.shape[1] * mask_ds))
    cols = np.arange(0, size, TILE)
    gx, gy = np.meshgrid(cols, cols)
    on = tissue[(gy // mask_ds).astype(int).clip(0, tissue.shape[0] - 1), (gx // mask_ds).astype(int).clip(0, tissue.shape[1] - 1)]
    coords = np.stack([gx[on], gy[on]], axis=1)
    pred = work / "pred"
    (pred / "heatmaps").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_tile_scores(pred / "heatmaps" / "big_scores.csv",
                      tile_scores_frame(coords, coords // TILE, float(TILE), rng.random(len(coords))))
    pd.DataFrame({"slide_id": ["big"], "pred": [1], "prob_0": [0.2], "prob_1": [0.8]}).to_csv(pred / "predictions.csv", index=False)
    server = _serve(build_catalog(slides=slide_dir, predictions=pred))
    try:
        zmax = max_zoom(server.slides.get("big").source.dimensions)
        t = time.perf_counter()
        _get(server.url + "overlay/big/heatmap/0/0/0.png")
        whole = time.perf_counter() - t
        times = []
        for i in rng.choice(len(coords), size=n, replace=False):
            x, y = coords[i]
            t = time.perf_counter()
            _get(server.url + f"overlay/big/heatmap/{zmax}/{x // TILE}/{y // TILE}.png")
            times.append(time.perf_counter() - t)
        return {"scored_tiles": len(coords), "zoom0_tile_ms": round(1000 * whole, 1),
                "level0_median_ms": round(1000 * float(np.median(times)), 1),
                "level0_p95_ms": round(1000 * float(np.percentile(times, 95)), 1)}
    finally:
        server.shutdown()
        server.server_close()


def _status_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of process ``pid`` in MiB, from ``/proc/<pid>/status`` (Linux)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def _list_memory(work: Path, n: int) -> dict[str, Any]:
    """Memory of a ``wsi-pipeline view`` process listing ``n`` slides, after every page of the list was fetched
    (each slide opened once to mark the ones that fail)."""
    small = work / "small.svs"
    if not small.is_file():
        make_slide(small, size=1536, seed=2)
    folder = work / f"list{n}"
    (folder / "slides").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        link = folder / "slides" / f"s{i:05d}.svs"
        if not link.exists():
            link.symlink_to(small.resolve())
    rng = np.random.default_rng(0)
    p = rng.random(n)
    pd.DataFrame({"slide_id": [f"s{i:05d}" for i in range(n)], "label": rng.integers(0, 2, n), "pred": (p > 0.5).astype(int),
                  "prob_0": 1 - p, "prob_1": p}).to_csv(folder / "predictions.csv", index=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "wsi_pipeline.cli.main", "view", "--slides", str(folder / "slides"),
                             "--predictions", str(folder), "--port", "0", "--seconds", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "wsi-pipeline view: N slides at http://127.0.0.1:PORT/ (Ctrl-C to stop)"
        match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        if match is None:
            raise RuntimeError(f"wsi-pipeline view did not start: {line!r}")
        url = match.group(1)
        started = time.perf_counter() - t0
        at_start = _status_mb(proc.pid)
        t0 = time.perf_counter()
        pages = 0
        for offset in range(0, n, 50):
            rows = json.loads(_get(url + f"api/slides?sort=prob&order=desc&offset={offset}&limit=50"))["rows"]
            assert all(r["status"] == "ok" for r in rows)
            pages += 1
        listed = time.perf_counter() - t0
        mem = _status_mb(proc.pid)
        return {"slides": n, "pages": pages, "start_s": round(started, 2), "all_pages_s": round(listed, 2),
                "rss_at_start_mb": at_start["VmRSS"], "rss_after_mb": mem["VmRSS"], "peak_mb": mem["VmHWM"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.view", description=__doc__,
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
        make_slide(path, size=args.size, seed=1, tissue_fraction=0.5)
        print(f"slide {path}: written in {time.perf_counter() - t0:.0f} s")
    with open_slide(path) as slide:  # where the tissue is: darker than the glass on a 1/64 thumbnail
        thumb = slide.thumbnail(max(1, args.size // 64))
    tissue = thumb.mean(axis=2) < 215
    mask_ds = args.size / thumb.shape[1]
    rows = [_tile_times(slide_dir, tissue, mask_ds, b, args.tiles, seed) for seed, b in enumerate(("openslide", "tiffslide"))]
    overlay = _overlay_times(work, slide_dir, tissue, mask_ds, args.tiles)
    mem = [_list_memory(work, n) for n in (max(1, args.slides // 10), args.slides)]
    print(f"\nviewer tiles, {args.size} x {args.size} px slide (over HTTP, one request at a time):")
    print(pd.DataFrame(rows).to_string(index=False))
    print("\nattention heatmap overlay tiles (PNG) of the same slide:")
    print(pd.DataFrame([overlay]).to_string(index=False))
    print("\nmemory of the `wsi-pipeline view` process (every page of the list fetched; at most 16 slides open):")
    print(pd.DataFrame(mem).to_string(index=False))
    out = work / "bench_view.json"
    write_text_atomic(out, json.dumps({"tiles": rows, "overlay": overlay, "memory": mem}, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
