"""Decode only the top rows of a sequential JPEG tile.

libjpeg decodes a sequential (baseline or extended, Huffman-coded) JPEG whose one scan holds every
component one MCU row at a time, top to bottom, and stops after the rows its frame header (SOF)
declares. So a tile's stream with a smaller height written into its SOF decodes to the tile's top
rows: the entropy decoding and the inverse DCT of the first MCU rows do not depend on the declared
height, and an output row depends only on the sample rows of its own MCU row and the next (chroma
upsampling looks at most one chroma row away; colour conversion is per pixel). Rows at least one MCU
row above the declared height are therefore the full decode's rows bit for bit; only the last MCU
row may differ (libjpeg repeats the last chroma row at the image's bottom edge). The data after the
declared rows is skipped by libjpeg as extraneous bytes before the end marker (a warning, not an
error).

Used by :meth:`~wsi_pipeline.slides.direct.DirectTiles.stored_tile_top` to decide most glass tiles
from their top half: it costs about half a full decode.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SequentialFrame", "sequential_frame", "with_height"]

_SOI, _SOS = 0xD8, 0xDA
#: start-of-frame markers that can be cut by height: baseline and extended sequential, Huffman
_SEQUENTIAL = frozenset({0xC0, 0xC1})
#: every other start-of-frame marker (progressive, lossless, hierarchical, arithmetic coding)
_OTHER_SOF = frozenset({0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
#: markers without a length field
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


@dataclass(frozen=True)
class SequentialFrame:
    """Where a sequential JPEG stream declares its height, and its MCU height.

    Attributes
    ----------
    height_offset : byte offset of the SOF's two-byte (big-endian) height field.
    height : the declared height in px.
    mcu_height : px per MCU row (8 x the largest vertical sampling factor).
    """

    height_offset: int
    height: int
    mcu_height: int

    def exact_rows(self, rows: int) -> tuple[int, int]:
        """(height to declare, rows of it that equal the full decode's) for at least ``rows`` exact rows.

        The declared height is a whole number of MCU rows, one MCU row more than ``rows`` needs.
        """
        m = self.mcu_height
        declared = (-(-int(rows) // m) + 1) * m
        return declared, declared - m


def sequential_frame(data: bytes) -> SequentialFrame | None:
    """The frame of a JPEG stream (or abbreviated TIFF tile stream) that can be cut by height.

    Returns None unless the stream is sequential Huffman-coded JPEG (SOF0 or SOF1) whose first scan
    holds all of the frame's components (so it is the only scan), or when the markers before the
    scan cannot be walked.
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != _SOI:
        return None
    i, frame, components = 2, None, 0
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = data[i + 2] << 8 | data[i + 3]
        if length < 2 or i + 2 + length > n:
            return None
        if marker in _SEQUENTIAL:
            if length < 8:
                return None
            components = data[i + 9]
            if components < 1 or length < 8 + 3 * components:
                return None
            v_max = max(data[i + 11 + 3 * k] & 0x0F for k in range(components))
            if not 1 <= v_max <= 4:
                return None
            frame = SequentialFrame(i + 5, data[i + 5] << 8 | data[i + 6], 8 * v_max)
        elif marker in _OTHER_SOF:
            return None
        elif marker == _SOS:
            if frame is None or data[i + 4] != components:
                return None
            return frame
        i += 2 + length
    return None


def with_height(data: bytes, frame: SequentialFrame, height: int) -> bytes:
    """``data`` with ``height`` (px, 1 .. the declared height) written into its frame header."""
    if not 1 <= height <= frame.height:
        raise ValueError(f"height {height} outside 1..{frame.height} (the stream's declared height)")
    out = bytearray(data)
    out[frame.height_offset : frame.height_offset + 2] = int(height).to_bytes(2, "big")
    return bytes(out)
