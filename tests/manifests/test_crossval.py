"""Cross-validation in which every slide is tested once (manifests.crossval, `manifest ... --crossval K`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.cli.main import main
from wsi_pipeline.manifests.crossval import assign_crossval, crossval_columns, crossval_manifests
from wsi_pipeline.manifests.folds import FoldRun, fold_runs
from wsi_pipeline.manifests.schema import read_manifest


def _labels(n_patients: int = 30, seed: int = 0) -> pd.DataFrame:
    """A labels file with patients of 1-3 slides, an unbalanced label per patient, and one unlabelled slide."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        label = int(rng.random() < 0.35)
        for s in range(int(rng.integers(1, 4))):
            rows.append({"slide_id": f"p{p:02d}_s{s}", "label": label, "patient_id": f"P{p:02d}"})
    rows.append({"slide_id": "nolabel", "label": pd.NA, "patient_id": "PX"})
    return pd.DataFrame(rows).astype({"label": "Int64"})


def _write_cohort(tmp, labels: pd.DataFrame):
    slides = tmp / "slides"
    slides.mkdir(parents=True)
    for sid in labels["slide_id"]:
        (slides / f"{sid}.svs").write_bytes(b"II*\x00" + sid.encode() * 40)  # distinct contents: no duplicate warning
    labels.to_csv(tmp / "labels.csv", index=False)
    return slides, tmp / "labels.csv"


def _check_one_repeat(fold_dfs: list[pd.DataFrame], labels: pd.DataFrame) -> None:
    """Every labelled slide tested exactly once; fold k+1 validates; patients in one fold; label mix kept."""
    K = len(fold_dfs)
    labelled = set(labels.loc[labels["label"].notna(), "slide_id"])
    tests = [set(f.loc[f["split"] == "test", "slide_id"]) for f in fold_dfs]
    assert sorted(s for t in tests for s in t) == sorted(labelled)  # each once, none twice
    patient = labels.set_index("slide_id")["patient_id"]
    for k, f in enumerate(fold_dfs):
        assert set(f.loc[f["split"] == "val", "slide_id"]) == tests[(k + 1) % K]
        assert set(f.loc[f["split"] == "train", "slide_id"]) == labelled - tests[k] - tests[(k + 1) % K]
        assert f.loc[f["slide_id"] == "nolabel", "split"].item() == ""
        # patient-grouped: no patient has slides in two splits of one fold's manifest
        per = f[f["split"] != ""].assign(p=lambda d: d["slide_id"].map(patient)).groupby("p")["split"].nunique()
        assert (per == 1).all()
    # stratified: each fold's count of each label is within one patient's slides of the cohort's share
    lab = labels.dropna(subset=["label"]).set_index("slide_id")["label"]
    biggest = int(labels.groupby("patient_id").size().max())
    for c in sorted(lab.unique()):
        share = (lab == c).sum() / K
        for t in tests:
            assert abs(int((lab[list(t)] == c).sum()) - share) <= biggest, (c, share, [len(t) for t in tests])


def test_cli_crossval_tests_every_slide_once_per_repeat_stratified_and_grouped(tmp_path, capsys):
    labels = _labels(30)
    slides, labels_csv = _write_cohort(tmp_path, labels)
    out = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(labels_csv), "--crossval", "4",
                 "--repeats", "2", "--seed", "5", "--out", str(out)]) == 0
    main_df = read_manifest(out)
    assert crossval_columns(main_df.columns) == ["cv_fold_r0", "cv_fold_r1"]
    assert main_df.loc[main_df["slide_id"] == "nolabel", "cv_fold_r0"].item() == -1
    runs = fold_runs(out)
    assert runs == [FoldRun(k, r, 2, crossval=True) for r in range(2) for k in range(4)]
    per_repeat = []
    for r in range(2):
        dfs = [read_manifest(tmp_path / f"m_r{r}_fold{k}.csv") for k in range(4)]
        _check_one_repeat(dfs, labels)
        # the main manifest records the test fold of each slide
        for k, f in enumerate(dfs):
            assert set(f.loc[f["split"] == "test", "slide_id"]) == set(main_df.loc[main_df[f"cv_fold_r{r}"] == k, "slide_id"])
        per_repeat.append(main_df.set_index("slide_id")[f"cv_fold_r{r}"])
    assert not per_repeat[0].equals(per_repeat[1])  # the repeats cut differently
    assert not (tmp_path / "m_fold0.csv").exists()
    assert "each of" in capsys.readouterr().out

    # one repeat: M_fold<k>.csv, the same fold numbers as FoldRun tags
    assert main(["manifest", "split", "--manifest", str(out), "--crossval", "3", "--out", str(tmp_path / "one.csv")]) == 0
    assert [r.tag for r in fold_runs(tmp_path / "one.csv")] == ["fold0", "fold1", "fold2"]
    _check_one_repeat([read_manifest(tmp_path / f"one_fold{k}.csv") for k in range(3)], labels)


