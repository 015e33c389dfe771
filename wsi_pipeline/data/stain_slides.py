"""Per-slide stain estimates from tile stores, the fitted normaliser, and what travels with a slide's tiles.

- :func:`estimate_store`: a slide's :class:`~wsi_pipeline.data.stain.StainEstimate` from up to
  ``max_tiles`` evenly spaced tiles of its store (deterministic: the same store gives the same
  estimate in training, evaluation and prediction).
- :class:`StainContext`: the fitted :class:`~wsi_pipeline.data.stain.StainNormaliser`, the
  training slides' estimates (the target was fitted on them; stain mixing draws donors from
  them) and a cache of the estimates of other slides met later. Its :meth:`~StainContext.state`
  goes into every checkpoint and ``stain.json``; :meth:`~StainContext.from_state` restores it
  exactly, so ``eval`` and ``predict`` apply what training fitted.
- :class:`SlideStain`: one slide's normaliser and estimate, attached to its open store
  (``store.stain``) and its bags, and applied by :func:`wsi_pipeline.data.tensors.tiles_to_tensor`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wsi_pipeline.data.stain import StainEstimate, StainNormaliser, estimate_stain, fit_target
from wsi_pipeline.data.stain_stats import even_indices
from wsi_pipeline.types import TileStoreLike

__all__ = ["DEFAULT_MAX_TILES", "SlideStain", "StainContext", "estimate_store", "fit_stain_context"]

log = logging.getLogger(__name__)

#: Tiles per slide read for its stain estimate (evenly spaced over the store).
DEFAULT_MAX_TILES = 32
_FORMAT = "stain-context-v1"
#: (method, slide id) pairs already warned about in this process (eval loads one model per run).
_WARNED: set[tuple[str, str]] = set()


def estimate_store(store: TileStoreLike, max_tiles: int = DEFAULT_MAX_TILES) -> StainEstimate:
    """The stain of an open tile store, from up to ``max_tiles`` evenly spaced tiles."""
    idx = even_indices(len(store), int(max_tiles))
    if len(idx) == 0:
        return StainEstimate(macenko_problem="no tiles", reinhard_problem="no tiles")
    return estimate_stain(store.read(idx))


@dataclass(frozen=True)
class SlideStain:
    """One slide's stain normalisation: ``normaliser`` applied with the slide's ``estimate``."""

    normaliser: StainNormaliser
    estimate: StainEstimate
    slide_id: str = ""

    @property
    def normalised(self) -> bool:
        """True when this slide's tiles are normalised (False for ``none`` and for a fallback slide)."""
        return self.normaliser.usable(self.estimate)[0]

    @property
    def problem(self) -> str:
        """Why the slide falls back to no normalisation ("" when it does not)."""
        return self.normaliser.usable(self.estimate)[1]

    @property
    def effective(self) -> StainEstimate:
        """The stain of the tiles after normalisation (what stain mixing starts from): the target's
        H and E for a Macenko-normalised slide, else the slide's own estimate."""
        return self.normaliser.target if self.normalised and self.normaliser.method == "macenko" else self.estimate

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise float images ``x`` (k, 3, H, W) in [0, 1] (see :meth:`StainNormaliser.apply`)."""
        return self.normaliser.apply(x, self.estimate)

    @property
    def tag(self) -> str:
        """The frozen features' cache key of this slide's normalisation."""
        return self.normaliser.tag(self.estimate)


class StainContext:
    """The fitted normaliser with the slides' estimates (see the module docstring).

    Parameters
    ----------
    normaliser : the fitted normaliser.
    max_tiles : tiles per slide of every estimate.
    estimates : slide id -> estimate of the training slides (and any slide known already).
    """

    def __init__(self, normaliser: StainNormaliser, max_tiles: int = DEFAULT_MAX_TILES,
                 estimates: Mapping[str, StainEstimate] | None = None) -> None:
        self.normaliser = normaliser
        self.max_tiles = int(max_tiles)
        self.training = dict(estimates or {})
        self._cache: dict[str, StainEstimate] = dict(self.training)
        self._lock = threading.Lock()

    @property
    def method(self) -> str:
        return self.normaliser.method

    def __getstate__(self) -> dict[str, Any]:  # picklable for Dask workers (no lock)
        return {"normaliser": self.normaliser, "max_tiles": self.max_tiles, "training": self.training, "cache": self._cache}

    def __setstate__(self, s: dict[str, Any]) -> None:
        self.normaliser, self.max_tiles, self.training = s["normaliser"], s["max_tiles"], s["training"]
        self._cache, self._lock = dict(s["cache"]), threading.Lock()

    def estimate(self, store: TileStoreLike) -> StainEstimate:
        """The estimate of an open store's slide (computed once per slide id, then cached)."""
        sid = str(store.slide_id)
        with self._lock:
            if sid in self._cache:
                return self._cache[sid]
        est = estimate_store(store, self.max_tiles)
        with self._lock:
            self._cache.setdefault(sid, est)
            return self._cache[sid]

    def for_store(self, store: TileStoreLike) -> SlideStain:
        """The slide's :class:`SlideStain`; a slide that falls back is warned about once."""
        st = SlideStain(self.normaliser, self.estimate(store), str(store.slide_id))
        if self.method != "none" and not st.normalised and (self.method, st.slide_id) not in _WARNED:
            _WARNED.add((self.method, st.slide_id))
            log.warning("slide %s: its stain cannot be estimated (%s); its tiles are not %s-normalised",
                        st.slide_id, st.problem, self.method)
        return st

    def attach(self, store: TileStoreLike) -> Any:
        """Set ``store.stain`` to the slide's :class:`SlideStain`; return the store."""
        store.stain = self.for_store(store)
        return store

    def donors(self) -> list[StainEstimate]:
        """The training slides' estimates usable for stain mixing (Macenko), in slide-id order."""
        return [e for _, e in sorted(self.training.items()) if e.ok_for("macenko")[0]]

    def report(self) -> list[dict[str, Any]]:
        """One row per slide estimated so far: ``slide_id, training, normalise, stain_normalised, stain_problem``."""
        rows = []
        for sid, est in sorted(self._cache.items()):
            ok, why = self.normaliser.usable(est)
            rows.append({"slide_id": sid, "training": sid in self.training, "normalise": self.method,
                         "stain_normalised": bool(ok), "stain_problem": why})
        return rows

    def state(self) -> dict[str, Any]:
        """Plain containers: ``method`` names the normalisation; the normaliser; the training estimates."""
        return {"format": _FORMAT, "method": self.method, "normaliser": self.normaliser.state(), "max_tiles": self.max_tiles,
                "training": {sid: e.to_dict() for sid, e in sorted(self.training.items())}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StainContext:
        """The inverse of :meth:`state` (``ValueError`` naming the problem for another format)."""
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"stain state has format {found!r}; expected {_FORMAT!r}")
        return cls(StainNormaliser.from_state(state["normaliser"]), int(state["max_tiles"]),
                   {str(k): StainEstimate.from_dict(v) for k, v in dict(state["training"]).items()})


