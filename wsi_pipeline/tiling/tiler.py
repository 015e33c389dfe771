"""Tile one slide: open, plan the grid, find foreground tiles, write the zarr store and QC image.

The slide is decoded once: a low-resolution overview (the background estimate, the
pre-screen, the Otsu mask and the QC thumbnail all come from it) and then only the candidate
tiles, read in runs along each row. A slide with no pyramid level coarse enough for the
overview is decoded twice (the overview, then the candidates). Slides whose background is dark
(fluorescence) are skipped unless ``allow_dark_background``.

Candidate tiles are read from the slide's stored tiles directly
(:class:`~wsi_pipeline.slides.direct.DirectTiles`, bit-equal to OpenSlide, each stored tile decoded
once) wherever that reader serves the read level, otherwise with :meth:`Slide.read_level`. With
``threads`` > 1 the runs are decoded, tested and their kept tiles compressed in a pool of threads
(libjpeg-turbo, OpenSlide, OpenCV and zstd release the GIL) while a writer thread writes them in
grid order, so one slide uses every core it is given; the store does not depend on the thread count.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import threading
import time
from collections import deque
from contextlib import closing
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

import wsi_pipeline
from wsi_pipeline.slides import MissingMppError, open_slide, read_scaled, resolve_mpp, slide_fingerprint
from wsi_pipeline.slides.direct import DirectTiles
from wsi_pipeline.slides.reader import Slide
from wsi_pipeline.tiling.background import Background, auto_grey_max, estimate_background
from wsi_pipeline.tiling.grid import TileGrid, make_grid
from wsi_pipeline.tiling.prescreen import prescreen_candidates
from wsi_pipeline.tiling.qc import qc_path, render_qc, write_png
from wsi_pipeline.data.store import StoreWriter, complete_attrs, store_path
from wsi_pipeline.config.tiling import DEFAULT_MIN_FOREGROUND, OtsuParams, TilingConfig  # noqa: F401 (re-exported)
from wsi_pipeline.tiling.params import output_params
from wsi_pipeline.tiling.tissue import box_mean, otsu_tissue_mask, strip_foreground, tiles_foreground

__all__ = [
    "METHODS", "SlideJob", "SlideResult", "TilePlan", "TilingConfig", "available_cores", "plan_tiles", "precheck",
    "store_matches", "tile_slide",
]

logger = logging.getLogger(__name__)

#: Foreground methods and their default keep thresholds (fraction of the tile).
METHODS: dict[str, float] = DEFAULT_MIN_FOREGROUND
#: Overview pixels per tile side (the overview is the slide at tile extent / 16).
_OVERVIEW_PER_TILE = 16
#: The paper's brightest foreground grey, used by ``grey_max="auto"`` when a slide shows no glass.
PAPER_GREY_MAX = 230
#: Report note of a slide skipped for its dark background.
DARK_NOTE = "skipped: dark background (fluorescence?)"


@dataclass(frozen=True)
class SlideJob:
    """One slide to tile: its id, file, optional per-slide mpp, and a problem found while listing it."""

    slide_id: str
    path: str
    mpp: float | None = None
    problem: str | None = None


@dataclass
class SlideResult:
    """One row of ``tiling_report.csv``."""

    slide_id: str
    status: str  # ok / failed / skipped
    n_tiles: int = 0
    mpp: float | None = None
    seconds: float = 0.0
    error: str = ""
    note: str = ""
    path: str = ""
    cpu_seconds: float = 0.0
    background_grey: float | None = None  # glass (or dark background) grey level from the thumbnail; None: no glass seen
    slide_mpp: float | None = None  # um per level-0 px used
    mpp_source: str = ""  # where slide_mpp came from: slide / manifest / run-fallback / run-forced / none


#: Version of the tile formula (grid.TILE_FORMULA); stores built by an earlier one are rebuilt.
TILE_FORMULA_VERSION = 2


def _valid_mpp(v: float | None) -> float | None:
    return float(v) if v is not None and math.isfinite(v) and v > 0 else None


def _identity(job: SlideJob, config: TilingConfig, fingerprint: str) -> dict[str, Any]:
    """What determines a store's content, known before the slide is opened.

    The fallback ``--mpp`` is not in it: it matters only for slides without an mpp of their own,
    which :func:`store_matches` checks against the store's recorded ``mpp_source``.
    """
    return {
        "fingerprint": fingerprint, "tile_formula": TILE_FORMULA_VERSION,
        "mpp_manifest": _valid_mpp(job.mpp), "mpp_force": _valid_mpp(config.mpp_force), **output_params(config),
    }


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [int(st.st_size), int(st.st_mtime_ns)]


def store_matches(path: Path, job: SlideJob, config: TilingConfig) -> dict[str, Any] | None:
    """The attributes of a complete store at ``path`` built from the same slide file and settings, else None.

    The slide is identified by its fingerprint; when its size and modification time equal
    those recorded in the store, the recorded fingerprint is reused instead of re-hashing
    (a resume check of thousands of slides on a network file system stays cheap).
    """
    attrs = complete_attrs(path)
    if attrs is None:
        return None
    slide = Path(job.path)
    recorded = attrs.get("tiling_identity", {}).get("fingerprint")
    same_stat = recorded and attrs.get("slide_stat") == _stat_key(slide)
    fingerprint = recorded if same_stat else slide_fingerprint(slide)
    if attrs.get("tiling_identity") != _identity(job, config, fingerprint):
        return None
    # a store whose mpp came from the fallback (or that had none) depends on the fallback too
    if attrs.get("mpp_source") in ("run-fallback", "none") and attrs.get("slide_mpp") != _valid_mpp(config.mpp):
        return None
    return attrs


def _clean_stale(out_dir: Path, slide_id: str) -> None:
    """Remove temporary stores of ``slide_id`` left by processes that no longer run."""
    prefix = f".{slide_id}.zarr."
    for p in out_dir.glob(f"{prefix}*"):
        pid_text = p.name.rsplit("-", 1)[-1]
        try:
            pid = int(pid_text)
            if pid != os.getpid():
                os.kill(pid, 0)
                continue  # a live process (another run) owns it
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        shutil.rmtree(p, ignore_errors=True)


class _InlineWriter:
    """Feed :meth:`StoreWriter.append` in the caller's thread (what :class:`_BackgroundWriter` runs in its own).

    Used on its own when every core already runs a worker: a second thread per worker would only
    compete with the other workers for the cores.
    """

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.cpu_seconds = 0.0  # CPU time spent in append

    def put(self, tiles: np.ndarray, keep: np.ndarray, coords: np.ndarray, grid: np.ndarray, fg: np.ndarray,
            encoded: list[Any] | None = None) -> None:
        """Write ``tiles[keep]`` with their level-0 ``coords``, ``grid`` cells and foreground ``fg`` (already
        selected); ``encoded``: those tiles already encoded (:attr:`StoreWriter.tile_encoder`)."""
        c0 = time.thread_time()
        self.writer.append(tiles if keep.all() else tiles[keep], coords, grid, fg, encoded)
        self.cpu_seconds += time.thread_time() - c0

    def close(self) -> None:
        pass


class _BackgroundWriter:
    """Feed :meth:`StoreWriter.append` from a thread; errors surface on the next call.

    Batches arrive as (tiles, keep, coords, grid, foreground) with ``tiles`` possibly a strided
    view of a decoded strip: selecting and copying the kept tiles happens here, off the
    decoding thread.
    """

    def __init__(self, writer: StoreWriter, depth: int = 8) -> None:
        self._inline = _InlineWriter(writer)
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self.cpu_seconds = 0.0  # the writer thread's CPU time, set when it ends
        self._thread = threading.Thread(target=self._run, name="tile-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self.cpu_seconds = time.thread_time()
                return
            if self._error is None:
                try:
                    self._inline.put(*item)
                except BaseException as err:  # re-raised in the main thread
                    self._error = err

    def put(self, tiles: np.ndarray, keep: np.ndarray, coords: np.ndarray, grid: np.ndarray, fg: np.ndarray,
            encoded: list[Any] | None = None) -> None:
        """Queue ``tiles[keep]`` with their level-0 ``coords``, ``grid`` cells and foreground ``fg`` (already
        selected); ``encoded``: those tiles already encoded."""
        if self._error is not None:
            raise self._error
        self._q.put((tiles, keep, coords, grid, fg, encoded))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _runs(cols: np.ndarray, max_len: int) -> Iterator[np.ndarray]:
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


def _level_source(slide: Slide, grid: TileGrid, rows_in_flight: int = 1) -> tuple[LevelRead, DirectTiles | None, bool]:
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


def _overview_downsample(grid: TileGrid) -> float:
    """Overview downsample in level-0 px per overview px (``_OVERVIEW_PER_TILE`` px per tile side)."""
    return max(1.0, grid.extent / _OVERVIEW_PER_TILE)


def tile_slide(
    job: SlideJob,
    out_dir: str | os.PathLike,
    config: TilingConfig,
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    background_write: bool = True,
    threads: int | None = None,
) -> SlideResult:
    """Tile one slide into ``<out_dir>/<slide_id>.zarr``; never raises for a bad slide.

    Parameters
    ----------
    job : the slide.
    out_dir : the tiles folder.
    config : :class:`TilingConfig`.
    overwrite : rebuild even when a matching complete store exists.
    progress : called with the number of tiles kept since the previous call.
    background_write : compress and write tiles in a second thread, overlapping decoding (worth
        it when a core is free for it); False also means one thread in all.
    threads : threads decoding, testing and (when > 1) compressing tiles, plus one writing them;
        None = the cores this process may use (:func:`available_cores`). The runner gives each of
        its worker processes its share of the cores. The store does not depend on it.

    Returns
    -------
    :class:`SlideResult` with status ``ok`` (store written), ``skipped`` (a complete store
    with the same slide fingerprint and settings exists, or a dark-background slide: note
    ``DARK_NOTE``, no store) or ``failed`` (``error`` says why).
    """
    t0 = time.perf_counter()
    c0 = time.process_time()
    out = Path(out_dir)
    res = SlideResult(job.slide_id, "failed", path=str(job.path))
    try:
        early = precheck(job, out, config, overwrite=overwrite)
        if early is not None:
            return early
        path = Path(job.path)
        identity = _identity(job, config, slide_fingerprint(path) if path.is_file() else "")
        out.mkdir(parents=True, exist_ok=True)
        _clean_stale(out, job.slide_id)
        with open_slide(path, config.backend) as slide:
            res.n_tiles, res.mpp, res.note = _tile_open_slide(
                slide, job, out, config, identity, progress, background_write, res, threads=threads
            )
        res.status = "skipped" if res.note.startswith(DARK_NOTE) else "ok"
    except MissingMppError as err:
        res.error, res.mpp_source = str(err), "none"
    except Exception as err:  # a bad slide is a report row, never a crash of the run
        res.error = f"{type(err).__name__}: {err}"
        logger.debug("slide %s failed", job.slide_id, exc_info=True)
    finally:
        res.seconds = round(time.perf_counter() - t0, 3)
        res.cpu_seconds = round(time.process_time() - c0, 3)
    return res


def precheck(job: SlideJob, out_dir: str | os.PathLike, config: TilingConfig, *, overwrite: bool = False) -> SlideResult | None:
    """The result of ``job`` when it is known without opening the slide, else None.

    ``skipped`` when a complete store from the same slide file (fingerprint) and settings
    exists; ``failed`` for a listing problem or a missing file. Cheap: hashes 1 MiB of the slide.
    """
    t0 = time.perf_counter()
    res = SlideResult(job.slide_id, "failed", path=str(job.path))
    try:
        if job.problem:
            raise ValueError(job.problem)
        if not job.path:
            raise ValueError(f"slide {job.slide_id!r} has no path; fill the manifest's `path` column")
        path = Path(job.path)
        if not path.exists():
            raise FileNotFoundError(f"slide file not found: {path}; fix the path or remove the row/file")
        if overwrite or not path.is_file():
            return None
        attrs = store_matches(store_path(out_dir, job.slide_id), job, config)
        if attrs is None:
            return None
        res.status, res.n_tiles, res.mpp = "skipped", int(attrs.get("n_tiles", 0)), attrs.get("mpp")
        res.background_grey = (attrs.get("background") or {}).get("grey")
        res.slide_mpp, res.mpp_source = attrs.get("slide_mpp"), str(attrs.get("mpp_source", ""))
        res.note = "complete store from the same slide and settings exists"
    except (ValueError, OSError) as err:
        res.error = f"{type(err).__name__}: {err}"
    res.seconds = round(time.perf_counter() - t0, 3)
    return res


@dataclass
class TilePlan:
    """What is known about a slide's tiles before any tile is decoded (:func:`plan_tiles`).

    Attributes
    ----------
    grid : the tile grid.
    mpp, mpp_source : um per level-0 px used and where it came from.
    mpp_note : a report note when that mpp replaces the slide's own ("" otherwise).
    overview : uint8 (H, W, 3), the slide at ``overview_downsample`` level-0 px per px.
    overview_downsample : level-0 px per overview px.
    background : the glass (or dark background) estimate from the overview.
    grey_max : the greyscale rule's upper grey level in effect; ``grey_note`` a report note or "".
    candidates : bool (rows, cols), the tiles to decode and test (None: a dark-background slide to skip).
    otsu_fg : float32 (rows, cols) tissue-mask foreground fractions (otsu and unet methods), else None.
    otsu_info : the Otsu mask's description (otsu method), else None.
    unet_info : the U-Net mask's description (unet method), else None.
    """

    grid: TileGrid
    mpp: float | None
    mpp_source: str
    mpp_note: str
    overview: np.ndarray
    overview_downsample: float
    background: Background
    grey_max: int
    grey_note: str
    candidates: np.ndarray | None
    otsu_fg: np.ndarray | None = None
    otsu_info: dict[str, Any] | None = None
    unet_info: dict[str, Any] | None = None


def plan_tiles(slide: Slide, job: SlideJob, config: TilingConfig) -> TilePlan:
    """Plan a slide's tiles: mpp, grid, overview, background, and the candidate tiles (pre-screen).

    Raises :class:`~wsi_pipeline.slides.MissingMppError` when the settings need an mpp the slide lacks.
    """
    needed = None
    if config.mpp_target is not None:
        needed = f"--mpp-target {config.mpp_target:g}"
    elif config.method == "otsu":
        needed = "the otsu method (its sizes are in um^2)"
    elif config.method == "unet":
        needed = "the unet method (its model works at a fixed um/px)"
    mpp, mpp_source = resolve_mpp(
        slide.mpp, manifest_mpp=job.mpp, run_mpp=config.mpp, force_mpp=config.mpp_force,
        slide_id=job.slide_id, path=str(slide.path), needed_for=needed,
    )
    mpp_note = ""
    if mpp is not None and slide.mpp is not None and mpp_source != "slide" and abs(mpp / slide.mpp - 1) > 0.01:
        mpp_note = f"mpp {mpp:g} um/px ({mpp_source}) replaces the slide's own {slide.mpp:g}"
        logger.info("slide %s: %s", job.slide_id, mpp_note)
    grid = make_grid(
        slide.level_dimensions, slide.level_downsamples, tile_size=config.tile_size,
        slide_mpp=mpp, mpp_target=config.mpp_target, tolerance=config.mpp_tolerance,
        exact_levels=slide.exact_levels() if config.mpp_target is not None else None,  # native: level 0 only
    )
    thr = config.threshold
    ds_over = _overview_downsample(grid)
    # the overview is always read: it gives the background estimate (and serves the pre-screen,
    # the Otsu mask and the QC image); with no cheap level this decodes the tile level twice
    overview = read_scaled(slide, ds_over)
    background = estimate_background(overview)
    plan = TilePlan(grid, mpp, mpp_source, mpp_note, overview, ds_over, background, 0, "", None)
    if background.is_dark and not config.allow_dark_background:
        return plan
    plan.grey_max, plan.grey_note = _grey_max_for(config, background, job.slide_id)
    if config.method == "otsu":
        mask, plan.otsu_info = otsu_tissue_mask(overview, float(mpp or 0.0) * ds_over, config.otsu, background=background)
        rows_all, cols_all = np.meshgrid(np.arange(grid.rows), np.arange(grid.cols), indexing="ij")
        coords_all = grid.coords(cols_all.ravel(), rows_all.ravel())
        plan.otsu_fg = box_mean(mask.astype(np.float32), ds_over, coords_all, grid.extent).reshape(grid.rows, grid.cols)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
    elif config.method == "unet":
        from wsi_pipeline.tissue_seg.tiling_mask import unet_tissue_mask

        mask, ds_mask, plan.unet_info = unet_tissue_mask(slide, float(mpp), config.tissue_model)  # type: ignore[arg-type]
        rows_all, cols_all = np.meshgrid(np.arange(grid.rows), np.arange(grid.cols), indexing="ij")
        coords_all = grid.coords(cols_all.ravel(), rows_all.ravel())
        plan.otsu_fg = box_mean(mask.astype(np.float32), ds_mask, coords_all, grid.extent).reshape(grid.rows, grid.cols)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
    elif config.prescreen and thr > 0:
        plan.candidates = prescreen_candidates(
            overview, ds_over, grid, grey_max=plan.grey_max, min_foreground=thr, margin=config.prescreen_margin
        )
    else:
        plan.candidates = np.ones((grid.rows, grid.cols), bool)
    return plan


#: Runs queued per decoding thread.
_IN_FLIGHT_PER_THREAD = 4
#: A run's result: (tiles, selection, keep bool (k,), foreground float32 (k,), encoded, thread CPU s); the
#: kept tiles are ``tiles[selection]`` (``tiles`` may hold only them already, then ``selection`` is all
#: True); ``encoded``: the kept tiles compressed for the store (when the decoding threads compress), else None.
_RunResult = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[Any] | None, float]
#: One tile (C-contiguous uint8 (T, T, 3)) to the bytes the store writes (StoreWriter.tile_encoder).
Encoder = Callable[[np.ndarray], Any]


def _finish_run(tiles: np.ndarray, keep: np.ndarray, fg: np.ndarray, encode: Encoder | None, c0: float) -> _RunResult:
    """The run's result; with ``encode``, the kept tiles are selected and compressed here (in the decoding thread)."""
    if encode is None or not keep.any():
        return tiles, keep, keep, fg, None, time.thread_time() - c0
    kept = tiles if keep.all() and tiles.flags.c_contiguous else np.ascontiguousarray(tiles[keep])
    return kept, np.ones(len(kept), bool), keep, fg, [encode(t) for t in kept], time.thread_time() - c0


