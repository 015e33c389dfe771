"""Real-tissue training mosaics (wsi_pipeline.tissue_seg.mosaic) on small generated slides."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from wsi_pipeline.slides.opener import open_slide
from wsi_pipeline.slides.scaled import read_scaled
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tissue_seg import mosaic as M
from wsi_pipeline.tissue_seg.labels import block_mean_downsample, paper_labels

#: a quiet mosaic: no noise, tint, gradient, dust, pen or fold, no arbitrary angle, no stain change
QUIET = dict(size=(320, 384), piece_side=(48, 120), angle=(0.0, 0.0), stain_scale=(1.0, 1.0), glass_tint=0.0,
             glass_gradient=0.0, glass_noise=(0.0, 0.0), folds=(0, 0), pen_marks=(0, 0), dust=(0, 0))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, M.TissueSource]:
    p = make_slide(tmp_path_factory.mktemp("mosaic") / "src.svs", size=(1024, 896), seed=77, tissue_fraction=0.45, mpp=0.5).path
    return p, M.read_source(p, 2.0)


def test_read_source_reads_at_mpp_keeps_the_row_band_and_labels_by_the_paper(source: tuple[Path, M.TissueSource]) -> None:
    path, whole = source
    with open_slide(path) as s:
        ref = read_scaled(s, 4.0)  # 2.0 um/px over the 0.5 um/px level 0
    assert np.array_equal(whole.rgb, ref)
    assert np.array_equal(whole.mask, paper_labels(ref))
    assert np.allclose(whole.glass, np.median(ref[paper_labels(ref) == 0].astype(np.float64), axis=0))
    top, bottom = M.read_source(path, 2.0, rows=(0.0, 0.5)), M.read_source(path, 2.0, rows=(0.5, 1.0))
    h = int(round(0.5 * ref.shape[0]))
    assert np.array_equal(top.rgb, ref[:h]) and np.array_equal(bottom.rgb, ref[h:])  # disjoint, together the slide
    with pytest.raises(ValueError, match="rows"):
        M.read_source(path, 2.0, rows=(0.5, 0.5))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pasted_masks_are_the_quarter_turned_mirrored_source_masks(source: tuple[Path, M.TissueSource], seed: int) -> None:
    _, src = source
    m = M.make_mosaic([src], seed, M.MosaicConfig(**QUIET))
    assert len(m.placements) >= 4
    union = np.zeros(m.pieces.shape, np.uint8)
    for p in m.placements:
        y, x, h, w = p.window
        assert p.cut.shape == (h, w) and p.cut.any()
        assert not np.any(p.cut & (src.mask[y : y + h, x : x + w] == 0))  # cut through the source's own mask
        turned = np.rot90(p.cut, p.rot90)
        expected = turned[:, ::-1] if p.flip else turned
        assert np.array_equal(p.mask, expected)
        oy, ox = p.offset
        assert p.mask.shape == ((h, w) if p.rot90 % 2 == 0 else (w, h))
        union[oy : oy + p.mask.shape[0], ox : ox + p.mask.shape[1]] |= p.mask
    assert np.array_equal(m.pieces, union)


def test_pasted_pixels_are_the_source_pixels_on_the_new_glass(source: tuple[Path, M.TissueSource]) -> None:
    """One piece on noiseless glass: each pasted px is glass * (source px / source glass), rounded."""
    _, src = source
    m = M.make_mosaic([src], 5, M.MosaicConfig(**{**QUIET, "n_pieces": (1, 1)}))
    (p,) = m.placements
    y, x, h, w = p.window
    t = np.clip(src.rgb[y : y + h, x : x + w].astype(np.float64) / src.glass, 0, 1)
    t = np.rot90(t, p.rot90)
    t = t[:, ::-1] if p.flip else t
    oy, ox = p.offset
    got = m.rgb[oy : oy + t.shape[0], ox : ox + t.shape[1]].astype(np.float64)
    ref = np.rint(m.glass * t)
    # the generator works in float32 (transmission and glass): |error| <= 255 * few 2^-24 << 0.5, so
    # only values within rounding of a .5 boundary may differ, by one level
    on = p.mask.astype(bool)
    assert np.abs(got[on] - ref[on]).max() <= 1 and (got[on] != ref[on]).mean() < 0.01
    assert np.all(m.rgb[~m.pieces.astype(bool)] == np.rint(m.glass).astype(np.uint8))


def test_arbitrary_rotation_carries_the_mask_by_nearest_neighbour(source: tuple[Path, M.TissueSource]) -> None:
    """Rotated pieces: the mask equals the turned cut sampled at the inverse-mapped px centres
    (independent numpy nearest neighbour; rounding conventions may differ on exact half px)."""
    _, src = source
    m = M.make_mosaic([src], 3, M.MosaicConfig(**{**QUIET, "angle": (-180.0, 180.0)}))
    for p in m.placements:
        c = np.rot90(p.cut, p.rot90)
        c = c[:, ::-1] if p.flip else c
        a = np.vstack([p.matrix, [0, 0, 1]])
        inv = np.linalg.inv(a)
        yy, xx = np.mgrid[0 : p.mask.shape[0], 0 : p.mask.shape[1]]
        sx = inv[0, 0] * xx + inv[0, 1] * yy + inv[0, 2]
        sy = inv[1, 0] * xx + inv[1, 1] * yy + inv[1, 2]
        ix, iy = np.floor(sx + 0.5).astype(int), np.floor(sy + 0.5).astype(int)
        inside = (ix >= 0) & (iy >= 0) & (ix < c.shape[1]) & (iy < c.shape[0])
        ref = np.zeros(p.mask.shape, np.uint8)
        ref[inside] = c[iy[inside], ix[inside]]
        union = (ref | p.mask).sum()
        assert (ref != p.mask).sum() <= 0.02 * union
        assert abs(int(p.mask.sum()) - int(c.sum())) <= 0.05 * c.sum()  # a rotation keeps the area


def test_stain_jitter_scales_optical_density_per_stain() -> None:
    from skimage.color import rgb_from_hed

    a = np.linspace(0.05, 1.5, 12)[:, None]
    t = np.exp(-a * rgb_from_hed[0])[None].astype(np.float32)  # pure haematoxylin of density a
    # float32 round trip: exp/log of values in (0.01, 1] keep ~1e-6 relative error
    assert np.allclose(M.stain_jitter(t, (1.0, 1.0, 1.0)), t, atol=1e-5)
    assert np.allclose(M.stain_jitter(t, (1.7, 1.0, 1.0)), np.exp(-1.7 * a * rgb_from_hed[0])[None], atol=1e-5)
    assert np.allclose(M.stain_jitter(t, (1.0, 0.5, 2.0)), t, atol=1e-5)  # other stains absent: unchanged


@pytest.mark.parametrize("seed", [0, 1])
def test_glass_grey_and_noise_in_range_and_not_tissue(seed: int) -> None:
    cfg = M.MosaicConfig(size=(256, 320), n_pieces=(0, 0), pen_marks=(0, 0), dust=(0, 0), glass_grey=(236.0, 240.0),
                         glass_noise=(1.0, 2.0))
    m = M.make_mosaic([], seed, cfg)
    grey = m.rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    lo, hi = cfg.glass_grey
    margin = cfg.glass_tint + cfg.glass_gradient  # tint and illumination field bounds, grey levels
    assert lo - margin <= grey.mean() <= hi + margin
    assert np.all((lo - cfg.glass_tint <= m.glass) & (m.glass <= hi + cfg.glass_tint))
    assert np.ptp(m.glass) <= 2 * cfg.glass_tint
    assert 0.8 <= (m.rgb.astype(np.float64) - cv2.GaussianBlur(m.rgb.astype(np.float64), (0, 0), 8)).std() <= 2.2
    assert not m.label.any()  # glass over the paper's 230 threshold is glass


def test_dust_and_thin_pen_are_caught_by_the_threshold_but_removed_by_the_median() -> None:
    """The paper's rule: blocks darker than 230 are tissue, then a 5 x 5 median removes what
    covers fewer than 13 of 25 neighbouring blocks: dust specks and thin pen lines."""
    for kw in ({"dust": (150, 150), "pen_marks": (0, 0)}, {"dust": (0, 0), "pen_marks": (3, 3), "pen_width": (4, 6)}):
        m = M.make_mosaic([], 4, M.MosaicConfig(size=(256, 384), n_pieces=(0, 0), **kw))
        assert (block_mean_downsample(m.rgb, 8).mean(axis=2) <= 230).sum() > 20  # the threshold flags them
        assert not m.label.any()
    wide = M.make_mosaic([], 4, M.MosaicConfig(size=(256, 384), n_pieces=(0, 0), dust=(0, 0), pen_marks=(3, 3), pen_width=(60, 60)))
    assert wide.label[wide.pen].mean() > 0.9  # a wide pen stroke is tissue to the paper's rule
    assert np.array_equal(wide.label, paper_labels(wide.rgb))


def test_folds_are_darker_double_layers(source: tuple[Path, M.TissueSource]) -> None:
    _, src = source
    m = M.make_mosaic([src], 8, M.MosaicConfig(**{**QUIET, "folds": (2, 2), "n_pieces": (2, 2)}))
    folds = [p for p in m.placements if p.source.startswith("fold")]
    assert folds
    for f in folds:
        oy, ox = f.offset
        region = m.rgb[oy : oy + f.mask.shape[0], ox : ox + f.mask.shape[1]]
        assert np.array_equal(f.mask, f.cut[:, ::-1])  # the flap is the mirrored band
        # a flap multiplies transmission: under it the image is no brighter than the glass
        assert np.all(region[f.mask.astype(bool)] <= np.ceil(m.glass).astype(np.uint8))


def test_mosaic_is_deterministic_in_the_seed(source: tuple[Path, M.TissueSource]) -> None:
    _, src = source
    cfg = M.MosaicConfig(size=(256, 320), piece_side=(48, 120))
    a, b, c = M.make_mosaic([src], 11, cfg), M.make_mosaic([src], 11, cfg), M.make_mosaic([src], 12, cfg)
    assert np.array_equal(a.rgb, b.rgb) and np.array_equal(a.label, b.label) and np.array_equal(a.pieces, b.pieces)
    assert [p.window for p in a.placements] == [p.window for p in b.placements]
    assert not np.array_equal(a.rgb, c.rgb)
    assert np.array_equal(a.label, paper_labels(a.rgb))


def test_written_mosaic_slides_open_at_their_mpp(source: tuple[Path, M.TissueSource], tmp_path: Path) -> None:
    _, src = source
    cfg = M.MosaicConfig(size=(256, 320), piece_side=(48, 120))
    paths = M.write_mosaics(tmp_path, [src], 2, mpp=2.0, seed=3, config=cfg)
    assert [p.name for p in paths] == ["mosaic_000.svs", "mosaic_001.svs"]
    ref = M.make_mosaic([src], int(np.random.SeedSequence([3, 1]).generate_state(1)[0]), cfg).rgb
    with open_slide(paths[1]) as s:
        assert s.dimensions == (320, 256) and s.mpp == pytest.approx(2.0)
        got = s.read_region((0, 0), 0, (320, 256))
    assert np.abs(got.astype(int) - ref).mean() < 3  # JPEG tiles (quality 92)


@pytest.mark.real_slides
def test_real_cmu1_training_and_test_regions_are_disjoint(real_slides_dir: Path) -> None:
    from wsi_pipeline.tissue_seg.builtin import MPP, TEST_SOURCES, TRAIN_SOURCES, training_sources

    (train_name, train_rows, _), (test_name, test_rows, _) = TRAIN_SOURCES[0], TEST_SOURCES[0]
    assert train_name == test_name and train_rows[1] <= test_rows[0]  # CMU-1: top half trains, bottom half tests
    top = training_sources(real_slides_dir, MPP, TRAIN_SOURCES[:1])[0]
    bottom = training_sources(real_slides_dir, MPP, TEST_SOURCES)[0]
    with open_slide(real_slides_dir / train_name) as s:
        whole = read_scaled(s, MPP / s.mpp)
    assert np.array_equal(np.concatenate([top.rgb, bottom.rgb]), whole)
    assert 0.1 < top.mask.mean() < 0.9 and 235 < top.glass.mean() < 252  # real glass, over the 230 threshold
    m = M.make_mosaic([top], 0, M.MosaicConfig(size=(512, 512)))
    for p in m.placements:
        if not p.source.startswith("fold"):
            y, x, h, w = p.window
            assert y + h <= top.rgb.shape[0] and not np.any(p.cut & (top.mask[y : y + h, x : x + w] == 0))
