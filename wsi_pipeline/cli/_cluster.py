"""Command-line flags shared by the per-slide stages that can run on a Dask cluster or as one shard of many."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_cluster_arguments", "cluster_from_args", "join_torchrun", "shard_from_args"]


def join_torchrun(args: argparse.Namespace) -> bool:
    """Under torchrun, join the process group (every rank then works on a shard of the slides and
    rank 0 writes and prints); other ranks go quiet (errors only, no progress bars), and
    ``--cluster`` beside torchrun is refused (``ValueError``). Returns whether this process is rank 0
    (True in a single process). The caller leaves the group with ``distributed.shutdown()``."""
    from wsi_pipeline.training import distributed

    main = distributed.init_from_env().is_main
    if not main:
        logging.getLogger("wsi_pipeline").setLevel(logging.ERROR)
        args.no_progress = True
    if distributed.current().enabled and args.cluster:
        raise ValueError("--cluster and torchrun are two ways to spread the slides; use one")
    return main


def add_cluster_arguments(p: argparse.ArgumentParser, *, shard: bool = True) -> None:
    """Add ``--cluster``, ``--retries``, the ``--slurm-*`` options, ``--cluster-option`` and (``shard``) ``--shard`` to ``p``."""
    g = p.add_argument_group("scaling out (Dask cluster, SLURM job arrays; see the README's 'Scaling out')")
    g.add_argument("--cluster", metavar="SPEC", default=None,
                   help="run each slide as a Dask task: local[:N] (N worker processes on this machine), tcp://HOST:PORT "
                        "(a running Dask scheduler whose workers see the same paths) or slurm[:JOBS] (start JOBS SLURM "
                        "batch jobs of workers with dask-jobqueue, options below) (default: this machine's process pool)")
    g.add_argument("--retries", type=int, default=2, metavar="N",
                   help="with --cluster: run a slide again, on another worker, up to N times when its worker dies")
    g.add_argument("--slurm-queue", metavar="PARTITION", default=None, help="with --cluster slurm: the partition (#SBATCH -p)")
    g.add_argument("--slurm-account", metavar="NAME", default=None, help="with --cluster slurm: the account (#SBATCH -A)")
    g.add_argument("--slurm-cores", type=int, metavar="N", default=None, help="with --cluster slurm: CPU cores per job")
    g.add_argument("--slurm-memory", metavar="SIZE", default=None, help="with --cluster slurm: memory per job, e.g. 64GB")
    g.add_argument("--slurm-walltime", metavar="HH:MM:SS", default=None, help="with --cluster slurm: time limit per job")
    g.add_argument("--slurm-gpus", type=int, metavar="G", default=None, help="with --cluster slurm: GPUs per job (--gres=gpu:G)")
    g.add_argument("--slurm-processes", type=int, metavar="N", default=None,
                   help="with --cluster slurm: worker processes per job (default: one per core)")
    g.add_argument("--cluster-option", action="append", default=[], metavar="KEY=VALUE",
                   help="with --cluster slurm: any other dask_jobqueue.SLURMCluster argument, VALUE read as YAML "
                        "(repeatable), e.g. --cluster-option 'job_script_prologue=[\"source .venv/bin/activate\"]'. "
                        "Unset options come from the Dask config (~/.config/dask/jobqueue.yaml)")
    if not shard:
        return
    g.add_argument("--shard", metavar="K/N", default=None,
                   help="process only the K-th of N disjoint, deterministic slide subsets (1 <= K <= N), for job arrays: "
                        "sbatch --array=1-N ... --shard $SLURM_ARRAY_TASK_ID/N; all shards share one report")


def cluster_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~wsi_pipeline.jobs.cluster.ClusterSpec` of ``args`` (None without ``--cluster``); ValueError when unusable."""
    if args.retries < 0:
        raise ValueError(f"--retries {args.retries} must be >= 0")
    slurm_flags = {k: getattr(args, f"slurm_{k}") for k in ("queue", "account", "cores", "memory", "walltime", "gpus", "processes")}
    if args.cluster is None:
        used = [f"--slurm-{k}" for k, v in slurm_flags.items() if v is not None] + (["--cluster-option"] if args.cluster_option else [])
        if used:
            raise ValueError(f"{', '.join(used)} need --cluster slurm")
        return None
    from wsi_pipeline.jobs.cluster import SlurmOptions, parse_cluster, parse_cluster_option

    for k in ("cores", "gpus", "processes"):
        if slurm_flags[k] is not None and slurm_flags[k] < 1:
            raise ValueError(f"--slurm-{k} {slurm_flags[k]} must be >= 1")
    extra = dict(parse_cluster_option(o) for o in args.cluster_option)
    spec = parse_cluster(args.cluster, SlurmOptions(**slurm_flags, extra=extra))
    if spec.kind != "slurm" and (extra or any(v is not None for v in slurm_flags.values())):
        raise ValueError(f"--slurm-* and --cluster-option apply to --cluster slurm, not to --cluster {args.cluster}")
    return spec


def shard_from_args(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--shard K/N`` as ``(K, N)``, None without it; ValueError when malformed."""
    if getattr(args, "shard", None) is None:
        return None
    from wsi_pipeline.tiling.partition import parse_shard

    return parse_shard(args.shard)
