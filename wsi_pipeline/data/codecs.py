"""Chunk codecs for the ``tiles`` array of a tile store (zarr v3).

- :func:`lossless_tile_codecs`: plain zstd at level 1. On RGB tiles Blosc's bit-shuffling
  slows compression about threefold and compresses natural images *worse*; level 1 keeps the
  writer close to the speed of JPEG decoding.
- :func:`tile_codecs_for`: the runner's choice per compression name. Chunk keys use ``.``
  as separator (``tiles/c.<i>.0.0.0``), one file per shard (or per tile) in one folder instead
  of four nested folders each: fewer file-system operations to write and to delete a store.
- :func:`jpeg_tile_codecs`: a lossy JPEG chunk serializer (imagecodecs / libjpeg-turbo), about
  10x smaller than lossless. Readers need the codec registered with zarr; importing
  :mod:`wsi_pipeline.tiling` does that (and the ``zarr.codecs`` entry point, where installed).
- :func:`tile_layout_for`: one tile per chunk, optionally grouped into zarr v3 shards of
  ``shard_tiles`` tiles (one file per shard; the chunk, the unit of a read, stays one tile).
- :func:`direct_codec`: the same codec chain (raw, zstd, jpeg; each optionally followed by
  ``crc32c``) as plain encode/decode functions, for the store's direct chunk reads and writes (the
  bytes zarr writes and reads).
- Every chain of a new store ends in zarr's ``crc32c`` codec: each tile's stored bytes carry
  their CRC-32C, checked on every read (by zarr and by the direct reader alike), so a damaged
  chunk is an error naming it, never other pixels. CRC-32C runs at several GB/s (SSE 4.2):
  ~10 us on a 100 kB tile, against ~500 us to decode it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import JSON, parse_named_configuration

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer

__all__ = [
    "ChecksumError", "DEFAULT_SHARD_TILES", "DirectCodec", "checksum_codec", "JPEG_CODEC_NAME", "JpegTileCodec", "direct_codec", "jpeg_tile_codecs",
    "lossless_tile_codecs", "register_codecs", "tile_codecs_for", "tile_layout_for",
]

#: The codec's name in a store's ``zarr.json``.
JPEG_CODEC_NAME = "wsi_pipeline.jpeg"


@dataclass(frozen=True)
class JpegTileCodec(ArrayBytesCodec):
    """JPEG-encode uint8 RGB chunks of shape (k, T, T, 3) as one (k*T, T, 3) image.

    Parameters
    ----------
    quality : JPEG quality, 1..100.
    """

    is_fixed_size = False
    quality: int = 90

    def __init__(self, *, quality: int = 90) -> None:
        q = int(quality)
        if not 1 <= q <= 100:
            raise ValueError(f"quality={quality} must be in [1, 100]")
        object.__setattr__(self, "quality", q)

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, config = parse_named_configuration(data, JPEG_CODEC_NAME, require_configuration=False)
        kwargs: dict[str, Any] = dict(config or {})  # the codec's keyword arguments, checked by __init__
        return cls(**kwargs)

    def to_dict(self) -> dict[str, JSON]:
        return {"name": JPEG_CODEC_NAME, "configuration": {"quality": self.quality}}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        native = getattr(dtype, "to_native_dtype", lambda: dtype)()
        if np.dtype(native) != np.uint8 or len(shape) != 4 or shape[-1] != 3:
            raise ValueError(f"{JPEG_CODEC_NAME} needs a uint8 array of shape (N, T, T, 3); got {native} {shape}")

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        import imagecodecs

        arr = np.ascontiguousarray(chunk_array.as_numpy_array())
        k, h, w, c = arr.shape
        data = imagecodecs.jpeg8_encode(arr.reshape(k * h, w, c), level=self.quality)
        return chunk_spec.prototype.buffer.from_bytes(bytes(data))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return self._encode_sync(chunk_array, chunk_spec)

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        import imagecodecs

        img = imagecodecs.jpeg8_decode(chunk_bytes.to_bytes())
        return chunk_spec.prototype.nd_buffer.from_numpy_array(np.asarray(img, np.uint8).reshape(chunk_spec.shape))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return self._decode_sync(chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError("JPEG output size is data dependent")


_registered = False


def register_codecs() -> None:
    """Register :class:`JpegTileCodec` with zarr (idempotent)."""
    global _registered
    if not _registered:
        from zarr.registry import register_codec

        register_codec(JPEG_CODEC_NAME, JpegTileCodec)
        _registered = True


class ChecksumError(ValueError):
    """A chunk whose stored CRC-32C does not match its bytes (the chunk is damaged)."""


def checksum_codec() -> Any:
    """zarr's ``crc32c`` codec: the last codec of every chunk chain of a new store."""
    from zarr.codecs import Crc32cCodec

    return Crc32cCodec()


def jpeg_tile_codecs(quality: int = 90) -> dict[str, Any]:
    """``zarr.create_array`` keyword arguments for JPEG-compressed tiles (lossy), checksummed."""
    register_codecs()
    return {"serializer": JpegTileCodec(quality=quality), "compressors": [checksum_codec()]}


def lossless_tile_codecs() -> dict[str, Any]:
    """``zarr.create_array`` keyword arguments for fast lossless tiles (zstd level 1), checksummed."""
    from zarr.codecs import ZstdCodec

    return {"compressors": [ZstdCodec(level=1), checksum_codec()]}


