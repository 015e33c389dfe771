"""QC image per slide: the slide's thumbnail with the kept tiles outlined."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.slide_ids import slide_output_path

__all__ = ["render_qc", "write_png", "qc_path"]


def qc_path(out_dir: str | os.PathLike, slide_id: str) -> Path:
    """``<out_dir>/qc/<slide_id>.png``."""
    return slide_output_path(Path(out_dir) / "qc", slide_id, ".png")


def render_qc(
    thumbnail: np.ndarray,
    thumbnail_downsample: float,
    coords: np.ndarray,
    extent: float,
    *,
    colour: tuple[int, int, int] = (0, 170, 0),
    min_tile_px: int = 16,
    min_side: int = 1024,
    max_side: int = 4096,
    others: Sequence[tuple[np.ndarray, tuple[int, int, int]]] = (),
    legend: str | None = None,
    outlines: Sequence[np.ndarray] = (),
    outline_colour: tuple[int, int, int] = (0, 90, 255),
) -> np.ndarray:
    """Outline tiles on a thumbnail.

    Parameters
    ----------
    thumbnail : uint8 (h, w, 3) RGB, the slide at ``thumbnail_downsample`` level-0 px per px.
    coords : (N, 2) level-0 (x, y) of the kept tiles' top-left corners.
    extent : tile side in level-0 px.
    colour : outline RGB.
    min_tile_px, min_side : the thumbnail is enlarged (up to 4x) until a tile spans
        ``min_tile_px`` px or its longer side reaches ``min_side`` px.
    max_side : the image never exceeds this side length (larger thumbnails are shrunk first).
    others : more (coords, colour) groups of tiles outlined after ``coords`` (e.g. flagged and dropped tiles).
    legend : a line of text written at the top left (white band).
    outlines : polygons drawn before the tiles (e.g. the ``--regions`` annotations), float (K, 2) level-0 (x, y) px each.
    outline_colour : their RGB (blue, apart from the tiles' green, orange and red).

    Returns
    -------
    uint8 (H, W, 3) RGB.
    """
    import cv2

    img = np.ascontiguousarray(thumbnail)
    h, w = img.shape[:2]
    if max(h, w) > max_side:  # shrink huge thumbnails first
        f = max_side / max(h, w)
        img = cv2.resize(img, (max(1, round(w * f)), max(1, round(h * f))), interpolation=cv2.INTER_AREA)
        thumbnail_downsample = thumbnail_downsample * w / img.shape[1]
        h, w = img.shape[:2]
    tile_px = extent / thumbnail_downsample
    zoom = max(int(math.ceil(min_tile_px / max(tile_px, 1e-9))), int(math.ceil(min_side / max(h, w, 1))))
    zoom = max(1, min(zoom, 4, max_side // max(h, w, 1)))
    if zoom > 1:
        img = cv2.resize(img, (w * zoom, h * zoom), interpolation=cv2.INTER_LINEAR)
    scale = zoom / thumbnail_downsample
    side = extent * scale
    rings = [np.round(np.asarray(r, np.float64).reshape(-1, 2) * scale).astype(np.int32) for r in outlines if len(r) >= 2]
    if rings:
        cv2.polylines(img, rings, True, tuple(int(v) for v in outline_colour), max(1, zoom), cv2.LINE_AA)
    for group, col in [(coords, colour), *others]:
        for x, y in np.asarray(group, np.float64).reshape(-1, 2) * scale:
            x0, y0 = int(round(x)), int(round(y))
            x1, y1 = int(round(x + side)) - 1, int(round(y + side)) - 1
            cv2.rectangle(img, (x0, y0), (max(x0, x1), max(y0, y1)), tuple(int(v) for v in col), 1)
    if legend:
        band = np.full((22, img.shape[1], 3), 255, np.uint8)
        cv2.putText(band, legend, (4, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
        img = np.concatenate([band, img], axis=0)
    return img


def write_png(path: str | os.PathLike, rgb: np.ndarray) -> Path:
    """Write an RGB image as PNG atomically (:func:`~wsi_pipeline.io_atomic.atomic_path`).

    Encoded in memory first (the bytes ``cv2.imwrite`` writes), so the temporary name needs no ``.png`` ending.
    """
    import cv2

    path = Path(path)
    ok, png = cv2.imencode(".png", cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR))
    if not ok:
        raise OSError(f"could not encode QC image {path}")
    with atomic_path(path) as tmp:
        tmp.write_bytes(png.tobytes())
    return path
