"""The earlier results of methods an ``eval`` of named methods does not score (``eval.methods``).

``wsi-pipeline eval --method A`` scores method A only. The results folder it writes must not lose
what an earlier ``eval`` wrote for the pipeline's other methods: their rows of every
``predictions_<cohort>_<protocol>.csv``, their records of ``metrics.json`` and their rows of
``stain.csv`` are read before any slide is scored (a damaged file stops the run then, naming
itself) and written back beside A's new results; a warning names any of their runs finished
after that earlier ``eval`` (:func:`retrained_since`: evaluate those methods again). The seed mean
and std of the kept per-seed records are recomputed when ``metrics.json`` is written (the same
values); bootstrap intervals (seed ``"mean"``, ``<metric>_ci_low`` / ``_ci_high``) are kept as
they are. An ``eval`` of every method writes the folder afresh.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.export.metrics_json import AGGREGATE_SEEDS, MetricRecord, read_metrics_json
from wsi_pipeline.export.predictions import read_predictions

__all__ = ["EarlierResults", "earlier_results", "retrained_since"]


@dataclass
class EarlierResults:
    """The kept results: prediction rows per (cohort, protocol), metric records, stain rows per (method, slide)."""

    rows: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    records: list[MetricRecord] = field(default_factory=list)
    stain: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        """The methods whose results are kept, sorted."""
        names = {r["method"] for rows in self.rows.values() for r in rows} | {r.method for r in self.records}
        return sorted(names | {m for m, _ in self.stain})


def _plain(value: Any) -> Any:
    """A CSV cell as the evaluation's rows hold it: missing (NaN, ``pd.NA``) as ``None``."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    return value


def _seed(value: Any) -> int | str:
    """A predictions file's ``seed`` cell as the evaluation's rows hold it: a training seed as an int, else text."""
    text = "" if value is None else str(value)
    return int(text) if text.lstrip("-").isdigit() else text


def earlier_results(results_dir: str | Path, scored: Collection[str]) -> EarlierResults:
    """The results in ``results_dir`` of every method not in ``scored`` (nothing when the folder is new).

    Raises
    ------
    ValueError : an earlier ``metrics.json`` does not follow its schema (naming the file).
    """
    out, kept = Path(results_dir), EarlierResults()
    for path in sorted(out.glob("predictions_*_*.csv")):
        old = read_predictions(path)
        old = old[~old["method"].isin(list(scored))]
        for row in old.astype(object).to_dict("records"):
            row = {k: _plain(v) for k, v in row.items()}
            row["seed"] = _seed(row.get("seed"))
            kept.rows[(str(row["cohort"]), str(row["protocol"]))].append(row)
    metrics = out / "metrics.json"
    if metrics.is_file():
        old_records = [r for r in read_metrics_json(metrics) if r.method not in scored]
        per_seed = {(r.method, r.cohort, r.split, r.protocol, r.metric) for r in old_records
                    if r.seed not in AGGREGATE_SEEDS and r.repeat is None}
        kept.records = [r for r in old_records
                        if not (r.seed in AGGREGATE_SEEDS and (r.method, r.cohort, r.split, r.protocol, r.metric) in per_seed)]
    stain = out / "stain.csv"
    if stain.is_file():
        table = pd.read_csv(stain, dtype={"method": "string", "slide_id": "string", "cohort": "string"})
        for row in table[~table["method"].isin(list(scored))].astype(object).to_dict("records"):
            row = {k: _plain(v) for k, v in row.items()}
            kept.stain[(str(row["method"]), str(row["slide_id"]))] = row
    return kept


def retrained_since(config: PipelineConfig, results_dir: str | Path, methods: Collection[str]) -> list[str]:
    """The runs (``method seed k``) of ``methods`` finished since ``results_dir/metrics.json`` was written: their
    kept results come from the models they replaced (methods no longer in ``config`` are not checked)."""
    from wsi_pipeline.evaluation.sets import finished_since, trained_runs

    metrics = Path(results_dir) / "metrics.json"
    names = [m.name for m in config.methods if m.name in set(methods)]
    if not metrics.is_file() or not names:
        return []
    return [f"{name} seed {seed}" for name, seed in finished_since(trained_runs(config, names)[0], metrics)]
