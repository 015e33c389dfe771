"""Feature files made by other tools (TRIDENT, CLAM, STAMP) and by this package, read as one thing; ours
written in TRIDENT's and STAMP's layouts.

Every reader returns a :class:`SlideFeatures`: the features float32 [N, D], the tiles' top-left corners in
level-0 px (int64 [N, 2]; None for CLAM's ``.pt`` files, which hold features only), the tile side in
level-0 px when the file says, and the slide's level-0 size when it says. The format is detected from
the file's datasets and attributes (:func:`detect_format`); a file that lacks what its format requires
is refused (``ValueError``) naming the file, what is missing and what was found. See ``docs/interop.md``.

Layouts (as read; written by :func:`write_features` for ``trident`` and ``stamp``):

``wsi-pipeline``
    ``features`` [N, D], ``coords`` [N, 2] level-0 px, ``grid`` [N, 2] (col, row), attributes
    ``encoder``, ``tile_size``, ``store_fingerprint``, ... (:mod:`wsi_pipeline.inference.features`).
``trident``
    ``features_<encoder>/<slide>.h5``: ``features`` [N, D], ``coords`` [N, 2] level-0 px; on ``coords``
    (accepted on the file too) ``patch_size``, ``patch_size_level0``, ``level0_magnification``,
    ``target_magnification``, ``overlap``, ``level0_width``, ``level0_height``.
``clam``
    ``h5_files/<slide>.h5``: ``features`` [N, D], ``coords`` [N, 2] level-0 px (``patch_size`` and
    ``patch_level`` on ``coords`` where CLAM knew them); ``pt_files/<slide>.pt``: the features tensor
    only, loaded with ``torch.load(weights_only=True)`` (nothing else is unpickled).
``stamp``
    ``feats`` [N, D], ``coords`` [N, 2] in micrometres; attributes ``extractor``, ``unit`` (``um``),
    ``tile_size_um``, ``tile_size_px``. Micrometres become level-0 px through the slide's level-0 mpp
    (``mpp`` attribute, or the manifest's ``mpp``) when one is known: ``px = um / mpp``; without one,
    level 0 is assumed to be the extraction resolution: ``px = um * tile_size_px / tile_size_um``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.io_atomic import atomic_path

__all__ = [
    "FEATURE_FORMATS",
    "FEATURE_SUFFIXES",
    "WRITE_LAYOUTS",
    "SlideFeatures",
    "detect_format",
    "feature_file",
    "feature_folder",
    "list_feature_files",
    "read_slide_features",
    "write_features",
]

#: ``data.features.format`` values.
FEATURE_FORMATS: tuple[str, ...] = ("auto", "trident", "clam", "stamp", "wsi-pipeline")
#: ``features --layout`` values.
WRITE_LAYOUTS: tuple[str, ...] = ("wsi-pipeline", "trident", "stamp")
#: Suffixes of feature files, in the order a slide's file is looked for.
FEATURE_SUFFIXES: tuple[str, ...] = (".h5", ".pt")
#: Attributes TRIDENT records on ``coords``.
TRIDENT_ATTRS: tuple[str, ...] = ("patch_size", "patch_size_level0", "level0_magnification", "target_magnification",
                                  "overlap", "level0_width", "level0_height")
#: Attributes a STAMP file must carry.
STAMP_ATTRS: tuple[str, ...] = ("extractor", "unit", "tile_size_um", "tile_size_px")


@dataclass
class SlideFeatures:
    """One slide's precomputed features, read from any supported format; also usable as a tile store
    stand-in by scoring (``coords``, ``grid``, ``attrs``, ``tile_size``, ``len``) without tiles.

    Attributes
    ----------
    slide_id : the file's stem.
    path : the file.
    format : ``wsi-pipeline``, ``trident``, ``clam`` or ``stamp``.
    features : float32 [N, D].
    coords : int64 [N, 2] top-left (x, y) of each tile in level-0 px; None when the file has none (CLAM ``.pt``).
    patch_size_level0 : tile side in level-0 px, when the file says (or it follows from its coordinates).
    level0_size : the slide's level-0 (width, height) px, when the file says.
    mpp : level-0 micrometres per px, when the file (or the caller) gives one.
    file_attrs : the file's own attributes (file and ``coords``), plain Python values.
    """

    slide_id: str
    path: Path
    format: str
    features: np.ndarray
    coords: np.ndarray | None
    patch_size_level0: float | None = None
    level0_size: tuple[int, int] | None = None
    mpp: float | None = None
    file_attrs: dict[str, Any] = field(default_factory=dict)
    stain: Any = None  # no stain normalisation: the features are embedded already

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def feature_dim(self) -> int:
        """D."""
        return int(self.features.shape[1])

    @property
    def tile_size(self) -> int:
        """Tile side in level-0 px (1 when unknown and no coordinates tell)."""
        return max(1, int(round(self.patch_size_level0 or 1)))

    @property
    def coords_or_index(self) -> np.ndarray:
        """``coords``, or for a file without any one tile per column of row 0 (``(i * tile, 0)``)."""
        if self.coords is not None:
            return self.coords
        return np.stack([np.arange(len(self), dtype=np.int64) * self.tile_size, np.zeros(len(self), np.int64)], 1)

    @property
    def grid(self) -> np.ndarray:
        """int32 [N, 2] (col, row): each tile's position on the tile grid (coordinates // tile side)."""
        c = self.coords_or_index
        if len(c) == 0:
            return np.zeros((0, 2), np.int32)
        step = float(self.patch_size_level0 or _min_step(c) or 1)
        return np.floor((c - c.min(axis=0)) / step).astype(np.int32)

    @property
    def attrs(self) -> dict[str, Any]:
        """Store-like attributes for scoring and heatmaps: ``downsample`` 1 (``tile_size`` is level-0 px),
        ``level0_size`` when known."""
        out: dict[str, Any] = {"downsample": 1.0, "slide_id": self.slide_id, "features_format": self.format}
        if self.level0_size is not None:
            out["level0_size"] = list(self.level0_size)
        return out

    @property
    def group(self) -> dict[str, Any]:
        """No arrays beside the features (no ``lesion`` truth)."""
        return {}

    def read(self, indices: np.ndarray) -> np.ndarray:
        raise ValueError(f"{self.path}: a feature file holds no tiles (only their features); this needs the tile store "
                         "or the slide")


