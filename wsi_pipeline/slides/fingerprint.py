"""A cheap identity of a slide file, to tell an unchanged slide from a replaced one on resume.

The identity covers the whole file at a cost independent of its size: its size, the SHA-256 of
its first MiB (where TIFF-based formats keep their directory and metadata) and, for a file
larger than that, one SHA-256 over blocks spread evenly across the rest (:data:`SPREAD_BLOCKS`
blocks of :data:`SPREAD_BYTES`, the last MiB included) and over the byte counts of every tile
of every page when the file is a TIFF (SVS, NDPI, generic TIFF): a slide replaced by another of
the same size whose first MiB is the same still differs in its tiles' compressed sizes or in
the sampled blocks. About 6 MiB are read whatever the slide's size.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["SPREAD_BLOCKS", "SPREAD_BYTES", "same_slide", "slide_fingerprint"]

_HEAD = 1 << 20  # 1 MiB
#: Blocks hashed across the file after its first MiB (the last MiB counts as one more).
SPREAD_BLOCKS = 64
#: Bytes per spread block (64 KiB).
SPREAD_BYTES = 1 << 16


def slide_fingerprint(path: str | os.PathLike) -> str:
    """``"<size in bytes>-<sha256 of the first MiB>"``, and for larger files ``"-<sha256 of the rest's samples>"``.

    A file of at most 1 MiB is hashed whole. Identities written before the spread blocks existed
    are the first two fields only; :func:`same_slide` compares them as they were written.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = hashlib.sha256(f.read(_HEAD)).hexdigest()
        if size <= _HEAD:
            return f"{size}-{head}"
        spread = hashlib.sha256()
        rest = size - _HEAD
        for i in range(SPREAD_BLOCKS):
            f.seek(_HEAD + (rest * i) // SPREAD_BLOCKS)
            spread.update(f.read(SPREAD_BYTES))
        f.seek(max(_HEAD, size - _HEAD))
        spread.update(f.read(_HEAD))
    spread.update(_tiff_tile_sizes(path))
    return f"{size}-{head}-{spread.hexdigest()}"


def _tiff_tile_sizes(path: str | os.PathLike) -> bytes:
    """The byte count of every tile (or strip) of every page of a TIFF, as bytes; empty for other formats.

    Reads only the file's directories (no pixels). Any re-encoded tile changes its byte count.
    """
    try:
        import numpy as np
        import tifffile

        with tifffile.TiffFile(path) as tf:
            return b"".join(np.asarray(page.databytecounts, dtype="<u8").tobytes() for page in tf.pages)
    except Exception:  # not a TIFF (DICOM, MRXS, ...) or one tifffile cannot parse: the sampled blocks stand alone
        return b""


def same_slide(recorded: str | None, current: str) -> bool:
    """True when ``current`` (:func:`slide_fingerprint` now) identifies the same file as ``recorded``.

    A fingerprint recorded before the spread blocks (``<size>-<head>``) is compared by its own
    rule: size and first MiB.
    """
    if not recorded:
        return False
    return current == recorded or (recorded.count("-") == 1 and current.startswith(recorded + "-"))
