"""Drawn splits and folds for a user's own cohort (manifests.assign, `manifest folder --split/--folds`, `manifest split`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.manifests.assign import assign_splits, duplicate_files, fold_manifests, parse_fractions

FR = {"train": 0.6, "val": 0.2, "test": 0.2}


def _cohort(n_patients: int = 30, seed: int = 0) -> pd.DataFrame:
    """Patients with 1-3 slides each, a label per patient (0/1/2, unbalanced), a few unlabelled slides."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        label = int(rng.choice(3, p=[0.5, 0.3, 0.2]))
        for s in range(int(rng.integers(1, 4))):
            rows.append({"slide_id": f"p{p:02d}_s{s}", "path": f"/x/p{p:02d}_s{s}.svs", "label": label,
                         "split": "", "cohort": "mine", "patient_id": f"P{p:02d}"})
    rows.append({"slide_id": "nolabel", "path": "/x/nolabel.svs", "label": pd.NA, "split": "", "cohort": "mine", "patient_id": ""})
    df = pd.DataFrame(rows)
    df["label"] = df["label"].astype("Int64")
    return df


def _patient_table(df: pd.DataFrame, column: str) -> pd.Series:
    """patient -> the one value of ``column`` its slides have (fails if a patient has two)."""
    sub = df[df["patient_id"] != ""]
    per = sub.groupby("patient_id")[column].nunique()
    assert (per == 1).all(), f"patients split across {column}: {per[per > 1].index.tolist()}"
    return sub.groupby("patient_id")[column].first()


def test_splits_group_patients_and_follow_the_fractions_per_label():
    df = assign_splits(_cohort(), FR, seed=3)
    split_of = _patient_table(df, "split")
    label_of = _patient_table(df, "label")
    for label in sorted(label_of.unique()):
        pats = label_of.index[label_of == label]
        n = len(pats)
        for name, f in FR.items():
            got = int((split_of[pats] == name).sum())
            # quota rule: a stratum of n patients gets floor or ceil of f * n
            assert math.floor(f * n) <= got <= math.ceil(f * n), (label, name, got, f * n)
    assert df.loc[df["slide_id"] == "nolabel", "split"].item() == ""  # unlabelled: no split


def test_splits_do_not_depend_on_row_order_and_change_with_the_seed():
    base = assign_splits(_cohort(), FR, seed=1).set_index("slide_id")["split"]
    shuffled = _cohort().sample(frac=1.0, random_state=7)
    again = assign_splits(shuffled, FR, seed=1).set_index("slide_id")["split"]
    assert again.reindex(base.index).tolist() == base.tolist()
    other = assign_splits(_cohort(), FR, seed=2).set_index("slide_id")["split"]
    assert other.reindex(base.index).tolist() != base.tolist()


def test_pinned_splits_are_kept_and_their_patients_follow():
    df = _cohort()
    df.loc[df["slide_id"] == "p00_s0", "split"] = "test"
    out = assign_splits(df, FR, seed=0)
    assert (out.loc[out["patient_id"] == "P00", "split"] == "test").all()
    df.loc[df["slide_id"] == "p01_s0", "split"] = "train"
    df.loc[(df["patient_id"] == "P01") & (df["slide_id"] != "p01_s0"), "split"] = "val"
    if (df["patient_id"] == "P01").sum() > 1:
        with pytest.raises(ValueError, match="P01"):
            assign_splits(df, FR, seed=0)


