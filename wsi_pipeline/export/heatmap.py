"""Attention heatmaps at thumbnail resolution: tile scores painted over the slide thumbnail.

Memory is bounded by the thumbnail: every array here has the thumbnail's size (h, w) or the
number of tiles (N), never the level-0 size, so a 100 000-tile slide renders in well under a
second and a few tens of MB. Each tile covers the thumbnail rectangle of its level-0 footprint
(edges rounded to the nearest thumbnail px, at least 1 px); where tiles overlap, their
normalised scores are averaged. Only tissue (pixels covered by a tile) is coloured; the rest
of the thumbnail is left as it is.

The legend (colour bar and the normalisation in words) is drawn inside the image, in the
corner with the least tissue, so the PNG has exactly the thumbnail's size.

Ground truth, when known (the synthetic cohorts' planted lesions), is drawn as a black outline
over the colours (:func:`mask_to_thumbnail` brings a lesion mask to the thumbnail's grid), so a
reader sees at once whether attention falls on the lesions.

Normalisations (``mode``):
- ``"rank"`` (default): per-slide rank of the score, 0 = lowest tile, 1 = highest; robust to
  the softmax scale differing between slides of different size.
- ``"minmax"``: linear per slide, min -> 0, max -> 1.
- ``"raw"``: the score itself, clipped to ``[vmin, vmax]`` (default 0..1: probabilities).
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from wsi_pipeline.io_atomic import atomic_path

__all__ = ["MODES", "OUTLINE_COLOUR", "colormap", "mask_to_thumbnail", "normalise_scores", "outline_width", "tile_rects", "render_heatmap", "save_png"]

MODES: tuple[str, ...] = ("rank", "minmax", "raw")

# A diverging blue -> pale yellow -> red ramp (the ColorBrewer RdYlBu scheme, reversed).
_ANCHORS = np.array(
    [
        (49, 54, 149), (69, 117, 180), (116, 173, 209), (171, 217, 233), (255, 255, 191),
        (253, 174, 97), (244, 109, 67), (215, 48, 39), (165, 0, 38),
    ],
    dtype=np.float32,
)


def _lut() -> np.ndarray:
    return colormap(np.linspace(0.0, 1.0, 256))


def colormap(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] (clipped; nan -> 0) to uint8 RGB, shape ``values.shape + (3,)``; 1 is hottest (red)."""
    v = np.nan_to_num(np.clip(np.asarray(values, dtype=np.float32), 0.0, 1.0), nan=0.0)
    pos = v * (len(_ANCHORS) - 1)
    i0 = np.minimum(pos.astype(np.int64), len(_ANCHORS) - 2)
    t = (pos - i0)[..., None]
    rgb = _ANCHORS[i0] * (1 - t) + _ANCHORS[i0 + 1] * t
    return np.round(rgb).astype(np.uint8)


_LUT = _lut()

#: Colour (RGB) of ground-truth outlines: black, distinct from every colour of the ramp.
OUTLINE_COLOUR = (0, 0, 0)


def mask_to_thumbnail(
    mask: np.ndarray, downsample: float, level0_size: tuple[int, int], shape: tuple[int, int]
) -> np.ndarray:
    """A mask of ``downsample`` level-0 px per px, sampled onto a thumbnail's grid: bool (h, w).

    Each thumbnail px takes the mask px under its centre (nearest neighbour; a centre exactly on
    a mask px edge takes the px after it); thumbnail px
    beyond the mask's extent are False. ``level0_size`` is (W, H) level-0 px, ``shape`` (h, w).
    """
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 2:
        raise ValueError(f"mask must be 2-D (H, W); got shape {m.shape}")
    if not downsample > 0:
        raise ValueError(f"mask downsample must be > 0 level-0 px per mask px; got {downsample}")
    h, w = shape
    W, H = level0_size
    # one correctly rounded division of exact values: a centre on a mask px edge lands on the later px
    xs = np.floor((2 * np.arange(w) + 1) * float(W) / (2.0 * w * float(downsample))).astype(np.int64)
    ys = np.floor((2 * np.arange(h) + 1) * float(H) / (2.0 * h * float(downsample))).astype(np.int64)
    okx, oky = xs < m.shape[1], ys < m.shape[0]
    out = np.zeros((h, w), bool)
    out[np.ix_(oky, okx)] = m[np.ix_(ys[oky], xs[okx])]
    return out


def outline_width(shape: tuple[int, int]) -> int:
    """Outline thickness in px for a thumbnail of ``shape`` (h, w): 1 px per 400 px of the longest side, at least 1."""
    return max(1, int(round(max(shape) / 400)))


def _average_rank(x: np.ndarray) -> np.ndarray:
    """0-based ranks of ``x`` (N,), ties sharing their average rank."""
    uniq, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    start = np.cumsum(counts) - counts
    return (start + (counts - 1) / 2.0)[inverse]


