"""Near-copies among image tiles: a perceptual hash invariant to the 8 rotations by 90 degrees and flips, and groups.

Tile sets grown by augmentation (LC25000: each class of 5,000 tiles from 250 originals by
rotations and flips) hold many near-copies of each tile; a split that puts two of them on
different sides measures memory, not learning. Each tile gets a 64-bit DCT hash (the signs, against
their median, of the 8 x 8 lowest frequencies but the constant one, of the grey image averaged
down to 32 x 32 px) of each of its 8 dihedral transforms (:func:`dihedral_hashes`); two tiles are
near-copies when some transform of one lies within ``max_distance`` bits (Hamming) of the other
(:func:`min_hamming`), and :func:`group_near_copies` joins near-copies into groups by union-find
(transitively: a chain of near-copies is one group).

The 32 x 32 grey image is computed with exact integer sums per channel, so the grey image of a
rotated or flipped tile is exactly the rotated or flipped grey image, and a tile's set of 8 hashes
(hence :func:`invariant_hash`, their minimum) is exactly the same for all 8 of its transforms.
"""

from __future__ import annotations

import logging
import numpy as np

__all__ = ["HASH_GRID", "dihedral", "dihedral_hashes", "group_near_copies", "invariant_hash", "min_hamming"]

log = logging.getLogger(__name__)

#: Side (px) of the grey image the DCT is taken of.
HASH_GRID = 32
#: Side of the block of lowest DCT frequencies whose signs make the hash (8 x 8 = 64 bits).
_LOW = 8


def dihedral(img: np.ndarray, k: int) -> np.ndarray:
    """Transform ``k`` (0..7) of the dihedral group of the square: ``k % 4`` quarter turns, then a left-right flip when ``k >= 4``."""
    out = np.rot90(img, k % 4)
    return np.ascontiguousarray(out[:, ::-1] if k >= 4 else out)


def _grey_grid(tile: np.ndarray) -> np.ndarray:
    """Float64 (32, 32) grey image: box means of each channel (exact integer sums), then 0.299 R + 0.587 G + 0.114 B."""
    a = np.asarray(tile)
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[0] != a.shape[1] or a.shape[0] % HASH_GRID:
        raise ValueError(f"tile of shape {a.shape}: expected a square (H, W[, C]) image whose side is a multiple of {HASH_GRID} px")
    b = a.shape[0] // HASH_GRID
    sums = a.astype(np.int64).reshape(HASH_GRID, b, HASH_GRID, b, a.shape[2]).sum(axis=(1, 3))
    if a.shape[2] >= 3:
        return (0.299 * sums[..., 0] + 0.587 * sums[..., 1] + 0.114 * sums[..., 2]) / (b * b)
    return sums[..., 0] / (b * b)


def _dct_matrix(n: int) -> np.ndarray:
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * x + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


_DCT = _dct_matrix(HASH_GRID)
_WEIGHTS = (1 << np.arange(_LOW * _LOW - 1, -1, -1, dtype=np.uint64)).astype(np.uint64)


def _dct_hash(grey: np.ndarray) -> int:
    low = (_DCT @ grey @ _DCT.T)[:_LOW, :_LOW].reshape(-1)
    ac = low[1:]  # the constant (DC) term says only how bright the tile is
    bits = (low > np.median(ac)).astype(np.uint64)
    bits[0] = 0
    return int((bits * _WEIGHTS).sum())


def dihedral_hashes(tile: np.ndarray) -> np.ndarray:
    """The 64-bit DCT hashes (uint64 (8,)) of the 8 rotations and flips of ``tile``, in :func:`dihedral` order.

    ``tile``: a square uint8 RGB (or grey) image whose side is a multiple of 32 px (224 px tiles:
    7 x 7 px blocks). The set of the 8 values is the same for every rotation or flip of the tile.
    """
    grey = _grey_grid(tile)
    return np.array([_dct_hash(dihedral(grey, k)) for k in range(8)], dtype=np.uint64)


def invariant_hash(tile: np.ndarray) -> int:
    """The minimum of :func:`dihedral_hashes`: one 64-bit key shared by a tile and its 8 rotations and flips."""
    return int(dihedral_hashes(tile).min())


def min_hamming(hashes_a: np.ndarray, hashes_b: np.ndarray) -> np.ndarray:
    """Hamming distance (bits) between each tile of ``a`` and each of ``b``, minimum over the 8 transforms of ``b``.

    ``hashes_a``: uint64 (n, 8) or (n,) (the identity transform's hash is used); ``hashes_b``:
    uint64 (m, 8). Returns int (n, m).
    """
    a = np.asarray(hashes_a, np.uint64)
    a = a[:, 0] if a.ndim == 2 else a
    b = np.asarray(hashes_b, np.uint64)
    return np.bitwise_count(a[:, None, None] ^ b[None, :, :]).min(axis=2).astype(np.int64)


def group_near_copies(hashes: np.ndarray, max_distance: int, *, chunk: int = 256) -> np.ndarray:
    """Group ids (int (n,), 0..g-1 in order of first appearance) joining tiles within ``max_distance`` bits.

    ``hashes``: uint64 (n, 8) from :func:`dihedral_hashes`. Two tiles are joined when
    :func:`min_hamming` is at most ``max_distance``; groups are the connected components
    (union-find), so near-copies of near-copies share a group.
    """
    h = np.asarray(hashes, np.uint64)
    if h.ndim != 2 or h.shape[1] != 8:
        raise ValueError(f"hashes of shape {h.shape}: expected (n, 8) from dihedral_hashes")
    if max_distance < 0:
        raise ValueError(f"max_distance={max_distance}: expected >= 0 bits")
    n = len(h)
    parent = np.arange(n)

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    for start in range(0, n, chunk):
        d = min_hamming(h[start : start + chunk], h)
        for i, j in zip(*np.nonzero(d <= max_distance)):
            a, b = find(start + int(i)), find(int(j))
            if a != b:
                parent[max(a, b)] = min(a, b)
    roots = [find(i) for i in range(n)]
    ids: dict[int, int] = {}
    return np.array([ids.setdefault(r, len(ids)) for r in roots], dtype=np.int64)

