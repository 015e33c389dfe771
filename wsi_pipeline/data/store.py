"""The zarr v3 tile store ``<tiles_dir>/<slide_id>.zarr`` (schema in ``data_manifests/README.md``).

Arrays: ``tiles`` uint8 (N, T, T, 3) RGB, one tile per chunk, in new stores grouped into zarr v3
shards of :data:`~wsi_pipeline.data.codecs.DEFAULT_SHARD_TILES` tiles (one file per shard;
``shard_tiles=0`` writes the older layout, one file per tile, which stays readable); ``coords`` int64 (N, 2), (x, y) of
each tile's top-left corner in level-0 px; ``grid`` int32 (N, 2), (col, row) on the slide's tile
grid at the read resolution; ``foreground`` float32 (N,); stores from the tiler also hold
``level_coords`` int64 (N, 2), each tile's source origin in px of the read level. Attributes
describe the slide and the tiling (with the tile formula's parameters, see
:mod:`wsi_pipeline.tiling.grid`); ``complete: true`` is written last.

Writes are atomic at the store level: :class:`StoreWriter` builds ``.<slide_id>.zarr.tmp-<pid>``
beside the destination and only :meth:`StoreWriter.commit` swaps it in, so a crash never
leaves a store marked complete, and a failed rebuild never destroys an earlier good store.
The tiler's stores (tiles the direct writer writes) are written as files throughout: the
``zarr.json`` files are zarr's own metadata, made once per process by zarr in memory, and the small
arrays' chunks go through the same codec chain; a store of a few tiles costs about its files, not
a dozen trips to zarr's event loop (see ``docs/tiling.md``, "Many small images").
Inside it, each shard is streamed into a temporary file and renamed into place once its index is
written, so a shard file is complete or absent.

Both layouts are read and written straight from/to the chunk and shard files when their codecs
are plain (raw, zstd, jpeg): a tile is one ``pread`` of its bytes, found in a shard through the
shard's index (per the zarr v3 sharding spec), without decoding the rest of the shard.

Stores verify themselves (stores written before this have no record and are read as before):

- every chunk of every array ends in its CRC-32C (zarr's ``crc32c`` codec), checked on each read:
  a damaged tile raises :class:`StoreDamagedError` naming the store and the tile, never decodes
  to other pixels;
- at commit, the attribute ``integrity`` records every chunk and shard file with its size; opening
  a store (:class:`TileStore`, cheap: one ``stat`` per file) checks that each is there with that
  size, so a deleted or truncated file is found before anything is read, and a tile or shard
  index entry that is absent is an error, never zarr's silent fill value;
- :func:`verify_store` reads everything (``wsi-pipeline verify``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.core.sync import sync as zarr_sync

from wsi_pipeline.data.codecs import (
    DEFAULT_SHARD_TILES, FLAT_KEYS, ChecksumError, DirectCodec, checksum_codec, direct_codec, register_codecs, tile_codecs_for,
    tile_layout_for,
)
from wsi_pipeline.slide_ids import slide_output_path

__all__ = [
    "COMPRESSIONS",
    "INTEGRITY_SCHEME",
    "StoreDamagedError",
    "StoreWriter",
    "TileStore",
    "complete_attrs",
    "is_complete",
    "is_tile_store",
    "marked_complete",
    "open_store",
    "store_bytes",
    "store_level0_size",
    "store_path",
    "store_problem",
    "store_tile_extent",
    "verify_store",
]

#: Tile compressions: lossless ``zstd`` (default), ``none``, or lossy ``jpeg`` (quality 90).
COMPRESSIONS: tuple[str, ...] = ("zstd", "none", "jpeg")
#: The arrays every store has; a chunk of any of them missing is damage, never a fill value.
_ARRAYS = ("tiles", "coords", "grid", "foreground")
#: Version of the ``integrity`` attribute (chunk files and their sizes, written at commit).
INTEGRITY_SCHEME = "files-v1"


class StoreDamagedError(ValueError):
    """A tile store whose files are missing, truncated or fail their checksum; the message names the
    store, the array or tile, and how to rebuild it."""

    def __init__(self, store: str | os.PathLike, problem: str) -> None:
        super().__init__(f"tile store {store} is damaged: {problem}; rebuild it (rerun `wsi-pipeline tile`, which "
                         "rebuilds damaged stores) and check the disk")
        self.store = Path(store)
        self.problem = problem


def is_tile_store(path: str | os.PathLike) -> bool:
    """True when ``path`` is a zarr group written as a tile store (complete or not): its
    attributes name a ``slide_id``. A folder that is not one is never replaced or removed."""
    try:
        meta = json.loads((Path(path) / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("node_type") == "group" and "slide_id" in (meta.get("attributes") or {})


def store_path(tiles_dir: str | os.PathLike, slide_id: str) -> Path:
    """Return the path of ``slide_id``'s store inside ``tiles_dir`` (the id checked to be a name, not a path)."""
    return slide_output_path(tiles_dir, slide_id, ".zarr")


