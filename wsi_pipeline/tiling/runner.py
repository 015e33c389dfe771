"""The cohort runner: tile a folder of slides or a manifest, in worker processes, resumably.

- Slides run in parallel in worker processes (default: one per core). Each worker reports
  progress and results over its own pipe; a worker that dies (a reader crash, the OOM killer,
  ``kill -9``) costs only its current slide, which gets a ``failed`` row, and is replaced.
- ``tiling_report.csv`` (slide_id, status, n_tiles, mpp, seconds, error, note, path,
  cpu_seconds, background_grey: the glass grey level estimated from the thumbnail, slide_mpp,
  mpp_source: the level-0 um/px used and where it came from) is
  rewritten atomically while the run goes on and at its end.
- Resume: a complete store with the same slide fingerprint and settings is ``skipped``; a
  partial store (a temporary ``.<id>.zarr.tmp-<pid>``) is never taken for a result and is
  removed once its process is gone; changed settings rebuild.
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

from wsi_pipeline.tiling.tiler import DARK_NOTE, SlideJob, SlideResult, TilingConfig, precheck, tile_slide
from wsi_pipeline.tiling.worker import worker_main

__all__ = [
    "REPORT_COLUMNS",
    "SLIDE_EXTENSIONS",
    "CohortReport",
    "jobs_from_folder",
    "jobs_from_manifest",
    "tile_cohort",
]

logger = logging.getLogger(__name__)

#: File extensions taken as slides when scanning a folder (case-insensitive). Formats no
#: backend reads (e.g. CZI) are listed on purpose: they get a ``failed`` row, not silence.
SLIDE_EXTENSIONS: tuple[str, ...] = (
    ".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".bif", ".svslide",
    ".qptiff", ".dcm", ".czi", ".isyntax",
)
REPORT_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SlideResult))
REPORT_NAME = "tiling_report.csv"


def _slide_id(name: str) -> str:
    stem = name
    for ext in sorted(SLIDE_EXTENSIONS, key=len, reverse=True):
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
            break
    return stem[:-4] if stem.lower().endswith(".ome") else stem


def jobs_from_folder(folder: str | os.PathLike, *, exclude: Sequence[str | os.PathLike] = ()) -> list[SlideJob]:
    """List the slides under ``folder`` (recursively), sorted by path.

    ``slide_id`` is the file name without its extension. A folder holding ``.dcm`` files is one
    DICOM slide named after the folder. Hidden folders, ``*.zarr`` stores and ``exclude`` are
    skipped. Two slides with the same id both get a job that fails with a message naming both.

    Raises
    ------
    FileNotFoundError : ``folder`` is not a directory.
    """
    root = Path(folder).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"slides folder not found: {root}")
    skip = {Path(p).resolve() for p in exclude}
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not d.endswith(".zarr") and (here / d).resolve() not in skip
        )
        dcm = sorted(f for f in filenames if f.lower().endswith(".dcm"))
        if dcm:
            found.append((here.name if here != root else _slide_id(dcm[0]), here / dcm[0]))
        for f in sorted(filenames):
            if f.startswith(".") or f.lower().endswith(".dcm"):
                continue
            if any(f.lower().endswith(ext) for ext in SLIDE_EXTENSIONS):
                found.append((_slide_id(f), here / f))
    by_id: dict[str, list[Path]] = {}
    for sid, p in found:
        by_id.setdefault(sid, []).append(p)
    jobs = []
    for sid, p in sorted(found, key=lambda t: str(t[1])):
        problem = None
        if len(by_id[sid]) > 1:
            others = ", ".join(str(q) for q in by_id[sid])
            problem = f"duplicate slide_id {sid!r} ({others}); rename one of the files or list the slides in a manifest with unique slide_id"
        jobs.append(SlideJob(sid, str(p), None, problem))
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


def _write_report(results: Sequence[SlideResult | None], jobs: Sequence[SlideJob], path: Path, *, final: bool = False) -> None:
    """Write ``tiling_report.csv`` atomically; unfinished slides are ``pending`` (``failed`` when ``final``)."""
    rows = [asdict(r if r is not None else _unfinished(job, final)) for job, r in zip(jobs, results)]
    df = pd.DataFrame(rows, columns=list(REPORT_COLUMNS))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def _default_workers() -> int:
    """Cores this process may use (CPU affinity, e.g. under SLURM), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not available on macOS / Windows
        return os.cpu_count() or 1


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    index: int | None = None  # the job being tiled


def _death_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"was killed by {name}"
    else:
        how = f"exited with code {exitcode}"
    return (
        f"the worker process tiling this slide {how} (a reader crash on a damaged file, or the system "
        "ran out of memory); no store was written. Rerun to retry it; if it recurs, check the file "
        "or use fewer --workers"
    )


