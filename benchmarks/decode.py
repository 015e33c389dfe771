"""Decode benchmark (``make bench-decode``): direct stored-tile decoding against OpenSlide, per tile.

Builds once (cached) a real-tissue mosaic from ``../shared/slides/CMU-1-Small-Region.svs``: the
tissue is cut out through its own Otsu mask, copied in the eight rotations / mirrors onto a lattice
over scanner-like glass (the scan's own glass colour, a slow illumination gradient, pixel noise) to
about 45 % tissue, and written as a pyramidal generic tiled TIFF (default 24576 x 24576 px, 256 px
YCbCr 4:2:0 JPEG tiles, quality 90, levels down by 2). Then, alternating the runs and taking medians,
it reads every tile of the 256 px level-0 grid:

1. ``openslide``: the project's OpenSlide-backed ``Slide.read_region``, one 256 x 256 read per tile;
2. ``direct``: :class:`~wsi_pipeline.slides.direct.DirectTiles`, the grid row by row (each stored
   tile decoded once);
3. ``floor``: only decoding each stored tile once (bytes read at their offsets, libjpeg-turbo);

and checks a sample of direct tiles against OpenSlide byte for byte. The same three figures are
taken on CMU-1-Small-Region.svs itself (240 px RGB-coded JPEG tiles, not aligned with the 256 px
grid). The page cache is warmed first, so the figures are CPU-bound. One thread throughout; wall
and this thread's CPU time are both reported (CPU time is the steadier figure on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from wsi_pipeline.io_atomic import atomic_path, write_text_atomic

GRID = 256  # px, the tile grid measured
_SPEC_VERSION = 1


def _source(slide_path: Path) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """CMU-1-Small-Region level 0 (uint8 RGB), its tissue mask (bool, same size), its glass colour."""
    import cv2

    from wsi_pipeline.slides.opener import open_slide
    from wsi_pipeline.tiling.tissue import otsu_tissue_mask

    with open_slide(slide_path, backend="openslide") as slide:
        img = slide.read_region((0, 0), 0, slide.dimensions)
        mpp = slide.mpp or 0.5
    h, w = img.shape[:2]
    small = cv2.resize(img, (w // 8, h // 8), interpolation=cv2.INTER_AREA)
    mask, _ = otsu_tissue_mask(small, mpp * 8)
    mask = cv2.resize(mask.astype(np.uint8), (w, h), interpolation=cv2.INTER_NEAREST).astype(bool)
    glass = tuple(int(round(v)) for v in np.median(img[~mask], axis=0))
    return img, mask, glass  # type: ignore[return-value]


def _variants(img: np.ndarray, mask: np.ndarray, factor: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The eight rotations / mirrors of (image, mask), reduced by ``factor`` (area mean / nearest)."""
    import cv2

    out = []
    for flip in (False, True):
        a, m = (img[:, ::-1], mask[:, ::-1]) if flip else (img, mask)
        for k in range(4):
            ra, rm = np.ascontiguousarray(np.rot90(a, k)), np.ascontiguousarray(np.rot90(m, k))
            if factor > 1:
                size = (ra.shape[1] // factor, ra.shape[0] // factor)
                ra = cv2.resize(ra, size, interpolation=cv2.INTER_AREA)
                rm = cv2.resize(rm.astype(np.uint8), size, interpolation=cv2.INTER_NEAREST).astype(bool)
            out.append((ra, rm))
    return out


def _layout(size: int, pitch: int, seed: int) -> list[tuple[int, int, int]]:
    """(x, y, variant) of each pasted copy in level-0 px: a lattice with jitter in steps of 16 px."""
    rng = np.random.default_rng(seed)
    out = []
    for y in range(-pitch // 4, size, pitch):
        for x in range(-pitch // 4, size, pitch):
            jx, jy = (int(v) * 16 for v in rng.integers(-12, 13, 2))
            out.append((x + jx, y + jy, int(rng.integers(0, 8))))
    return out


def _level_tiles(src: tuple[np.ndarray, np.ndarray, tuple[int, int, int]], size: int, factor: int, layout: list[tuple[int, int, int]], seed: int, tissue: list[int]) -> Iterator[np.ndarray]:
    """256 px tiles, row-major, of the mosaic reduced by ``factor``; counts tissue px into ``tissue``."""
    img, mask, glass = src
    variants = _variants(img, mask, factor)
    side = size // factor
    rng = np.random.default_rng(seed + factor)
    noise = rng.integers(-3, 4, (16, GRID, GRID, 3)).astype(np.int16)
    cols = -(-side // GRID)
    yy, xx = np.mgrid[0:GRID, 0 : cols * GRID].astype(np.float32) / side
    for ty in range(-(-side // GRID)):
        y0 = ty * GRID
        # glass: the scan's glass colour, a slow illumination falloff towards the corners, noise
        shade = 1.0 - 0.025 * ((xx - 0.5) ** 2 + (yy + y0 / side - 0.5) ** 2)
        band = (np.asarray(glass, np.float32) * shade[..., None]).astype(np.int16)
        band += np.concatenate([noise[i] for i in rng.integers(0, 16, cols)], axis=1)
        band = np.clip(band, 0, 255).astype(np.uint8)
        covered = np.zeros(band.shape[:2], bool)
        for x, y, v in layout:
            a, m = variants[v]
            px, py = x // factor, y // factor
            r0, r1 = max(y0, py), min(y0 + GRID, py + a.shape[0])
            c0, c1 = max(0, px), min(cols * GRID, px + a.shape[1])
            if r1 <= r0 or c1 <= c0:
                continue
            sub_m = m[r0 - py : r1 - py, c0 - px : c1 - px]
            dst = band[r0 - y0 : r1 - y0, c0:c1]
            dst[sub_m] = a[r0 - py : r1 - py, c0 - px : c1 - px][sub_m]
            covered[r0 - y0 : r1 - y0, c0:c1] |= sub_m
        tissue[0] += int(covered[: min(GRID, side - y0), :side].sum())
        for tx in range(cols):
            yield band[:, tx * GRID : (tx + 1) * GRID]


def build_mosaic(path: Path, source: Path, size: int = 24576, pitch: int = 2304, quality: int = 90, seed: int = 21, regenerate: bool = False) -> dict:
    """Write the mosaic (see the module docstring) unless a complete one with the same spec exists.

    ``size`` (level-0 side, px) must be a multiple of 256 x 16; ``pitch`` is the lattice step of the
    pasted copies in level-0 px. Returns the spec with the measured tissue fraction. The TIFF is
    written to a temporary name and renamed; the spec file beside it is written last.
    """
    import tifffile

    if size % (GRID * 16):
        raise ValueError(f"size={size} px must be a multiple of {GRID * 16}")
    spec = {"size": size, "pitch": pitch, "quality": quality, "seed": seed, "source": source.name, "version": _SPEC_VERSION}
    meta = path.with_suffix(".json")
    if not regenerate and path.exists() and meta.exists():
        done = json.loads(meta.read_text())
        if {k: done.get(k) for k in spec} == spec:
            return done
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building {path} ({size} x {size} px) from {source} ...", flush=True)
    src = _source(source)
    layout = _layout(size, pitch, seed)
    fractions = []
    with atomic_path(path) as tmp, tifffile.TiffWriter(tmp, bigtiff=True) as tw:
        factor = 1
        while size // factor >= 1024:
            side = size // factor
            tissue = [0]
            tw.write(
                _level_tiles(src, size, factor, layout, seed, tissue),
                shape=(side, side, 3),
                dtype=np.uint8,
                tile=(GRID, GRID),
                photometric="rgb",
                compression="jpeg",
                compressionargs={"level": quality},
                subfiletype=0 if factor == 1 else 1,
                metadata=None,
            )
            fractions.append(tissue[0] / side**2)
            factor *= 2
    done = dict(spec, tissue_fraction=round(fractions[0], 4), levels=len(fractions), build_s=round(time.perf_counter() - t0, 1))
    write_text_atomic(meta, json.dumps(done))
    print(f"  done in {done['build_s']} s, {path.stat().st_size / 2**20:.0f} MiB, tissue {100 * done['tissue_fraction']:.1f} %", flush=True)
    return done


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def _grid(w: int, h: int) -> list[tuple[int, int]]:
    return [(x, y) for y in range(0, h, GRID) for x in range(0, w, GRID)]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    """(wall s, this thread's CPU s) since ``t``."""
    return time.perf_counter() - t[0], time.thread_time() - t[1]


def _run_openslide(path: Path, origins: list[tuple[int, int]]) -> tuple[float, float]:
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(path, backend="openslide") as slide:
        t = _clock()
        for x, y in origins:
            slide.read_region((x, y), 0, (GRID, GRID))
        return _since(t)


def _run_direct(path: Path, origins: list[tuple[int, int]]) -> tuple[tuple[float, float], int]:
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        t = _clock()
        for _ in reader.read_tiles(0, origins, GRID):
            pass
        return _since(t), reader.decoded


def _run_floor(path: Path) -> tuple[tuple[float, float], int]:
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide, cache_bytes=0) as reader:
        tw, th = reader.stored_tile_size(0)
        w, h = slide.level_dimensions[0]
        cells = [(c, r) for r in range(-(-h // th)) for c in range(-(-w // tw))]
        t = _clock()
        for c, r in cells:
            reader.stored_tile(0, c, r)
        return _since(t), len(cells)


def _verify(path: Path, origins: list[tuple[int, int]], n: int) -> tuple[int, int]:
    """Direct vs OpenSlide on ``n`` grid tiles spread over the grid: (checked, differing)."""
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    pick = origins if n >= len(origins) else [origins[int(i)] for i in np.linspace(0, len(origins) - 1, n)]
    bad = 0
    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        if not reader.supports(0):
            raise ValueError(f"{path}: level 0 is not read directly: {reader.reason(0)}")
        for x, y in pick:
            bad += not np.array_equal(reader.read(0, x, y, GRID, GRID), slide.read_region((x, y), 0, (GRID, GRID)))
    return len(pick), bad


def measure(path: Path, repeats: int, verify: int) -> dict:
    """The three per-tile figures on ``path`` (medians of ``repeats`` alternating runs)."""
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(path, backend="openslide") as slide:
        w, h = slide.level_dimensions[0]
    origins = _grid(w, h)
    _warm(path)
    checked, bad = _verify(path, origins, verify)
    runs: dict[str, list[tuple[float, float]]] = {"openslide": [], "direct": [], "floor": []}
    decoded = stored = 0
    for _ in range(repeats):
        runs["openslide"].append(_run_openslide(path, origins))
        s, decoded = _run_direct(path, origins)
        runs["direct"].append(s)
        s, stored = _run_floor(path)
        runs["floor"].append(s)
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    return {
        "slide": str(path),
        "level0": [w, h],
        "grid_tiles": len(origins),
        "stored_tiles": stored,
        "stored_tiles_decoded_by_direct": decoded,
        "verified_tiles": checked,
        "verified_differing": bad,
        "wall_s": {k: round(v, 3) for k, v in med.items()},
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "runs_wall_cpu_s": {k: [[round(w, 3), round(c, 3)] for w, c in v] for k, v in runs.items()},
        "ms_per_grid_tile": {k: round(1000 * v / len(origins), 3) for k, v in med.items()},
        "cpu_ms_per_grid_tile": {k: round(1000 * v / len(origins), 3) for k, v in cpu.items()},
        "ms_per_stored_tile_floor": round(1000 * med["floor"] / max(stored, 1), 3),
        "openslide_over_direct": round(med["openslide"] / med["direct"], 2),
        "direct_over_floor": round(med["direct"] / med["floor"], 2),
        "cpu_openslide_over_direct": round(cpu["openslide"] / cpu["direct"], 2),
        "cpu_direct_over_floor": round(cpu["direct"] / cpu["floor"], 2),
    }


def _report(r: dict) -> None:
    print(f"\n{r['slide']}: {r['level0'][0]} x {r['level0'][1]} px, {r['grid_tiles']} grid tiles of {GRID} px, {r['stored_tiles']} stored tiles")
    print(f"  verified {r['verified_tiles']} grid tiles direct vs OpenSlide: {r['verified_differing']} differ")
    print(f"  {'run':<10} {'wall s':>8} {'ms/grid tile':>13} {'CPU s':>8} {'CPU ms/tile':>12}")
    for k in ("openslide", "direct", "floor"):
        print(f"  {k:<10} {r['wall_s'][k]:>8.3f} {r['ms_per_grid_tile'][k]:>13.3f} {r['cpu_s'][k]:>8.3f} {r['cpu_ms_per_grid_tile'][k]:>12.3f}")
    print(f"  OpenSlide / direct = {r['openslide_over_direct']}x wall, {r['cpu_openslide_over_direct']}x CPU; "
          f"direct / floor = {r['direct_over_floor']}x wall, {r['cpu_direct_over_floor']}x CPU; "
          f"stored tiles decoded by direct: {r['stored_tiles_decoded_by_direct']} of {r['stored_tiles']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--source", type=Path, default=Path(os.environ.get("WSI_TEST_SLIDES", here.parent / "shared" / "slides")) / "CMU-1-Small-Region.svs",
                   help="the real slide the mosaic is cut from (default ../shared/slides/CMU-1-Small-Region.svs)")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("WSI_BENCH_CACHE", here / ".bench-cache")),
                   help="folder of the generated mosaic (reused between runs; env WSI_BENCH_CACHE; default .bench-cache/, git-ignored)")
    p.add_argument("--size", type=int, default=24576, help="level-0 side of the mosaic in px (multiple of 4096)")
    p.add_argument("--regenerate", action="store_true", help="rebuild the mosaic even if cached")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per figure; medians are reported")
    p.add_argument("--verify", type=int, default=400, help="grid tiles compared byte for byte with OpenSlide per slide")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not args.source.is_file():
        print(f"source slide not found: {args.source} (pass --source or set WSI_TEST_SLIDES)", file=sys.stderr)
        return 2
    spec = build_mosaic(args.cache / f"cmu1_mosaic_{args.size}.tif", args.source, size=args.size, regenerate=args.regenerate)
    print(f"mosaic: {json.dumps(spec)}")
    results = []
    for path in (args.cache / f"cmu1_mosaic_{args.size}.tif", args.source):
        r = measure(path, args.repeats, args.verify)
        _report(r)
        results.append(r)
    if args.json:
        write_text_atomic(args.json, json.dumps({"mosaic": spec, "results": results}, indent=1))
    return 0 if all(r["verified_differing"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
