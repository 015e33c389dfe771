"""Per-tile scores CSV ``<slide_id>_scores.csv``: where each tile is and what the model said about it.

Columns: ``tile`` (store index), ``x, y`` (top-left, level-0 px), ``size`` (tile side, level-0 px),
``col, row`` (tile grid), ``attention`` (the aggregator's score as returned), ``attention_rank``
(per-slide rank in [0, 1], 1 = highest), then ``score_0 .. score_{C-1}`` when the aggregator
provides per-tile class scores (e.g. DTFD's instance probabilities).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.export.heatmap import normalise_scores
from wsi_pipeline.io_atomic import atomic_path

__all__ = ["tile_scores_frame", "write_tile_scores"]


def tile_scores_frame(
    coords: np.ndarray,
    grid: np.ndarray,
    tile_extent: float,
    attention: np.ndarray,
    instance_scores: np.ndarray | None = None,
) -> pd.DataFrame:
    """The table described in the module docstring; ``instance_scores`` is (N, C) or None."""
    c = np.asarray(coords).reshape(-1, 2)
    g = np.asarray(grid).reshape(-1, 2)
    a = np.asarray(attention, dtype=np.float64).reshape(-1)
    if not (len(c) == len(g) == len(a)):
        raise ValueError(f"coords ({len(c)}), grid ({len(g)}) and attention ({len(a)}) must have one row per tile")
    df = pd.DataFrame(
        {
            "tile": np.arange(len(c)),
            "x": c[:, 0],
            "y": c[:, 1],
            "size": float(tile_extent),
            "col": g[:, 0],
            "row": g[:, 1],
            "attention": a,
            "attention_rank": normalise_scores(a, "rank")[0],
        }
    )
    if instance_scores is not None:
        s = np.asarray(instance_scores, dtype=np.float64)
        if s.ndim != 2 or len(s) != len(c):
            raise ValueError(f"instance_scores must be (N={len(c)}, C); got {s.shape}")
        for k in range(s.shape[1]):
            df[f"score_{k}"] = s[:, k]
    return df


def write_tile_scores(path: str | os.PathLike, df: pd.DataFrame) -> Path:
    """Write a :func:`tile_scores_frame` table atomically."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6g")
    return Path(path)
