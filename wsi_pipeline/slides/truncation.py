"""Whether a slide file is complete: a TIFF-based file (SVS, NDPI, OME-TIFF, generic TIFF) cut short is called truncated.

A copy that stopped half way opens (its header is whole) and then fails deep in a reader with an error that
does not say so ("Jpeg8Error: Empty input file"). :func:`tiff_truncation` checks the file's chain of image
directories and its image data against the file's size; :func:`unreadable_reason` is the message for a slide
that failed to open or to read, calling it truncated when it is (the tiler's ``error`` column, the viewer's list).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Literal

__all__ = ["SlideTruncatedError", "check_complete", "tiff_truncation", "unreadable_reason"]

_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
#: Image directories followed at most (a slide has a few dozen; a loop or a hostile chain stops here).
_MAX_IFDS = 100_000


class SlideTruncatedError(ValueError):
    """A slide file cut short (:func:`check_complete`)."""


def _ifd_chain_end(f: BinaryIO, head: bytes, size: int) -> str | None:
    """Follow the chain of a TIFF's image directories (each one's entry count and next-directory offset); how it
    runs past the end of the file, or None when every directory lies inside it."""
    order: Literal["little", "big"] = "little" if head[:2] == b"II" else "big"
    big = head[2:4] in (b"+\x00", b"\x00+")
    count_size, entry_size, offset_size = (8, 20, 8) if big else (2, 12, 4)
    offset = int.from_bytes(head[8:16] if big else head[4:8], order)
    seen: set[int] = set()
    n = 0
    while offset and offset not in seen and n < _MAX_IFDS:
        seen.add(offset)
        n += 1
        if offset + count_size > size:
            return f"image directory {n} is at byte {offset} but the file ends at byte {size}"
        f.seek(offset)
        entries = int.from_bytes(f.read(count_size), order)
        end = offset + count_size + entries * entry_size + offset_size
        if end > size:
            return f"image directory {n} (byte {offset}) runs to byte {end} but the file ends at byte {size}"
        f.seek(end - offset_size)
        offset = int.from_bytes(f.read(offset_size), order)
    return None


def tiff_truncation(path: Path) -> str | None:
    """How a TIFF-based file is cut short, or None (complete, or not a TIFF): a directory of its chain lies past its
    end, or some image data does."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(16)
            if head[:4] not in _TIFF_MAGIC:
                return None
            # an NDPI over 4 GiB keeps its offsets' high bits elsewhere: only tifffile follows its chain
            ndpi_64 = path.suffix.lower() == ".ndpi" and size >= 1 << 32
            chain = None if ndpi_64 else _ifd_chain_end(f, head, size)
    except OSError:
        return None
    if chain is not None:
        return chain
    import tifffile

    try:
        with tifffile.TiffFile(path) as tf:
            end = 0
            for page in tf.pages:
                offsets, counts = getattr(page, "dataoffsets", ()), getattr(page, "databytecounts", ())
                if len(offsets):
                    end = max(end, max(int(o) + int(c) for o, c in zip(offsets, counts)))
    except Exception as err:  # any parse error of a file that starts as a TIFF: its directories are damaged
        return f"its image directories cannot be read ({type(err).__name__}: {str(err)[:120]}); the file has {size} bytes"
    if end > size:
        return f"its image data runs to byte {end} but the file ends at byte {size}"
    return None


def check_complete(path: Path) -> None:
    """:class:`SlideTruncatedError` (a ``ValueError``) calling ``path`` truncated when it is a TIFF-based file cut short (:func:`tiff_truncation`),
    even when the pieces :func:`probe` read were whole."""
    reason = tiff_truncation(path)
    if reason is not None:
        raise SlideTruncatedError(f"slide file {path.name} is truncated: {reason}; copy it again from its source")


def unreadable_reason(path: Path | None, err: BaseException) -> str:
    """The message for a slide that failed to open or to read: the reader's error, and whether the file is truncated."""
    msg = f"{type(err).__name__}: {err}"
    if isinstance(err, SlideTruncatedError):
        return str(err)
    reason = tiff_truncation(path) if path is not None else None
    if reason is not None:
        return f"slide file {path.name if path else ''} is truncated or damaged: {reason} (reader: {msg})"
    return msg
