"""Generated brightfield fields with painted ground truth: tissue, pen ink, blur and folds.

A field is one level of level-0 pixels (a crop of a slide), composed in transmission as a
scanner records it: ``rgb = glass * T_tissue * T_pen`` with ``glass`` a per-channel level (any
grey, optionally tinted), a smooth illumination field and per-pixel noise; then blurred where the
field is out of focus, and written as a one-level JPEG slide. The masks say, per level-0 pixel,
what was painted there, so a tile's truth is an exact fraction of its pixels.

Kinds (:data:`FIELD_KINDS`), each a few seeds:

- ``he``: H&E on glass at 236..248, about 60 % covered;
- ``ihc``: DAB-brown positive nuclei over a pale blue haematoxylin counterstain on glass at grey
  216 (the issue's Ki-67 case, about 70 % covered);
- ``pale``: faint, low-contrast H&E on glass at 238..244;
- ``pen``: H&E with green, blue, red and black ink strokes across tissue and glass;
- ``blur``: H&E with an out-of-focus region (Gaussian point spread, sigma 4 px);
- ``fold``: H&E with folded bands (a double layer: transmission squared);
- ``glass210``, ``glass230``, ``bluish``: H&E on darker glass, and on bluish glass;
- ``blank``: glass only (any kept tile is a false positive).

The tissue is :func:`~wsi_pipeline.synthetic.texture.paint_tissue` texture; a source image
(e.g. real tissue read from a slide) may replace it (``texture=``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from wsi_pipeline.synthetic.texture import HE_STAIN, Stain, paint_tissue

__all__ = ["FIELD_KINDS", "IHC_STAIN", "PALE_STAIN", "PEN_COLOURS", "Field", "FieldSpec", "field_spec", "make_field",
           "tile_truth", "write_field", "write_one_level_slide"]

#: IHC look: pale blue haematoxylin counterstain, blue nuclei, DAB-brown positive nuclei.
IHC_STAIN: Stain = ((206.0, 210.0, 226.0), (105.0, 120.0, 180.0), (150.0, 95.0, 55.0))
#: Faint H&E: pale pink stroma, pale purple nuclei.
PALE_STAIN: Stain = ((238.0, 220.0, 232.0), (200.0, 178.0, 214.0), (170.0, 130.0, 190.0))
#: Pen inks as RGB colours on white (green, blue, red, black), as felt-tip markers look when scanned.
PEN_COLOURS: dict[str, tuple[float, float, float]] = {
    "green": (60.0, 150.0, 90.0), "blue": (45.0, 75.0, 175.0), "red": (200.0, 45.0, 60.0), "black": (40.0, 40.0, 45.0),
}
#: The painted texture's own glass (paint_tissue's colours assume a white background at about this level).
_PAINT_WHITE = 250.0


@dataclass(frozen=True)
class FieldSpec:
    """What to paint (px are level-0 px).

    Attributes
    ----------
    size : (height, width) px.
    glass : RGB glass level (0..255 per channel).
    stain : :data:`~wsi_pipeline.synthetic.texture.Stain` of the tissue.
    cover : target fraction of the field covered by tissue (0 = blank).
    pens : ink names drawn as strokes (:data:`PEN_COLOURS`).
    blur_sigma : Gaussian sigma (px) of the out-of-focus region, 0 = none.
    folds : folded bands.
    lesions : fraction of the tissue with dense nuclei (DAB-positive nuclei for IHC).
    """

    size: tuple[int, int] = (2048, 2048)
    glass: tuple[float, float, float] = (242.0, 242.0, 242.0)
    stain: Stain = HE_STAIN
    cover: float = 0.6
    pens: tuple[str, ...] = ()
    blur_sigma: float = 0.0
    folds: int = 0
    lesions: float = 0.25


#: The benchmark's kinds of field.
FIELD_KINDS: tuple[str, ...] = ("he", "ihc", "pale", "pen", "blur", "fold", "glass210", "glass230", "bluish", "blank")


def field_spec(kind: str, rng: np.random.Generator, size: tuple[int, int] = (2048, 2048)) -> FieldSpec:
    """The :class:`FieldSpec` of one field of ``kind`` (its glass level and cover drawn from ``rng``)."""
    if kind not in FIELD_KINDS:
        raise ValueError(f"field kind {kind!r}; expected one of {FIELD_KINDS}")
    g = float(rng.uniform(236, 248))
    grey3 = (g, g, g)
    cover = float(rng.uniform(0.5, 0.7))
    if kind == "he":
        return FieldSpec(size, grey3, HE_STAIN, cover)
    if kind == "ihc":
        return FieldSpec(size, (216.0, 216.0, 216.0), IHC_STAIN, float(rng.uniform(0.65, 0.75)), lesions=0.3)
    if kind == "pale":
        g = float(rng.uniform(238, 244))
        return FieldSpec(size, (g, g, g), PALE_STAIN, cover, lesions=0.0)
    if kind == "pen":
        inks = tuple(rng.permutation(list(PEN_COLOURS))[: int(rng.integers(2, 5))])
        return FieldSpec(size, grey3, HE_STAIN, cover, pens=inks)
    if kind == "blur":
        return FieldSpec(size, grey3, HE_STAIN, cover, blur_sigma=4.0)
    if kind == "fold":
        return FieldSpec(size, grey3, HE_STAIN, cover, folds=2)
    if kind == "glass210":
        return FieldSpec(size, (210.0, 210.0, 210.0), HE_STAIN, cover)
    if kind == "glass230":
        return FieldSpec(size, (230.0, 230.0, 230.0), HE_STAIN, cover)
    if kind == "bluish":
        return FieldSpec(size, (222.0, 229.0, 242.0), HE_STAIN, cover)
    return FieldSpec(size, grey3, HE_STAIN, 0.0)


@dataclass
class Field:
    """A generated field and its painted truth (all (H, W) at level 0).

    Attributes
    ----------
    rgb : uint8 (H, W, 3).
    tissue : bool, tissue painted (under ink too).
    pen : bool, ink.
    blur : bool, the out-of-focus region.
    fold : bool, folded (double-layer) tissue.
    spec : what was painted.
    """

    rgb: np.ndarray
    tissue: np.ndarray
    pen: np.ndarray
    blur: np.ndarray
    fold: np.ndarray
    spec: FieldSpec = field(default_factory=FieldSpec)


def _smooth(rng: np.random.Generator, h: int, w: int, sigma: float) -> np.ndarray:
    small = rng.standard_normal((max(2, h // 16), max(2, w // 16))).astype(np.float32)
    blurred = cv2.GaussianBlur(small, (0, 0), max(0.5, sigma / 16))
    f = cv2.resize(blurred, (w, h), interpolation=cv2.INTER_CUBIC)
    return (f - f.mean()) / (f.std() + 1e-6)


def _shape(rng: np.random.Generator, h: int, w: int, cover: float) -> np.ndarray:
    """Bool (h, w): smooth tissue fragments covering about ``cover`` of the field."""
    if cover <= 0:
        return np.zeros((h, w), bool)
    if cover >= 1:
        return np.ones((h, w), bool)
    f = _smooth(rng, h, w, 0.25 * min(h, w))
    return f > np.quantile(f, 1.0 - cover)


def _transmission(texture: np.ndarray) -> np.ndarray:
    return np.clip(texture.astype(np.float32) / _PAINT_WHITE, 0.0, 1.0)


def make_field(spec: FieldSpec, seed: int, texture: np.ndarray | None = None) -> Field:
    """Paint one field (see the module docstring); deterministic in ``seed``.

    ``texture``: uint8 (H, W, 3) tissue to use instead of painted texture (its white is taken as 250).
    """
    rng = np.random.default_rng(seed)
    h, w = spec.size
    tissue = _shape(rng, h, w, spec.cover)
    lesion = None
    if spec.lesions > 0:
        lf = _smooth(rng, h, w, 0.08 * min(h, w))
        lesion = lf > np.quantile(lf, 1.0 - spec.lesions)
    if texture is None:
        texture = paint_tissue(rng, h, w, lesion=lesion, stain=spec.stain, noise=3.0)
    alpha = cv2.GaussianBlur(tissue.astype(np.float32), (0, 0), 1.5)[..., None]
    trans = 1.0 - alpha * (1.0 - _transmission(texture))  # soft edge
    fold = np.zeros((h, w), bool)
    for _ in range(spec.folds):
        # a band of tissue lying over itself: the transmission squared (twice the optical density)
        ang = rng.uniform(0, np.pi)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        d = (xx - rng.uniform(0.3, 0.7) * w) * np.cos(ang) + (yy - rng.uniform(0.3, 0.7) * h) * np.sin(ang)
        band = (np.abs(d) < rng.uniform(60, 140)) & tissue
        trans = np.where(band[..., None], trans * trans, trans)
        fold |= band
    pen = np.zeros((h, w), bool)
    pen_t = np.ones((h, w, 3), np.float32)
    for ink in spec.pens:
        stroke = np.zeros((h, w), np.uint8)
        pts = np.round(rng.uniform([0.1 * w, 0.1 * h], [0.9 * w, 0.9 * h]) + rng.normal(0, 0.2 * min(h, w), (4, 2)).cumsum(0))
        cv2.polylines(stroke, [pts.astype(np.int32).reshape(-1, 1, 2)], False, 1, thickness=int(rng.integers(40, 90)))
        on = stroke.astype(bool)
        colour = np.asarray(PEN_COLOURS[ink], np.float32) / 255.0
        pen_t[on] *= colour ** float(rng.uniform(0.8, 1.2))
        pen |= on
    trans = trans * pen_t
    gl = np.asarray(spec.glass, np.float32) * (1.0 + 0.008 * _smooth(rng, h, w, 0.5 * min(h, w)))[..., None]
    img = gl * trans
    blur = np.zeros((h, w), bool)
    if spec.blur_sigma > 0:
        bf = _smooth(rng, h, w, 0.3 * min(h, w))
        blur = bf > np.quantile(bf, 0.5)
        soft = cv2.GaussianBlur(blur.astype(np.float32), (0, 0), 2.0)[..., None]
        blurred = cv2.GaussianBlur(img, (0, 0), spec.blur_sigma)
        img = img * (1 - soft) + blurred * soft
    img = img + rng.normal(0.0, 1.5, img.shape).astype(np.float32)  # sensor noise, after the optics
    rgb = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return Field(rgb, tissue, pen, blur, fold, spec)


def tile_truth(f: Field, tile: int, coords: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per grid tile (rows, cols) of side ``tile`` px: fractions of tissue, ink, blur and fold; tissue under
    ink counts as ink only (``tissue`` is the inked-free tissue fraction)."""
    h, w = f.tissue.shape
    rows, cols = h // tile, w // tile

    def frac(m: np.ndarray) -> np.ndarray:
        return m[: rows * tile, : cols * tile].reshape(rows, tile, cols, tile).mean(axis=(1, 3))

    return {"tissue": frac(f.tissue & ~f.pen), "pen": frac(f.pen), "blur": frac(f.blur & f.tissue), "fold": frac(f.fold)}


