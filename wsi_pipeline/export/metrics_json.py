"""``metrics.json``: tidy metric records, one value per record.

Schema::

    {"records": [{"method": str, "seed": int | "mean" | "std", "cohort": str,
                  "split": "test" | "external" | ..., "protocol": "all" | "sub256x100" | "ens256x100" | ...,
                  "metric": str, "value": float | null[, "repeat": int]}, ...]}

Per-seed records (no ``repeat`` key) carry the model's metrics:

- ``all``: computed on the all-tiles slide probabilities;
- ``sub<k>x<R>`` (the papers' protocol): the mean over the R repeats of the metric computed on
  each repeat's slide predictions; beside it ``<metric>_repeat_std`` (sample std over repeats)
  and ``n_repeats``; and one record per repeat and metric with ``"repeat": r`` (0-based) holding
  that repeat's value;
- ``ens<k>x<R>``: computed on the slide probabilities averaged over the R repeats.

Records with seed ``"mean"`` and ``"std"`` aggregate the per-seed values (not the per-repeat
ones) of one (method, cohort, split, protocol, metric) with
:func:`~wsi_pipeline.tasks.metrics.mean_std` (sample std; ``null`` with one seed): for
``sub<k>x<R>`` the mean +- std over seeds of the per-seed repeat means, as the papers' tables.
Undefined values (``nan``) are written as ``null``, which keeps the file strict JSON. To read the
headline numbers, take the records without a ``repeat`` key.
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

from wsi_pipeline.io_atomic import write_text_atomic

__all__ = [
    "RECORD_KEYS",
    "MetricRecord",
    "aggregate_seeds",
    "write_metrics_json",
    "read_metrics_json",
    "validate_records",
    "summary_table",
]

RECORD_KEYS: tuple[str, ...] = ("method", "seed", "cohort", "split", "protocol", "metric", "value")
#: Optional key of per-repeat records (the repeat's 0-based index).
REPEAT_KEY = "repeat"
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
    repeat: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["repeat"] is None:
            del d["repeat"]  # headline records keep the seven keys
        else:
            d["repeat"] = int(d["repeat"])
        v = d["value"]
        d["value"] = None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        if isinstance(d["seed"], (np.integer,)):
            d["seed"] = int(d["seed"])
        return d


def aggregate_seeds(records: Iterable[MetricRecord]) -> list[MetricRecord]:
    """Mean and std over seeds of every (method, cohort, split, protocol, metric) group.

    Records that already have seed ``"mean"``/``"std"`` and per-repeat records are left out of
    the groups. Returns the new aggregate records only (two per group).
    """
    from wsi_pipeline.tasks.metrics import mean_std

    groups: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    for r in records:
        if r.seed in AGGREGATE_SEEDS or r.repeat is not None:
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
        if not isinstance(r, Mapping) or set(r) - {REPEAT_KEY} != set(RECORD_KEYS):
            raise ValueError(
                f"{source}: record {i} must have exactly the keys {list(RECORD_KEYS)} (and optionally "
                f"{REPEAT_KEY!r}); got {r!r}"
            )
        if REPEAT_KEY in r and (not isinstance(r[REPEAT_KEY], int) or isinstance(r[REPEAT_KEY], bool) or r[REPEAT_KEY] < 0):
            raise ValueError(f"{source}: record {i} repeat must be a non-negative integer; got {r[REPEAT_KEY]!r}")
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
    return write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def read_metrics_json(path: str | os.PathLike) -> list[MetricRecord]:
    """Read and validate ``metrics.json``; ``null`` values come back as ``nan``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}; run `wsi-pipeline eval` first")
    recs = validate_records(json.loads(path.read_text()), source=str(path))
    return [MetricRecord(**{**r, "value": math.nan if r["value"] is None else float(r["value"])}) for r in recs]


def summary_table(records: Iterable[MetricRecord], metrics: Iterable[str] = ("auc", "accuracy"), *, digits: int = 3) -> Any:
    """Method x (cohort, protocol, metric) table of ``"mean ± std"`` strings over seeds (headline records).

    Each cell is the seed mean of the metric (for ``sub<k>x<R>``: of the per-seed repeat means) and,
    with two or more seeds, ``± sample std`` over seeds; ``-`` where undefined. Ask for
    ``<metric>_repeat_std`` to show the (seed-mean) std over repeats of the per-repeat protocols.
    Returns a pandas DataFrame (index ``method``; columns ``cohort, protocol, metric``).
    """
    import pandas as pd

    wanted = list(metrics)
    recs = [r for r in records if r.repeat is None and r.metric in wanted]
    look = {(r.method, r.seed, r.cohort, r.protocol, r.metric): r.value for r in recs}

    def cell(mean: float | None, std: float | None) -> str:
        if mean is None or math.isnan(mean):
            return "-"
        txt = f"{mean:.{digits}f}"
        return txt if std is None or math.isnan(std) else f"{txt} ± {std:.{digits}f}"

    rows: dict[str, dict[tuple[str, str, str], str]] = defaultdict(dict)
    for r in recs:
        if r.seed == "mean":
            std = look.get((r.method, "std", r.cohort, r.protocol, r.metric))
            rows[r.method][(r.cohort, r.protocol, r.metric)] = cell(r.value, std)
    cols = sorted({c for v in rows.values() for c in v}, key=lambda c: (c[0], c[1], wanted.index(c[2])))
    table = pd.DataFrame([[rows[m].get(c, "") for c in cols] for m in rows], index=pd.Index(list(rows), name="method"),
                         columns=pd.MultiIndex.from_tuples(cols, names=["cohort", "protocol", "metric"]) if cols else None)
    return table
