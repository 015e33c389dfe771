"""A tile-level synthetic cohort: tile stores and a manifest written directly, without slides.

For fast tests and benchmarks of the training and evaluation stages (the slide generator in
:mod:`wsi_pipeline.synthetic` exercises the tiling stage). Each slide is a blob of tissue tiles on
a grid; positive slides (label 1) contain a lesion region covering a few tiles. Ground truth is a
lesion mask PNG per slide (one mask px per tile), named by the manifest columns ``lesion_mask``
and ``mask_downsample`` as for synthetic slides (:mod:`wsi_pipeline.synthetic.truth`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.manifests.schema import write_manifest
from wsi_pipeline.manifests.splits import normalise_fractions, stratified_split
from wsi_pipeline.synthetic.texture import paint_tissue
from wsi_pipeline.synthetic.truth import write_mask
from wsi_pipeline.data.store import StoreWriter, store_path

__all__ = ["make_store_cohort"]


def _blob(rng: np.random.Generator, n_tiles: int) -> np.ndarray:
    """(col, row) grid cells of a connected-ish tissue blob of about ``n_tiles`` cells."""
    side = int(np.ceil(np.sqrt(n_tiles * 1.6))) + 2
    cy, cx = (side - 1) / 2, (side - 1) / 2
    rows, cols = np.mgrid[0:side, 0:side]
    d = ((rows - cy) / (side / 2)) ** 2 + ((cols - cx) / (side / 2)) ** 2 + rng.uniform(0, 0.3, (side, side))
    order = np.argsort(d.ravel(), kind="stable")[:n_tiles]
    return np.stack([cols.ravel()[order], rows.ravel()[order]], axis=1).astype(np.int32)


def make_store_cohort(
    out_dir: str | os.PathLike,
    *,
    n_slides: int = 12,
    tile_size: int = 32,
    tiles_per_slide: tuple[int, int] = (16, 32),
    lesion_tiles: tuple[int, int] = (3, 6),
    splits: dict[str, float] | None = None,
    cohort: str = "synthetic",
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0),
    seed: int = 0,
) -> Path:
    """Write ``n_slides`` tile stores under ``out_dir/tiles`` and return the manifest path.

    Labels alternate 0/1 (balanced). Splits follow ``splits`` fractions (default train 0.5 / val
    0.25 / test 0.25), stratified by label and seeded
    (:func:`wsi_pipeline.manifests.splits.stratified_split`). Each store's ``coords`` are
    ``grid * tile_size`` (level-0 px, downsample 1); masks go to ``out_dir/masks``.
    The manifest's ``path`` points at a (non-existent) slide file name; stages that read tiles
    use the store, found by ``slide_id`` in ``out_dir/tiles``.
    """
    out = Path(out_dir)
    tiles_dir = out / "tiles"
    tiles_dir.mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = splits or {"train": 0.5, "val": 0.25, "test": 0.25}
    labels = np.arange(n_slides) % 2
    ids = [f"{cohort}_{i:03d}" for i in range(n_slides)]
    split_of = stratified_split(ids, labels, normalise_fractions(splits, what="splits"), seed=seed)
    rows = []
    T = tile_size
    for i in range(n_slides):
        slide_id = ids[i]
        n = int(rng.integers(tiles_per_slide[0], tiles_per_slide[1] + 1))
        grid = _blob(rng, n)
        lesion = np.zeros(n, np.uint8)
        if labels[i] == 1:
            k = int(rng.integers(lesion_tiles[0], lesion_tiles[1] + 1))
            # a spatially coherent lesion: the k cells nearest a random tissue cell
            centre = grid[rng.integers(n)]
            d = np.abs(grid - centre).sum(1) + rng.uniform(0, 0.5, n)
            lesion[np.argsort(d)[:k]] = 1
        tiles = np.stack(
            [paint_tissue(rng, T, T, lesion=np.full((T, T), bool(hit)), tint=tint, scale=T / 64 if T < 64 else 1.0) for hit in lesion]
        )
        attrs = {
            "slide_id": slide_id, "slide_path": f"{slide_id}.tiff", "slide_fingerprint": f"synthetic-{seed}-{i}",
            "mpp": 0.5, "read_level": 0, "downsample": 1.0, "tile_size": T, "method": "synthetic",
        }
        w = StoreWriter(store_path(tiles_dir, slide_id), tile_size=T, capacity=n, attrs=attrs)
        w.append(tiles, grid.astype(np.int64) * T, grid, np.ones(n, np.float32))
        w.commit()
        mask = np.zeros((grid[:, 1].max() + 1, grid[:, 0].max() + 1), bool)
        mask[grid[:, 1], grid[:, 0]] = lesion.astype(bool)
        write_mask(out / "masks" / f"{slide_id}.png", mask)
        rows.append({"slide_id": slide_id, "path": f"slides/{slide_id}.tiff", "label": int(labels[i]),
                     "split": split_of[i], "cohort": cohort, "lesion_mask": f"masks/{slide_id}.png",
                     "mask_downsample": float(T)})
    return write_manifest(pd.DataFrame(rows), out / "manifest.csv")