def test_folds_cover_every_non_test_slide_once_as_validation():
    df = assign_splits(_cohort(40), FR, seed=0, folds=4)
    _patient_table(df, "fold")  # a patient sits in one fold
    test_ids = set(df.loc[df["split"] == "test", "slide_id"])
    cv_ids = set(df.loc[df["fold"] >= 0, "slide_id"])
    assert test_ids and not (test_ids & cv_ids)
    labelled = set(df.loc[df["label"].notna(), "slide_id"])
    assert test_ids | cv_ids == labelled
    manifests = fold_manifests(df)
    assert len(manifests) == 4
    val_counts: dict[str, int] = {}
    for m in manifests:
        assert set(m.loc[m["split"] == "test", "slide_id"]) == test_ids
        for sid in m.loc[m["split"] == "val", "slide_id"]:
            val_counts[sid] = val_counts.get(sid, 0) + 1
        assert set(m.loc[m["split"] == "train", "slide_id"]) == cv_ids - set(m.loc[m["split"] == "val", "slide_id"])
    assert set(val_counts) == cv_ids and set(val_counts.values()) == {1}


def test_bad_fold_and_fraction_arguments_are_named():
    with pytest.raises(ValueError, match="at least 2 folds"):
        assign_splits(_cohort(), FR, folds=1)
    with pytest.raises(ValueError, match="only 2 patient"):
        assign_splits(_cohort(3), {"train": 0.6, "val": 0.2, "test": 0.2}, folds=5)
    with pytest.raises(ValueError, match="three numbers"):
        parse_fractions("0.5,0.5")
    assert parse_fractions("3,1,1") == pytest.approx({"train": 0.6, "val": 0.2, "test": 0.2})


def test_duplicate_files_are_found_by_content(tmp_path):
    a = tmp_path / "a.svs"
    a.write_bytes(b"II*\x00" + bytes(range(256)) * 10)
    b = tmp_path / "sub" / "b.svs"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    c = tmp_path / "c.svs"
    c.write_bytes(b"II*\x00other")
    df = pd.DataFrame({"slide_id": ["a", "b", "c", "a2"], "path": [str(a), str(b), str(c), str(a)]})
    assert sorted(duplicate_files(df)) == [["a", "a2", "b"]]


def _write_slides(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_bytes(b"II*\x00" + str(i).encode() * 100)


def test_cli_folder_draws_splits_and_writes_fold_manifests(tmp_path, capsys):
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.manifests.schema import read_manifest

    names = [f"s{i:02d}.svs" for i in range(20)]
    _write_slides(tmp_path / "slides", names)
    labels = pd.DataFrame({"slide_id": [n[:-4] for n in names], "label": [i % 2 for i in range(20)]})
    labels.to_csv(tmp_path / "labels.csv", index=False)
    out = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(tmp_path / "slides"), "--labels", str(tmp_path / "labels.csv"),
                 "--out", str(out), "--split", "0.6,0.2,0.2", "--seed", "0"]) == 0
    m = read_manifest(out)
    counts = m["split"].value_counts().to_dict()
    assert counts == {"train": 12, "val": 4, "test": 4}
    printed = capsys.readouterr().out
    assert "train" in printed and "test" in printed

    assert main(["manifest", "split", "--manifest", str(out), "--redraw", "--folds", "3", "--out", str(tmp_path / "cv.csv")]) == 0
    folds = [read_manifest(tmp_path / f"cv_fold{k}.csv") for k in range(3)]
    vals = [set(f.loc[f["split"] == "val", "slide_id"]) for f in folds]
    assert not (vals[0] & vals[1]) and not (vals[1] & vals[2]) and not (vals[0] & vals[2])
    assert sum(map(len, vals)) == int((folds[0]["split"] != "test").sum())


def test_cli_warns_about_two_ids_for_one_file(tmp_path, capsys):
    from wsi_pipeline.cli.main import main

    _write_slides(tmp_path / "slides", ["a.svs", "b.svs"])
    (tmp_path / "slides" / "copy_of_a.svs").write_bytes((tmp_path / "slides" / "a.svs").read_bytes())
    assert main(["manifest", "folder", "--slides", str(tmp_path / "slides"), "--out", str(tmp_path / "m.csv")]) == 0
    err = capsys.readouterr().err
    assert "2 slide ids (a, copy_of_a) point to the same file" in err
