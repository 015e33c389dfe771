"""Training bags from a manifest and tile stores (or frozen-feature files).

Each epoch, every training slide contributes one bag of ``k`` tiles drawn at random without
replacement (all its tiles when it has fewer); slides come in a random order, grouped into
optimiser steps of ``B x S`` bags (B bags per batch, S accumulated batches). The draw depends
only on ``(seed, epoch)``, so an interrupted run that resumes at epoch e sees the same bags as
an uninterrupted one. Tiles are read by a background thread one bag ahead of the consumer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from wsi_pipeline.data.store import TileStore, marked_complete, open_store, store_path, store_problem

log = logging.getLogger(__name__)

__all__ = [
    "Bag",
    "FeatureReader",
    "Slide",
    "TileReader",
    "check_stores",
    "check_tiling",
    "drop_empty",
    "skipped_by_tiler",
    "epoch_plan",
    "iter_bags",
    "sample_indices",
    "slides_for_split",
]


@dataclass(frozen=True)
class Slide:
    """A labelled slide: ``slide_id``, integer ``label`` and its tile store path.

    ``target``: what a survival or regression method learns, ``(time, event)`` or ``(value,)``
    (None for classification, whose target is ``label``; ``label`` is -1 for the other tasks).
    ``patient_id``: the manifest's, or the slide id when it has none.
    ``parts``: for a patient bag (``data.bags: patient``), the patient's slides
    (:func:`wsi_pipeline.data.patient_bags.patient_units`); empty for a slide.
    """

    slide_id: str
    label: int
    store: Path
    target: tuple[float, ...] | None = None
    patient_id: str = ""
    parts: tuple[Slide, ...] = ()

    @property
    def y(self) -> Any:
        """The training target: the class index, ``(time, event)``, or the regression value."""
        if self.target is None:
            return self.label
        return self.target if len(self.target) > 1 else self.target[0]


@dataclass
class Bag:
    """One slide's sampled tiles.

    Attributes
    ----------
    slide : the slide.
    indices : int64 (k,) tile positions in the store, increasing.
    data : uint8 tiles (k, T, T, 3) from a :class:`TileReader`, or float32 features (k, D)
        from a :class:`FeatureReader`.
    stain : the slide's stain normalisation (:class:`~wsi_pipeline.data.stain_slides.SlideStain`)
        for tiles, None for features or without normalisation.
    prepared : what the training strategy made of ``data`` in the loader thread, off the training
        thread (:meth:`~wsi_pipeline.training.strategies.Strategy.prepare_bag`: the float input on
        the CPU, or pinned uint8 for the device), None when it prepares nothing.
    """

    slide: Slide
    indices: np.ndarray
    data: Any
    stain: Any = None
    prepared: Any = None


def slides_for_split(manifest: pd.DataFrame, split: str, tiles_dir: str | os.PathLike, *, task: str = "classification") -> list[Slide]:
    """Labelled slides of ``split`` (``train``/``val``/``test``) in manifest order.

    Rows of the split without the task's target (its ``target_columns``: ``label``; ``time`` and
    ``event``; ``target``; a multilabel method's columns, all of them empty) are left out (they cannot be trained or validated on).

    Raises ``ValueError`` naming the columns when the manifest has none of the task's columns.
    """
    from wsi_pipeline.tasks import get_task

    kind = get_task(task)
    cols = kind.target_columns
    missing = [c for c in cols if c not in manifest.columns]
    if missing:
        raise ValueError(f"task {task!r} needs the manifest column(s) {list(cols)}; missing {missing}")
    has = kind.has_target(manifest)
    rows = manifest[(manifest["split"] == split) & has]
    patients = rows["patient_id"] if "patient_id" in rows.columns else pd.Series("", index=rows.index)
    out = []
    for r, patient in zip(rows.itertuples(), patients):
        sid = str(r.slide_id)
        label, target = kind.slide_fields([getattr(r, c) for c in cols])
        out.append(Slide(sid, label, store_path(tiles_dir, sid), target, str(patient or "") or sid))
    return out


def skipped_by_tiler(tiles_dir: str | os.PathLike) -> dict[str, str]:
    """Slides the tiler left without a usable store, with why: skipped on purpose, or failed.

    Read from ``<tiles_dir>/tiling_report.csv``; empty when there is no report. A slide skipped on
    purpose (``skipped`` with a ``skipped: ...`` note and no store: a fluorescence slide under the
    brightfield rules, say) or one whose tiling ``failed`` (an unreadable file; its store absent or
    incomplete) has nothing to train on, like a slide with 0 tiles: it is left out with them
    (:func:`drop_empty`), not reported as "run `wsi-pipeline tile`", which has just been run.
    """
    report = Path(tiles_dir) / "tiling_report.csv"
    if not report.is_file():
        return {}
    df = pd.read_csv(report, dtype=str, keep_default_na=False)
    if not {"slide_id", "status", "note"} <= set(df.columns):
        return {}
    out: dict[str, str] = {}
    for r in df.itertuples():
        store = store_path(tiles_dir, str(r.slide_id))
        if r.status == "skipped" and str(r.note).startswith("skipped:") and not store.exists():
            out[str(r.slide_id)] = str(r.note)
        elif r.status == "failed" and (not store.exists() or marked_complete(store) is None):
            error = str(getattr(r, "error", "") or "").strip()
            out[str(r.slide_id)] = "failed in tiling" + (f": {error[:200]}" if error else "")
    return out


def check_stores(slides: Sequence[Slide], tiles_dir: str | os.PathLike,
                 skipped: Mapping[str, str] | None = None) -> None:
    """Raise ``FileNotFoundError`` naming every slide without a complete tile store, and the fix.

    Slides the tiler skipped on purpose (:func:`skipped_by_tiler`; pass its result as ``skipped`` when the
    caller has it, else it is read here) are not missing: they are left out later with the slides that have
    0 tiles (:func:`drop_empty`).
    """
    skipped = skipped_by_tiler(tiles_dir) if skipped is None else skipped
    slides = [s for s in slides if s.slide_id not in skipped]
    missing = [s.slide_id for s in slides if not s.store.exists()]
    partial = [s.slide_id for s in slides if s.store.exists() and marked_complete(s.store) is None]
    if not missing and not partial:
        damaged = [(s.slide_id, p) for s in slides if (p := store_problem(s.store)) is not None]
        if damaged:
            raise ValueError(
                f"{len(damaged)} slide(s) of the manifest have unusable tile stores in {tiles_dir}: "
                + "; ".join(f"slide {sid}: {why}" for sid, why in damaged[:5]) + (" ..." if len(damaged) > 5 else "")
            )
        return
    parts = []
    if missing:
        parts.append(f"no store for {len(missing)}: {_first(missing)}")
    if partial:
        parts.append(f"partial store (no `complete: true`) for {len(partial)}: {_first(partial)}")
    raise FileNotFoundError(
        f"{len(missing) + len(partial)} slide(s) of the manifest have no complete tile store in {tiles_dir} "
        f"({'; '.join(parts)}). Run `wsi-pipeline tile` (make tile) on these slides to (re)build their "
        f"<slide_id>.zarr stores, or point data.tiles_dir at the folder that holds them."
    )



#: Store settings that may differ between the slides of one cohort (they describe the slide, not the tiling).
_PER_SLIDE = ("fingerprint", "mpp_override", "mpp_manifest", "mpp_force", "mpp", "mpp_source", "compression",
              "backend", "tile_formula", "regions_sha256", "points_sha256", "schema_version")


def store_settings(path: str | os.PathLike) -> dict[str, Any] | None:
    """The tiling settings recorded in a store (tile size, method, thresholds, mpp target, ...).

    None for a store that records none (stores written outside the tiler, e.g. synthetic ones).
    """
    identity = open_store(path).attrs.get("tiling_identity")
    if not isinstance(identity, dict):
        return None
    return {k: v for k, v in identity.items() if k not in _PER_SLIDE}


def check_tiling(slides: Sequence[Slide], expected: Any = None) -> dict[str, Any] | None:
    """The tiling settings shared by every slide's store, checked; None when the stores record none.

    Parameters
    ----------
    slides : slides with complete stores.
    expected : the config's ``data.tiling`` (fields that are not None must match the stores).

    Raises
    ------
    ValueError
        The stores were made with different settings (naming a few stores of each), or with
        settings other than ``expected``.
    """
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for s in slides:
        settings = store_settings(s.store)
        if settings is None:
            continue
        key = repr(sorted(settings.items()))
        groups.setdefault(key, (settings, []))[1].append(s.slide_id)
    if not groups:
        return None
    if len(groups) > 1:
        parts = [f"{_first(ids, 4)}: {_describe(settings)}" for settings, ids in groups.values()]
        raise ValueError(
            f"the tile stores were made with different tiling settings ({'; '.join(parts)}); retile the odd "
            "ones with the same `wsi-pipeline tile` options (a model must see one resolution and tile size)"
        )
    settings = next(iter(groups.values()))[0]
    if expected is not None:
        wrong = []
        for name in ("method", "tile_size", "min_foreground", "mpp_target"):
            want = getattr(expected, name, None)
            got = settings.get(name)
            if want is not None and not (got == want or (isinstance(got, float) and abs(got - float(want)) < 1e-9)):
                wrong.append(f"{name}: config {want} vs stores {got}")
        if wrong:
            raise ValueError(
                f"data.tiling disagrees with the tile stores ({'; '.join(wrong)}); remove those keys from data.tiling "
                "(the stores' settings are used) or retile with the config's settings"
            )
    return settings


def _describe(settings: dict[str, Any]) -> str:
    keys = ("method", "tile_size", "mpp_target", "min_foreground")
    return ", ".join(f"{k}={settings.get(k)}" for k in keys if k in settings)


def drop_empty(slides: Sequence[Slide], *, split: str, strict: bool = False,
               skipped: Mapping[str, str] | None = None) -> list[Slide]:
    """``slides`` without those whose (complete) store holds 0 tiles, with one warning naming them.

    A slide whose tiles all failed the foreground rule (a blank scan, a fluorescence slide under a
    brightfield rule) has an empty store: it cannot form a bag, so it is left out of training and
    evaluation, with the slides the tiler left out (``skipped``: :func:`skipped_by_tiler`, read here when
    not given). With ``strict`` that is an error instead.

    Raises
    ------
    ValueError
        ``strict`` and some slide has no tiles.
    """
    kept: list[Slide] = []
    empty: list[Slide] = []
    if skipped is None:
        skipped = skipped_by_tiler(slides[0].store.parent) if slides else {}
    for s in slides:
        (kept if s.slide_id not in skipped and len(open_store(s.store)) > 0 else empty).append(s)
    if empty:
        ids = [s.slide_id for s in empty]
        failed = [sid for sid in ids if skipped.get(sid, "").startswith("failed")]
        msg = (f"{len(ids)} {split} slide(s) have 0 tiles in their store, or were skipped by the tiler or failed in "
               f"tiling, and are left out: {_first(ids)} (all tiles failed the foreground rule, or e.g. a dark "
               "fluorescence background; see tiling_report.csv and the QC images, and retile with other settings, e.g. "
               "`wsi-pipeline tile --min-foreground 0.3` or `--allow-dark-background`)"
               + (f"; failed in tiling: {_first([f'{sid} ({skipped[sid]})' for sid in failed], 3)}" if failed else ""))
        if strict:
            raise ValueError(msg + "; --strict makes this an error")
        log.warning(msg)
    return kept


def _first(values: Sequence[str], k: int = 8) -> str:
    more = f" (and {len(values) - k} more)" if len(values) > k else ""
    return ", ".join(values[:k]) + more


def sample_indices(n_tiles: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct tile positions out of ``n_tiles`` (all when ``n_tiles <= k``), increasing, int64."""
    if n_tiles <= k:
        return np.arange(n_tiles, dtype=np.int64)
    return np.sort(rng.choice(n_tiles, size=k, replace=False)).astype(np.int64)


