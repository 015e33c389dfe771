"""Tile scores as GeoJSON for QuPath: one closed square polygon per tile, in level-0 px.

The file is a ``FeatureCollection``; each feature has a ``Polygon`` geometry (exterior ring of
five points, first = last: top-left, top-right, bottom-right, bottom-left, top-left) and
``properties`` ``{"objectType": "detection", "name": "tile <i>", "measurements": {name: value}}``,
the form QuPath (>= 0.4) reads with File > Import objects; detections keep 100 000 tiles
responsive in QuPath, where annotations would not. Measurements QuPath cannot hold (nan) are
left out of that tile's dict.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from wsi_pipeline.io_atomic import atomic_path

__all__ = ["tile_feature", "write_geojson"]

OBJECT_TYPES = ("detection", "annotation", "tile")


def _num(v: float) -> int | float:
    f = float(v)
    return int(f) if f.is_integer() else round(f, 3)


def tile_feature(
    x: float, y: float, extent: float, measurements: Mapping[str, float], *, object_type: str = "detection", name: str | None = None
) -> dict:
    """One GeoJSON feature: the square ``[x, x + extent] x [y, y + extent]`` (level-0 px)."""
    x0, y0, x1, y1 = _num(x), _num(y), _num(x + extent), _num(y + extent)
    ring = [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]
    props: dict = {"objectType": object_type}
    if name is not None:
        props["name"] = name
    props["measurements"] = {k: float(v) for k, v in measurements.items() if not math.isnan(float(v))}
    return {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [ring]}, "properties": props}


def write_geojson(
    path: str | os.PathLike,
    coords: np.ndarray,
    tile_extent: float,
    measurements: Mapping[str, np.ndarray],
    *,
    object_type: str = "detection",
) -> Path:
    """Write one feature per tile, atomically.

    Parameters
    ----------
    coords : (N, 2) tile top-left (x, y) in level-0 px.
    tile_extent : tile side in level-0 px.
    measurements : name -> (N,) values (e.g. ``attention``, ``attention_rank``, ``prob_1``).
    object_type : ``"detection"`` (default), ``"annotation"`` or ``"tile"``.
    """
    if object_type not in OBJECT_TYPES:
        raise ValueError(f"object_type={object_type!r}; choose one of {list(OBJECT_TYPES)}")
    c = np.asarray(coords).reshape(-1, 2)
    cols = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in measurements.items()}
    for k, v in cols.items():
        if len(v) != len(c):
            raise ValueError(f"measurement {k!r} has {len(v)} values for {len(c)} tiles; give one per tile")
    names = list(cols)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write('{"type": "FeatureCollection", "features": [\n')
        for i in range(len(c)):
            feat = tile_feature(c[i, 0], c[i, 1], tile_extent, {k: cols[k][i] for k in names}, object_type=object_type, name=f"tile {i}")
            f.write(("," if i else "") + json.dumps(feat, separators=(",", ":"), allow_nan=False) + "\n")
        f.write("]}\n")
    return Path(path)
