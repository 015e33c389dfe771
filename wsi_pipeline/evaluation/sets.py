"""What the evaluation scores: the test slides and external cohorts of a manifest, and the finished runs.

- internal test set: the ``test`` slides of a training cohort (a cohort with ``train``/``val``
  slides; ``split`` recorded as ``"test"``);
- external cohort: every slide of a cohort with no ``train``/``val`` slide, whatever its split
  value (``split`` recorded as ``"external"``).

A run is finished when ``runs/<pipeline>/<method>/seed<k>/`` has ``done`` and ``best.pt``; its
``done`` record holds the best validation value training saw (:func:`validation_scores`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig
from wsi_pipeline.types import ValidationScore

__all__ = ["EXTERNAL", "EvalSet", "evaluation_sets", "finished_since", "trained_runs", "validation_scores"]

EXTERNAL = "external"


@dataclass
class EvalSet:
    """Slides scored together: one cohort, internal test split or external."""

    cohort: str
    split: str
    slides: pd.DataFrame


def evaluation_sets(manifest: pd.DataFrame) -> list[EvalSet]:
    """Split a manifest into the internal test set(s) and external cohorts (see the module docstring)."""
    cohort = manifest["cohort"].astype("string").fillna("")
    split = manifest["split"].astype("string").fillna("")
    training = set(cohort[split.isin(["train", "val"])])
    sets = []
    for c in sorted(set(cohort)):
        in_c = cohort == c
        if c in training:
            rows = manifest[in_c & (split == "test")]
            if len(rows):
                sets.append(EvalSet(c or "default", "test", rows))
        else:
            sets.append(EvalSet(c or "default", EXTERNAL, manifest[in_c]))
    return sets


def trained_runs(config: PipelineConfig, methods: Sequence[str] | None = None) -> tuple[list[tuple[MethodConfig, int, Path]], list[str]]:
    """``([(method, seed, run_dir)], [skipped reasons])`` for every finished run of the config's methods."""
    wanted = list(methods) if methods else [m.name for m in config.methods]
    known = {m.name: m for m in config.methods}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"method(s) {unknown} not in pipeline {config.name!r}; its methods: {list(known)}")
    runs, skipped = [], []
    for name in wanted:
        for seed in config.seeds:
            d = config.run_dir(name, seed)
            if (d / "done").is_file() and (d / "best.pt").is_file():
                runs.append((known[name], int(seed), d))
            elif (d / "best.pt").is_file():
                skipped.append(f"{d}: unfinished (no `done` marker); finish it with `wsi-pipeline train`")
            else:
                skipped.append(f"{d}: not trained")
    return runs, skipped


def finished_since(runs: Sequence[tuple[Any, int, Path]], path: str | Path) -> list[tuple[str, int]]:
    """``[(method, seed)]`` of the finished ``runs`` (from :func:`trained_runs`) whose ``done`` marker is not older
    than ``path`` (results written from earlier models; every run when ``path`` is missing)."""
    written = Path(path).stat().st_mtime if Path(path).is_file() else -math.inf
    return [(m.name, int(seed)) for m, seed, d in runs if (Path(d) / "done").stat().st_mtime >= written]


def validation_scores(runs: Sequence[tuple[Any, int, Path]]) -> dict[tuple[str, int], ValidationScore]:
    """``{(method, seed): (select metric, best validation value, that epoch's validation loss)}`` from
    each finished run's ``done`` record (the loss is None in records written before it was kept).

    Runs without a finite recorded value (no validation split) are left out.
    """
    out = {}
    for method, seed, run_dir in runs:
        try:
            rec = json.loads((Path(run_dir) / "done").read_text() or "{}")
        except (OSError, ValueError):
            continue
        v = rec.get("best_value") if isinstance(rec, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            loss = rec.get("best_loss")
            loss = float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None
            out[(method.name, int(seed))] = ValidationScore(str(rec.get("select_metric", "")), float(v), loss)
    return out
