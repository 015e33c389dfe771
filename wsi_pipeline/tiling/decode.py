"""Decoding and testing runs of candidate tiles, in a pool of threads when given several.

A run is consecutive candidate tiles of one grid row, read with one level read
(:meth:`Slide.read_level`) or from the slide's stored tiles directly
(:class:`~wsi_pipeline.slides.direct.DirectTiles`, bit-equal to OpenSlide); each run's tiles are
tested against the foreground rule and, with several threads, the kept ones compressed for the store.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from wsi_pipeline.slides.direct import DirectTiles
from wsi_pipeline.slides.base import Slide
from wsi_pipeline.tiling.artifacts import TileQC
from wsi_pipeline.tiling.grid import TileGrid
from wsi_pipeline.tiling.tissue import strip_foreground, tiles_foreground

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig

__all__ = [
    "IN_FLIGHT_PER_THREAD", "Encoder", "LevelRead", "RunResult", "available_cores", "decode_run", "decode_stored_run",
    "decoded_runs", "level_source", "split_runs",
]

logger = logging.getLogger(__name__)


def split_runs(cols: np.ndarray, max_len: int) -> Iterator[np.ndarray]:
    """Split sorted column indices into runs of consecutive values, at most ``max_len`` long."""
    if cols.size == 0:
        return
    breaks = np.flatnonzero(np.diff(cols) != 1) + 1
    for run in np.split(cols, breaks):
        for i in range(0, len(run), max_len):
            yield run[i : i + max_len]


#: ``read(x, y, width, height)``: level px of the read level, uint8 (height, width, 3) RGB.
LevelRead = Callable[[int, int, int, int], np.ndarray]


def _read_run(read: LevelRead, grid: TileGrid, row: int, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode tiles (row, cols) with one exact level read; returns (tiles uint8 (k, T, T, 3), strip or None).

    ``read`` returns the read level's own pixels (:meth:`Slide.read_level` or
    :meth:`DirectTiles.read`, no resampling); the strip spans the run's sources, so each tile's
    source, cut from it, is the same as if it were read alone. ``strip`` is the raw (T, k*T, 3)
    strip when tiles are not resized (for a fast foreground test).
    """
    import cv2

    T = grid.tile_size
    Sx, Sy = grid.source_shape
    lx = grid.level_origin(cols, 0)
    ly = int(grid.level_origin(row, 1))
    x0 = int(lx[0])
    width = int(lx[-1]) - x0 + Sx
    strip = read(x0, ly, width, Sy)
    k = len(cols)
    if not grid.resized and width == k * T:
        tiles = strip.reshape(T, k, T, 3).transpose(1, 0, 2, 3)
        return tiles, strip
    out = np.empty((k, T, T, 3), np.uint8)
    for i, x in enumerate(lx - x0):
        src = strip[:, x : x + Sx]
        out[i] = src if not grid.resized else cv2.resize(np.ascontiguousarray(src), (T, T), interpolation=cv2.INTER_AREA)
    return out, None


#: Most bytes of decoded stored tiles the direct reader keeps for a slide (beyond it, a stored tile
#: shared by two grid rows may be decoded twice; the pixels are the same).
_DIRECT_CACHE_MAX = 512 * 2**20


