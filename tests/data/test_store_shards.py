"""Sharded tile stores (zarr v3 sharding, one tile per inner chunk) and the older one-file-per-tile
stores: direct reads against zarr's own reads, the tiles written, the shard format per the zarr v3
sharding spec, crash safety of shard writes, and the tiler writing both layouts."""

from __future__ import annotations

import struct
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import zarr
from numcodecs import Zstd

from wsi_pipeline.cli.main import main
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.data.codecs import DEFAULT_SHARD_TILES, tile_codecs_for
from wsi_pipeline.data.store import StoreWriter, TileStore, _DirectChunks, _DirectShards, open_store

T = 16


def _tiles(n: int, seed: int = 0) -> np.ndarray:
    """Random RGB tiles, never all zero (an all-fill chunk is one zarr may leave out)."""
    return np.random.default_rng(seed).integers(1, 256, (n, T, T, 3)).astype(np.uint8)


def _write(path: Path, tiles: np.ndarray, batches: list[int], **kw) -> StoreWriter:
    """Append ``tiles`` in batches of the given sizes (cycled), starting from a small capacity so the array grows."""
    w = StoreWriter(path, tile_size=T, capacity=3, attrs={"slide_id": path.stem}, **kw)
    i, b = 0, 0
    while i < len(tiles):
        k = min(batches[b % len(batches)], len(tiles) - i)
        coords = np.stack([np.arange(i, i + k) * T, np.zeros(k, int)], axis=1)
        w.append(tiles[i : i + k], coords, coords // T, np.full(k, 0.9))
        i, b = i + k, b + 1
    return w


def _zarr_tiles(path: Path) -> zarr.Array:
    return zarr.open_array(str(path / "tiles"), mode="r")


@pytest.mark.parametrize("compression", ["zstd", "none", "jpeg"])
def test_sharded_store_random_reads_direct_equal_zarr_and_written(tmp_path: Path, compression: str) -> None:
    tiles = _tiles(45, seed=1)
    S = 8  # 45 tiles: 5 full shards and a partial one; batches of 3 and 7 cross shard boundaries
    _write(tmp_path / "s.zarr", tiles, [3, 7], compression=compression, shard_tiles=S).commit()
    store = open_store(tmp_path / "s.zarr")
    assert isinstance(store._direct, _DirectShards) and store.shard_tiles == S and len(store) == 45
    shard_files = sorted(p.name for p in (tmp_path / "s.zarr" / "tiles").iterdir() if p.name != "zarr.json")
    assert shard_files == [f"c.{s}.0.0.0" for s in range(6)]  # ceil(45 / 8), nothing else left behind
    ref = _zarr_tiles(tmp_path / "s.zarr")
    assert ref.shards == (S, T, T, 3) and ref.chunks == (1, T, T, 3)
    idx = np.random.default_rng(2).integers(0, 45, 200)  # random order, with repeats
    got = store.read(idx)
    np.testing.assert_array_equal(got, ref.get_orthogonal_selection((idx,)))
    for i in idx[:20]:  # one tile per call, as a data loader reads them
        np.testing.assert_array_equal(store.read([int(i)])[0], ref[int(i)])
    np.testing.assert_array_equal(store.read(), ref[:])
    if compression != "jpeg":  # lossless: the tiles written come back
        np.testing.assert_array_equal(got, tiles[idx])
    else:  # lossy, within JPEG's error on random noise, but the tiles were really stored
        assert np.abs(got.astype(int) - tiles[idx]).mean() < 60
    np.testing.assert_array_equal(store.coords[:, 0], np.arange(45) * T)


@pytest.mark.parametrize("compression", ["zstd", "none", "jpeg"])
def test_shard_files_are_the_bytes_zarr_writes(tmp_path: Path, compression: str) -> None:
    """The direct writer's shard files equal zarr's own, for the same array settings (partial last shard included)."""
    tiles = _tiles(21, seed=3)
    _write(tmp_path / "a.zarr", tiles, [5], compression=compression, shard_tiles=8).commit()
    ref = zarr.open_group(str(tmp_path / "b.zarr"), mode="w").create_array(
        "tiles", shape=tiles.shape, chunks=(1, T, T, 3), shards=(8, T, T, 3), dtype="uint8", **tile_codecs_for(compression))
    ref[:] = tiles
    for s in range(3):
        key = ref.metadata.chunk_key_encoding.encode_chunk_key((s, 0, 0, 0))
        assert (tmp_path / "a.zarr" / "tiles" / key).read_bytes() == (tmp_path / "b.zarr" / "tiles" / key).read_bytes()


def test_shard_layout_follows_the_zarr_v3_sharding_spec(tmp_path: Path) -> None:
    """Parse a shard by the spec alone: chunks (each zstd frame followed by its crc32c, the codec
    chain bytes -> zstd -> crc32c), then S (offset, nbytes) little-endian uint64 pairs, then crc32c."""
    tiles = _tiles(13, seed=4)
    S = 8
    _write(tmp_path / "s.zarr", tiles, [13], compression="zstd", shard_tiles=S).commit()
    z = Zstd()
    for s, n_in in ((0, 8), (1, 5)):
        raw = (tmp_path / "s.zarr" / "tiles" / f"c.{s}.0.0.0").read_bytes()
        index_bytes, crc = raw[-(16 * S + 4) : -4], raw[-4:]
        assert struct.unpack("<I", crc)[0] == google_crc32c.value(index_bytes)
        index = np.frombuffer(index_bytes, "<u8").reshape(S, 2)
        for j in range(S):
            off, nb = (int(v) for v in index[j])
            if j >= n_in:  # beyond the array's end: absent
                assert off == nb == 2**64 - 1
                continue
            chunk, chunk_crc = raw[off : off + nb - 4], raw[off + nb - 4 : off + nb]
            assert struct.unpack("<I", chunk_crc)[0] == google_crc32c.value(chunk)
            tile = np.frombuffer(z.decode(chunk), np.uint8).reshape(T, T, 3)
            np.testing.assert_array_equal(tile, tiles[s * S + j])


def test_old_one_file_per_tile_stores_still_read(tmp_path: Path) -> None:
    """A store in the older layout, written by zarr alone (one chunk file per tile), reads directly and equals zarr."""
    tiles = _tiles(30, seed=5)
    g = zarr.open_group(str(tmp_path / "old.zarr"), mode="w")
    g.attrs.update({"slide_id": "old", "complete": False})
    arr = g.create_array("tiles", shape=tiles.shape, chunks=(1, T, T, 3), dtype="uint8", **tile_codecs_for("zstd"))
    arr[:] = tiles
    coords = np.stack([np.arange(30) * T, np.zeros(30, int)], axis=1).astype(np.int64)
    g.create_array("coords", data=coords)
    g.create_array("grid", data=(coords // T).astype(np.int32))
    g.create_array("foreground", data=np.ones(30, np.float32))
    g.attrs.update({"complete": True})
    assert len([p for p in (tmp_path / "old.zarr" / "tiles").iterdir() if p.name.startswith("c.")]) == 30
    store = open_store(tmp_path / "old.zarr")
    assert isinstance(store._direct, _DirectChunks) and store.shard_tiles == 0
    idx = np.random.default_rng(6).integers(0, 30, 100)
    np.testing.assert_array_equal(store.read(idx), tiles[idx])
    np.testing.assert_array_equal(store.read(idx), _zarr_tiles(tmp_path / "old.zarr").get_orthogonal_selection((idx,)))
    # and the writer still writes that layout on request
    _write(tmp_path / "w.zarr", tiles, [4], shard_tiles=0).commit()
    assert len([p for p in (tmp_path / "w.zarr" / "tiles").iterdir() if p.name.startswith("c.")]) == 30
    np.testing.assert_array_equal(open_store(tmp_path / "w.zarr").read(idx), tiles[idx])


def test_sharded_store_with_codecs_only_zarr_knows(tmp_path: Path) -> None:
    """Inner codecs without a direct path (blosc): whole shards go through zarr, reads too."""
    from zarr.codecs import BloscCodec

    tiles = _tiles(19, seed=7)
    w = _write(tmp_path / "b.zarr", tiles, [3, 6], tile_codecs={"compressors": [BloscCodec()]}, shard_tiles=4)
    assert w._direct is None
    w.commit()
    store = open_store(tmp_path / "b.zarr")
    assert store._direct is None and store.shard_tiles == 4
    idx = np.random.default_rng(8).integers(0, 19, 50)
    np.testing.assert_array_equal(store.read(idx), tiles[idx])
    # default "/" chunk keys here: tiles/c/<shard>/0/0/0
    assert len([p for p in (tmp_path / "b.zarr" / "tiles").rglob("*") if p.is_file() and p.name != "zarr.json"]) == 5


def test_shard_is_complete_or_absent_and_abort_keeps_the_old_store(tmp_path: Path) -> None:
    tiles = _tiles(11, seed=9)
    path = tmp_path / "s.zarr"
    _write(path, tiles[:5], [5], shard_tiles=4).commit()
    w = _write(path, tiles, [3], shard_tiles=4)  # a rebuild, stopped mid-shard (tiles 8..10 of shard 2)
    names = sorted(p.name for p in (w.tmp / "tiles").iterdir())
    assert names == [".c.2.0.0.0.partial", "c.0.0.0.0", "c.1.0.0.0", "zarr.json"]
    # the finished shards are whole (zarr reads them); the shard in progress is not one yet
    partial = zarr.open_array(str(w.tmp / "tiles"), mode="r")
    np.testing.assert_array_equal(partial[:8], tiles[:8])
    assert not partial[8:11].any()  # absent shard: fill value
    w.abort()
    assert not w.tmp.exists()
    np.testing.assert_array_equal(open_store(path).read(), tiles[:5])
    with pytest.raises(ValueError, match="out of order"):
        w2 = StoreWriter(tmp_path / "x.zarr", tile_size=T, capacity=4, attrs={}, shard_tiles=4)
        w2._direct.write(1, tiles[0])
    with pytest.raises(ValueError, match="shard_tiles=-1"):
        StoreWriter(tmp_path / "y.zarr", tile_size=T, capacity=4, attrs={}, shard_tiles=-1)


def test_damaged_shard_index_is_a_clear_error(tmp_path: Path) -> None:
    tiles = _tiles(6, seed=10)
    path = tmp_path / "s.zarr"
    _write(path, tiles, [6], shard_tiles=4).commit()
    shard = path / "tiles" / "c.0.0.0.0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # a flipped bit in the index
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"c\.0\.0\.0\.0.*checksum"):
        open_store(path).read([1])
    opened = open_store(path)
    shard.write_bytes(bytes(raw[:20]))  # truncated below the index size
    with pytest.raises(ValueError, match=r"c\.0\.0\.0\.0 has 20 bytes, expected"):  # found on open
        open_store(path)
    with pytest.raises(ValueError, match=r"c\.0\.0\.0\.0 has 20 bytes, fewer than its index"):  # and on read
        opened.read([1])
    np.testing.assert_array_equal(opened.read([5, 4]), tiles[[5, 4]])  # the other shard is fine


def test_open_store_sees_a_rebuilt_store(tmp_path: Path) -> None:
    """A kept shard index is dropped when the shard file is replaced (a rebuild under an open TileStore)."""
    path = tmp_path / "s.zarr"
    first, second = _tiles(6, seed=11), _tiles(6, seed=12)
    _write(path, first, [6], shard_tiles=8).commit()
    store = TileStore(path)
    np.testing.assert_array_equal(store.read([2]), first[[2]])
    _write(path, second, [6], shard_tiles=8).commit()
    np.testing.assert_array_equal(store.read([2, 0]), second[[2, 0]])


def test_tile_cli_writes_sharded_stores_by_default_and_per_tile_on_request(tmp_path: Path, capsys) -> None:
    make_slide(tmp_path / "slides" / "a.svs", size=512, seed=41, tissue_fraction=0.6)
    base = ["tile", "--method", "greyscale", "--qc", "off", "--slides", str(tmp_path / "slides"), "--tile-size", "32", "--no-progress", "--no-qc-images", "--workers", "0"]
    assert main(base + ["--out", str(tmp_path / "sharded"), "--shard-tiles", "16"]) == 0
    assert main(base + ["--out", str(tmp_path / "default")]) == 0
    assert main(base + ["--out", str(tmp_path / "per_tile"), "--shard-tiles", "0"]) == 0
    sh, de, pt = (open_store(tmp_path / d / "a.zarr") for d in ("sharded", "default", "per_tile"))
    assert (sh.shard_tiles, de.shard_tiles, pt.shard_tiles) == (16, DEFAULT_SHARD_TILES, 0)
    n = len(pt)
    assert n > 40
    for st in (sh, de):
        np.testing.assert_array_equal(st.coords, pt.coords)
        np.testing.assert_array_equal(st.read(), pt.read())
    files = {d: sum(1 for p in (tmp_path / d / "a.zarr" / "tiles").iterdir() if p.name.startswith("c."))
             for d in ("sharded", "default", "per_tile")}
    assert files == {"sharded": -(-n // 16), "default": 1, "per_tile": n}
    assert main(base + ["--out", str(tmp_path / "bad"), "--shard-tiles", "-2"]) == 2
    assert "shard_tiles=-2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tile", "--help"])
    assert f"(default: {DEFAULT_SHARD_TILES})" in capsys.readouterr().out
