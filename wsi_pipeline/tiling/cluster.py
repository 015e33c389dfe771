"""Per-slide work on a Dask cluster: ``--cluster local[:N] | tcp://HOST:PORT | slurm[:JOBS]``.

Dask (``distributed``) schedules, dask-jobqueue starts SLURM workers; this module only picks
the cluster, submits one task per slide and streams the results back to the runner, which
keeps doing what it does for its own process pool: the slide locks (held by the submitting
process, :mod:`wsi_pipeline.tiling.locks`), the report merge and the progress bar.

- ``local[:N]``: a :class:`distributed.LocalCluster` of N single-threaded worker processes
  (default: ``--workers``, else the cores available).
- ``tcp://HOST:PORT``: attach to a running scheduler (``dask scheduler`` + ``dask worker``
  on other machines); the workers must see ``--out`` and the slides under the same paths.
- ``slurm[:JOBS]``: :class:`dask_jobqueue.SLURMCluster` with :class:`SlurmOptions`, scaled
  to JOBS batch jobs (default 1); the workers are cancelled when the run ends.

A worker that dies (``kill -9``, the OOM killer, a node lost) costs only the slide it was
tiling: the scheduler runs it again on another worker, up to ``retries`` more times
(``distributed.scheduler.allowed-failures``; for a ``tcp://`` scheduler its own setting
applies); after that the slide gets a ``failed`` row. The half-written temporary store of a
killed worker is removed by the next attempt on the same host (see ``tiler._clean_stale``).

``dask`` and ``dask_jobqueue`` are imported only inside the functions that need them, so the
command line stays fast without a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from wsi_pipeline.tiling.tiler import SlideJob, SlideResult, TilingConfig, tile_slide

__all__ = ["ClusterSpec", "SlurmOptions", "dask_client", "map_slides", "parse_cluster", "run_on_dask", "slurm_cluster_kwargs", "tile_task"]

logger = logging.getLogger(__name__)

#: Extra runs of a slide after its worker died or its task raised.
DEFAULT_RETRIES = 2
_POLL_S = 0.25


@dataclass(frozen=True)
class SlurmOptions:
    """What each SLURM batch job of a :class:`dask_jobqueue.SLURMCluster` asks for.

    None leaves a value to the Dask configuration (``~/.config/dask/jobqueue.yaml``,
    ``jobqueue.slurm.*``). ``extra`` is passed to ``SLURMCluster`` as keyword arguments
    (``--cluster-option KEY=VALUE``), after and over the named fields.
    """

    queue: str | None = None  # partition (#SBATCH -p)
    account: str | None = None  # #SBATCH -A
    cores: int | None = None  # CPU cores per job
    memory: str | None = None  # memory per job, e.g. "32GB"
    walltime: str | None = None  # e.g. "02:00:00"
    gpus: int | None = None  # GPUs per job (#SBATCH --gres=gpu:G)
    processes: int | None = None  # worker processes per job [default: cores, one single-threaded worker each]
    jobs: int = 1  # batch jobs to start
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterSpec:
    """A parsed ``--cluster`` value: ``kind`` is ``local``, ``tcp`` or ``slurm``."""

    kind: str
    workers: int | None = None  # local: worker processes (None: the runner's --workers, else the cores)
    address: str | None = None  # tcp: the scheduler
    slurm: SlurmOptions = field(default_factory=SlurmOptions)


def parse_cluster(text: str, slurm: SlurmOptions | None = None) -> ClusterSpec:
    """Parse ``local``, ``local:N``, ``tcp://HOST:PORT`` (or ``tls://``), ``slurm`` or ``slurm:JOBS``.

    Raises
    ------
    ValueError : anything else, naming what was found and what is accepted.
    """
    t = str(text).strip()
    accepted = "local, local:N, tcp://HOST:PORT, slurm or slurm:JOBS"
    if t.startswith(("tcp://", "tls://")):
        host, _, port = t.split("://", 1)[1].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--cluster {text!r}: a scheduler address needs a host and a port, e.g. tcp://node01:8786")
        return ClusterSpec("tcp", address=t)
    kind, _, n = t.partition(":")
    if kind not in ("local", "slurm"):
        raise ValueError(f"--cluster {text!r} is not understood; expected {accepted}")
    count: int | None = None
    if n:
        try:
            count = int(n)
        except ValueError:
            raise ValueError(f"--cluster {text!r}: {n!r} is not a whole number; expected {accepted}") from None
        if count < 1:
            raise ValueError(f"--cluster {text!r}: the count must be >= 1")
    if kind == "local":
        return ClusterSpec("local", workers=count)
    opts = slurm or SlurmOptions()
    if count is not None:
        opts = replace(opts, jobs=count)
    return ClusterSpec("slurm", slurm=opts)


def slurm_cluster_kwargs(opts: SlurmOptions) -> dict[str, Any]:
    """Keyword arguments for :class:`dask_jobqueue.SLURMCluster` from ``opts``.

    Each job runs ``processes`` single-threaded worker processes (default: one per core, as the
    local pool does); GPUs are requested with ``--gres=gpu:G``.
    """
    kw: dict[str, Any] = {}
    for name in ("queue", "account", "cores", "memory", "walltime"):
        value = getattr(opts, name)
        if value is not None:
            kw[name] = value
    processes = opts.processes if opts.processes is not None else opts.cores
    if processes is not None:
        kw["processes"] = processes
    if opts.gpus:
        kw["job_extra_directives"] = [f"--gres=gpu:{int(opts.gpus)}"]
    for key, value in opts.extra.items():
        if key == "job_extra_directives" and "job_extra_directives" in kw:
            kw[key] = list(kw[key]) + list(value)
        else:
            kw[key] = value
    return kw


def parse_cluster_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``; VALUE is read as YAML (``8``, ``true``, ``["--constraint=v100"]``)."""
    import yaml

    key, sep, value = str(text).partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"--cluster-option {text!r}: expected KEY=VALUE with a SLURMCluster argument as KEY, "
                         "e.g. local_directory=/scratch or 'job_extra_directives=[\"--constraint=v100\"]'")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ValueError(f"--cluster-option {text!r}: the value is not valid YAML ({err})") from err


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def dask_client(spec: ClusterSpec, *, workers: int | None = None, retries: int = DEFAULT_RETRIES) -> Iterator[Any]:
    """A :class:`distributed.Client` for ``spec``; a cluster started here is closed on exit.

    ``workers`` is the runner's worker count, used by ``local`` without ``:N``. ``retries`` sets
    how often a slide whose worker died is run again (the scheduler's ``allowed-failures``).
    """
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": int(retries)}):
        if spec.kind == "tcp":
            try:
                client = Client(spec.address, timeout="30s")
            except OSError as err:
                raise ValueError(f"--cluster {spec.address}: no Dask scheduler answers there ({err}); start one with "
                                 "`dask scheduler` and workers with `dask worker ADDRESS --nthreads 1`") from err
            with client:
                yield client
            return
        if spec.kind == "local":
            n = spec.workers or workers or _default_workers()
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
                yield client
            return
        if spec.kind == "slurm":
            from dask_jobqueue import SLURMCluster

            kw = slurm_cluster_kwargs(spec.slurm)
            try:
                cluster = SLURMCluster(**kw)
            except (ValueError, TypeError) as err:
                raise ValueError(f"--cluster slurm: SLURMCluster({kw}) is unusable: {err}") from err
            with cluster, Client(cluster) as client:
                cluster.scale(jobs=spec.slurm.jobs)
                yield client
            return
    raise ValueError(f"unknown cluster kind {spec.kind!r}")


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
    return max(1, _default_workers() // max(1, sum(client.nthreads().values())))


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
                time.sleep(_POLL_S)
                fill()
                continue
            try:
                done = wait(list(running), timeout=_POLL_S * 4, return_when="FIRST_COMPLETED").done
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


@contextlib.contextmanager
def _client_for(cluster: ClusterSpec | str | Any, *, workers: int | None, retries: int) -> Iterator[Any]:
    """A client for a ``--cluster`` string, a :class:`ClusterSpec` (started and closed here) or a connected client."""
    from distributed import Client

    if isinstance(cluster, Client):
        yield cluster
        return
    spec = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    with dask_client(spec, workers=workers, retries=retries) as client:
        yield client


def map_slides(
    cluster: ClusterSpec | str | Any,
    fn: Callable[..., Any],
    items: Sequence[Any],
    args: tuple[Any, ...] = (),
    *,
    broadcast: Any = None,
    progress: bool = True,
    desc: str = "slides",
    retries: int = DEFAULT_RETRIES,
    workers: int | None = None,
) -> list[Any]:
    """Run ``fn(item, *args)`` (``fn(item, broadcast, *args)`` with ``broadcast``) as one Dask task per item.

    For per-slide stages without slide locks (feature extraction): every item is submitted at
    once, ``broadcast`` (e.g. an encoder module) is sent to each worker once, a task whose worker
    died runs again elsewhere up to ``retries`` times. Returns the results in the order of
    ``items``; an item whose task raised (or whose workers kept dying) gets the exception instead.
    """
    from distributed import as_completed

    from wsi_pipeline.progress import progress_bar

    with _client_for(cluster, workers=workers, retries=retries) as client:
        extra: tuple[Any, ...] = ()
        if broadcast is not None:
            extra = (client.scatter(broadcast, broadcast=True, hash=False),)
        stamp = f"{os.getpid()}-{time.time_ns()}"
        futures = [client.submit(fn, item, *extra, *args, key=f"{desc}-{i}-{stamp}", pure=False, retries=retries)
                   for i, item in enumerate(items)]
        where = {f.key: i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(items)
        with progress_bar(total=len(items), unit="slide", desc=desc, enabled=progress) as bar:
            try:
                for fut in as_completed(futures):
                    i = where[fut.key]
                    results[i] = fut.result() if fut.status == "finished" else fut.exception()
                    bar.update(1)
            finally:
                client.cancel([f for f in futures if not f.done()])
        return results
