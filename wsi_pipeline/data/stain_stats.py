"""Stain colour and intensity summaries of tiles, to tell when a slide lies outside the training cohort.

Each tile is described by five numbers computed from its uint8 RGB pixels:

- ``od_r``, ``od_g``, ``od_b``: mean optical density per channel, ``OD = -log10((I + 1) / 256)``
  (0 = white glass, about 2.4 = black); the stain's colour and how dark it is.
- ``od_contrast``: standard deviation over the tile's pixels of the channel-mean OD (texture
  contrast: nuclei against stroma).
- ``saturation``: mean HSV saturation (OpenCV's ``max - min`` over ``max``), 0..1.

At training time :func:`stain_reference` summarises the training tiles (up to
``max_tiles`` evenly spaced tiles per training slide): per feature the median over tiles and a
robust spread, ``1.4826 * MAD`` (the standard deviation for a normal distribution), never below
:data:`MIN_SPREAD`. The result is a small dict of plain numbers saved in every checkpoint.

At prediction time :func:`compare_to_reference` takes a new slide's per-tile features, and per
feature scores ``z = |median over the slide's tiles - reference median| / reference spread``; the
slide's *stain distance* is the largest ``z`` and the slide is *off-distribution* when that
distance exceeds :data:`OFF_DISTRIBUTION_DISTANCE` (a fluorescence slide, dark background and
bright nuclei, on a brightfield model scores tens; a tinted H&E scanner shift scores about 1).
The check warns; it never stops a prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import cv2
import numpy as np

from wsi_pipeline.types import TileStoreLike

__all__ = [
    "FEATURES",
    "FEATURE_NAMES",
    "MIN_SPREAD",
    "OFF_DISTRIBUTION_DISTANCE",
    "StainCheck",
    "compare_to_reference",
    "even_indices",
    "store_tile_features",
    "stain_reference",
    "tile_features",
]

#: Feature names, in column order of :func:`tile_features`.
FEATURES: tuple[str, ...] = ("od_r", "od_g", "od_b", "od_contrast", "saturation")
#: Words for messages.
FEATURE_NAMES: dict[str, str] = {
    "od_r": "mean optical density (red)", "od_g": "mean optical density (green)",
    "od_b": "mean optical density (blue)", "od_contrast": "optical-density contrast", "saturation": "mean saturation",
}
#: Smallest spread per feature (OD units; saturation 0..1): a cohort of near-identical tiles
#: must not make every slight shift look far away.
MIN_SPREAD: dict[str, float] = {"od_r": 0.05, "od_g": 0.05, "od_b": 0.05, "od_contrast": 0.03, "saturation": 0.05}
#: A slide whose stain distance exceeds this many reference spreads is flagged.
OFF_DISTRIBUTION_DISTANCE = 4.0
#: Reference format tag (saved with the reference dict).
_FORMAT = "stain-reference-v1"
#: OD of each uint8 grey level.
_OD_LUT = -np.log10((np.arange(256, dtype=np.float64) + 1.0) / 256.0)


def tile_features(tiles: np.ndarray) -> np.ndarray:
    """Per-tile features (k, 5) float64 of uint8 RGB tiles (k, T, T, 3), columns :data:`FEATURES`."""
    t = np.asarray(tiles)
    if t.ndim != 4 or t.shape[-1] != 3 or t.dtype != np.uint8:
        raise ValueError(f"tiles must be uint8 (k, T, T, 3) RGB; got {t.dtype} {t.shape}")
    out = np.zeros((len(t), len(FEATURES)), np.float64)
    for i, tile in enumerate(t):
        od = _OD_LUT[tile]  # (T, T, 3)
        out[i, :3] = od.reshape(-1, 3).mean(0)
        out[i, 3] = od.mean(-1).std()
        out[i, 4] = cv2.cvtColor(np.ascontiguousarray(tile), cv2.COLOR_RGB2HSV)[..., 1].mean() / 255.0
    return out


def even_indices(n: int, k: int) -> np.ndarray:
    """Up to ``k`` tile indices spread evenly over ``0 .. n-1`` (all of them when ``n <= k``)."""
    if n <= 0:
        return np.zeros(0, np.int64)
    if n <= k:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64))


@runtime_checkable
class HasStorePath(Protocol):
    """Something that names a tile store by path (such as :class:`wsi_pipeline.data.bags.Slide`)."""

    @property
    def store(self) -> Path: ...


def store_tile_features(store: TileStoreLike, max_tiles: int = 64) -> np.ndarray:
    """Features (k, 5) of up to ``max_tiles`` evenly spaced tiles of an open tile store."""
    idx = even_indices(len(store), max_tiles)
    return tile_features(store.read(idx)) if len(idx) else np.zeros((0, len(FEATURES)))


def stain_reference(stores: Iterable[str | Path | TileStoreLike | HasStorePath], max_tiles: int = 64) -> dict[str, Any] | None:
    """The training cohort's reference: per-feature median and robust spread over its tiles.

    Parameters
    ----------
    stores : tile store paths (or open stores, or objects with a ``store`` path attribute,
        such as :class:`wsi_pipeline.data.bags.Slide`).
    max_tiles : tiles read per store (evenly spaced).

    Returns a plain dict (``format``, ``features``, ``median``, ``spread``, ``n_slides``,
    ``n_tiles``, ``max_tiles_per_slide``, ``threshold``), or None when no store has a tile.
    """
    from wsi_pipeline.data.store import open_store

    feats, n_slides = [], 0
    for item in stores:
        src = item.store if isinstance(item, HasStorePath) else item
        store = open_store(src) if isinstance(src, (str, Path)) else src
        f = store_tile_features(store, max_tiles)
        if len(f):
            feats.append(f)
            n_slides += 1
    if not feats:
        return None
    x = np.concatenate(feats)
    med = np.median(x, axis=0)
    mad = 1.4826 * np.median(np.abs(x - med), axis=0)
    spread = np.maximum(mad, [MIN_SPREAD[f] for f in FEATURES])
    return {
        "format": _FORMAT, "features": list(FEATURES), "median": [float(v) for v in med],
        "spread": [float(v) for v in spread], "n_slides": int(n_slides), "n_tiles": int(len(x)),
        "max_tiles_per_slide": int(max_tiles), "threshold": float(OFF_DISTRIBUTION_DISTANCE),
    }


@dataclass(frozen=True)
class StainCheck:
    """One slide against the training reference.

    Attributes
    ----------
    distance : largest per-feature ``|slide median - reference median| / reference spread``.
    off_distribution : ``distance > threshold``.
    feature : the feature that gave the distance.
    value, reference : the slide's and the reference's median of that feature.
    medians : the slide's median of every feature (keyed by name).
    threshold : the distance above which a slide is flagged.
    """

    distance: float
    off_distribution: bool
    feature: str
    value: float
    reference: float
    medians: dict[str, float]
    threshold: float = OFF_DISTRIBUTION_DISTANCE

    def describe(self) -> str:
        """One sentence: the distance and the feature furthest from training."""
        return (f"stain distance {self.distance:.1f} (> {self.threshold:g} is off-distribution): "
                f"{FEATURE_NAMES.get(self.feature, self.feature)} {self.value:.3f} vs {self.reference:.3f} in training")


def compare_to_reference(features: np.ndarray, reference: Mapping[str, Any]) -> StainCheck:
    """Score a slide's per-tile ``features`` (k, 5) against a :func:`stain_reference` dict."""
    if reference.get("format") != _FORMAT or list(reference.get("features", [])) != list(FEATURES):
        raise ValueError(
            f"stain reference has format {reference.get('format')!r} and features {reference.get('features')!r}; "
            f"expected {_FORMAT!r} with {list(FEATURES)}"
        )
    f = np.asarray(features, np.float64).reshape(-1, len(FEATURES))
    if len(f) == 0:
        raise ValueError("a slide with no tiles has no stain statistics")
    med = np.median(f, axis=0)
    ref = np.asarray(reference["median"], np.float64)
    z = np.abs(med - ref) / np.asarray(reference["spread"], np.float64)
    j = int(np.argmax(z))
    thr = float(reference.get("threshold", OFF_DISTRIBUTION_DISTANCE))
    d = float(z[j])
    return StainCheck(distance=d, off_distribution=bool(math.isfinite(d) and d > thr), feature=FEATURES[j],
                      value=float(med[j]), reference=float(ref[j]), medians=dict(zip(FEATURES, map(float, med))), threshold=thr)