def _min_step(coords: np.ndarray) -> float | None:
    """The smallest positive spacing of the coordinates along x or y (the tile pitch), or None."""
    steps = []
    for axis in (0, 1):
        d = np.diff(np.unique(coords[:, axis]))
        d = d[d > 0]
        if len(d):
            steps.append(float(d.min()))
    return min(steps) if steps else None


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _h5_attrs(f: Any) -> dict[str, Any]:
    """The file's attributes with those on ``coords`` (coords' win, as TRIDENT and CLAM put them there)."""
    attrs = {k: _plain(v) for k, v in f.attrs.items()}
    if "coords" in f:
        attrs.update({k: _plain(v) for k, v in f["coords"].attrs.items()})
    return attrs


def detect_format(path: str | os.PathLike) -> str:
    """The format of a feature file, from its suffix, datasets and attributes.

    ``.pt``: ``clam``; an HDF5 file with ``feats``: ``stamp``; with ``patch_size_level0`` (on ``coords`` or
    the file): ``trident``; with ``grid`` or our ``store_fingerprint`` attribute: ``wsi-pipeline``; else with
    ``features`` and ``coords``: ``clam``. Raises ``ValueError`` naming the file and what it
    holds when it is none of them.
    """
    import h5py

    p = Path(path)
    if p.suffix == ".pt":
        return "clam"
    with h5py.File(p, "r") as f:
        return _h5_format(p, list(f.keys()), _h5_attrs(f))


def _h5_format(p: Path, keys: list[str], attrs: Mapping[str, Any]) -> str:
    """:func:`detect_format`'s rule for an HDF5 file with datasets ``keys`` and attributes ``attrs``."""
    if "feats" in keys:
        return "stamp"
    if "features" in keys and "patch_size_level0" in attrs:  # (also ours written with `features --layout trident`)
        return "trident"
    if "features" in keys and ("grid" in keys or "store_fingerprint" in attrs):
        return "wsi-pipeline"
    if "features" in keys and "coords" in keys:
        return "clam"
    raise ValueError(f"feature file {p}: no known layout (datasets {sorted(keys)}); expected `features` + `coords` (TRIDENT, "
                     "CLAM, wsi-pipeline) or `feats` + `coords` (STAMP)")