def test_crossval_is_seeded_independent_of_row_order_and_keeps_pinned_tests():
    df = _labels(24).assign(path="/x", split="", cohort="mine")
    a = assign_crossval(df, 3, seed=1).set_index("slide_id")["cv_fold_r0"]
    b = assign_crossval(df.sample(frac=1.0, random_state=3), 3, seed=1).set_index("slide_id")["cv_fold_r0"]
    assert a.reindex(b.index).tolist() == b.tolist()
    assert not assign_crossval(df, 3, seed=2).set_index("slide_id")["cv_fold_r0"].equals(a)
    # an external cohort (all its slides pinned to test) stays test in every fold; the internal cohort's
    # drawn splits (test included) are replaced by the folds
    df.loc[df["slide_id"] == "p00_s0", "split"] = "test"
    df.loc[df["slide_id"] == "p01_s0", "split"] = "train"
    ext = pd.DataFrame({"slide_id": ["e0", "e1"], "label": [0, 1], "patient_id": ["E0", "E1"], "path": "/x",
                        "split": "test", "cohort": "external"})
    out = assign_crossval(pd.concat([df, ext], ignore_index=True), 3, seed=0)
    is_ext = out["cohort"] == "external"
    assert (out.loc[is_ext, "cv_fold_r0"] == -1).all()
    assert (out.loc[~is_ext & out["label"].notna(), "cv_fold_r0"] >= 0).all()
    for _, _, m in crossval_manifests(out):
        assert (m.loc[is_ext, "split"] == "test").all()


def test_survival_crossval_is_event_stratified():
    rng = np.random.default_rng(1)
    n = 40
    event = (np.arange(n) % 4 == 0).astype(int)  # 10 events among 40 patients
    df = pd.DataFrame({"slide_id": [f"s{i:02d}" for i in range(n)], "path": "/x", "label": pd.NA, "split": "",
                       "cohort": "c", "time": rng.uniform(1, 50, n), "event": event})
    out = assign_crossval(df, 5, seed=0)
    per_fold = out.groupby("cv_fold_r0")["event"].sum()
    assert per_fold.tolist() == [2] * 5  # one slide per patient: exactly 10/5 events per fold
    assert (out["cv_fold_r0"] >= 0).all()


def test_crossval_refusals_name_the_flag(tmp_path, capsys):
    df = _labels(5).assign(path="/x", split="", cohort="mine")
    with pytest.raises(ValueError, match="--crossval 2: .*at least 3"):
        assign_crossval(df, 2)
    with pytest.raises(ValueError, match="--crossval 6: only 5 labelled patient"):
        assign_crossval(df, 6)
    slides, labels_csv = _write_cohort(tmp_path, _labels(6))
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(labels_csv), "--repeats", "2",
                 "--out", str(tmp_path / "m.csv")]) == 2
    assert "--repeats 2 needs --crossval" in capsys.readouterr().err
    assert not (tmp_path / "m.csv").exists()


def test_split_folds_on_a_manifest_that_has_splits_draws_the_folds(tmp_path):
    """Issue 45 item 6: `manifest split --folds K` on a drawn manifest wrote fold=-1 and no fold files."""
    slides, labels_csv = _write_cohort(tmp_path, _labels(20))
    m = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(labels_csv), "--out", str(m)]) == 0
    before = read_manifest(m)
    assert main(["manifest", "split", "--manifest", str(m), "--folds", "3", "--out", str(m)]) == 0
    after = read_manifest(m)
    test_before = set(before.loc[before["split"] == "test", "slide_id"])
    assert set(after.loc[after["split"] == "test", "slide_id"]) == test_before  # the test split is kept
    cv = set(before.loc[before["split"].isin(["train", "val"]), "slide_id"])
    assert set(after.loc[after["fold"] >= 0, "slide_id"]) == cv and sorted(after.loc[after["fold"] >= 0, "fold"].unique()) == [0, 1, 2]
    vals = [set(read_manifest(tmp_path / f"m_fold{k}.csv").query("split == 'val'")["slide_id"]) for k in range(3)]
    assert sorted(s for v in vals for s in v) == sorted(cv)
    assert [r.tag for r in fold_runs(m)] == ["fold0", "fold1", "fold2"]


def test_train_and_eval_without_folds_refuse_a_crossval_manifest(tmp_path, capsys):
    import yaml

    slides, labels_csv = _write_cohort(tmp_path, _labels(8))
    m = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(labels_csv), "--crossval", "3",
                 "--out", str(m)]) == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "c", "data": {"manifest": str(m), "tiles_dir": str(tmp_path / "tiles"), "n_classes": 2},
        "methods": [{"name": "a", "strategy": "frozen", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}}],
        "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results")}))
    capsys.readouterr()
    for command in ("train", "eval"):
        assert main([command, "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "is a cross-validation manifest" in err and f"{command} --config ... --folds" in err and "m_fold0.csv" in err
    assert not (tmp_path / "runs").exists()
    # the manifest it names, one fold's (same fold column, each slide's split of that fold), is accepted
    from wsi_pipeline.manifests.folds import check_not_crossval

    fold0 = read_manifest(tmp_path / "m_fold0.csv")
    assert "cv_fold_r0" in fold0.columns and set(fold0["split"]) >= {"train", "val"}
    for command in ("train", "eval"):
        check_not_crossval(tmp_path / "m_fold0.csv", command)