def fit_stain_context(
    method: str,
    target: str,
    train_stores: Mapping[str, str | Path],
    *,
    target_store: str | Path | None = None,
    max_tiles: int = DEFAULT_MAX_TILES,
    progress: bool = False,
) -> StainContext:
    """Estimate every training slide's stain and fit the normaliser's target.

    Parameters
    ----------
    method : ``none``, ``macenko`` or ``reinhard``.
    target : ``train`` (medians over the training slides' usable estimates) or a slide id (that
        slide's estimate; its store is ``target_store``).
    train_stores : training slide id -> tile store path.
    max_tiles : tiles per slide of each estimate.

    Raises ``ValueError`` when the target cannot be fitted (no usable training slide, or the
    reference slide's stain cannot be estimated), naming why.
    """
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.progress import progress_bar

    ests = {}
    for sid, path in progress_bar(sorted(train_stores.items()), enabled=progress, desc="stain estimates", unit="slide"):
        ests[sid] = estimate_store(open_store(path), max_tiles)
    if method == "none":
        return StainContext(StainNormaliser("none"), max_tiles, ests)
    if target == "train":
        tgt, n = fit_target(ests.values(), method)
    else:
        if target in ests:
            tgt = ests[target]
        elif target_store is not None:
            tgt = estimate_store(open_store(target_store), max_tiles)
        else:
            raise ValueError(f"data.stain.target={target!r}: no tile store for that slide; name a slide of the manifest "
                             "that has a store, or use target: train")
        ok, why = tgt.ok_for(method)
        if not ok:
            raise ValueError(f"data.stain.target={target!r}: its stain cannot be estimated ({why}); choose another reference slide")
        n = 1
    ctx = StainContext(StainNormaliser(method, tgt, target, n), max_tiles, ests)
    bad = [(sid, e.ok_for(method)[1]) for sid, e in sorted(ests.items()) if not e.ok_for(method)[0]]
    if bad:
        log.warning("%d training slide(s) fall back to no %s normalisation: %s", len(bad), method,
                    "; ".join(f"{s}: {w}" for s, w in bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return ctx
