"""The viewer reads only what it was given: every file it opens resolves inside a folder named on its command line.

:class:`Folders` holds those folders (``--slides``, ``--predictions``/``--results``, ``--tiles``,
``--annotations``, the manifest's folder; the page's own static files are a folder of their own). Every
file the viewer opens first goes through :meth:`Folders.check`: the path is resolved (symlinks followed,
``..`` removed) and must lie inside one of them, else :class:`OutsideFoldersError` (a ``PermissionError``, a
403 on the page) naming the file and the folders, and the file is never opened. A folder read as one (a tile
store, a DICOM slide) is checked entry by entry for links that lead out; FIFOs, devices and sockets are
refused (:class:`RefusedFileError`). This module is the viewer's
one place that resolves paths.

GeoJSON (annotations, tissue contours) is never served as its bytes: :meth:`Folders.read_geojson` reads at
most :data:`MAX_GEOJSON_BYTES`, parses it, checks it is a FeatureCollection (or a list) of Features with
finite coordinates and serves the document it rebuilt. Lesion masks are bounded by :data:`MAX_MASK_BYTES`
and :data:`MAX_MASK_PIXELS` before they are decoded (:meth:`Folders.open_mask`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_FOLDER_ENTRIES", "MAX_GEOJSON_BYTES", "MAX_MASK_BYTES", "MAX_MASK_PIXELS", "Folders", "GeoJSONError", "OutsideFoldersError",
           "RefusedFileError"]

log = logging.getLogger(__name__)

#: Largest GeoJSON file (annotations, tissue contours) the viewer parses and serves, bytes.
MAX_GEOJSON_BYTES = 64 << 20
#: Largest lesion mask file, bytes, and image, pixels (a mask is a downsampled image of the slide).
MAX_MASK_BYTES = 256 << 20
MAX_MASK_PIXELS = 1 << 28
#: Most entries in a folder read as one (a tile store's chunk files, a DICOM slide's instances) checked for links.
MAX_FOLDER_ENTRIES = 1_000_000
#: GeoJSON geometry types and how deep their coordinate arrays nest.
_DEPTH = {"Point": 1, "MultiPoint": 2, "LineString": 2, "MultiLineString": 3, "Polygon": 3, "MultiPolygon": 4}


class RefusedFileError(PermissionError):
    """A file the viewer will not open (403): outside its folders, or not a regular file or folder."""


class OutsideFoldersError(RefusedFileError):
    """A file that resolves outside the folders given to the viewer; refused, never opened (403)."""


class GeoJSONError(ValueError):
    """A GeoJSON file that is too large or is not a FeatureCollection of Features (422)."""


@dataclass(frozen=True)
class Folders:
    """The folders the viewer may read from, resolved once (:func:`Folders.of`)."""

    roots: tuple[Path, ...]

    @classmethod
    def of(cls, folders: Iterable[str | os.PathLike[str] | None]) -> Folders:
        """The folders given (None skipped), each resolved; ``FileNotFoundError`` for one that does not exist."""
        roots: list[Path] = []
        for f in folders:
            if f is None:
                continue
            real = Path(f).resolve(strict=True)
            if real not in roots:
                roots.append(real)
        return cls(tuple(roots))

    def describe(self) -> str:
        """The folders, for messages."""
        return ", ".join(str(r) for r in self.roots) or "none"

    def check(self, path: str | os.PathLike[str], what: str) -> Path:
        """The resolved ``path`` when it lies inside one of the folders.

        Raises ``FileNotFoundError`` (no such file, or a link that leads nowhere), :class:`OutsideFoldersError`
        (it resolves outside every folder) and :class:`RefusedFileError` (a FIFO, device or socket: opening one
        could block or never end), each naming ``what`` and the path as given; where a link leads is logged
        here, not told to the page."""
        given = Path(path)
        try:
            real = given.resolve(strict=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"{what} {given} not found") from None
        except (OSError, RuntimeError) as err:  # a symlink loop, a component that is not a folder
            raise FileNotFoundError(f"{what} {given} cannot be resolved ({err.__class__.__name__})") from None
        if not any(real == root or root in real.parents for root in self.roots):
            log.warning("viewer: %s %s resolves to %s, outside the folders given (%s): refused", what, given, real, self.describe())
            raise OutsideFoldersError(f"{what} {given.name} ({given}) resolves outside the folders given to the viewer "
                                      f"({self.describe()}); refused")
        mode = real.stat().st_mode
        if stat.S_ISDIR(mode):
            self._check_links_under(real, what, given)
        elif not stat.S_ISREG(mode):
            raise RefusedFileError(f"{what} {given.name} ({given}) is not a regular file or folder (a FIFO, device or "
                                   "socket); refused")
        return real

    def _check_links_under(self, folder: Path, what: str, given: Path) -> None:
        """A folder read as one (a tile store, a DICOM slide): every link inside it must resolve inside the folders
        too, and nothing in it may be a FIFO, device or socket (at most :data:`MAX_FOLDER_ENTRIES` entries)."""
        n = 0
        for top, dirs, files in os.walk(folder):
            for name in (*dirs, *files):
                n += 1
                if n > MAX_FOLDER_ENTRIES:
                    raise RefusedFileError(f"{what} {given.name} ({given}) holds more than {MAX_FOLDER_ENTRIES} entries; refused")
                entry = Path(top) / name
                mode = entry.lstat().st_mode
                if stat.S_ISLNK(mode):
                    target = entry.resolve()
                    if not any(target == root or root in target.parents for root in self.roots):
                        log.warning("viewer: %s %s holds %s, a link to %s outside the folders given: refused", what, given, entry, target)
                        raise OutsideFoldersError(f"{what} {given.name} ({given}) holds a link ({entry.relative_to(folder)}) "
                                                  f"that resolves outside the folders given to the viewer ({self.describe()}); refused")
                elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise RefusedFileError(f"{what} {given.name} ({given}) holds {entry.relative_to(folder)}, not a regular "
                                           "file or folder; refused")

    def contains(self, path: str | os.PathLike[str] | None) -> bool:
        """Whether ``path`` exists and resolves inside the folders (:meth:`check` without the error)."""
        if path is None:
            return False
        try:
            self.check(path, "file")
        except OSError:  # absent, outside, not a regular file
            return False
        return True

    def read_geojson(self, path: str | os.PathLike[str], what: str) -> dict[str, Any]:
        """The checked FeatureCollection of a GeoJSON file inside the folders (module docstring).

        Raises :class:`OutsideFoldersError`, ``FileNotFoundError`` or :class:`GeoJSONError` naming the file."""
        real = self.check(path, what)
        name = Path(path).name
        if not real.is_file():
            raise GeoJSONError(f"{what} {name} is a folder, expected a GeoJSON file")
        size = real.stat().st_size
        if size > MAX_GEOJSON_BYTES:
            raise GeoJSONError(f"{what} {name}: {size} bytes, more than the {MAX_GEOJSON_BYTES} bytes the viewer reads")
        with open(real, "rb") as f:
            raw = f.read(MAX_GEOJSON_BYTES + 1)
        if len(raw) > MAX_GEOJSON_BYTES:  # grew since stat
            raise GeoJSONError(f"{what} {name}: more than the {MAX_GEOJSON_BYTES} bytes the viewer reads")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise GeoJSONError(f"{what} {name} is not JSON ({str(err)[:120]}); expected a GeoJSON FeatureCollection") from None
        return {"type": "FeatureCollection", "features": _features(obj, f"{what} {name}")}

    def open_mask(self, path: str | os.PathLike[str], what: str = "lesion mask") -> np.ndarray:
        """Bool (h, w) mask (white = True) of an image inside the folders, bounded before it is decoded."""
        from PIL import Image

        real = self.check(path, what)
        if not real.is_file():
            raise ValueError(f"{what} {Path(path).name} is a folder, expected an image file")
        size = real.stat().st_size
        if size > MAX_MASK_BYTES:
            raise ValueError(f"{what} {Path(path).name}: {size} bytes, more than the {MAX_MASK_BYTES} the viewer reads")
        with Image.open(real) as img:
            w, h = img.size
            if w * h > MAX_MASK_PIXELS:
                raise ValueError(f"{what} {Path(path).name}: {w} x {h} px, more than the {MAX_MASK_PIXELS} px the viewer decodes")
            return np.asarray(img.convert("L")) > 127


def _features(obj: Any, where: str) -> list[dict[str, Any]]:
    """The Features of a FeatureCollection (or a list of Features), each checked; GeoJSONError naming the first bad one."""
    if isinstance(obj, dict) and obj.get("type") == "FeatureCollection":
        feats = obj.get("features")
        if not isinstance(feats, list):
            raise GeoJSONError(f"{where}: its features are a {type(feats).__name__}, expected a list of GeoJSON Features")
    elif isinstance(obj, list) and all(isinstance(f, dict) for f in obj):
        feats = obj  # QuPath's older exports: a bare list of features
    else:
        kind = obj.get("type") if isinstance(obj, dict) else None
        found = f"an object of type {str(kind)[:40]!r}" if isinstance(kind, str) else f"a JSON {type(obj).__name__}"
        raise GeoJSONError(f"{where}: {found}, expected a GeoJSON FeatureCollection")
    out = []
    for i, f in enumerate(feats):
        problem = _feature_problem(f)
        if problem is not None:
            raise GeoJSONError(f"{where}: feature {i} {problem}; expected a GeoJSON Feature in a FeatureCollection")
        out.append({"type": "Feature", "geometry": f.get("geometry"), "properties": f.get("properties") or {}})
    return out


def _feature_problem(f: Any) -> str | None:
    """What is wrong with one feature, or None."""
    if not isinstance(f, dict):
        return f"is a {type(f).__name__}"
    if f.get("type", "Feature") != "Feature":
        return f"has type {str(f.get('type'))[:40]!r}"
    if not isinstance(f.get("properties") or {}, dict):
        return "has properties that are not an object"
    geom = f.get("geometry")
    if geom is None:
        return None
    return _geometry_problem(geom, 0)


def _geometry_problem(geom: Any, depth: int) -> str | None:
    if not isinstance(geom, dict):
        return f"has a geometry that is a {type(geom).__name__}"
    kind = geom.get("type")
    if kind == "GeometryCollection" and depth == 0:
        parts = geom.get("geometries")
        if not isinstance(parts, list):
            return "has a GeometryCollection without a list of geometries"
        return next((p for p in (_geometry_problem(g, 1) for g in parts) if p is not None), None)
    if kind not in _DEPTH:
        return f"has a geometry of type {str(kind)[:40]!r}"
    if not _coordinates_ok(geom.get("coordinates"), _DEPTH[str(kind)]):
        return f"has {kind} coordinates that are not arrays of finite numbers"
    return None


def _coordinates_ok(c: Any, depth: int) -> bool:
    """Whether ``c`` is ``depth`` levels of arrays ending in positions of 2 or 3 finite numbers."""
    if depth == 1:
        return (isinstance(c, list) and 2 <= len(c) <= 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in c))
    return isinstance(c, list) and all(_coordinates_ok(x, depth - 1) for x in c)
