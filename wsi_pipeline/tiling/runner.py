"""The cohort runner: tile a folder of slides or a manifest, in worker processes, resumably.

- Slides run in parallel in worker processes (default: one per core). Each worker reports
  progress and results over its own pipe; a worker that dies (a reader crash, the OOM killer,
  ``kill -9``) costs only its current slide, which gets a ``failed`` row, and is replaced.
- ``tiling_report.csv`` (slide_id, status, n_tiles, mpp, seconds, error, note, path,
  cpu_seconds, background_grey: the glass grey level estimated from the thumbnail, slide_mpp,
  mpp_source: the level-0 um/px used and where it came from) is merged under a lock and replaced
  atomically while the run goes on and at its end: one row per slide, this run's outcomes
  replacing older rows, never a partial view replacing finished rows.
- Resume: a complete store with the same slide fingerprint and settings is ``skipped``; a
  partial store (a temporary ``.<id>.zarr.tmp-<pid>``) is never taken for a result and is
  removed once its process is gone; changed settings rebuild.
- Many runs, one folder: a slide is tiled only while holding its lock
  (``<out>/.locks/<slide_id>.lock``, see :mod:`wsi_pipeline.tiling.locks`), taken just before
  it is handed to a worker. Slides another live run holds are waited for (they end ``skipped``
  here once that run finished them); a stale lock (its run gone, or not refreshed for
  ``lock_stale_s``) is taken over. So any number of runs on one ``--out``, on one machine or
  many sharing a file system, tile each slide once.
- The output folder is checked before any work (:mod:`wsi_pipeline.tiling.outdir`), and again
  when a slide fails: a folder that cannot be written stops the run with one
  :class:`~wsi_pipeline.tiling.outdir.OutputDirError` instead of failing every slide.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.slides.finder import (
    SLIDE_EXTENSIONS,
    NoSlidesError,
    describe_extensions,
    find_slide_files,
    is_slide_name,
    no_slides_message,
    slide_id,
)
from wsi_pipeline.jobs.cluster import default_workers
from wsi_pipeline.tiling.locks import HEARTBEAT_S, STALE_AFTER_S, LockDir
from wsi_pipeline.tiling.outdir import OutputDirError, check_output_dir, output_problem
from wsi_pipeline.data.store import store_path
from wsi_pipeline.tiling.tiler import DARK_NOTE, SlideJob, SlideResult, TilingConfig, precheck, store_matches, tile_slide
from wsi_pipeline.tiling.worker import worker_main
from wsi_pipeline.progress import progress_bar

__all__ = [
    "REPORT_COLUMNS",
    "SLIDE_EXTENSIONS",
    "CohortReport",
    "NoSlidesError",
    "OutputDirError",
    "jobs_from_folder",
    "jobs_from_manifest",
    "tile_cohort",
]

logger = logging.getLogger(__name__)

REPORT_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SlideResult))
REPORT_NAME = "tiling_report.csv"
#: Lock files of the slides being tiled and of the report, inside the output folder.
LOCK_DIR = ".locks"
_REPORT_LOCK = "_report"
#: Seconds between attempts on a slide another run holds.
_RETRY_S = 1.0


def jobs_from_folder(folder: str | os.PathLike, *, exclude: Sequence[str | os.PathLike] = ()) -> list[SlideJob]:
    """List the slides under ``folder`` (recursively), sorted by path, with :mod:`wsi_pipeline.slides.finder`.

    ``slide_id`` is the file name without its extension (``a.ome.tiff`` -> ``a``). A folder
    holding ``.dcm`` files is one DICOM slide named after the folder. Hidden folders, ``*.zarr``
    stores and ``exclude`` are skipped. Two slides with the same id both get a job that fails
    with a message naming both.

    Raises
    ------
    FileNotFoundError : ``folder`` is not a directory.
    """
    found = find_slide_files(folder, exclude=exclude)
    by_id: dict[str, list[Path]] = {}
    for f in found:
        by_id.setdefault(f.slide_id, []).append(f.path)
    jobs = []
    for f in found:
        problem = None
        if len(by_id[f.slide_id]) > 1:
            others = ", ".join(str(q) for q in by_id[f.slide_id])
            problem = f"duplicate slide_id {f.slide_id!r} ({others}); rename one of the files or list the slides in a manifest with unique slide_id"
        jobs.append(SlideJob(f.slide_id, str(f.path), None, problem))
    return jobs


def jobs_from_manifest(manifest: str | os.PathLike) -> list[SlideJob]:
    """One job per manifest row (``slide_id``, ``path`` made absolute, optional ``mpp``).

    Raises ``FileNotFoundError`` for a missing manifest and ``ManifestError`` for one that
    breaks the schema; rows whose slide is missing become jobs that fail with that reason.
    """
    from wsi_pipeline.manifests.schema import read_manifest

    df = read_manifest(manifest)
    jobs = []
    for row in df.itertuples(index=False):
        mpp = getattr(row, "mpp", None)
        mpp = float(mpp) if mpp is not None and not pd.isna(mpp) else None
        path = "" if pd.isna(row.path) else str(row.path)
        problem = None
        if path and not Path(path).exists():
            problem = f"slide file not found: {path} (manifest {manifest}, slide_id {row.slide_id!r}); fix the path column or remove the row"
        jobs.append(SlideJob(str(row.slide_id), path, mpp, problem))
    return jobs


@dataclass
class CohortReport:
    """Outcome of :func:`tile_cohort`: one :class:`SlideResult` per job, the report path and the wall time."""

    results: list[SlideResult]
    report_path: Path
    seconds: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        """True when no slide failed."""
        return self.count("failed") == 0

    @property
    def n_tiles(self) -> int:
        return sum(r.n_tiles for r in self.results if r.status in ("ok", "skipped"))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(r) for r in self.results], columns=list(REPORT_COLUMNS))

    def summary(self) -> str:
        empty = sum(r.status == "ok" and r.n_tiles == 0 for r in self.results)
        parts = [f"{self.count('ok')} ok", f"{self.count('skipped')} skipped", f"{self.count('failed')} failed"]
        text = f"tiling: {len(self.results)} slides: " + ", ".join(parts)
        if empty:
            text += f" ({empty} with 0 tiles)"
        dark = sum(r.status == "skipped" and r.note.startswith(DARK_NOTE) for r in self.results)
        if dark:
            text += f" ({dark} with a dark background, fluorescence?, not tiled)"
        text += f"; {self.n_tiles} tiles in {self.seconds:.1f} s; report: {self.report_path}"
        if not self.ok:
            failed = [r.slide_id for r in self.results if r.status == "failed"]
            more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            text += f"\nfailed: {', '.join(failed[:5])}{more} (see the error column)"
        return text


def _unfinished(job: SlideJob, final: bool) -> SlideResult:
    if final:
        return SlideResult(job.slide_id, "failed", error="not processed: the run was interrupted; rerun to resume", path=job.path)
    return SlideResult(job.slide_id, "pending", path=job.path)


def _read_report(path: Path) -> list[dict[str, Any]]:
    """The rows of an existing report (strings), in file order; [] when there is none or it is unreadable."""
    if not path.exists():
        return []
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as err:
        logger.warning("%s is unreadable (%s); it is replaced by this run's rows", path, err)
        return []
    if "slide_id" not in df.columns or "status" not in df.columns:
        logger.warning("%s has no slide_id/status columns; it is replaced by this run's rows", path)
        return []
    return df.to_dict("records")


def _merge_rows(existing: list[dict[str, Any]], results: Sequence[SlideResult | None], jobs: Sequence[SlideJob], final: bool) -> list[dict[str, Any]]:
    """One row per slide: this run's finished results replace older rows; its unfinished slides
    only fill in slides without a row (another run may have finished them)."""
    rows: dict[str, dict[str, Any]] = {}
    for row in existing:
        rows[str(row["slide_id"])] = row
    for job, r in zip(jobs, results):
        old = rows.get(job.slide_id)
        if r is None:
            if old is None or old.get("status") == "pending":
                rows[job.slide_id] = asdict(_unfinished(job, final))
            continue
        rows[job.slide_id] = asdict(r)
    return list(rows.values())


def _write_report(
    results: Sequence[SlideResult | None], jobs: Sequence[SlideJob], path: Path, *, final: bool = False,
    locks: LockDir | None = None,
) -> None:
    """Merge this run's rows into ``tiling_report.csv`` under the report lock and replace it atomically.

    Unfinished slides are ``pending`` (``failed`` when ``final``) unless the report already has
    a row for them.
    """
    if locks is None:
        locks = LockDir(path.parent / LOCK_DIR, stale_after_s=60.0, heartbeat_s=30.0)
    locks.acquire_wait(_REPORT_LOCK, timeout_s=120.0)
    try:
        rows = _merge_rows(_read_report(path), results, jobs, final)
        columns = list(REPORT_COLUMNS) + [c for c in (rows[0] if rows else {}) if c not in REPORT_COLUMNS]
        df = pd.DataFrame(rows, columns=columns)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        df.to_csv(tmp, index=False)
        os.replace(tmp, path)
    finally:
        locks.release(_REPORT_LOCK)


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    index: int | None = None  # the job being tiled
    retired: bool = False  # sent the end-of-work message


def _death_message(exitcode: int | None) -> str:
    """What a worker's exit says about its slide, by cause (the output folder is checked separately)."""
    if exitcode is not None and exitcode < 0:
        sig = -exitcode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            how = (f"was killed by {name}, usually the system's out-of-memory killer (or a `kill -9`); "
                   "use fewer --workers if memory is short")
        elif sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE):
            how = (f"crashed ({name}) inside the slide reader, typically on a damaged or unsupported file; "
                   "check the file, or try --backend tiffslide")
        else:
            how = f"was stopped by {name}"
    else:
        how = (f"exited with code {exitcode} before finishing the slide (an error outside the tiler's own checks); "
               "rerun with -v and --workers 0 to see it")
    return f"the worker process tiling this slide {how}; no store was written. Rerun to retry it"


