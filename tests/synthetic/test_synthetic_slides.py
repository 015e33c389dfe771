"""The synthetic slide generator and cohort (wsi_pipeline.synthetic.slides / cohort)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile

from wsi_pipeline.manifests.schema import read_manifest
from wsi_pipeline.synthetic.cohort import EXTERNAL_TINT, make_slide_cohort
from wsi_pipeline.synthetic.slides import BACKGROUND_GREY, make_slide
from wsi_pipeline.synthetic.truth import read_mask


def _level0(path: Path) -> np.ndarray:
    with tifffile.TiffFile(path) as tf:
        return tf.pages[0].asarray()


def test_slide_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = make_slide(tmp_path / "a.svs", size=768, seed=11, n_lesions=1, pen_marks=1)
    b = make_slide(tmp_path / "b.svs", size=768, seed=11, n_lesions=1, pen_marks=1)
    c = make_slide(tmp_path / "c.svs", size=768, seed=12, n_lesions=1, pen_marks=1)
    np.testing.assert_array_equal(_level0(a.path), _level0(b.path))
    np.testing.assert_array_equal(a.lesion, b.lesion)
    assert not np.array_equal(_level0(a.path), _level0(c.path))


def test_slide_content_tissue_lesions_background(tmp_path: Path) -> None:
    s = make_slide(tmp_path / "s.svs", size=(1536, 1024), seed=3, n_lesions=2, mpp=0.5)
    img = _level0(s.path)
    md = s.mask_downsample
    grey = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(float)
    small = grey[: (1024 // md) * md, : (1536 // md) * md].reshape(1024 // md, md, 1536 // md, md).mean(axis=(1, 3))
    tissue, lesion = s.tissue[: small.shape[0], : small.shape[1]], s.lesion[: small.shape[0], : small.shape[1]]
    # erode masks by 2 px to stay off the soft edges
    k = np.ones((5, 5), np.uint8)
    core = cv2.erode(tissue.astype(np.uint8), k) > 0
    les = cv2.erode(lesion.astype(np.uint8), k) > 0
    glass = cv2.erode((~tissue).astype(np.uint8), k) > 0
    assert les.any() and (lesion <= tissue).all()
    assert abs(small[glass].mean() - BACKGROUND_GREY) < 3  # white glass
    assert small[core & ~les].mean() < 220  # tissue is darker than glass
    assert small[les].mean() < small[core & ~les].mean() - 20  # lesions: dense dark nuclei
    assert 0 < s.lesion_fraction < 0.5
    blank = make_slide(tmp_path / "blank.svs", size=512, seed=1, blank=True)
    assert not blank.tissue.any() and abs(_level0(blank.path).astype(float).mean() - BACKGROUND_GREY) < 2


def test_both_readers_open_it_with_mpp_and_the_same_pixels(tmp_path: Path, opener) -> None:
    s = make_slide(tmp_path / "s.svs", size=(1100, 700), seed=4, mpp=0.2521, n_lesions=1)
    slides = [opener(s.path, b) for b in ("openslide", "tiffslide")]
    for sl in slides:
        assert sl.mpp == pytest.approx(0.2521)
        assert sl.level_dimensions == s.level_dimensions
        assert sl.level_dimensions[1] == (1100 // 4, 700 // 4)
    a, b = (sl.read_region((0, 0), 1, sl.level_dimensions[1]) for sl in slides)
    np.testing.assert_array_equal(a, b)
    # level 1 is the area average of level 0 (up to JPEG error)
    ref = _level0(s.path)[: 175 * 4, : 275 * 4].reshape(175, 4, 275, 4, 3).mean(axis=(1, 3))
    assert np.abs(a.astype(float) - ref).mean() < 3
    assert make_slide(tmp_path / "n.svs", size=512, seed=1, mpp=None).mpp is None
    assert opener(tmp_path / "n.svs").mpp is None


def test_large_slide_is_written_without_holding_level0(tmp_path: Path, opener) -> None:
    """Peak memory grows with the slide by about its level 1 (1/16 of level 0), not by level 0."""
    w = 384
    peaks = {}
    for h in (3072, 12288):
        tracemalloc.start()
        make_slide(tmp_path / f"tall{h}.svs", size=(w, h), seed=2, n_lesions=1)
        peaks[h] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    growth_full = w * (12288 - 3072) * 3
    assert peaks[12288] - peaks[3072] < 0.15 * growth_full, {k: v / 2**20 for k, v in peaks.items()}
    assert opener(tmp_path / "tall12288.svs").dimensions == (w, 12288)


def test_cohort_labels_splits_masks_and_external_shift(tmp_path: Path) -> None:
    m = make_slide_cohort(tmp_path, 8, size=512, seed=1, pen_fraction=0.5)
    df = read_manifest(m)
    assert df["label"].tolist().count(1) == 4 and df["label"].tolist().count(0) == 4
    assert set(df["split"]) == {"train", "val", "test"}
    for lab in (0, 1):
        assert df[df.label == lab]["split"].value_counts().to_dict() == {"train": 2, "val": 1, "test": 1}
    for row in df.itertuples():
        mask = read_mask(row.lesion_mask)
        assert Path(row.path).is_file()
        assert mask.shape == (-(-512 // row.mask_downsample),) * 2
        assert bool(mask.any()) == (row.label == 1)
        assert (row.lesion_fraction > 0) == (row.label == 1)
    assert df["pen_marks"].gt(0).any()
    # same seed, same cohort: identical files; external cohort: tinted towards blue
    m2 = make_slide_cohort(tmp_path / "again", 2, size=512, seed=1)
    np.testing.assert_array_equal(_level0(Path(read_manifest(m2).path[0])), _level0(Path(df.path[0])))
    ext = read_manifest(make_slide_cohort(tmp_path / "ext", 2, size=512, seed=1, cohort="external", splits=None))
    assert set(ext["split"]) == {""} and set(ext["cohort"]) == {"external"}

    def tissue_rgb(path: str) -> np.ndarray:
        img = _level0(Path(path)).reshape(-1, 3).astype(float)
        return img[cv2.cvtColor(img.astype(np.uint8)[None], cv2.COLOR_RGB2GRAY)[0] < 220].mean(axis=0)

    internal_rb = np.mean([tissue_rgb(p)[2] / tissue_rgb(p)[0] for p in df.path[:2]])
    external_rb = np.mean([tissue_rgb(p)[2] / tissue_rgb(p)[0] for p in ext.path])
    assert external_rb > internal_rb * (EXTERNAL_TINT[2] / EXTERNAL_TINT[0]) * 0.95


def test_mimics_darken_tissue_like_lesions_but_stay_out_of_the_lesion_mask(tmp_path: Path) -> None:
    from wsi_pipeline.synthetic.texture import paint_tissue

    def grey(**kw) -> float:
        img = paint_tissue(np.random.default_rng(0), 256, 256, **kw)
        return float(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).mean())

    full = np.ones((256, 256), bool)
    normal, mimic, lesion = grey(), grey(mimic=full), grey(lesion=full, lesion_contrast=0.5)
    # both darken the tissue, by amounts of the same order: mean grey alone cannot tell them apart
    assert mimic < normal - 10 and lesion < normal - 10
    assert 0.3 < (normal - mimic) / (normal - lesion) < 3
    # the mimic nuclei are smaller than lesion nuclei: finer texture (more high-frequency energy)
    def fine(**kw) -> float:
        g = cv2.cvtColor(paint_tissue(np.random.default_rng(1), 256, 256, noise=0, **kw), cv2.COLOR_RGB2GRAY).astype(np.float32)
        return float(np.abs(g - cv2.GaussianBlur(g, (0, 0), 1.0)).mean() / (np.abs(g - cv2.GaussianBlur(g, (0, 0), 4.0)).mean() + 1e-6))
    assert fine(mimic=full) > fine(lesion=full, lesion_contrast=0.5)

    plain = make_slide(tmp_path / "plain.svs", size=768, seed=21, n_lesions=1)
    mimicked = make_slide(tmp_path / "mimic.svs", size=768, seed=21, n_lesions=1, n_mimics=2)
    np.testing.assert_array_equal(plain.lesion, mimicked.lesion)  # the truth mask is the lesions only
    a, b = _level0(plain.path).astype(int), _level0(mimicked.path).astype(int)
    changed = np.abs(a - b).max(axis=2) > 40
    md = plain.mask_downsample
    changed_cells = changed[: (768 // md) * md, : (768 // md) * md].reshape(768 // md, md, 768 // md, md).mean(axis=(1, 3)) > 0.05
    assert changed_cells.any()
    assert not (changed_cells & plain.lesion[: changed_cells.shape[0], : changed_cells.shape[1]]).any()


def test_cohort_nuisance_variation_is_label_independent(tmp_path: Path) -> None:
    df = read_manifest(make_slide_cohort(tmp_path, 12, size=384, seed=4, mimic_fraction=0.6, stain_jitter=0.06,
                                         density_jitter=0.3, lesion_size=0.2, lesions=(1, 1)))
    assert df.loc[df.label == 0, "n_mimics"].gt(0).any() and df.loc[df.label == 1, "n_mimics"].gt(0).any()
    for row in df.itertuples():  # mimics never enter the truth mask
        assert bool(read_mask(row.lesion_mask).any()) == (row.label == 1)
