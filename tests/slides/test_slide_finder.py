"""The one slide finder: extensions, ids (double endings, DICOM folders), and tile / manifest folder agreeing on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.manifests.folder import build_folder_manifest
from wsi_pipeline.manifests.sources import clean_slide_ids
from wsi_pipeline.slides.finder import SLIDE_EXTENSIONS, find_slide_files, slide_id
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.sources import jobs_from_folder
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import open_store
from wsi_pipeline.config.tiling import TilingConfig

# extensions a generated Aperio-layout TIFF is a valid slide under (both readers detect TIFFs by content)
TIFF_LIKE = (".svs", ".tif", ".tiff", ".ome.tif", ".ome.tiff", ".qptiff")


def test_slide_id_rule() -> None:
    assert slide_id("a.ome.tiff") == "a" and slide_id("a.OME.TIF") == "a" and slide_id("b.tiff") == "b"
    assert slide_id("x/y/c.SVS") == "c" and slide_id("d.e.ndpi") == "d.e" and slide_id("k.isyntax") == "k"
    assert slide_id("/data/scan7/level0.dcm") == "scan7"
    with pytest.raises(ValueError, match=r"'notes.txt' is not a slide file name; expected one of the endings .svs"):
        slide_id("notes.txt")
    # every double ending outranks its tail, so the label files' id cleaning agrees with the finder
    for ext in SLIDE_EXTENSIONS:
        for other in SLIDE_EXTENSIONS:
            if ext != other and ext.endswith(other):
                assert SLIDE_EXTENSIONS.index(ext) < SLIDE_EXTENSIONS.index(other)
    names = pd.Series([f"s{i}{ext}" for i, ext in enumerate(SLIDE_EXTENSIONS) if ext != ".dcm"])
    assert list(clean_slide_ids(names)) == [slide_id(n) for n in names]


def test_tiled_folder_and_its_manifest_agree_for_every_extension(tmp_path: Path) -> None:
    folder = tmp_path / "slides"
    src = make_slide(tmp_path / "src.svs", size=320, tile_size=128, seed=3, tissue_fraction=0.7).path
    expected: dict[str, Path] = {}
    for i, ext in enumerate(SLIDE_EXTENSIONS):
        if ext == ".dcm":  # a DICOM slide is its folder
            p = folder / "dicom_scan" / "level0.dcm"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"\0" * 128 + b"DICM")
            (p.parent / "level1.dcm").write_bytes(b"\0" * 128 + b"DICM")
            expected["dicom_scan"] = p
            continue
        name = f"slide{i}{ext.upper() if i % 3 == 0 else ext}"  # endings match case-insensitively
        p = folder / ("sub" if i % 2 else "") / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if ext in TIFF_LIKE:
            shutil.copy(src, p)
        else:  # formats the generated TIFF is not: listed all the same, their rows say why they fail
            p.write_bytes(b"not a slide" * 100)
        expected[f"slide{i}"] = p
    (folder / "notes.txt").write_text("x")
    (folder / ".hidden.svs").write_bytes(b"x")

    manifest = build_folder_manifest(folder).set_index("slide_id")
    out = tmp_path / "tiles"
    rep = tile_cohort(folder, out, TilingConfig(method="greyscale", qc_mode="off", tile_size=128), workers=0, progress=False)
    report = pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id")

    assert set(manifest.index) == set(report.index) == set(expected)
    for sid, p in expected.items():
        assert Path(manifest.loc[sid, "path"]).resolve() == p.resolve() == Path(report.loc[sid, "path"]).resolve()
    ok = {r.slide_id for r in rep.results if r.status == "ok"}
    assert {f"slide{i}" for i, e in enumerate(SLIDE_EXTENSIONS) if e in TIFF_LIKE} <= ok
    for sid in ok:  # the store of a manifest row is <out>/<its slide_id>.zarr
        assert open_store(out / f"{sid}.zarr").attrs["slide_id"] == sid
    assert {j.slide_id for j in jobs_from_folder(folder)} == set(expected)


def test_finder_skips_stores_hidden_and_excluded_folders(tmp_path: Path) -> None:
    for rel in ("a.svs", "old.zarr/z.svs", ".cache/h.svs", "out/x.svs", "deep/er/b.ome.tif"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    (tmp_path / "loop").symlink_to(tmp_path, target_is_directory=True)  # a cycle is entered once
    got = find_slide_files(tmp_path, exclude=[tmp_path / "out"])
    assert [(f.slide_id, f.path.relative_to(tmp_path.resolve()).as_posix()) for f in got] == [("a", "a.svs"), ("b", "deep/er/b.ome.tif")]


def test_two_links_to_one_dicom_folder_are_two_slides_and_the_builder_warns(tmp_path: Path, capsys) -> None:
    """Linked copies are listed under their own names (the manifest warns), while a cycle still ends."""
    from wsi_pipeline.cli.main import main

    real = tmp_path / "store" / "bone"
    real.mkdir(parents=True)
    for i in range(3):
        (real / f"{i}.dcm").write_bytes(b"x")
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "bone_a").symlink_to(real, target_is_directory=True)
    (slides / "bone_b").symlink_to(real, target_is_directory=True)
    (real / "back").symlink_to(slides, target_is_directory=True)  # slides -> bone_a -> back -> slides: a cycle
    got = find_slide_files(slides)
    assert [f.slide_id for f in got] == ["bone_a", "bone_b"]
    assert main(["manifest", "folder", "--slides", str(slides), "--out", str(tmp_path / "m.csv")]) == 0
    assert "2 slide ids (bone_a, bone_b) point to the same file" in capsys.readouterr().err