def _jobs_from_source(source: str | os.PathLike | Sequence[SlideJob], out: Path) -> list[SlideJob]:
    """The jobs of a folder, a slide file, a manifest or a job list; :class:`NoSlidesError` when there are none."""
    if not isinstance(source, (str, os.PathLike)):
        return list(source)
    src = Path(source)
    if src.is_dir():
        jobs = jobs_from_folder(src, exclude=[out])
        if not jobs:
            raise NoSlidesError(no_slides_message(src, exclude=[out]))
    elif src.suffix.lower() == ".csv":
        jobs = jobs_from_manifest(src)
        if not jobs:
            raise NoSlidesError(f"manifest {src} lists no slides; expected one row per slide (slide_id, path)")
    elif src.is_file() and is_slide_name(src.name):
        jobs = [SlideJob(slide_id(src), str(src.resolve()))]
    elif src.exists():
        raise NoSlidesError(
            f"{src} is neither a folder of slides, a slide file (endings {describe_extensions()}), nor a manifest .csv"
        )
    else:
        raise FileNotFoundError(f"{src} not found; pass a folder of slides, a slide file or a manifest .csv")
    return jobs


def _current_store(job: SlideJob, out: Path, config: TilingConfig, since: float) -> SlideResult | None:
    """With ``overwrite``: a ``skipped`` result when another run rebuilt this slide's store after ``since``.

    "After" is read from the store's ``zarr.json``, written when it was marked complete (file
    times have ns resolution locally; the ``created`` attribute only has seconds).
    """
    path = Path(job.path)
    if not path.is_file():
        return None
    store = store_path(out, job.slide_id)
    try:
        completed = (store / "zarr.json").stat().st_mtime
    except OSError:
        return None
    if completed <= since:
        return None
    attrs = store_matches(store, job, config)
    if attrs is None:
        return None
    return SlideResult(job.slide_id, "skipped", n_tiles=int(attrs.get("n_tiles", 0)), mpp=attrs.get("mpp"),
                       note="rebuilt by another run during this one", path=job.path)