def epoch_plan(
    n_tiles: Sequence[int],
    *,
    bag_size: int,
    bags_per_step: int,
    seed: int,
    epoch: int,
) -> list[list[tuple[int, np.ndarray]]]:
    """The bags of one epoch, grouped by optimiser step.

    Parameters
    ----------
    n_tiles : tiles per training slide.
    bag_size : k tiles per bag.
    bags_per_step : B x S bags per optimiser step (the last group may be smaller).
    seed, epoch : the draw depends on these only.

    Returns
    -------
    groups : list of groups; each group lists ``(slide position, tile indices)``.
    """
    rng = np.random.default_rng([int(seed), int(epoch), 0x5A6])
    order = rng.permutation(len(n_tiles))
    bags = [(int(i), sample_indices(int(n_tiles[i]), bag_size, rng)) for i in order]
    return [bags[i : i + bags_per_step] for i in range(0, len(bags), bags_per_step)]


class TileReader:
    """Reads tiles of slides from their stores (stores stay open for the run).

    ``stain``: a :class:`~wsi_pipeline.data.stain_slides.StainContext`; each store opened gets its
    slide's normalisation (``store.stain``), and so does each bag read (``bag.stain``).
    """

    def __init__(self, slides: Sequence[Slide], stain: Any = None) -> None:
        self.slides = list(slides)
        self.stain = stain
        self._stores: dict[int, TileStore] = {}

    def store(self, i: int) -> TileStore:
        """The open store of slide ``i`` (of all its slides' stores, for a patient bag)."""
        if i not in self._stores:
            slide = self.slides[i]
            if slide.parts:
                from wsi_pipeline.data.patient_bags import PatientStore

                store: Any = PatientStore(slide.slide_id, [p.store for p in slide.parts])
            else:
                store = open_store(slide.store)
            if self.stain is not None:
                self.stain.attach(store)
            self._stores[i] = store
        return self._stores[i]

    def stain_of(self, i: int) -> Any:
        """Slide ``i``'s :class:`~wsi_pipeline.data.stain_slides.SlideStain` (None without normalisation)."""
        return self.store(i).stain

    def n_tiles(self) -> list[int]:
        """Tiles per slide."""
        return [len(self.store(i)) for i in range(len(self.slides))]

    def read(self, i: int, indices: np.ndarray) -> np.ndarray:
        """uint8 tiles (k, T, T, 3) of slide ``i``."""
        return self.store(i).read(indices)


