"""Synthetic whole-slide images: pyramidal, tiled JPEG TIFFs in the Aperio SVS layout.

OpenSlide and tiffslide both open them and both report their mpp (from the SVS description).
A slide is H&E-like tissue (:func:`wsi_pipeline.synthetic.texture.paint_tissue`) on a near-white
background, optionally with pen marks and planted lesions (dense clusters of dark nuclei) whose
ground-truth mask is returned. Level 0 is painted and written one tile row at a time, so a
20000 x 20000 px slide never holds level 0 in memory (only level 1, 1/16 of it). Everything is
deterministic in ``seed``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.synthetic.texture import HE_STAIN, Stain, paint_tissue
from wsi_pipeline.io_atomic import atomic_path

__all__ = ["SyntheticSlide", "make_slide", "BACKGROUND_GREY", "write_image_slide"]

#: Grey level of the glass background (scanners white-balance to about 245-252).
BACKGROUND_GREY = 250
#: Widest region (px) painted in one call.
_PAINT_CHUNK = 2048
#: Pen colours (RGB): green, blue, black.
_PENS = ((40, 150, 70), (40, 70, 170), (35, 35, 40))


@dataclass(frozen=True)
class SyntheticSlide:
    """A written synthetic slide and its ground truth.

    Attributes
    ----------
    path : the ``.svs`` file.
    size : (width, height) of level 0 in px.
    mpp : um per level-0 px (None: the file has no resolution metadata).
    mask_downsample : level-0 px per mask px (for ``tissue`` and ``lesion``).
    tissue : bool (h, w) tissue mask.
    lesion : bool (h, w) planted-lesion mask (inside the tissue).
    lesion_fraction : lesion area / tissue area.
    n_lesions : number of planted lesion regions.
    level_dimensions : (width, height) per pyramid level.
    """

    path: Path
    size: tuple[int, int]
    mpp: float | None
    mask_downsample: int
    tissue: np.ndarray
    lesion: np.ndarray
    lesion_fraction: float
    n_lesions: int
    level_dimensions: tuple[tuple[int, int], ...]


def _smooth_noise(rng: np.random.Generator, h: int, w: int, sigma: float) -> np.ndarray:
    import cv2

    f = cv2.GaussianBlur(rng.standard_normal((h, w)).astype(np.float32), (0, 0), max(sigma, 0.5))
    return (f - f.mean()) / (f.std() + 1e-6)


def _tissue_shape(rng: np.random.Generator, mh: int, mw: int, fraction: float) -> np.ndarray:
    """Bool (mh, mw): a few irregular tissue fragments covering about ``fraction`` of the slide."""
    yy, xx = np.mgrid[0:mh, 0:mw].astype(np.float32)
    field: np.ndarray = np.full((mh, mw), -np.inf, np.float32)
    n_frag = int(rng.integers(1, 4))
    for _ in range(n_frag):
        cy, cx = rng.uniform(0.3, 0.7) * mh, rng.uniform(0.3, 0.7) * mw
        ry, rx = rng.uniform(0.2, 0.4) * mh, rng.uniform(0.2, 0.4) * mw
        ang = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = (dx * np.cos(ang) + dy * np.sin(ang)) / rx
        v = (-dx * np.sin(ang) + dy * np.cos(ang)) / ry
        field = np.maximum(field, 1 - (u * u + v * v))
    field = field + 0.35 * _smooth_noise(rng, mh, mw, 0.06 * min(mh, mw))
    # keep tissue off the slide's edge, as on a real slide
    edge = np.minimum.reduce([yy, xx, mh - 1 - yy, mw - 1 - xx]) / max(1.0, 0.04 * min(mh, mw))
    field = np.where(edge < 1, -np.inf, field)
    thr = np.quantile(field[np.isfinite(field)], 1 - fraction) if np.isfinite(field).any() else np.inf
    return field > thr


def _lesions(rng: np.random.Generator, tissue: np.ndarray, n: int, size: float) -> np.ndarray:
    """Bool mask of ``n`` irregular lesion blobs inside ``tissue`` (radius ~ ``size`` x tissue extent)."""
    import cv2

    mh, mw = tissue.shape
    lesion = np.zeros_like(tissue)
    if n <= 0 or not tissue.any():
        return lesion
    inner = cv2.distanceTransform(tissue.astype(np.uint8), cv2.DIST_L2, 3)
    ys, xs = np.nonzero(inner >= max(1.0, 0.5 * inner.max()))
    scale = math.sqrt(tissue.sum())
    yy, xx = np.mgrid[0:mh, 0:mw].astype(np.float32)
    noise = _smooth_noise(rng, mh, mw, max(1.0, 0.02 * min(mh, mw)))
    for _ in range(n):
        i = int(rng.integers(len(ys)))
        r = max(2.0, rng.uniform(0.6, 1.4) * size * scale)
        d = np.hypot((yy - ys[i]) / (r * rng.uniform(0.7, 1.3)), (xx - xs[i]) / (r * rng.uniform(0.7, 1.3)))
        lesion |= (1 - d + 0.25 * noise) > 0
    return lesion & tissue


def _pen_strokes(rng: np.random.Generator, w: int, h: int, n: int) -> list[tuple[np.ndarray, tuple[int, int, int], int]]:
    """``n`` pen strokes: (points (k, 2) level-0 px, RGB colour, thickness px)."""
    strokes = []
    for _ in range(n):
        k = int(rng.integers(4, 9))
        start = rng.uniform([0.1 * w, 0.1 * h], [0.9 * w, 0.9 * h])
        steps = rng.normal(0, 0.06 * min(w, h), (k, 2)).cumsum(0)
        pts = np.clip(start + steps, 0, [w - 1, h - 1]).astype(np.int32)
        colour = _PENS[int(rng.integers(len(_PENS)))]
        strokes.append((pts, colour, max(3, int(0.012 * min(w, h)))))
    return strokes


def _upsample_rows(mask: np.ndarray, md: int, y0: int, y1: int, w: int) -> np.ndarray:
    """Bilinear upsampling of a low-res float map to level-0 rows [y0, y1) (full width ``w``), seamless across calls."""
    import cv2

    mh, mw = mask.shape
    r0, r1 = y0 // md, -(-y1 // md)
    padded = np.pad(mask.astype(np.float32), 1, mode="edge")
    block = padded[r0 : r1 + 2]  # one row of context on each side
    up = cv2.resize(block, ((mw + 2) * md, block.shape[0] * md), interpolation=cv2.INTER_LINEAR)
    top = md + (y0 - r0 * md)
    return up[top : top + (y1 - y0), md : md + w]


def _paint_strip(
    y0: int, y1: int, w: int, *, seed: int, md: int, alpha_map: np.ndarray, lesion_map: np.ndarray,
    strokes: list, tint: tuple[float, float, float], noise: float, tile: int, lesion_contrast: float = 1.0,
    mimic_map: np.ndarray | None = None, nuclei_density: float = 1.0, glass_grey: int = BACKGROUND_GREY,
    stain: Stain = HE_STAIN, od_matrix: tuple | None = None,
) -> np.ndarray:
    """Level-0 rows [y0, y1): uint8 (y1 - y0, w, 3)."""
    import cv2

    h = y1 - y0
    rng = np.random.default_rng([seed, 7, y0])
    bg_noise = min(noise, 1.0) + 0.25 * max(0.0, noise - 4.0)  # scanner noise shows on the glass too
    base = np.full((h, w), float(glass_grey) + 0.5, np.float32)
    if bg_noise > 0:
        base += bg_noise * rng.standard_normal((h, w), dtype=np.float32)
    base_u8 = np.clip(base, 0, 255).astype(np.uint8)
    img = np.repeat(base_u8[..., None], 3, axis=2)
    alpha = _upsample_rows(alpha_map, md, y0, y1, w)
    cols = np.flatnonzero(alpha.max(axis=0) > 0.003)
    if cols.size:
        x0 = (cols[0] // tile) * tile
        x1 = min(w, -(-(cols[-1] + 1) // tile) * tile)
        lesion_all = _upsample_rows(lesion_map, md, y0, y1, w) > 0.5
        mimic_all = _upsample_rows(mimic_map, md, y0, y1, w) > 0.5 if mimic_map is not None else None
        # paint in tile-aligned chunks: paint_tissue's temporaries (~50 bytes/px) stay bounded
        for c0 in range(x0, x1, _PAINT_CHUNK):
            c1 = min(x1, c0 + _PAINT_CHUNK)
            lesion = lesion_all[:, c0:c1]
            mimic = mimic_all[:, c0:c1] if mimic_all is not None else None
            tissue = paint_tissue(rng, h, c1 - c0, lesion=lesion if lesion.any() else None, tint=tint, noise=noise,
                                  lesion_contrast=lesion_contrast, mimic=mimic, nuclei_density=nuclei_density, stain=stain,
                                  od_matrix=od_matrix)
            a = alpha[:, c0:c1, None]
            mixed = base[:, c0:c1, None] * (1 - a) + tissue.astype(np.float32) * a
            img[:, c0:c1] = np.clip(mixed, 0, 255).astype(np.uint8)
    if strokes:
        ink = np.zeros((h, w), np.uint8)
        for pts, colour, thick in strokes:
            ink[:] = 0
            cv2.polylines(ink, [pts - np.array([0, y0], np.int32)], False, 255, thick, cv2.LINE_AA)
            bx, by, bw, bh = cv2.boundingRect(ink)
            if bw == 0 or bh == 0:
                continue
            a = ink[by : by + bh, bx : bx + bw].astype(np.float32)[..., None] * (0.85 / 255)
            part = img[by : by + bh, bx : bx + bw].astype(np.float32)
            img[by : by + bh, bx : bx + bw] = np.clip(part * (1 - a) + np.asarray(colour, np.float32) * a + 0.5, 0, 255).astype(np.uint8)
    return img


def _level_sizes(w: int, h: int, factor: int, min_side: int) -> list[tuple[int, int]]:
    sizes = [(w, h)]
    while min(sizes[-1]) // factor >= min_side:
        sizes.append((sizes[-1][0] // factor, sizes[-1][1] // factor))
    return sizes


def _tiles_of(img: np.ndarray, tile: int, fill: int) -> Iterator[np.ndarray]:
    """Row-major tiles of ``img`` (rows of tiles), padded with ``fill`` at the right and bottom."""
    h, w = img.shape[:2]
    for y in range(0, h, tile):
        yield from _row_tiles(img[y : y + tile], tile, fill)


def _row_tiles(strip: np.ndarray, tile: int, fill: int) -> Iterator[np.ndarray]:
    h, w = strip.shape[:2]
    for x in range(0, w, tile):
        t = strip[:, x : x + tile]
        if t.shape[:2] != (tile, tile):
            full = np.full((tile, tile, 3), fill, np.uint8)
            full[: t.shape[0], : t.shape[1]] = t
            t = full
        yield np.ascontiguousarray(t)


def _checked_geometry(
    size: int | tuple[int, int], tile_size: int, mask_downsample: int, level_factor: int, glass_grey: int,
) -> tuple[int, int, int, int, int]:
    """Validate :func:`make_slide`'s geometry; return (width px, height px, tile px, mask downsample, glass grey)."""
    if isinstance(size, (tuple, list, np.ndarray)):
        w, h = int(size[0]), int(size[1])
    else:
        w = h = int(size)
    T, md = int(tile_size), int(mask_downsample)
    if T % 16 or T < 16:
        raise ValueError(f"tile_size={tile_size} must be a positive multiple of 16 (a TIFF requirement)")
    if T % md:
        raise ValueError(f"mask_downsample={mask_downsample} must divide tile_size={tile_size}")
    if level_factor not in (2, 4):
        raise ValueError(f"level_factor={level_factor}; expected 2 or 4")
    if min(w, h) < T:
        raise ValueError(f"size={size} is smaller than one tile ({T} px)")
    if not 0 <= int(glass_grey) <= 255:
        raise ValueError(f"glass_grey={glass_grey} must be a grey level in [0, 255]")
    return w, h, T, md, int(glass_grey)