class _Claims:
    """Hands out this run's slides one at a time, each only while this process holds its lock.

    A slide whose lock another live run holds is deferred and retried every ``_RETRY_S``
    seconds; once free it is checked again (usually ``skipped``: the other run finished it).
    """

    def __init__(self, jobs: Sequence[SlideJob], todo: Sequence[int], out: Path, config: TilingConfig,
                 overwrite: bool, locks: LockDir, settle: Callable[[int, SlideResult], None], since: float) -> None:
        self.jobs, self.out, self.config, self.overwrite, self.locks = jobs, out, config, overwrite, locks
        self.pending = deque(todo)
        self.deferred: dict[int, float] = {}  # job index -> next attempt (monotonic s)
        self.settle = settle
        self.since = since  # this run's start (epoch s): stores built after it by others count as current
        self._told: set[int] = set()

    @property
    def done(self) -> bool:
        return not self.pending and not self.deferred

    def _claim(self, i: int) -> bool:
        job = self.jobs[i]
        if not self.locks.try_acquire(job.slide_id):
            self.deferred[i] = time.monotonic() + _RETRY_S
            if i not in self._told:
                self._told.add(i)
                info = self.locks.holder(job.slide_id)
                logger.info("slide %s is being tiled by another run (%s); waiting for it", job.slide_id,
                            info.describe() if info else "lock being written")
            return False
        self.deferred.pop(i, None)
        # another run may have finished it between our first look and the lock
        early = precheck(job, self.out, self.config, overwrite=self.overwrite)
        if early is None and self.overwrite:
            early = _current_store(job, self.out, self.config, self.since)
        if early is not None:
            self.settle(i, early)  # releases the lock
            return False
        return True

    def next(self) -> int | None:
        """The next job index to tile, its lock held; None when none can start now (see :attr:`done`)."""
        while self.pending:
            i = self.pending.popleft()
            if self._claim(i):
                return i
        now = time.monotonic()
        for i, when in sorted(self.deferred.items(), key=lambda kv: kv[1]):
            if when <= now and self._claim(i):
                return i
        return None