class FeatureReader:
    """Reads frozen-encoder features (``read_features`` h5 files), one file per slide.

    Parameters
    ----------
    slides : the slides.
    paths : one feature file per slide (a list of them for a patient bag: concatenated in order).
    read : ``read_features(path) -> (features (n, D), coords (n, 2), attrs)``.
    """

    def __init__(self, slides: Sequence[Slide], paths: Sequence[Path | Sequence[Path]], read: Callable[[Path], tuple]) -> None:
        self.slides = list(slides)
        self.paths = list(paths)
        self._read = read
        self._n: list[int] | None = None

    def features(self, i: int) -> np.ndarray:
        """All features (n, D) float32 of slide ``i``."""
        paths = self.paths[i]
        if isinstance(paths, (list, tuple)):
            return np.concatenate([np.asarray(self._read(p)[0], dtype=np.float32) for p in paths])
        return np.asarray(self._read(cast(Path, paths))[0], dtype=np.float32)

    def n_tiles(self) -> list[int]:
        """Feature rows (tiles) per slide."""
        if self._n is None:
            self._n = [len(self.features(i)) for i in range(len(self.slides))]
        return self._n

    def read(self, i: int, indices: np.ndarray) -> np.ndarray:
        """float32 features (k, D) of slide ``i``."""
        return self.features(i)[indices]

    def stain_of(self, i: int) -> None:
        """None: features are embedded already (normalised when they were extracted)."""
        return None


