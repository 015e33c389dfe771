"""Overlays drawn as transparent PNG tiles on the viewer's pyramid (:mod:`wsi_pipeline.viewer.tiles` geometry).

Kinds (each a Leaflet tile layer the page toggles and fades with its own opacity slider):

- ``heatmap``: each scored tile filled with :func:`wsi_pipeline.export.heatmap.colormap` of its
  ``attention_rank`` from ``heatmaps/<slide_id>_scores.csv`` (the per-slide rank in [0, 1], the PNG
  heatmap's default normalisation): 1 (the highest attention) is the top of the scale, dark red
  (165, 0, 38). Tiles are drawn in rising rank, so where tiles overlap the higher one shows.
- ``tiles``: every tile the store kept, outlined green (the tiler's QC image uses the same colours).
- ``qc``: tiles QC dropped (store arrays ``qc_dropped_coords``/``qc_dropped_flags``) outlined red,
  kept tiles QC flagged (``qc_flags``) outlined orange; ``reasons`` limits both to some artifacts.
- ``lesion``: the manifest's lesion mask (``lesion_mask`` image, ``mask_downsample`` level-0 px per mask
  px) filled magenta.

Outlines are :data:`OUTLINE_PX` screen px wide at every zoom, inside the tile's footprint. Tissue contours
and QuPath annotations are GeoJSON the page draws itself (:func:`wsi_pipeline.viewer.server`).

Memory per slide: the tile table (a few numbers per tile: 100,000 tiles ~ 5 MB) and the lesion mask image;
each overlay tile is rendered on request from the tiles that meet it (one vectorised test over the table).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from wsi_pipeline.data.store import TileStore
from wsi_pipeline.export.heatmap import colormap
from wsi_pipeline.viewer.containment import Folders, RefusedFileError
from wsi_pipeline.viewer.query import BadRequest
from wsi_pipeline.viewer.tiles import TILE, tile_box

__all__ = ["COLOURS", "KINDS", "OUTLINE_PX", "QC_REASONS", "SlideOverlays"]

log = logging.getLogger(__name__)

#: Overlay kinds drawn as tiles.
KINDS: tuple[str, ...] = ("heatmap", "tiles", "qc", "lesion")
#: Outline width in screen px.
OUTLINE_PX = 3
#: RGB of outlines and fills (kept green, flagged orange, dropped red: as the tiler's QC image).
COLOURS: dict[str, tuple[int, int, int]] = {
    "kept": (0, 200, 0), "flagged": (255, 140, 0), "dropped": (220, 0, 0), "lesion": (255, 0, 255),
}
#: QC artifacts in bit order of the store's ``qc_flags`` (bit 1 << i).
QC_REASONS: tuple[str, ...] = ("pen", "blur", "fold")


def _bits(names: tuple[str, ...]) -> int:
    return sum(1 << QC_REASONS.index(n) for n in names)


def reasons_of(flags: int) -> list[str]:
    """Names of the artifacts set in one ``qc_flags`` value."""
    return [n for i, n in enumerate(QC_REASONS) if int(flags) & (1 << i)]


@dataclass
class _Table:
    """Tiles of one kind: level-0 top-left (x, y), side (level-0 px)."""

    xy: np.ndarray  # (N, 2) float64
    extent: np.ndarray  # (N,) float64

    def meeting(self, x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
        x, y, e = self.xy[:, 0], self.xy[:, 1], self.extent
        return np.flatnonzero((x < x1) & (x + e > x0) & (y < y1) & (y + e > y0))

    def containing(self, x: float, y: float) -> np.ndarray:
        tx, ty, e = self.xy[:, 0], self.xy[:, 1], self.extent
        return np.flatnonzero((tx <= x) & (x < tx + e) & (ty <= y) & (y < ty + e))


def _px(v: float, origin: float, s: float) -> int:
    return int(math.floor((v - origin) / s))


class SlideOverlays:
    """The overlay data of one slide, loaded on first use.

    Parameters
    ----------
    dimensions : level-0 (W, H) of the slide.
    store : the slide's tile store or None.
    scores : the ``_scores.csv`` path or None.
    lesion_mask, mask_downsample : lesion mask image and its level-0 px per mask px, or None.
    folders : the viewer's folders (:class:`~wsi_pipeline.viewer.containment.Folders`): a scores file or mask
        outside them is refused (its overlay answers :class:`RefusedFileError` with the reason, and is not
        listed as available); None reads the paths as given (a library caller's own files).
    """

    def __init__(self, dimensions: tuple[int, int], *, store: TileStore | None = None, scores: Path | None = None,
                 lesion_mask: Path | None = None, mask_downsample: float | None = None,
                 folders: Folders | None = None) -> None:
        self.dimensions = dimensions
        self.store = store
        self.folders = folders
        #: overlay kind -> why its file was refused (outside the folders)
        self.refused: dict[str, str] = {}
        self.scores_path = self._inside(scores, "heatmap", "scores file")
        self.lesion_path = self._inside(lesion_mask, "lesion", "lesion mask")
        self.mask_downsample = float(mask_downsample or 1.0)
        self._lock = threading.Lock()
        self._scores: pd.DataFrame | None = None
        self._mask: np.ndarray | None = None
        self.kept: _Table | None = None
        self.dropped: _Table | None = None
        self.flags: np.ndarray | None = None
        self.dropped_flags: np.ndarray | None = None
        self.qc_measures: dict[str, np.ndarray] = {}
        if store is not None:
            extent = float(store.attrs.get("tile_size", store.tile_size)) * float(store.attrs.get("downsample", 1.0))
            xy = store.coords.reshape(-1, 2).astype(np.float64)
            self.kept = _Table(xy, np.full(len(xy), extent))
            self.extent = extent
            arrays = set(store.group.array_keys())
            if "qc_flags" in arrays:
                self.flags = store.array("qc_flags").astype(np.int64)
            for name in ("qc_focus", "qc_pen", "qc_fold"):
                if name in arrays:
                    self.qc_measures[name[3:]] = store.array(name)
            if "qc_dropped_coords" in arrays:
                d = store.array("qc_dropped_coords").reshape(-1, 2).astype(np.float64)
                self.dropped = _Table(d, np.full(len(d), extent))
                self.dropped_flags = store.array("qc_dropped_flags").astype(np.int64)

    def _inside(self, path: Path | None, kind: str, what: str) -> Path | None:
        """``path`` resolved inside the folders; None (the reason kept in :attr:`refused`) when it is refused."""
        if path is None or self.folders is None:
            return path
        try:
            return self.folders.check(path, what)
        except RefusedFileError as err:  # outside the folders, or a FIFO or device
            self.refused[kind] = str(err)
        except FileNotFoundError:
            pass
        return None

    def available(self) -> list[str]:
        """The overlay kinds this slide has data for."""
        out = []
        if self.scores_path is not None:
            out.append("heatmap")
        if self.kept is not None:
            out.append("tiles")
        if self.flags is not None or self.dropped is not None:
            out.append("qc")
        if self.lesion_path is not None and self.lesion_path.is_file():
            out.append("lesion")
        return out

    # -- data -------------------------------------------------------------------------------------------------
    def scores(self) -> pd.DataFrame:
        """The scores table with a ``position`` column: 1 = highest attention, N = lowest."""
        with self._lock:
            if self._scores is None:
                if self.scores_path is None:
                    raise FileNotFoundError("this slide has no heatmaps/<slide_id>_scores.csv")
                df = pd.read_csv(self.scores_path)
                missing = {"x", "y", "size", "attention"} - set(df.columns)
                if missing:
                    raise ValueError(f"scores file {self.scores_path}: missing column(s) {sorted(missing)}; expected the "
                                     "columns of heatmaps/<slide_id>_scores.csv (tile, x, y, size, attention, attention_rank)")
                if "attention_rank" not in df.columns:
                    r = df["attention"].rank(method="average")
                    df["attention_rank"] = (r - 1) / max(len(df) - 1, 1)
                df["position"] = df["attention"].rank(method="min", ascending=False).astype(int)
                self._scores = df.sort_values("attention_rank", kind="stable").reset_index(drop=True)
            return self._scores

    def lesion(self) -> np.ndarray:
        """Bool (h, w) lesion mask at ``mask_downsample``."""
        with self._lock:
            if self._mask is None:
                if self.lesion_path is None:
                    raise FileNotFoundError("this slide has no lesion mask")
                if self.folders is not None:  # checked again: the file may have been replaced since
                    self._mask = self.folders.open_mask(self.lesion_path)
                else:
                    self._mask = np.asarray(Image.open(self.lesion_path).convert("L")) > 127
            return self._mask

    # -- drawing ----------------------------------------------------------------------------------------------
    def render(self, kind: str, z: int, tx: int, ty: int, reasons: tuple[str, ...] = QC_REASONS) -> np.ndarray:
        """uint8 (256, 256, 4) RGBA overlay tile ``(z, tx, ty)`` of ``kind`` (transparent where nothing is drawn)."""
        if kind not in KINDS:
            raise BadRequest(f"overlay {kind!r}: expected one of {', '.join(KINDS)}")
        if kind in self.refused:
            raise RefusedFileError(self.refused[kind])
        x0, y0, x1, y1, s = tile_box(self.dimensions, z, tx, ty)
        box = (x0, y0, x0 + TILE * s, y0 + TILE * s)
        out = np.zeros((TILE, TILE, 4), np.uint8)
        if kind == "heatmap":
            df = self.scores()
            table = _Table(df[["x", "y"]].to_numpy(np.float64), df["size"].to_numpy(np.float64))
            sel = table.meeting(*box)
            rgb = colormap(df["attention_rank"].to_numpy()[sel])
            for i, c in zip(sel, rgb):  # rising rank (the table is sorted): the highest is drawn last
                self._fill(out, table, int(i), box[0], box[1], s, tuple(int(v) for v in c))
        elif kind == "tiles" and self.kept is not None:
            for i in self.kept.meeting(*box):
                self._outline(out, self.kept, int(i), box[0], box[1], s, COLOURS["kept"])
        elif kind == "qc":
            mask = _bits(tuple(r for r in reasons if r in QC_REASONS))
            if self.kept is not None and self.flags is not None:
                for i in self.kept.meeting(*box):
                    if self.flags[i] & mask:
                        self._outline(out, self.kept, int(i), box[0], box[1], s, COLOURS["flagged"])
            if self.dropped is not None and self.dropped_flags is not None:
                for i in self.dropped.meeting(*box):
                    if self.dropped_flags[i] & mask:
                        self._outline(out, self.dropped, int(i), box[0], box[1], s, COLOURS["dropped"])
        elif kind == "lesion":
            self._lesion(out, box, s)
        return out

    @staticmethod
    def _rect(table: _Table, i: int, ox: float, oy: float, s: float) -> tuple[int, int, int, int]:
        x, y = table.xy[i]
        e = table.extent[i]
        a, b = _px(x, ox, s), _px(y, oy, s)
        c, d = max(a + 1, _px(x + e, ox, s)), max(b + 1, _px(y + e, oy, s))
        return max(a, 0), max(b, 0), min(c, TILE), min(d, TILE)

    def _fill(self, out: np.ndarray, table: _Table, i: int, ox: float, oy: float, s: float, rgb: tuple[int, ...]) -> None:
        a, b, c, d = self._rect(table, i, ox, oy, s)
        if c > a and d > b:
            out[b:d, a:c, :3] = rgb
            out[b:d, a:c, 3] = 255

    def _outline(self, out: np.ndarray, table: _Table, i: int, ox: float, oy: float, s: float, rgb: tuple[int, ...]) -> None:
        x, y = table.xy[i]
        e = table.extent[i]
        a, b = _px(x, ox, s), _px(y, oy, s)
        c, d = max(a + 1, _px(x + e, ox, s)), max(b + 1, _px(y + e, oy, s))
        w = max(1, min(OUTLINE_PX, (c - a) // 4))
        colour = np.array((*rgb, 255), np.uint8)
        for ya, yb, xa, xb in ((b, b + w, a, c), (d - w, d, a, c), (b, d, a, a + w), (b, d, c - w, c)):
            ya, yb, xa, xb = max(ya, 0), min(yb, TILE), max(xa, 0), min(xb, TILE)
            if yb > ya and xb > xa:
                out[ya:yb, xa:xb] = colour

    def _lesion(self, out: np.ndarray, box: tuple[int, int, int, int], s: int) -> None:
        """Nearest-neighbour: each screen px takes the mask px under its centre."""
        mask = self.lesion()
        k = self.mask_downsample
        centres = (np.arange(TILE) + 0.5) * s
        xs = np.floor((box[0] + centres) / k).astype(np.int64)
        ys = np.floor((box[1] + centres) / k).astype(np.int64)
        okx, oky = xs < mask.shape[1], ys < mask.shape[0]
        if not okx.any() or not oky.any():
            return
        m = np.zeros((TILE, TILE), bool)
        m[np.ix_(oky, okx)] = mask[np.ix_(ys[oky], xs[okx])]
        out[m] = (*COLOURS["lesion"], 255)

    # -- a click ----------------------------------------------------------------------------------------------
    def tile_at(self, x: float, y: float) -> dict[str, Any] | None:
        """What is known of the tile under level-0 point (x, y): a kept tile (store index, grid, foreground, QC
        measures and flags, attention and its rank), else a QC-dropped tile (its reasons), else None."""
        info: dict[str, Any] | None = None
        if self.kept is not None:
            hit = self.kept.containing(x, y)
            if len(hit):
                i = int(hit[-1])
                info = {"status": "kept", "tile": i, "x": int(self.kept.xy[i, 0]), "y": int(self.kept.xy[i, 1]),
                        "size": float(self.kept.extent[i])}
                assert self.store is not None
                info["col"], info["row"] = (int(v) for v in self.store.grid[i])
                info["foreground"] = round(float(self.store.foreground[i]), 4)
                if self.flags is not None:
                    info["qc_flags"] = reasons_of(int(self.flags[i]))
                    if info["qc_flags"]:
                        info["status"] = "kept, flagged"
                for name, arr in self.qc_measures.items():
                    if i < len(arr) and np.isfinite(arr[i]):
                        info[f"qc_{name}"] = round(float(arr[i]), 4)
        if self.scores_path is not None:
            df = self.scores()
            t = _Table(df[["x", "y"]].to_numpy(np.float64), df["size"].to_numpy(np.float64))
            hit = t.containing(x, y)
            if len(hit):
                row = df.iloc[int(hit[-1])]
                info = info or {"status": "scored", "x": int(row["x"]), "y": int(row["y"]), "size": float(row["size"])}
                if "tile" in df.columns:
                    info["tile"] = int(row["tile"])
                info["attention"] = float(row["attention"])
                info["attention_rank"] = round(float(row["attention_rank"]), 4)
                info["position"] = int(row["position"])
                info["n_scored"] = int(len(df))
        if info is None and self.dropped is not None and self.dropped_flags is not None:
            hit = self.dropped.containing(x, y)
            if len(hit):
                i = int(hit[-1])
                info = {"status": "dropped by QC", "x": int(self.dropped.xy[i, 0]), "y": int(self.dropped.xy[i, 1]),
                        "size": float(self.dropped.extent[i]), "qc_flags": reasons_of(int(self.dropped_flags[i]))}
        return info