def tile_cohort(
    source: str | os.PathLike | Sequence[SlideJob],
    out_dir: str | os.PathLike,
    config: TilingConfig | None = None,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_result: Callable[[SlideResult], None] | None = None,
    lock_stale_s: float = STALE_AFTER_S,
    heartbeat_s: float = HEARTBEAT_S,
    cluster: Any = None,
    retries: int = 2,
    shard: tuple[int, int] | None = None,
) -> CohortReport:
    """Tile every slide of a folder, a manifest or a job list into ``out_dir``.

    Parameters
    ----------
    source : a folder of slides, one slide file, a manifest CSV, or a list of :class:`SlideJob`.
    out_dir : the tiles folder (``<slide_id>.zarr``, ``qc/``, ``tiling_report.csv``, ``.locks/``).
    config : :class:`TilingConfig` (defaults: greyscale, 256 px, level 0, zstd).
    workers : worker processes; None = the cores available to this process; 0 = tile in this process
        (no crash isolation; for debugging and small jobs).
    overwrite : rebuild stores even when they are complete and current (a store another run
        rebuilt during this run counts as current).
    progress : show a tqdm bar (slides, with tiles kept in the postfix).
    on_result : called in this process with each finished slide's result.
    lock_stale_s : seconds without a heartbeat after which another run's slide lock is taken over.
    heartbeat_s : seconds between refreshes of this run's locks.
    cluster : None = this machine's process pool; else run each slide as a Dask task (see
        :mod:`wsi_pipeline.tiling.cluster`): a ``--cluster`` string (``local[:N]``,
        ``tcp://HOST:PORT``, ``slurm[:JOBS]``), a :class:`~wsi_pipeline.jobs.cluster.ClusterSpec`
        or a connected ``distributed.Client``.
    retries : with ``cluster``: extra runs of a slide whose worker died.
    shard : ``(K, N)``: tile only the K-th of N disjoint slide subsets
        (:mod:`wsi_pipeline.tiling.partition`); the report keeps the other shards' rows.

    Returns
    -------
    :class:`CohortReport`; ``report.ok`` is False when any slide failed.

    Raises
    ------
    NoSlidesError : the folder or manifest yields no slides (the message names the folder and
        the endings looked for).
    OutputDirError : ``out_dir`` cannot be created or written (checked before any work, and
        again when a slide fails).
    FileNotFoundError : ``source`` does not exist.

    Notes
    -----
    Workers are started with ``spawn``: a script calling this must guard its entry point with
    ``if __name__ == "__main__":``.
    """
    t0, started = time.perf_counter(), time.time()
    config = config or TilingConfig()
    out = Path(out_dir)
    n_workers = default_workers() if workers is None else int(workers)
    if n_workers < 0:
        raise ValueError(f"workers={workers} must be >= 0 (0 = in this process)")
    jobs = _jobs_from_source(source, out)
    if shard is not None:
        from wsi_pipeline.tiling.partition import shard_items

        jobs = shard_items(jobs, *shard)
    if isinstance(cluster, str):
        from wsi_pipeline.jobs.cluster import parse_cluster

        cluster = parse_cluster(cluster)
    check_output_dir(out, subfolders=("qc", LOCK_DIR))
    report_path = out / REPORT_NAME
    results: list[SlideResult | None] = [None] * len(jobs)

    locks = LockDir(out / LOCK_DIR, stale_after_s=lock_stale_s, heartbeat_s=min(heartbeat_s, lock_stale_s / 4))
    report_locks = LockDir(out / LOCK_DIR, stale_after_s=60.0, heartbeat_s=30.0)
    bar = progress_bar(total=len(jobs), unit="slide", desc="tiling", enabled=progress)
    tiles_done = 0
    n_failed = 0
    last_write = 0.0

    def finish(i: int, r: SlideResult) -> None:
        nonlocal last_write, n_failed
        locks.release(jobs[i].slide_id)
        if r.status == "failed":
            problem = output_problem(out)
            if problem is not None:  # the output broke, not the slide: stop here, this slide stays unprocessed
                raise OutputDirError(out, f"{problem} (while tiling {r.slide_id}: {r.error})")
            if r.error.startswith(("OSError", "PermissionError")) and any(f"'{o}{os.sep}" in r.error for o in (out, out.resolve())):
                r.error = f"writing to the output folder failed (the slide itself may be fine): {r.error}"
            n_failed += 1
            logger.warning("slide %s failed: %s", r.slide_id, r.error)
        results[i] = r
        if on_result is not None:
            on_result(r)
        bar.set_postfix(tiles=tiles_done, failed=n_failed, refresh=False)
        bar.update(1)
        if time.monotonic() - last_write > 2.0:
            _write_report(results, jobs, report_path, locks=report_locks)
            last_write = time.monotonic()

    def add_tiles(n: int, refresh: bool = True) -> None:
        nonlocal tiles_done
        tiles_done += n
        bar.set_postfix(tiles=tiles_done, failed=n_failed, refresh=refresh)

    def settle(i: int, r: SlideResult) -> None:
        if r.status == "skipped":
            add_tiles(r.n_tiles, refresh=False)
        finish(i, r)

    try:
        with locks:
            todo = []
            for i, job in enumerate(jobs):
                early = precheck(job, out, config, overwrite=overwrite)
                if early is None:
                    todo.append(i)
                else:
                    settle(i, early)
            claims = _Claims(jobs, todo, out, config, overwrite, locks, settle, since=started)
            if todo and cluster is not None:
                from wsi_pipeline.tiling.cluster import run_on_dask

                run_on_dask(cluster, jobs, claims.next, lambda: claims.done, out, config, overwrite, finish, add_tiles,
                            workers=workers or None, retries=retries)
            elif n_workers == 0:
                while not claims.done:
                    i = claims.next()
                    if i is None:
                        time.sleep(_RETRY_S / 4)
                        continue
                    finish(i, tile_slide(jobs[i], out, config, overwrite=overwrite, progress=add_tiles))
            elif todo:
                _run_pool(jobs, claims, out, config, overwrite, min(n_workers, len(todo)), finish, add_tiles)
    except BaseException:
        bar.close()
        try:  # keep what is known; the error in flight matters more than a report that cannot be written
            _write_report(results, jobs, report_path, final=True, locks=report_locks)
        except (OSError, TimeoutError) as err:
            logger.error("could not write %s: %s", report_path, err)
        raise
    bar.close()
    try:
        _write_report(results, jobs, report_path, final=True, locks=report_locks)
    except OSError as err:
        raise OutputDirError(out, f"cannot write {report_path}: {err}") from err
    final = [r if r is not None else _unfinished(j, True) for j, r in zip(jobs, results)]
    return CohortReport(final, report_path, round(time.perf_counter() - t0, 3))


