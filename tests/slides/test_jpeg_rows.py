"""Decoding only a JPEG tile's top rows (wsi_pipeline.slides.jpeg_rows, DirectTiles.stored_tile_top).

The reference is the same decoder on the whole, unmodified stream (and, for slides, OpenSlide's
own stored-tile reads through DirectTiles, which test_direct_decode checks against read_region):
the rows the cut decode calls exact must equal the full decode's bit for bit, for every chroma
subsampling, RGB-coded and YCbCr tiles, greyscale, restart markers, widths that are not a whole
number of MCUs, and JPEGTables kept outside the tile (Aperio).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

imagecodecs = pytest.importorskip("imagecodecs")

from wsi_pipeline.slides.jpeg_rows import sequential_frame, with_height  # noqa: E402


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Colour gradients with noise and a sharp chroma edge every 8 rows (chroma upsampling differs near them)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([xx * 255 // max(w, 1), yy * 255 // max(h, 1), np.where((yy // 8) % 2, 40, 220)], -1).astype(np.int16)
    a += rng.integers(-25, 26, a.shape).astype(np.int16)
    return np.clip(a, 0, 255).astype(np.uint8)


def _pillow(img: np.ndarray, **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=85, **kw)
    return buf.getvalue()


#: name -> (encoded stream, decode function)
def _streams() -> dict[str, tuple[bytes, dict]]:
    rgb = _image(256, 256)
    odd = _image(200, 250, seed=3)  # neither side a whole number of 16 px MCUs
    cs = imagecodecs.JPEG8.CS
    return {
        "ycbcr-420": (imagecodecs.jpeg8_encode(rgb, level=85, subsampling=(2, 2)), {}),
        "ycbcr-422": (imagecodecs.jpeg8_encode(rgb, level=85, subsampling=(2, 1)), {}),
        "ycbcr-444": (imagecodecs.jpeg8_encode(rgb, level=85, subsampling=(1, 1)), {}),
        "ycbcr-420-odd-size": (imagecodecs.jpeg8_encode(odd, level=85, subsampling=(2, 2)), {}),
        "rgb-coded": (imagecodecs.jpeg8_encode(rgb, level=85, outcolorspace="rgb"), dict(colorspace=cs.RGB, outcolorspace=cs.RGB)),
        "grey": (imagecodecs.jpeg8_encode(np.ascontiguousarray(rgb[..., 1]), level=85), {}),
        "restart-markers": (_pillow(rgb, restart_marker_rows=1), {}),
        "restart-markers-420-odd": (_pillow(odd, restart_marker_blocks=3, subsampling=2), {}),
        "optimized-huffman": (imagecodecs.jpeg8_encode(rgb, level=85, optimize=True), {}),
    }


STREAMS = _streams()


@pytest.mark.parametrize("name", list(STREAMS))
def test_top_rows_equal_the_full_decode(name: str) -> None:
    data, kw = STREAMS[name]
    full = imagecodecs.jpeg8_decode(data, **kw)
    frame = sequential_frame(data)
    assert frame is not None and frame.height == full.shape[0]
    assert frame.mcu_height in (8, 16)
    for rows in (1, 7, 8, 9, 50, 103, frame.height - 2 * frame.mcu_height):
        declared, exact = frame.exact_rows(rows)
        assert exact >= rows and declared % frame.mcu_height == 0 and declared == exact + frame.mcu_height
        top = imagecodecs.jpeg8_decode(with_height(data, frame, declared), **kw)
        assert top.shape == (declared,) + full.shape[1:]
        np.testing.assert_array_equal(top[:exact], full[:exact], err_msg=f"{name}: rows < {exact} of a {declared}-row decode")


def test_mcu_height_follows_the_vertical_sampling() -> None:
    assert sequential_frame(STREAMS["ycbcr-420"][0]).mcu_height == 16
    assert sequential_frame(STREAMS["ycbcr-422"][0]).mcu_height == 8
    assert sequential_frame(STREAMS["ycbcr-444"][0]).mcu_height == 8
    assert sequential_frame(STREAMS["grey"][0]).mcu_height == 8


def test_streams_that_cannot_be_cut_are_declined() -> None:
    img = _image(64, 64)
    assert sequential_frame(_pillow(img, progressive=True)) is None  # SOF2: every scan covers the whole image
    lossless = imagecodecs.jpeg8_encode(img, lossless=True)
    assert b"\xff\xc3" in lossless and sequential_frame(lossless) is None  # SOF3, lossless
    assert sequential_frame(b"") is None
    assert sequential_frame(b"\x89PNG\r\n\x1a\n") is None
    data = STREAMS["ycbcr-420"][0]
    sos = data.index(b"\xff\xda")
    assert sequential_frame(data[:sos]) is None  # no scan: header only, or cut short
    assert sequential_frame(data[:20]) is None
    # a scan that holds only some components (a multi-scan sequential file) is declined
    broken = bytearray(data)
    broken[sos + 4] = 1
    assert sequential_frame(bytes(broken)) is None


def test_with_height_checks_its_range() -> None:
    data = STREAMS["ycbcr-444"][0]
    frame = sequential_frame(data)
    with pytest.raises(ValueError, match="height 0 outside 1..256"):
        with_height(data, frame, 0)
    with pytest.raises(ValueError, match="height 257 outside"):
        with_height(data, frame, 257)
    assert sequential_frame(with_height(data, frame, 64)).height == 64


# ------------------------------------------------------------------------ DirectTiles on slides


def _stored_tiles_top_equal(path: Path, rows: int) -> tuple[int, int]:
    """Every stored tile of level 0: stored_tile_top equals stored_tile's top rows; (cut decodes, tiles)."""
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide, cache_bytes=0) as reader:
        assert reader.supports(0), reader.reason(0)
        tw, th = reader.stored_tile_size(0)
        w, h = slide.level_dimensions[0]
        n = 0
        for r in range(-(-h // th)):
            for c in range(-(-w // tw)):
                top = reader.stored_tile_top(0, c, r, rows)
                n += 1
                if top is None:
                    continue
                full = reader.stored_tile(0, c, r)
                assert rows <= len(top) < th
                np.testing.assert_array_equal(top, full[: len(top)], err_msg=f"{path.name} stored tile ({c}, {r})")
                reader.clear_cache()
        return reader.decoded_top, n


@pytest.mark.parametrize("kw", [
    dict(compression="jpeg", photometric="rgb"),  # YCbCr 4:2:0
    dict(compression="jpeg", photometric="rgb", subsampling=(1, 1), compressionargs={"outcolorspace": "rgb"}),  # as Aperio
], ids=["ycbcr-420", "rgb-coded"])
def test_direct_reader_top_rows_on_generated_tiffs(tmp_path: Path, kw: dict) -> None:
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("openslide")
    img = _image(700, 900, seed=5)
    path = tmp_path / "s.tif"
    with tifffile.TiffWriter(path) as tw:
        tw.write(img, tile=(256, 256), metadata=None, **kw)
    cut, n = _stored_tiles_top_equal(path, 103)
    assert cut == n == 12  # every tile, edge tiles (padded past the level) included


def test_direct_reader_declines_what_it_cannot_cut(tmp_path: Path) -> None:
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("openslide")
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    img = _image(512, 512)
    lzw, jpeg = tmp_path / "lzw.tif", tmp_path / "jpeg.tif"
    tifffile.imwrite(lzw, img, tile=(256, 256), compression="lzw", photometric="rgb", metadata=None)
    tifffile.imwrite(jpeg, img, tile=(256, 256), compression="jpeg", photometric="rgb", metadata=None)
    with open_slide(lzw, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
        assert reader.supports(0) and reader.stored_tile_top(0, 0, 0, 100) is None
    with open_slide(jpeg, backend="openslide") as slide, DirectTiles.from_slide(slide, cache_bytes=0) as reader:
        assert reader.stored_tile_top(0, 0, 0, 241) is None  # 241 exact rows need all 256: nothing saved
        assert reader.decoded_top == 0
        with pytest.raises(ValueError, match="outside the 2 x 2 grid"):
            reader.stored_tile_top(0, 2, 0, 100)


def test_real_slides_top_rows(real_slides_dir: Path) -> None:
    """The real SVS (JPEGTables outside the tiles, RGB-coded or YCbCr) cut-decodes every stored tile
    of level 0 to the whole decode's rows; NDPI (restart-marker tiles behind a file header) declines."""
    svs = sorted(real_slides_dir.glob("*.svs"))
    if not svs:
        pytest.skip(f"no .svs slide in {real_slides_dir}")
    tifffile = pytest.importorskip("tifffile")
    for path in svs:
        with tifffile.TiffFile(path) as tf:
            assert tf.pages[0].jpegtables is not None  # abbreviated tile streams: the tables live in the page
        cut, n = _stored_tiles_top_equal(path, 103)
        assert cut == n, f"{path.name}: {n - cut} stored tiles were not cut"
    from wsi_pipeline.slides.direct import DirectTiles
    from wsi_pipeline.slides.opener import open_slide

    for path in sorted(real_slides_dir.glob("*.ndpi")):
        with open_slide(path, backend="openslide") as slide, DirectTiles.from_slide(slide) as reader:
            if reader.supports(0):
                assert reader.stored_tile_top(0, 0, 0, 8) is None
