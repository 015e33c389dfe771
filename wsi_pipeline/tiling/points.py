"""Tiles centred on given points (``tile --points``): point files in, one tile per point out.

**Point files** (:func:`read_points`), level-0 px of the full image, pixel ``i`` covering
``[i, i + 1)`` (so a point at x = 148.78 lies in pixel 148, and a point on the far border,
x = W exactly, in the last pixel W - 1; 1-based pixel indices, as MATLAB writes them, need 1
subtracted first):

- one CSV for every slide with columns ``slide_id`` (or ``image``), ``x``, ``y`` and optionally
  ``class``; rows of other slides are ignored;
- a folder of ``<slide_id>.csv`` files (``x``, ``y``, optional ``class``) or ``<slide_id>.geojson``
  (or ``.json``) files: QuPath detections or annotations exported as GeoJSON; a ``Point`` or
  ``MultiPoint`` gives its points, a ``Polygon``/``MultiPolygon`` (a detected cell's outline) its
  area centroid; the class is ``properties.classification.name``.

**Tiles** (:func:`point_origins`): a tile of T px is cut around each point's pixel ``(px, py)``
with its top-left corner at ``(px - T // 2, py - T // 2)``, so the point's pixel is the tile's pixel
``(T // 2, T // 2)`` (the centre for odd T such as 27; for even T the first pixel right and below
the centre). Tiles are read at level 0 (native resolution). At the image edge (``edge``):

- ``"pad"`` (the default): the part outside the image is filled with the slide's glass colour as
  its reader gives it (:attr:`~wsi_pipeline.slides.base.Slide.background`: white unless the slide
  says otherwise), so every point inside the image gets its tile;
- ``"skip"``: tiles that do not lie wholly inside the image are left out and counted.

A point outside the image is always left out and counted. The store's ``grid`` is the cell of
the slide's T-px tile grid holding the point's pixel, ``(px // T, py // T)`` (several points may
share a cell); ``coords`` the tiles' top-left corners (negative at the top/left edge with ``pad``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.config.choices import POINT_EDGES
from wsi_pipeline.tiling.regions import GEOJSON_SUFFIXES, classification_of, geojson_features

__all__ = [
    "PointTiles", "Points", "check_points", "class_codes", "describe_points", "mask_fraction", "point_origins", "points_file", "points_sha256",
    "read_points",
]

_ID_COLUMNS = ("slide_id", "image")
#: Largest GeoJSON points file read, bytes (as a regions file).
MAX_POINTS_BYTES = 512 << 20


@dataclass(frozen=True)
class Points:
    """A slide's points: ``xy`` float64 (n, 2) level-0 px, ``classes`` the class name of each ("" when none), ``file``."""

    xy: np.ndarray
    classes: list[str]
    file: str


@dataclass(frozen=True)
class PointTiles:
    """Where a slide's point tiles go (:func:`point_origins`).

    Attributes
    ----------
    index : int64 (k,) rows of :class:`Points` that get a tile, in file order.
    origins : int64 (k, 2) level-0 (x, y) of each tile's top-left corner.
    grid : int32 (k, 2) (col, row) of the T-px grid cell holding each point.
    n_outside : points outside the image (never tiled).
    n_edge_skipped : points inside the image whose tile crosses its edge, left out (``edge="skip"``).
    n_padded : tiles that cross the edge and were padded (``edge="pad"``).
    """

    index: np.ndarray
    origins: np.ndarray
    grid: np.ndarray
    n_outside: int
    n_edge_skipped: int
    n_padded: int


def points_file(points: str | os.PathLike, slide_id: str) -> Path:
    """The points file of ``slide_id``: ``points`` itself when it is a file, else ``<points>/<slide_id>.csv``
    (or ``.geojson``, ``.json``); FileNotFoundError naming what was looked for."""
    p = Path(points)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"points: {p} is neither a points file (CSV slide_id,x,y[,class]) nor a folder of "
                                "<slide_id>.csv / <slide_id>.geojson files")
    for suffix in (".csv",) + GEOJSON_SUFFIXES:
        f = p / f"{slide_id}{suffix}"
        if f.is_file():
            return f
    raise FileNotFoundError(f"points: no {p / (slide_id + '.csv')} (nor .geojson, .json) for slide {slide_id!r}; "
                            "add its points or leave the slide out of this run")