def iter_bags(
    plan: Sequence[Sequence[tuple[int, np.ndarray]]],
    reader: TileReader | FeatureReader,
    *,
    prefetch: bool = True,
    prepare: Callable[[Bag], Any] | None = None,
) -> Iterator[tuple[int, Bag]]:
    """Yield ``(group index, bag)`` in plan order, reading the next bag in a background thread.

    ``prepare(bag)``, when given, also runs there and its result becomes ``bag.prepared`` (the
    strategy's conversion of the tiles, so the training thread does not convert while the device
    waits). Only I/O and deterministic conversion happen in the thread (no random numbers), so the
    result does not depend on timing.
    """
    flat = [(g, i, idx) for g, group in enumerate(plan) for i, idx in group]

    def load(item: tuple[int, int, np.ndarray]) -> tuple[int, Bag]:
        g, i, idx = item
        bag = Bag(reader.slides[i], idx, reader.read(i, idx), reader.stain_of(i))
        if prepare is not None:
            bag.prepared = prepare(bag)
        return g, bag

    if not prefetch or len(flat) < 2:
        for item in flat:
            yield load(item)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bag-reader") as pool:
        pending = pool.submit(load, flat[0])
        for nxt in flat[1:]:
            current = pending.result()
            pending = pool.submit(load, nxt)
            yield current
        yield pending.result()