def tile_cohort(
    source: str | os.PathLike | Sequence[SlideJob],
    out_dir: str | os.PathLike,
    config: TilingConfig | None = None,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_result: Callable[[SlideResult], None] | None = None,
) -> CohortReport:
    """Tile every slide of a folder, a manifest or a job list into ``out_dir``.

    Parameters
    ----------
    source : a folder of slides, one slide file, a manifest CSV, or a list of :class:`SlideJob`.
    out_dir : the tiles folder (``<slide_id>.zarr``, ``qc/``, ``tiling_report.csv``).
    config : :class:`TilingConfig` (defaults: greyscale, 256 px, level 0, zstd).
    workers : worker processes; None = the cores available to this process; 0 = tile in this process
        (no crash isolation; for debugging and small jobs).
    overwrite : rebuild stores even when they are complete and current.
    progress : show a tqdm bar (slides, with tiles kept in the postfix).
    on_result : called in this process with each finished slide's result.

    Returns
    -------
    :class:`CohortReport`; ``report.ok`` is False when any slide failed.

    Notes
    -----
    Workers are started with ``spawn``: a script calling this must guard its entry point with
    ``if __name__ == "__main__":``.
    """
    t0 = time.perf_counter()
    config = config or TilingConfig()
    out = Path(out_dir)
    if isinstance(source, (str, os.PathLike)):
        src = Path(source)
        if src.is_dir():
            jobs = jobs_from_folder(src, exclude=[out])
        elif src.suffix.lower() == ".csv":
            jobs = jobs_from_manifest(src)
        elif src.is_file() and src.name.lower().endswith(SLIDE_EXTENSIONS):
            jobs = [SlideJob(_slide_id(src.name), str(src.resolve()))]
        else:
            raise FileNotFoundError(f"{src} is neither a folder of slides, a slide file, nor a manifest .csv")
    else:
        jobs = list(source)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / REPORT_NAME
    results: list[SlideResult | None] = [None] * len(jobs)
    n_workers = _default_workers() if workers is None else int(workers)
    if n_workers < 0:
        raise ValueError(f"workers={workers} must be >= 0 (0 = in this process)")

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), unit="slide", desc="tiling", disable=not progress, dynamic_ncols=True)
    tiles_done = 0
    n_failed = 0
    last_write = 0.0

    def finish(i: int, r: SlideResult) -> None:
        nonlocal last_write, n_failed
        results[i] = r
        if r.status == "failed":
            n_failed += 1
            logger.warning("slide %s failed: %s", r.slide_id, r.error)
        if on_result is not None:
            on_result(r)
        bar.set_postfix(tiles=tiles_done, failed=n_failed, refresh=False)
        bar.update(1)
        if time.monotonic() - last_write > 2.0:
            _write_report(results, jobs, report_path)
            last_write = time.monotonic()

    def add_tiles(n: int, refresh: bool = True) -> None:
        nonlocal tiles_done
        tiles_done += n
        bar.set_postfix(tiles=tiles_done, failed=n_failed, refresh=refresh)

    try:
        todo = []
        for i, job in enumerate(jobs):
            early = precheck(job, out, config, overwrite=overwrite)
            if early is None:
                todo.append(i)
                continue
            if early.status == "skipped":
                add_tiles(early.n_tiles, refresh=False)
            finish(i, early)
        if n_workers == 0:
            for i in todo:
                finish(i, tile_slide(jobs[i], out, config, overwrite=overwrite, progress=add_tiles))
        elif todo:
            _run_pool(jobs, todo, out, config, overwrite, min(n_workers, len(todo)), finish, add_tiles)
    finally:
        bar.close()
        _write_report(results, jobs, report_path, final=True)
    final = [r if r is not None else _unfinished(j, True) for j, r in zip(jobs, results)]
    return CohortReport(final, report_path, round(time.perf_counter() - t0, 3))


def _run_pool(
    jobs: Sequence[SlideJob],
    todo: Sequence[int],
    out: Path,
    config: TilingConfig,
    overwrite: bool,
    n_workers: int,
    finish: Callable[[int, SlideResult], None],
    add_tiles: Callable[[int], None],
) -> None:
    # spawn: workers must not inherit a parent's threads or CUDA state (predict may have torch loaded)
    ctx = mp.get_context("spawn")
    # a writer thread per worker pays off only when cores are left over for it; otherwise the
    # workers' compression threads compete with the other workers' decoding
    background_write = n_workers < _default_workers()
    pending = deque(todo)
    pool: list[_Worker] = []

    def start() -> _Worker:
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(child, str(out), config, overwrite, background_write), daemon=True, name="wsi-tile-worker")
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        pool.append(w)
        return w

    def assign(w: _Worker) -> None:
        if pending:
            w.index = pending.popleft()
            w.conn.send(jobs[w.index])
        else:
            w.index = None
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
            finish(w.index, SlideResult(job.slide_id, "failed", error=_death_message(w.proc.exitcode), path=job.path))
            _remove_temp(out, job.slide_id, w.proc.pid)
            w.index = None
            if pending:
                assign(start())

    for _ in range(n_workers):
        assign(start())
    try:
        while any(w.index is not None for w in pool):
            busy = [w for w in pool if w.index is not None]
            handles: list[Any] = [w.conn for w in busy] + [w.proc.sentinel for w in busy]
            ready = wait(handles, timeout=1.0)
            for w in busy:
                if w.conn in ready:
                    try:
                        while w.conn.poll():
                            kind, payload = w.conn.recv()
                            if kind == "progress":
                                add_tiles(int(payload))
                            elif kind == "done" and w.index is not None:
                                r: SlideResult = payload
                                if r.status == "skipped":
                                    add_tiles(r.n_tiles, refresh=False)
                                finish(w.index, r)
                                assign(w)
                    except (EOFError, OSError):
                        bury(w)
                        continue
                if w in pool and w.proc.sentinel in ready and not w.conn.poll():
                    bury(w)
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