def read_slide_features(path: str | os.PathLike, fmt: str = "auto", *, mpp: float | None = None) -> SlideFeatures:
    """Read one slide's feature file in ``fmt`` (``auto``: :func:`detect_format`).

    Parameters
    ----------
    path : ``<slide_id>.h5`` (any format) or ``<slide_id>.pt`` (CLAM's features tensor).
    fmt : one of :data:`FEATURE_FORMATS`; a file is read as that format, and refused when it lacks what
        that format requires.
    mpp : level-0 um/px of the slide (the manifest's), used for STAMP coordinates when the file gives none.

    Returns
    -------
    :class:`SlideFeatures` with coordinates in level-0 px.

    Raises
    ------
    FileNotFoundError : the file is absent.
    ValueError : the file lacks a dataset or attribute its format (``fmt``, or the detected one) requires.
    """
    p = Path(path)
    if fmt not in FEATURE_FORMATS:
        raise ValueError(f"feature format {fmt!r}; expected one of {list(FEATURE_FORMATS)}")
    if not p.is_file():
        raise FileNotFoundError(f"feature file {p} not found")
    if p.suffix == ".pt":
        if fmt not in ("auto", "clam"):
            raise ValueError(f"feature file {p}: a .pt file is CLAM's features tensor, but the format given is {fmt!r}")
        return _read_clam_pt(p)
    return _read_h5(p, fmt, mpp)


#: Each HDF5 format's name in messages, and its features dataset (besides ``coords``, which every one has).
_H5_NAMES = {"wsi-pipeline": "wsi-pipeline", "trident": "TRIDENT", "clam": "CLAM", "stamp": "STAMP"}
_FEATURES_DATASET = {"stamp": "feats"}


def _read_h5(p: Path, fmt: str, mpp: float | None) -> SlideFeatures:
    """Read an HDF5 feature file in ``fmt`` (``auto``: detected from the same open file), its datasets checked,
    then finished by its format's reader (:data:`_READERS`: coordinates to level-0 px, tile side, attributes).
    A format given is the one the file must satisfy."""
    import h5py

    with h5py.File(p, "r") as f:
        keys, attrs = list(f.keys()), _h5_attrs(f)
        found = _h5_format(p, keys, attrs) if fmt == "auto" else fmt
        name = _FEATURES_DATASET.get(found, "features")
        _require(p, _H5_NAMES[found], keys, (name, "coords"), "dataset(s)")
        feats = _features(p, f[name][:], name)
        coords = _coords(p, f["coords"][:], len(feats))
    return _READERS[found](p, feats, coords, attrs, mpp)


def _require(p: Path, what: str, have: Mapping[str, Any] | list[str], need: tuple[str, ...], kind: str) -> None:
    missing = [k for k in need if k not in have]
    if missing:
        raise ValueError(f"feature file {p} ({what}) lacks {kind} {missing}; found {sorted(have)}")


def _features(p: Path, arr: Any, name: str) -> np.ndarray:
    x = np.asarray(arr, dtype=np.float32)
    if x.ndim == 3 and x.shape[0] == 1:  # CLAM/TRIDENT batch axis
        x = x[0]
    if x.ndim != 2:
        raise ValueError(f"feature file {p}: `{name}` has shape {list(x.shape)}; expected [N, D]")
    return x


def _coords(p: Path, arr: Any, n: int, name: str = "coords") -> np.ndarray:
    c = np.asarray(arr, dtype=np.float64)
    if c.ndim == 3 and c.shape[0] == 1:
        c = c[0]
    if c.ndim != 2 or c.shape[1] != 2 or len(c) != n:
        raise ValueError(f"feature file {p}: `{name}` has shape {list(c.shape)}; expected [{n}, 2] (one (x, y) per feature row)")
    return c


def _read_ours(p: Path, feats: np.ndarray, coords: np.ndarray, attrs: dict[str, Any], mpp: float | None) -> SlideFeatures:
    coords = coords.astype(np.int64)
    # our files record the tile size at the read resolution; its level-0 side is the tile pitch (non-overlapping grid)
    tile = attrs.get("tile_size_level0") or _min_step(coords) or attrs.get("tile_size")
    return SlideFeatures(p.stem, p, "wsi-pipeline", feats, coords, float(tile) if tile else None,
                         _level0(attrs), _mpp(attrs, mpp), attrs)


def _level0(attrs: Mapping[str, Any]) -> tuple[int, int] | None:
    w, h = attrs.get("level0_width"), attrs.get("level0_height")
    if w and h:
        return int(w), int(h)
    v = attrs.get("level0_size")
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return int(v[0]), int(v[1])
    return None


