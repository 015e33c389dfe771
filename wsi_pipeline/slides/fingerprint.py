"""A cheap identity of a slide file, to tell an unchanged slide from a replaced one on resume."""

from __future__ import annotations

import hashlib
import os

__all__ = ["slide_fingerprint"]

_HEAD = 1 << 20  # 1 MiB


def slide_fingerprint(path: str | os.PathLike) -> str:
    """``"<size in bytes>-<sha256 of the first MiB>"``.

    Hashing only the head keeps this O(1) in the slide size; TIFF-based formats keep their
    directory and metadata near the start, and a size change catches most re-exports.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f.read(_HEAD))
    return f"{size}-{h.hexdigest()}"
