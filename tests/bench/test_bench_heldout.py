"""bench-heldout's image set: every image is its cells' source tiles exactly, no near-copy group
joins two images, the labels and tumour counts are as specified; the attention truth of a tile is
the mosaic cell under its centre."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from benchmarks.heldout import CELL, build_cohort, cell_truth, claim_folder


def _source(root: Path, rng: np.random.Generator) -> None:
    """Tiles of three classes, each distinct tile written with two near-copies (a quarter turn and a flip)."""
    for cls, n, base in (("lung_n", 40, (230, 180, 200)), ("lung_aca", 20, (120, 60, 160)), ("lung_scc", 8, (90, 40, 120))):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            # a distinct low-frequency pattern per tile (the near-copy hash reads 32 x 32 grey)
            blocks = rng.integers(0, 2, (8, 8)).repeat(CELL // 8, 0).repeat(CELL // 8, 1)
            img = (np.asarray(base, np.float64)[None, None, :] * (0.55 + 0.45 * blocks[..., None])).astype(np.uint8)
            for k, variant in enumerate((img, np.rot90(img), img[:, ::-1])):
                Image.fromarray(np.ascontiguousarray(variant)).save(root / cls / f"{cls}_{i:03d}_{k}.png")
    # a near-copy across classes: a turned benign tile filed as adenocarcinoma (its group joins both kinds)
    Image.fromarray(np.rot90(np.asarray(Image.open(root / "lung_n" / "lung_n_000_0.png")), 2).copy()).save(
        root / "lung_aca" / "lung_aca_mixed.png")


@pytest.mark.slow
def test_image_set_is_its_source_tiles_without_shared_groups(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    src = tmp_path / "src"
    _source(src, rng)
    out = tmp_path / "cohort"
    labels_csv = build_cohort(src, out, n_negative=4, n_positive=3, seed=3)
    labels = pd.read_csv(labels_csv)
    cells = pd.read_csv(out / "cells.csv")
    assert sorted(labels["label"].tolist()) == [0] * 4 + [1] * 3
    assert (labels["mpp"] == 0.5).all()
    # each distinct source tile and its near-copies (same stem before the variant) appear in one image only
    stem = cells["file"].str.replace(r"_\d\.png$", "", regex=True)
    assert stem.groupby(stem).apply(lambda s: cells.loc[s.index, "slide_id"].nunique()).max() == 1
    assert cells.groupby("group")["slide_id"].nunique().max() == 1
    assert not cells["file"].str.contains("lung_n_000_|lung_aca_mixed").any()  # the group of both kinds is left out
    n_t = cells.groupby("slide_id")["tumour"].sum()
    for sid, label in zip(labels["slide_id"], labels["label"]):
        assert (3 <= n_t[sid] <= 6) if label else n_t[sid] == 0
        img = np.asarray(Image.open(out / "images" / f"{sid}.png"))
        assert img.shape == (3 * CELL, 4 * CELL, 3)
        for c in cells[cells["slide_id"] == sid].itertuples():
            tile = np.asarray(Image.open(src / c.file).convert("RGB"))
            np.testing.assert_array_equal(img[c.row * CELL:(c.row + 1) * CELL, c.col * CELL:(c.col + 1) * CELL], tile)
            assert c.tumour == int(not c.file.startswith("lung_n/"))
    # a complete set is kept as it is; asking the folder for another draw is an error naming the seed
    stamp = (out / "labels.csv").stat().st_mtime_ns
    build_cohort(src, out, n_negative=4, n_positive=3, seed=3)
    with pytest.raises(ValueError, match=r"seed: 3 \(found\) vs 99 \(asked\)"):
        build_cohort(src, out, n_negative=4, n_positive=3, seed=99)
    assert (out / "labels.csv").stat().st_mtime_ns == stamp


def test_cell_truth_reads_the_cell_under_the_tile_centre() -> None:
    cells = pd.DataFrame({"slide_id": ["a", "a", "b"], "row": [0, 1, 0], "col": [1, 0, 0], "tumour": [1, 1, 0]})
    truth = cell_truth(cells, 32)
    coords = np.array([[CELL, 0], [CELL - 16, 0], [CELL - 17, 0], [0, CELL + 5], [0, 0]])
    # centre at x = CELL + 16 (cell 1), x = CELL (cell 1), x = CELL - 1 (cell 0), y in row 1 (cell (1, 0)), cell (0, 0)
    assert truth("a", coords).tolist() == [True, True, False, True, False]
    assert not truth("b", coords).any()


def test_a_recipe_folder_serves_one_image_set(tmp_path: Path) -> None:
    """Runs of one draw are never resumed on another draw's images (both name their slides lung01...)."""
    draws = {}
    for seed in (0, 1):
        draws[seed] = tmp_path / f"cohort{seed}"
        draws[seed].mkdir()
        (draws[seed] / "cohort.json").write_text(json.dumps({"contrast": "aca-scc", "seed": seed}))
    folder = tmp_path / "current"
    claim_folder(folder, draws[0])
    claim_folder(folder, draws[0])  # the same set again: resumes
    (folder / "runs").mkdir()
    with pytest.raises(ValueError, match=r"seed: 0 \(its runs\) vs 1 \(.*cohort1\); give this set another --tag"):
        claim_folder(folder, draws[1])
    assert json.loads((folder / "cohort.json").read_text())["seed"] == 0 and (folder / "runs").is_dir()
