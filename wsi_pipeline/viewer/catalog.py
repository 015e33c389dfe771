"""The viewer's slide list: which slides there are, where their files are, and what was predicted.

Sources, any combination (a slide id joins them):

- ``slides``: a folder of slide files, found and named by :func:`~wsi_pipeline.slides.finder.find_slide_files`
  (the same ids as ``tile``, ``manifest folder`` and ``predict``);
- ``manifest``: a manifest CSV (``slide_id``, ``path`` relative to the manifest, ``label``, ``split``, and
  optionally ``lesion_mask`` + ``mask_downsample``: the planted or annotated lesion mask);
- ``predictions``: a ``predict --out`` folder (``predictions.csv``, ``heatmaps/``, ``tiles/``) or an ``eval``
  results folder (``predictions_<cohort>_<protocol>.csv``, ``heatmaps/``); predictions give ``pred``,
  ``prob_<k>`` (the list shows the largest), ``risk`` for survival models, and ``label`` when known;
- ``tiles``: a folder of ``<slide_id>.zarr`` tile stores (kept tiles, QC, tissue contours under
  ``tissue/``); a slide whose file is gone is still listed and viewed from its store.

Memory: one small :class:`SlideEntry` per slide (a few hundred bytes: ids, paths, a few numbers); no slide
is opened to build the list, so 10,000 slides list in well under a second and a few MB.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wsi_pipeline.slide_ids import slide_output_path, slide_id_problem
from wsi_pipeline.slides.finder import find_slide_files
from wsi_pipeline.viewer.containment import Folders

__all__ = ["SORT_KEYS", "Catalog", "SlideEntry", "build_catalog", "view_command"]

log = logging.getLogger(__name__)

#: Columns the list can be sorted by (``name`` sorts by slide id).
SORT_KEYS: tuple[str, ...] = ("name", "pred", "prob", "label", "split", "risk")


@dataclass
class SlideEntry:
    """One slide of the list.

    Attributes
    ----------
    slide_id : the id every stage uses.
    path : the slide file, or None (only a tile store is known, or the file is gone).
    store : ``<tiles>/<slide_id>.zarr`` when there is one.
    label, split, pred : from the manifest or the predictions (None when unknown).
    prob : the highest class probability of the prediction (0..1), None without predictions.
    risk : a survival model's risk score, None otherwise.
    scores : ``heatmaps/<slide_id>_scores.csv`` (per-tile attention) when present.
    lesion_mask, mask_downsample : a lesion mask image (white = lesion) and its level-0 px per mask px.
    tissue : the tiler's tissue contours ``<tiles>/tissue/<slide_id>.geojson`` when present.
    annotations : a QuPath GeoJSON of regions for this slide when present.
    """

    slide_id: str
    path: Path | None = None
    store: Path | None = None
    label: Any = None
    split: str | None = None
    pred: Any = None
    prob: float | None = None
    risk: float | None = None
    scores: Path | None = None
    lesion_mask: Path | None = None
    mask_downsample: float | None = None
    tissue: Path | None = None
    annotations: Path | None = None

    def row(self) -> dict[str, Any]:
        """The JSON row of the list page (no paths but the slide file's name)."""
        return {
            "slide_id": self.slide_id,
            "file": self.path.name if self.path is not None else None,
            "store": self.store is not None,
            "label": self.label,
            "split": self.split,
            "pred": self.pred,
            "prob": self.prob,
            "risk": self.risk,
            "heatmap": self.scores is not None,
        }


def _clean(value: Any) -> Any:
    """A CSV cell as JSON: NaN and empty -> None, integral floats -> int."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return int(value) if value.is_integer() else value
    if hasattr(value, "item"):
        return _clean(value.item())
    text = str(value)
    return text if text != "" else None


@dataclass
class Catalog:
    """Every slide of the list, by id, in the order found (see :meth:`page` for sorted pages)."""

    entries: dict[str, SlideEntry] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    #: The folders named by the sources (:class:`~wsi_pipeline.viewer.containment.Folders`): every file the
    #: server opens must resolve inside one of them.
    folders: Folders = field(default_factory=lambda: Folders(()))

    def get(self, slide_id: str) -> SlideEntry:
        """The entry of ``slide_id``; KeyError naming it when the list has no such slide."""
        try:
            return self.entries[slide_id]
        except KeyError:
            raise KeyError(f"no slide {slide_id!r} in the list ({len(self.entries)} slides from {', '.join(self.sources)})") from None

    def entry(self, slide_id: str) -> SlideEntry:
        """The entry of ``slide_id``, created when new."""
        e = self.entries.get(slide_id)
        if e is None:
            e = self.entries[slide_id] = SlideEntry(slide_id)
        return e

    def page(self, *, sort: str = "name", descending: bool = False, offset: int = 0, limit: int = 50,
             query: str = "") -> tuple[int, list[SlideEntry]]:
        """``(total matching, entries[offset:offset + limit])`` sorted by ``sort`` (one of :data:`SORT_KEYS`);
        missing values sort last either way; ``query`` keeps ids containing it (case-insensitive)."""
        if sort not in SORT_KEYS:
            raise ValueError(f"sort={sort!r}: expected one of {', '.join(SORT_KEYS)}")
        items = list(self.entries.values())
        if query:
            q = query.lower()
            items = [e for e in items if q in e.slide_id.lower()]
        attr = "slide_id" if sort == "name" else sort
        present = [e for e in items if getattr(e, attr) is not None]
        missing = [e for e in items if getattr(e, attr) is None]

        def key(e: SlideEntry) -> tuple[int, Any, str]:
            v = getattr(e, attr)
            return (0, v, e.slide_id) if isinstance(v, (int, float)) else (1, str(v), e.slide_id)

        present.sort(key=key, reverse=descending)
        missing.sort(key=lambda e: e.slide_id)
        ordered = present + missing
        offset = max(0, int(offset))
        limit = max(1, min(int(limit), 500))
        return len(ordered), ordered[offset:offset + limit]


def _folder(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} folder not found: {p}")
    if not p.is_dir():
        raise NotADirectoryError(f"{what} {p} is a file, not a folder")
    return p


def _add_manifest(cat: Catalog, manifest: Path) -> None:
    if not manifest.is_file():
        raise FileNotFoundError(f"manifest not found: {manifest}")
    df = pd.read_csv(manifest, dtype={"slide_id": str, "split": str})
    if "slide_id" not in df.columns:
        raise ValueError(f"manifest {manifest}: no column 'slide_id' (columns: {', '.join(map(str, df.columns))})")
    for rec in df.to_dict("records"):
        sid = str(rec["slide_id"])
        if slide_id_problem(sid) is not None:
            log.warning("manifest %s: slide id %r skipped (%s)", manifest, sid, slide_id_problem(sid))
            continue
        e = cat.entry(sid)
        if _clean(rec.get("path")) is not None:
            p = Path(str(rec["path"]))
            e.path = p if p.is_absolute() else manifest.parent / p
        e.label = _clean(rec.get("label")) if e.label is None else e.label
        e.split = _clean(rec.get("split")) if e.split is None else e.split
        mask = _clean(rec.get("lesion_mask"))
        if mask is not None:
            mp = Path(str(mask))
            e.lesion_mask = mp if mp.is_absolute() else manifest.parent / mp
            e.mask_downsample = float(rec.get("mask_downsample") or 1.0)


def _prediction_files(folder: Path) -> list[Path]:
    """``predictions.csv`` of a predict folder, else an eval folder's ``predictions_*.csv``, 'all' protocol first."""
    if (folder / "predictions.csv").is_file():
        return [folder / "predictions.csv"]
    files = sorted(folder.glob("predictions_*.csv"))
    return sorted(files, key=lambda p: (0 if p.stem.endswith("_all") else 1, p.name))


def _add_predictions(cat: Catalog, folder: Path, method: str | None = None) -> None:
    """Predictions of each slide: a predict folder has one row per slide; an eval folder has one per method and
    seed: the rows of ``method`` (default: the first method in the file) averaged over its seeds."""
    files = _prediction_files(folder)
    if not files:
        log.warning("predictions folder %s has no predictions.csv or predictions_*.csv; its heatmaps are used if any", folder)
    seen: set[str] = set()
    for f in files:
        df = pd.read_csv(f, dtype={"slide_id": str})
        if "slide_id" not in df.columns:
            raise ValueError(f"predictions file {f}: no column 'slide_id' (columns: {', '.join(map(str, df.columns))})")
        if ("method" in df.columns and df["method"].nunique() > 1) or method is not None:
            if "method" not in df.columns:
                raise ValueError(f"predictions file {f} has no column 'method' to choose {method!r} from")
            names = list(dict.fromkeys(df["method"].astype(str)))
            chosen = method or names[0]
            if chosen not in names:
                raise ValueError(f"predictions file {f}: no method {chosen!r}; it has {', '.join(names)}")
            df = df[df["method"].astype(str) == chosen]
            if f is files[0]:  # the list says once which model it shows
                cat.sources[-1] += f" (method {chosen}, mean over its seeds)"
        prob_cols = [c for c in df.columns if str(c).startswith("prob_") and str(c)[5:].isdigit()]
        numeric = [c for c in [*prob_cols, "risk"] if c in df.columns]
        per_slide = df.groupby("slide_id", sort=False)
        mean = per_slide[numeric].mean() if numeric else None
        for sid, rows in per_slide:
            sid = str(sid)
            if sid in seen or slide_id_problem(sid) is not None:
                continue  # the first file (the 'all' protocol) wins
            seen.add(sid)
            e = cat.entry(sid)
            probs = [float(mean.at[sid, c]) for c in prob_cols] if mean is not None else []
            probs = [p for p in probs if not math.isnan(p)]
            e.prob = max(probs) if probs else None
            if probs and len(probs) == len(prob_cols):
                e.pred = int(np.argmax(probs))  # the class of the largest mean probability
            elif "pred" in rows.columns:
                e.pred = _clean(rows["pred"].iloc[0])
            if "risk" in numeric and mean is not None and not math.isnan(float(mean.at[sid, "risk"])):
                e.risk = float(mean.at[sid, "risk"])
            lab = _clean(rows["label"].iloc[0]) if "label" in rows.columns else None
            if lab is not None:
                e.label = lab
    heat = folder / "heatmaps"
    if heat.is_dir():
        for f in heat.glob("*_scores.csv"):
            sid = f.name[: -len("_scores.csv")]
            if slide_id_problem(sid) is None:
                cat.entry(sid).scores = f


def _add_tiles(cat: Catalog, tiles: Path, *, create: bool) -> None:
    for store in sorted(tiles.glob("*.zarr")):
        sid = store.name[: -len(".zarr")]
        if slide_id_problem(sid) is not None or (not create and sid not in cat.entries):
            continue
        e = cat.entry(sid)
        e.store = store
        tissue = tiles / "tissue" / f"{sid}.geojson"
        if tissue.is_file():
            e.tissue = tissue


def build_catalog(
    *,
    slides: str | os.PathLike | None = None,
    manifest: str | os.PathLike | None = None,
    predictions: str | os.PathLike | None = None,
    tiles: str | os.PathLike | None = None,
    annotations: str | os.PathLike | None = None,
    method: str | None = None,
) -> Catalog:
    """Collect the slides of the given sources (see the module docstring).

    ``method``: the model whose predictions an eval results folder lists (default: its first).
    Raises ``FileNotFoundError`` naming a folder or file that does not exist, and ``ValueError`` when the
    sources hold no slide at all. The catalog's :attr:`Catalog.folders` are the folders of the sources (the
    manifest's own folder for a manifest): the server opens no file outside them.
    """
    cat = Catalog()
    if slides is not None:
        root = _folder(slides, "slides")
        cat.sources.append(f"slides {root}")
        for sf in find_slide_files(root):
            cat.entry(sf.slide_id).path = sf.path
    if manifest is not None:
        cat.sources.append(f"manifest {manifest}")
        _add_manifest(cat, Path(manifest))
    pred_dir = None
    if predictions is not None:
        pred_dir = _folder(predictions, "predictions")
        cat.sources.append(f"predictions {pred_dir}")
        _add_predictions(cat, pred_dir, method)
    if tiles is not None:
        cat.sources.append(f"tiles {tiles}")
        _add_tiles(cat, _folder(tiles, "tiles"), create=True)
    elif pred_dir is not None and (pred_dir / "tiles").is_dir():
        _add_tiles(cat, pred_dir / "tiles", create=False)  # predict --out keeps its stores there
    if annotations is not None:
        ann = _folder(annotations, "annotations")
        cat.sources.append(f"annotations {ann}")
        for sid, e in cat.entries.items():
            p = slide_output_path(ann, sid, ".geojson")
            if p.is_file():
                e.annotations = p
    cat.folders = Folders.of([slides, Path(manifest).parent if manifest is not None else None, predictions, tiles, annotations])
    if not cat.entries:
        raise ValueError(f"no slides to view in {', '.join(cat.sources) or 'no source'}: give --slides, --manifest, "
                         "--predictions/--results or --tiles with at least one slide")
    return cat


def view_command(*, slides: str | os.PathLike | None = None, manifest: str | os.PathLike | None = None,
                 predictions: str | os.PathLike | None = None, tiles: str | os.PathLike | None = None,
                 port: int | None = None) -> str:
    """The ``wsi-pipeline view`` command line that lists these sources (printed by the demo)."""
    parts = ["wsi-pipeline view"]
    for flag, value in (("--slides", slides), ("--manifest", manifest), ("--predictions", predictions), ("--tiles", tiles)):
        if value is not None:
            parts += [flag, shlex.quote(str(value))]
    if port is not None:
        parts += ["--port", str(port)]
    return " ".join(parts)
