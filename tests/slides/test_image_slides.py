"""Plain images as single-level slides: PNG, JPEG, BMP (Pillow) and plain TIFF (striped: tiffslide,
tiled: OpenSlide), pixels against the library's own decode; screen-resolution tags ignored."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
from PIL import Image

from wsi_pipeline.data.store import open_store
from wsi_pipeline.slides import open_slide
from wsi_pipeline.slides.finder import find_slide_files
from wsi_pipeline.slides.mpp import MAX_MICROSCOPE_MPP


def _tissue(h: int, w: int, seed: int) -> np.ndarray:
    """An RGB test image: smooth pink blobs on near-white glass plus noise (so JPEG has work to do)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    blob = np.exp(-(((xx - w * 0.45) / (w * 0.3)) ** 2 + ((yy - h * 0.5) / (h * 0.3)) ** 2))
    base = np.stack([235 - 60 * blob, 235 - 120 * blob, 240 - 50 * blob], axis=-1)
    return np.clip(base + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8)


def _pil_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("ext", [".png", ".jpg", ".jpeg", ".bmp"])
def test_pillow_formats_read_as_the_librarys_decode(tmp_path: Path, ext: str) -> None:
    img = _tissue(70, 93, seed=1)  # odd sizes
    path = tmp_path / f"im{ext}"
    Image.fromarray(img).save(path)
    ref = _pil_rgb(path)
    with open_slide(path) as s:
        assert s.backend == "pillow" and s.level_count == 1 and s.dimensions == (93, 70)
        assert s.level_downsamples == (1.0,) and s.mpp is None
        assert s.mpp_source == ("ignored-dpi:96" if ext == ".bmp" else "none")  # Pillow writes BMPs at 96 dpi
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (93, 70)), ref)
        np.testing.assert_array_equal(s.read_level(0, (11, 7), (40, 30)), ref[7:37, 11:51])
        # outside the image: the background (white), inside unchanged
        got = s.read_region((80, -5), 0, (20, 12))
        assert (got[:5] == 255).all() and (got[:, 13:] == 255).all()
        np.testing.assert_array_equal(got[5:, :13], ref[0:7, 80:93])
    if ext == ".png":  # lossless: the file's pixels themselves
        np.testing.assert_array_equal(ref, img)


def test_greyscale_palette_and_transparent_pngs(tmp_path: Path) -> None:
    img = _tissue(40, 50, seed=2)
    grey = tmp_path / "grey.png"
    Image.fromarray(img[..., 0]).save(grey)
    with open_slide(grey) as s:
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (50, 40)), np.repeat(img[..., :1], 3, axis=2))
    pal = tmp_path / "pal.png"
    Image.fromarray(img).convert("P").save(pal)
    with open_slide(pal) as s:
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (50, 40)), _pil_rgb(pal))
    rgba = np.dstack([img, np.linspace(0, 255, 50, dtype=np.uint8)[None, :].repeat(40, 0)])
    tr = tmp_path / "alpha.png"
    Image.fromarray(rgba, "RGBA").save(tr)
    a = rgba[..., 3:4] / 255.0
    expected = np.clip(np.rint(rgba[..., :3] * a + 255 * (1 - a)), 0, 255).astype(np.uint8)  # over white glass
    with open_slide(tr) as s:
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (50, 40)), expected)
    deep = tmp_path / "deep.png"
    Image.fromarray(img[..., 0].astype(np.uint16) * 257).save(deep)
    with pytest.raises(ValueError, match=r"deep.png.*pixel mode 'I;16'.*8-bit"):
        open_slide(deep)


@pytest.mark.parametrize("layout", ["striped", "tiled-zlib", "tiled-jpeg", "striped-lzw"])
def test_plain_tiffs_read_as_tifffiles_decode(tmp_path: Path, layout: str) -> None:
    img = _tissue(150, 190, seed=3)
    path = tmp_path / f"{layout}.tif"
    kw: dict = {"photometric": "rgb"}
    if layout.startswith("tiled"):
        kw.update(tile=(64, 64), compression="zlib" if layout.endswith("zlib") else "jpeg")
    elif layout.endswith("lzw"):
        kw.update(compression="lzw", rowsperstrip=16)
    tifffile.imwrite(path, img, **kw)
    ref = tifffile.imread(path)
    with open_slide(path) as s:
        assert s.level_count == 1 and s.dimensions == (190, 150)
        assert s.backend == ("openslide" if layout.startswith("tiled") else "tiffslide")  # pyramid readers unchanged
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (190, 150)), ref)
        np.testing.assert_array_equal(s.read_level(0, (61, 33), (27, 27)), ref[33:60, 61:88])


def _save(path: Path, img: np.ndarray, dpi: float) -> None:
    if path.suffix in (".tif", ".tiff"):
        tiled = "tiled" in path.stem
        tifffile.imwrite(path, img, photometric="rgb", resolution=(dpi, dpi), resolutionunit="INCH",
                         **({"tile": (64, 64)} if tiled else {}))
    else:
        Image.fromarray(img).save(path, dpi=(dpi, dpi))


