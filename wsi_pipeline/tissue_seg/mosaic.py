"""Training mosaics of real tissue for the tissue U-Net (issue 17, item 5).

A mosaic is a large image at the training resolution built from pieces of real slides:

1. **Sources** (:func:`read_source`): a slide read whole at the training ``mpp`` with the package's
   readers, optionally restricted to a band of rows (so that one slide gives disjoint training
   and test regions), with its tissue mask from the paper's label pipeline
   (:func:`~wsi_pipeline.tissue_seg.labels.paper_labels`) and its glass level (median RGB of the
   pixels that mask calls glass).
2. **Pieces** (:func:`cut_piece`): a window around a random tissue pixel, cut through the
   source's own mask intersected with a random smooth blob (a whole-tissue slide such as a
   microscope field still gives fragments). A piece is kept as a *transmission*
   ``T = rgb / glass`` (1 on glass, < 1 where tissue absorbs), so it can be laid on any glass.
3. **Transforms**: a rotation by a multiple of 90 degrees and an optional mirror (exact), then a
   rotation by an arbitrary angle (``cv2.warpAffine``: bilinear for the transmission, nearest
   neighbour for the mask, the same matrix); stain jitter in optical density (HED) space: the
   optical density ``-log T`` is unmixed with scikit-image's haematoxylin/eosin/DAB matrix, each
   stain is scaled, and the result is mixed back (exact when every scale is 1).
4. **Glass**: scanner-like background, a grey level with a slight colour tint, a smooth
   illumination gradient and per-pixel noise, all drawn per mosaic.
5. **Composition** in transmission: ``rgb = glass * prod(T)``. Overlapping pieces and **folds**
   (a band of a piece mirrored over its own edge, a double layer) are darker, as real folds are.
   **Pen marks** (semi-transparent green, blue, black or red ink polylines of varied width) and
   **dust** (small dark specks and thin fibres, slightly out of focus) multiply in the same way.

The label of a mosaic is the paper's label pipeline applied to the mosaic (:attr:`Mosaic.label`),
not the union of the pasted masks (:attr:`Mosaic.pieces`, kept for checking): the model is scored
against the paper's labels, and the two differ exactly where the paper's rule decides otherwise
(wide pen strokes and dark folds are "tissue" to it, the 8 px blocks and the dilation widen the
edges, dust and thin pen lines are removed by its median filter). Training on the pasted masks
would teach a different target than the one measured.

Everything is deterministic in ``seed`` (one ``numpy.random.Generator``). Sizes are px at the
training resolution (``mpp`` um/px), not level-0 px.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from wsi_pipeline.tissue_seg.labels import paper_labels

__all__ = [
    "TissueSource",
    "MosaicConfig",
    "Placement",
    "Mosaic",
    "read_source",
    "source_from_rgb",
    "glass_level",
    "cut_piece",
    "orient",
    "stain_jitter",
    "make_mosaic",
    "write_mosaic_slide",
    "write_mosaics",
]

#: Pen inks as transmissions per RGB channel (green, blue, black, red).
PEN_INKS = ((0.30, 0.62, 0.38), (0.30, 0.38, 0.78), (0.16, 0.16, 0.19), (0.80, 0.28, 0.32))


@dataclass(frozen=True)
class TissueSource:
    """Real tissue to cut pieces from.

    Attributes
    ----------
    name : where it came from (file name and row band).
    rgb : uint8 (H, W, 3) image at the training resolution.
    mask : uint8 (H, W) {0, 1}: the paper's label of ``rgb``.
    glass : float64 (3,) RGB level of the source's glass (transmission 1).
    """

    name: str
    rgb: np.ndarray
    mask: np.ndarray
    glass: np.ndarray


@dataclass(frozen=True)
class MosaicConfig:
    """Ranges the generator draws from (``(low, high)`` pairs; px at the training resolution).

    The glass stays above the paper's 230 threshold by default (real brightfield scanners put it
    at about 235..252; darker glass makes every block "tissue" to the paper's rule).
    """

    size: tuple[int, int] = (768, 1024)  #: mosaic (height, width) px
    n_pieces: tuple[int, int] = (4, 12)  #: pieces per mosaic (inclusive)
    piece_side: tuple[int, int] = (96, 360)  #: side of the window a piece is cut from, px
    angle: tuple[float, float] = (-180.0, 180.0)  #: arbitrary rotation after the 90-degree one, degrees
    stain_scale: tuple[float, float] = (0.7, 1.3)  #: per-stain optical density scale (H, E, D)
    glass_grey: tuple[float, float] = (236.0, 250.0)  #: glass grey level
    glass_tint: float = 3.0  #: per-channel tint, +- grey levels
    glass_gradient: float = 3.0  #: smooth illumination field amplitude, grey levels
    glass_noise: tuple[float, float] = (0.5, 3.0)  #: per-pixel noise sd, grey levels
    folds: tuple[int, int] = (0, 2)  #: folds per mosaic (inclusive)
    pen_marks: tuple[int, int] = (0, 3)  #: pen strokes per mosaic (inclusive)
    pen_width: tuple[int, int] = (6, 60)  #: pen stroke width, px
    dust: tuple[int, int] = (0, 150)  #: dust specks and fibres per mosaic (inclusive)


@dataclass(frozen=True)
class Placement:
    """One piece laid on the mosaic.

    Attributes
    ----------
    source : the source's name (a fold: ``"fold of piece <i>"``).
    window : (y, x, height, width) px of the cut window in the source (a fold: in piece i's box).
    rot90 : counter-clockwise quarter turns (``np.rot90``), applied first.
    flip : mirrored left-right (``np.fliplr``) after the quarter turns.
    angle : then rotated by this many degrees (counter-clockwise) with ``matrix``.
    matrix : float64 (2, 3) affine map (``cv2.warpAffine``) from the turned window to the box.
    offset : (y, x) px of the box's top-left corner in the mosaic.
    stain : (H, E, D) optical density scales.
    cut : uint8 {0, 1} mask of the piece in the window (a subset of the source's mask there).
    mask : uint8 {0, 1} mask of the piece in its box (``cut`` carried through the transforms).
    """

    source: str
    window: tuple[int, int, int, int]
    rot90: int
    flip: bool
    angle: float
    matrix: np.ndarray
    offset: tuple[int, int]
    stain: tuple[float, float, float]
    cut: np.ndarray
    mask: np.ndarray


@dataclass
class Mosaic:
    """A generated mosaic.

    Attributes
    ----------
    rgb : uint8 (H, W, 3) image.
    label : uint8 (H, W) {0, 1}: the paper's label of ``rgb`` (the training target).
    pieces : uint8 (H, W) {0, 1}: union of the pasted pieces' masks.
    pen : bool (H, W): pen ink.
    dust : bool (H, W): dust.
    glass : float64 (3,) mean RGB of the glass (before noise).
    placements : every piece and fold, in the order laid.
    """

    rgb: np.ndarray
    label: np.ndarray
    pieces: np.ndarray
    pen: np.ndarray
    dust: np.ndarray
    glass: np.ndarray
    placements: list[Placement] = field(default_factory=list)


def glass_level(rgb: np.ndarray, mask: np.ndarray, min_fraction: float = 0.02) -> np.ndarray:
    """RGB level of the glass: the median of the pixels ``mask`` calls glass; when under
    ``min_fraction`` of the image is glass (a microscope field), the 99th percentile per channel."""
    glass = mask == 0
    if glass.mean() >= min_fraction:
        level = np.median(rgb[glass].astype(np.float64), axis=0)
    else:
        level = np.percentile(rgb.reshape(-1, 3).astype(np.float64), 99, axis=0)
    return np.maximum(level, 1.0)


def source_from_rgb(name: str, rgb: np.ndarray) -> TissueSource:
    """A :class:`TissueSource` from an RGB image: mask by the paper's labels, glass by :func:`glass_level`."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"source {name}: expected a uint8 (H, W, 3) RGB image, got {rgb.dtype} {rgb.shape}")
    mask = paper_labels(rgb)
    return TissueSource(name, rgb, mask, glass_level(rgb, mask))


def read_source(path: str | os.PathLike, mpp: float, *, rows: tuple[float, float] = (0.0, 1.0),
                level0_mpp: float | None = None) -> TissueSource:
    """Read a slide whole at ``mpp`` um/px and keep the band of rows ``rows`` (fractions of its height).

    Parameters
    ----------
    path : a slide the package's readers open.
    mpp : training resolution, um/px.
    rows : (start, stop) fractions of the height kept, e.g. (0, 0.5) the top half.
    level0_mpp : um per level-0 px, overriding the file's value (for files whose value is a
        placeholder); None: the file's value (an error when it has none).
    """
    from wsi_pipeline.slides.mpp import resolve_mpp
    from wsi_pipeline.slides.opener import open_slide
    from wsi_pipeline.slides.scaled import read_scaled

    if not 0.0 <= rows[0] < rows[1] <= 1.0:
        raise ValueError(f"{path}: rows must be fractions 0 <= start < stop <= 1, got {rows}")
    with open_slide(path) as slide:
        if level0_mpp is None:
            level0_mpp, _ = resolve_mpp(slide.mpp, run_mpp=None, path=str(path), needed_for=f"reading at {mpp} um/px")
        if level0_mpp is None:  # (resolve_mpp raises first: needed_for is given)
            raise ValueError(f"{path}: no pixel size (mpp) for reading at {mpp} um/px")
        down = mpp / level0_mpp
        if down < 1:
            raise ValueError(f"{path}: {mpp} um/px is finer than its level 0 ({level0_mpp:.4g} um/px)")
        rgb = read_scaled(slide, down)
    h = rgb.shape[0]
    y0, y1 = int(round(rows[0] * h)), int(round(rows[1] * h))
    return source_from_rgb(f"{Path(path).name}[rows {rows[0]:g}-{rows[1]:g}]", np.ascontiguousarray(rgb[y0:y1]))


def _blob(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """bool (h, w): a random smooth blob (a noisy ellipse) filling much of the window."""
    import cv2

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    ry, rx = rng.uniform(0.3, 0.5) * h, rng.uniform(0.3, 0.5) * w
    ang = rng.uniform(0, np.pi)
    dy, dx = yy - cy, xx - cx
    u = (dx * np.cos(ang) + dy * np.sin(ang)) / rx
    v = (-dx * np.sin(ang) + dy * np.cos(ang)) / ry
    noise = cv2.GaussianBlur(rng.standard_normal((h, w)).astype(np.float32), (0, 0), max(2.0, 0.08 * min(h, w)))
    noise = noise / (noise.std() + 1e-6)
    return (1 - (u * u + v * v) + 0.35 * noise) > 0


def cut_piece(source: TissueSource, rng: np.random.Generator, side: int,
              tries: int = 20) -> tuple[tuple[int, int, int, int], np.ndarray, np.ndarray]:
    """Cut a piece of about ``side`` px around a random tissue pixel of ``source``.

    Returns ``(window (y, x, h, w), transmission float32 (h, w, 3) in 0..1 (1 outside the piece),
    cut mask uint8 (h, w) {0, 1})``; the cut mask is the source's mask in the window intersected
    with a random blob. Raises ValueError when the source has no tissue.
    """
    ys, xs = np.nonzero(source.mask)
    if ys.size == 0:
        raise ValueError(f"source {source.name} has no tissue to cut")
    H, W = source.mask.shape
    best: tuple[tuple[int, int, int, int], np.ndarray] | None = None
    for _ in range(tries):
        i = int(rng.integers(ys.size))
        h, w = min(H, side), min(W, side)
        y = int(np.clip(ys[i] - h // 2, 0, H - h))
        x = int(np.clip(xs[i] - w // 2, 0, W - w))
        cut = (source.mask[y : y + h, x : x + w] != 0) & _blob(rng, h, w)
        if best is None or cut.sum() > best[1].sum():
            best = ((y, x, h, w), cut)
        if cut.mean() >= 0.15:
            break
    if best is None:
        raise ValueError(f"tries={tries}; expected >= 1")
    (y, x, h, w), cut = best
    trans = np.clip(source.rgb[y : y + h, x : x + w].astype(np.float32) / source.glass.astype(np.float32), 0.0, 1.0)
    trans[~cut] = 1.0
    return (y, x, h, w), trans, cut.astype(np.uint8)


def orient(img: np.ndarray, rot90: int, flip: bool) -> np.ndarray:
    """``np.rot90(img, rot90)`` then, if ``flip``, ``np.fliplr`` (exact)."""
    out = np.rot90(img, int(rot90) % 4)
    return np.ascontiguousarray(np.fliplr(out) if flip else out)


def rotation_matrix(h: int, w: int, angle: float) -> tuple[np.ndarray, tuple[int, int]]:
    """Affine (2, 3) matrix rotating an (h, w) image by ``angle`` degrees about its centre into a
    box that holds all of it, and the box's (height, width) px."""
    import cv2

    m = cv2.getRotationMatrix2D(((w - 1) / 2.0, (h - 1) / 2.0), float(angle), 1.0)
    c, s = abs(m[0, 0]), abs(m[0, 1])
    bw, bh = int(np.ceil(w * c + h * s)), int(np.ceil(w * s + h * c))
    m[0, 2] += (bw - 1) / 2.0 - (w - 1) / 2.0
    m[1, 2] += (bh - 1) / 2.0 - (h - 1) / 2.0
    return m, (bh, bw)


def _warp(trans: np.ndarray, mask: np.ndarray, m: np.ndarray, box: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    import cv2

    bh, bw = box
    t = cv2.warpAffine(trans, m, (bw, bh), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=(1.0, 1.0, 1.0))
    k = cv2.warpAffine(mask, m, (bw, bh), flags=cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    t[k == 0] = 1.0
    return t, k


def stain_jitter(trans: np.ndarray, scale: Sequence[float]) -> np.ndarray:
    """Scale the haematoxylin, eosin and DAB optical densities of a transmission image (0..1).

    OD = -log(T) (T floored at 1e-4) is unmixed with ``skimage.color.hed_from_rgb``, each stain's
    density multiplied by ``scale``, mixed back with ``rgb_from_hed``; returns float32 in 0..1.
    """
    from skimage.color import hed_from_rgb, rgb_from_hed

    od = -np.log(np.clip(trans.astype(np.float64), 1e-4, 1.0))
    stains = od.reshape(-1, 3) @ hed_from_rgb
    stains *= np.asarray(scale, np.float64)
    out = np.exp(-(stains @ rgb_from_hed)).reshape(trans.shape)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def _glass(rng: np.random.Generator, cfg: MosaicConfig) -> tuple[np.ndarray, np.ndarray]:
    """(float32 (H, W, 3) noisy glass, its mean RGB)."""
    import cv2

    h, w = cfg.size
    grey = rng.uniform(*cfg.glass_grey)
    mean = grey + rng.uniform(-cfg.glass_tint, cfg.glass_tint, size=3)
    small = rng.standard_normal((max(2, h // 64), max(2, w // 64))).astype(np.float32)
    field_ = cv2.resize(cv2.GaussianBlur(small, (0, 0), 2.0), (w, h), interpolation=cv2.INTER_CUBIC)
    field_ *= cfg.glass_gradient / (np.abs(field_).max() + 1e-6)
    sd = rng.uniform(*cfg.glass_noise)
    noise = rng.standard_normal((h, w, 3)).astype(np.float32) * sd
    return mean.astype(np.float32) + field_[..., None] + noise, mean


def _pen(rng: np.random.Generator, cfg: MosaicConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 (H, W, 3) transmission of ``n`` pen strokes, bool ink mask)."""
    import cv2

    h, w = cfg.size
    trans = np.ones((h, w, 3), np.float32)
    ink = np.zeros((h, w), bool)
    for _ in range(n):
        k = int(rng.integers(3, 7))
        start = rng.uniform([0, 0], [w, h])
        steps = rng.normal(0, 0.25 * min(h, w), size=(k, 2)).cumsum(axis=0)
        pts = np.round(start + steps).astype(np.int32)
        stroke = np.zeros((h, w), np.uint8)
        cv2.polylines(stroke, [pts.reshape(-1, 1, 2)], False, 1, thickness=int(rng.integers(*cfg.pen_width, endpoint=True)))
        colour = np.asarray(PEN_INKS[int(rng.integers(len(PEN_INKS)))], np.float32) ** rng.uniform(0.6, 1.4)
        on = stroke.astype(bool)
        trans[on] *= colour
        ink |= on
    return trans, ink


def _dust(rng: np.random.Generator, cfg: MosaicConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 (H, W) transmission of ``n`` specks and fibres, slightly out of focus; bool mask)."""
    import cv2

    h, w = cfg.size
    od = np.zeros((h, w), np.float32)
    for _ in range(n):
        x, y = int(rng.integers(w)), int(rng.integers(h))
        dens = float(rng.uniform(0.3, 2.0))
        if rng.random() < 0.8:  # speck
            cv2.circle(od, (x, y), int(rng.integers(1, 5)), dens, thickness=-1)
        else:  # fibre
            pts = np.round(np.array([x, y]) + rng.normal(0, 12, size=(4, 2)).cumsum(axis=0)).astype(np.int32)
            cv2.polylines(od, [pts.reshape(-1, 1, 2)], False, 0.5 * dens, thickness=int(rng.integers(1, 3)))
    blurred = cv2.GaussianBlur(od, (0, 0), 0.8)
    return np.exp(-blurred), blurred > 0.05


def make_mosaic(sources: Sequence[TissueSource], seed: int, config: MosaicConfig | None = None) -> Mosaic:
    """Build one mosaic from pieces of ``sources`` (see the module docstring); deterministic in ``seed``."""
    cfg = config or MosaicConfig()
    h, w = cfg.size
    if h < 32 or w < 32:
        raise ValueError(f"mosaic size must be at least 32 x 32 px, got {cfg.size}")
    rng = np.random.default_rng(seed)
    glass, mean = _glass(rng, cfg)
    total = np.ones((h, w, 3), np.float32)
    pieces = np.zeros((h, w), np.uint8)
    placements: list[Placement] = []
    n = int(rng.integers(cfg.n_pieces[0], cfg.n_pieces[1], endpoint=True)) if sources else 0
    for _ in range(n):
        src = sources[int(rng.integers(len(sources)))]
        side = int(rng.integers(*cfg.piece_side, endpoint=True))
        window, trans, cut = cut_piece(src, rng, side)
        k, flip = int(rng.integers(4)), bool(rng.random() < 0.5)
        angle = float(rng.uniform(*cfg.angle))
        s_r, s_g, s_b = (float(v) for v in rng.uniform(*cfg.stain_scale, size=3))
        stain = (s_r, s_g, s_b)
        t, c = orient(trans, k, flip), orient(cut, k, flip)
        m, box = rotation_matrix(t.shape[0], t.shape[1], angle)
        t, mk = _warp(t, c, m, box)
        t = stain_jitter(t, stain)
        t[mk == 0] = 1.0
        bh, bw = min(box[0], h), min(box[1], w)
        t, mk = t[:bh, :bw], mk[:bh, :bw]
        oy, ox = int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1))
        total[oy : oy + bh, ox : ox + bw] *= t
        pieces[oy : oy + bh, ox : ox + bw] |= mk
        placements.append(Placement(src.name, window, k, flip, angle, m, (oy, ox), stain, cut, mk))
    n_folds = int(rng.integers(cfg.folds[0], cfg.folds[1], endpoint=True)) if placements else 0
    for _ in range(n_folds):
        i = int(rng.integers(len(placements)))
        p = placements[i]
        bh, bw = p.mask.shape
        oy, ox = p.offset
        # a band along the left or right edge of the piece's box, mirrored over its inner edge
        band = max(4, int(rng.uniform(0.15, 0.35) * bw))
        left = bool(rng.random() < 0.5)
        x0 = 0 if left else bw - band
        if 2 * band > bw:
            continue
        t_box = total[oy : oy + bh, ox : ox + bw]
        piece_t = np.where(p.mask[..., None] != 0, t_box, 1.0).astype(np.float32)
        flap_t = piece_t[:, x0 : x0 + band][:, ::-1]
        flap_m = p.mask[:, x0 : x0 + band][:, ::-1]
        fx = band if left else bw - 2 * band
        total[oy : oy + bh, ox + fx : ox + fx + band] *= np.where(flap_m[..., None] != 0, flap_t, 1.0)
        pieces[oy : oy + bh, ox + fx : ox + fx + band] |= flap_m
        placements.append(Placement(f"fold of piece {i}", (0, x0, bh, band), 0, True, 0.0,
                                    np.array([[1.0, 0, 0], [0, 1.0, 0]]), (oy, ox + fx), (1.0, 1.0, 1.0),
                                    np.ascontiguousarray(p.mask[:, x0 : x0 + band]), np.ascontiguousarray(flap_m)))
    pen_t, pen = _pen(rng, cfg, int(rng.integers(cfg.pen_marks[0], cfg.pen_marks[1], endpoint=True)))
    dust_t, dust = _dust(rng, cfg, int(rng.integers(cfg.dust[0], cfg.dust[1], endpoint=True)))
    total *= pen_t
    total *= dust_t[..., None]
    rgb = np.clip(np.rint(glass * total), 0, 255).astype(np.uint8)
    return Mosaic(rgb, paper_labels(rgb), pieces, pen, dust, mean.astype(np.float64), placements)


def write_mosaic_slide(path: str | os.PathLike, rgb: np.ndarray, mpp: float, quality: int = 92) -> Path:
    """Write ``rgb`` as a one-level Aperio-layout slide (JPEG tiles, ``MPP = mpp``) that the
    package's readers open; atomic (temp file + rename)."""
    from wsi_pipeline.synthetic.fields import write_one_level_slide

    return write_one_level_slide(Path(path), rgb, mpp, quality, generator="wsi_pipeline.tissue_seg.mosaic")


def write_mosaics(folder: str | os.PathLike, sources: Sequence[TissueSource], n: int, *, mpp: float, seed: int,
                  prefix: str = "mosaic", config: MosaicConfig | None = None) -> list[Path]:
    """Write ``n`` mosaics (seeds ``[seed, i]``) as slides ``<prefix>_<i>.svs`` in ``folder``;
    existing files are kept (the generation is deterministic). Returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"{prefix}_{i:03d}.svs"
        if not p.exists():
            m = make_mosaic(sources, seed=int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), config=config)
            write_mosaic_slide(p, m.rgb, mpp)
        paths.append(p)
    return paths
