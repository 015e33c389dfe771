"""Tiling on a Dask cluster (the cluster itself: :mod:`wsi_pipeline.jobs.cluster`).

This module submits one task per slide and streams the results back to the runner, which
keeps doing what it does for its own process pool: the slide locks (held by the submitting
process, :mod:`wsi_pipeline.tiling.locks`), the report merge and the progress bar.

A worker that dies (``kill -9``, the OOM killer, a node lost) costs only the slide it was
tiling: the scheduler runs it again on another worker, up to ``retries`` more times
(``distributed.scheduler.allowed-failures``; for a ``tcp://`` scheduler its own setting
applies); after that the slide gets a ``failed`` row. The half-written temporary store of a
killed worker is removed by the next attempt on the same host (see :func:`wsi_pipeline.tiling.identity.clean_stale`).

"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from wsi_pipeline.failures import is_slide_error
from wsi_pipeline.jobs.cluster import POLL_S, DEFAULT_RETRIES, ClusterSpec, dask_client, default_workers
from wsi_pipeline.tiling.job import SlideJob, SlideResult
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.tiler import tile_slide

__all__ = ["run_on_dask", "tile_task"]

logger = logging.getLogger(__name__)


def tile_task(job: SlideJob, out_dir: str, config: TilingConfig, overwrite: bool, threads: int) -> SlideResult:
    """The Dask task of one slide: :func:`~wsi_pipeline.tiling.tiler.tile_slide` in a worker process,
    with ``threads`` decoding threads (see :func:`_tile_threads`)."""
    import cv2

    cv2.setNumThreads(1)  # the tiler's own threads share the cores, as in the local pool
    return tile_slide(job, out_dir, config, overwrite=overwrite, background_write=threads > 1, threads=threads)


def _for_workers(job: SlideJob) -> SlideJob:
    """``job`` with an absolute path (a worker's working directory may differ from ours)."""
    if job.path and not os.path.isabs(job.path):
        return replace(job, path=os.path.abspath(job.path))
    return job


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _remove_dead_temps(out: Path, slide_id: str) -> None:
    """Remove the temporary stores of ``slide_id`` whose writer (a worker on this host) is gone."""
    import shutil

    for p in out.glob(f".{slide_id}.zarr.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if not _running(pid):
            shutil.rmtree(p, ignore_errors=True)


def _killed_message(err: BaseException, retries: int) -> str:
    return (f"the Dask worker tiling this slide died {retries + 1} time(s) ({type(err).__name__}: {err}); "
            "usually the out-of-memory killer or a lost node: give workers more memory or use fewer per node. "
            "No store was written. Rerun to retry it")


def run_on_dask(
    cluster: ClusterSpec | Any,
    jobs: Sequence[SlideJob],
    claim: Callable[[], int | None],
    claims_done: Callable[[], bool],
    out: Path,
    config: TilingConfig,
    overwrite: bool,
    finish: Callable[[int, SlideResult], None],
    add_tiles: Callable[..., None],
    *,
    workers: int | None = None,
    retries: int = DEFAULT_RETRIES,
) -> None:
    """Tile the claimed slides on ``cluster`` (a :class:`ClusterSpec` or a connected ``distributed.Client``).

    ``claim()`` returns the next job index whose lock this process now holds (None when none can
    start now); ``claims_done()`` tells when no slide is left to claim. Each finished slide is
    passed to ``finish(index, result)`` in this process, in completion order. At most one task
    more than the cluster has threads is in flight, so locks are taken just before a slide can run.
    """
    from distributed import Client

    if isinstance(cluster, Client):
        _submit_all(cluster, jobs, claim, claims_done, out, config, overwrite, finish, add_tiles, retries)
        return
    with dask_client(cluster, workers=workers, retries=retries) as client:
        _submit_all(client, jobs, claim, claims_done, out, config, overwrite, finish, add_tiles, retries)


def _is_local(client: Any) -> bool:
    from distributed import LocalCluster

    return isinstance(getattr(client, "cluster", None), LocalCluster)


def _tile_threads(client: Any) -> int:
    """Decoding threads per slide task: on a :class:`distributed.LocalCluster`, this machine's cores
    shared among its worker threads (the local pool's rule); elsewhere 1, since other jobs may share
    a worker's node and a worker's cores are already its threads."""
    from distributed import LocalCluster

    if not isinstance(getattr(client, "cluster", None), LocalCluster):
        return 1
    return max(1, default_workers() // max(1, sum(client.nthreads().values())))


def _submit_all(
    client: Any, jobs: Sequence[SlideJob], claim: Callable[[], int | None], claims_done: Callable[[], bool], out: Path,
    config: TilingConfig, overwrite: bool, finish: Callable[[int, SlideResult], None], add_tiles: Callable[..., None],
    retries: int,
) -> None:
    from distributed import wait
    from distributed.client import FutureCancelledError

    tile_threads = _tile_threads(client)
    # workers on this host: temporary stores of killed attempts are removed here (elsewhere by the next run)
    local_workers = _is_local(client)
    out_abs = str(out.resolve())
    running: dict[Any, int] = {}
    threads = 1
    last_threads = 0.0

    def fill() -> None:
        nonlocal threads, last_threads
        if time.monotonic() - last_threads > 2.0:  # workers come and go (SLURM jobs starting, nannies restarting)
            threads = max(1, sum(client.nthreads().values()))
            last_threads = time.monotonic()
        while len(running) < threads + 1:
            i = claim()
            if i is None:
                return
            job = jobs[i]
            fut = client.submit(tile_task, _for_workers(job), out_abs, config, overwrite, tile_threads,
                                key=f"tile-{job.slide_id}-{os.getpid()}-{time.time_ns()}", pure=False, retries=retries)
            running[fut] = i

    try:
        fill()
        while running or not claims_done():
            if not running:
                time.sleep(POLL_S)
                fill()
                continue
            try:
                done = wait(list(running), timeout=POLL_S * 4, return_when="FIRST_COMPLETED").done
            except TimeoutError:
                done = set()
            for fut in done:
                i = running.pop(fut)
                job = jobs[i]
                if fut.status == "finished":
                    r: SlideResult = fut.result()
                    r.path = job.path  # the report keeps the path as listed
                    add_tiles(r.n_tiles, refresh=False)
                else:
                    try:
                        err = fut.exception()
                    except FutureCancelledError as e:
                        err = e
                    from distributed.scheduler import KilledWorker

                    if isinstance(err, KilledWorker):
                        msg = _killed_message(err, retries)
                    elif err is not None and not isinstance(err, FutureCancelledError) and not is_slide_error(err):
                        raise err  # the tiler let it through: a bug or memory stops the run (wsi_pipeline.failures)
                    else:
                        msg = f"the Dask task failed after {retries + 1} attempt(s): {type(err).__name__}: {err}"
                    r = SlideResult(job.slide_id, "failed", error=msg, path=job.path)
                if local_workers:
                    _remove_dead_temps(out, job.slide_id)
                finish(i, r)
            fill()
    finally:
        if running:
            client.cancel(list(running))