def _mpp(attrs: Mapping[str, Any], given: float | None) -> float | None:
    v = attrs.get("mpp", given)
    try:
        v = float(v) if v is not None else None
    except (TypeError, ValueError):
        return given
    return v if v is not None and math.isfinite(v) and v > 0 else given


def _read_trident(p: Path, feats: np.ndarray, coords: np.ndarray, attrs: dict[str, Any], mpp: float | None) -> SlideFeatures:
    _require(p, "TRIDENT", attrs, ("patch_size_level0",), "attribute(s) (on `coords` or the file)")
    return SlideFeatures(p.stem, p, "trident", feats, np.rint(coords).astype(np.int64), float(attrs["patch_size_level0"]),
                         _level0(attrs), _mpp(attrs, mpp), attrs)


def _read_clam_h5(p: Path, feats: np.ndarray, coords: np.ndarray, attrs: dict[str, Any], mpp: float | None) -> SlideFeatures:
    coords = np.rint(coords).astype(np.int64)
    # CLAM's patch_size is in px at patch_level; it is the level-0 side only at level 0, else the tile pitch is
    tile = float(attrs["patch_size"]) if attrs.get("patch_size") and int(attrs.get("patch_level", 0) or 0) == 0 else None
    return SlideFeatures(p.stem, p, "clam", feats, coords, tile or _min_step(coords), _level0(attrs), _mpp(attrs, mpp), attrs)


def _read_clam_pt(p: Path) -> SlideFeatures:
    import torch

    from wsi_pipeline.model_files.loader import load_torch_file

    try:
        obj = load_torch_file(p)  # the pickle screened, then torch.load(weights_only=True)
    except Exception as e:
        raise ValueError(f"feature file {p} (CLAM pt_files): not a plain tensor file torch.load(weights_only=True) "
                         f"accepts ({type(e).__name__}: {e})") from e
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"feature file {p} (CLAM pt_files): holds a {type(obj).__name__}; expected the features tensor [N, D]")
    return SlideFeatures(p.stem, p, "clam", _features(p, obj.float().numpy(), "features tensor"), None)


def _read_stamp(p: Path, feats: np.ndarray, um: np.ndarray, attrs: dict[str, Any], mpp: float | None) -> SlideFeatures:
    _require(p, "STAMP", attrs, STAMP_ATTRS, "attribute(s)")
    unit = str(attrs["unit"]).lower()
    if unit not in ("um", "µm", "micrometre", "micrometer", "micron"):
        raise ValueError(f"feature file {p} (STAMP): attribute `unit` is {attrs['unit']!r}; expected 'um' (coordinates in micrometres)")
    tile_um, tile_px = float(attrs["tile_size_um"]), float(attrs["tile_size_px"])
    if not (tile_um > 0 and tile_px > 0):
        raise ValueError(f"feature file {p} (STAMP): tile_size_um={tile_um}, tile_size_px={tile_px}; expected both > 0")
    level0_mpp = _mpp(attrs, mpp)
    px_per_um = 1.0 / level0_mpp if level0_mpp else tile_px / tile_um
    return SlideFeatures(p.stem, p, "stamp", feats, np.rint(um * px_per_um).astype(np.int64), tile_um * px_per_um,
                         _level0(attrs), level0_mpp, attrs)


_READERS = {"wsi-pipeline": _read_ours, "trident": _read_trident, "clam": _read_clam_h5, "stamp": _read_stamp}