def normalise_scores(
    scores: np.ndarray, mode: str = "rank", *, vmin: float = 0.0, vmax: float = 1.0
) -> tuple[np.ndarray, str]:
    """Scores (N,) to [0, 1] for colouring, and the sentence stating the normalisation.

    ``nan`` scores stay ``nan`` (painted as the lowest colour). Ties share their average rank.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    ok = ~np.isnan(s)
    out = np.full(s.shape, np.nan)
    if mode == "rank":
        if ok.sum() > 1:
            out[ok] = _average_rank(s[ok]) / (ok.sum() - 1)
        elif ok.any():
            out[ok] = 1.0
        return out, "colour = per-slide rank (0 lowest, 1 highest)"
    if mode == "minmax":
        lo, hi = (float(np.min(s[ok])), float(np.max(s[ok]))) if ok.any() else (0.0, 1.0)
        out[ok] = (s[ok] - lo) / (hi - lo) if hi > lo else 1.0
        return out, f"colour = per-slide min-max ({lo:.3g} .. {hi:.3g})"
    if mode == "raw":
        if not vmax > vmin:
            raise ValueError(f"raw heatmap needs vmax > vmin; got vmin={vmin}, vmax={vmax}")
        out[ok] = np.clip((s[ok] - vmin) / (vmax - vmin), 0, 1)
        return out, f"colour = raw score ({vmin:.3g} .. {vmax:.3g})"
    raise ValueError(f"heatmap mode {mode!r} unknown; choose one of {list(MODES)}")


def tile_rects(
    coords: np.ndarray, tile_extent: float, scale: tuple[float, float], shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Thumbnail rectangles ``[x0, x1) x [y0, y1)`` (int64, each (N,)) of tiles.

    Parameters
    ----------
    coords : (N, 2) tile top-left (x, y) in level-0 px.
    tile_extent : tile side in level-0 px.
    scale : (sx, sy) thumbnail px per level-0 px.
    shape : (h, w) of the thumbnail; rectangles are clipped to it.

    Edges are rounded, so neighbouring tiles share an edge (no gaps or double coverage), and
    every tile inside the image keeps at least one px.
    """
    c = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    sx, sy = scale
    h, w = shape
    x0 = np.round(c[:, 0] * sx).astype(np.int64)
    y0 = np.round(c[:, 1] * sy).astype(np.int64)
    x1 = np.maximum(np.round((c[:, 0] + tile_extent) * sx).astype(np.int64), x0 + 1)
    y1 = np.maximum(np.round((c[:, 1] + tile_extent) * sy).astype(np.int64), y0 + 1)
    x0, x1 = np.clip(x0, 0, w), np.clip(x1, 0, w)
    y0, y1 = np.clip(y0, 0, h), np.clip(y1, 0, h)
    return x0, y0, x1, y1


