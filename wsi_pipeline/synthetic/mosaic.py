"""A mosaic cohort of real tissue: slides tiled from real image tiles, with planted clusters of tumour tiles.

From a folder of labelled tiles (LC25000 lung: ``lung_n/`` benign, ``lung_aca/`` adenocarcinoma,
224 px JPEG tiles) each slide is a ``grid`` x ``grid`` mosaic of tiles written as a pyramidal,
tiled TIFF in the Aperio SVS layout (:func:`~wsi_pipeline.synthetic.slides.write_image_slide`;
level 0 lossless, so a reader returns the placed tiles exactly; the mpp in the SVS description
and in the TIFF resolution tags). A negative slide is benign tiles only; a positive slide has
between 1 % and 10 % of its tiles (at least one) from the tumour class, laid in one or two
clusters of 4-connected tiles grown at random. The lesion mask has one pixel per tile
(``mask_downsample`` = the tile side), the layout :mod:`wsi_pipeline.evaluation.localisation` reads.

Near-copies (the source grew each class from a few hundred originals by rotations and flips)
are grouped first (:mod:`wsi_pipeline.synthetic.near_copies`), and every group goes to one
split: slides of different splits never share a tile or a near-copy of it. Slides of one split
draw from that split's tiles (without replacement within a slide, with replacement across
slides of the split).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.manifests.schema import write_manifest
from wsi_pipeline.manifests.splits import grouped_split, normalise_fractions, stratified_split
from wsi_pipeline.synthetic.near_copies import dihedral_hashes, group_near_copies
from wsi_pipeline.synthetic.slides import write_image_slide
from wsi_pipeline.synthetic.truth import write_mask

__all__ = ["LungMosaicCohort", "TILE_EXTENSIONS", "index_tiles", "lesion_layout", "make_mosaic_cohort", "mosaic_image"]

log = logging.getLogger(__name__)

#: Image files read as tiles.
TILE_EXTENSIONS: tuple[str, ...] = (".jpeg", ".jpg", ".png", ".tif", ".tiff", ".bmp")


@dataclass(frozen=True)
class LungMosaicCohort:
    """Settings of the lung mosaic cohort (``wsi-pipeline demo --cohort lung-mosaic --source DIR``).

    Attributes
    ----------
    source : folder with one subfolder of tiles per class.
    n_slides : slides, half positive (split train/val/test by ``splits``, stratified by label).
    grid : tiles per slide side (a slide is ``grid * tile`` px square).
    negative_class, positive_class : subfolders of benign and tumour tiles.
    lesion_fraction : (min, max) share of a positive slide's tiles from the tumour class; the count
        is drawn uniformly among the integers in ``[ceil(min * n), floor(max * n)]`` (at least 1).
    max_distance : Hamming distance (bits of 64) at or under which two tiles are near-copies.
    mpp : um per slide px written to the slides. Nominal: LC25000 states no resolution.
    splits : split name -> fraction of slides (and of near-copy groups of tiles).
    seed : everything random derives from it.
    """

    source: str = ""
    n_slides: int = 48
    grid: int = 8
    negative_class: str = "lung_n"
    positive_class: str = "lung_aca"
    lesion_fraction: tuple[float, float] = (0.01, 0.10)
    max_distance: int = 12
    mpp: float = 0.5
    splits: Mapping[str, float] = field(default_factory=lambda: {"train": 0.5, "val": 0.25, "test": 0.25})
    seed: int = 0


def _read_tile(path: str | os.PathLike) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def index_tiles(source: str | os.PathLike, classes: tuple[str, ...], max_distance: int, *, progress: bool = True) -> pd.DataFrame:
    """Every tile of ``classes`` under ``source`` with its near-copy group.

    Returns a DataFrame with columns ``file`` (path relative to ``source``), ``class``, ``hash``
    (the rotation- and flip-invariant 64-bit hash as 16 hex digits) and ``group`` (int, shared by
    near-copies across all the classes; :func:`~wsi_pipeline.synthetic.near_copies.group_near_copies`).
    Raises ``FileNotFoundError``/``ValueError`` naming the folder when a class has no tiles or
    tiles differ in size.
    """
    from wsi_pipeline.progress import progress_bar

    root = Path(source)
    files: list[tuple[str, str]] = []
    for c in classes:
        folder = root / c
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such folder; --source must hold one subfolder of tiles per class ({', '.join(classes)})")
        found = sorted(p for p in folder.iterdir() if p.suffix.lower() in TILE_EXTENSIONS)
        if not found:
            raise ValueError(f"{folder}: no image tiles ({', '.join(TILE_EXTENSIONS)})")
        files += [(str(p.relative_to(root)), c) for p in found]
    hashes = np.zeros((len(files), 8), np.uint64)
    shape = None
    for i, (f, _) in enumerate(progress_bar(files, desc="hash tiles", unit="tile", enabled=progress)):
        tile = _read_tile(root / f)
        if shape is None:
            shape = tile.shape
        elif tile.shape != shape:
            raise ValueError(f"{root / f}: tile of shape {tile.shape}, expected {shape} like {root / files[0][0]}")
        hashes[i] = dihedral_hashes(tile)
    groups = group_near_copies(hashes, max_distance)
    return pd.DataFrame({"file": [f for f, _ in files], "class": [c for _, c in files],
                         "hash": [f"{int(h):016x}" for h in hashes.min(axis=1)], "group": groups})


def lesion_layout(rng: np.random.Generator, grid: int, n_lesion: int) -> np.ndarray:
    """Bool (grid, grid): ``n_lesion`` tiles in one cluster (two when ``n_lesion >= 6``, at random) of 4-connected tiles.

    Each cluster starts at a random free tile and grows by a random free 4-neighbour of its
    tiles until it has its size.
    """
    if not 0 <= n_lesion <= grid * grid:
        raise ValueError(f"n_lesion={n_lesion}: expected 0..{grid * grid}")
    out = np.zeros((grid, grid), bool)
    n_clusters = int(rng.integers(1, 3)) if n_lesion >= 6 else 1
    sizes = [n_lesion // n_clusters + (1 if k < n_lesion % n_clusters else 0) for k in range(n_clusters)]
    for size in sizes:
        if size == 0:
            continue
        free = np.argwhere(~out)
        start = tuple(free[rng.integers(len(free))])
        cluster = {start}
        out[start] = True
        while len(cluster) < size:
            frontier = sorted({(y + dy, x + dx) for y, x in cluster for dy, dx in ((0, 1), (1, 0), (0, -1), (-1, 0))
                               if 0 <= y + dy < grid and 0 <= x + dx < grid and not out[y + dy, x + dx]})
            if not frontier:  # boxed in by the other cluster: restart from a free tile
                free = np.argwhere(~out)
                frontier = [tuple(free[rng.integers(len(free))])]
            cell = frontier[int(rng.integers(len(frontier)))]
            cluster.add(cell)
            out[cell] = True
    return out


def mosaic_image(tiles: list[np.ndarray], grid: int) -> np.ndarray:
    """uint8 (grid * t, grid * t, 3): ``tiles`` (row-major, each t x t x 3) laid on the grid."""
    t = tiles[0].shape[0]
    arr = np.stack(tiles).reshape(grid, grid, t, t, 3)
    return np.ascontiguousarray(arr.transpose(0, 2, 1, 3, 4).reshape(grid * t, grid * t, 3))


def _lesion_count(rng: np.random.Generator, n_tiles: int, fraction: tuple[float, float]) -> int:
    lo = max(1, math.ceil(fraction[0] * n_tiles - 1e-9))
    hi = max(lo, math.floor(fraction[1] * n_tiles + 1e-9))
    return int(rng.integers(lo, hi + 1))


def make_mosaic_cohort(out_dir: str | os.PathLike, cohort: LungMosaicCohort, *, progress: bool = True) -> Path:
    """Write the mosaic cohort under ``out_dir``; return its manifest.

    Writes ``slides/<slide_id>.svs``, ``masks/<slide_id>.png`` (one px per tile, 255 = tumour
    tile), ``tiles.csv`` (every placed tile: slide_id, row, col, file, class, group), ``groups.csv``
    (every source tile with its hash and group), ``labels.csv`` (slide_id, label, split,
    lesion_mask, mask_downsample: for ``manifest folder``) and, last, ``manifest.csv`` (slide_id,
    path, label, split, cohort, patient_id, lesion_mask, mask_downsample, lesion_fraction,
    n_lesion_tiles, n_lesions; paths relative to the manifest).
    """
    from wsi_pipeline.progress import progress_bar

    if cohort.n_slides < 2:
        raise ValueError(f"n_slides={cohort.n_slides}: expected at least 2 (one of each label)")
    if cohort.grid < 1:
        raise ValueError(f"grid={cohort.grid}: expected at least 1 tile per side")
    lo, hi = cohort.lesion_fraction
    if not 0 <= lo <= hi <= 1:
        raise ValueError(f"lesion_fraction={cohort.lesion_fraction}: expected 0 <= min <= max <= 1")
    fractions = normalise_fractions(cohort.splits, what="splits")
    out = Path(out_dir)
    for sub in ("slides", "masks"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    source = Path(cohort.source)
    tiles = index_tiles(source, (cohort.negative_class, cohort.positive_class), cohort.max_distance, progress=progress)
    sizes = np.bincount(tiles["group"])
    log.info("%d tiles in %d near-copy groups (largest %d tiles)", len(tiles), len(sizes), sizes.max())
    # whole groups to splits, stratified by class, so each split gets its share of both classes' tiles
    group_key = tiles["group"].astype(str)
    strata = dict(zip(group_key, tiles["class"]))
    tiles["split"] = grouped_split(tiles["file"].tolist(), group_key.tolist(), fractions, seed=cohort.seed, group_strata=strata)
    write_text_atomic(out / "groups.csv", tiles.to_csv(index=False))

    rng = np.random.default_rng(cohort.seed)
    n = cohort.n_slides
    labels = rng.permutation(np.arange(n) % 2)
    ids = [f"lung_{i:03d}" for i in range(n)]
    split_of = stratified_split(ids, labels.tolist(), fractions, seed=int(rng.integers(2**31)))
    n_tiles = cohort.grid * cohort.grid
    rows, placed = [], []
    for i, slide_id in enumerate(progress_bar(ids, desc="mosaic slides", unit="slide", enabled=progress)):
        srng = np.random.default_rng([cohort.seed, i])
        pool = tiles[tiles["split"] == split_of[i]]
        neg = pool.index[pool["class"] == cohort.negative_class].to_numpy()
        pos = pool.index[pool["class"] == cohort.positive_class].to_numpy()
        n_les = _lesion_count(srng, n_tiles, cohort.lesion_fraction) if labels[i] == 1 else 0
        lesion = lesion_layout(srng, cohort.grid, n_les)
        if len(neg) < n_tiles - n_les or len(pos) < n_les:
            raise ValueError(f"split {split_of[i]!r} holds {len(neg)} {cohort.negative_class} and {len(pos)} "
                             f"{cohort.positive_class} tiles; slide {slide_id} needs {n_tiles - n_les} and {n_les}: "
                             f"use a smaller --grid or fewer splits")
        chosen = np.empty(n_tiles, np.int64)
        flat = lesion.reshape(-1)
        chosen[~flat] = srng.choice(neg, n_tiles - n_les, replace=False)
        chosen[flat] = srng.choice(pos, n_les, replace=False)
        image = mosaic_image([_read_tile(source / tiles.at[j, "file"]) for j in chosen], cohort.grid)
        t = image.shape[0] // cohort.grid
        write_image_slide(out / "slides" / f"{slide_id}.svs", image, tile_size=t, mpp=cohort.mpp, lossless=True)
        write_mask(out / "masks" / f"{slide_id}.png", lesion)
        from scipy import ndimage

        n_clusters = int(ndimage.label(lesion)[1]) if n_les else 0
        rows.append({"slide_id": slide_id, "path": f"slides/{slide_id}.svs", "label": int(labels[i]), "split": split_of[i],
                     "cohort": "internal", "patient_id": slide_id, "lesion_mask": f"masks/{slide_id}.png",
                     "mask_downsample": t, "lesion_fraction": round(n_les / n_tiles, 5), "n_lesion_tiles": n_les,
                     "n_lesions": n_clusters})
        for k, j in enumerate(chosen):
            placed.append({"slide_id": slide_id, "row": k // cohort.grid, "col": k % cohort.grid, "file": tiles.at[j, "file"],
                           "class": tiles.at[j, "class"], "group": int(tiles.at[j, "group"])})
    write_text_atomic(out / "tiles.csv", pd.DataFrame(placed).to_csv(index=False))
    manifest = pd.DataFrame(rows)
    labels_csv = manifest[["slide_id", "label", "split", "lesion_mask", "mask_downsample"]].copy()
    labels_csv["lesion_mask"] = [str((out / p).resolve()) for p in labels_csv["lesion_mask"]]
    write_text_atomic(out / "labels.csv", labels_csv.to_csv(index=False))
    spec = asdict(cohort)
    spec["n_groups"] = int(len(sizes))
    write_text_atomic(out / "mosaic_cohort.json", json.dumps(spec, indent=1, default=list))
    return write_manifest(manifest, out / "manifest.csv")  # last: marks the cohort done
