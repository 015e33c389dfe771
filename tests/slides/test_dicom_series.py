"""DICOM files become slides by series: a single-file DICOM among other slides keeps its own id."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wsi_pipeline.slides.dicom import dicom_files, series_uid
from wsi_pipeline.slides.finder import find_slide_files



@pytest.fixture
def dcm(real_slides_dir: Path) -> Path:
    """The real single-file DICOM WSI of ../shared/slides (skips without it)."""
    return real_slides_dir / "dicom-bone" / "jpeg.dcm"


def _other_series(src: Path, dest: Path) -> Path:
    """A copy of a DICOM file under a new SeriesInstanceUID (another slide)."""
    import pydicom
    from pydicom.uid import generate_uid

    ds = pydicom.dcmread(str(src))
    ds.SeriesInstanceUID = generate_uid()
    ds.save_as(str(dest))
    return dest


def test_a_single_file_dicom_among_other_slides_keeps_its_own_id(tmp_path, dcm):
    mixed = tmp_path / "cohort"
    mixed.mkdir()
    shutil.copy(dcm, mixed / "bone.dcm")
    (mixed / "other.svs").write_bytes(b"x")  # any other slide file
    ids = {f.slide_id: f.path.name for f in find_slide_files(tmp_path)}
    assert ids == {"bone": "bone.dcm", "other": "other.svs"}  # not "cohort" (the folder's name)


def test_a_dicom_folder_of_one_series_is_one_slide_named_after_the_folder(tmp_path, dcm):
    folder = tmp_path / "case7"
    folder.mkdir()
    shutil.copy(dcm, folder / "level0.dcm")
    shutil.copy(dcm, folder / "level1.dcm")  # same series: the levels of one slide
    assert [(f.slide_id, f.path.name) for f in find_slide_files(tmp_path)] == [("case7", "level0.dcm")]
    # the same file directly in the folder searched: named after the file, not the folder searched
    assert [f.slide_id for f in find_slide_files(folder)] == ["level0"]


def test_two_series_in_one_folder_are_two_slides_each_opened_alone(tmp_path, dcm):
    from wsi_pipeline.slides import open_slide

    folder = tmp_path / "scans"
    folder.mkdir()
    shutil.copy(dcm, folder / "a.dcm")
    _other_series(dcm, folder / "b.dcm")
    assert series_uid(folder / "a.dcm") != series_uid(folder / "b.dcm")
    found = find_slide_files(tmp_path)
    assert [(f.slide_id, f.path.name) for f in found] == [("a", "a.dcm"), ("b", "b.dcm")]
    assert dicom_files(folder / "b.dcm") == [folder / "b.dcm"]
    with open_slide(folder / "a.dcm") as s, open_slide(dcm) as ref:
        assert s.dimensions == ref.dimensions
        assert (s.read_region((0, 0), 0, (64, 64)) == ref.read_region((0, 0), 0, (64, 64))).all()


def test_unreadable_dcm_files_of_a_folder_stay_one_slide(tmp_path):
    folder = tmp_path / "dicom_slide"
    folder.mkdir()
    for name in ("1.dcm", "2.dcm"):
        (folder / name).write_bytes(b"not dicom")
    assert [(f.slide_id, f.path.name) for f in find_slide_files(tmp_path)] == [("dicom_slide", "1.dcm")]