def _run_pool(
    jobs: Sequence[SlideJob],
    claims: _Claims,
    out: Path,
    config: TilingConfig,
    overwrite: bool,
    n_workers: int,
    finish: Callable[[int, SlideResult], None],
    add_tiles: Callable[[int], None],
) -> None:
    # spawn: workers must not inherit a parent's threads or CUDA state (predict may have torch loaded)
    ctx = mp.get_context("spawn")
    # each worker decodes, tests and writes a slide with its share of the cores (threads); a worker
    # whose share is one core does all in one thread, not competing with the other workers
    threads = max(1, default_workers() // n_workers)
    pool: list[_Worker] = []

    def start() -> _Worker:
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(child, str(out), config, overwrite, threads), daemon=True, name="wsi-tile-worker")
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        pool.append(w)
        return w

    def assign(w: _Worker) -> None:
        """Hand ``w`` the next claimable slide; leave it idle while only slides other runs hold remain."""
        i = claims.next()
        if i is not None:
            w.index = i
            w.conn.send(jobs[i])
            return
        w.index = None
        if claims.done and not w.retired:
            w.retired = True
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def bury(w: _Worker) -> None:
        w.proc.join(timeout=5)
        pool.remove(w)
        w.conn.close()
        if w.index is not None:
            job = jobs[w.index]
            i, w.index = w.index, None
            _remove_temp(out, job.slide_id, w.proc.pid)
            finish(i, SlideResult(job.slide_id, "failed", error=_death_message(w.proc.exitcode), path=job.path))
            if not claims.done:
                assign(start())

    for _ in range(n_workers):
        assign(start())
    try:
        while any(w.index is not None for w in pool) or not claims.done:
            busy = [w for w in pool if w.index is not None]
            handles: list[Any] = [w.conn for w in busy] + [w.proc.sentinel for w in busy]
            ready = wait(handles, timeout=_RETRY_S) if handles else (time.sleep(_RETRY_S / 4) or [])
            for w in busy:
                if w.conn in ready:
                    try:
                        while w.conn.poll():
                            kind, payload = w.conn.recv()
                            if kind == "progress":
                                add_tiles(int(payload))
                            elif kind == "done" and w.index is not None:
                                r: SlideResult = payload
                                i, w.index = w.index, None
                                if r.status == "skipped":
                                    add_tiles(r.n_tiles, refresh=False)
                                finish(i, r)
                                assign(w)
                    except (EOFError, OSError):
                        bury(w)
                        continue
                if w in pool and w.proc.sentinel in ready and not w.conn.poll():
                    bury(w)
            for w in [w for w in pool if w.index is None and not w.retired]:
                if not w.proc.is_alive():
                    bury(w)
                    continue
                assign(w)
            if not pool and not claims.done:
                assign(start())
    finally:
        for w in list(pool):
            if w.proc.is_alive():
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 10
        for w in list(pool):
            w.proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=5)
            if w.index is not None:
                _remove_temp(out, jobs[w.index].slide_id, w.proc.pid)


def _remove_temp(out: Path, slide_id: str, pid: int | None) -> None:
    import shutil

    if pid is not None:
        shutil.rmtree(out / f".{slide_id}.zarr.tmp-{pid}", ignore_errors=True)