def _test_run(
    read: LevelRead, grid: TileGrid, row: int, run: np.ndarray, config: TilingConfig, grey_max: int, otsu_fg: np.ndarray | None,
    encode: Encoder | None = None,
) -> _RunResult:
    """Decode and test one run of candidate tiles (:data:`_RunResult`)."""
    c0 = time.thread_time()
    tiles, strip = _read_run(read, grid, row, run)
    if otsu_fg is not None:
        fg = otsu_fg[row, run].astype(np.float32)
        keep = np.ones(len(run), bool)
    else:
        if strip is not None:
            fg = strip_foreground(strip, grid.tile_size, config.grey_min, grey_max)
        else:
            fg = tiles_foreground(tiles, config.grey_min, grey_max)
        keep = fg >= config.threshold
    return _finish_run(tiles, keep, fg, encode, c0)


def _test_stored_run(
    direct: DirectTiles, grid: TileGrid, row: int, run: np.ndarray, config: TilingConfig, grey_max: int, otsu_fg: np.ndarray | None,
    encode: Encoder | None = None,
) -> _RunResult:
    """:func:`_test_run` where each grid tile is one stored tile (stored tiles of T x T px on the grid):
    the decoded stored tiles are tested as they are and only the kept ones copied (no strip is assembled).
    The foreground fraction is the same count of grey values in [grey_min, grey_max] over T * T."""
    import cv2

    c0 = time.thread_time()
    T, level = grid.tile_size, grid.level
    srcs = []
    blank = None
    for c in run.tolist():
        tile = direct.stored_tile(level, int(c), int(row))
        if tile is None:  # no stored data: the background, as DirectTiles.read fills it
            if blank is None:
                blank = np.empty((T, T, 3), np.uint8)
                blank[:] = direct.background
            tile = blank
        srcs.append(tile[:T, :T])
    if otsu_fg is not None:
        fg = otsu_fg[row, run].astype(np.float32)
        keep = np.ones(len(run), bool)
    else:
        lo, hi, area = int(config.grey_min), int(grey_max), float(T * T)
        fg = np.array([cv2.countNonZero(cv2.inRange(cv2.cvtColor(src, cv2.COLOR_RGB2GRAY), lo, hi)) / area for src in srcs], np.float32)
        keep = fg >= config.threshold
    kept = [src for src, k in zip(srcs, keep.tolist()) if k]
    tiles = np.stack(kept) if kept else np.zeros((0, T, T, 3), np.uint8)
    return _stored_result(tiles, keep, fg, encode, c0)


