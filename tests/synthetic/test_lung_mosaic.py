"""The lung mosaic cohort: a rotation/flip-invariant tile hash, near-copy groups kept within one split,
slides whose pixels are the placed tiles, planted tumour tiles 1-10 % and clustered, the demo command."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from scipy import ndimage

from wsi_pipeline.synthetic.near_copies import dihedral, dihedral_hashes, group_near_copies, invariant_hash, min_hamming

REPO = Path(__file__).resolve().parents[2]
LUNG = REPO.parent / "shared" / "realdata" / "lc25000-lung"
needs_lung = pytest.mark.skipif(not LUNG.is_dir(), reason=f"{LUNG} absent (real LC25000 lung tiles)")


def _field(rng: np.random.Generator, side: int) -> np.ndarray:
    """A smooth random RGB tile (uint8 side x side): coarse noise upsampled, so its low frequencies differ by seed."""
    import cv2

    coarse = rng.uniform(40, 230, (12, 12, 3)).astype(np.float32)
    img = cv2.resize(coarse, (side, side), interpolation=cv2.INTER_CUBIC)
    return np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)


def _noisy(rng: np.random.Generator, tile: np.ndarray, sd: float = 2.0) -> np.ndarray:
    return np.clip(tile.astype(np.float64) + rng.normal(0, sd, tile.shape), 0, 255).astype(np.uint8)


def _source(folder: Path, *, side: int, originals: int, copies: int, seed: int = 0) -> dict[str, list[int]]:
    """Write lung_n/ and lung_aca/ tiles: per class ``originals`` smooth fields, each as ``copies`` noisy
    rotated/flipped versions (a random dihedral transform each). Returns file stem -> original index per class."""
    rng = np.random.default_rng(seed)
    origin: dict[str, list[int]] = {}
    for c in ("lung_n", "lung_aca"):
        (folder / c).mkdir(parents=True)
        origin[c] = []
        for o in range(originals):
            base = _field(rng, side)
            for _ in range(copies):
                tile = _noisy(rng, dihedral(base, int(rng.integers(8))))
                Image.fromarray(tile).save(folder / c / f"{c}{len(origin[c])}.png")
                origin[c].append(o)
    return origin


def test_hash_is_invariant_to_the_8_rotations_and_flips_of_generated_tiles():
    rng = np.random.default_rng(1)
    for side in (32, 224):
        tile = _field(rng, side)
        ref = dihedral_hashes(tile)
        for k in range(8):
            t = dihedral(tile, k)
            assert sorted(dihedral_hashes(t).tolist()) == sorted(ref.tolist())
            assert invariant_hash(t) == int(ref.min())
        # the transforms really differ (an asymmetric tile), and another tile hashes far away
        assert len({dihedral(tile, k).tobytes() for k in range(8)}) == 8
        assert min_hamming(dihedral_hashes(_field(rng, side))[None], ref[None])[0, 0] > 8


@needs_lung
def test_hash_is_invariant_on_real_lung_tiles():
    for c in ("lung_n", "lung_aca", "lung_scc"):
        for f in sorted((LUNG / c).iterdir())[:4]:
            tile = np.asarray(Image.open(f).convert("RGB"))
            ref = sorted(dihedral_hashes(tile).tolist())
            for k in range(8):
                assert sorted(dihedral_hashes(dihedral(tile, k)).tolist()) == ref, (f, k)


def test_min_hamming_against_a_direct_count():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 2**63, (5, 8), dtype=np.uint64)
    b = rng.integers(0, 2**63, (4, 8), dtype=np.uint64)
    want = np.array([[min(bin(int(a[i, 0]) ^ int(b[j, k])).count("1") for k in range(8)) for j in range(4)] for i in range(5)])
    np.testing.assert_array_equal(min_hamming(a, b), want)


def test_grouping_puts_rotated_and_flipped_copies_together():
    rng = np.random.default_rng(3)
    tiles, origin = [], []
    for o in range(12):
        base = _field(rng, 64)
        for k in rng.permutation(8)[:4]:
            tiles.append(_noisy(rng, dihedral(base, int(k))))
            origin.append(o)
    groups = group_near_copies(np.stack([dihedral_hashes(t) for t in tiles]), max_distance=12)
    # the same partition as the originals: copies share a group, different originals never do
    pairs_same = np.equal.outer(groups, groups)
    np.testing.assert_array_equal(pairs_same, np.equal.outer(origin, origin))


def _cohort(tmp_path: Path, *, n_slides: int = 8, grid: int = 6, side: int = 32):
    from wsi_pipeline.synthetic.mosaic import LungMosaicCohort, make_mosaic_cohort

    src = tmp_path / "src"
    origin = _source(src, side=side, originals=48, copies=4)
    cohort = LungMosaicCohort(source=str(src), n_slides=n_slides, grid=grid, seed=0)
    manifest = make_mosaic_cohort(tmp_path / "cohort", cohort, progress=False)
    return src, origin, cohort, manifest


def test_mosaic_cohort_keeps_every_near_copy_group_in_one_split(tmp_path):
    src, origin, _, manifest = _cohort(tmp_path)
    out = manifest.parent
    groups = pd.read_csv(out / "groups.csv")
    # the hash found the generator's originals exactly
    truth = [f"{c}:{origin[c][int(Path(f).stem[len(c):])]}" for f, c in zip(groups["file"], groups["class"])]
    assert groups["group"].nunique() == 96
    g = groups["group"].to_numpy()
    np.testing.assert_array_equal(np.equal.outer(g, g), np.equal.outer(truth, truth))
    assert (groups.groupby("group")["split"].nunique() == 1).all()
    # slides of different splits never share a group
    placed = pd.read_csv(out / "tiles.csv").merge(pd.read_csv(manifest)[["slide_id", "split"]], on="slide_id")
    assert (placed.groupby("group")["split"].nunique() == 1).all()
    assert set(placed["split"]) == {"train", "val", "test"}
    # each placed tile's group and split agree with the source tile's
    src_split = dict(zip(groups["file"], groups["split"]))
    assert (placed["file"].map(src_split) == placed["split"]).all()


def test_mosaic_slides_read_back_as_the_placed_tiles(tmp_path):
    from wsi_pipeline.slides.opener import open_slide
    from wsi_pipeline.synthetic.truth import read_mask

    src, _, cohort, manifest = _cohort(tmp_path)
    out = manifest.parent
    m = pd.read_csv(manifest)
    placed = pd.read_csv(out / "tiles.csv").rename(columns={"class": "cls"})
    for row in m.itertuples():
        slide = open_slide(out / row.path)
        side = 32 * cohort.grid
        assert slide.dimensions == (side, side) and slide.mpp == pytest.approx(cohort.mpp)
        got = np.asarray(slide.read_region((0, 0), 0, (side, side)))[..., :3]
        mask = read_mask(out / row.lesion_mask)
        assert mask.shape == (cohort.grid, cohort.grid) and row.mask_downsample == 32
        for t in placed[placed["slide_id"] == row.slide_id].itertuples():
            want = np.asarray(Image.open(src / t.file).convert("RGB"))
            np.testing.assert_array_equal(got[t.row * 32 : (t.row + 1) * 32, t.col * 32 : (t.col + 1) * 32], want)
            assert mask[t.row, t.col] == (t.cls == cohort.positive_class)
        slide.close()


def test_positive_slides_hold_1_to_10_percent_tumour_tiles_in_clusters(tmp_path):
    from wsi_pipeline.synthetic.mosaic import lesion_layout
    from wsi_pipeline.synthetic.truth import read_mask

    _, _, cohort, manifest = _cohort(tmp_path, n_slides=10, grid=6)
    out = manifest.parent
    m = pd.read_csv(manifest)
    placed = pd.read_csv(out / "tiles.csv")
    n = cohort.grid**2
    for row in m.itertuples():
        mask = read_mask(out / row.lesion_mask)
        tumour = (placed[placed["slide_id"] == row.slide_id]["class"] == cohort.positive_class).sum()
        assert mask.sum() == tumour == row.n_lesion_tiles
        if row.label == 0:
            assert tumour == 0
            continue
        assert math.ceil(0.01 * n) <= tumour <= math.floor(0.10 * n)
        labelled, k = ndimage.label(mask)
        assert 1 <= k <= 2 and row.n_lesions == k
    # the layout on its own, over many draws: exact count, at most two 4-connected clusters, each of >= 2 tiles
    # when the lesion has >= 2 tiles (a cluster of one tile only when a single tile is planted)
    rng = np.random.default_rng(5)
    for _ in range(300):
        k = int(rng.integers(1, 26))
        lay = lesion_layout(rng, 16, k)
        labelled, n_comp = ndimage.label(lay)
        sizes = np.bincount(labelled.ravel())[1:]
        assert lay.sum() == k and 1 <= n_comp <= 2
        assert k == 1 or sizes.min() >= 2 or (k < 6 and n_comp == 1)
        # clustered: the tiles sit far closer together than k tiles scattered at random would
        if k >= 6:
            ys, xs = np.nonzero(lay)
            d = np.hypot(ys[:, None] - ys[None], xs[:, None] - xs[None])
            np.fill_diagonal(d, np.inf)
            assert d.min(axis=1).max() == 1.0  # every tumour tile touches another


@pytest.mark.slow
def test_demo_lung_mosaic_end_to_end_then_the_five_commands(tmp_path, monkeypatch, capsys):
    import json

    from wsi_pipeline.cli.main import main

    src = tmp_path / "src"
    _source(src, side=224, originals=24, copies=3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    quick = ["--set", "train.epochs=1", "--set", "methods.patchgd.train.epochs=1", "--no-progress"]
    args = ["demo", "--cohort", "lung-mosaic", "--source", str(src), "--out", "lm", "--internal", "4", "--grid", "4",
            "--workers", "0", *quick]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time per stage" in out
    records = pd.DataFrame(json.loads((tmp_path / "lm" / "results" / "lung_mosaic" / "metrics.json").read_text())["records"])
    assert set(records["method"]) == {"abmil_frozen", "abmil_e2e", "abmil_bigl", "patchgd"}
    assert "localisation_auc" in set(records["metric"])
    # every store holds one tile per mosaic tile
    report = pd.read_csv(tmp_path / "lm" / "tiles" / "tiling_report.csv")
    assert (report["n_tiles"] == 16).all() and len(report) == 4

    # the README's five commands on the cohort the demo wrote
    cohort = tmp_path / "lm" / "cohort"
    yaml_path = "lm/lung_mosaic.yaml"
    cfg = ["--set", "data.manifest=m.csv", "--set", "data.tiles_dir=t"]
    assert main(["manifest", "folder", "--slides", str(cohort / "slides"), "--labels", str(cohort / "labels.csv"), "--out", "m.csv"]) == 0
    assert "lesion_mask" in pd.read_csv("m.csv").columns
    assert main(["tile", "--manifest", "m.csv", "--out", "t", "--mpp-target", "3.5", "--tile-size", "32",
                 "--min-foreground", "0", "--method", "greyscale", "--qc", "off", "--workers", "0", "--no-progress"]) == 0
    one = ["--method", "abmil_e2e"]  # the demo above trained all four; one keeps this part short
    assert main(["train", "--config", yaml_path, *cfg, *quick, *one, "--set", "runs_dir=r5"]) == 0
    assert main(["eval", "--config", yaml_path, *cfg, *one, "--no-progress", "--set", "runs_dir=r5", "--set", "results_dir=res5"]) == 0
    assert (tmp_path / "res5" / "lung_mosaic" / "report.html").is_file()
    assert main(["predict", "--model", "r5/lung_mosaic/abmil_e2e/seed0", "--slides", str(cohort / "slides"), "--out", "p",
                 "--no-progress"]) == 0
    assert len(pd.read_csv("p/predictions.csv")) == 4


def test_demo_lung_mosaic_refuses_missing_or_foreign_options(tmp_path, capsys):
    from wsi_pipeline.cli.main import main

    assert main(["demo", "--cohort", "lung-mosaic", "--out", str(tmp_path / "o")]) == 2
    assert "--source" in capsys.readouterr().err
    assert main(["demo", "--cohort", "lung-mosaic", "--source", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert "absent" in capsys.readouterr().err
    assert main(["demo", "--cohort", "lung-mosaic", "--source", str(tmp_path), "--external", "4"]) == 2
    assert "--external" in capsys.readouterr().err
    # a source folder without the class folders: named in the error, before any slide is written
    assert main(["demo", "--cohort", "lung-mosaic", "--source", str(tmp_path), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "lung_n" in capsys.readouterr().err
    assert not (tmp_path / "o" / "cohort" / "manifest.csv").exists()
