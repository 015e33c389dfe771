"""DICOM whole-slide images through wsidicom: generated pyramids (written here with pydicom) and the real file."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import cv2
import numpy as np
import openslide
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid

from wsi_pipeline.slides import SlideOpenError, open_slide
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import open_store
from wsi_pipeline.config.tiling import TilingConfig

WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"


def write_dicom_wsi(folder: Path, levels: list[np.ndarray], *, tile: int, mpp_um: float, implicit_vr: bool = False) -> list[Path]:
    """One VL whole-slide instance per level (TILED_FULL, uncompressed RGB frames, row-major tiles)."""
    folder.mkdir(parents=True, exist_ok=True)
    study, series, frame_ref = generate_uid(), generate_uid(), generate_uid()
    h0, w0 = levels[0].shape[:2]
    paths = []
    for k, img in enumerate(levels):
        h, w = img.shape[:2]
        nx, ny = -(-w // tile), -(-h // tile)
        pad = np.zeros((ny * tile, nx * tile, 3), np.uint8)
        pad[:h, :w] = img
        frames = pad.reshape(ny, tile, nx, tile, 3).transpose(0, 2, 1, 3, 4)
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = WSI_SOP_CLASS
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ImplicitVRLittleEndian if implicit_vr else ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = WSI_SOP_CLASS, meta.MediaStorageSOPInstanceUID
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series, frame_ref
        ds.Modality = "SM"
        ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"] if k == 0 else ["DERIVED", "PRIMARY", "VOLUME", "RESAMPLED"]
        ds.InstanceNumber = k + 1
        ds.Rows = ds.Columns = tile
        ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = w, h
        ds.NumberOfFrames = nx * ny
        ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
        ds.DimensionOrganizationType = "TILED_FULL"
        ds.TotalPixelMatrixFocalPlanes, ds.NumberOfOpticalPaths = 1, 1
        ds.ImagedVolumeWidth, ds.ImagedVolumeHeight, ds.ImagedVolumeDepth = w0 * mpp_um / 1000, h0 * mpp_um / 1000, 0.001
        pm = Dataset()
        spacing = mpp_um * (w0 / w) / 1000.0  # mm per px of this level
        pm.PixelSpacing, pm.SliceThickness = [spacing, spacing], 0.001
        shared = Dataset()
        shared.PixelMeasuresSequence = Sequence([pm])
        ds.SharedFunctionalGroupsSequence = Sequence([shared])
        op = Dataset()
        op.OpticalPathIdentifier = "0"
        ds.OpticalPathSequence = Sequence([op])
        ds.PixelData = np.ascontiguousarray(frames).tobytes()
        p = folder / f"level{k}.dcm"
        ds.save_as(p, enforce_file_format=True, implicit_vr=implicit_vr, little_endian=True)
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def pyramid() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    l0 = cv2.GaussianBlur(rng.integers(0, 256, (600, 1000, 3), np.uint8), (0, 0), 2)  # 1000 x 600 px
    return [l0, cv2.resize(l0, (500, 300), interpolation=cv2.INTER_AREA)]


def test_generated_pyramid_reads_exactly(tmp_path: Path, pyramid: list[np.ndarray]) -> None:
    files = write_dicom_wsi(tmp_path / "scan", pyramid, tile=128, mpp_um=0.25)
    with open_slide(files[1], "wsidicom") as s:  # any instance opens the whole slide (its folder)
        assert s.backend == "wsidicom" and s.dimensions == (1000, 600) and s.level_count == 2
        assert s.level_dimensions == ((1000, 600), (500, 300)) and s.level_downsamples == (1.0, 2.0)
        assert s.mpp == pytest.approx(0.25, rel=1e-12)
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (1000, 600)), pyramid[0])
        np.testing.assert_array_equal(s.read_region((0, 0), 1, (500, 300)), pyramid[1])
        # level-0 location (130, 66) is level-1 px (65, 33)
        np.testing.assert_array_equal(s.read_region((130, 66), 1, (70, 40)), pyramid[1][33:73, 65:135])
        # partly outside: the inside part, then the background (white)
        got = s.read_region((960, 580), 0, (100, 50))
        np.testing.assert_array_equal(got[:20, :40], pyramid[0][580:, 960:])
        assert (got[20:] == 255).all() and (got[:, 40:] == 255).all()
    with open_slide(tmp_path / "scan", "auto") as s:  # the folder itself is accepted too
        assert s.dimensions == (1000, 600)


def test_auto_falls_back_to_wsidicom_and_tiles_exactly(tmp_path: Path, pyramid: list[np.ndarray]) -> None:
    # implicit-VR little endian: a valid DICOM transfer syntax OpenSlide 4 rejects
    folder = tmp_path / "slides"
    files = write_dicom_wsi(folder / "implicit", pyramid, tile=128, mpp_um=0.25, implicit_vr=True)
    with pytest.raises(openslide.OpenSlideError):
        openslide.OpenSlide(str(files[0]))
    with open_slide(files[0]) as s:
        assert s.backend == "wsidicom"
    out = tmp_path / "tiles"
    for cfg, ref in ((TilingConfig(method="greyscale", qc_mode="off", tile_size=100, min_foreground=0.0), pyramid[0]),
                     (TilingConfig(method="greyscale", qc_mode="off", tile_size=100, min_foreground=0.0, mpp_target=0.5), pyramid[1])):
        rep = tile_cohort(folder, out / str(cfg.mpp_target), cfg, workers=0, progress=False)
        assert rep.ok and [r.slide_id for r in rep.results] == ["implicit"]
        store = open_store(out / str(cfg.mpp_target) / "implicit.zarr")
        assert store.attrs["backend"] == "wsidicom" and store.attrs["slide_mpp"] == pytest.approx(0.25)
        h, w = ref.shape[:2]
        assert len(store) == (w // 100) * (h // 100)
        step = 2 if cfg.mpp_target else 1  # level-0 px per tile px (0.5 / 0.25 um/px: level 1, no resize)
        tiles = store.read()
        for tile, (x, y) in zip(tiles, store.coords):
            lx, ly = int(x) // step, int(y) // step
            np.testing.assert_array_equal(tile, ref[ly : ly + 100, lx : lx + 100])


def test_unreadable_dicom_says_which_layouts_are_supported(tmp_path: Path) -> None:
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.7"  # secondary capture
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.SOPInstanceUID = "1.2.840.10008.5.1.4.1.1.7", ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.Rows, ds.Columns, ds.SamplesPerPixel, ds.BitsAllocated = "OT", 8, 8, 1, 8
    ds.PhotometricInterpretation, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = "MONOCHROME2", 8, 7, 0
    ds.PixelData = bytes(64)
    (tmp_path / "sc").mkdir()
    ds.save_as(tmp_path / "sc" / "photo.dcm", enforce_file_format=True)
    with pytest.raises(SlideOpenError) as e:
        open_slide(tmp_path / "sc" / "photo.dcm")
    text = str(e.value)
    assert set(e.value.reasons) == {"openslide", "wsidicom"}
    assert "SOP class 1.2.840.10008.5.1.4.1.1.7" in text and "not a whole-slide image instance" in text
    assert "supported DICOM layouts: VL Whole Slide Microscopy Image" in text and "one slide per folder" in text


@pytest.mark.real_slides
def test_real_dicom_wsidicom_equals_openslide_and_pydicom_frames(real_slides_dir: Path, tmp_path: Path) -> None:
    path = real_slides_dir / "dicom-bone" / "jpeg.dcm"
    with open_slide(path, "wsidicom") as s:
        assert s.dimensions == (957, 715) and s.mpp == pytest.approx(16.783)
        got = s.read_region((0, 0), 0, s.dimensions)
    osr = openslide.OpenSlide(str(path))
    rgba = np.asarray(osr.read_region((0, 0), 0, osr.dimensions))
    np.testing.assert_array_equal(got, rgba[..., :3])  # same JPEG frames, same libjpeg-turbo decode
    ds = pydicom.dcmread(path)
    T, (w, h) = int(ds.Rows), (int(ds.TotalPixelMatrixColumns), int(ds.TotalPixelMatrixRows))
    frames = pydicom.pixels.pixel_array(ds)  # decoded and converted YBR_FULL_422 -> RGB by pydicom
    ny, nx = -(-h // T), -(-w // T)
    full = frames.reshape(ny, nx, T, T, 3).transpose(0, 2, 1, 3, 4).reshape(ny * T, nx * T, 3)[:h, :w]
    # pydicom's YCbCr -> RGB rounds on its own (float, then truncation): at most 1 grey level apart
    assert np.abs(full.astype(np.int16) - got).max() <= 1

    # and through the tiler, wsidicom forced: the same tiles as OpenSlide's
    folder = tmp_path / "slides" / "dicom-bone"
    folder.mkdir(parents=True)
    (folder / "jpeg.dcm").symlink_to(path)
    rep = tile_cohort(folder.parent, tmp_path / "t", TilingConfig(method="greyscale", qc_mode="off", backend="wsidicom", min_foreground=0.0), workers=0, progress=False)
    store = open_store(tmp_path / "t" / "dicom-bone.zarr")
    assert rep.ok and store.attrs["backend"] == "wsidicom" and len(store) == (957 // 256) * (715 // 256)
    for tile, (x, y) in zip(store.read(), store.coords):
        np.testing.assert_array_equal(tile, rgba[y : y + 256, x : x + 256, :3])


@pytest.mark.real_slides
def test_reader_warnings_go_to_the_log(real_slides_dir: Path, caplog) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a leaked warning fails the test
        with caplog.at_level(logging.INFO, logger="wsi_pipeline.slides.opener"):
            with open_slide(real_slides_dir / "test3-DAPI-2-387.ndpi", "tiffslide") as s:
                assert s.backend == "tiffslide"
    assert "tiffslide on test3-DAPI-2-387.ndpi: hamamatsu-format metadata parsing only partially implemented" in caplog.text
