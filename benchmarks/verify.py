"""Cost of self-verifying stores and checkpoints (``make bench-verify``), with and without, side by side.

What is measured, each run alternating "with" and "without" and the medians compared:

1. ``tile``: tiling a real slide (``../shared/slides/CMU-1-Small-Region.svs``, else a generated one)
   into a store, with the per-chunk CRC-32C codec and the ``integrity`` file record, and without
   (the codec chain and the record taken out);
2. ``write``: writing a store of real-tissue tiles (256 px; rotations of the slide's tissue tiles);
3. ``open``: opening that store (:class:`~wsi_pipeline.data.store.TileStore`: with the file and size
   check, and without it);
4. ``read``: reading every tile in batches of 64, as training and evaluation read (each tile's
   checksum checked, or a store written without checksums);
5. ``checkpoint``: saving and loading a ResNet-18 and a ResNet-50 checkpoint (weights plus Adam
   state, as ``last.pt`` holds) with the file's SHA-256 and the digest inside it computed, recorded
   and checked, and without.
   Training saves one or two checkpoints per epoch and evaluation loads one per run: the absolute
   difference (ms) is the figure to set against an epoch's time.

Prints, per part, the medians (ms) and the ratio with / without; the target is under 3 % (1.03x).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REAL_SLIDE = Path(__file__).resolve().parents[1].parent / "shared" / "slides" / "CMU-1-Small-Region.svs"


@contextlib.contextmanager
def _without_checksums() -> Iterator[None]:
    """Stores written inside leave out the CRC-32C codec and the ``integrity`` record; opening skips the file check."""
    import wsi_pipeline.data.codecs as codecs
    import wsi_pipeline.data.store as store

    import wsi_pipeline.checkpoints.files as ck

    saved = (codecs.checksum_codec, store.checksum_codec, store._chunk_files, store._check_files)
    saved_ck = (ck._HashingWriter.write, ck.verify_checkpoint, ck._write_hashes, ck.state_digest)

    def no_crc() -> None:
        return None

    def tile_codecs_for(compression: str) -> dict:
        kw = saved_tile_codecs(compression)
        kw["compressors"] = [c for c in (kw.get("compressors") or []) if c is not None] or None
        return kw

    saved_tile_codecs = store.tile_codecs_for
    codecs.checksum_codec = no_crc
    store.checksum_codec = no_crc
    store.tile_codecs_for = tile_codecs_for
    store._chunk_files = lambda root: {}
    store._check_files = lambda path, attrs: None
    orig_add = store.StoreWriter.add_array

    def add_array(self: store.StoreWriter, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        chunks = tuple(max(int(v), 1) for v in values.shape) or None
        self.group.create_array(name, data=values, chunks=chunks or "auto", overwrite=True)

    store.StoreWriter.add_array = add_array  # type: ignore[method-assign]
    ck._HashingWriter.write = lambda self, data: self.f.write(data)  # type: ignore[method-assign]
    ck.verify_checkpoint = lambda path: True
    ck._write_hashes = lambda side, name, hashes: None
    ck.state_digest = lambda state: ""  # the digest inside the checkpoint: computed and checked only "with"
    try:
        yield
    finally:
        ck._HashingWriter.write, ck.verify_checkpoint, ck._write_hashes, ck.state_digest = saved_ck  # type: ignore[method-assign]
        codecs.checksum_codec, store.checksum_codec, store._chunk_files, store._check_files = saved
        store.tile_codecs_for = saved_tile_codecs
        store.StoreWriter.add_array = orig_add  # type: ignore[method-assign]


def _real_tiles(slide_path: Path, n: int) -> np.ndarray:
    """``n`` 256 px tiles of tissue from the slide (rotated and mirrored copies when it has fewer)."""
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(slide_path) as slide:
        img = slide.read_region((0, 0), 0, slide.dimensions)
    h, w = (s // 256 * 256 for s in img.shape[:2])
    tiles = img[:h, :w].reshape(h // 256, 256, w // 256, 256, 3).swapaxes(1, 2).reshape(-1, 256, 256, 3)
    grey = tiles.mean(axis=(1, 2, 3))
    tissue = tiles[grey < 215] if (grey < 215).sum() >= 8 else tiles
    out = [np.rot90(t, k) if k < 4 else np.rot90(t[::-1], k - 4) for k in range(8) for t in tissue]
    return np.ascontiguousarray(np.stack(out[:n]))


def _write(path: Path, tiles: np.ndarray) -> None:
    from wsi_pipeline.data.store import StoreWriter

    w = StoreWriter(path, tile_size=tiles.shape[1], capacity=len(tiles), attrs={"slide_id": path.stem})
    coords = np.stack([np.arange(len(tiles)) * 256, np.zeros(len(tiles), int)], axis=1)
    w.append(tiles, coords, coords // 256, np.ones(len(tiles), np.float32))
    w.commit()


def _read_all(path: Path) -> None:
    from wsi_pipeline.data.store import TileStore

    s = TileStore(path)
    for start in range(0, len(s), 64):
        s.read(np.arange(start, min(start + 64, len(s))))


def _checkpoint(folder: Path, arch: str) -> Callable[[], None]:
    """Save and load a checkpoint of ``arch``'s weights plus Adam-like state (as ``last.pt`` holds)."""
    from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint
    from wsi_pipeline.checkpoints.run import ResumeState, RunCheckpoint
    from wsi_pipeline.models import build_encoder

    enc = build_encoder(arch)
    optimizer = {k: {"exp_avg": v.clone(), "exp_avg_sq": v.clone()} for k, v in enc.state_dict().items() if v.is_floating_point()}
    ckpt = RunCheckpoint(config={}, method={"name": arch}, seed=0, epoch=1, models={"encoder": enc.state_dict()}, endpoint={},
                         resume=ResumeState(optimizer=optimizer, scheduler={}, rng={}, history=[]))

    def save_load() -> None:
        p = save_run_checkpoint(folder / f"{arch}.pt", ckpt)
        load_run_checkpoint(p)

    return save_load


