"""Manifest builders: the real cohort files (../shared/cohorts, skipped without them) and small
synthetic label files written here for the error cases."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.cli.main import main
from wsi_pipeline.manifests import ManifestError, read_manifest
from wsi_pipeline.manifests.camelyon import build_camelyon16_manifest, build_camelyon17_manifest, pn_stage
from wsi_pipeline.manifests.folder import build_folder_manifest
from wsi_pipeline.manifests.panda import build_panda_manifest
from wsi_pipeline.manifests.sources import ManifestWarning
from wsi_pipeline.manifests.splits import grouped_split, quota_counts, stratified_split
from wsi_pipeline.manifests.tcga import build_tcga_prad_manifest, gleason_to_isup

FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}


def _write(path: Path, rows: list[dict] | pd.DataFrame, header: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False, header=header)
    return path


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


# ----------------------------------------------------------------------------------------------
# real cohort files
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def panda_files(cohorts_dir):
    d = cohorts_dir / "panda"
    return d / "kaggle_train_5kfold.csv", d / "train_with_noise_flags.csv", d / "panther"


def test_panda_paper_split_matches_the_published_files(panda_files, tmp_path):
    labels, noise, splits = panda_files
    df = build_panda_manifest(labels, tmp_path, noise_csv=noise, splits_dir=splits, check_files=False)
    assert df["split"].value_counts().to_dict() == {"train": 7647, "val": 954, "test": 954}
    # labels equal the challenge's isup_grade, read here with the csv module
    with open(labels, newline="") as f:
        grade = {r["image_id"]: int(r["isup_grade"]) for r in csv.DictReader(f)}
    assert all(grade[s] == lab for s, lab in zip(df["slide_id"], df["label"]))
    # membership equals the three published files, and the union is the slides flagged clean
    for split in ("train", "val", "test"):
        with open(splits / f"{split}.csv", newline="") as f:
            assert set(df.loc[df["split"] == split, "slide_id"]) == {r["FILENAME"] for r in csv.DictReader(f)}
    with open(noise, newline="") as f:
        clean = {r["image_id"] for r in csv.DictReader(f) if r["noise_ratio_10"] == "1"}
    assert set(df["slide_id"]) == clean
    train = df[df["split"] == "train"]
    assert [int((train["label"] == g).sum()) for g in range(6)] == [2083, 1919, 967, 896, 900, 882]
    assert (df["path"] == [str(tmp_path.absolute() / f"{s}.tiff") for s in df["slide_id"]]).all()


def test_panda_seeded_stratified_split(panda_files, tmp_path):
    labels, noise, _ = panda_files
    a = build_panda_manifest(labels, tmp_path, noise_csv=noise, split_seed=3, check_files=False)
    b = build_panda_manifest(labels, tmp_path, noise_csv=noise, split_seed=3, check_files=False)
    c = build_panda_manifest(labels, tmp_path, noise_csv=noise, split_seed=4, check_files=False)
    assert len(a) == 9555
    pd.testing.assert_frame_equal(a, b)
    assert (a["split"] != c["split"]).sum() > 100
    for df in (a, c):
        for grade, rows in df.groupby("label"):
            for split, f in FRACTIONS.items():
                assert abs((rows["split"] == split).sum() - f * len(rows)) < 1, (grade, split)
    # the split depends on the set of slides and the seed, not on the row order of train.csv
    shuffled = pd.read_csv(labels).sample(frac=1.0, random_state=0)
    d = build_panda_manifest(_write(tmp_path / "shuffled.csv", shuffled), tmp_path, noise_csv=noise, split_seed=3,
                             check_files=False)
    assert d.set_index("slide_id")["split"].loc[a["slide_id"]].tolist() == a["split"].tolist()


def test_panda_missing_slide_files_are_counted(panda_files, tmp_path):
    labels, noise, splits = panda_files
    some = pd.read_csv(splits / "test.csv")["FILENAME"].head(4)
    for s in some:
        _touch(tmp_path / f"{s}.tiff")
    with pytest.raises(FileNotFoundError, match=r"9551 of 9555 slide files not found under .*first few: .*--no-check-files"):
        build_panda_manifest(labels, tmp_path, noise_csv=noise, splits_dir=splits)


def test_panda_cli_writes_a_readable_manifest(panda_files, tmp_path, capsys):
    labels, noise, splits = panda_files
    out = tmp_path / "m" / "panda.csv"
    rc = main(["manifest", "panda", "--labels", str(labels), "--exclude-noisy", str(noise), "--splits", str(splits),
               "--slides", str(tmp_path), "--out", str(out), "--no-check-files"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "7647" in text and "954" in text
    df = read_manifest(out, n_classes=6)
    assert len(df) == 9555 and set(df["cohort"]) == {"panda"}
    rc = main(["manifest", "panda", "--labels", str(labels), "--slides", str(tmp_path / "none"), "--out", str(out)])
    assert rc == 2
    assert "10616 of 10616 slide files not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def c16_files(cohorts_dir):
    d = cohorts_dir / "camelyon16"
    return d / "reference.csv", d / "flamby_labels.csv"


def test_camelyon16_reference_wins(c16_files, tmp_path):
    ref, labels = c16_files
    with pytest.warns(ManifestWarning, match=r"test_114: .*normal.*reference.*tumour"):
        df = build_camelyon16_manifest(ref, labels, tmp_path, check_files=False)
    assert len(df) == 399
    counts = df.groupby(["split", "label"]).size().to_dict()
    assert counts == {("test", 0): 80, ("test", 1): 49, ("train", 0): 159, ("train", 1): 111}
    reference = pd.read_csv(ref, header=None, names=["slide", "cls", "type", "size"])
    truth = dict(zip(reference["slide"], (reference["cls"] == "Tumor").astype(int)))
    test = df[df["split"] == "test"]
    assert {s: int(v) for s, v in zip(test["slide_id"], test["label"])} == truth
    assert df.set_index("slide_id").loc["test_114", "label"] == 1
    assert "test_049" not in set(df["slide_id"])  # neither file labels it
    train = df[df["split"] == "train"]
    assert (train["label"] == train["slide_id"].str.startswith("tumor_").astype(int)).all()


@pytest.mark.filterwarnings("ignore:test_114")
def test_camelyon16_finds_files_in_the_official_layout(c16_files, tmp_path):
    ref, labels = c16_files
    names = pd.read_csv(labels)["filenames"].str.replace(".tif.npy", "", regex=False)
    for s in names:
        sub = "testing/images" if s.startswith("test_") else f"training/{s.split('_')[0]}"
        _touch(tmp_path / sub / f"{s}.tif")
    _touch(tmp_path / "testing" / "images" / "test_049.tif")
    with pytest.warns(ManifestWarning, match=r"no label and are not in the manifest: test_049"):
        df = build_camelyon16_manifest(ref, labels, tmp_path)
    paths = df.set_index("slide_id")["path"]
    assert paths["tumor_001"] == str(tmp_path / "training" / "tumor" / "tumor_001.tif")
    assert paths["test_114"] == str(tmp_path / "testing" / "images" / "test_114.tif")


def test_camelyon17_patients_and_binary_rule(cohorts_dir, tmp_path):
    stage = cohorts_dir / "camelyon17" / "stage_labels.csv"
    raw = pd.read_csv(stage)
    slides = raw[raw["patient"].str.endswith(".tif")]
    node = dict(zip(slides["patient"].str[:-4], slides["stage"]))
    df = build_camelyon17_manifest(stage, tmp_path, check_files=False)
    assert len(df) == 500 and df["patient_id"].nunique() == 100
    assert (df["patient_id"] == [s.rsplit("_node_", 1)[0] for s in df["slide_id"]]).all()
    assert (df.groupby("patient_id")["split"].nunique() == 1).all()
    assert df.loc[df["split"] == "val", "patient_id"].nunique() == 10
    assert (df["label"] == [int(node[s] != "negative") for s in df["slide_id"]]).all()
    macro = build_camelyon17_manifest(stage, tmp_path, positive="macro", check_files=False)
    assert (macro["label"] == [int(node[s] == "macro") for s in macro["slide_id"]]).all()
    other = build_camelyon17_manifest(stage, tmp_path, split_seed=1, check_files=False)
    same = build_camelyon17_manifest(stage, tmp_path, check_files=False)
    assert (same["split"] == df["split"]).all() and (other["split"] != df["split"]).any()
    # every patient's published pN stage follows from its slides under the CAMELYON17 rules
    zips = raw[raw["patient"].str.endswith(".zip")]
    patients = pd.Series(zips["stage"].to_numpy(), index=zips["patient"].str[:-4])
    implied = df.groupby("patient_id")["node_stage"].agg(pn_stage)
    assert (implied.to_numpy() == patients.loc[implied.index].to_numpy()).all()  # index names differ (pandas 2 compares them)


# ----------------------------------------------------------------------------------------------
# synthetic label files: PANDA
# ----------------------------------------------------------------------------------------------


@pytest.fixture()
def small_panda(tmp_path):
    rng = np.random.default_rng(0)
    ids = [f"s{i:03d}" for i in range(60)]
    grades = np.arange(60) % 6
    labels = _write(tmp_path / "train.csv", {"image_id": ids, "data_provider": "x", "isup_grade": grades,
                                              "gleason_score": "3+3"})
    flags = (rng.random(60) > 0.2).astype(int)
    noise = _write(tmp_path / "noise.csv", {"image_id": ids, "isup_grade": grades, "noise_ratio_10": flags})
    kept = [s for s, f in zip(ids, flags) if f]
    split_dir = tmp_path / "splits"
    parts = {"train": kept[: len(kept) - 10], "val": kept[-10:-5], "test": kept[-5:]}
    for name, members in parts.items():
        _write(split_dir / f"{name}.csv", {"FILENAME": members, "isup_grade": [int(s[1:]) % 6 for s in members],
                                           "PATIENT": members})
    return tmp_path, labels, noise, split_dir, parts


def test_panda_small_split_and_extra_columns(small_panda):
    root, labels, noise, split_dir, parts = small_panda
    df = build_panda_manifest(labels, root, noise_csv=noise, splits_dir=split_dir, check_files=False)
    for name, members in parts.items():
        assert set(df.loc[df["split"] == name, "slide_id"]) == set(members)
    assert {"data_provider", "gleason_score", "patient_id"} <= set(df.columns)


def test_panda_errors(small_panda):
    root, labels, noise, split_dir, parts = small_panda
    frame = pd.read_csv(labels)
    dup = _write(root / "dup.csv", pd.concat([frame, frame.head(1)]))
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) s000"):
        build_panda_manifest(dup, root, check_files=False)
    high = _write(root / "high.csv", frame.assign(isup_grade=frame["isup_grade"].where(frame.index != 3, 6)))
    with pytest.raises(ManifestError, match=r"label out of range \[0, 6\).*s003"):
        build_panda_manifest(high, root, check_files=False)
    two = root / "two"
    for name in ("train", "val", "test"):
        members = parts[name] + (parts["train"][:1] if name == "test" else [])
        _write(two / f"{name}.csv", {"image_id": members})
    with pytest.raises(ManifestError, match=rf"in more than one split: {parts['train'][0]} \(test.csv and train.csv\)"):
        build_panda_manifest(labels, root, noise_csv=noise, splits_dir=two, check_files=False)
    leak = root / "leak"
    for name in ("train", "val", "test"):
        _write(leak / f"{name}.csv", {"image_id": parts[name], "PATIENT": ["p0"] * len(parts[name])})
    with pytest.raises(ManifestError, match=r"patient\(s\) in more than one split.*p0 \(test and train and val\)"):
        build_panda_manifest(labels, root, noise_csv=noise, splits_dir=leak, check_files=False)
    short = _write(root / "short_noise.csv", pd.read_csv(noise).iloc[2:])
    with pytest.raises(ManifestError, match=r"no noise flag for 2 of 60 labelled slide\(s\): s000, s001"):
        build_panda_manifest(labels, root, noise_csv=short, check_files=False)
    with pytest.raises(ManifestError, match=r"flagged noisy"):
        build_panda_manifest(labels, root, noise_csv=_write(root / "all_noisy.csv", pd.read_csv(noise).assign(noise_ratio_10=0)),
                             splits_dir=split_dir, check_files=False)
    with pytest.warns(ManifestWarning, match=r"in none of the split files.*pass the noise-flag file"):
        build_panda_manifest(labels, root, splits_dir=split_dir, check_files=False)
    with pytest.raises(FileNotFoundError, match=r"missing \['val.csv'\]"):
        (split_dir / "val.csv").unlink()
        build_panda_manifest(labels, root, splits_dir=split_dir, check_files=False)
    for s in ("s000", "s001"):
        _touch(root / "slides" / f"{s}.tiff")
    with pytest.raises(FileNotFoundError, match=r"58 of 60 slide files not found under .*slides \(first few: s002 -> "):
        build_panda_manifest(labels, root / "slides")


# ----------------------------------------------------------------------------------------------
# synthetic label files: CAMELYON16 / 17
# ----------------------------------------------------------------------------------------------


def test_camelyon16_errors(tmp_path):
    ref = _write(tmp_path / "ref.csv", [["test_001", "Tumor", "IDC", "Macro"], ["test_002", "Normal", "", "None"]], header=False)
    good = {"filenames": ["normal_001.tif.npy", "tumor_001.tif.npy", "test_001.tif.npy"], "tumor": [False, True, True]}
    df = build_camelyon16_manifest(ref, _write(tmp_path / "l.csv", good), tmp_path, check_files=False)
    assert df.set_index("slide_id")["metastasis"].to_dict() == {"normal_001": "", "tumor_001": "", "test_001": "macro", "test_002": ""}
    dup = {"filenames": good["filenames"] + ["tumor_001.tif.npy"], "tumor": good["tumor"] + [True]}
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) tumor_001"):
        build_camelyon16_manifest(ref, _write(tmp_path / "d.csv", dup), tmp_path, check_files=False)
    with pytest.raises(ManifestError, match=r"label out of range in column tumor for slide\(s\) tumor_001 \(values maybe\)"):
        build_camelyon16_manifest(ref, _write(tmp_path / "o.csv", {**good, "tumor": ["False", "maybe", "True"]}), tmp_path,
                                  check_files=False)
    with pytest.raises(ManifestError, match=r"label contradicts the slide name for normal_001"):
        build_camelyon16_manifest(ref, _write(tmp_path / "c.csv", {**good, "tumor": [True, True, True]}), tmp_path,
                                  check_files=False)
    with pytest.raises(ManifestError, match=r"slide name\(s\) slide_9 are not CAMELYON16 names"):
        build_camelyon16_manifest(ref, _write(tmp_path / "n.csv", {"filenames": ["slide_9.tif"], "tumor": [True]}), tmp_path,
                                  check_files=False)
    ref_dup = _write(tmp_path / "rd.csv", [["test_001", "Tumor"], ["test_001", "Normal"]], header=False)
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) test_001"):
        build_camelyon16_manifest(ref_dup, _write(tmp_path / "l.csv", good), tmp_path, check_files=False)
    with pytest.warns(ManifestWarning, match=r"no label in the official reference and are left out: test_003"):
        build_camelyon16_manifest(ref, _write(tmp_path / "x.csv", {"filenames": ["test_003.tif"], "tumor": [True]}), tmp_path,
                                  check_files=False)


def _stage_rows(stages: dict[str, list[str]], pn: dict[str, str] | None = None) -> list[dict]:
    rows = []
    for p, nodes in stages.items():
        rows.append({"patient": f"{p}.zip", "stage": (pn or {}).get(p) or pn_stage(nodes)})
        rows += [{"patient": f"{p}_node_{i}.tif", "stage": s} for i, s in enumerate(nodes)]
    return rows


def test_camelyon17_errors(tmp_path):
    stages = {f"patient_{i:03d}": ["negative", "itc", "micro", "macro", "negative"][: 1 + i % 5] for i in range(20)}
    path = _write(tmp_path / "s.csv", _stage_rows(stages))
    df = build_camelyon17_manifest(path, tmp_path, val_fraction=0.2, check_files=False)
    assert df.loc[df["split"] == "val", "patient_id"].nunique() == 4
    # patients 100-199 are CAMELYON17's official test set: never in train/val
    with_test = _write(tmp_path / "t.csv", _stage_rows({**stages, "patient_100": ["macro", "negative"], "patient_150": ["itc"]}))
    df = build_camelyon17_manifest(with_test, tmp_path, val_fraction=0.2, check_files=False)
    assert set(df.loc[df["split"] == "test", "patient_id"]) == {"patient_100", "patient_150"}
    assert df.loc[df["split"] == "val", "patient_id"].nunique() == 4
    dup = _stage_rows(stages) + [{"patient": "patient_001_node_0.tif", "stage": "negative"}]
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) patient_001_node_0"):
        build_camelyon17_manifest(_write(tmp_path / "d.csv", dup), tmp_path, check_files=False)
    bad = _stage_rows({"patient_000": ["negative", "huge"]}, pn={"patient_000": "pN1"})
    with pytest.raises(ManifestError, match=r"label out of range \(stage\) for slide\(s\) patient_000_node_1 \(values huge\)"):
        build_camelyon17_manifest(_write(tmp_path / "b.csv", bad), tmp_path, check_files=False)
    with pytest.raises(ValueError, match=r"positive='micro,huge'.*found \['huge'\]"):
        build_camelyon17_manifest(path, tmp_path, positive="micro,huge", check_files=False)
    with pytest.raises(ValueError, match=r"val_fraction=1.0"):
        build_camelyon17_manifest(path, tmp_path, val_fraction=1.0, check_files=False)
    wrong = _write(tmp_path / "w.csv", _stage_rows({"patient_000": ["macro"]}, pn={"patient_000": "pN0"}))
    with pytest.warns(ManifestWarning, match=r"patient_000 \(pN0 vs pN1\)"):
        build_camelyon17_manifest(wrong, tmp_path, check_files=False)


# ----------------------------------------------------------------------------------------------
# TCGA-PRAD
# ----------------------------------------------------------------------------------------------

# ISUP grade groups (Epstein et al. 2016), written out as a table
ISUP_TABLE = {(0, 0): 0, (3, 3): 1, (2, 4): 1, (3, 4): 2, (4, 3): 3, (4, 4): 4, (3, 5): 4, (5, 3): 4,
              (4, 5): 5, (5, 4): 5, (5, 5): 5}


def test_tcga_prad_external_cohort(tmp_path):
    assert {k: gleason_to_isup(*k) for k in ISUP_TABLE} == ISUP_TABLE
    ids = ["TCGA-2A-A8VL-01Z-00-DX1", "TCGA-2A-A8VL-01Z-00-DX2", "TCGA-EJ-7115-01Z-00-DX1"]
    for s in ids:
        _touch(tmp_path / "slides" / "sub" / f"{s}.0A1B2C3D-uuid.svs")
    csv_path = _write(tmp_path / "tcga.csv", {"slide_id": ids, "gleason_score": ["4+3", "3+4", "5+5"], "age": [60, 60, 70]})
    df = build_tcga_prad_manifest(csv_path, tmp_path / "slides")
    assert df["label"].tolist() == [3, 2, 5]
    assert set(df["split"]) == {"test"} and set(df["cohort"]) == {"tcga_prad"}
    assert df["patient_id"].tolist() == ["TCGA-2A-A8VL", "TCGA-2A-A8VL", "TCGA-EJ-7115"]
    assert df["path"].tolist() == [str(tmp_path / "slides" / "sub" / f"{s}.0A1B2C3D-uuid.svs") for s in ids]
    assert df["age"].tolist() == ["60", "60", "70"]
    one = build_tcga_prad_manifest(csv_path, tmp_path / "slides", one_per_patient=True, seed=1)
    assert sorted(one["patient_id"]) == ["TCGA-2A-A8VL", "TCGA-EJ-7115"]
    with pytest.raises(ManifestError, match=r"label out of range \[0, 6\) in column isup_grade.*TCGA-EJ-7115-01Z-00-DX1 \(values 7\)"):
        build_tcga_prad_manifest(_write(tmp_path / "o.csv", {"slide_id": ids, "isup_grade": [1, 2, 7]}), tmp_path,
                                 check_files=False)
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) TCGA-2A-A8VL-01Z-00-DX1"):
        build_tcga_prad_manifest(_write(tmp_path / "d.csv", {"slide_id": ids + ids[:1], "isup_grade": [1, 2, 3, 1]}), tmp_path,
                                 check_files=False)
    with pytest.raises(ManifestError, match=r"slide TCGA-2A-A8VL-01Z-00-DX2: cannot read a Gleason score"):
        build_tcga_prad_manifest(_write(tmp_path / "g.csv", {"slide_id": ids, "gleason_score": ["3+3", "4+x", "3+4"]}), tmp_path,
                                 check_files=False)
    with pytest.raises(ValueError, match=r"no grade column; expected one of"):
        build_tcga_prad_manifest(_write(tmp_path / "n.csv", {"slide_id": ids}), tmp_path, check_files=False)
    with pytest.raises(FileNotFoundError, match=r"1 of 1 slide files not found"):
        build_tcga_prad_manifest(_write(tmp_path / "m.csv", {"slide_id": ["TCGA-XX-0000-01Z"], "isup_grade": [1]}), tmp_path / "slides")


# ----------------------------------------------------------------------------------------------
# folder
# ----------------------------------------------------------------------------------------------


def test_folder_builder(tmp_path, capsys):
    root = tmp_path / "my_cohort"
    for rel in ("a/x.svs", "b/deep/y.NDPI", "z.tiff", "notes.txt", "a/.hidden.svs", "dicom_slide/1.dcm", "dicom_slide/2.dcm"):
        _touch(root / rel)
    df = build_folder_manifest(root)
    assert sorted(df["slide_id"]) == ["dicom_slide", "x", "y", "z"]
    assert df["label"].isna().all() and set(df["cohort"]) == {"my_cohort"} and set(df["split"]) == {""}
    assert df.set_index("slide_id")["path"]["dicom_slide"] == str(root / "dicom_slide" / "1.dcm")
    labels = _write(tmp_path / "labels.csv", {"slide_id": ["x.svs", "z", "w"], "label": [1, 0, 1], "split": ["train", "test", "val"],
                                              "patient_id": ["p1", "p2", "p3"], "stain": ["he", "he", "he"]})
    with pytest.warns(ManifestWarning, match=r"1 labelled slide\(s\) have no file .* w"):
        df = build_folder_manifest(root, labels)
    by = df.set_index("slide_id")
    assert by.loc["x", "label"] == 1 and by.loc["z", "label"] == 0 and pd.isna(by.loc["y", "label"])
    assert by.loc["x", "split"] == "train" and by.loc["y", "split"] == "" and by.loc["z", "stain"] == "he"
    out = tmp_path / "out.csv"
    assert main(["manifest", "folder", "--slides", str(root), "--labels", str(labels), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "unlabelled" in captured.out and "warning: " in captured.err
    assert read_manifest(out)["path"].map(lambda p: Path(p).is_file()).all()


def test_folder_builder_errors(tmp_path):
    root = tmp_path / "slides"
    for rel in ("a/x.svs", "b/y.svs"):
        _touch(root / rel)
    base = {"slide_id": ["x", "y"], "label": [0, 1], "split": ["train", "val"], "patient_id": ["p1", "p2"]}
    with pytest.raises(ManifestError, match=r"duplicate slide id\(s\) x"):
        build_folder_manifest(root, _write(tmp_path / "d.csv", {k: v + v[:1] for k, v in base.items()}))
    with pytest.raises(ManifestError, match=r"in more than one split: x \(test and train\)"):
        build_folder_manifest(root, _write(tmp_path / "s.csv", {k: v + (["test"] if k == "split" else v[:1]) for k, v in base.items()}))
    with pytest.raises(ManifestError, match=r"patient\(s\) in more than one split.*p1 \(train and val\)"):
        build_folder_manifest(root, _write(tmp_path / "p.csv", {**base, "patient_id": ["p1", "p1"]}))
    with pytest.raises(ManifestError, match=r"label out of range >= 0 .* y \(values -1\)"):
        build_folder_manifest(root, _write(tmp_path / "o.csv", {**base, "label": [0, -1]}))
    with pytest.raises(ManifestError, match=r"must hold integer classes; slide\(s\) x have 0.5"):
        build_folder_manifest(root, _write(tmp_path / "f.csv", {**base, "label": [0.5, 1]}))
    with pytest.raises(ManifestError, match=r"split must be one of"):
        build_folder_manifest(root, _write(tmp_path / "v.csv", {**base, "split": ["train", "validation"]}))
    with pytest.raises(ValueError, match=r"no label column; expected one of \['label'\]"):
        build_folder_manifest(root, _write(tmp_path / "n.csv", {"slide_id": ["x"]}))
    _touch(root / "c" / "x.tif")
    with pytest.raises(ManifestError, match=r"occur more than once.*x: .*a/x.svs, .*c/x.tif"):
        build_folder_manifest(root)
    with pytest.raises(ManifestError, match=r"no slide files under .*empty \(looked for the endings \.svs .*\.ome\.tiff .*\.dcm.*readme\.txt"):
        build_folder_manifest(_touch(tmp_path / "empty" / "readme.txt").parent)
    with pytest.raises(FileNotFoundError, match=r"slides folder not found"):
        build_folder_manifest(tmp_path / "nope")


# ----------------------------------------------------------------------------------------------
# splits
# ----------------------------------------------------------------------------------------------


def test_quota_counts_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(2, 5))
        fr = dict(zip("abcd", rng.dirichlet(np.ones(k))))
        sizes = rng.integers(0, 50, int(rng.integers(1, 10)))
        counts = quota_counts(sizes, fr)
        exact = np.outer(sizes, list(fr.values()))
        assert (counts.sum(1) == sizes).all()
        assert ((counts == np.floor(exact)) | (counts == np.ceil(exact))).all()
        assert (np.abs(counts.sum(0) - exact.sum(0)) < 1.5).all()


def test_stratified_and_grouped_split():
    rng = np.random.default_rng(1)
    keys = [f"k{i}" for i in range(200)]
    strata = rng.integers(0, 4, 200)
    split = stratified_split(keys, strata, FRACTIONS, seed=0)
    for s in range(4):
        for name, f in FRACTIONS.items():
            assert abs(((strata == s) & (split == name)).sum() - f * (strata == s).sum()) < 1
    groups = [f"p{int(i) // 5}" for i in rng.permutation(200)]
    g = grouped_split(keys, groups, {"train": 0.9, "val": 0.1}, seed=2)
    per = pd.DataFrame({"g": groups, "s": g}).groupby("g")["s"]
    assert (per.nunique() == 1).all() and (per.first() == "val").sum() == 4
    with pytest.raises(ValueError, match=r"fractions must sum to 1"):
        stratified_split(keys, strata, {"train": 0.8, "val": 0.1}, seed=0)


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------


def test_merge_internal_and_external(tmp_path):
    from wsi_pipeline.manifests.merge import merge_manifests

    internal = _write(tmp_path / "a" / "internal.csv", {"slide_id": ["i1", "i2", "i3"], "path": ["s/i1.svs", "s/i2.svs", "s/i3.svs"],
                                                        "label": [0, 1, 0], "split": ["train", "val", "test"], "cohort": "int",
                                                        "patient_id": ["p1", "p2", "p3"]})
    external = _write(tmp_path / "b" / "external.csv", {"slide_id": ["e1", "e2"], "path": ["/abs/e1.tif", "e2.tif"], "label": [1, 0],
                                                         "split": ["train", "test"], "cohort": "ext", "metastasis": ["macro", ""]})
    df = merge_manifests([internal], [external]).set_index("slide_id")
    assert df["split"].to_dict() == {"i1": "train", "i2": "val", "i3": "test", "e1": "test", "e2": "test"}
    assert df.loc["i1", "path"] == str(tmp_path / "a" / "s" / "i1.svs") and df.loc["e2", "path"] == str(tmp_path / "b" / "e2.tif")
    assert df.loc["e1", "metastasis"] == "macro" and df.loc["e1", "patient_id"] == ""
    with pytest.raises(ManifestError, match=r"slide id\(s\) i1, i2, i3 also in .*internal.csv"):
        merge_manifests([internal], [internal])
    other = _write(tmp_path / "c.csv", {"slide_id": ["x"], "path": ["x.svs"], "label": [0], "split": ["test"], "cohort": "int"})
    with pytest.raises(ManifestError, match=r"cohort\(s\) \['int'\] given as both internal and external"):
        merge_manifests([internal], [other])
    out = tmp_path / "merged.csv"
    assert main(["manifest", "merge", "--internal", str(internal), "--external", str(external), "--out", str(out)]) == 0
    assert len(read_manifest(out)) == 5


def test_normalise_fractions_scales_to_one_and_rejects_bad_values():
    from wsi_pipeline.manifests.splits import normalise_fractions

    assert normalise_fractions({"train": 2, "val": 1, "test": 1}) == {"train": 0.5, "val": 0.25, "test": 0.25}
    with pytest.raises(ValueError, match="positive fractions"):
        normalise_fractions({"train": 0, "val": 0})
    with pytest.raises(ValueError, match=">= 0"):
        normalise_fractions({"train": 2, "val": -1})