@dataclass(frozen=True)
class _Layout:
    """What a slide shows, at mask resolution (``md`` level-0 px per px), before painting."""

    tissue: np.ndarray  # bool (mh, mw)
    lesion: np.ndarray  # bool (mh, mw), the planted lesions
    alpha_map: np.ndarray  # float32 (mh, mw): tissue opacity, soft edges
    lesion_map: np.ndarray  # float32 (mh, mw): rounded lesion outlines for painting
    mimic_map: np.ndarray | None  # float32 (mh, mw) benign mimics, or None
    strokes: list  # pen strokes, as :func:`_pen_strokes` returns them


def _draw_layout(
    seed: int, w: int, h: int, md: int, *, blank: bool, tissue_fraction: float | None, n_lesions: int,
    lesion_size: float, pen_marks: int, n_mimics: int,
) -> _Layout:
    """Draw tissue, lesions, pen strokes and mimics of a ``w`` x ``h`` px slide from ``seed``."""
    import cv2

    rng = np.random.default_rng(seed)
    mh, mw = -(-h // md), -(-w // md)
    frac = float(rng.uniform(0.25, 0.45)) if tissue_fraction is None else float(tissue_fraction)
    tissue = np.zeros((mh, mw), bool) if blank else _tissue_shape(rng, mh, mw, frac)
    lesion = _lesions(rng, tissue, 0 if blank else n_lesions, lesion_size)
    # soft tissue edges: faint tissue fades into the glass over ~1.5 mask px
    alpha_map = cv2.GaussianBlur(tissue.astype(np.float32), (0, 0), 0.8) if tissue.any() else np.zeros((mh, mw), np.float32)
    alpha_map = np.clip(alpha_map * 1.25, 0, 1)
    # rounded lesion outlines for painting (the returned mask stays the planted one)
    lesion_map = cv2.GaussianBlur(lesion.astype(np.float32), (0, 0), 0.7) if lesion.any() else np.zeros((mh, mw), np.float32)
    strokes = [] if blank else _pen_strokes(rng, w, h, int(pen_marks))
    mimic_map = None
    if n_mimics and not blank:  # own generator: slides without mimics stay as they were
        mimic = _lesions(np.random.default_rng([seed, 11]), tissue & ~lesion, int(n_mimics), lesion_size)
        mimic_map = cv2.GaussianBlur(mimic.astype(np.float32), (0, 0), 0.7) if mimic.any() else None
    return _Layout(tissue, lesion, alpha_map, lesion_map, mimic_map, strokes)


def _level0_tiles(
    w: int, h: int, T: int, f: int, level1: np.ndarray | None, glass_grey: int, **paint: Any,
) -> Iterator[np.ndarray]:
    """Paint level 0 one tile row at a time and yield its tiles; fill ``level1`` (``f`` x smaller) on the way.

    ``paint`` holds :func:`_paint_strip`'s keyword arguments other than the rows, width, tile and grey.
    """
    import cv2

    for y0 in range(0, h, T):
        y1 = min(h, y0 + T)
        strip = _paint_strip(y0, y1, w, tile=T, glass_grey=glass_grey, **paint)
        if level1 is not None:
            r0, r1 = y0 // f, min(level1.shape[0], y1 // f)
            if r1 > r0:
                part = strip[: (r1 - r0) * f, : level1.shape[1] * f]
                level1[r0:r1] = cv2.resize(part, (level1.shape[1], r1 - r0), interpolation=cv2.INTER_AREA)
        yield from _row_tiles(strip, T, glass_grey)


def _svs_descriptions(path: Path, w: int, h: int, T: int, quality: int, mpp: float | None) -> tuple[str, str, dict[str, Any]]:
    """(common header, level-0 ImageDescription, TIFF resolution tags) in the Aperio SVS style."""
    head = f"Aperio Image Library v12.0.16\r\n{w}x{h} [0,0 {w}x{h}] ({T}x{T}) JPEG/RGB Q={quality}"
    if mpp is not None:
        if not mpp > 0:
            raise ValueError(f"mpp={mpp} must be > 0 um/px (or None for no resolution metadata)")
        desc0 = f"{head}|AppMag = {10.0 / mpp:g}|MPP = {mpp:.6g}|Filename = {path.stem}|Generator = wsi_pipeline.synthetic"
        resolution = {"resolution": (1e4 / mpp, 1e4 / mpp), "resolutionunit": "CENTIMETER"}
    else:
        desc0 = f"{head}|Filename = {path.stem}|Generator = wsi_pipeline.synthetic"
        resolution = {}
    return head, desc0, resolution


def _write_svs(
    path: Path, tiles0: Iterator[np.ndarray], level1: np.ndarray | None, sizes: list[tuple[int, int]], *,
    T: int, f: int, quality: int, mpp: float | None, glass_grey: int, lossless: bool = False,
) -> None:
    """Write the SVS file atomically: level 0 from ``tiles0``, the thumbnail, then the lower levels.

    ``level1`` is filled while ``tiles0`` is consumed; the lower levels are downsampled from it.
    ``lossless``: level 0 compressed with Deflate (pixels read back exactly) instead of JPEG.
    """
    import cv2
    import tifffile

    w, h = sizes[0]
    head, desc0, resolution = _svs_descriptions(path, w, h, T, quality, mpp)
    # photometric "rgb" + JPEG: tifffile stores YCbCr 4:2:0 JPEG tiles (as scanners do) from RGB input
    jpeg: dict[str, Any] = {"compression": "jpeg", "compressionargs": {"level": int(quality)}, "photometric": "rgb"}
    level0: dict[str, Any] = {"compression": "zlib", "photometric": "rgb"} if lossless else jpeg
    with atomic_path(path) as tmp, tifffile.TiffWriter(tmp, bigtiff=w * h * 3 > 2**31) as tw:
        tw.write(tiles0, shape=(h, w, 3), dtype=np.uint8, tile=(T, T), description=desc0,
                 metadata=None, **resolution, **level0)
        levels = [level1] if level1 is not None else []
        for lw, lh in sizes[2:]:
            levels.append(cv2.resize(levels[-1][: lh * f, : lw * f], (lw, lh), interpolation=cv2.INTER_AREA))
        # SVS layout: the second directory is a stripped thumbnail, the other levels follow
        small = levels[-1] if levels else None
        if small is None:
            thumb = cv2.resize(np.full((h, w, 3), glass_grey, np.uint8), (max(1, w // 8), max(1, h // 8)))
        else:
            thumb = small
        tw.write(thumb, description=f"{head} -> {thumb.shape[1]}x{thumb.shape[0]} - ", metadata=None, **jpeg)
        for img in levels:
            lh_, lw_ = img.shape[:2]
            tw.write(_tiles_of(img, T, glass_grey), shape=img.shape, dtype=np.uint8, tile=(T, T),
                     description=f"{head} -> {lw_}x{lh_} JPEG/RGB Q={quality}", metadata=None, **jpeg)


def make_slide(
    path: str | os.PathLike,
    *,
    size: int | tuple[int, int] = 2048,
    tile_size: int = 256,
    mpp: float | None = 0.5,
    seed: int = 0,
    n_lesions: int = 0,
    lesion_size: float = 0.12,
    tissue_fraction: float | None = None,
    pen_marks: int = 0,
    blank: bool = False,
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0),
    noise: float = 4.0,
    quality: int = 90,
    lesion_contrast: float = 1.0,
    level_factor: int = 4,
    mask_downsample: int = 16,
    n_mimics: int = 0,
    nuclei_density: float = 1.0,
    glass_grey: int = BACKGROUND_GREY,
    stain: Stain = HE_STAIN,
    od_matrix: tuple | None = None,
) -> SyntheticSlide:
    """Write a synthetic slide.

    Parameters
    ----------
    path : output file (``.svs`` recommended; the layout is Aperio SVS either way).
    size : level-0 side, or (width, height), in px.
    tile_size : TIFF tile side in px (multiple of 16).
    mpp : um per level-0 px, written as the SVS ``MPP`` (0.5 = 20x); None writes a slide
        without resolution metadata (readers report no mpp).
    seed : all randomness derives from it.
    n_lesions : lesion regions to plant (0 = a negative slide).
    lesion_size : lesion radius relative to the square root of the tissue area.
    tissue_fraction : fraction of the slide covered by tissue; None = drawn in [0.25, 0.45].
    pen_marks : number of pen strokes (green, blue or black ink).
    blank : no tissue and no pen: background only.
    tint : per-channel stain multiplier (stain shift of an external cohort).
    noise : pixel noise (grey levels) of the tissue; the background gets a fraction of it.
    lesion_contrast : how visible lesions are, 0..1 (see :func:`~wsi_pipeline.synthetic.texture.paint_tissue`).
    n_mimics : benign mimic regions (dense small dark nuclei, outside the lesions and not in the
        lesion mask), the same size as lesions: they darken tissue as lesions do.
    nuclei_density : multiplier of the normal nuclei density.
    glass_grey : grey level (0..255) of the glass background (scanners put it anywhere from
        about 210 to 252; near 0 gives a dark, fluorescence-like background).
    stain : stroma, normal-nucleus and lesion-nucleus colours (H&E by default; e.g. an IHC
        look: pale blue counterstain, haematoxylin nuclei, DAB-brown lesion nuclei).
    od_matrix : a stain change of the tissue in optical-density space (see
        :func:`~wsi_pipeline.synthetic.texture.stain_shift_matrix`); None: none.
    quality : JPEG quality of the tiles.
    level_factor : downsample between pyramid levels (2 or 4).
    mask_downsample : level-0 px per px of the returned masks (divides ``tile_size``).

    Returns
    -------
    :class:`SyntheticSlide`.
    """
    w, h, T, md, glass_grey = _checked_geometry(size, tile_size, mask_downsample, level_factor, glass_grey)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lay = _draw_layout(seed, w, h, md, blank=blank, tissue_fraction=tissue_fraction, n_lesions=n_lesions,
                       lesion_size=lesion_size, pen_marks=pen_marks, n_mimics=n_mimics)
    sizes = _level_sizes(w, h, level_factor, max(64, T // 4))
    level1 = np.empty((sizes[1][1], sizes[1][0], 3), np.uint8) if len(sizes) > 1 else None
    tiles0 = _level0_tiles(w, h, T, level_factor, level1, glass_grey, seed=seed, md=md, alpha_map=lay.alpha_map,
                           lesion_map=lay.lesion_map, strokes=lay.strokes, tint=tint, noise=noise,
                           lesion_contrast=lesion_contrast, mimic_map=lay.mimic_map, nuclei_density=nuclei_density,
                           stain=stain, od_matrix=od_matrix)
    _write_svs(path, tiles0, level1, sizes, T=T, f=level_factor, quality=quality, mpp=mpp, glass_grey=glass_grey)
    tissue, lesion = lay.tissue, lay.lesion
    t_area = float(tissue.sum())
    return SyntheticSlide(
        path=path, size=(w, h), mpp=None if mpp is None else float(mpp), mask_downsample=md, tissue=tissue, lesion=lesion,
        lesion_fraction=float(lesion.sum()) / t_area if t_area else 0.0,
        n_lesions=int(n_lesions) if lesion.any() else 0, level_dimensions=tuple(sizes),
    )


def write_image_slide(
    path: str | os.PathLike, image: np.ndarray, *, tile_size: int = 256, mpp: float | None = 0.5, quality: int = 90,
    level_factor: int = 4, lossless: bool = True, glass_grey: int = BACKGROUND_GREY,
) -> tuple[tuple[int, int], ...]:
    """Write an RGB image held in memory as a pyramidal tiled TIFF in the Aperio SVS layout (as :func:`make_slide`).

    Parameters
    ----------
    path : output file (``.svs``).
    image : uint8 (H, W, 3) level 0.
    tile_size : TIFF tile side in px (a multiple of 16).
    mpp : um per level-0 px, written as the SVS ``MPP`` and as the TIFF resolution tags (pixels
        per cm); None: no resolution metadata.
    quality : JPEG quality of the lower levels (and of level 0 unless ``lossless``).
    level_factor : downsample between pyramid levels (2 or 4).
    lossless : level 0 Deflate-compressed, so a reader returns ``image`` exactly; False: JPEG.
    glass_grey : fill of the partial tiles at the right and bottom edges.

    Returns
    -------
    (width, height) per pyramid level.
    """
    import cv2

    img = np.ascontiguousarray(np.asarray(image, np.uint8))
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"image of shape {img.shape}: expected (H, W, 3) uint8 RGB")
    h, w = img.shape[:2]
    w, h, T, _, glass_grey = _checked_geometry((w, h), tile_size, 16, level_factor, glass_grey)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sizes = _level_sizes(w, h, level_factor, max(64, T // 4))
    level1 = None
    if len(sizes) > 1:
        lw, lh = sizes[1]
        level1 = cv2.resize(img[: lh * level_factor, : lw * level_factor], (lw, lh), interpolation=cv2.INTER_AREA)
    _write_svs(path, _tiles_of(img, T, glass_grey), level1, sizes, T=T, f=level_factor, quality=quality, mpp=mpp,
               glass_grey=glass_grey, lossless=lossless)
    return tuple(sizes)
