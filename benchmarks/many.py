"""``make bench-many``: many small inputs against the cost of decoding them.

A folder of ``--n`` small images (``--size`` px square, PNG) goes through ``wsi-pipeline tile``
(``--tile-size`` px grid, ``--workers`` processes, QC images and tile QC off: the work a plain
grid tiling must do) as a user runs it: a fresh ``python -m wsi_pipeline`` process, timed from the
outside, so interpreter start, imports, worker start-up, locks, reports and the stores' files all
count. Beside it, alternating run by run so that the machine's load falls on both sides, the
**decode floor**: the same files decoded (Pillow, ``Image.open(f).convert("RGB")`` into a numpy array)
by a pool of as many fresh processes as the stage has workers (``spawn``, started inside the timed
span, as the stage starts its workers). The table gives, per stage, the wall time and the per-item
cost of both and their ratio (stage / decode), each the median over ``--repeats`` alternating runs;
every figure is measured in this run, none is a constant.

Images: the real colon images (CRCHistoPhenotypes, 500 x 500 H&E, ``--real``), taken in turn and
varied by the eight flips and quarter turns to reach the count, resized when ``--size`` is not
theirs; every ``--generated``-th image instead a generated one (pink stained blobs on glass, seeded),
and all of them generated when the real folder is absent. They are written once per (n, size,
generated) into ``--work``.

``--features ENCODER`` adds ``wsi-pipeline features`` (that encoder, random weights, on the CPU, in
one process) over the last tiling run's stores, against the decode floor on one process: what a
slide costs to embed once tiled.

``--package`` runs the stages with another checkout's package (its root put first on the
stages' ``PYTHONPATH``), e.g. the commit before a change, for a before/after table in one sitting.

    python -m benchmarks.many [--n 800] [--size 500] [--tile-size 128] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["COLUMNS", "StageRow", "decode_files", "main", "make_images", "measure", "table"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REAL = ROOT.parent / "shared" / "realdata" / "crc-histophenotypes" / "images"
#: The table's columns, in order.
COLUMNS = ("stage", "n", "workers", "wall_s", "per_item_ms", "decode_wall_s", "decode_per_item_ms", "ratio", "cpu_per_item_ms",
           "decode_cpu_per_item_ms", "cpu_ratio")


@dataclass(frozen=True)
class StageRow:
    """One stage against the decode floor: median wall times (s) over the repeats, per item (ms), their ratio; and
    the CPU time (user + system, every process of the side) per item (ms) and its ratio, the figure a loaded
    machine moves least."""

    stage: str
    n: int
    workers: int
    wall_s: float
    per_item_ms: float
    decode_wall_s: float
    decode_per_item_ms: float
    ratio: float
    cpu_per_item_ms: float
    decode_cpu_per_item_ms: float
    cpu_ratio: float


def _generated(size: int, seed: int) -> np.ndarray:
    """A uint8 (size, size, 3) field: pale glass with noise and pink-purple stained blobs."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    img = np.full((size, size, 3), (236, 232, 238), np.float32)
    for _ in range(int(rng.integers(2, 7))):
        cx, cy, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(size / 10, size / 3)
        blob = np.clip(1.0 - ((xx - cx) ** 2 + (yy - cy) ** 2) / r**2, 0, 1)[..., None]
        colour = np.array([rng.uniform(150, 200), rng.uniform(60, 120), rng.uniform(140, 190)], np.float32)
        img = img * (1 - blob) + colour * blob
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_images(folder: Path, n: int, size: int, *, real: Path | None = DEFAULT_REAL, generated_every: int = 10) -> list[Path]:
    """Write ``n`` PNG images of ``size`` px into ``folder`` (kept when already complete); their paths.

    Real images (``real``, a folder of them) in turn, the k-th pass over them flipped (odd passes) and
    turned by k // 2 quarter turns; every ``generated_every``-th image (0: none) a generated one; all
    generated when ``real`` is None or holds no image.
    """
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"img{i:05d}.png" for i in range(n)]
    done = folder / ".complete.json"
    spec = {"n": n, "size": size, "real": str(real) if real else None, "generated_every": generated_every}
    if done.exists() and json.loads(done.read_text()) == spec and all(p.exists() for p in paths):
        return paths
    sources = sorted(p for p in real.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".tif", ".tiff")) \
        if real is not None and real.is_dir() else []
    k = 0
    for i, path in enumerate(paths):
        if not sources or (generated_every and i % generated_every == generated_every - 1):
            img = _generated(size, i)
        else:
            src, turn = sources[k % len(sources)], k // len(sources)
            k += 1
            a = np.asarray(Image.open(src).convert("RGB"))
            if turn % 2:
                a = a[:, ::-1]
            a = np.rot90(a, (turn // 2) % 4)
            if a.shape[:2] != (size, size):
                a = np.asarray(Image.fromarray(np.ascontiguousarray(a)).resize((size, size), Image.Resampling.BICUBIC))
            img = np.ascontiguousarray(a)
        Image.fromarray(img).save(path)
    done.write_text(json.dumps(spec))
    return paths


def _decode_part(paths: list[str]) -> int:
    """Decode each file (Pillow, to a uint8 RGB array); the pixels seen (so nothing is skipped)."""
    from PIL import Image

    total = 0
    for p in paths:
        with Image.open(p) as im:
            total += int(np.asarray(im.convert("RGB")).shape[0])
    return total


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's ended and waited-for children (and theirs)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def decode_files(paths: list[Path], workers: int) -> tuple[float, float]:
    """Wall and CPU seconds to decode every file on ``workers`` fresh processes (spawn; 0 or 1: a pool of one)."""
    n = max(1, int(workers))
    parts = [[str(p) for p in paths[i::n]] for i in range(n)]
    c0, t0 = _children_cpu(), time.perf_counter()
    pool = mp.get_context("spawn").Pool(n)
    try:
        rows = sum(pool.map(_decode_part, parts))
        pool.close()
    finally:
        pool.terminate()
        pool.join()  # the workers waited for: their CPU time counts
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if paths and rows <= 0:
        raise RuntimeError("the decode floor decoded no pixels")
    return wall, cpu


def _stage_env(package: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _timed_stage(cmd: list[str], package: Path | None, what: str) -> tuple[float, float]:
    """Run the stage ``cmd`` as a fresh process (with ``package``'s code when given); its wall and CPU seconds
    (the command and its worker processes). ``RuntimeError`` with the end of its stderr when it fails."""
    c0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, env=_stage_env(package), cwd=str(package or ROOT), capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, cpu


def run_tile(images: Path, out: Path, tile_size: int, workers: int, package: Path | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of ``python -m wsi_pipeline tile`` over ``images`` into a fresh ``out`` (QC off; the
    CPU time of the command and its worker processes)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "wsi_pipeline", "tile", "--slides", str(images), "--out", str(out),
           "--tile-size", str(tile_size), "--workers", str(workers), "--no-qc", "--qc", "off", "--no-progress", "--quiet"]
    # "--no-qc": the spelling older checkouts (--package) know; today's tile reads it as --no-qc-images
    return _timed_stage(cmd, package, "tile")


def run_features(tiles: Path, images: list[Path], out: Path, encoder: str, package: Path | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of ``python -m wsi_pipeline features`` (``encoder``, random weights, CPU) over the tile
    stores ``tiles`` of ``images`` into a fresh ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    manifest = out.with_name(out.name + "_manifest.csv")
    manifest.write_text("slide_id,path\n" + "".join(f"{p.stem},{p}\n" for p in images))
    cmd = [sys.executable, "-m", "wsi_pipeline", "features", "--manifest", str(manifest), "--tiles", str(tiles),
           "--out", str(out), "--encoder", encoder, "--device", "cpu", "--no-progress", "--quiet"]
    return _timed_stage(cmd, package, "features")


def measure(stage: list[tuple[float, float]], decode: list[tuple[float, float]], *, name: str, n: int,
            workers: int) -> StageRow:
    """The row of a stage from its measured (wall, CPU) seconds per run and the decode floor's (medians; per item in ms)."""
    if not stage or not decode or n <= 0:
        raise ValueError("a row needs at least one measured run of each side and n > 0")
    s, d = statistics.median(w for w, _ in stage), statistics.median(w for w, _ in decode)
    sc, dc = statistics.median(c for _, c in stage), statistics.median(c for _, c in decode)
    if d <= 0 or dc <= 0:
        raise ValueError("the decode floor measured no time")
    return StageRow(name, n, workers, round(s, 3), round(1000 * s / n, 2), round(d, 3), round(1000 * d / n, 2),
                    round(s / d, 2), round(1000 * sc / n, 2), round(1000 * dc / n, 2), round(sc / dc, 2))


def table(rows: list[StageRow]) -> str:
    """The rows as a fixed-width text table with :data:`COLUMNS`."""
    cells = [list(COLUMNS)] + [[str(v) for v in asdict(r).values()] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def run(n: int, size: int, tile_size: int, workers: int, repeats: int, work: Path, *, real: Path | None = DEFAULT_REAL,
        generated_every: int = 10, package: Path | None = None, keep: bool = False, features: str | None = None) -> dict[str, Any]:
    """Make the images, then alternate the decode floor and ``tile`` ``repeats`` times (with ``features``, an encoder
    name: then the one-process decode floor and ``features`` on the last run's stores); the results (JSON-ready)."""
    images = work / f"images_n{n}_s{size}_g{generated_every}"
    paths = make_images(images, n, size, real=real, generated_every=generated_every)
    load_before = os.getloadavg()
    decode, tile = [], []
    decode_files(paths[: min(4, n)], 1)  # page cache and imports warm for both sides
    for r in range(repeats):
        decode.append(decode_files(paths, workers))
        tile.append(run_tile(images, work / f"tiles_{r}", tile_size, workers, package))
        if not keep and (r < repeats - 1 or not features):
            shutil.rmtree(work / f"tiles_{r}", ignore_errors=True)
    rows = [measure(tile, decode, name="tile", n=n, workers=workers)]
    runs: dict[str, Any] = {"decode_wall_cpu_s": decode, "tile_wall_cpu_s": tile}
    if features:  # one process (torch's threads): against decoding on one process
        decode1, feats = [], []
        for r in range(repeats):
            decode1.append(decode_files(paths, 1))
            feats.append(run_features(work / f"tiles_{repeats - 1}", paths, work / f"features_{r}", features, package))
            if not keep:
                shutil.rmtree(work / f"features_{r}", ignore_errors=True)
        rows.append(measure(feats, decode1, name=f"features ({features})", n=n, workers=1))
        runs.update(decode_1_wall_cpu_s=decode1, features_wall_cpu_s=feats)
        if not keep:
            shutil.rmtree(work / f"tiles_{repeats - 1}", ignore_errors=True)
    return {
        "rows": [asdict(r) for r in rows], "table": table(rows),
        "runs": runs,
        "settings": {"n": n, "size": size, "tile_size": tile_size, "workers": workers, "repeats": repeats,
                     "real": str(real) if real else None, "generated_every": generated_every,
                     "package": str(package) if package else str(ROOT)},
        "load": {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]},
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=800, help="images (default 800)")
    ap.add_argument("--size", type=int, default=500, help="image side, px (default 500)")
    ap.add_argument("--tile-size", type=int, default=128, help="tile side, px (default 128)")
    ap.add_argument("--workers", type=int, default=2, help="processes of the stage and of the decode floor (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians reported (default 3)")
    ap.add_argument("--real", type=Path, default=DEFAULT_REAL, help="folder of real images (absent: all generated)")
    ap.add_argument("--generated-every", type=int, default=10, help="every k-th image generated (0: none; default 10)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_many", help="images and stage outputs")
    ap.add_argument("--package", type=Path, default=None, help="run the stages with this checkout's package")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the stages' outputs")
    ap.add_argument("--features", default=None, metavar="ENCODER",
                    help="also time `features` with this encoder (random weights, CPU, one process; e.g. ilse_cnn, resnet18)")
    a = ap.parse_args(argv)
    if a.n < 1 or a.repeats < 1:
        ap.error("--n and --repeats must be >= 1")
    res = run(a.n, a.size, a.tile_size, a.workers, a.repeats, a.work, real=a.real if a.real and a.real.is_dir() else None,
              generated_every=a.generated_every, package=a.package, keep=a.keep, features=a.features)
    print(f"{a.n} images of {a.size} px, {a.tile_size} px tiles, {a.workers} workers, {a.repeats} repeats; "
          f"load {res['load']['before']} -> {res['load']['after']} on {res['cpus']} cpus")
    print(res["table"])
    if a.out is not None:
        from wsi_pipeline.io_atomic import write_text_atomic

        write_text_atomic(a.out, json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