def level_source(slide: Slide, grid: TileGrid, rows_in_flight: int = 1) -> tuple[LevelRead, DirectTiles | None, bool]:
    """How the tiles' sources are read: (read function, the direct reader or None, thread-safe).

    :class:`DirectTiles` when it serves the read level (its pixels equal OpenSlide's, which
    :meth:`Slide.read_level` returns for such a level), else :meth:`Slide.read_level`. Reads are
    thread-safe through the direct reader and OpenSlide; tiffslide and wsidicom are read by one thread.
    ``rows_in_flight``: grid rows that may be read at once (the direct reader keeps their stored tiles).
    """
    level = grid.level
    if slide.backend == "openslide" and slide.level_reader(level) == "openslide":
        direct = DirectTiles.from_slide(slide, cache_bytes=0)
        if direct.supports(level):
            tw, th = direct.stored_tile_size(level)
            Sx, Sy = grid.source_shape
            aligned = Sx == tw and Sy == th and grid.level_step == (float(tw), float(th))
            if not aligned:  # neighbouring tiles share stored tiles: keep the stored rows of the grid rows in flight
                across = -(-grid.level_size[0] // tw)
                rows = (-(-Sy // th) + 1) * (max(1, rows_in_flight) + 1)
                direct.cache_bytes = min(_DIRECT_CACHE_MAX, rows * across * tw * th * 3)

            def read(x: int, y: int, w: int, h: int) -> np.ndarray:
                return direct.read(level, x, y, w, h)

            return read, direct, True
        logger.debug("slide %s: level %d read through OpenSlide: %s", slide.path, level, direct.reason(level))
        direct.close()

    def read_level(x: int, y: int, w: int, h: int) -> np.ndarray:
        return slide.read_level(level, (x, y), (w, h))

    # OpenSlide handles are thread-safe; a level read through tiffslide (or wsidicom) is not shared
    return read_level, None, slide.backend == "openslide" and slide.level_reader(level) == "openslide"


def available_cores() -> int:
    """Cores this process may use (CPU affinity, e.g. under SLURM), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not available on macOS / Windows
        return os.cpu_count() or 1


#: Runs queued per decoding thread.
IN_FLIGHT_PER_THREAD = 4
#: A run's result: (tiles, selection, keep bool (k,), foreground float32 (k,), encoded, thread CPU s, qc); the
#: kept tiles are ``tiles[selection]`` (``tiles`` may hold only them already, then ``selection`` is all
#: True); ``encoded``: the kept tiles compressed for the store (when the decoding threads compress), else None;
#: ``qc``: None without tile QC, else ``{"focus": float32 per kept tile, "dropped": bool (k,) tiles QC removed
#: from ``keep``, "dropped_flags": uint8 per dropped tile}``.
RunResult = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[Any] | None, float, dict[str, np.ndarray] | None]
#: One tile (C-contiguous uint8 (T, T, 3)) to the bytes the store writes (StoreWriter.tile_encoder).
Encoder = Callable[[np.ndarray], Any]


@overload
def _apply_qc(qc: TileQC, row: int, run: np.ndarray, keep: np.ndarray, kept_tiles: list[np.ndarray] | np.ndarray,
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...
@overload
def _apply_qc(qc: None, row: int, run: np.ndarray, keep: np.ndarray, kept_tiles: list[np.ndarray] | np.ndarray,
              ) -> tuple[np.ndarray, None]: ...
def _apply_qc(qc: TileQC | None, row: int, run: np.ndarray, keep: np.ndarray, kept_tiles: list[np.ndarray] | np.ndarray,
              ) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
    """Tile QC of the tiles ``keep`` selects (``kept_tiles``, in run order): their focus, flags, and the
    tiles ``qc.mode == "drop"`` removes. Returns (keep after QC, the run's ``qc`` record or None)."""
    if qc is None:
        return keep, None
    cols = run[keep]
    focus = np.full(len(cols), np.nan, np.float32)  # not measured: a tile with too little stained tissue is not judged
    judged = np.flatnonzero(qc.judged(np.full(len(cols), row), cols))
    if judged.size:
        focus[judged] = qc.focus([kept_tiles[i] for i in judged.tolist()])
    flags = qc.flags(np.full(len(cols), row), cols, focus)
    drop = qc.dropped(flags)
    dropped = np.zeros(len(run), bool)
    dropped[np.flatnonzero(keep)[drop]] = True
    return keep & ~dropped, {"focus": focus[~drop], "dropped": dropped, "dropped_flags": flags[drop]}


def _finish_run(tiles: np.ndarray, keep: np.ndarray, fg: np.ndarray, encode: Encoder | None, c0: float,
                qc: TileQC | None = None, row: int = 0, run: np.ndarray | None = None) -> RunResult:
    """The run's result; with ``encode``, the kept tiles are selected and compressed here (in the decoding thread);
    with ``qc``, kept tiles are measured and QC's drops removed first."""
    record = None
    if qc is not None and keep.any():
        keep, record = _apply_qc(qc, row, run if run is not None else np.arange(len(keep)), keep, tiles[keep])
    elif qc is not None:
        record = {"focus": np.zeros(0, np.float32), "dropped": np.zeros(len(keep), bool), "dropped_flags": np.zeros(0, np.uint8)}
    if encode is None or not keep.any():
        return tiles, keep, keep, fg, None, time.thread_time() - c0, record
    kept = tiles if keep.all() and tiles.flags.c_contiguous else np.ascontiguousarray(tiles[keep])
    return kept, np.ones(len(kept), bool), keep, fg, [encode(t) for t in kept], time.thread_time() - c0, record


def decode_run(
    read: LevelRead, grid: TileGrid, row: int, run: np.ndarray, config: TilingConfig, grey_band: tuple[int, int], otsu_fg: np.ndarray | None,
    encode: Encoder | None = None, qc: TileQC | None = None,
) -> RunResult:
    """Decode and test one run of candidate tiles (:data:`RunResult`): by ``otsu_fg`` (the detector's per-tile
    fractions) or else by the grey band ``grey_band`` (inclusive levels) on the decoded tiles; ``qc``: tile QC of
    the kept tiles."""
    c0 = time.thread_time()
    tiles, strip = _read_run(read, grid, row, run)
    if otsu_fg is not None:
        fg = otsu_fg[row, run].astype(np.float32)
        keep = np.ones(len(run), bool)
    else:
        if strip is not None:
            fg = strip_foreground(strip, grid.tile_size, *grey_band)
        else:
            fg = tiles_foreground(tiles, *grey_band)
        keep = fg >= config.threshold
    return _finish_run(tiles, keep, fg, encode, c0, qc, row, run)


def decode_stored_run(
    direct: DirectTiles, grid: TileGrid, row: int, run: np.ndarray, config: TilingConfig, grey_band: tuple[int, int], otsu_fg: np.ndarray | None,
    encode: Encoder | None = None, top_first: np.ndarray | None = None, top_rows: int = 0, qc: TileQC | None = None,
) -> RunResult:
    """:func:`decode_run` where each grid tile is one stored tile (stored tiles of T x T px on the grid):
    the decoded stored tiles are tested as they are and only the kept ones copied (no strip is assembled).
    The foreground fraction is the same count of grey values in [grey_min, grey_max] over T * T.

    ``top_first`` (bool, the grid's shape) marks tiles that probably fail the rule: of those, the top
    ``top_rows`` or more rows are decoded first (:meth:`DirectTiles.stored_tile_top`, the full decode's
    exact rows) and the tile is dropped when even with every other row foreground it stays below the
    threshold; otherwise it is decoded whole. The kept set is the same; the dropped tiles' fractions
    are then upper bounds (only kept tiles' fractions are stored).
    """
    import cv2

    c0 = time.thread_time()
    T, level = grid.tile_size, grid.level
    (lo, hi), area, thr = grey_band, float(T * T), config.threshold

    def count(src: np.ndarray) -> int:
        return int(cv2.countNonZero(cv2.inRange(cv2.cvtColor(src, cv2.COLOR_RGB2GRAY), lo, hi)))

    srcs: list[np.ndarray | None] = []
    fgs: list[float] = []
    blank = None
    for c in run.tolist():
        if otsu_fg is None and top_first is not None and top_first[row, c]:
            top = direct.stored_tile_top(level, int(c), int(row), top_rows)
            if top is not None:
                r = min(len(top), T)
                upper = np.float32((count(np.ascontiguousarray(top[:r, :T])) + (T - r) * T) / area)
                if not upper >= thr:  # the same comparison as `keep` below: this tile cannot be kept
                    srcs.append(None)
                    fgs.append(float(upper))
                    continue
        tile = direct.stored_tile(level, int(c), int(row))
        if tile is None:  # no stored data: the background, as DirectTiles.read fills it
            if blank is None:
                blank = np.empty((T, T, 3), np.uint8)
                blank[:] = direct.background
            tile = blank
        src = tile[:T, :T]
        srcs.append(src)
        fgs.append(0.0 if otsu_fg is not None else count(src) / area)
    if otsu_fg is not None:
        fg = otsu_fg[row, run].astype(np.float32)
        keep = np.ones(len(run), bool)
    else:
        fg = np.array(fgs, np.float32)
        keep = fg >= thr
    kept = [src for src, k in zip(srcs, keep.tolist()) if k and src is not None]
    if len(kept) != int(keep.sum()):
        raise RuntimeError(f"row {row}: a tile dropped from its top rows passed the foreground test")  # cannot happen
    record = None
    if qc is not None:
        after, record = _apply_qc(qc, row, run, keep, kept)
        kept = [t for t, d in zip(kept, record["dropped"][keep].tolist()) if not d]
        keep = after
    tiles = np.stack(kept) if kept else np.zeros((0, T, T, 3), np.uint8)
    return _stored_result(tiles, keep, fg, encode, c0, record)


def _stored_result(tiles: np.ndarray, keep: np.ndarray, fg: np.ndarray, encode: Encoder | None, c0: float,
                   record: dict[str, np.ndarray] | None = None) -> RunResult:
    """:func:`_finish_run` for ``tiles`` that are the kept tiles already (contiguous)."""
    encoded = None if encode is None or not len(tiles) else [encode(t) for t in tiles]
    return tiles, np.ones(len(tiles), bool), keep, fg, encoded, time.thread_time() - c0, record


def decoded_runs(
    tasks: list[tuple[int, np.ndarray]], test: Callable[[int, np.ndarray], RunResult], threads: int
) -> Generator[tuple[int, np.ndarray, RunResult], None, None]:
    """Yield (row, run, result) for every task in order; ``threads`` > 1 tests them in a thread pool
    with at most ``IN_FLIGHT_PER_THREAD`` runs per thread in flight (memory stays bounded)."""
    if threads <= 1:
        for row, run in tasks:
            yield row, run, test(row, run)
        return
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tile-decode")
    inflight: deque[tuple[int, np.ndarray, Future[RunResult]]] = deque()
    it = iter(tasks)
    try:
        for row, run in it:
            inflight.append((row, run, pool.submit(test, row, run)))
            if len(inflight) >= IN_FLIGHT_PER_THREAD * threads:
                r, c, fut = inflight.popleft()
                yield r, c, fut.result()
        while inflight:
            r, c, fut = inflight.popleft()
            yield r, c, fut.result()
    finally:
        for _, _, fut in inflight:
            fut.cancel()
        pool.shutdown(wait=True)
