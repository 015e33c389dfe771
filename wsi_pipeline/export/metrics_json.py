"""``metrics.json``: tidy metric records, one value per record.

Schema::

    {"records": [{"method": str, "seed": int | "mean" | "std", "cohort": str,
                  "split": "test" | "external" | ..., "protocol": "all" | "sub256x100" | ...,
                  "metric": str, "value": float | null}, ...]}

Per-seed records carry the model's metrics (for subsample protocols: computed on the
probabilities averaged over repeats). Records with seed ``"mean"`` and ``"std"`` aggregate the
per-seed values of one (method, cohort, split, protocol, metric) with
:func:`~wsi_pipeline.evaluation.metrics.mean_std` (sample std; ``null`` with one seed).
Undefined values (``nan``) are written as ``null``, which keeps the file strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RECORD_KEYS", "MetricRecord", "aggregate_seeds", "write_metrics_json", "read_metrics_json", "validate_records"]

RECORD_KEYS: tuple[str, ...] = ("method", "seed", "cohort", "split", "protocol", "metric", "value")
AGGREGATE_SEEDS: tuple[str, ...] = ("mean", "std")


@dataclass(frozen=True)
class MetricRecord:
    """One value of ``metrics.json`` (see the module docstring)."""

    method: str
    seed: int | str
    cohort: str
    split: str
    protocol: str
    metric: str
    value: float | None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        v = d["value"]
        d["value"] = None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        if isinstance(d["seed"], (np.integer,)):
            d["seed"] = int(d["seed"])
        return d


def aggregate_seeds(records: Iterable[MetricRecord]) -> list[MetricRecord]:
    """Mean and std over seeds of every (method, cohort, split, protocol, metric) group.

    Records that already have seed ``"mean"``/``"std"`` are left out of the groups. Returns the
    new aggregate records only (two per group).
    """
    from wsi_pipeline.evaluation.metrics import mean_std

    groups: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    for r in records:
        if r.seed in AGGREGATE_SEEDS:
            continue
        groups[(r.method, r.cohort, r.split, r.protocol, r.metric)].append(math.nan if r.value is None else float(r.value))
    out = []
    for (method, cohort, split, protocol, metric), values in groups.items():
        m, s = mean_std(values)
        out.append(MetricRecord(method, "mean", cohort, split, protocol, metric, m))
        out.append(MetricRecord(method, "std", cohort, split, protocol, metric, s))
    return out


def validate_records(obj: Mapping[str, Any], *, source: str = "metrics.json") -> list[dict[str, Any]]:
    """Check the schema of a loaded ``metrics.json``; return its records or raise ``ValueError``."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("records"), list):
        raise ValueError(f"{source}: expected an object {{\"records\": [...]}}; got {type(obj).__name__}")
    for i, r in enumerate(obj["records"]):
        if not isinstance(r, Mapping) or tuple(sorted(r)) != tuple(sorted(RECORD_KEYS)):
            raise ValueError(f"{source}: record {i} must have exactly the keys {list(RECORD_KEYS)}; got {r!r}")
        if not (isinstance(r["seed"], int) or r["seed"] in AGGREGATE_SEEDS):
            raise ValueError(f"{source}: record {i} seed must be an integer, 'mean' or 'std'; got {r['seed']!r}")
        if r["value"] is not None and not isinstance(r["value"], (int, float)):
            raise ValueError(f"{source}: record {i} value must be a number or null; got {r['value']!r}")
        for k in ("method", "cohort", "split", "protocol", "metric"):
            if not isinstance(r[k], str):
                raise ValueError(f"{source}: record {i} {k} must be a string; got {r[k]!r}")
    return list(obj["records"])


def write_metrics_json(path: str | os.PathLike, records: Iterable[MetricRecord], *, with_aggregates: bool = True) -> Path:
    """Write ``{"records": [...]}`` atomically: the given records in order, then (``with_aggregates``)
    the seed mean/std of the per-seed ones (:func:`aggregate_seeds`). Given records with seed
    ``"mean"``/``"std"`` (e.g. bootstrap intervals of the seed mean) are written as they are."""
    recs = list(records)
    if with_aggregates:
        recs += aggregate_seeds(recs)
    obj = {"records": [r.to_json() for r in recs]}
    validate_records(obj, source=str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def read_metrics_json(path: str | os.PathLike) -> list[MetricRecord]:
    """Read and validate ``metrics.json``; ``null`` values come back as ``nan``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}; run `wsi-pipeline eval` first")
    recs = validate_records(json.loads(path.read_text()), source=str(path))
    return [MetricRecord(**{**r, "value": math.nan if r["value"] is None else float(r["value"])}) for r in recs]