#: Chunk keys ``c.0.0`` (one file per chunk beside ``zarr.json``, no ``c/0/`` folders), of every array of new stores.
FLAT_KEYS: dict[str, Any] = {"name": "default", "configuration": {"separator": "."}}
_FLAT_KEYS = FLAT_KEYS


def tile_codecs_for(compression: str) -> dict[str, Any]:
    """``zarr.create_array`` keyword arguments of the ``tiles`` array for ``zstd``, ``jpeg`` or ``none``."""
    if compression == "zstd":
        kw = lossless_tile_codecs()
    elif compression == "jpeg":
        kw = jpeg_tile_codecs()
    elif compression == "none":
        kw = {"compressors": [checksum_codec()]}
    else:
        raise ValueError(f"compression={compression!r}; expected 'zstd', 'jpeg' or 'none'")
    return {**kw, "chunk_key_encoding": _FLAT_KEYS}


#: Tiles per shard file of new stores (0 = the older layout, one file per tile). 1024 tiles of
#: 256 px make shards of ~50-200 MB (zstd): a 30,000-tile slide is ~30 shard files instead of
#: 30,000 tile files, and the shard index a reader loads once per shard is 16 KiB.
DEFAULT_SHARD_TILES = 1024


def tile_layout_for(tile_size: int, shard_tiles: int | None) -> dict[str, Any]:
    """``create_array`` keyword arguments for the ``tiles`` array's chunking.

    One tile (``tile_size`` px square) per chunk; ``shard_tiles`` > 0 groups that many chunks into
    one zarr v3 shard file (index at its end, with a crc32c checksum); 0 or None: one file per tile.
    """
    T = int(tile_size)
    n = 0 if shard_tiles is None else int(shard_tiles)
    if n < 0:
        raise ValueError(f"shard_tiles={shard_tiles}; expected tiles per shard >= 1, or 0 for one file per tile")
    kw: dict[str, Any] = {"chunks": (1, T, T, 3)}
    if n > 0:
        kw["shards"] = (n, T, T, 3)
    return kw


@dataclass(frozen=True)
class DirectCodec:
    """One chunk's codec chain as plain functions: the bytes zarr writes, and the array it reads.

    ``encode(tile)`` takes a C-contiguous uint8 chunk; ``decode(data)`` returns its uint8 values
    (any shape; the caller reshapes to the chunk's shape).
    """

    name: str
    encode: Callable[[np.ndarray], Any]
    decode: Callable[[bytes], Any]


def _with_checksum(codec: DirectCodec) -> DirectCodec:
    """``codec`` followed by zarr's ``crc32c`` codec: its CRC-32C appended (4 bytes, little-endian)
    on encode, checked and removed on decode (:class:`ChecksumError` when it does not match)."""
    import google_crc32c

    inner_encode, inner_decode = codec.encode, codec.decode

    def encode(tile: np.ndarray) -> bytearray:
        data = np.frombuffer(inner_encode(tile), np.uint8)  # read-only view, no copy
        out = bytearray(len(data) + 4)  # one copy: the chunk, then its checksum
        memoryview(out)[: len(data)] = data.data
        struct.pack_into("<I", out, len(data), google_crc32c.value(data))
        return out

    def decode(data: bytes) -> Any:
        arr = np.frombuffer(data, np.uint8)  # a read-only view, as google_crc32c wants
        if len(arr) < 4:
            raise ChecksumError(f"chunk of {len(arr)} bytes is shorter than its checksum")
        # a read-only view of the body, no copy: google_crc32c and every decoder here read any
        # buffer, though their hints say bytes
        body = cast(bytes, arr[:-4])
        stored, = struct.unpack("<I", arr[-4:].tobytes())
        if google_crc32c.value(body) != stored:
            raise ChecksumError("the chunk's CRC-32C checksum does not match its bytes")
        return inner_decode(body)

    return DirectCodec(codec.name + "+crc32c", encode, decode)


def direct_codec(codecs: Sequence[Any]) -> DirectCodec | None:
    """The :class:`DirectCodec` for a uint8 chunk's zarr codec chain, or None if it is not one of
    ``bytes``, ``bytes`` + ``zstd``, or :class:`JpegTileCodec`, each optionally followed by
    ``crc32c`` (zarr then does the work)."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec

    codecs = tuple(codecs)
    if codecs and isinstance(codecs[-1], Crc32cCodec):
        inner = direct_codec(codecs[:-1])
        return None if inner is None else _with_checksum(inner)
    if len(codecs) == 1 and isinstance(codecs[0], JpegTileCodec):
        import imagecodecs

        q = codecs[0].quality

        def jpeg_encode(tile: np.ndarray) -> Any:
            return imagecodecs.jpeg8_encode(tile.reshape(-1, tile.shape[-2], tile.shape[-1]), level=q)

        return DirectCodec("jpeg", jpeg_encode, imagecodecs.jpeg8_decode)
    if not codecs or not isinstance(codecs[0], BytesCodec):
        return None
    if len(codecs) == 1:
        return DirectCodec("raw", lambda tile: tile.data.cast("B"), lambda data: data)
    if len(codecs) == 2 and isinstance(codecs[1], ZstdCodec):
        from numcodecs import Zstd

        z = Zstd(level=codecs[1].level, checksum=codecs[1].checksum)
        return DirectCodec("zstd", z.encode, z.decode)
    return None