def _median_pair(with_: Callable[[], None], without: Callable[[], None], repeats: int, wrap: bool) -> tuple[float, ...]:
    """Medians of (wall with, wall without, CPU with, CPU without) in s over ``repeats`` alternated runs;
    CPU is this process's (all threads), the steadier figure on a shared machine."""
    runs: list[list[float]] = [[], [], [], []]
    for _ in range(repeats):
        for k, (fn, off) in enumerate(((with_, False), (without, wrap))):
            with _without_checksums() if off else contextlib.nullcontext():
                t, c = time.perf_counter(), time.process_time()
                fn()
                runs[k].append(time.perf_counter() - t)
                runs[2 + k].append(time.process_time() - c)
    return tuple(statistics.median(r) for r in runs)


def measure(slide: Path | None, n_tiles: int, repeats: int) -> list[tuple[Any, ...]]:
    """Rows ``(part, wall with, wall without, CPU with, CPU without)`` in s."""
    from wsi_pipeline.synthetic.slides import make_slide
    from wsi_pipeline.tiling.job import SlideJob
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.tiler import tile_slide

    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if slide is None or not slide.is_file():
            slide = tmp / "generated.svs"
            make_slide(slide, size=4096, mpp=0.5, seed=3, tile_size=256)
        job = SlideJob(slide.stem, str(slide))
        cfg = TilingConfig(qc=False)
        k = [0]

        def tile_once() -> None:
            k[0] += 1
            tile_slide(job, tmp / f"tiles{k[0]}", cfg)

        tile_once()  # warm the page cache and imports
        rows.append(("tile " + slide.name,) + _median_pair(tile_once, tile_once, repeats, wrap=True))

        tiles = _real_tiles(slide, n_tiles)
        with _without_checksums():
            _write(tmp / "plain.zarr", tiles)
        _write(tmp / "crc.zarr", tiles)
        rows.append((f"write {len(tiles)} tiles",) + _median_pair(lambda: _write(tmp / "w1.zarr", tiles),
                                                                  lambda: _write(tmp / "w2.zarr", tiles), repeats, wrap=True))
        from wsi_pipeline.data.store import TileStore

        rows.append(("open store",) + _median_pair(lambda: [TileStore(tmp / "crc.zarr") for _ in range(20)],
                                                   lambda: [TileStore(tmp / "crc.zarr") for _ in range(20)], repeats, wrap=True))
        rows.append((f"read {len(tiles)} tiles",) + _median_pair(lambda: _read_all(tmp / "crc.zarr"),
                                                                 lambda: _read_all(tmp / "plain.zarr"), repeats, wrap=False))
        for arch in ("resnet18", "resnet50"):
            save_load = _checkpoint(tmp, arch)
            rows.append((f"checkpoint {arch} save+load",) + _median_pair(save_load, save_load, repeats, wrap=True))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slide", type=Path, default=REAL_SLIDE, help="slide to tile and take tiles from (default: CMU-1-Small-Region)")
    p.add_argument("--tiles", type=int, default=512, help="tiles in the write/read store")
    p.add_argument("--repeats", type=int, default=5, help="alternating runs per part (medians reported)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    rows = measure(args.slide, args.tiles, args.repeats)
    print("| part | wall with checks (ms) | wall without (ms) | wall ratio | CPU with (ms) | CPU without (ms) | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, a, b, ca, cb in rows:
        ok = "PASS" if ca <= 1.03 * cb else "over 3 %"
        print(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f}x | {ca * 1e3:.1f} | {cb * 1e3:.1f} | {ca / cb:.3f}x {ok} |")
    print("Target: with / without <= 1.03 (CPU time, the steadier figure when other work shares the machine).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