def points_sha256(points: str | os.PathLike, slide_id: str) -> str | None:
    """sha256 of the slide's points file (a shared CSV: of its whole content), None when it has none."""
    try:
        return hashlib.sha256(points_file(points, slide_id).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_points(points: str | os.PathLike, slide_id: str) -> Points:
    """The points of ``slide_id`` (module docstring for the file layouts).

    Raises
    ------
    FileNotFoundError : no points file for the slide.
    ValueError : a file that is not a points file (missing columns, non-numeric or non-finite
        coordinates, malformed GeoJSON), naming the file, the row or feature and the value.
    """
    path = points_file(points, slide_id)
    shared = Path(points).is_file()
    if path.suffix.lower() == ".csv":
        df = _points_table(path, shared)
        if _id_column(df) is not None:
            df = df[df[_id_column(df)] == slide_id]
        xy = df[["x", "y"]].to_numpy(np.float64).reshape(-1, 2)
        return Points(xy, df["class"].tolist(), str(path))
    return _read_geojson(path)


def check_points(points: str | os.PathLike, slide_ids: Sequence[str]) -> None:
    """Read every points file the slides ``slide_ids`` will use, once, before any slide is tiled.

    ``points`` itself must exist (a CSV for every slide, or a folder); a shared CSV is read whole (its
    ``slide_id`` column, every row's coordinates); in a folder, each slide's file that is there is read
    (a slide without one fails alone when it is tiled, :func:`points_file`).

    Raises
    ------
    FileNotFoundError : ``points`` is neither a file nor a folder.
    ValueError : the first file that is not a points file, naming it and the row or feature (:func:`read_points`).
    """
    p = Path(points)
    if p.is_file():
        if p.suffix.lower() == ".csv":
            _points_table(p, shared=True)
        else:
            _read_geojson(p)
        return
    if not p.is_dir():
        found = "is neither a regular file nor a folder" if p.exists() else "not found"
        raise FileNotFoundError(f"points: {p} {found}; expected a points file (CSV slide_id,x,y[,class]) or a folder "
                                "of <slide_id>.csv / <slide_id>.geojson files")
    for sid in slide_ids:
        try:
            points_file(p, sid)
        except FileNotFoundError:
            continue  # this slide fails alone, naming the file it looked for
        read_points(p, sid)


def _id_column(df: Any) -> str | None:
    return next((c for c in _ID_COLUMNS if c in df.columns), None)


def _points_table(path: Path, shared: bool) -> Any:
    """The checked table of a points CSV: columns ``x``, ``y`` (float64, finite), ``class`` (str) and the id
    column when there is one (stripped); read once per file version (size, modification time)."""
    st = path.stat()
    return _points_table_cached(str(path), shared, st.st_size, st.st_mtime_ns).copy()


@functools.lru_cache(maxsize=4)
def _points_table_cached(path_text: str, shared: bool, size: int, mtime_ns: int) -> Any:
    import pandas as pd

    path = Path(path_text)
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise ValueError(f"points file {path} is not a readable CSV: {err}") from err
    df.columns = [str(c).strip().lower() for c in df.columns]
    id_col = _id_column(df)
    need = ["x", "y"] + (["slide_id"] if shared and id_col is None else [])
    missing = [c for c in need if c not in df.columns]
    if missing:
        layout = "slide_id,x,y[,class]" if shared else "x,y[,class] (one file per slide)"
        raise ValueError(f"points file {path}: no column(s) {missing}; found {list(df.columns)}, expected {layout}")
    out = pd.DataFrame(index=df.index)
    if id_col is not None:
        out[id_col] = df[id_col].str.strip()
    for axis in ("x", "y"):
        values = pd.to_numeric(df[axis].str.strip(), errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"points file {path}: row {int(df.index[i]) + 2} has {axis}={df[axis].iloc[i]!r}; "
                             "expected a number of level-0 px")
        out[axis] = values
    out["class"] = [c.strip() for c in df["class"]] if "class" in df.columns else [""] * len(df)
    return out


def _feature_points(feat: Any) -> list[tuple[float, float]]:
    """The points of one GeoJSON feature (module docstring); ValueError saying what is wrong with it."""
    from shapely.errors import ShapelyError
    from shapely.geometry import shape

    if not isinstance(feat, dict):
        raise ValueError(f"is a {type(feat).__name__} ({str(feat)[:40]!r}), not a GeoJSON Feature")
    geom = feat.get("geometry")
    if not isinstance(geom, dict):
        raise ValueError(f"its geometry is a {type(geom).__name__} ({str(geom)[:40]!r}), expected a GeoJSON geometry")
    if not isinstance(feat.get("properties") or {}, dict):
        raise ValueError(f"its properties are a {type(feat['properties']).__name__}, expected an object")
    kind = geom.get("type")
    try:
        if kind == "Point":
            found = [tuple(geom["coordinates"][:2])]
        elif kind == "MultiPoint":
            found = [tuple(c[:2]) for c in geom["coordinates"]]
        elif kind in ("Polygon", "MultiPolygon"):
            c = shape(geom).centroid
            if c.is_empty:
                raise ValueError(f"an empty {kind} (no area, no centroid)")
            found = [(c.x, c.y)]
        else:
            raise ValueError(f"a {kind!r} geometry (expected Point, MultiPoint, Polygon or MultiPolygon)")
        pts = [(float(x), float(y)) for x, y in found]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ShapelyError) as err:
        raise ValueError(str(err) or type(err).__name__) from err
    if not all(math.isfinite(v) for p in pts for v in p):
        raise ValueError(f"has non-finite coordinates {pts[:3]}")
    return pts


