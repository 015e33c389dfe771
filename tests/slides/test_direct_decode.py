"""Direct stored-tile decoding (wsi_pipeline.slides.direct) against OpenSlide's read_region.

The reference in every test is OpenSlide itself (through the project's OpenSlide-backed Slide, which
composites transparent areas over the background): regions and 256 px grid tiles read directly must
equal it byte for byte, on the real slides and on tifffile-written pyramids of each photometric,
compression and stored tile size, including stored grids (240 px, 512 px) that do not align with ours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openslide")
tifffile = pytest.importorskip("tifffile")
pytest.importorskip("imagecodecs")

from wsi_pipeline.slides.direct import DirectTiles, direct_levels  # noqa: E402
from wsi_pipeline.slides.opener import open_slide  # noqa: E402

GRID = 256  # our tile grid, level px


def _image(h: int, w: int, grey: bool = False) -> np.ndarray:
    """Smooth gradients plus noise: colour edges for chroma subsampling, detail for the codecs."""
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 256], -1).astype(np.int16)
    a += np.random.default_rng(1).integers(-20, 21, a.shape).astype(np.int16)
    a = np.clip(a, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(a[..., 0]) if grey else a


def _write_pyramid(path: Path, tile: int, levels: int = 3, description: str | None = None, grey: bool = False, size: tuple[int, int] = (1000, 1200), **kw) -> None:
    """A generic tiled TIFF: level 0 then reduced-resolution pages, each half the one before."""
    img = _image(*size, grey=grey)
    with tifffile.TiffWriter(path) as tw:
        for i in range(levels):
            tw.write(img, tile=(tile, tile), subfiletype=0 if i == 0 else 1, description=description, metadata=None, **kw)
            img = img[::2, ::2]


_APERIO = "Aperio Image Library v12.0.0\r\n1200x1000 (240x240) JPEG/RGB Q=80|AppMag = 20|MPP = 0.5"

#: name -> (writer arguments, vendor OpenSlide must report)
CASES = {
    # YCbCr JPEG, 4:2:0, stored tiles smaller than ours and not dividing them
    "jpeg-ycbcr420-240": (dict(tile=240, compression="jpeg", photometric="rgb"), "generic-tiff"),
    # YCbCr JPEG, 4:2:2, stored tiles larger than ours
    "jpeg-ycbcr422-512": (dict(tile=512, compression="jpeg", photometric="rgb", subsampling=(2, 1)), "generic-tiff"),
    # RGB-coded JPEG (no colour transform), as Aperio writes it
    "jpeg-rgb-256": (dict(tile=256, compression="jpeg", photometric="rgb", subsampling=(1, 1), compressionargs={"outcolorspace": "rgb"}), "generic-tiff"),
    "svs-jpeg-rgb-240": (dict(tile=240, compression="jpeg", photometric="rgb", subsampling=(1, 1), compressionargs={"outcolorspace": "rgb"}, description=_APERIO), "aperio"),
    "svs-jpeg-ycbcr-240": (dict(tile=240, compression="jpeg", photometric="rgb", description=_APERIO), "aperio"),
    # Aperio JPEG 2000, RGB (compression 33005), lossy: irreversible wavelet and colour transform
    "svs-j2k-rgb-240": (dict(tile=240, compression=33005, compressionargs={"level": 40, "reversible": False}, photometric="rgb", description=_APERIO.replace("JPEG/RGB", "J2K/KDU")), "aperio"),
    "lzw-predictor-240": (dict(tile=240, compression="lzw", photometric="rgb", predictor=True), "generic-tiff"),
    "deflate-512": (dict(tile=512, compression="adobe_deflate", photometric="rgb"), "generic-tiff"),
    "raw-256": (dict(tile=256, photometric="rgb"), "generic-tiff"),
    "zstd-256": (dict(tile=256, compression="zstd", photometric="rgb"), "generic-tiff"),
    "grey-lzw-256": (dict(tile=256, compression="lzw", photometric="minisblack", grey=True), "generic-tiff"),
}


@pytest.fixture(scope="module")
def pyramids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("direct")
    out = {}
    for name, (kw, _) in CASES.items():
        out[name] = root / f"{name}.tif"
        _write_pyramid(out[name], **kw)
    return out


def _assert_equal_to_openslide(slide, reader: DirectTiles, level: int, n_random: int = 12, seed: int = 0) -> int:
    """Random regions (crossing the level's edges) and the whole 256 px grid; returns tiles decoded."""
    w, h = slide.level_dimensions[level]
    d = int(slide.level_downsamples[level])
    rng = np.random.default_rng(seed)
    for _ in range(n_random):
        x, y = int(rng.integers(-100, w)), int(rng.integers(-100, h))
        rw, rh = int(rng.integers(1, 600)), int(rng.integers(1, 600))
        got = reader.read(level, x, y, rw, rh)
        ref = slide.read_region((x * d, y * d), level, (rw, rh))
        assert got.dtype == np.uint8 and got.shape == (rh, rw, 3)
        assert np.array_equal(got, ref), f"level {level} region x={x} y={y} {rw}x{rh} differs from OpenSlide"
    # the whole grid (edge tiles run past the level), row-major: each stored tile decoded once
    origins = [(x, y) for y in range(0, h, GRID) for x in range(0, w, GRID)]
    reader.clear_cache()
    before = reader.decoded
    for (x, y), got in zip(origins, reader.read_tiles(level, origins, GRID), strict=True):
        ref = slide.read_region((x * d, y * d), level, (GRID, GRID))
        assert np.array_equal(got, ref), f"level {level} grid tile at ({x}, {y}) differs from OpenSlide"
    tw, th = reader.stored_tile_size(level)
    stored = -(-w // tw) * -(-h // th)
    assert reader.decoded - before == stored, "a stored tile was decoded more than once (or not at all)"
    return stored


@pytest.mark.parametrize("name", list(CASES))
def test_generated_pyramid_equals_openslide(pyramids: dict[str, Path], name: str) -> None:
    path = pyramids[name]
    with open_slide(path, backend="openslide") as slide:
        assert slide.properties.get("openslide.vendor") == CASES[name][1]
        assert slide.level_count == 3
        with DirectTiles.from_slide(slide) as reader:
            for level in range(slide.level_count):
                assert reader.supports(level), reader.reason(level)
                _assert_equal_to_openslide(slide, reader, level, seed=level)


def test_stored_photometric_matches_the_case(pyramids: dict[str, Path]) -> None:
    """The generated files really cover RGB-coded and YCbCr JPEG, and both subsamplings."""
    seen = {}
    for name, path in pyramids.items():
        with tifffile.TiffFile(path) as tf:
            p = tf.pages[0]
            seen[name] = (int(p.compression), int(p.photometric), tuple(p.subsampling) if int(p.photometric) == 6 else None, p.tilewidth)
    assert seen["jpeg-rgb-256"][:2] == (7, 2) and seen["svs-jpeg-rgb-240"][:2] == (7, 2)
    assert seen["jpeg-ycbcr420-240"] == (7, 6, (2, 2), 240)
    assert seen["jpeg-ycbcr422-512"] == (7, 6, (2, 1), 512)
    assert seen["lzw-predictor-240"][:2] == (5, 2) and seen["grey-lzw-256"][:2] == (5, 1)


def test_ome_tiff_level0(tmp_path: Path) -> None:
    """An OME-TIFF (pyramid in SubIFDs): OpenSlide's generic driver sees level 0 only; equal there."""
    path = tmp_path / "slide.ome.tif"
    img = _image(700, 900)
    with tifffile.TiffWriter(path, ome=True) as tw:
        tw.write(img, tile=(256, 256), compression="jpeg", photometric="rgb", subifds=1, metadata={"axes": "YXS"})
        tw.write(img[::2, ::2], tile=(256, 256), compression="jpeg", photometric="rgb", subfiletype=1)
    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        assert slide.level_count == 1 and reader.supports(0), reader.reason(0)
        _assert_equal_to_openslide(slide, reader, 0)


def test_missing_tile_is_background(tmp_path: Path) -> None:
    """A generic TIFF stored tile with byte count 0: OpenSlide leaves it transparent, we fill background."""
    path = tmp_path / "sparse.tif"
    _write_pyramid(path, tile=256, levels=1, size=(600, 700), compression="jpeg", photometric="rgb")
    with tifffile.TiffFile(path, mode="r+b") as tf:
        tag = tf.pages[0].tags["TileByteCounts"]
        counts = list(tag.value)
        counts[4] = 0  # stored tile (col 1, row 1) of a 3-across grid
        tag.overwrite(counts)
    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        assert reader.supports(0), reader.reason(0)
        got = reader.read(0, 200, 200, 200, 200)
        assert np.array_equal(got, slide.read_region((200, 200), 0, (200, 200)))
        assert (got[56:, 56:] == 255).all() and not (got[:56, :56] == 255).all()
        _assert_equal_to_openslide(slide, reader, 0)


def test_non_integer_downsample_falls_back(tmp_path: Path) -> None:
    """Level 1 of 1001 x 999 px is 500 x 499 px: downsample not an integer, so OpenSlide resamples."""
    path = tmp_path / "odd.tif"
    _write_pyramid(path, tile=256, levels=2, size=(999, 1001), compression="lzw", photometric="rgb")
    with open_slide(path, backend="openslide") as slide:
        assert slide.level_downsamples[1] != int(slide.level_downsamples[1])
        reasons = direct_levels(slide)
        assert reasons[0] is None
        assert reasons[1] is not None and "not an integer" in reasons[1]
        with DirectTiles.from_slide(slide) as reader, pytest.raises(ValueError, match="not read directly"):
            reader.read(1, 0, 0, 10, 10)


def test_aperio_cases_left_to_openslide(tmp_path: Path) -> None:
    """Aperio YCbCr JPEG 2000 (33003, OpenSlide's own colour tables) and Aperio levels with a missing
    tile (OpenSlide paints it from the level above) are declined with the reason, other levels kept."""
    j2k = tmp_path / "ycbcr_j2k.svs"
    _write_pyramid(j2k, tile=240, levels=1, size=(300, 400), compression=33003, photometric="rgb", description=_APERIO)
    sparse = tmp_path / "sparse.svs"
    _write_pyramid(sparse, tile=240, levels=2, size=(600, 700), compression="jpeg", photometric="rgb", description=_APERIO)
    with tifffile.TiffFile(sparse, mode="r+b") as tf:
        tag = tf.pages[0].tags["TileByteCounts"]
        tag.overwrite([0, *list(tag.value)[1:]])
    with open_slide(j2k, backend="openslide") as slide:
        assert slide.properties["openslide.vendor"] == "aperio"
        assert "33003" in direct_levels(slide)[0]
    with open_slide(sparse, backend="openslide") as slide:
        assert slide.properties["openslide.vendor"] == "aperio"
        reasons = direct_levels(slide)
        assert "without data" in reasons[0] and reasons[1] is None


def test_read_region_signature(pyramids: dict[str, Path]) -> None:
    """read_region takes level-0 px like Slide.read_region and rejects off-grid locations."""
    with open_slide(pyramids["lzw-predictor-240"], backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        ref = slide.read_region((100, 60), 2, (90, 70))
        assert np.array_equal(reader.read_region((100, 60), 2, (90, 70)), ref)
        with pytest.raises(ValueError, match="multiple"):
            reader.read_region((101, 60), 2, (10, 10))


def test_any_order_and_threads(pyramids: dict[str, Path]) -> None:
    """A tiny cache and a reversed, shuffled order still give OpenSlide's pixels; so do 4 threads."""
    from concurrent.futures import ThreadPoolExecutor

    with open_slide(pyramids["jpeg-ycbcr422-512"], backend="openslide") as slide:
        w, h = slide.level_dimensions[0]
        origins = [(x, y) for y in range(-64, h, 200) for x in range(-64, w, 200)]
        order = np.random.default_rng(3).permutation(len(origins))
        refs = {o: slide.read_region(o, 0, (GRID, GRID)) for o in origins}
        with DirectTiles.from_slide(slide, cache_bytes=0) as reader:
            for i in order:
                assert np.array_equal(reader.read(0, *origins[i], GRID, GRID), refs[origins[i]])
        with DirectTiles.from_slide(slide, cache_bytes=4 * 512 * 512 * 3) as reader, ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda o: reader.read(0, o[0], o[1], GRID, GRID), origins))
        assert all(np.array_equal(g, refs[o]) for g, o in zip(got, origins, strict=True))


def test_tiffslide_opened_slide_is_declined(pyramids: dict[str, Path]) -> None:
    with open_slide(pyramids["raw-256"], backend="tiffslide") as slide:
        reasons = direct_levels(slide)
    assert all(r is not None and "OpenSlide" in r for r in reasons.values())


# -- real slides ---------------------------------------------------------------------------------


def test_real_svs_equals_openslide(real_slides_dir: Path) -> None:
    """CMU-1-Small-Region.svs: Aperio, RGB-coded JPEG with JPEGTables, 240 px stored tiles."""
    with open_slide(real_slides_dir / "CMU-1-Small-Region.svs", backend="openslide") as slide:
        with DirectTiles.from_slide(slide) as reader:
            assert reader.supports(0), reader.reason(0)
            assert reader.stored_tile_size(0) == (240, 240)
            assert _assert_equal_to_openslide(slide, reader, 0, n_random=20) == 10 * 13


def test_real_ndpi_stored_levels_equal_openslide(real_slides_dir: Path) -> None:
    """NDPI: the four stored levels (restart-marker tiles of 8 rows) are served and equal; OpenSlide's
    extra levels made by libjpeg's DCT scaling are not stored and go to OpenSlide."""
    path = real_slides_dir / "test3-DAPI-2-387.ndpi"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        served = [lv for lv in range(slide.level_count) if reader.supports(lv)]
        assert served == [0, 1, 2, 3]
        for lv in range(4, slide.level_count):
            assert "stored" in reader.reason(lv)
        for lv in served:
            _assert_equal_to_openslide(slide, reader, lv, n_random=6, seed=lv)


def test_real_dicom_falls_back(real_slides_dir: Path) -> None:
    path = real_slides_dir / "dicom-bone" / "jpeg.dcm"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    with open_slide(path, backend="openslide") as slide:
        reasons = direct_levels(slide)
    assert reasons and all(r is not None and "dicom" in r for r in reasons.values())
