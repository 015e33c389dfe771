"""Whether an opened slide's pixels can be read, and why not: a truncated file is called truncated.

A slide whose header opens but whose tiles are cut off (a copy that stopped half way) used to be listed "ok"
while every tile failed. :func:`probe` reads two small pieces when a slide is first opened (the zoom-0 tile,
from the smallest level, and the last level-0 pixel, from the end of the largest); why a slide failed, and
whether its file is truncated, is :mod:`wsi_pipeline.slides.truncation`'s (shared with the tiler).
"""

from __future__ import annotations

from wsi_pipeline.viewer.tiles import TileSource

__all__ = ["probe"]


def probe(source: TileSource) -> None:
    """Read the zoom-0 tile and the last level-0 pixel of ``source``; the reader's error when either fails."""
    w, h = source.dimensions
    source.tile(0, 0, 0)
    source.region(max(w - 1, 0), max(h - 1, 0), 1, 1)
