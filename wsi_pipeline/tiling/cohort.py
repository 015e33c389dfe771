"""The cohort runner: tile a folder of slides or a manifest, in worker processes, resumably.

- Slides run in parallel in worker processes (default: one per core), started once for the run. Each
  worker reports progress and results over its own pipe; a worker that dies (a reader crash, the OOM
  killer, ``kill -9``) costs only its current slide, which gets a ``failed`` row, and is replaced.
  A worker whose slides take under 2 s is sent the next ones ahead (:mod:`~wsi_pipeline.tiling.pool`),
  so many small images are tiled at the speed of their decode rather than of this process's turn.
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
- The output folder is checked before any work (:mod:`wsi_pipeline.output_dirs`), and again
  when a slide fails: a folder that cannot be written stops the run with one
  :class:`~wsi_pipeline.output_dirs.OutputDirError` instead of failing every slide.

The bookkeeping (rows, progress bar, report while running and on an interrupt) is the per-slide
job runner's (:class:`wsi_pipeline.jobs.slide_jobs.SlideRun`), with the tiler's steps plugged in. The
parts: :mod:`~wsi_pipeline.tiling.sources` (which slides), :mod:`~wsi_pipeline.tiling.claims`
(slide locks), :mod:`~wsi_pipeline.tiling.pool` (worker processes), :mod:`~wsi_pipeline.tiling.cluster`
(Dask), :mod:`~wsi_pipeline.tiling.report` (the merged report).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from wsi_pipeline.jobs.cluster import default_workers
from wsi_pipeline.jobs.slide_jobs import STOP_ERRNOS, SlideRun, run_claimed
from wsi_pipeline.tiling.claims import RETRY_S, SlideClaims
from wsi_pipeline.tiling.locks import HEARTBEAT_S, STALE_AFTER_S, LockDir
from wsi_pipeline.output_dirs import OutputDirError, check_output_dir, output_problem
from wsi_pipeline.tiling.pool import run_pool
from wsi_pipeline.tiling.report import LOCK_DIR, REPORT_NAME, CohortReport, unfinished_result, write_report
from wsi_pipeline.tiling.sources import jobs_from_source
from wsi_pipeline.tiling.job import SlideJob, SlideResult
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.tiler import precheck, tile_slide

__all__ = ["tile_cohort"]

logger = logging.getLogger(__name__)

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
    FileNotFoundError : ``source`` does not exist, or ``config.points`` is neither a file nor a folder.
    ValueError : a points file (``config.points``) that is not one, naming it and the row or feature
        (:func:`~wsi_pipeline.tiling.points.check_points`), or a ``tissue_model`` that is not a readable tissue
        model (a hostile pickle included: :func:`~wsi_pipeline.model_files.load_torch_file`), before any slide is tiled.

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
    jobs = _select_jobs(source, out, shard)
    if config.points is not None:  # a bad points file is refused once, before any slide (not once per slide)
        from wsi_pipeline.tiling.points import check_points

        check_points(config.points, [j.slide_id for j in jobs])
    tissue_model = getattr(config.detector, "tissue_model", None)
    if tissue_model is not None:  # a model file that is none (or a hostile pickle) is refused once, not per slide
        from wsi_pipeline.tissue_seg.stage import load_tissue_model

        load_tissue_model(tissue_model)
    if isinstance(cluster, str):
        from wsi_pipeline.jobs.cluster import parse_cluster

        cluster = parse_cluster(cluster)
    check_output_dir(out, subfolders=("qc", LOCK_DIR))
    report_path = out / REPORT_NAME
    locks = LockDir(out / LOCK_DIR, stale_after_s=lock_stale_s, heartbeat_s=min(heartbeat_s, lock_stale_s / 4))
    run = _slide_run(jobs, out, locks, progress, on_result)
    with run, locks:
        claims = _first_look(jobs, out, config, overwrite, locks, run, since=started)
        _execute(run, claims, jobs, out, config, overwrite, n_workers, cluster, workers=workers, retries=retries)
    try:
        run.write_report(final=True)
    except OSError as err:
        raise OutputDirError(out, f"cannot write {report_path}: {err}") from err
    final = [r if r is not None else unfinished_result(j, True) for j, r in zip(jobs, run.results)]
    return CohortReport(final, report_path, round(time.perf_counter() - t0, 3))


def _slide_run(jobs: Sequence[SlideJob], out: Path, locks: LockDir, progress: bool,
               on_result: Callable[[SlideResult], None] | None) -> SlideRun:
    """The job runner's bookkeeping with the tiler's steps plugged in: each slide's lock released (and the
    output folder checked when it failed) before its row is recorded; the report merged under its own lock
    every 2 s and at the end."""
    report_locks = LockDir(out / LOCK_DIR, stale_after_s=60.0, heartbeat_s=30.0)
    return SlideRun(
        len(jobs), desc="tiling", progress=progress, totals=("tiles",), on_result=on_result, report_every_s=2.0,
        before_record=functools.partial(_release_and_check, jobs, locks, out),
        report=lambda results, final: write_report(results, jobs, out / REPORT_NAME, final=final, locks=report_locks),
    )


def _select_jobs(source: str | os.PathLike | Sequence[SlideJob], out: Path, shard: tuple[int, int] | None) -> list[SlideJob]:
    """The run's jobs (:func:`~wsi_pipeline.tiling.sources.jobs_from_source`), this shard's only with ``shard``."""
    jobs = jobs_from_source(source, out)
    if shard is not None:
        from wsi_pipeline.tiling.partition import shard_items

        jobs = shard_items(jobs, *shard)
    return jobs


def _release_and_check(jobs: Sequence[SlideJob], locks: LockDir, out: Path, i: int, r: SlideResult) -> None:
    """The tiler's step before a slide's row is recorded: release its lock; for a failed slide, stop the
    run when the output folder broke (the slide stays unprocessed), else say when a write to it failed."""
    locks.release(jobs[i].slide_id)
    if r.status != "failed":
        return
    problem = output_problem(out)
    if problem is None and any(f"[Errno {e}]" in r.error for e in STOP_ERRNOS):  # the worker's error, as text
        problem = "the disk is full, the quota used up or the file system read-only; free space or choose another disk"
    if problem is not None:  # the output broke, not the slide: stop here, this slide stays unprocessed
        raise OutputDirError(out, f"{problem} (while tiling {r.slide_id}: {r.error})")
    if r.error.startswith(("OSError", "PermissionError")) and any(f"'{o}{os.sep}" in r.error for o in (out, out.resolve())):
        r.error = f"writing to the output folder failed (the slide itself may be fine): {r.error}"


def _settle(run: SlideRun, i: int, r: SlideResult) -> None:
    """Record a result known without tiling (a skipped slide's tiles count in the bar)."""
    if r.status == "skipped":
        run.add("tiles", r.n_tiles, refresh=False)
    run.record(i, r)


def _first_look(jobs: Sequence[SlideJob], out: Path, config: TilingConfig, overwrite: bool, locks: LockDir,
                run: SlideRun, since: float) -> SlideClaims:
    """Record the slides known without their lock (complete stores, listing problems); claims for the rest."""
    settle = functools.partial(_settle, run)
    todo = []
    for i, job in enumerate(jobs):
        early = precheck(job, out, config, overwrite=overwrite)
        if early is None:
            todo.append(i)
        else:
            settle(i, early)
    return SlideClaims(jobs, todo, out, config, overwrite, locks, settle, since=since)


def _execute(run: SlideRun, claims: SlideClaims, jobs: Sequence[SlideJob], out: Path, config: TilingConfig,
             overwrite: bool, n_workers: int, cluster: Any, *, workers: int | None, retries: int) -> None:
    """Tile the claimed slides on a Dask cluster, in this process (``n_workers`` 0) or in the process pool."""
    add_tiles: Callable[..., None] = functools.partial(run.add, "tiles")
    if claims.done:
        return
    if cluster is not None:
        from wsi_pipeline.tiling.cluster import run_on_dask

        run_on_dask(cluster, jobs, claims.next, lambda: claims.done, out, config, overwrite, run.record, add_tiles,
                    workers=workers or None, retries=retries)
    elif n_workers == 0:
        run_claimed(run, claims, lambda i: tile_slide(jobs[i], out, config, overwrite=overwrite, progress=add_tiles),
                    idle_s=RETRY_S / 4)
    else:
        run_pool(jobs, claims, out, config, overwrite, min(n_workers, len(claims.pending)), run.record, add_tiles)
