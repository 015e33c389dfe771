"""The zarr v3 tile store ``<tiles_dir>/<slide_id>.zarr`` (schema in ``data_manifests/README.md``).

Arrays: ``tiles`` uint8 (N, T, T, 3) RGB, one tile per chunk; ``coords`` int64 (N, 2), (x, y) of
each tile's top-left corner in level-0 px; ``grid`` int32 (N, 2), (col, row) on the slide's tile
grid at the read resolution; ``foreground`` float32 (N,); stores from the tiler also hold
``level_coords`` int64 (N, 2), each tile's source origin in px of the read level. Attributes
describe the slide and the tiling (with the tile formula's parameters, see
:mod:`wsi_pipeline.tiling.grid`); ``complete: true`` is written last.

Writes are atomic at the store level: :class:`StoreWriter` builds ``.<slide_id>.zarr.tmp-<pid>``
beside the destination and only :meth:`StoreWriter.commit` swaps it in, so a crash never
leaves a store marked complete, and a failed rebuild never destroys an earlier good store.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from wsi_pipeline.tiling.codecs import tile_codecs_for

__all__ = ["StoreWriter", "TileStore", "open_store", "is_complete", "store_path", "COMPRESSIONS"]

#: Tile compressions: lossless ``zstd`` (default), ``none``, or lossy ``jpeg`` (quality 90).
COMPRESSIONS: tuple[str, ...] = ("zstd", "none", "jpeg")


def store_path(tiles_dir: str | os.PathLike, slide_id: str) -> Path:
    """Return the path of ``slide_id``'s store inside ``tiles_dir``."""
    return Path(tiles_dir) / f"{slide_id}.zarr"


class StoreWriter:
    """Write one slide's tiles into a temporary store, then :meth:`commit` it atomically.

    Parameters
    ----------
    path : destination ``<slide_id>.zarr``.
    tile_size : tile side T in px (at the read resolution).
    capacity : upper bound on the number of tiles; the arrays are trimmed at commit.
    attrs : store attributes (``complete`` is set by :meth:`commit` only).
    compression : one of :data:`COMPRESSIONS` (its codecs from
        :func:`~wsi_pipeline.tiling.codecs.tile_codecs_for`, as the tiling runner writes them).
    tile_codecs : explicit ``create_array`` codec arguments, overriding ``compression``.
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
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tile_size = int(tile_size)
        self.n = 0
        cap = max(int(capacity), 1)
        self.group = zarr.open_group(str(self.tmp), mode="w")
        self.group.attrs.update({**dict(attrs), "complete": False})
        codecs = dict(tile_codecs) if tile_codecs is not None else tile_codecs_for(compression)
        T = self.tile_size
        self.tiles = self.group.create_array("tiles", shape=(cap, T, T, 3), chunks=(1, T, T, 3), dtype="uint8", **codecs)
        self._direct = _DirectChunks.for_array(self.tiles)
        self.coords = np.zeros((cap, 2), np.int64)
        self.grid = np.zeros((cap, 2), np.int32)
        self.foreground = np.zeros((cap,), np.float32)
        self.extra: dict[str, list[np.ndarray]] = {}

    def append(
        self,
        tiles: np.ndarray,
        coords: np.ndarray,
        grid: np.ndarray,
        foreground: np.ndarray,
    ) -> None:
        """Append a batch: ``tiles`` uint8 (k, T, T, 3), ``coords`` (k, 2) level-0 px, ``grid`` (k, 2), ``foreground`` (k,)."""
        k = len(tiles)
        if k == 0:
            return
        if tiles.shape[1:] != (self.tile_size, self.tile_size, 3) or tiles.dtype != np.uint8:
            raise ValueError(f"tiles must be uint8 (k, {self.tile_size}, {self.tile_size}, 3); got {tiles.dtype} {tiles.shape}")
        end = self.n + k
        if end > self.tiles.shape[0]:
            self.tiles.resize((max(end, 2 * self.tiles.shape[0]),) + self.tiles.shape[1:])
            grow = self.tiles.shape[0]
            self.coords = np.resize(self.coords, (grow, 2))
            self.grid = np.resize(self.grid, (grow, 2))
            self.foreground = np.resize(self.foreground, (grow,))
        if self._direct is not None:
            self._write_direct(self.n, tiles)
        else:
            self.tiles[self.n : end] = tiles
        self.coords[self.n : end] = coords
        self.grid[self.n : end] = grid
        self.foreground[self.n : end] = foreground
        self.n = end

    def _write_direct(self, start: int, tiles: np.ndarray) -> None:
        """Write one chunk file per tile straight to the local store (same bytes zarr would write)."""
        assert self._direct is not None
        for i, tile in enumerate(tiles):
            self._direct.write(start + i, tile)

    def add_array(self, name: str, values: np.ndarray) -> None:
        """Store an extra per-tile or per-slide array (e.g. ``lesion`` ground truth) under ``name``."""
        self.group.create_array(name, data=np.asarray(values), overwrite=True)

    def commit(self) -> Path:
        """Trim, write the small arrays, mark ``complete: true`` last, and rename into place."""
        n = self.n
        self.tiles.resize((n,) + self.tiles.shape[1:])
        for name, arr in (("coords", self.coords[:n]), ("grid", self.grid[:n]), ("foreground", self.foreground[:n])):
            self.group.create_array(name, data=np.ascontiguousarray(arr), overwrite=True)
        self.group.attrs.update({"n_tiles": n})
        self.group.attrs.update({"complete": True})
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Remove the temporary store; the destination (if any) is untouched."""
        shutil.rmtree(self.tmp, ignore_errors=True)


