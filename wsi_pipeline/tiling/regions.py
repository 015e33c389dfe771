"""Annotations as regions: QuPath GeoJSON in, tile fractions and labels out; tissue contours as GeoJSON.

**Reading** (:func:`read_regions`): a QuPath export (File > Export objects as GeoJSON): a
``FeatureCollection``, a list of features or one feature; ``Polygon`` and ``MultiPolygon``
geometries (holes are interior rings) in level-0 px of the full image; the class is
``properties.classification.name`` (unclassified: ``""``). Other geometries (points, lines) hold
no area and are skipped (counted in the info). Invalid rings (self-intersecting) are repaired
with ``shapely.make_valid``.

**Selection** (:func:`region_tiles`): regions whose class matches an ``exclude`` pattern remove
area; the others matching ``include`` (every one when ``include`` is empty) add it. A tile's
``region_fraction`` is the exact area of its footprint inside (included minus excluded) over its
area (shapely); its ``region_label`` is the included class covering most of it (-1: none). When
no region is included and ``include`` is empty, the whole slide is included (a file of exclusions
only). Patterns are shell-style (``Ignore*``), case-insensitive.

**Contours** (:func:`write_tissue_geojson`): the tiler's tissue mask traced with OpenCV
(``RETR_CCOMP``: outer boundaries and their holes) and written as QuPath annotations of class
``Tissue``, one per connected piece, in level-0 px (the boundary runs through the mask's edge pixel
centres, so it is within half a mask pixel of the mask's edge).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["GEOJSON_SUFFIXES", "Region", "RegionTiles", "classification_of", "geojson_features", "read_regions", "region_file", "region_tiles", "write_region_csv",
           "write_tissue_geojson"]

#: Endings of a slide's regions file inside a regions folder, tried in order.
GEOJSON_SUFFIXES: tuple[str, ...] = (".geojson", ".json")


@dataclass(frozen=True)
class Region:
    """One annotated area: its class name, its name, and its shapely geometry (level-0 px)."""

    classification: str
    name: str
    geometry: Any


@dataclass
class RegionTiles:
    """Per grid tile (rows, cols): fraction inside the included area and the majority class.

    Attributes
    ----------
    fraction : float32 (rows, cols).
    label : int16 (rows, cols) index into ``classes``, -1 when no included region covers the tile.
    classes : the included classes' names.
    info : file, patterns and counts (store attribute ``regions``).
    """

    fraction: np.ndarray
    label: np.ndarray
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)


def region_file(regions: str | os.PathLike, slide_id: str) -> Path:
    """The regions file of ``slide_id``: ``regions`` itself when it is a file, else
    ``<regions>/<slide_id>.geojson`` (or ``.json``); FileNotFoundError naming what was looked for."""
    p = Path(regions)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"regions: {p} is neither a GeoJSON file nor a folder of <slide_id>.geojson files")
    for suffix in GEOJSON_SUFFIXES:
        f = p / f"{slide_id}{suffix}"
        if f.is_file():
            return f
    raise FileNotFoundError(f"regions: no {p / (slide_id + '.geojson')} (nor .json) for slide {slide_id!r}; "
                            "add its annotations or leave the slide out of this run")


def geojson_features(obj: Any, path: Path, what: str = "regions") -> list[dict[str, Any]]:
    """The features of a parsed GeoJSON document (a FeatureCollection, a list of features, one feature or
    one bare geometry); ValueError naming ``path`` (a ``what`` file) for anything else."""
    if isinstance(obj, list):
        return [f for f in obj if isinstance(f, dict)]
    if isinstance(obj, dict) and obj.get("type") == "FeatureCollection":
        return list(obj.get("features") or [])
    if isinstance(obj, dict) and obj.get("type") == "Feature":
        return [obj]
    if isinstance(obj, dict) and obj.get("type") in ("Polygon", "MultiPolygon", "Point", "MultiPoint"):
        return [{"type": "Feature", "geometry": obj, "properties": {}}]
    raise ValueError(f"{what} file {path}: expected a GeoJSON FeatureCollection, Feature or list of features "
                     f"(QuPath: File > Export objects as GeoJSON), got {type(obj).__name__} {str(obj)[:80]!r}")


def classification_of(properties: dict[str, Any]) -> str:
    """A QuPath feature's class name: ``properties.classification.name`` (older exports: a string); "" when unclassified."""
    cls = properties.get("classification") or {}
    name = cls.get("name", "") if isinstance(cls, dict) else str(cls)
    return str(name or "")


def read_regions(path: str | os.PathLike) -> tuple[list[Region], dict[str, int]]:
    """The areal regions of a QuPath GeoJSON file and counts (``regions``, ``skipped`` non-areal features)."""
    import shapely
    from shapely.geometry import shape

    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"regions file {path} is not readable JSON: {err}") from err
    out: list[Region] = []
    skipped = 0
    for i, feat in enumerate(geojson_features(obj, path)):
        geom = feat.get("geometry") or {}
        if geom.get("type") not in ("Polygon", "MultiPolygon"):
            skipped += 1
            continue
        try:
            g = shape(geom)
        except (ValueError, TypeError, AttributeError, IndexError) as err:
            raise ValueError(f"regions file {path}: feature {i} has a malformed {geom.get('type')}: {err}") from err
        if not g.is_valid:
            g = shapely.make_valid(g)
        props = feat.get("properties") or {}
        out.append(Region(classification_of(props), str(props.get("name") or ""), g))
    return out, {"regions": len(out), "skipped": skipped}


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name.lower(), p.lower()) for p in patterns)


