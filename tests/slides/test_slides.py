"""Slide reading (wsi_pipeline.slides): backends, pixels, errors, mpp resolution, fingerprints."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile

from wsi_pipeline.slides import (
    MissingMppError,
    SlideOpenError,
    read_scaled,
    resolve_mpp,
    slide_fingerprint,
)
from wsi_pipeline.synthetic.slides import make_slide


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("slides_synth")
    return make_slide(d / "s.svs", size=(1280, 1024), seed=5, n_lesions=1, pen_marks=1, mpp=0.25).path


def _tifffile_level(path: Path, level: int) -> np.ndarray:
    """Level ``level`` decoded by tifffile alone (SVS layout: page 0, then pages 2, 3, ...)."""
    with tifffile.TiffFile(path) as tf:
        page = tf.pages[0 if level == 0 else level + 1]
        return page.asarray()


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
def test_backends_report_geometry_mpp_and_pixels_of_the_file(synth: Path, backend: str, opener) -> None:
    s = opener(synth, backend)
    assert s.backend == backend
    assert s.dimensions == (1280, 1024)
    assert s.level_count == 3
    assert s.level_dimensions == ((1280, 1024), (320, 256), (80, 64))
    assert s.level_downsamples == pytest.approx((1.0, 4.0, 16.0))
    assert s.mpp == pytest.approx(0.25)
    for level in range(s.level_count):
        ref = _tifffile_level(synth, level)
        w, h = s.level_dimensions[level]
        got = s.read_region((0, 0), level, (w, h))
        assert got.dtype == np.uint8 and got.shape == (h, w, 3)
        np.testing.assert_array_equal(got, ref)
    # an unaligned window at level 1: location in level-0 px, size in level px
    ref1 = _tifffile_level(synth, 1)
    np.testing.assert_array_equal(s.read_region((4 * 37, 4 * 11), 1, (50, 30)), ref1[11:41, 37:87])


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
def test_out_of_bounds_is_white_and_inside_is_unchanged(synth: Path, backend: str, opener) -> None:
    s = opener(synth, backend)
    ref = _tifffile_level(synth, 0)
    got = s.read_region((1200, -30), 0, (200, 100))
    assert (got[:30] == 255).all()  # above the slide
    assert (got[:, 80:] == 255).all()  # right of the slide
    np.testing.assert_array_equal(got[30:, :80], ref[0:70, 1200:1280])


def test_open_errors_name_the_problem(tmp_path: Path, opener) -> None:
    with pytest.raises(FileNotFoundError, match="slide file not found"):
        opener(tmp_path / "missing.svs")
    empty = tmp_path / "empty.svs"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty \(0 bytes\)"):
        opener(empty)
    text = tmp_path / "notes.svs"
    text.write_text("this is not a slide\n" * 50)
    with pytest.raises(SlideOpenError, match="openslide: .*tiffslide: ") as info:
        opener(text)
    assert set(info.value.reasons) == {"openslide", "tiffslide"}
    with pytest.raises(ValueError, match="backend='bioformats'"):
        opener(text, backend="bioformats")
    with pytest.raises(ValueError, match=r"level=3 out of range \[0, 1\)"):
        img = tmp_path / "flat.tif"
        tifffile.imwrite(img, np.zeros((64, 64, 3), np.uint8), photometric="rgb")
        opener(img).read_region((0, 0), 3, (8, 8))


def test_auto_falls_back_to_tiffslide_for_a_tiff_openslide_rejects(tmp_path: Path, opener) -> None:
    img = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    path = tmp_path / "stripped.tif"
    tifffile.imwrite(path, img, photometric="rgb")  # not tiled: OpenSlide's generic TIFF reader refuses it
    with pytest.raises(SlideOpenError, match="openslide"):
        opener(path, backend="openslide")
    s = opener(path)
    assert s.backend == "tiffslide"
    np.testing.assert_array_equal(s.read_region((0, 0), 0, (128, 96)), img)


def test_resolve_mpp_precedence_and_missing_message() -> None:
    # manifest > slide metadata > run fallback; a forced run value beats all three
    assert resolve_mpp(0.25) == (0.25, "slide")
    assert resolve_mpp(0.25, run_mpp=0.5) == (0.25, "slide")  # --mpp only fills in slides without one
    assert resolve_mpp(None, run_mpp=0.5) == (0.5, "run-fallback")
    assert resolve_mpp(0.25, run_mpp=0.5, manifest_mpp=0.3) == (0.3, "manifest")
    assert resolve_mpp(None, manifest_mpp=float("nan"), run_mpp=0.5) == (0.5, "run-fallback")  # empty manifest cell
    assert resolve_mpp(0.25, manifest_mpp=0.3, force_mpp=0.4) == (0.4, "run-forced")
    assert resolve_mpp(None, manifest_mpp=float("nan"), run_mpp=None) == (None, "none")
    assert resolve_mpp(0.25, run_mpp=-1.0, force_mpp=float("inf")) == (0.25, "slide")  # invalid values are ignored
    with pytest.raises(MissingMppError) as info:
        resolve_mpp(None, slide_id="x7", path="/d/x7.svs", needed_for="--mpp-target 0.5")
    msg = str(info.value)
    assert "slide 'x7' (/d/x7.svs)" in msg and "--mpp-target 0.5" in msg
    assert "`mpp` column" in msg and "--mpp <um/px>" in msg and "--mpp-force <um/px>" in msg


def _level_pages(path: Path) -> list[np.ndarray]:
    """Every pyramid level decoded by tifffile alone (SVS layout: page 0, then pages 2, 3, ...)."""
    with tifffile.TiffFile(path) as tf:
        return [tf.pages[0].asarray()] + [p.asarray() for p in tf.pages[2:]]


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
def test_read_level_is_exact_at_non_integer_downsamples(tmp_path: Path, backend: str, opener) -> None:
    """Level sizes floor(W / 2): downsamples 2.0011 etc. read_level returns the level's own pixels at
    any integer position (background outside), where read_region at such a level cannot."""
    rng = np.random.default_rng(3)
    W, H = 777, 519
    levels = [cv2.GaussianBlur(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), (0, 0), 1.0)]
    for k in (1, 2):
        levels.append(cv2.resize(levels[0], (W >> k, H >> k), interpolation=cv2.INTER_AREA))
    path = tmp_path / "p.svs"
    head = f"Aperio Image Library v12.0.16\r\n{W}x{H} [0,0 {W}x{H}] (64x64)"
    opts = {"photometric": "rgb", "compression": "zlib", "metadata": None}
    with tifffile.TiffWriter(path) as tw:
        tw.write(levels[0], tile=(64, 64), description=f"{head}|MPP = 0.25", **opts)
        tw.write(levels[2], description=f"{head} -> thumb", **opts)
        for lv in levels[1:]:
            tw.write(lv, tile=(64, 64), description=f"{head} -> {lv.shape[1]}x{lv.shape[0]}", **opts)
    pages = _level_pages(path)
    s = opener(path, backend)
    assert s.exact_levels() == (True, True, True)
    assert s.level_scale(1) == (W / (W >> 1), H / (H >> 1))
    for L, page in enumerate(pages):
        np.testing.assert_array_equal(page, levels[L])
        lh, lw = page.shape[:2]
        padded = np.full((lh + 80, lw + 80, 3), 255, np.uint8)  # the level with a 40 px white margin
        padded[40 : 40 + lh, 40 : 40 + lw] = page
        for _ in range(40):
            x, y = int(rng.integers(-40, lw)), int(rng.integers(-40, lh))
            w, h = (int(v) for v in rng.integers(1, 41, 2))
            np.testing.assert_array_equal(s.read_level(L, (x, y), (w, h)), padded[y + 40 : y + 40 + h, x + 40 : x + 40 + w])
    if backend == "openslide":  # why read_level exists: OpenSlide interpolates at a fractional level position
        x0 = round(101 * s.level_downsamples[1])
        assert not np.array_equal(s.read_region((x0, 0), 1, (32, 32)), pages[1][0:32, 101:133])


def test_fingerprint_tracks_size_and_head(tmp_path: Path, synth: Path) -> None:
    a = tmp_path / "a.svs"
    shutil.copy(synth, a)
    assert slide_fingerprint(a) == slide_fingerprint(synth)
    size = a.stat().st_size
    assert slide_fingerprint(a).startswith(f"{size}-")
    data = bytearray(a.read_bytes())
    data[100] ^= 0xFF
    a.write_bytes(bytes(data))
    assert slide_fingerprint(a) != slide_fingerprint(synth)


def test_read_scaled_uses_pyramid_and_matches_area_average(synth: Path, opener) -> None:
    s = opener(synth)
    # downsample 4 is a pyramid level: returned as stored
    np.testing.assert_array_equal(read_scaled(s, 4), _tifffile_level(synth, 1))
    # downsample 2 comes from level 0 by area averaging (independent reference: block means)
    full = _tifffile_level(synth, 0).astype(np.float64)
    ref = full.reshape(512, 2, 640, 2, 3).mean(axis=(1, 3))
    got = read_scaled(s, 2).astype(np.float64)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1.0
    thumb = s.thumbnail(100)
    assert max(thumb.shape[:2]) <= 100 and thumb.shape[2] == 3


@pytest.mark.real_slides
def test_real_slides_open_with_their_documented_facts(real_slides_dir: Path, opener) -> None:
    svs = real_slides_dir / "CMU-1-Small-Region.svs"
    for backend in ("openslide", "tiffslide"):
        s = opener(svs, backend)
        assert s.dimensions == (2220, 2967) and s.level_count == 1
        assert s.mpp == pytest.approx(0.499)
    a = opener(svs, "openslide").read_region((1000, 1000), 0, (300, 200))
    b = opener(svs, "tiffslide").read_region((1000, 1000), 0, (300, 200))
    assert np.abs(a.astype(int) - b).max() <= 2  # same JPEG data, two decoders
    dcm = real_slides_dir / "dicom-bone" / "jpeg.dcm"
    assert opener(dcm).backend == "openslide"
    with pytest.raises(SlideOpenError, match="tiffslide: .*not a TIFF"):
        opener(dcm, backend="tiffslide")
    ndpi = opener(real_slides_dir / "test3-DAPI-2-387.ndpi")
    assert ndpi.dimensions == (3968, 4864) and ndpi.mpp == pytest.approx(0.2282, rel=1e-3)


@pytest.mark.parametrize("backend", ["auto", "openslide", "tiffslide"])
@pytest.mark.parametrize("size, unit, expected", [(0.25, "µm", 0.25), (500.0, "nm", 0.5), (None, None, None)])
def test_ome_tiff_pixel_size_is_the_slides_mpp(tmp_path, backend, size, unit, expected):
    """OpenSlide reads an OME-TIFF as a generic TIFF and tiffslide skips OME-XML: the mpp comes from
    the OME ``PhysicalSizeX/Y`` (in their unit) all the same, and stays None when the file has none."""
    import tifffile

    from wsi_pipeline.slides import open_slide

    meta = {"axes": "YXS"}
    if size is not None:
        meta.update(PhysicalSizeX=size, PhysicalSizeY=size, PhysicalSizeXUnit=unit, PhysicalSizeYUnit=unit)
    path = tmp_path / "crop.ome.tif"
    tifffile.imwrite(path, np.full((512, 512, 3), 180, np.uint8), ome=True, tile=(256, 256), photometric="rgb", metadata=meta)
    with open_slide(path, backend) as slide:
        assert (slide.mpp is None) if expected is None else slide.mpp == pytest.approx(expected, rel=1e-12)
