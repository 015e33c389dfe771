"""Feature files of TRIDENT, CLAM and STAMP (generated here with h5py/torch, known coordinates) read as one thing,
and ours written in TRIDENT's and STAMP's layouts (wsi_pipeline.data.feature_formats)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from wsi_pipeline.config.data import FeaturesFormat
from wsi_pipeline.data.feature_formats import (
    FEATURE_FORMATS,
    detect_format,
    feature_file,
    feature_folder,
    list_feature_files,
    read_slide_features,
    write_features,
)

RNG = np.random.default_rng(0)
FEATS = RNG.normal(size=(6, 8)).astype(np.float32)
# a 3 x 2 grid of 512-px (level 0) tiles, starting at (1024, 2048)
COORDS = np.array([[1024 + 512 * c, 2048 + 512 * r] for r in range(2) for c in range(3)], np.int64)
TRIDENT_COORD_ATTRS = {"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40.0,
                       "target_magnification": 20.0, "overlap": 0, "level0_width": 9000, "level0_height": 7000}


def trident_file(path, *, on_file=False, drop=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=FEATS)
        c = f.create_dataset("coords", data=COORDS)
        for k, v in TRIDENT_COORD_ATTRS.items():
            if k not in drop:
                (f if on_file else c).attrs[k] = v
    return path


def test_formats_listed_in_the_config_match_the_readers():
    assert tuple(FeaturesFormat.__args__) == FEATURE_FORMATS


@pytest.mark.parametrize("on_file", [False, True])
def test_trident_file_reads_with_level0_coords_and_grid(tmp_path, on_file):
    p = trident_file(tmp_path / "features_uni_v1" / "s1.h5", on_file=on_file)
    assert detect_format(p) == "trident"
    sf = read_slide_features(p)
    assert sf.format == "trident" and sf.slide_id == "s1"
    np.testing.assert_array_equal(sf.features, FEATS)
    np.testing.assert_array_equal(sf.coords, COORDS)
    assert sf.patch_size_level0 == 512 and sf.level0_size == (9000, 7000)
    # grid by hand: (x - 1024) / 512, (y - 2048) / 512
    np.testing.assert_array_equal(sf.grid, [[c, r] for r in range(2) for c in range(3)])
    assert sf.attrs["level0_size"] == [9000, 7000] and sf.tile_size == 512


def test_trident_file_without_patch_size_level0_is_refused_by_name(tmp_path):
    p = trident_file(tmp_path / "s1.h5", drop=("patch_size_level0",))
    with pytest.raises(ValueError, match=r"s1\.h5 \(TRIDENT\) lacks attribute\(s\) .*\['patch_size_level0'\]"):
        read_slide_features(p, "trident")


def test_clam_h5_and_pt_files(tmp_path):
    h5 = tmp_path / "h5_files" / "c1.h5"
    h5.parent.mkdir()
    with h5py.File(h5, "w") as f:
        f.create_dataset("features", data=FEATS)
        c = f.create_dataset("coords", data=COORDS)
        c.attrs["patch_size"], c.attrs["patch_level"] = 512, 0
    pt = tmp_path / "pt_files" / "c2.pt"
    pt.parent.mkdir()
    torch.save(torch.from_numpy(FEATS), pt)
    assert detect_format(h5) == "clam" and detect_format(pt) == "clam"
    sf = read_slide_features(h5, "clam")
    np.testing.assert_array_equal(sf.coords, COORDS)
    assert sf.patch_size_level0 == 512
    sp = read_slide_features(pt)
    np.testing.assert_array_equal(sp.features, FEATS)
    assert sp.coords is None and len(sp.grid) == 6  # features only: no coordinates
    assert feature_folder(tmp_path) == tmp_path / "h5_files"  # CLAM's output folder is looked into
    assert feature_file(tmp_path / "pt_files", "c2") == pt


def test_clam_pt_with_anything_but_a_tensor_is_refused(tmp_path):
    pt = tmp_path / "bad.pt"
    torch.save({"features": torch.zeros(2, 3), "extra": object.__name__}, pt)
    with pytest.raises(ValueError, match=r"bad\.pt \(CLAM pt_files\): holds a dict; expected the features tensor"):
        read_slide_features(pt)


def stamp_file(path, *, mpp=None, drop=(), unit="um"):
    tile_px, tile_um = 224, 256.0  # STAMP's default: 256 um tiles resized to 224 px
    with h5py.File(path, "w") as f:
        f.create_dataset("feats", data=FEATS)
        f.create_dataset("coords", data=COORDS * (tile_um / 512))  # micrometres: one 512-px tile = 256 um
        for k, v in {"extractor": "uni", "unit": unit, "tile_size_um": tile_um, "tile_size_px": tile_px}.items():
            if k not in drop:
                f.attrs[k] = v
        if mpp is not None:
            f.attrs["mpp"] = mpp
    return path


def test_stamp_coords_in_um_become_level0_px(tmp_path):
    # with the slide's mpp (0.5 um/px): px = um / 0.5, exactly the level-0 coordinates the file was made from
    sf = read_slide_features(stamp_file(tmp_path / "a.h5", mpp=0.5))
    assert sf.format == "stamp"
    np.testing.assert_array_equal(sf.coords, COORDS)
    assert sf.patch_size_level0 == pytest.approx(512)
    # the manifest's mpp when the file has none
    np.testing.assert_array_equal(read_slide_features(stamp_file(tmp_path / "b.h5"), "stamp", mpp=0.5).coords, COORDS)
    # without any mpp: level 0 is taken as the extraction resolution, px = um * tile_size_px / tile_size_um
    sf = read_slide_features(tmp_path / "b.h5")
    np.testing.assert_array_equal(sf.coords, np.rint(COORDS * (256.0 / 512) * (224 / 256.0)).astype(np.int64))
    assert sf.patch_size_level0 == pytest.approx(224)


@pytest.mark.parametrize("drop,match", [(("tile_size_um",), r"\(STAMP\) lacks attribute\(s\) \['tile_size_um'\]"),
                                        (("unit", "extractor"), r"lacks attribute\(s\) \['extractor', 'unit'\]")])
def test_stamp_file_missing_attributes_is_refused(tmp_path, drop, match):
    with pytest.raises(ValueError, match=match):
        read_slide_features(stamp_file(tmp_path / "a.h5", drop=drop))


def test_stamp_file_in_pixels_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"attribute `unit` is 'px'; expected 'um'"):
        read_slide_features(stamp_file(tmp_path / "a.h5", unit="px"))


def test_a_file_read_in_another_format_names_what_that_format_misses(tmp_path):
    p = stamp_file(tmp_path / "a.h5", mpp=0.5)
    with pytest.raises(ValueError, match=r"a\.h5 \(TRIDENT\) lacks dataset\(s\) \['features'\]; found \['coords', 'feats'\]"):
        read_slide_features(p, "trident")


def test_a_file_of_no_known_layout_names_what_it_holds(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("embeddings", data=FEATS)
    with pytest.raises(ValueError, match=r"x\.h5: no known layout \(datasets \['embeddings'\]\)"):
        read_slide_features(p)


@pytest.mark.parametrize("layout", ["trident", "stamp"])
def test_written_layouts_read_back_as_written(tmp_path, layout):
    p = write_features(tmp_path / "s.h5", layout, FEATS, COORDS, tile_size_level0=512, level0_size=(9000, 7000), mpp=0.25,
                       patch_size=256, encoder="resnet18", attrs={"encoder": "resnet18"})
    assert detect_format(p) == layout
    sf = read_slide_features(p, layout)
    np.testing.assert_array_equal(sf.features, FEATS)
    np.testing.assert_array_equal(sf.coords, COORDS)
    assert sf.patch_size_level0 == pytest.approx(512) and sf.level0_size == (9000, 7000)
    with h5py.File(p) as f:
        if layout == "trident":
            a = dict(f["coords"].attrs)
            assert {k: a[k] for k in TRIDENT_COORD_ATTRS} == {
                "patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40.0, "target_magnification": 20.0,
                "overlap": 0, "level0_width": 9000, "level0_height": 7000}
        else:
            np.testing.assert_allclose(f["coords"][:], COORDS * 0.25)  # micrometres
            assert f.attrs["unit"] == "um" and f.attrs["tile_size_um"] == 128.0 and f.attrs["tile_size_px"] == 256
            assert f.attrs["extractor"] == "resnet18"


def test_stamp_layout_without_mpp_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"s\.h5: the STAMP layout stores coordinates in micrometres and needs the slide's mpp"):
        write_features(tmp_path / "s.h5", "stamp", FEATS, COORDS, tile_size_level0=512)


def test_listing_a_trident_job_folder(tmp_path):
    trident_file(tmp_path / "job" / "features_uni_v1" / "b.h5")
    trident_file(tmp_path / "job" / "features_uni_v1" / "a.h5")
    assert [p.name for p in list_feature_files(tmp_path / "job")] == ["a.h5", "b.h5"]
    trident_file(tmp_path / "job" / "features_conch" / "a.h5")
    with pytest.raises(ValueError, match=r"has 2 TRIDENT feature folders \(features_conch, features_uni_v1\); point at one"):
        feature_folder(tmp_path / "job")