def _read_geojson(path: Path) -> Points:
    size = path.stat().st_size
    if size > MAX_POINTS_BYTES:
        raise ValueError(f"points file {path}: {size} bytes, more than the {MAX_POINTS_BYTES} bytes a points file may have")
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"points file {path} is not readable JSON: {err}") from err
    except RecursionError:
        raise ValueError(f"points file {path} is nested deeper than the JSON parser follows; expected GeoJSON") from None
    xy: list[tuple[float, float]] = []
    classes: list[str] = []
    for i, feat in enumerate(geojson_features(obj, path, what="points")):
        try:
            pts = _feature_points(feat)
        except ValueError as err:
            raise ValueError(f"points file {path}: feature {i}: {err}") from err
        cls = classification_of(feat.get("properties") or {})
        xy.extend(pts)
        classes.extend([cls] * len(pts))
    return Points(np.asarray(xy, np.float64).reshape(-1, 2), classes, str(path))


def point_origins(xy: np.ndarray, tile_size: int, dimensions: tuple[int, int], edge: str = "pad") -> PointTiles:
    """Tile origins of points ``xy`` (level-0 px) on an image of ``dimensions`` (W, H) px (module docstring).

    Parameters
    ----------
    xy : float (n, 2) level-0 px.
    tile_size : T, tile side in px (odd or even).
    dimensions : (width, height) of level 0.
    edge : ``"pad"`` or ``"skip"`` (:data:`POINT_EDGES`).
    """
    if edge not in POINT_EDGES:
        raise ValueError(f"points edge={edge!r}; expected one of {POINT_EDGES}")
    T = int(tile_size)
    W, H = int(dimensions[0]), int(dimensions[1])
    xy = np.asarray(xy, np.float64).reshape(-1, 2)
    # points far outside the image (1e300 px) stay outside without an overflowing cast to int64
    pix = np.floor(np.clip(xy, -1.0, [W + 1.0, H + 1.0])).astype(np.int64)
    pix[:, 0][xy[:, 0] == W] = W - 1  # on the far border: the last pixel
    pix[:, 1][xy[:, 1] == H] = H - 1
    inside_image = (pix[:, 0] >= 0) & (pix[:, 1] >= 0) & (pix[:, 0] < W) & (pix[:, 1] < H)
    origins = pix - T // 2
    whole = (origins[:, 0] >= 0) & (origins[:, 1] >= 0) & (origins[:, 0] + T <= W) & (origins[:, 1] + T <= H)
    keep = inside_image & (whole if edge == "skip" else True)
    index = np.flatnonzero(keep)
    return PointTiles(
        index=index.astype(np.int64), origins=origins[index], grid=(pix[index] // T).astype(np.int32),
        n_outside=int((~inside_image).sum()), n_edge_skipped=int((inside_image & ~whole).sum()) if edge == "skip" else 0,
        n_padded=int((inside_image & ~whole).sum()) if edge == "pad" else 0,
    )


def class_codes(classes: list[str]) -> tuple[np.ndarray, list[str]]:
    """``(codes int16 (n,), names)``: each class's index into the sorted distinct non-empty names, -1 for ""."""
    names = sorted({c for c in classes if c})
    lookup = {c: i for i, c in enumerate(names)}
    return np.asarray([lookup.get(c, -1) for c in classes], np.int16), names


def describe_points(points: Points, tiles: PointTiles, edge: str, filtered: int, keep_all: bool) -> dict[str, Any]:
    """The store attribute ``points``: file, counts and rules."""
    return {
        "file": points.file, "n_points": int(len(points.xy)), "n_outside": tiles.n_outside,
        "n_edge_skipped": tiles.n_edge_skipped, "n_padded": tiles.n_padded, "n_filtered": int(filtered), "edge": edge,
        "filter": not keep_all, "centre_pixel": "tile px (T // 2, T // 2) is the point's pixel (floor(x), floor(y))",
    }


def mask_fraction(mask: np.ndarray, downsample: float, origins: np.ndarray, tile_size: int) -> np.ndarray:
    """Fraction of each tile's footprint covered by a tissue ``mask`` (``downsample`` level-0 px per mask px).

    A tile with top-left ``origins[i]`` (level-0 px) and side ``tile_size`` covers the mask pixels
    ``floor(x / d) .. ceil((x + T) / d)`` (at least one, the one under its corner); the part outside
    the mask (outside the image) counts as no tissue. Returns float32 (k,).
    """
    h, w = mask.shape[:2]
    out = np.zeros(len(origins), np.float32)
    d = float(downsample)
    for i, (x, y) in enumerate(np.asarray(origins, np.int64).reshape(-1, 2)):
        x0, y0 = math.floor(x / d), math.floor(y / d)
        x1, y1 = max(x0 + 1, math.ceil((x + tile_size) / d)), max(y0 + 1, math.ceil((y + tile_size) / d))
        area = (x1 - x0) * (y1 - y0)
        cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
        if cx1 > cx0 and cy1 > cy0:
            out[i] = float(np.count_nonzero(mask[cy0:cy1, cx0:cx1])) / area
    return out