def _union(geoms: list[Any]) -> Any:
    import shapely

    return shapely.union_all(geoms) if geoms else None


def region_tiles(
    regions: list[Region], origins: np.ndarray, extent: float, *, include: Sequence[str] = (), exclude: Sequence[str] = (),
) -> tuple[np.ndarray, np.ndarray, list[str], dict[str, Any]]:
    """Fractions and labels of tiles (module docstring).

    Parameters
    ----------
    regions : from :func:`read_regions`.
    origins : (k, 2) level-0 (x, y) of the tiles' top-left corners.
    extent : tile side in level-0 px.
    include, exclude : class-name patterns.

    Returns
    -------
    (fraction float32 (k,), label int16 (k,), included class names, counts).
    """
    import shapely

    excl = [r for r in regions if _matches(r.classification, exclude)]
    incl = [r for r in regions if r not in excl and (not include or _matches(r.classification, include))]
    classes = sorted({r.classification for r in incl})
    xy = np.asarray(origins, np.float64).reshape(-1, 2)
    boxes = shapely.box(xy[:, 0], xy[:, 1], xy[:, 0] + extent, xy[:, 1] + extent)
    area = float(extent) ** 2
    ex = _union([r.geometry for r in excl])
    if incl:
        inside = _union([r.geometry for r in incl])
    elif not include:
        inside = shapely.box(float(xy[:, 0].min(initial=0)), float(xy[:, 1].min(initial=0)),
                             float(xy[:, 0].max(initial=0) + extent), float(xy[:, 1].max(initial=0) + extent))
    else:
        inside = None
    frac = np.zeros(len(xy), np.float32)
    if inside is not None and len(xy):
        keep_area = inside if ex is None else shapely.difference(inside, ex)
        shapely.prepare(keep_area)
        hit = shapely.intersects(boxes, keep_area)
        if hit.any():
            frac[hit] = shapely.area(shapely.intersection(boxes[hit], keep_area)) / area
    label = np.full(len(xy), -1, np.int16)
    if classes and len(xy):
        best = np.zeros(len(xy))
        for ci, name in enumerate(classes):
            g = _union([r.geometry for r in incl if r.classification == name])
            if ex is not None:
                g = shapely.difference(g, ex)
            a = shapely.area(shapely.intersection(boxes, g)) / area
            better = a > best
            label[better], best[better] = ci, a[better]
    info = {"included_regions": len(incl), "excluded_regions": len(excl), "include": list(include), "exclude": list(exclude)}
    return np.clip(frac, 0.0, 1.0), label, classes, info


def write_region_csv(path: str | os.PathLike, coords: np.ndarray, fraction: np.ndarray, label: np.ndarray, classes: list[str]) -> Path:
    """Per stored tile (in store order): ``tile, x, y, region_fraction, region_label`` (class name, empty: none); atomic."""
    lines = ["tile,x,y,region_fraction,region_label"]
    for i, ((x, y), f, lab) in enumerate(zip(np.asarray(coords).reshape(-1, 2), fraction, label)):
        name = classes[int(lab)] if lab >= 0 else ""
        name = '"' + name.replace('"', '""') + '"' if ("," in name or '"' in name) else name
        lines.append(f"{i},{int(x)},{int(y)},{float(f):.6g},{name}")
    write_text_atomic(Path(path), "\n".join(lines) + "\n")
    return Path(path)


def write_tissue_geojson(path: str | os.PathLike, mask: np.ndarray, downsample: float, *, name: str = "tissue",
                         colour: tuple[int, int, int] = (0, 170, 0)) -> Path:
    """Write a tissue mask's contours as QuPath annotations (class ``Tissue``), level-0 px; atomic.

    Parameters
    ----------
    mask : bool (H, W); pixel (i, j) covers level-0 [j*d, (j+1)*d) x [i*d, (i+1)*d).
    downsample : d, level-0 px per mask px.
    """
    import cv2

    m = np.ascontiguousarray(mask, np.uint8)
    contours, hierarchy = cv2.findContours(m, cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
    d = float(downsample)

    def ring(c: np.ndarray) -> list[list[float]]:
        pts = [[round((float(x) + 0.5) * d, 2), round((float(y) + 0.5) * d, 2)] for x, y in c.reshape(-1, 2)]
        return pts + [pts[0]]

    feats = []
    if hierarchy is not None:
        hier = hierarchy[0]
        for i, c in enumerate(contours):
            if hier[i][3] != -1 or len(c) < 3:  # holes are added to their outer ring below
                continue
            rings = [ring(c)]
            child = hier[i][2]
            while child != -1:
                if len(contours[child]) >= 3:
                    rings.append(ring(contours[child]))
                child = hier[child][0]
            feats.append({"type": "Feature", "geometry": {"type": "Polygon", "coordinates": rings},
                          "properties": {"objectType": "annotation", "name": name,
                                         "classification": {"name": "Tissue", "color": list(colour)}}})
    write_text_atomic(Path(path), json.dumps({"type": "FeatureCollection", "features": feats}, separators=(",", ":")))
    return Path(path)