@pytest.mark.parametrize("name,dpi", [("a.png", 72), ("b.png", 96), ("c.jpg", 300), ("d.bmp", 150),
                                      ("e.tif", 72), ("f_tiled.tif", 96), ("g.tiff", 300)])
def test_screen_dpi_is_never_the_slides_mpp(tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, dpi: int) -> None:
    path = tmp_path / name
    _save(path, _tissue(64, 64, seed=4), dpi)
    caplog.set_level(logging.WARNING)
    for _ in range(3):  # opened three times (plan, tile, QC ...): one warning
        with open_slide(path) as s:
            assert s.mpp is None
            assert s.mpp_source == f"ignored-dpi:{dpi}"
            assert 25400 / dpi > MAX_MICROSCOPE_MPP
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    said = warnings[0].getMessage()
    assert f"({dpi} dpi)" in said
    um = float(said.split(" says ")[1].split(" um/px")[0])  # PNG stores px per metre: 72 dpi is 352.73 um/px there
    assert um == pytest.approx(25400 / dpi, rel=2e-3)


def test_a_microscope_resolution_tag_is_kept(tmp_path: Path) -> None:
    img = _tissue(64, 64, seed=5)
    tif = tmp_path / "m.tif"
    tifffile.imwrite(tif, img, photometric="rgb", tile=(64, 64), resolution=(1e4 / 0.5, 1e4 / 0.5), resolutionunit="CENTIMETER")
    with open_slide(tif) as s:
        assert s.mpp == pytest.approx(0.5) and s.mpp_source == "tiff-tag"
    png = tmp_path / "m.png"
    Image.fromarray(img).save(png, dpi=(25400 / 0.25, 25400 / 0.25))  # pHYs in px per metre: 4e6
    with open_slide(png) as s:
        assert s.mpp == pytest.approx(0.25, rel=1e-3) and s.mpp_source == "image-tag"


def _png_folder(root: Path, n: int = 3) -> dict[str, np.ndarray]:
    root.mkdir(parents=True)
    imgs = {}
    for i in range(n):
        img = _tissue(96 + 16 * i, 112, seed=10 + i)
        Image.fromarray(img).save(root / f"img{i + 1}.png", dpi=(96, 96))
        imgs[f"img{i + 1}"] = img
    return imgs


def test_manifest_folder_and_tile_over_a_folder_of_pngs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from wsi_pipeline.cli.main import main

    imgs = _png_folder(tmp_path / "images")
    (tmp_path / "images" / "notes.txt").write_text("not an image")
    assert [f.slide_id for f in find_slide_files(tmp_path / "images")] == ["img1", "img2", "img3"]
    pd.DataFrame({"slide_id": ["img1", "img2", "img3"], "label": [0, 1, 0], "mpp": [0.5, 0.5, ""]}).to_csv(
        tmp_path / "labels.csv", index=False)
    manifest = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(tmp_path / "images"), "--labels", str(tmp_path / "labels.csv"),
                 "--out", str(manifest)]) == 0
    m = pd.read_csv(manifest).set_index("slide_id")
    assert list(m.index) == ["img1", "img2", "img3"] and list(m["label"]) == [0, 1, 0]
    caplog.set_level(logging.WARNING)
    out = tmp_path / "tiles"
    assert main(["tile", "--manifest", str(manifest), "--out", str(out), "--tile-size", "32", "--workers", "0",
                 "--method", "greyscale", "--qc", "off", "--min-foreground", "0"]) == 0
    report = pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id")
    assert list(report["status"]) == ["ok"] * 3
    assert report.loc["img1", "mpp_source"] == "manifest" and report.loc["img3", "mpp_source"] == "ignored-dpi:96"
    for sid, img in imgs.items():
        st = open_store(out / f"{sid}.zarr")
        h, w = img.shape[:2]
        assert len(st) == (h // 32) * (w // 32)  # every full tile (min-foreground 0)
        tiles = st.read()
        for k, (x, y) in enumerate(st.coords):
            np.testing.assert_array_equal(tiles[k], img[y : y + 32, x : x + 32])
        assert st.attrs["backend"] == "pillow" and st.attrs["metadata_mpp_source"] == "ignored-dpi:96"
        assert st.attrs["mpp_source"] == ("ignored-dpi:96" if sid == "img3" else "manifest")
    # the ignored tag is named once per slide, with its value
    for sid in imgs:
        said = [r for r in caplog.records if f"{sid}.png" in r.getMessage() and "96 dpi" in r.getMessage()]
        assert len(said) == 1
    # --mpp fills in the slides whose tag was ignored (the store is rebuilt: its mpp depended on the fallback)
    assert main(["tile", "--slides", str(tmp_path / "images"), "--out", str(tmp_path / "t2"), "--tile-size", "32",
                 "--workers", "0", "--method", "greyscale", "--qc", "off", "--mpp", "0.5"]) == 0
    r2 = pd.read_csv(tmp_path / "t2" / "tiling_report.csv", keep_default_na=False)
    assert set(r2["mpp_source"]) == {"run-fallback"} and set(r2["slide_mpp"]) == {0.5}
