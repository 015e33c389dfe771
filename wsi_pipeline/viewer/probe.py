"""Whether an opened slide's pixels can be read, and why not: a truncated file is called truncated.

A slide whose header opens but whose tiles are cut off (a copy that stopped half way) used to be listed "ok"
while every tile failed. :func:`probe` reads two small pieces when a slide is first opened (the zoom-0 tile,
from the smallest level, and the last level-0 pixel, from the end of the largest); :func:`unreadable_reason`
says why a slide failed, checking a TIFF-based file (SVS, NDPI, OME-TIFF, generic TIFF) for image data that
runs past the end of the file.
"""

from __future__ import annotations

from pathlib import Path

from wsi_pipeline.viewer.tiles import TileSource

__all__ = ["probe", "tiff_truncation", "unreadable_reason"]

_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")


def probe(source: TileSource) -> None:
    """Read the zoom-0 tile and the last level-0 pixel of ``source``; the reader's error when either fails."""
    w, h = source.dimensions
    source.tile(0, 0, 0)
    source.region(max(w - 1, 0), max(h - 1, 0), 1, 1)


def tiff_truncation(path: Path) -> str | None:
    """How a TIFF-based file is cut short (its image data runs past its end, or its directories cannot be read),
    or None (complete, or not a TIFF)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if f.read(4) not in _TIFF_MAGIC:
                return None
    except OSError:
        return None
    import tifffile

    try:
        with tifffile.TiffFile(path) as tf:
            end = 0
            for page in tf.pages:
                offsets, counts = getattr(page, "dataoffsets", ()), getattr(page, "databytecounts", ())
                if offsets:
                    end = max(end, max(int(o) + int(c) for o, c in zip(offsets, counts)))
    except Exception as err:  # any parse error of a file that starts as a TIFF: its directories are cut off
        return f"its TIFF directories cannot be read ({type(err).__name__}: {str(err)[:120]}); the file has {size} bytes"
    if end > size:
        return f"its image data runs to byte {end} but the file ends at byte {size}"
    return None


def unreadable_reason(path: Path | None, err: BaseException) -> str:
    """The message for a slide that failed to open or to read: the reader's error, and whether the file is truncated."""
    msg = f"{type(err).__name__}: {err}"
    reason = tiff_truncation(path) if path is not None else None
    if reason is not None:
        return f"slide file {path.name if path else ''} is truncated or damaged: {reason} (reader: {msg})"
    return msg