def feature_folder(root: str | os.PathLike) -> Path:
    """The folder that holds the per-slide files under ``root`` (``data.features.dir``, ``--features``).

    ``root`` itself when it holds ``.h5``/``.pt`` files; else CLAM's ``h5_files`` (or ``pt_files``); else
    TRIDENT's single ``features_<encoder>`` subfolder. Raises ``FileNotFoundError`` when ``root`` is absent
    and ``ValueError`` when it has several ``features_*`` folders (name one).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"features folder {root} not found")
    if any(root.glob("*.h5")) or any(root.glob("*.pt")):
        return root
    for sub in ("h5_files", "pt_files"):
        if (root / sub).is_dir():
            return root / sub
    trident = sorted(p for p in root.glob("features_*") if p.is_dir())
    if len(trident) > 1:
        raise ValueError(f"features folder {root} has {len(trident)} TRIDENT feature folders "
                         f"({', '.join(p.name for p in trident)}); point at one of them")
    return trident[0] if trident else root


def feature_file(folder: str | os.PathLike, slide_id: str) -> Path:
    """``<folder>/<slide_id>.h5``, or ``.pt`` when only that exists (the ``.h5`` path when neither does)."""
    folder = Path(folder)
    for suffix in FEATURE_SUFFIXES:
        p = folder / f"{slide_id}{suffix}"
        if p.is_file():
            return p
    return folder / f"{slide_id}.h5"


def list_feature_files(folder: str | os.PathLike) -> list[Path]:
    """The feature files of a folder (after :func:`feature_folder`), one per slide (``.h5`` before ``.pt``), by name."""
    folder = feature_folder(folder)
    by_id: dict[str, Path] = {}
    for suffix in reversed(FEATURE_SUFFIXES):
        for p in folder.glob(f"*{suffix}"):
            if p.is_file() and not p.name.startswith("."):
                by_id[p.stem] = p
    return [by_id[k] for k in sorted(by_id)]


def write_features(path: str | os.PathLike, layout: str, features: np.ndarray, coords: np.ndarray, *, tile_size_level0: float,
                   level0_size: tuple[int, int] | None = None, mpp: float | None = None, magnification: float | None = None,
                   patch_size: int | None = None, encoder: str = "", attrs: Mapping[str, Any] | None = None) -> Path:
    """Write one slide's features in another tool's layout, atomically.

    Parameters
    ----------
    path : the file (``<slide_id>.h5``).
    layout : ``trident`` or ``stamp`` (ours is written by :mod:`wsi_pipeline.inference.features`).
    features : float32 [N, D].
    coords : [N, 2] top-left (x, y) of each tile in level-0 px.
    tile_size_level0 : tile side in level-0 px.
    level0_size : the slide's level-0 (width, height) px (TRIDENT's ``level0_width``/``level0_height``; 0 unknown).
    mpp : level-0 um/px (required for ``stamp``, whose coordinates are micrometres; also written as ``mpp``).
    magnification : level-0 objective magnification (TRIDENT's ``level0_magnification``; default 10 / mpp
        when mpp is known, else 0).
    patch_size : tile side in px at the read resolution (default the level-0 side).
    encoder : the encoder's name (STAMP's ``extractor``).
    attrs : further file attributes (ours: ``encoder``, ``weights_sha256``, ...), kept.

    Returns the path written.
    """
    import h5py

    p = Path(path)
    feats = np.asarray(features, dtype=np.float32)
    xy = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    ps = int(patch_size or round(tile_size_level0))
    with atomic_path(p) as tmp, h5py.File(tmp, "w") as f:
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        if layout == "trident":
            f.create_dataset("features", data=feats)
            c = f.create_dataset("coords", data=np.rint(xy).astype(np.int64))
            l0mag = magnification if magnification is not None else (10.0 / mpp if mpp else 0.0)
            c.attrs["patch_size"] = ps
            c.attrs["patch_size_level0"] = int(round(tile_size_level0))
            c.attrs["level0_magnification"] = float(l0mag)
            c.attrs["target_magnification"] = float(l0mag * ps / tile_size_level0) if l0mag else 0.0
            c.attrs["overlap"] = 0
            c.attrs["level0_width"] = int(level0_size[0]) if level0_size else 0
            c.attrs["level0_height"] = int(level0_size[1]) if level0_size else 0
            if mpp:
                c.attrs["mpp"] = float(mpp)
        elif layout == "stamp":
            if not mpp:
                raise ValueError(f"{p}: the STAMP layout stores coordinates in micrometres and needs the slide's mpp "
                                 "(level-0 um/px); none is known for this slide (its tile store records none)")
            f.create_dataset("feats", data=feats)
            f.create_dataset("coords", data=xy * float(mpp))
            f.attrs["extractor"] = encoder or str((attrs or {}).get("encoder", ""))
            f.attrs["unit"] = "um"
            f.attrs["tile_size_um"] = float(tile_size_level0) * float(mpp)
            f.attrs["tile_size_px"] = ps
            f.attrs["mpp"] = float(mpp)
            if level0_size:
                f.attrs["level0_width"], f.attrs["level0_height"] = int(level0_size[0]), int(level0_size[1])
        else:
            raise ValueError(f"feature layout {layout!r}; expected 'trident' or 'stamp' here")
    return p