class _DirectChunks:
    """One-tile chunk files of a local zarr v3 array with plain ``bytes`` (+ ``zstd``) codecs, read
    and written straight from/to disk: the same bytes zarr reads and writes, without its
    per-chunk asynchronous machinery (about half of the writer's CPU time per 256 px tile, and
    most of the reading time: ~3.5 ms per 256 px tile through zarr, ~0.5 ms directly).

    Built by :meth:`for_array`, which returns None for any other layout (zarr handles those).
    """

    def __init__(self, array: Any, codec: Any | None) -> None:
        self.meta = array.metadata
        self.root = Path(array.store_path.store.root) / array.store_path.path
        self.codec = codec  # numcodecs Zstd, or None for uncompressed chunks
        self.chunk_shape = tuple(int(v) for v in self.meta.chunk_grid.chunk_shape[1:])
        fill = self.meta.fill_value
        self.fill = 0 if fill is None else int(fill)

    @classmethod
    def for_array(cls, array: Any) -> _DirectChunks | None:
        try:
            from numcodecs import Zstd
            from zarr.codecs import BytesCodec, ZstdCodec
            from zarr.storage import LocalStore

            meta = array.metadata
            if not isinstance(array.store_path.store, LocalStore) or getattr(meta, "zarr_format", 3) != 3:
                return None
            if tuple(meta.chunk_grid.chunk_shape) != (1,) + tuple(array.shape[1:]) or np.dtype(array.dtype) != np.uint8:
                return None
            codecs = tuple(meta.codecs)
            if not codecs or not isinstance(codecs[0], BytesCodec):
                return None
            if len(codecs) == 1:
                return cls(array, None)
            if len(codecs) == 2 and isinstance(codecs[1], ZstdCodec):
                return cls(array, Zstd(level=codecs[1].level, checksum=codecs[1].checksum))
        except Exception:  # any surprise in zarr's internals: let zarr do the work
            return None
        return None

    def path(self, index: int) -> Path:
        return self.root / self.meta.chunk_key_encoding.encode_chunk_key((int(index),) + (0,) * len(self.chunk_shape))

    def write(self, index: int, tile: np.ndarray) -> None:
        """Write ``tile`` (uint8, the chunk's shape) as chunk ``index``."""
        tile = np.ascontiguousarray(tile)
        data = memoryview(tile).cast("B") if self.codec is None else self.codec.encode(tile)
        dest = self.path(index)
        try:
            f = open(dest, "wb")
        except FileNotFoundError:  # "/" chunk keys: the chunk's folder is new
            dest.parent.mkdir(parents=True, exist_ok=True)
            f = open(dest, "wb")
        with f:
            f.write(data)

    def read(self, index: int, out: np.ndarray) -> None:
        """Read chunk ``index`` into ``out`` (a missing chunk file reads as the fill value, as in zarr)."""
        try:
            raw = self.path(index).read_bytes()
        except FileNotFoundError:
            out[...] = self.fill
            return
        data = raw if self.codec is None else self.codec.decode(raw)
        out[...] = np.frombuffer(data, np.uint8).reshape(self.chunk_shape)


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a readable store whose attributes say ``complete: true``."""
    try:
        return bool(zarr.open_group(str(path), mode="r").attrs.get("complete", False))
    except Exception:  # any unreadable or missing store is simply not complete
        return False


class TileStore:
    """Read access to a complete tile store.

    Attributes
    ----------
    path, attrs : the store and its attributes.
    coords : int64 (N, 2) tile top-left (x, y) in level-0 px.
    grid : int32 (N, 2) tile (col, row) at the read resolution.
    foreground : float32 (N,).
    tile_size : T in px.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.group = zarr.open_group(str(self.path), mode="r")
        self.attrs: dict[str, Any] = dict(self.group.attrs)
        self._tiles = self.group["tiles"]
        self.coords = np.asarray(self.group["coords"][:])
        self.grid = np.asarray(self.group["grid"][:])
        self.foreground = np.asarray(self.group["foreground"][:])
        self.tile_size = int(self._tiles.shape[1])
        self._direct = _DirectChunks.for_array(self._tiles)

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
            for j, i in enumerate(idx):
                self._direct.read(int(i), out[j])
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        uniq, inverse = np.unique(sorted_idx, return_inverse=True)
        block = np.asarray(self._tiles.get_orthogonal_selection((uniq,)))
        out = np.empty((len(idx),) + block.shape[1:], np.uint8)
        out[order] = block[inverse]
        return out

    def array(self, name: str) -> np.ndarray:
        """Return an extra array stored with :meth:`StoreWriter.add_array` (KeyError naming it if absent)."""
        if name not in self.group:
            raise KeyError(f"store {self.path} has no array {name!r}; it has {sorted(self.group.array_keys())}")
        return np.asarray(self.group[name][:])


def open_store(path: str | os.PathLike) -> TileStore:
    """Open a complete store; raise ``FileNotFoundError`` if absent and ``ValueError`` if partial."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tile store not found: {path}; run `wsi-pipeline tile` first")
    if not is_complete(path):
        raise ValueError(f"tile store {path} is partial (no `complete: true`); rerun `wsi-pipeline tile` to rebuild it")
    return TileStore(path)