class StoreWriter:
    """Write one slide's tiles into a temporary store, then :meth:`commit` it atomically.

    Parameters
    ----------
    path : destination ``<slide_id>.zarr``.
    tile_size : tile side T in px (at the read resolution).
    capacity : upper bound on the number of tiles; the arrays are trimmed at commit.
    attrs : store attributes (``complete`` is set by :meth:`commit` only).
    compression : one of :data:`COMPRESSIONS` (its codecs from
        :func:`~wsi_pipeline.data.codecs.tile_codecs_for`, as the tiling runner writes them).
    tile_codecs : explicit ``create_array`` codec arguments, overriding ``compression``.
    shard_tiles : tiles per shard file (default :data:`DEFAULT_SHARD_TILES`); 0 or None writes one
        file per tile (the layout of older stores).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tile_size: int,
        capacity: int,
        attrs: Mapping[str, Any],
        compression: str = "zstd",
        tile_codecs: Mapping[str, Any] | None = None,
        shard_tiles: int | None = DEFAULT_SHARD_TILES,
    ) -> None:
        layout = tile_layout_for(tile_size, shard_tiles)  # checks shard_tiles before touching the disk
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tile_size = int(tile_size)
        self.n = 0
        cap = max(int(capacity), 1)
        codecs = dict(tile_codecs) if tile_codecs is not None else tile_codecs_for(compression)
        T = self.tile_size

        made = _create_direct(self.tmp, {**dict(attrs), "complete": False}, (cap, T, T, 3), layout, codecs)
        if made is None:  # a layout or codecs that zarr writes: zarr makes the store, in one trip to its event loop

            async def create() -> tuple[Any, Any]:
                group = await zarr.api.asynchronous.open_group(str(self.tmp), mode="w",
                                                               attributes={**dict(attrs), "complete": False})
                return group, await group.create_array("tiles", shape=(cap, T, T, 3), dtype="uint8", **layout, **codecs)

            group, tiles = zarr_sync(create())
            self.group, self.tiles, self._tiles_json = zarr.Group(group), zarr.Array(tiles), None
        else:
            self.group, self.tiles, self._tiles_json = made
        self._arrays: dict[str, np.ndarray] = {}  # add_array's arrays, written at commit
        self._attrs: dict[str, Any] = {}  # set_attrs's attributes, written at commit
        self.files: dict[str, int] = {}  # the committed store's chunk and shard files and their sizes
        self.shard_tiles = int(layout["shards"][0]) if "shards" in layout else 0
        self._direct: _DirectChunks | _DirectShards | None = _direct_for(self.tiles)
        self._pending: list[np.ndarray] = []  # tiles of the open shard, when zarr writes the shards
        self._pending_start = 0
        self.coords = np.zeros((cap, 2), np.int64)
        self.grid = np.zeros((cap, 2), np.int32)
        self.foreground = np.zeros((cap,), np.float32)
        self.extra: dict[str, list[np.ndarray]] = {}

    @property
    def tile_encoder(self) -> Callable[[np.ndarray], Any] | None:
        """The function turning one C-contiguous uint8 (T, T, 3) tile into the bytes this store writes for
        it (for :meth:`append`'s ``encoded``, so callers can compress in their own threads); None when
        zarr writes the tiles."""
        return None if self._direct is None else self._direct.codec.encode

    def append(
        self,
        tiles: np.ndarray,
        coords: np.ndarray,
        grid: np.ndarray,
        foreground: np.ndarray,
        encoded: Sequence[Any] | None = None,
        extra: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Append a batch: ``tiles`` uint8 (k, T, T, 3), ``coords`` (k, 2) level-0 px, ``grid`` (k, 2), ``foreground`` (k,);
        ``encoded``: the tiles already encoded with :attr:`tile_encoder` (written as given); ``extra``: more
        per-tile arrays (k, ...) by name, concatenated over batches and stored at :meth:`commit`."""
        k = len(tiles)
        if k == 0:
            return
        for name, values in (extra or {}).items():
            if len(values) != k:
                raise ValueError(f"extra array {name!r} has {len(values)} rows for {k} tiles")
            self.extra.setdefault(name, []).append(np.asarray(values))
        if tiles.shape[1:] != (self.tile_size, self.tile_size, 3) or tiles.dtype != np.uint8:
            raise ValueError(f"tiles must be uint8 (k, {self.tile_size}, {self.tile_size}, 3); got {tiles.dtype} {tiles.shape}")
        end = self.n + k
        if end > self.tiles.shape[0]:
            self.tiles.resize((max(end, 2 * self.tiles.shape[0]),) + self.tiles.shape[1:])
            grow = self.tiles.shape[0]
            self.coords = np.resize(self.coords, (grow, 2))
            self.grid = np.resize(self.grid, (grow, 2))
            self.foreground = np.resize(self.foreground, (grow,))
        if encoded is not None and (self._direct is None or len(encoded) != k):
            raise ValueError(f"encoded: {len(encoded)} pre-encoded tiles for {k} tiles, on a store with tile_encoder {self.tile_encoder}")
        if self._direct is not None:
            for i, tile in enumerate(tiles):
                self._direct.write(self.n + i, tile, None if encoded is None else encoded[i])
        elif self.shard_tiles:
            self._buffer_for_zarr(tiles)
        else:
            self.tiles[self.n : end] = tiles
        self.coords[self.n : end] = coords
        self.grid[self.n : end] = grid
        self.foreground[self.n : end] = foreground
        self.n = end

    def _buffer_for_zarr(self, tiles: np.ndarray) -> None:
        """Sharded layout with codecs only zarr knows: hold the open shard's tiles, write whole shards."""
        self._pending.append(np.array(tiles, np.uint8))
        S = self.shard_tiles
        held = sum(len(t) for t in self._pending)
        if (self._pending_start + held) // S > self._pending_start // S:
            block = np.concatenate(self._pending)
            cut = (self._pending_start + held) // S * S - self._pending_start
            self.tiles[self._pending_start : self._pending_start + cut] = block[:cut]
            self._pending = [block[cut:]] if cut < len(block) else []
            self._pending_start += cut

    def _flush(self) -> None:
        """Write the last, partial shard."""
        if self._direct is not None:
            self._direct.flush()
        elif self._pending:
            block = np.concatenate(self._pending)
            self.tiles[self._pending_start : self._pending_start + len(block)] = block
            self._pending, self._pending_start = [], self._pending_start + len(block)

    def add_array(self, name: str, values: np.ndarray) -> None:
        """Store an extra per-tile or per-slide array (e.g. ``lesion`` ground truth) under ``name``, as one chunk
        (one file); written at :meth:`commit` (the same name again replaces it)."""
        self._arrays[name] = np.ascontiguousarray(values)

    def set_attrs(self, attrs: Mapping[str, Any]) -> None:
        """Add store attributes (e.g. timings); written at :meth:`commit` with ``complete: true``, in one write."""
        self._attrs.update(attrs)

    @property
    def bytes_written(self) -> int:
        """Bytes of the committed store's chunk and shard files (its ``integrity`` record; 0 before commit)."""
        return int(sum(self.files.values()))

    def commit(self) -> Path:
        """Trim, write the small arrays, mark ``complete: true`` last, and rename into place.

        The small arrays (``coords``, ``grid``, ``foreground``, :meth:`add_array`'s) and the metadata of a
        directly written ``tiles`` array are written here as files (:func:`_write_small_array`: zarr's own
        metadata and codec chain, without a trip to zarr's event loop per array: on a store of a few tiles
        those trips cost several times the decode of the image). The attributes, with ``complete: true``
        and the ``integrity`` record of every chunk file, are then one write of the group's ``zarr.json``.
        No file is fsynced: the store is built under a temporary name and only the final rename makes it
        visible, so a crash leaves a temporary store (removed by the next run) or, after a machine crash, a
        store whose ``integrity`` check fails on open and is rebuilt.
        """
        n = self.n
        self._flush()
        shape = (n,) + tuple(self.tiles.shape[1:])
        if self._direct is not None:  # its chunk or shard files cover the first n tiles only: nothing to delete
            _write_json(self.tmp / "tiles", _shaped(self._tiles_json or _zarr_json(self.tiles.metadata), shape))
        else:
            self.tiles.resize(shape)
        arrays: dict[str, np.ndarray] = {"coords": self.coords[:n], "grid": self.grid[:n], "foreground": self.foreground[:n]}
        arrays.update({name: np.concatenate(parts) for name, parts in self.extra.items()})
        arrays.update(self._arrays)
        for name, values in arrays.items():
            _write_small_array(self.group, self.tmp, name, values)
        self.files = _chunk_files(self.tmp)
        attrs = {**self.group.metadata.attributes, **self._attrs, "n_tiles": n,
                 "integrity": {"scheme": INTEGRITY_SCHEME, "files": self.files}, "complete": True}
        _write_json(self.tmp, _group_json(attrs))
        old = None
        if self.path.exists() or self.path.is_symlink():
            if not is_tile_store(self.path):
                raise FileExistsError(
                    f"{self.path} exists and is not a tile store (no zarr.json naming a slide_id); it was not written by "
                    "wsi-pipeline, so it is left alone: move it away or choose another output folder"
                )
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Remove the temporary store; the destination (if any) is untouched."""
        if isinstance(self._direct, _DirectShards):
            self._direct.discard()
        shutil.rmtree(self.tmp, ignore_errors=True)


#: zarr.json contents (dicts) made by zarr once per process: small arrays by (dtype, rank), ``tiles`` by layout.
_SMALL_TEMPLATES: dict[tuple[str, int], tuple[dict[str, Any], str, DirectCodec]] = {}
_TILES_TEMPLATES: dict[str, dict[str, Any]] = {}


def _write_json(folder: Path, meta: Mapping[str, Any]) -> None:
    """Write a zarr v3 node's metadata ``meta`` (the dict zarr serialises) as ``folder/zarr.json``.

    zarr writes the same dict with ``json.dumps(allow_nan=True, indent=2)``; without the indent the C
    encoder does it (a tenth of the time on a store's attributes) and any JSON reader, zarr's included,
    reads the same metadata.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zarr.json").write_bytes(json.dumps(meta, allow_nan=True).encode())


def _zarr_json(meta: Any) -> dict[str, Any]:
    """The dict zarr writes as ``zarr.json`` for the metadata object ``meta``."""
    from zarr.core.buffer import default_buffer_prototype

    out: dict[str, Any] = json.loads(meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())
    return out


def _group_json(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The group ``zarr.json`` dict zarr writes for a group with ``attrs`` (``GroupMetadata.to_dict``)."""
    return {"attributes": dict(attrs), "zarr_format": 3, "consolidated_metadata": None, "node_type": "group"}


def _shaped(meta: Mapping[str, Any], shape: tuple[int, ...], chunks: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Array metadata dict ``meta`` with another shape (and chunk shape)."""
    d = dict(meta)
    d["shape"] = [int(v) for v in shape]
    if chunks is not None:
        d["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [int(v) for v in chunks]}}
    return d


def _create_direct(root: Path, attrs: dict[str, Any], shape: tuple[int, ...], layout: Mapping[str, Any],
                   codecs: Mapping[str, Any]) -> tuple[zarr.Group, zarr.Array, dict[str, Any]] | None:
    """Create the store folder ``root`` for a group with ``attrs`` and a ``tiles`` array of ``shape`` that the direct
    writer writes (:func:`_direct_for`): the group, the array and the array's metadata dict; None otherwise
    (nothing written).

    The metadata is zarr's own: the ``tiles`` array's is made once per process by zarr in memory and given
    this shape, the group's is ``GroupMetadata.to_dict``'s, written now and again at commit;
    :meth:`StoreWriter.commit` writes the array's, as
    ``zarr.open_group(mode="w")``, ``create_array`` and ``resize`` would have, without the trips to zarr's
    event loop they cost (a store of a few tiles would spend more on those than on its tiles).
    """
    from zarr.core.array import AsyncArray
    from zarr.core.group import AsyncGroup, GroupMetadata
    from zarr.core.metadata.v3 import ArrayV3Metadata
    from zarr.storage import LocalStore, StorePath

    key = repr((shape[1:], sorted(layout.items()), sorted(codecs.items())))
    template = _TILES_TEMPLATES.get(key)
    if template is None:
        made = zarr.create_array(zarr.storage.MemoryStore(), shape=shape, dtype="uint8", **layout, **codecs)
        template = _TILES_TEMPLATES[key] = _zarr_json(made.metadata)
    store = LocalStore(str(root))
    meta = _shaped(template, shape)
    tiles = zarr.Array(AsyncArray(metadata=ArrayV3Metadata.from_dict(meta), store_path=StorePath(store, "tiles")))
    if _direct_for(tiles) is None:
        return None
    # the group's zarr.json now (a partial store says ``complete: false``), the tiles' at commit (their number is
    # known only then; the direct writer needs none)
    _write_json(root, _group_json(attrs))
    group = AsyncGroup(metadata=GroupMetadata(attributes=attrs), store_path=StorePath(store, ""))
    return zarr.Group(group), tiles, meta


def _write_small_array(group: zarr.Group, root: Path, name: str, values: np.ndarray) -> None:
    """Write ``values`` as the array ``name`` of the store folder ``root``: one chunk (one file, ``c.0.0``: the flat
    chunk keys of the ``tiles`` array), zstd level 1 and a CRC-32C, as ``group.create_array(name, data=values,
    chunks=values.shape, chunk_key_encoding=FLAT_KEYS)`` writes it.

    The metadata is zarr's own (made once per dtype and rank by zarr in memory, then given this shape) and
    the chunk is encoded by the same codec chain (:func:`~wsi_pipeline.data.codecs.direct_codec`), so zarr
    and :class:`TileStore` read it as any other (a chunk of fill values only, which zarr leaves out, is
    written); a 0-d or non-numeric array is left to zarr.
    """
    from zarr.codecs import ZstdCodec

    values = np.ascontiguousarray(values)
    compressors = [ZstdCodec(level=1), checksum_codec()]
    if values.ndim == 0 or values.dtype.kind not in "biuf":
        group.create_array(name, data=values, chunks="auto", overwrite=True, compressors=compressors,
                           chunk_key_encoding=FLAT_KEYS)
        return
    chunks = tuple(max(int(v), 1) for v in values.shape)
    key = (values.dtype.str, values.ndim)
    template = _SMALL_TEMPLATES.get(key)
    if template is None:
        made = zarr.create_array(zarr.storage.MemoryStore(), shape=chunks, dtype=values.dtype, chunks=chunks,
                                 compressors=compressors, chunk_key_encoding=FLAT_KEYS)
        codec = direct_codec(getattr(made.metadata, "codecs", ()))
        if codec is None:  # pragma: no cover - bytes + zstd + crc32c is always one
            raise RuntimeError("no direct codec for the small arrays' codecs")
        template = _SMALL_TEMPLATES[key] = (_zarr_json(made.metadata), made.metadata.encode_chunk_key((0,) * values.ndim), codec)
    meta, chunk_key, codec = template
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    _write_json(folder, _shaped(meta, values.shape, chunks))
    if values.size:
        chunk = folder / chunk_key  # one file beside zarr.json (the tiles' flat chunk keys: no c/0/ folders)
        little = values.astype(values.dtype.newbyteorder("<"), copy=False)
        chunk.write_bytes(codec.encode(np.frombuffer(little.tobytes(), np.uint8)))


def _chunk_files(root: Path) -> dict[str, int]:
    """Every chunk or shard file of the store folder ``root`` (not the ``zarr.json`` metadata), as
    ``{path relative to root (with /): size in bytes}``."""
    files: dict[str, int] = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name == "zarr.json" or name.startswith("."):
                continue
            full = Path(dirpath) / name
            files[full.relative_to(root).as_posix()] = full.stat().st_size
    return dict(sorted(files.items()))


def _check_files(path: Path, attrs: Mapping[str, Any]) -> None:
    """The cheap check on open: every file the ``integrity`` record lists is there, with its size.

    Stores without the record (written by earlier versions) get the check zarr's metadata allows:
    the small arrays' chunks are all present.
    """
    record = attrs.get("integrity")
    if isinstance(record, Mapping) and record.get("scheme") == INTEGRITY_SCHEME:
        for rel, size in dict(record.get("files") or {}).items():
            try:
                found = os.stat(path / rel).st_size
            except FileNotFoundError:
                raise StoreDamagedError(path, f"{rel.split('/')[0]}: chunk file {rel} is missing") from None
            if found != int(size):
                raise StoreDamagedError(path, f"{rel.split('/')[0]}: chunk file {rel} has {found} bytes, expected {size}"
                                        " (truncated or overwritten)")
        return
    group = zarr.open_group(str(path), mode="r")
    for name in _ARRAYS[1:]:
        if name in group and int(attrs.get("n_tiles", 1) or 0) > 0:
            arr = _array(group, name, path)
            if arr.nchunks_initialized < arr.nchunks:
                raise StoreDamagedError(path, f"{name}: {arr.nchunks - arr.nchunks_initialized} of its {arr.nchunks} "
                                        "chunk file(s) are missing")


def _array(group: zarr.Group, name: str, path: Path) -> zarr.Array:
    """The array ``name`` of a store's group (a group found in its place is damage)."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise StoreDamagedError(path, f"{name}: expected an array, found a group")
    return node


def store_bytes(attrs: Mapping[str, Any]) -> int:
    """Bytes of a store's chunk and shard files, from its ``integrity`` record (0 for stores without one)."""
    record = attrs.get("integrity")
    if not isinstance(record, Mapping):
        return 0
    return int(sum(int(v) for v in dict(record.get("files") or {}).values()))


def store_problem(path: str | os.PathLike) -> str | None:
    """Why the store at ``path`` cannot be used (missing, partial, damaged files), or None (the
    cheap check of :class:`TileStore`; chunk checksums are checked when tiles are read)."""
    try:
        open_store(path)
    except (FileNotFoundError, StoreDamagedError, ValueError) as e:
        return str(e)
    return None


_NO_CHUNK = 2**64 - 1  # offset and length of an absent chunk in a shard index (zarr v3 sharding spec)


def _direct_for(array: Any) -> _DirectChunks | _DirectShards | None:
    """The direct reader/writer for a local zarr v3 ``tiles`` array whose layout and codecs it
    knows (one-tile chunks, raw / zstd / jpeg), or None: zarr then does the work."""
    try:
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
        from zarr.storage import LocalStore

        meta = array.metadata
        if not isinstance(array.store_path.store, LocalStore) or getattr(meta, "zarr_format", 3) != 3:
            return None
        if np.dtype(array.dtype) != np.uint8 or len(array.shape) != 4:
            return None
        tile_shape = (1,) + tuple(int(v) for v in array.shape[1:])
        grid_shape = tuple(int(v) for v in meta.chunk_grid.chunk_shape)
        codecs = tuple(meta.codecs)
        if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
            sh = codecs[0]
            if tuple(sh.chunk_shape) != tile_shape or grid_shape[1:] != tile_shape[1:]:
                return None
            index_codecs = tuple(sh.index_codecs)
            if not index_codecs or not isinstance(index_codecs[0], BytesCodec) or str(getattr(index_codecs[0].endian, "value", "")) != "little":
                return None
            if index_codecs[1:] not in ((), (Crc32cCodec(),)):
                return None
            codec = direct_codec(sh.codecs)
            if codec is None:
                return None
            return _DirectShards(array, codec, grid_shape[0], crc=len(index_codecs) == 2,
                                 index_at_end=sh.index_location.value == "end")
        if grid_shape != tile_shape:
            return None
        codec = direct_codec(codecs)
        return None if codec is None else _DirectChunks(array, codec)
    except Exception:  # any surprise in zarr's internals: let zarr do the work
        return None


def _shard_tiles_of(array: Any) -> int:
    """Tiles per shard of a ``tiles`` array, 0 when it is not sharded."""
    from zarr.codecs import ShardingCodec

    codecs = tuple(getattr(array.metadata, "codecs", ()))
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        return int(array.metadata.chunk_grid.chunk_shape[0])
    return 0


class _DirectChunks:
    """One-tile chunk files of a local zarr v3 array (one file per tile, the layout of older
    stores), read and written straight from/to disk: the same bytes zarr reads and writes, without
    its per-chunk asynchronous machinery (about half of the writer's CPU time per 256 px tile, and
    most of the reading time: ~3.5 ms per 256 px tile through zarr, ~0.5 ms directly).

    Built by :func:`_direct_for`.
    """

    def __init__(self, array: Any, codec: DirectCodec) -> None:
        self.meta = array.metadata
        self.store = Path(array.store_path.store.root)
        self.root = self.store / array.store_path.path
        self.codec = codec
        self.chunk_shape = tuple(int(v) for v in array.shape[1:])
        fill = self.meta.fill_value
        self.fill = 0 if fill is None else int(fill)

    def path(self, index: int) -> Path:
        return self.root / self.meta.chunk_key_encoding.encode_chunk_key((int(index),) + (0,) * len(self.chunk_shape))

    def write(self, index: int, tile: np.ndarray, data: Any = None) -> None:
        """Write ``tile`` (uint8, the chunk's shape) as chunk ``index`` (``data``: it already encoded)."""
        if data is None:
            data = self.codec.encode(np.ascontiguousarray(tile))
        dest = self.path(index)
        try:
            f = open(dest, "wb")
        except FileNotFoundError:  # "/" chunk keys: the chunk's folder is new
            dest.parent.mkdir(parents=True, exist_ok=True)
            f = open(dest, "wb")
        with f:
            f.write(data)

    def flush(self) -> None:
        """Nothing is held back: every chunk file is written by :meth:`write`."""

    def read(self, index: int, out: np.ndarray) -> None:
        """Read chunk ``index`` into ``out``; a missing chunk file is :class:`StoreDamagedError`
        (zarr would read the fill value), as is a chunk failing its checksum."""
        try:
            raw = self.path(index).read_bytes()
        except FileNotFoundError:
            raise StoreDamagedError(self.store, f"tile {index}: its chunk file {self.path(index).name} is missing") from None
        try:
            out[...] = np.frombuffer(self.codec.decode(raw), np.uint8).reshape(self.chunk_shape)
        except ChecksumError as e:
            raise StoreDamagedError(self.store, f"tile {index}: {e}") from None

    def read_many(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Read chunks ``indices`` into ``out[j]`` for each j."""
        for j, i in enumerate(indices):
            self.read(int(i), out[j])


class _DirectShards:
    """Shard files of a local zarr v3 array of one-tile chunks, read and written straight from/to disk.

    A shard file holds ``S`` = ``shard_tiles`` consecutive tiles: their encoded chunks back to back,
    then the shard index, ``S`` (offset, nbytes) pairs of little-endian uint64 (2**64 - 1 for an
    absent chunk), followed by its crc32c (4 bytes, little-endian) when the index codecs include
    ``crc32c`` (the zarr v3 sharding spec; zarr's default, which new stores use).

    Reading a tile takes one ``pread`` of its bytes; each shard's index is read once and kept, as
    long as the file's identity (inode, size, mtime) is unchanged. Writing streams tiles (in index
    order) into ``.<shard>.partial`` and renames it to the shard's key once its index is appended.
    """

    def __init__(self, array: Any, codec: DirectCodec, shard_tiles: int, *, crc: bool, index_at_end: bool) -> None:
        self.meta = array.metadata
        self.store = Path(array.store_path.store.root)
        self.root = self.store / array.store_path.path
        self.codec = codec
        self.S = int(shard_tiles)
        self.crc = crc
        self.index_at_end = index_at_end
        self.index_nbytes = 16 * self.S + (4 if crc else 0)
        self.chunk_shape = tuple(int(v) for v in array.shape[1:])
        fill = self.meta.fill_value
        self.fill = 0 if fill is None else int(fill)
        self._indexes: dict[int, tuple[tuple[int, int, int], np.ndarray]] = {}
        self._paths: dict[int, str] = {}
        # the shard being written: number, open partial file, its index, bytes written so far
        self._shard = -1
        self._file: Any = None
        self._index: np.ndarray | None = None
        self._offset = 0
        self._next = 0

    def path(self, shard: int) -> Path:
        return self.root / self.meta.chunk_key_encoding.encode_chunk_key((int(shard),) + (0,) * len(self.chunk_shape))

    # writing

    def write(self, index: int, tile: np.ndarray, data: Any = None) -> None:
        """Append ``tile`` (uint8, the chunk's shape) as chunk ``index``; tiles must come in index order
        (``data``: it already encoded)."""
        if not self.index_at_end:
            raise ValueError(f"{self.root}: direct shard writes need the shard index at the end")
        if int(index) != self._next:
            raise ValueError(f"{self.root}: tile {index} written out of order (expected tile {self._next}); shards are written sequentially")
        shard, j = divmod(int(index), self.S)
        if shard != self._shard:
            self.flush()
            self._open(shard)
        assert self._index is not None
        if data is None:
            data = self.codec.encode(np.ascontiguousarray(tile))
        n = self._file.write(data)
        self._index[j] = (self._offset, n)
        self._offset += n
        self._next += 1

    def _open(self, shard: int) -> None:
        dest = self.path(shard)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._shard = shard
        self._file = open(dest.with_name(f".{dest.name}.partial"), "wb")
        self._index = np.full((self.S, 2), _NO_CHUNK, dtype="<u8")
        self._offset = 0

    def flush(self) -> None:
        """Complete the shard being written: append its index, close it and rename it into place."""
        if self._file is None:
            return
        assert self._index is not None
        index = self._index.tobytes()
        if self.crc:
            import google_crc32c

            index += struct.pack("<I", google_crc32c.value(index))
        with self._file as f:
            f.write(index)
        os.replace(f.name, self.path(self._shard))
        self._file, self._index, self._shard = None, None, -1

    def discard(self) -> None:
        """Close the shard being written without completing it (its partial file is left for removal)."""
        if self._file is not None:
            self._file.close()
        self._file, self._index, self._shard = None, None, -1

    # reading

    def _shard_index(self, shard: int, fd: int) -> np.ndarray:
        st = os.fstat(fd)
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._indexes.get(shard)
        if cached is not None and cached[0] == key:
            return cached[1]
        size, nb = st.st_size, self.index_nbytes
        path = self.path(shard)
        if size < nb:
            raise StoreDamagedError(self.store, f"shard {path.name} has {size} bytes, fewer than its index ({nb} bytes for {self.S} tiles)")
        raw = os.pread(fd, nb, size - nb if self.index_at_end else 0)
        if self.crc:
            import google_crc32c

            body, (stored,) = raw[:-4], struct.unpack("<I", raw[-4:])
            if google_crc32c.value(body) != stored:
                raise StoreDamagedError(self.store, f"shard {path.name}: the index checksum (crc32c) does not match")
            raw = body
        index = np.frombuffer(raw, dtype="<u8").reshape(self.S, 2)
        present = index[:, 0] != _NO_CHUNK
        if np.any(index[present, 0] + index[present, 1] > size):
            raise StoreDamagedError(self.store, f"shard {path.name}: its index points past the end of the file ({size} bytes)")
        self._indexes[shard] = (key, index)
        return index

    def read(self, index: int, out: np.ndarray) -> None:
        """Read chunk ``index`` into ``out`` (an absent shard or chunk, or one failing its checksum, is
        :class:`StoreDamagedError`: zarr would read the fill value)."""
        self.read_many(np.array([index]), out[None])

    def _shard_file(self, shard: int) -> str:
        path = self._paths.get(shard)
        if path is None:
            path = self._paths[shard] = str(self.path(shard))
        return path

    def read_many(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Read chunks ``indices`` into ``out[j]`` for each j, opening each shard once."""
        S = self.S
        order = np.argsort(indices, kind="stable") if len(indices) > 1 else range(1)
        shard, fd = -1, -1
        index = np.empty((0, 2), np.uint64)  # the current shard's index: read at the first tile (shard -1 matches none)
        try:
            for j in order:
                i = int(indices[j])
                if i // S != shard:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    shard = i // S
                    try:
                        fd = os.open(self._shard_file(shard), os.O_RDONLY)
                    except FileNotFoundError:
                        raise StoreDamagedError(self.store, f"tile {i}: its shard file {self.path(shard).name} is missing") from None
                    index = self._shard_index(shard, fd)
                offset, nbytes = index[i - shard * S]
                if offset == _NO_CHUNK:
                    raise StoreDamagedError(self.store, f"tile {i}: absent from the index of shard {self.path(shard).name}")
                raw = os.pread(fd, int(nbytes), int(offset))
                if len(raw) != int(nbytes):
                    raise StoreDamagedError(self.store, f"tile {i}: shard {self.path(shard).name} ends inside it (truncated)")
                try:
                    out[j] = np.frombuffer(self.codec.decode(raw), np.uint8).reshape(self.chunk_shape)
                except ChecksumError as e:
                    raise StoreDamagedError(self.store, f"tile {i}: {e}") from None
        finally:
            if fd >= 0:
                os.close(fd)


def complete_attrs(path: str | os.PathLike) -> dict[str, Any] | None:
    """The attributes of a complete store at ``path``; None when it is missing, unreadable,
    partial (its attributes do not say ``complete: true``, which a writer sets last) or damaged
    (a file its ``integrity`` record lists is missing or has another size)."""
    attrs = marked_complete(path)
    if attrs is None:
        return None
    try:
        TileStore(path)  # the check every reader makes (verify, train, eval): tile and they agree on "complete"
    except Exception:  # any unreadable or damaged store is simply not complete
        return None
    return attrs


def marked_complete(path: str | os.PathLike) -> dict[str, Any] | None:
    """The attributes of the store at ``path`` when they say ``complete: true`` (its files unchecked);
    None when it is missing, unreadable or partial."""
    if not os.path.isfile(os.path.join(path, "zarr.json")):  # no store (the usual case on a first run): no zarr call
        return None
    try:
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception:  # any unreadable or missing store is simply not complete
        return None
    return attrs if attrs.get("complete") else None


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a readable, undamaged store whose attributes say ``complete: true``."""
    return complete_attrs(path) is not None


class TileStore:
    """Read access to a complete tile store.

    Attributes
    ----------
    path, attrs : the store and its attributes.
    shard_tiles : tiles per shard file; 0 for a store with one file per tile.
    coords : int64 (N, 2) tile top-left (x, y) in level-0 px.
    grid : int32 (N, 2) tile (col, row) at the read resolution.
    foreground : float32 (N,).
    tile_size : T in px.
    stain : the slide's stain normalisation (a :class:`~wsi_pipeline.data.stain_slides.SlideStain`),
        set by the stage that opened the store and applied on the tiles' way to a tensor; None: none.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.stain: Any = None
        register_codecs()  # a JPEG-compressed store needs its codec known to zarr before opening
        self.group = zarr.open_group(str(self.path), mode="r")
        self.attrs: dict[str, Any] = dict(self.group.attrs)
        try:  # an array's metadata (zarr.json) that does not parse is damage, named like any other
            missing = [name for name in _ARRAYS if name not in self.group]
            if missing:
                raise StoreDamagedError(self.path, f"array(s) {missing} are missing")
            _check_files(self.path, self.attrs)
            self._tiles = _array(self.group, "tiles", self.path)
        except StoreDamagedError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreDamagedError(self.path, f"an array's metadata does not read ({type(e).__name__}: {e})") from None
        try:
            self.coords = np.asarray(_array(self.group, "coords", self.path)[:])
            self.grid = np.asarray(_array(self.group, "grid", self.path)[:])
            self.foreground = np.asarray(_array(self.group, "foreground", self.path)[:])
        except (ValueError, RuntimeError, KeyError, TypeError) as e:  # zarr's crc32c codec: "Stored and computed checksum do not match"
            raise StoreDamagedError(self.path, f"a small array does not decode ({e})") from None
        lengths = {"tiles": int(self._tiles.shape[0]), "coords": len(self.coords), "grid": len(self.grid),
                   "foreground": len(self.foreground)}
        if "n_tiles" in self.attrs:
            lengths["n_tiles attribute"] = int(self.attrs["n_tiles"])
        if len(set(lengths.values())) > 1:
            raise StoreDamagedError(self.path, f"its arrays disagree on the number of tiles ({lengths})")
        self.tile_size = int(self._tiles.shape[1])
        #: tiles per shard file, 0 for the one-file-per-tile layout of older stores
        self.shard_tiles = _shard_tiles_of(self._tiles)
        self._direct = _direct_for(self._tiles)

    @property
    def slide_id(self) -> str:
        return str(self.attrs.get("slide_id", self.path.stem))

    def __len__(self) -> int:
        return int(self._tiles.shape[0])

    def read(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Return tiles as uint8 (k, T, T, 3) in the order of ``indices`` (all tiles when None)."""
        if indices is None:
            if self._direct is None:
                return np.asarray(self._tiles[:])
            indices = np.arange(len(self))
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return np.zeros((0, self.tile_size, self.tile_size, 3), np.uint8)
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"tile index out of range [0, {len(self)}) in store {self.path}")
        if self._direct is not None:
            out = np.empty((len(idx),) + tuple(self._tiles.shape[1:]), np.uint8)
            self._direct.read_many(idx, out)
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        uniq, inverse = np.unique(sorted_idx, return_inverse=True)
        try:
            block = np.asarray(self._tiles.get_orthogonal_selection((uniq,)))
        except (ValueError, RuntimeError) as e:  # zarr's crc32c codec on a damaged chunk
            raise StoreDamagedError(self.path, f"tiles {uniq[:5].tolist()}...: {e}") from None
        out = np.empty((len(idx),) + block.shape[1:], np.uint8)
        out[order] = block[inverse]
        return out

    def array(self, name: str) -> np.ndarray:
        """Return an extra array stored with :meth:`StoreWriter.add_array` (KeyError naming it if absent)."""
        if name not in self.group:
            raise KeyError(f"store {self.path} has no array {name!r}; it has {sorted(self.group.array_keys())}")
        return np.asarray(_array(self.group, name, self.path)[:])


def verify_store(path: str | os.PathLike, *, batch: int = 64) -> tuple[int, str | None]:
    """Check a store fully: :class:`TileStore`'s checks on open, then every tile read and its checksum
    checked, ``batch`` tiles at a time. Return ``(tiles read, problem or None)``."""
    try:
        store = open_store(path)
    except (FileNotFoundError, ValueError) as e:
        return 0, str(e)
    n = len(store)
    try:
        for start in range(0, n, batch):
            store.read(np.arange(start, min(start + batch, n)))
    except StoreDamagedError as e:
        return start, e.problem
    return n, None


def open_store(path: str | os.PathLike) -> TileStore:
    """Open a complete store; raise ``FileNotFoundError`` if absent, :class:`StoreDamagedError` if
    its files are missing or truncated, and ``ValueError`` if partial."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tile store not found: {path}; run `wsi-pipeline tile` first")
    if marked_complete(path) is None:
        raise ValueError(f"tile store {path} is partial (no `complete: true`); rerun `wsi-pipeline tile` to rebuild it")
    return TileStore(path)


def store_tile_extent(attrs: Mapping[str, Any], tile_size: int) -> float:
    """Tile side in level-0 px: ``tile_size * downsample`` (store attribute, default 1)."""
    return float(tile_size) * float(attrs.get("downsample", 1.0) or 1.0)


def store_level0_size(attrs: Mapping[str, Any], coords: np.ndarray, tile_extent: float) -> tuple[int, int]:
    """Level-0 (width, height) of a store's slide.

    From the store attributes when the tiler recorded them (``level0_size``, ``slide_dimensions``
    or ``dimensions`` as (W, H)), else the bounding box of the tiles from the origin.
    """
    for key in ("level0_size", "slide_dimensions", "dimensions"):
        v = attrs.get(key)
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(float(x) > 0 for x in v):
            return int(v[0]), int(v[1])
    c = np.asarray(coords).reshape(-1, 2)
    if len(c) == 0:
        return max(1, int(math.ceil(tile_extent))), max(1, int(math.ceil(tile_extent)))
    return int(math.ceil(c[:, 0].max() + tile_extent)), int(math.ceil(c[:, 1].max() + tile_extent))
