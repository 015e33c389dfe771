"""``make bench-tissue`` (first part): tile-level precision and recall of tissue detection against painted truth.

Fields of every kind of :data:`~wsi_pipeline.synthetic.fields.FIELD_KINDS` (H&E, IHC on glass at
216, pale, pen, blur, folds, glass at 210 / 230 / bluish, blank glass; ``--seeds`` of each,
2048 x 2048 px at 0.5 um/px, 64 tiles of 256 px) are written once as JPEG slides into ``--cache``
and tiled by every method (``greyscale``, ``otsu``, ``unet``, ``tissue``) through
:func:`~wsi_pipeline.tiling.tiler.tile_slide` with its default settings (tile QC included where
the code has it). A tile is

* **worth keeping** when >= 60 % of it is painted tissue free of ink, < 5 % of it ink and < 25 %
  of it out-of-focus tissue;
* **not worth keeping** when < 40 % of it is tissue, >= 20 % ink or >= 75 % out of focus;
* otherwise ambiguous (a border tile) and not scored (the count is printed).

Per kind and method: precision = kept & worth / kept (scored tiles), recall = kept & worth / worth,
and the tiles kept; a field that is mostly tissue where a method keeps nothing is marked ``!``.
The real slides under ``--real-slides`` (no painted truth) get the tiles each method keeps and
its status. Runs against any version of the package (a method it lacks is ``n/a``), so the same
command gives the before and after tables.

    python -m benchmarks.tissue_detection [--seeds 3] [--methods greyscale,otsu,unet,tissue]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "score_tiles", "truth_labels"]

#: Painted-truth thresholds (fractions of a tile): worth keeping / not worth keeping; between them: not scored.
WORTH = {"tissue": 0.6, "pen": 0.05, "blur": 0.25}
NOT_WORTH = {"tissue": 0.4, "pen": 0.2, "blur": 0.75}
METHODS = ("greyscale", "otsu", "unet", "tissue")


def truth_labels(truth: dict[str, np.ndarray]) -> np.ndarray:
    """int8 (rows, cols): 1 worth keeping, 0 not, -1 ambiguous, from :func:`~wsi_pipeline.synthetic.fields.tile_truth`."""
    t, p, b = truth["tissue"], truth["pen"], truth["blur"]
    worth = (t >= WORTH["tissue"]) & (p < WORTH["pen"]) & (b < WORTH["blur"])
    not_worth = (t < NOT_WORTH["tissue"]) | (p >= NOT_WORTH["pen"]) | (b >= NOT_WORTH["blur"])
    out = np.full(t.shape, -1, np.int8)
    out[not_worth] = 0
    out[worth] = 1
    return out


def score_tiles(labels: np.ndarray, kept: np.ndarray) -> dict[str, int]:
    """Counts over scored tiles (labels >= 0): true/false positives, false negatives, tiles kept, ambiguous."""
    scored = labels >= 0
    pos = labels == 1
    return {"tp": int((kept & pos).sum()), "fp": int((kept & scored & ~pos).sum()), "fn": int((~kept & pos).sum()),
            "kept": int(kept.sum()), "ambiguous": int((~scored).sum()), "worth": int(pos.sum())}


def _config(method: str) -> Any:
    from wsi_pipeline.config.tiling import TilingConfig

    names = {f.name for f in dataclasses.fields(TilingConfig)}
    kw = {"method": method, "qc": False} if "qc" in names else {"method": method}
    return TilingConfig(**kw)


def _kept_grid(store: Path, rows: int, cols: int) -> np.ndarray:
    from wsi_pipeline.data.store import open_store

    kept = np.zeros((rows, cols), bool)
    if store.exists():
        g = open_store(store).grid
        inside = (g[:, 1] < rows) & (g[:, 0] < cols)
        kept[g[inside, 1], g[inside, 0]] = True
    return kept


def _fmt(c: dict[str, int] | None) -> str:
    if c is None:
        return "n/a"
    p = c["tp"] / (c["tp"] + c["fp"]) if c["tp"] + c["fp"] else float("nan")
    r = c["tp"] / (c["tp"] + c["fn"]) if c["tp"] + c["fn"] else float("nan")
    ps = "  -  " if np.isnan(p) else f"{p:.3f}"
    rs = "  -  " if np.isnan(r) else f"{r:.3f}"
    return f"{ps} {rs} {c['kept']:>4}{'!' if c.get('zero_on_tissue') else ' '}"


def main(argv: list[str] | None = None) -> int:
    """Generate the fields (cached), tile them with every method, print the table and write ``--out`` (JSON)."""
    from wsi_pipeline.synthetic.fields import FIELD_KINDS, field_spec, make_field, tile_truth, write_field
    from wsi_pipeline.config.tiling import DEFAULT_MIN_FOREGROUND as AVAILABLE
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.tiling.tiler import tile_slide

    p = argparse.ArgumentParser(prog="python -m benchmarks.tissue_detection", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="fields per kind")
    p.add_argument("--size", type=int, default=2048, help="field side, px (256 px tiles)")
    p.add_argument("--kinds", default=",".join(FIELD_KINDS), help="comma-separated kinds")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--cache", type=Path, default=Path(".bench-cache/tissue_fields"), help="generated fields (kept between runs)")
    p.add_argument("--real-slides", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "slides")
    p.add_argument("--out", type=Path, default=Path("results/bench_tissue_detection.json"))
    args = p.parse_args(argv)
    kinds, methods = args.kinds.split(","), args.methods.split(",")
    args.cache.mkdir(parents=True, exist_ok=True)
    work = args.cache / "tiles"
    totals: dict[str, dict[str, dict[str, int] | None]] = {}
    seconds: dict[str, float] = {m: 0.0 for m in methods}
    for kind in kinds:
        totals[kind] = {}
        for seed in range(args.seeds):
            rng = np.random.default_rng([seed, FIELD_KINDS.index(kind)])
            f = make_field(field_spec(kind, rng, (args.size, args.size)), seed=1000 + 17 * seed + FIELD_KINDS.index(kind))
            path = args.cache / f"{kind}_{seed}_{args.size}.svs"
            if not path.exists():
                write_field(path, f)
            truth = tile_truth(f, 256)
            labels = truth_labels(truth)
            mostly_tissue = truth["tissue"].mean() >= 0.5
            for m in methods:
                if m not in AVAILABLE:
                    totals[kind][m] = None
                    continue
                out = work / m
                t0 = time.perf_counter()
                res = tile_slide(SlideJob(path.stem, str(path)), out, _config(m), overwrite=True)
                seconds[m] += time.perf_counter() - t0
                if res.status != "ok":
                    print(f"  {path.name} {m}: {res.status} {res.error} {res.note}")
                kept = _kept_grid(out / f"{path.stem}.zarr", *labels.shape)
                c = score_tiles(labels, kept)
                c["zero_on_tissue"] = int(mostly_tissue and c["kept"] == 0)
                acc = totals[kind].get(m) or {k: 0 for k in c}
                totals[kind][m] = {k: acc[k] + c[k] for k in c}
        amb = next((c["ambiguous"] for c in totals[kind].values() if c), 0)
        worth = next((c["worth"] for c in totals[kind].values() if c), 0)
        print(f"{kind:>9} ({args.seeds} fields, {worth} worth keeping, {amb} ambiguous): "
              + " | ".join(f"{m} {_fmt(totals[kind][m])}" for m in methods), flush=True)
    print()
    print("precision recall kept per kind and method ('!': a mostly-tissue field with 0 tiles kept)")
    print(f"{'kind':>9} | " + " | ".join(f"{m:^20}" for m in methods))
    for kind in kinds:
        print(f"{kind:>9} | " + " | ".join(f"{_fmt(totals[kind][m]):^20}" for m in methods))
    print(f"{'seconds':>9} | " + " | ".join(f"{seconds[m]:^20.1f}" for m in methods))
    real: dict[str, dict[str, Any]] = {}
    if args.real_slides.is_dir():
        print("\nreal slides (no painted truth): tiles kept, status")
        for rel in ("CMU-1-Small-Region.svs", "dicom-bone", "test3-DAPI-2-387.ndpi"):
            path = args.real_slides / rel
            if not path.exists():
                continue
            real[rel] = {}
            for m in methods:
                if m not in AVAILABLE:
                    continue
                res = tile_slide(SlideJob(Path(rel).stem, str(path)), work / "real" / m, _config(m), overwrite=True)
                real[rel][m] = {"status": res.status, "n_tiles": res.n_tiles, "note": res.note[:120], "error": res.error[:120]}
            print(f"{rel:>24} | " + " | ".join(f"{m} {v['n_tiles']} {v['status']}" for m, v in real[rel].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from wsi_pipeline.io_atomic import write_text_atomic

    write_text_atomic(args.out, json.dumps({"fields": totals, "real": real, "seconds": seconds, "worth": WORTH,
                                            "not_worth": NOT_WORTH}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