def _stored_result(tiles: np.ndarray, keep: np.ndarray, fg: np.ndarray, encode: Encoder | None, c0: float) -> _RunResult:
    """:func:`_finish_run` for ``tiles`` that are the kept tiles already (contiguous)."""
    encoded = None if encode is None or not len(tiles) else [encode(t) for t in tiles]
    return tiles, np.ones(len(tiles), bool), keep, fg, encoded, time.thread_time() - c0


def _tested_runs(
    tasks: list[tuple[int, np.ndarray]], test: Callable[[int, np.ndarray], _RunResult], threads: int
) -> Iterator[tuple[int, np.ndarray, _RunResult]]:
    """Yield (row, run, result) for every task in order; ``threads`` > 1 tests them in a thread pool
    with at most ``_IN_FLIGHT_PER_THREAD`` runs per thread in flight (memory stays bounded)."""
    if threads <= 1:
        for row, run in tasks:
            yield row, run, test(row, run)
        return
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tile-decode")
    inflight: deque[tuple[int, np.ndarray, Future[_RunResult]]] = deque()
    it = iter(tasks)
    try:
        for row, run in it:
            inflight.append((row, run, pool.submit(test, row, run)))
            if len(inflight) >= _IN_FLIGHT_PER_THREAD * threads:
                r, c, fut = inflight.popleft()
                yield r, c, fut.result()
        while inflight:
            r, c, fut = inflight.popleft()
            yield r, c, fut.result()
    finally:
        for _, _, fut in inflight:
            fut.cancel()
        pool.shutdown(wait=True)


