"""Everything a pathologist opens for one slide: heatmap PNG, per-tile scores CSV and QuPath GeoJSON.

Files, in ``out_dir``: ``<slide_id>.png`` (attention over the thumbnail), ``<slide_id>_scores.csv``
(:mod:`wsi_pipeline.export.scores`), ``<slide_id>.geojson`` (:mod:`wsi_pipeline.export.geojson`,
measurements ``attention``, ``attention_rank`` and ``score_<c>`` when available).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wsi_pipeline.export.geojson import write_geojson
from wsi_pipeline.export.heatmap import render_heatmap, save_png
from wsi_pipeline.export.scores import tile_scores_frame, write_tile_scores
from wsi_pipeline.slide_ids import slide_output_path

__all__ = ["SlideOutputs", "write_slide_outputs"]


@dataclass(frozen=True)
class SlideOutputs:
    png: Path
    scores: Path
    geojson: Path


def write_slide_outputs(
    out_dir: str | os.PathLike,
    slide_id: str,
    *,
    thumbnail: np.ndarray,
    level0_size: tuple[int, int],
    coords: np.ndarray,
    grid: np.ndarray,
    tile_extent: float,
    attention: np.ndarray,
    instance_scores: np.ndarray | None = None,
    mode: str = "rank",
    title: str | None = None,
    outline: np.ndarray | None = None,
) -> SlideOutputs:
    """Write the three per-slide files (see the module docstring) and return their paths.

    ``coords`` (N, 2) level-0 px, ``grid`` (N, 2) (col, row), ``tile_extent`` level-0 px,
    ``attention`` (N,), ``instance_scores`` (N, C) or None, ``thumbnail`` uint8 (h, w, 3) of a
    level 0 of ``level0_size`` (W, H) px; ``outline`` an optional bool (h, w) ground-truth mask
    on the thumbnail's grid, drawn as an outline on the PNG.
    """
    out = Path(out_dir)
    df = tile_scores_frame(coords, grid, tile_extent, attention, instance_scores)
    scores = write_tile_scores(slide_output_path(out, slide_id, "_scores.csv"), df)
    meas = {c: df[c].to_numpy() for c in df.columns if c in ("attention", "attention_rank") or c.startswith("score_")}
    geo = write_geojson(slide_output_path(out, slide_id, ".geojson"), coords, tile_extent, meas)
    img = render_heatmap(thumbnail, coords, tile_extent, attention, level0_size=level0_size, mode=mode, title=title,
                         outline=outline)
    png = save_png(slide_output_path(out, slide_id, ".png"), img)
    return SlideOutputs(png=png, scores=scores, geojson=geo)