def write_one_level_slide(path: str | Path, rgb: np.ndarray, mpp: float, quality: int = 92, generator: str = "wsi_pipeline.synthetic") -> Path:
    """Write ``rgb`` as a one-level Aperio-layout slide (JPEG tiles of 256 px, ``MPP = mpp``, a thumbnail)
    that the package's readers open; atomic (temp file + rename)."""
    import tifffile

    from wsi_pipeline.io_atomic import atomic_path

    if not mpp > 0:
        raise ValueError(f"mpp must be > 0 um/px, got {mpp}")
    h, w = rgb.shape[:2]
    tile = 256
    head = f"Aperio Image Library v12.0.16\r\n{w}x{h} [0,0 {w}x{h}] ({tile}x{tile}) JPEG/RGB Q={quality}"
    desc = f"{head}|AppMag = {10.0 / mpp:g}|MPP = {mpp:.6g}|Filename = {Path(path).stem}|Generator = {generator}"
    jpeg: dict[str, Any] = {"compression": "jpeg", "compressionargs": {"level": int(quality)}, "photometric": "rgb"}
    thumb = cv2.resize(rgb, (max(1, w // 8), max(1, h // 8)), interpolation=cv2.INTER_AREA)
    with atomic_path(path) as tmp:
        with tifffile.TiffWriter(tmp) as tw:
            tw.write(rgb, tile=(tile, tile), description=desc, metadata=None,
                     resolution=(1e4 / mpp, 1e4 / mpp), resolutionunit="CENTIMETER", **jpeg)
            tw.write(thumb, description=f"{head} -> {thumb.shape[1]}x{thumb.shape[0]} - ", metadata=None, **jpeg)
    return Path(path)


def write_field(path: str | Path, f: Field, mpp: float = 0.5, quality: int = 90) -> Path:
    """Write the field as a one-level Aperio-layout JPEG slide (:func:`write_one_level_slide`)."""
    return write_one_level_slide(path, f.rgb, mpp, quality=quality, generator="wsi_pipeline.synthetic.fields")