def _tile_open_slide(
    slide: Slide,
    job: SlideJob,
    out: Path,
    config: TilingConfig,
    identity: dict[str, Any],
    progress: Callable[[int], None] | None,
    background_write: bool = True,
    res: SlideResult | None = None,
    *,
    threads: int | None = None,
) -> tuple[int, float | None, str]:
    """Tile an open slide; returns (tiles kept, um per tile px, note); fills ``res``'s mpp columns."""
    plan = plan_tiles(slide, job, config)
    grid, mpp, background = plan.grid, plan.mpp, plan.background
    if res is not None:
        res.slide_mpp, res.mpp_source, res.background_grey = mpp, plan.mpp_source, background.grey
    if plan.candidates is None:
        logger.warning("slide %s: dark background (grey %.0f), fluorescence? skipped; --allow-dark-background tiles it",
                       job.slide_id, background.grey)
        return 0, grid.mpp, f"{DARK_NOTE}; background grey {background.grey:.0f}; --allow-dark-background tiles it anyway"
    T = grid.tile_size
    thr = config.threshold
    grey_max, candidates = plan.grey_max, plan.candidates
    n_candidates = int(candidates.sum())
    budget = 1 if not background_write else max(1, int(threads) if threads is not None else available_cores())
    read, direct, thread_safe = _level_source(slide, grid, _IN_FLIGHT_PER_THREAD * budget)
    n_threads = budget if thread_safe else 1  # threads decoding and testing
    attrs_extra: dict[str, Any] = {k: v for k, v in (("otsu_info", plan.otsu_info), ("unet_info", plan.unet_info)) if v is not None}
    attrs = {
        "slide_id": job.slide_id,
        "slide_path": str(Path(slide.path).resolve()),
        "slide_fingerprint": identity["fingerprint"],
        "slide_stat": _stat_key(Path(slide.path)),
        "slide_dimensions": list(slide.dimensions),
        "slide_mpp": mpp,
        "mpp_source": plan.mpp_source,
        "metadata_mpp": slide.mpp,
        "manifest_mpp": _valid_mpp(job.mpp),
        "backend": slide.backend,
        "level_reader": slide.level_reader(grid.level),
        "tile_decoder": "direct" if direct is not None else "read_level",
        **grid.describe(),
        "method": config.method,
        "min_foreground": thr,
        "compression": config.compression,
        "package_version": wsi_pipeline.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tiling_identity": identity,
        "n_candidates": n_candidates,
        "background": background.as_dict(),
        **attrs_extra,
    }
    if config.method == "greyscale":
        attrs.update(grey_min=int(config.grey_min), grey_max=int(grey_max), grey_max_rule=str(config.grey_max),
                     prescreen=bool(config.prescreen and thr > 0))
    elif config.method == "otsu":
        attrs.update(otsu=asdict(config.otsu))
    try:
        writer = StoreWriter(
            store_path(out, job.slide_id), tile_size=T, capacity=max(1, n_candidates), attrs=attrs,
            compression=config.compression, shard_tiles=config.shard_tiles,
        )
    except BaseException:
        if direct is not None:
            direct.close()
        raise
    main_cpu0 = time.thread_time()
    # a writer thread when there is a second core for it
    sink: _BackgroundWriter | _InlineWriter = _BackgroundWriter(writer) if budget > 1 else _InlineWriter(writer)
    kept_coords: list[np.ndarray] = []
    n_kept = 0
    last_report = time.monotonic()
    reported = 0
    test_cpu = 0.0
    tasks = [(row, run) for row in range(grid.rows) for run in _runs(np.flatnonzero(candidates[row]), config.read_run)]

    # stored tiles of exactly the grid's tiles: test them as decoded (no strip copy)
    stored_grid = (direct is not None and not grid.resized and direct.stored_tile_size(grid.level) == (T, T)
                   and grid.level_step == (float(T), float(T)))

    # with several decoding threads they compress the kept tiles too; the writer thread only writes
    encode = writer.tile_encoder if n_threads > 1 else None

    def test(row: int, run: np.ndarray) -> _RunResult:
        if stored_grid:
            assert direct is not None
            return _test_stored_run(direct, grid, row, run, config, grey_max, plan.otsu_fg, encode)
        return _test_run(read, grid, row, run, config, grey_max, plan.otsu_fg, encode)

    try:
        with closing(_tested_runs(tasks, test, n_threads)) as tested:  # closing it stops the pool on an error
            for row, run, (tiles, sel, keep, fg, encoded, cpu) in tested:
                test_cpu += cpu
                if not keep.any():
                    continue
                kc = run[keep]
                coords = grid.coords(kc, np.full(len(kc), row))
                gridxy = np.stack([kc, np.full(len(kc), row)], axis=1).astype(np.int32)
                sink.put(tiles, sel, coords, gridxy, fg[keep], encoded)
                kept_coords.append(coords)
                n_kept += len(kc)
                if progress is not None and time.monotonic() - last_report > 0.5:
                    progress(n_kept - reported)
                    reported, last_report = n_kept, time.monotonic()
        sink.close()
        # each tile's source origin in px of the read level (the tile formula; also derivable from grid)
        n = writer.n
        writer.add_array("level_coords", grid.level_coords(writer.grid[:n, 0], writer.grid[:n, 1]))
        # CPU split of the tile pass: decoding + testing (all decoding threads) vs compression + writes
        main_cpu = time.thread_time() - main_cpu0 - (0.0 if isinstance(sink, _BackgroundWriter) else sink.cpu_seconds)
        writer.group.attrs.update({"timing": {
            "main_thread_cpu": round(main_cpu + (test_cpu if n_threads > 1 else 0.0), 3),
            "decode_test_cpu": round(test_cpu, 3),
            "threads": n_threads,
            "background_write": isinstance(sink, _BackgroundWriter),
            "writer_thread_cpu": round(sink.cpu_seconds, 3),
            "n_decoded": n_candidates,
            "stored_tiles_decoded": None if direct is None else int(direct.decoded),
        }})
    except BaseException:
        try:
            sink.close()
        except BaseException:
            pass
        writer.abort()
        raise
    finally:
        if direct is not None:
            direct.close()
    writer.commit()
    if progress is not None and n_kept > reported:
        progress(n_kept - reported)
    note = "" if n_kept else "no foreground tiles (blank slide, or thresholds too strict for it)"
    if plan.grey_note:
        note = f"{note}; {plan.grey_note}" if note else plan.grey_note
    if plan.mpp_note:
        note = (note + "; " if note else "") + plan.mpp_note
    if config.qc:
        try:
            coords_kept = np.concatenate(kept_coords) if kept_coords else np.zeros((0, 2), np.int64)
            write_png(qc_path(out, job.slide_id), render_qc(plan.overview, plan.overview_downsample, coords_kept, grid.extent))
        except Exception as err:  # the store is complete; a QC failure is only noted
            logger.warning("QC image for %s failed: %s", job.slide_id, err)
            note = (note + "; " if note else "") + f"QC image failed: {err}"
    return n_kept, grid.mpp, note


def _grey_max_for(config: TilingConfig, background: Background, slide_id: str) -> tuple[int, str]:
    """(grey_max in effect for this slide, a report note or ""); warns when glass counts as foreground."""
    note = ""
    if config.grey_max == "auto":
        auto = auto_grey_max(background, config.grey_auto_margin)
        grey_max = PAPER_GREY_MAX if auto is None else auto
        if auto is None and config.method == "greyscale":
            note = f"grey-max auto: no glass seen on the thumbnail, used {PAPER_GREY_MAX}"
    else:
        grey_max = int(config.grey_max)
    if config.method == "greyscale" and background.kind == "bright" and background.grey is not None:
        if config.grey_min <= background.grey <= grey_max:
            note = (
                f"glass grey {background.grey:.0f} lies inside the foreground band [{config.grey_min}, {grey_max}]: "
                "empty glass counts as foreground; try --grey-max auto"
            )
            logger.warning("slide %s: %s", slide_id, note)
    return grey_max, note
