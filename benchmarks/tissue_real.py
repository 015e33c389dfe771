"""``make bench-tissue-real``: what tile QC removes from real, ink-free tissue, per detector, set, tile size and resolution.

Every ink-free real image under ``--realdata`` and ``--slides`` is tiled by
:func:`~wsi_pipeline.tiling.tiler.tile_slide` with the default settings except ``qc_mode="flag"``
(so every detector's verdict is recorded and nothing is removed), at tile sizes 32, 64, 128, 256
and 512 px and, where the resolution is known, natively and at ``--mpp-target`` 0.25 / 0.5 / 1.0
(a target finer than the image is not tiled: the tiler never upsamples). Sets:

* ``crc``: CRCHistoPhenotypes, H&E images of 500 x 500 px at 20x (0.5 um/px), each its own slide:
  the 97 free of tissue-marking dye (``crc-dye``: the 3 that carry it, :data:`CRC_DYED`, where
  ``pen`` is right);
* ``crc-x2``: every other one of those enlarged 2x (bicubic) and declared 0.25 um/px: the 40x
  geometry (a nucleus spans twice the pixels; the images are softer than a real 40x scan);
* ``lung``: LC25000 lung tiles (224 px, resolution unknown: native only) mosaicked 6 x 6 per slide;
* ``cmu1``: ``CMU-1-Small-Region.svs`` (0.499 um/px);
* ``lung-glass``: pale fields: blocks of 2 x 2 lung tiles laid on grey glass (216..235, the tile's own
  white mapped onto the glass level) beside white (255) scanner padding, wider than the glass (as on
  a scan whose scanned area is a strip of the slide); truth from the layout.

The images are written once as one-level JPEG slides (quality 95) into ``--cache``. A **tissue
tile** is one whose pixels are at least half stained (largest-channel optical density >= 0.05
against the image's 99.5th-percentile brightness), from the tile's own pixels, independent of the
tiler. Per (set, resolution, tile size): tissue tiles, the share of them the default QC would
drop (``pen`` or ``blur``: :attr:`QCParams.drop`), flagged ``fold``, and not kept at all by the
tissue rule (``lost``: includes tissue taken for ink). ``lung-glass`` adds the glass tiles kept.
Generated pen fields (``--pen-seeds``) and real pen images (``--pen-images``, optional) give pen
recall: the share of tiles that are at least 20 % ink flagged ``pen`` (or not kept).

    python -m benchmarks.tissue_real [--sets crc,lung,cmu1] [--tile-sizes 32,256] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RealImage", "main", "reference_tissue", "score_store"]

TILE_SIZES = (32, 64, 128, 256, 512)
MPP_TARGETS = (0.25, 0.5, 1.0)
SETS = ("crc", "crc-x2", "lung", "cmu1", "lung-glass", "crc-dye")
#: A reference tissue tile is at least this stained (fraction of its pixels).
TISSUE_MIN = 0.5
#: A pixel is stained when its largest-channel optical density against the image's white reaches this.
STAINED_OD = 0.05
#: Environment variable naming the folder of real pen-marked images (PNG + ``<name>.ink.png`` truth made by the bench).
PEN_IMAGES_ENV = "WSI_PIPELINE_TESTDATA"
DEFAULT_TESTDATA = Path.home() / ".cache" / "wsi-pipeline-testdata"
#: QCParams fields set by ``--qc key=value`` (calibration runs); empty: the defaults.
QC_OVERRIDES: dict[str, Any] = {}


@dataclass
class RealImage:
    """One image of a set: its id, uint8 RGB pixels, um per px (None: unknown) and, for fields with truth,
    a bool (H, W) tissue mask and a bool (H, W) glass mask."""

    slide_id: str
    rgb: np.ndarray
    mpp: float | None
    tissue: np.ndarray | None = None
    glass: np.ndarray | None = None


def _read_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


#: CRC images carrying tissue-marking dye (black pigment: img11, img12; blue: img62), seen by eye: not ink-free.
CRC_DYED = ("img11", "img12", "img62")
#: ``crc-x2`` tiles every other image (the 40x geometry costs 4x the pixels).
CRC_X2_STEP = 2


def _crc(root: Path, scale: int = 1, dyed: bool = False, step: int = 1) -> Iterator[RealImage]:
    import cv2

    paths = sorted((root / "crc-histophenotypes" / "images").glob("img*.png"), key=lambda q: int(q.stem[3:]))
    for p in [q for q in paths if (q.stem in CRC_DYED) == dyed][::step]:
        rgb = _read_rgb(p)
        if scale != 1:
            rgb = cv2.resize(rgb, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
        yield RealImage(f"{p.stem}{'_x' + str(scale) if scale != 1 else ''}", rgb, 0.5 / scale)


def _lung_tiles(root: Path) -> list[Path]:
    d = root / "lc25000-lung"
    return sorted(p for sub in ("lung_n", "lung_aca", "lung_scc") for p in (d / sub).glob("*.jpeg"))


def _lung(root: Path, per_side: int = 6) -> Iterator[RealImage]:
    paths = _lung_tiles(root)
    n = per_side * per_side
    for i in range(0, len(paths) - n + 1, n):
        tiles = [_read_rgb(p) for p in paths[i:i + n]]
        rows = [np.concatenate(tiles[r * per_side:(r + 1) * per_side], axis=1) for r in range(per_side)]
        yield RealImage(f"lung_mosaic{i // n:03d}", np.concatenate(rows, axis=0), None)


def _lung_on_glass(root: Path, n_fields: int = 8, seed: int = 0) -> Iterator[RealImage]:
    """Fields of 2 x 2 lung-tile blocks on grey glass with white padding (module docstring)."""
    rng = np.random.default_rng(seed)
    paths = _lung_tiles(root)
    order = rng.permutation(len(paths))
    k = 0
    for f in range(n_fields):
        glass_level = float(rng.uniform(216, 235))
        tint = np.array([1.0, rng.uniform(0.97, 1.0), rng.uniform(0.98, 1.02)], np.float32)  # grey-pink to bluish
        block, gap, nb = 448, 160, 3
        side = nb * block + (nb + 1) * gap
        pad = int(0.7 * side)  # more padding than glass: a median over both would be the padding's
        img = np.empty((side, side + pad, 3), np.float32)
        img[:] = glass_level * tint * (1.0 + 0.004 * rng.standard_normal((side, side + pad, 1)).astype(np.float32))
        tissue = np.zeros((side, side + pad), bool)
        for by in range(nb):
            for bx in range(nb):
                y0, x0 = gap + by * (block + gap), gap + bx * (block + gap)
                for dy in (0, 224):
                    for dx in (0, 224):
                        t = _read_rgb(paths[order[k % len(paths)]]).astype(np.float32)
                        k += 1
                        white = np.percentile(t.reshape(-1, 3), 99.5, axis=0)
                        trans = np.clip(t / np.maximum(white, 1.0), 0.0, 1.0)
                        img[y0 + dy:y0 + dy + 224, x0 + dx:x0 + dx + 224] *= trans
                tissue[y0:y0 + block, x0:x0 + block] = True
        img[:, side:] = 255.0  # scanner padding: exactly flat, pure white
        glass = ~tissue
        glass[:, side:] = True
        rgb = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        yield RealImage(f"lung_glass{f:02d}_g{glass_level:.0f}", rgb, 0.5, tissue=tissue, glass=glass)


def _cmu1(slides: Path) -> Iterator[RealImage]:
    path = slides / "CMU-1-Small-Region.svs"
    if path.exists():
        from wsi_pipeline.slides import open_slide

        with open_slide(path) as s:
            rgb = s.read_level(0, (0, 0), s.dimensions)
            mpp = s.mpp
        yield RealImage("CMU-1-Small-Region", np.ascontiguousarray(rgb[..., :3]), mpp)


def real_sets(name: str, realdata: Path, slides: Path) -> Iterator[RealImage]:
    """The images of set ``name`` (module docstring)."""
    if name == "crc":
        return _crc(realdata)
    if name == "crc-x2":
        return _crc(realdata, 2, step=CRC_X2_STEP)
    if name == "crc-dye":
        return _crc(realdata, dyed=True)
    if name == "lung":
        return _lung(realdata)
    if name == "lung-glass":
        return _lung_on_glass(realdata)
    if name == "cmu1":
        return _cmu1(slides)
    raise ValueError(f"set {name!r}; expected one of {SETS}")


def reference_tissue(rgb: np.ndarray, tile: int, white: np.ndarray | None = None) -> np.ndarray:
    """float (rows, cols): each grid tile's stained fraction (largest-channel optical density >= :data:`STAINED_OD`
    against ``white``, by default the image's 99.5th-percentile brightness per channel), from the tile's own pixels."""
    if white is None:
        white = np.percentile(rgb.reshape(-1, 3), 99.5, axis=0)
    white = np.maximum(np.asarray(white, np.float32), 1.0)
    od = np.log10(white / np.maximum(rgb.astype(np.float32), 1.0)).max(axis=-1)
    stained = (od >= STAINED_OD).astype(np.float32)
    rows, cols = rgb.shape[0] // tile, rgb.shape[1] // tile
    return stained[: rows * tile, : cols * tile].reshape(rows, tile, cols, tile).mean(axis=(1, 3))


def _frac(mask: np.ndarray, tile: int) -> np.ndarray:
    rows, cols = mask.shape[0] // tile, mask.shape[1] // tile
    return mask[: rows * tile, : cols * tile].reshape(rows, tile, cols, tile).mean(axis=(1, 3))


def _resized(a: np.ndarray, factor: float) -> np.ndarray:
    import cv2

    if abs(factor - 1.0) < 1e-6:
        return a
    h, w = a.shape[:2]
    size = (max(1, int(round(w / factor))), max(1, int(round(h / factor))))
    if a.dtype == bool:
        return cv2.resize(a.astype(np.float32), size, interpolation=cv2.INTER_AREA) >= 0.5
    return cv2.resize(a, size, interpolation=cv2.INTER_AREA)


def score_store(store: Path, ref: np.ndarray, glass: np.ndarray | None = None, blur_drops: bool = True) -> dict[str, int]:
    """Counts of one tiled image: reference tissue tiles, of them flagged pen / blur / fold, dropped by the
    default (pen or blur; blur only where ``blur_drops``: tiles large enough at the focus scale), not kept;
    kept tiles; glass tiles kept (``glass``: bool (rows, cols) truth)."""
    from wsi_pipeline.config.tiling_params import QCParams
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.tiling.artifacts import QC_BITS

    rows, cols = ref.shape
    kept = np.zeros((rows, cols), bool)
    flags = np.zeros((rows, cols), np.uint8)
    if store.exists():
        st = open_store(store)
        g = np.asarray(st.grid, np.int64)
        inside = (g[:, 1] < rows) & (g[:, 0] < cols)
        kept[g[inside, 1], g[inside, 0]] = True
        try:
            flags[g[inside, 1], g[inside, 0]] = np.asarray(st.array("qc_flags"))[inside]
        except KeyError:
            pass
    tissue = ref >= TISSUE_MIN
    drop_bits = sum(QC_BITS[a] for a in QCParams().drop if a != "blur" or blur_drops)
    out = {"tissue": int(tissue.sum()), "kept": int(kept.sum()), "not_kept": int((tissue & ~kept).sum())}
    for name, bit in QC_BITS.items():
        out[name] = int((tissue & kept & ((flags & bit) != 0)).sum())
    out["dropped"] = int((tissue & kept & ((flags & drop_bits) != 0)).sum())
    if glass is not None:
        out["glass"] = int(glass.sum())
        out["glass_kept"] = int((glass & kept).sum())
    return out


def _blur_drops(tile: int, tile_mpp: float | None) -> bool:
    """Whether the default drops blurred tiles of this size (the package's rule where it has one)."""
    from wsi_pipeline.tiling import artifacts

    min_px, factor = getattr(artifacts, "FOCUS_DROP_MIN_PX", None), getattr(artifacts, "focus_factor", None)
    if min_px is None or factor is None:  # an older package (the before table): blur always dropped
        return True
    return bool(tile / factor(tile_mpp) >= min_px)


def _tile(path: Path, slide_id: str, work: Path, tile: int, mpp_target: float | None) -> Path:
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.tiling.tiler import tile_slide

    cfg = TilingConfig(tile_size=tile, mpp_target=mpp_target, qc_mode="flag", qc=False)
    if QC_OVERRIDES:
        cfg = dataclasses.replace(cfg, qc_params=dataclasses.replace(cfg.qc_params, **QC_OVERRIDES))
    res = tile_slide(SlideJob(slide_id, str(path)), work, cfg, overwrite=True, background_write=False, threads=1)
    if res.status not in ("ok", "skipped"):
        print(f"  {slide_id} T={tile} mpp={mpp_target}: {res.status} {res.error}", flush=True)
    return work / f"{slide_id}.zarr"


def _add(acc: dict[str, int], c: dict[str, int]) -> None:
    for k, v in c.items():
        acc[k] = acc.get(k, 0) + v


def _pct(n: int, d: int) -> str:
    return "    -" if d == 0 else f"{100.0 * n / d:5.1f}"


def _cached_slide(cache: Path, img: RealImage) -> Path:
    from wsi_pipeline.synthetic.fields import write_one_level_slide

    path = cache / f"{img.slide_id}.svs"
    if not path.exists():
        # no mpp: written with a placeholder the tiler is told to ignore (mpp_source "none" is not possible
        # for an SVS), so such sets are tiled natively only
        write_one_level_slide(path, img.rgb, img.mpp or 0.5, quality=95, generator="benchmarks.tissue_real")
    return path


def run_set(name: str, realdata: Path, slides: Path, cache: Path, tile_sizes: tuple[int, ...],
            mpp_targets: tuple[float, ...], limit: int = 0) -> list[dict[str, Any]]:
    """Tile every image of set ``name`` (the first ``limit``; 0: all) at each tile size and resolution;
    one row per (resolution, tile size)."""
    import itertools
    import shutil

    cache.mkdir(parents=True, exist_ok=True)
    work = cache / "tiles"
    images = list(itertools.islice(real_sets(name, realdata, slides), limit or None))
    if not images:
        return []
    res_list: list[float | None] = [None]
    if images[0].mpp is not None:
        res_list += [m for m in mpp_targets if m >= images[0].mpp * 0.95 and abs(m / images[0].mpp - 1) > 0.05]
    rows = []
    for target in res_list:
        for tile in tile_sizes:
            acc: dict[str, int] = {}
            t0 = time.perf_counter()
            n_slides = 0
            for img in images:
                factor = 1.0 if target is None or img.mpp is None else target / img.mpp
                rgb = _resized(img.rgb, factor)
                if min(rgb.shape[:2]) < tile:
                    continue
                n_slides += 1
                path = _cached_slide(cache, img)
                store = _tile(path, img.slide_id, work, tile, target)
                glass = None
                white = None
                if img.glass is not None:  # the layout's glass (not the padding) is the white
                    on_glass = rgb[_resized(img.glass, factor) & (rgb.min(axis=-1) < 253)]
                    white = np.median(on_glass.reshape(-1, 3), axis=0) if on_glass.size else None
                ref = reference_tissue(rgb, tile, white)
                if img.tissue is not None and img.glass is not None:
                    t_frac = _frac(_resized(img.tissue, factor), tile)
                    g_frac = _frac(_resized(img.glass, factor), tile)
                    ref = np.where(t_frac >= 0.9, ref, 0.0)  # inside a tissue block (layout) and stained
                    glass = g_frac >= 0.999
                _add(acc, score_store(store, ref, glass, _blur_drops(tile, target or img.mpp)))
                shutil.rmtree(store, ignore_errors=True)
            mpp = images[0].mpp if target is None else target
            row = {"set": name, "mpp": mpp, "target": target, "tile": tile, "slides": n_slides, **acc,
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(_fmt_row(row), flush=True)
    return rows


HEADER = (f"{'set':>10} {'um/px':>6} {'T':>4} {'slides':>6} {'tissue':>7} | {'pen%':>5} {'blur%':>5} {'drop%':>5} "
          f"{'fold%':>5} {'lost%':>5} | {'glass kept':>10} {'s':>6}")


def _fmt_row(r: dict[str, Any]) -> str:
    mpp = "?" if r["mpp"] is None else f"{r['mpp']:.3g}"
    d = r.get("tissue", 0)
    glass = f"{r['glass_kept']}/{r['glass']}" if "glass" in r else "-"
    return (f"{r['set']:>10} {mpp:>6} {r['tile']:>4} {r['slides']:>6} {d:>7} | {_pct(r.get('pen', 0), d)} "
            f"{_pct(r.get('blur', 0), d)} {_pct(r.get('dropped', 0), d)} {_pct(r.get('fold', 0), d)} "
            f"{_pct(r.get('not_kept', 0), d)} | {glass:>10} {r['seconds']:>6}")


def pen_recall_generated(cache: Path, seeds: int, tile_sizes: tuple[int, ...], kind: str = "pen") -> list[dict[str, Any]]:
    """Recall on the generated ``kind`` (``pen`` or ``fold``) fields (:mod:`~wsi_pipeline.synthetic.fields`, 2048 px
    at 0.5 um/px): tiles at least 20 % painted ink (fold) that are flagged ``pen`` (``fold``) or not kept, and
    tissue tiles free of it that are flagged."""
    import shutil

    from wsi_pipeline.synthetic.fields import FIELD_KINDS, field_spec, make_field, tile_truth, write_field

    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for tile in tile_sizes:
        c = {"ink_tiles": 0, "found": 0, "clean_tissue": 0, "clean_flagged": 0}
        for seed in range(seeds):
            rng = np.random.default_rng([seed, FIELD_KINDS.index(kind)])
            f = make_field(field_spec(kind, rng, (2048, 2048)), seed=1000 + 17 * seed + FIELD_KINDS.index(kind))
            path = cache / f"{kind}_{seed}_2048.svs"
            if not path.exists():
                write_field(path, f)
            store = _tile(path, path.stem, cache / "tiles", tile, None)
            truth = tile_truth(f, tile)
            s = _pen_score(store, truth[kind], truth["tissue"], kind)
            _add(c, s)
            shutil.rmtree(store, ignore_errors=True)
        rows.append({"source": f"generated {kind}", "tile": tile, **c})
    return rows


def _pen_score(store: Path, ink: np.ndarray, tissue: np.ndarray, kind: str = "pen") -> dict[str, int]:
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.tiling.artifacts import QC_BITS

    rows, cols = ink.shape
    kept = np.zeros((rows, cols), bool)
    pen = np.zeros((rows, cols), bool)
    if store.exists():
        st = open_store(store)
        g = np.asarray(st.grid, np.int64)
        inside = (g[:, 1] < rows) & (g[:, 0] < cols)
        kept[g[inside, 1], g[inside, 0]] = True
        pen[g[inside, 1], g[inside, 0]] = (np.asarray(st.array("qc_flags"))[inside] & QC_BITS[kind]) != 0
    inked = ink >= 0.2
    clean = (ink == 0) & (tissue >= TISSUE_MIN)
    found = pen | ~kept if kind == "pen" else pen  # a fold is flagged, never removed
    return {"ink_tiles": int(inked.sum()), "found": int((inked & found).sum()),
            "clean_tissue": int(clean.sum()), "clean_flagged": int((clean & kept & pen).sum())}


def pen_recall_real(folder: Path, cache: Path, tile_sizes: tuple[int, ...], mpp: float) -> list[dict[str, Any]]:
    """Pen recall on real pen-marked images: every ``<name>.png`` in ``folder`` with a ``<name>.ink.png``
    truth mask (255 = ink, 0 = no ink, other values = unsure) beside it, tiled at ``mpp`` um/px."""
    import shutil

    from wsi_pipeline.synthetic.fields import write_one_level_slide

    rows = []
    pairs = [(p, p.with_name(p.stem + ".ink.png")) for p in sorted(folder.glob("*.png")) if not p.stem.endswith(".ink")]
    pairs = [(p, q) for p, q in pairs if q.exists()]
    for tile in tile_sizes:
        c = {"ink_tiles": 0, "found": 0, "clean_tissue": 0, "clean_flagged": 0}
        for p, q in pairs:
            rgb = _read_rgb(p)
            truth = np.asarray(_read_rgb(q))[..., 0]
            if min(rgb.shape[:2]) < 2 * tile:
                continue
            path = cache / f"pen_real_{p.stem}.svs"
            if not path.exists():
                write_one_level_slide(path, rgb, mpp, quality=95, generator="benchmarks.tissue_real")
            store = _tile(path, path.stem, cache / "tiles", tile, None)
            ink = _frac(truth == 255, tile)
            ok = _frac(truth == 0, tile) == 1.0
            tissue = np.where(ok, reference_tissue(rgb, tile), 0.0)
            _add(c, _pen_score(store, np.where(ok, 0.0, np.maximum(ink, 1e-3)), tissue))
            shutil.rmtree(store, ignore_errors=True)
        rows.append({"source": f"real ({len(pairs)} images, {mpp:g} um/px assumed)", "tile": tile, **c})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Tile the real sets, print the table and write ``--out`` (JSON)."""
    from wsi_pipeline.io_atomic import write_text_atomic

    root = Path(__file__).resolve().parents[1].parent / "shared"
    p = argparse.ArgumentParser(prog="python -m benchmarks.tissue_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--realdata", type=Path, default=root / "realdata", help="folder of crc-histophenotypes and lc25000-lung")
    p.add_argument("--slides", type=Path, default=root / "slides", help="folder holding CMU-1-Small-Region.svs")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated sets of {SETS}")
    p.add_argument("--tile-sizes", default=",".join(map(str, TILE_SIZES)), help="comma-separated tile sizes, px")
    p.add_argument("--mpp-targets", default=",".join(map(str, MPP_TARGETS)), help="comma-separated um/px (besides native)")
    p.add_argument("--qc", action="append", default=[], metavar="KEY=VALUE",
                   help="a QCParams field other than the default (calibration), e.g. overview_um=8; repeatable")
    p.add_argument("--limit", type=int, default=0, help="images per set (0: all)")
    p.add_argument("--pen-seeds", type=int, default=3, help="generated pen fields (0: none)")
    p.add_argument("--pen-images", type=Path, default=Path(os.environ.get(PEN_IMAGES_ENV, DEFAULT_TESTDATA)) / "pen",
                   help=f"folder of real pen-marked images with .ink.png truth (env {PEN_IMAGES_ENV}/pen); skipped when absent")
    p.add_argument("--pen-mpp", type=float, default=2.0, help="um/px assumed for the real pen images")
    p.add_argument("--cache", type=Path, default=Path(".bench-cache/tissue_real"), help="slides written from the images")
    p.add_argument("--out", type=Path, default=Path("results/bench_tissue_real.json"))
    args = p.parse_args(argv)
    for kv in args.qc:
        key, _, value = kv.partition("=")
        QC_OVERRIDES[key.strip()] = float(value)
    sizes = tuple(int(v) for v in args.tile_sizes.split(","))
    targets = tuple(float(v) for v in args.mpp_targets.split(",")) if args.mpp_targets else ()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for name in filter(None, args.sets.split(",")):
        if name in ("crc", "crc-x2", "crc-dye", "lung", "lung-glass") and not args.realdata.is_dir():
            print(f"{name}: skipped, {args.realdata} is absent", flush=True)
            continue
        rows += run_set(name, args.realdata, args.slides, args.cache / name, sizes, targets, args.limit)
    pen: list[dict[str, Any]] = []
    if args.pen_seeds > 0:
        pen += pen_recall_generated(args.cache / "pen", args.pen_seeds, (64, 256))
        pen += pen_recall_generated(args.cache / "pen", args.pen_seeds, (64, 256), kind="fold")
    if args.pen_images.is_dir():
        pen += pen_recall_real(args.pen_images, args.cache / "pen_real", (32, 64), args.pen_mpp)
    if pen:
        print("\nrecall: tiles >= 20 % ink (fold) flagged pen or not kept (flagged fold); clean tissue tiles flagged")
        for r in pen:
            print(f"  {r['source']:>40} T={r['tile']:>4}: recall {r['found']}/{r['ink_tiles']} "
                  f"({_pct(r['found'], r['ink_tiles'])} %), false {r['clean_flagged']}/{r['clean_tissue']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps({"rows": rows, "pen": pen, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