def _paint(values: np.ndarray, rects: tuple[np.ndarray, ...], shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Average ``values`` (N,) over each pixel's covering tiles: (mean (h, w) float32, covered bool (h, w)).

    Vectorised with 2-D difference arrays: +v at (y0, x0) and (y1, x1), -v at (y0, x1) and
    (y1, x0); the 2-D cumulative sum is then, at every pixel, the sum over the tiles covering it.
    """
    h, w = shape
    x0, y0, x1, y1 = rects
    keep = (x1 > x0) & (y1 > y0)
    x0, y0, x1, y1 = x0[keep], y0[keep], x1[keep], y1[keep]
    v = np.nan_to_num(np.asarray(values, dtype=np.float64)[keep], nan=0.0)
    acc = np.zeros((h + 1, w + 1), np.float64)
    cnt = np.zeros((h + 1, w + 1), np.int64)
    for ys, xs, sign in ((y0, x0, 1), (y0, x1, -1), (y1, x0, -1), (y1, x1, 1)):
        np.add.at(acc, (ys, xs), sign * v)
        np.add.at(cnt, (ys, xs), sign)
    np.cumsum(acc, axis=0, out=acc)
    np.cumsum(acc, axis=1, out=acc)
    np.cumsum(cnt, axis=0, out=cnt)
    np.cumsum(cnt, axis=1, out=cnt)
    covered = cnt[:h, :w] > 0
    mean = np.zeros((h, w), np.float32)
    mean[covered] = acc[:h, :w][covered] / cnt[:h, :w][covered]
    return mean, covered


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _legend(img: Image.Image, covered: np.ndarray, lines: list[str], ticks: tuple[str, str]) -> None:
    """Draw a colour bar with ``ticks`` and ``lines`` of text in the corner with least tissue."""
    w, h = img.size
    fs = int(np.clip(round(min(w, h * 2) / 45), 8, 16))
    font = _font(fs)
    draw = ImageDraw.Draw(img)
    # whole pixels: Pillow's bitmap and FreeType fonts measure in ints (its stubs say float)
    text_w = int(max(draw.textbbox((0, 0), s, font=font)[2] for s in [*lines, "".join(ticks) + "   "]))
    pad = max(2, fs // 3)
    bar_h = max(4, fs)
    box_w = min(w - 2, max(text_w, 6 * fs) + 2 * pad)
    line_h = fs + max(1, fs // 4)
    box_h = min(h - 2, pad * 2 + bar_h + line_h * (len(lines) + 1))
    corners = [(w - box_w - 1, h - box_h - 1), (1, h - box_h - 1), (w - box_w - 1, 1), (1, 1)]
    x, y = min(corners, key=lambda p: covered[p[1] : p[1] + box_h, p[0] : p[0] + box_w].sum())
    draw.rectangle([x, y, x + box_w, y + box_h], fill=(255, 255, 255), outline=(90, 90, 90))
    ty = y + pad
    for s in lines:
        draw.text((x + pad, ty), s, fill=(0, 0, 0), font=font)
        ty += line_h
    bar_w = box_w - 2 * pad
    ramp = colormap(np.linspace(0, 1, max(bar_w, 1)))[None].repeat(bar_h, 0)
    img.paste(Image.fromarray(ramp), (x + pad, ty))
    ty += bar_h + 1
    draw.text((x + pad, ty), ticks[0], fill=(0, 0, 0), font=font)
    tw = draw.textbbox((0, 0), ticks[1], font=font)[2]
    draw.text((x + box_w - pad - tw, ty), ticks[1], fill=(0, 0, 0), font=font)


def render_heatmap(
    thumbnail: np.ndarray,
    coords: np.ndarray,
    tile_extent: float,
    scores: np.ndarray,
    *,
    level0_size: tuple[int, int],
    mode: str = "rank",
    vmin: float = 0.0,
    vmax: float = 1.0,
    alpha: float = 0.5,
    title: str | None = None,
    legend: bool = True,
    outline: np.ndarray | None = None,
) -> np.ndarray:
    """Paint per-tile scores over a thumbnail.

    Parameters
    ----------
    thumbnail : uint8 (h, w, 3) RGB image of the whole slide (level 0 scaled to (w, h)).
    coords : (N, 2) tile top-left (x, y) in level-0 px.
    tile_extent : tile side in level-0 px.
    scores : (N,) one score per tile (attention, probability, ...).
    level0_size : (width, height) of level 0 in px; the thumbnail maps onto it.
    mode, vmin, vmax : normalisation, see the module docstring.
    alpha : opacity of the colour over tissue, 0..1.
    title : first legend line (e.g. ``"attention, abmil seed 0"``).
    legend : draw the colour bar and normalisation text.
    outline : optional bool (h, w) ground-truth mask on the thumbnail's grid (see
        :func:`mask_to_thumbnail`); its region borders are drawn in :data:`OUTLINE_COLOUR`,
        :func:`outline_width` px wide, and the legend says so.

    Returns
    -------
    uint8 (h, w, 3): the thumbnail with tiles coloured (blue = low, red = high) and a legend.
    """
    thumb = np.asarray(thumbnail)
    if thumb.ndim != 3 or thumb.shape[2] != 3 or thumb.dtype != np.uint8:
        raise ValueError(f"thumbnail must be uint8 (h, w, 3) RGB; got {thumb.dtype} {thumb.shape}")
    s = np.asarray(scores).reshape(-1)
    c = np.asarray(coords).reshape(-1, 2)
    if len(s) != len(c):
        raise ValueError(f"scores ({len(s)}) and coords ({len(c)}) must have one entry per tile")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}; expected 0..1")
    h, w = thumb.shape[:2]
    W, H = level0_size
    norm, sentence = normalise_scores(s, mode, vmin=vmin, vmax=vmax)
    value, covered = _paint(norm, tile_rects(c, tile_extent, (w / W, h / H), (h, w)), (h, w))
    # colour through a 256-entry lookup table and blend in uint8: no float copies of the image
    colour = _LUT[np.round(value * 255).astype(np.uint8)]
    blended = cv2.addWeighted(np.ascontiguousarray(thumb), 1.0 - alpha, colour, alpha, 0.0)
    out = np.where(covered[..., None], blended, thumb)
    del colour, blended
    drawn = False
    if outline is not None:
        o = np.asarray(outline, dtype=bool)
        if o.shape != (h, w):
            raise ValueError(f"outline mask has shape {o.shape}; expected the thumbnail's (h, w) = {(h, w)}")
        if o.any():
            contours, _ = cv2.findContours(o.astype(np.uint8), cv2.RETR_LIST, cv2.CHAIN_APPROX_NONE)
            out = np.ascontiguousarray(out)
            cv2.drawContours(out, contours, -1, OUTLINE_COLOUR, outline_width((h, w)))
            drawn = True
    if legend:
        img = Image.fromarray(out)
        lines = ([title] if title else []) + [sentence] + (["black outline: planted lesion (truth)"] if drawn else [])
        ticks = ("low", "high") if mode != "raw" else (f"{vmin:.3g}", f"{vmax:.3g}")
        _legend(img, covered, lines, ticks)
        out = np.asarray(img)
    return out


def save_png(path: str | os.PathLike, image: np.ndarray) -> Path:
    """Write a uint8 RGB image as PNG atomically (temp name, then rename)."""
    with atomic_path(path, suffix=".png") as tmp:
        # fast zlib level: a 1024 px heatmap encodes in tens of ms instead of hundreds
        Image.fromarray(np.asarray(image)).save(tmp, compress_level=1)
    return Path(path)
