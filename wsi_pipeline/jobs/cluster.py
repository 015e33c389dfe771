"""Where per-slide work runs: ``--cluster local[:N] | tcp://HOST:PORT | slurm[:JOBS]`` on Dask.

Dask (``distributed``) schedules and dask-jobqueue starts SLURM workers; this module only turns a
``--cluster`` value into a connected client (:func:`dask_client`) and maps a function over
slides, one task each (:func:`map_slides`, used by :func:`wsi_pipeline.jobs.slide_jobs.run_slides`).
Rows, reports and progress are the job runner's (:mod:`wsi_pipeline.jobs.slide_jobs`); the tiler
submits its own tasks as its slide locks allow (:mod:`wsi_pipeline.tiling.cluster`).

- ``local[:N]``: a :class:`distributed.LocalCluster` of N single-threaded worker processes
  (default: ``--workers``, else the cores available).
- ``tcp://HOST:PORT``: attach to a running scheduler (``dask scheduler`` + ``dask worker``
  on other machines); the workers must see the outputs and slides under the same paths.
- ``slurm[:JOBS]``: :class:`dask_jobqueue.SLURMCluster` with :class:`SlurmOptions`, scaled
  to JOBS batch jobs (default 1); the workers are cancelled when the run ends.

A task whose worker dies runs again elsewhere up to ``retries`` more times
(``distributed.scheduler.allowed-failures``). ``dask`` and ``dask_jobqueue`` are imported only
inside the functions that need them, so the command line stays fast without a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["DEFAULT_RETRIES", "ClusterSpec", "SlurmOptions", "dask_client", "default_workers", "map_slides",
           "parse_cluster", "parse_cluster_option", "slurm_cluster_kwargs"]

logger = logging.getLogger(__name__)

#: Extra runs of a slide after its worker died or its task raised.
DEFAULT_RETRIES = 2
POLL_S = 0.25


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
    from wsi_pipeline.config.io import load_yaml

    key, sep, value = str(text).partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"--cluster-option {text!r}: expected KEY=VALUE with a SLURMCluster argument as KEY, "
                         "e.g. local_directory=/scratch or 'job_extra_directives=[\"--constraint=v100\"]'")
    return key, load_yaml(value, f"--cluster-option {text!r}")


#: Dask's loggers: the scheduler's, the workers' and the nannies' start-up lines come from these.
DASK_LOGGERS = ("distributed", "distributed.scheduler", "distributed.worker", "distributed.nanny", "distributed.core",
                "distributed.http.proxy", "bokeh")


def quiet_dask_logs() -> None:
    """Show only Dask's warnings unless our package logs INFO (``-v``).

    Set through the environment before ``distributed`` is imported, so the worker processes a local
    cluster starts (which read their logging settings from it) are quiet too, and on the loggers of
    this process.
    """
    if logging.getLogger("wsi_pipeline").getEffectiveLevel() <= logging.INFO:
        return
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    for name in DASK_LOGGERS:
        if logging.getLogger(name).getEffectiveLevel() < logging.WARNING:
            logging.getLogger(name).setLevel(logging.WARNING)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def dask_client(spec: ClusterSpec, *, workers: int | None = None, retries: int = DEFAULT_RETRIES) -> Iterator[Any]:
    """A :class:`distributed.Client` for ``spec``; a cluster started here is closed on exit.

    ``workers`` is the runner's worker count, used by ``local`` without ``:N``. ``retries`` sets
    how often a slide whose worker died is run again (the scheduler's ``allowed-failures``).

    Dask's own INFO lines (scheduler and worker start-up, ~30 per local cluster) are hidden unless
    our package logs INFO (``-v``): :func:`quiet_dask_logs`.
    """
    quiet_dask_logs()
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
            n = spec.workers or workers or default_workers()
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

    For per-slide stages without slide locks (through :func:`wsi_pipeline.jobs.slide_jobs.run_slides`): every item is submitted at
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
