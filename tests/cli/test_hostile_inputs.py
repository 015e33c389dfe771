"""Hostile and unlucky inputs: ids that look like paths, damaged stores and checkpoints, YAML bombs,
full and read-only disks, locks and stale files (issue 34).

Each case reproduces a defect found by trying the pipeline as a hostile or unlucky user would;
what each test checks is the behaviour a researcher should get instead: a one-line error naming
the file or field, nothing written or removed outside the output folder, damaged data refused
by name while the other slides go on.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from wsi_pipeline.cli.main import main
from wsi_pipeline.slide_ids import SlideIdError, check_slide_id, slide_output_path
from pipeline_helpers import replace_best

HOSTILE_IDS = ["../ESC", "a/b", "..", ".hidden", " lead", "trail ", "bell\x07", "x" * 201, "a\\b", "dir/../up", ""]
GOOD_IDS = ["case 01", "TCGA-AB-1234-01Z-00-DX1.5F2A", "Ünïcode-é", "a.b", "x" * 200]


# ----------------------------------------------------------------------------------------------
# Slide ids are names, never paths
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", HOSTILE_IDS + ["/abs/victim"])
def test_the_rule_refuses_every_hostile_id(sid, tmp_path):
    with pytest.raises(SlideIdError, match="refused"):
        check_slide_id(sid)
    with pytest.raises(SlideIdError):
        slide_output_path(tmp_path, sid, ".zarr")


@pytest.mark.parametrize("sid", GOOD_IDS)
def test_ordinary_ids_pass_and_stay_inside(sid, tmp_path):
    assert check_slide_id(sid) == sid
    p = slide_output_path(tmp_path / "out", sid, "_scores.csv")
    assert p.parent == tmp_path / "out" and p.name == f"{sid}_scores.csv"


def _manifest(path: Path, ids: list[str], slide: Path | str = "x.svs", **cols) -> Path:
    df = pd.DataFrame({"slide_id": ids, "path": [str(slide)] * len(ids), "label": [i % 2 for i in range(len(ids))],
                       "split": ["train"] * len(ids), "cohort": ["c"] * len(ids), **cols})
    df.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("sid", ["../ESC", "a/b", " lead", "/abs/victim"])
def test_manifest_refuses_hostile_id_naming_the_line(sid, tmp_path):
    from wsi_pipeline.manifests.schema import ManifestError, read_manifest

    m = _manifest(tmp_path / "m.csv", ["ok1", sid, "ok2"])
    with pytest.raises(ManifestError, match=r"line 3.*refused") as e:
        read_manifest(m)
    assert str(m) in str(e.value)


@pytest.fixture(scope="module")
def small_slides(tmp_path_factory) -> Path:
    """Three small generated slides (1024 px, 256 px tiles, 0.5 um/px)."""
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path_factory.mktemp("slides")
    for i in range(3):
        make_slide(d / f"s{i}.svs", size=1024, mpp=0.5, seed=10 + i, tile_size=256)
    return d


def test_tile_with_hostile_ids_writes_and_removes_nothing_outside(small_slides, tmp_path, capsys):
    victim = tmp_path / "other" / "victim.zarr"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "work" / "tiles"
    for sid in [str(tmp_path / "other" / "victim"), "../ESC", "a/b"]:
        m = _manifest(tmp_path / "m.csv", ["s0", sid], small_slides / "s1.svs")
        rc = main(["tile", "--manifest", str(m), "--out", str(out), "--no-progress", "--workers", "0"])
        err = capsys.readouterr().err
        assert rc == 2 and "refused" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert (victim / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["victim.zarr"]
    assert not (tmp_path / "work" / "ESC.zarr").exists() and not (tmp_path / "work" / "ESC").exists()
    assert not out.exists() or not any(out.glob("*.zarr"))


@pytest.mark.parametrize("command", ["train", "eval", "features"])
def test_commands_reading_a_manifest_refuse_hostile_ids(command, store_cohort, tmp_path, capsys):
    from pipeline_helpers import make_config

    df = pd.read_csv(store_cohort)
    df.loc[0, "slide_id"] = "../ESC"
    m = tmp_path / "m.csv"
    df.to_csv(m, index=False)
    shutil.copytree(store_cohort.parent / "tiles", tmp_path / "tiles")
    cfg = make_config(tmp_path, m, [{"name": "m", "strategy": "frozen", "chunk_size": 16}], results_dir=str(tmp_path / "results"))
    argv = {"train": ["train", "--config", str(cfg)], "eval": ["eval", "--config", str(cfg)],
            "features": ["features", "--manifest", str(m), "--tiles", str(tmp_path / "tiles"), "--out", str(tmp_path / "feat")]}[command]
    rc = main(argv + ["--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "refused" in err and "Traceback" not in err, err
    assert not (tmp_path.parent / "ESC.h5").exists() and not list(tmp_path.parent.glob("ESC*"))


def test_slide_files_give_one_id_everywhere(tmp_path, small_slides, capsys):
    from wsi_pipeline.slides.finder import find_slide_files

    d = tmp_path / "slides"
    d.mkdir()
    shutil.copy(small_slides / "s0.svs", d / " lead.svs")
    shutil.copy(small_slides / "s1.svs", d / "fine.svs")
    with pytest.raises(SlideIdError, match=r"lead\.svs.*white space"):
        find_slide_files(d)
    rc = main(["manifest", "folder", "--slides", str(d), "--out", str(tmp_path / "m.csv")])
    err = capsys.readouterr().err
    assert rc == 2 and "lead.svs" in err and "rename" in err and "Traceback" not in err, err


def test_tile_does_not_replace_a_folder_it_did_not_create(small_slides, tmp_path):
    out = tmp_path / "tiles"
    theirs = out / "s0.zarr"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("a user's folder")
    rc = main(["tile", "--slides", str(small_slides), "--out", str(out), "--no-progress", "--workers", "0", "--no-qc-images"])
    assert rc == 1
    assert (theirs / "notes.txt").read_text() == "a user's folder"
    report = pd.read_csv(out / "tiling_report.csv").set_index("slide_id")
    assert report.loc["s0", "status"] == "failed" and "not a tile store" in report.loc["s0", "error"]
    assert (report.loc[["s1", "s2"], "status"] == "ok").all()


# ----------------------------------------------------------------------------------------------
# Stores verify themselves
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiled(small_slides, tmp_path_factory) -> Path:
    """The three small slides tiled (4 tiles per shard, so each store has several shard files)."""
    out = tmp_path_factory.mktemp("tiled") / "tiles"
    rc = main(["tile", "--slides", str(small_slides), "--out", str(out), "--no-progress", "--workers", "0",
               "--shard-tiles", "4", "--no-qc-images"])
    assert rc == 0
    return out


def _copy(tiled: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "tiles"
    shutil.copytree(tiled, dest)
    return dest


def _files(store: Path, array: str) -> list[Path]:
    return sorted(p for p in (store / array).rglob("*") if p.is_file() and p.name != "zarr.json")


def test_new_stores_carry_checksums_that_plain_zarr_checks(tiled):
    import zarr

    from wsi_pipeline.data.store import open_store

    store = open_store(tiled / "s0.zarr")
    ours = store.read()
    arr = zarr.open_group(str(tiled / "s0.zarr"), mode="r")["tiles"]
    names = [c.to_dict()["name"] for c in arr.metadata.codecs[0].codecs]
    assert names[-1] == "crc32c", names
    np.testing.assert_array_equal(np.asarray(arr[:]), ours)
    assert len(_files(tiled / "s0.zarr", "tiles")) >= 2


@pytest.mark.parametrize("array", ["tiles", "coords", "grid", "foreground"])
def test_a_deleted_chunk_file_is_detected_on_open(array, tiled, tmp_path):
    from wsi_pipeline.data.store import StoreDamagedError, open_store

    tiles = _copy(tiled, tmp_path)
    victim = _files(tiles / "s0.zarr", array)[0]
    victim.unlink()
    with pytest.raises(StoreDamagedError, match=rf"s0\.zarr.*{array}.*missing"):
        open_store(tiles / "s0.zarr")
    open_store(tiles / "s1.zarr")  # the others are fine


def test_a_truncated_shard_is_detected_on_open(tiled, tmp_path):
    from wsi_pipeline.data.store import StoreDamagedError, open_store

    tiles = _copy(tiled, tmp_path)
    shard = _files(tiles / "s0.zarr", "tiles")[0]
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(StoreDamagedError, match=rf"{shard.name}.*{size // 2} bytes.*expected {size}"):
        open_store(tiles / "s0.zarr")


def test_flipped_bytes_inside_a_shard_fail_the_read_of_that_tile(tiled, tmp_path):
    import zarr

    from wsi_pipeline.data.store import StoreDamagedError, open_store

    tiles = _copy(tiled, tmp_path)
    store = open_store(tiles / "s0.zarr")
    good = store.read()
    shard = _files(tiles / "s0.zarr", "tiles")[0]
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])  # inside the shard's first tile
    shard.write_bytes(bytes(data))
    store = open_store(tiles / "s0.zarr")  # sizes unchanged: the cheap check passes
    with pytest.raises(StoreDamagedError, match=r"s0\.zarr.*tile 0.*checksum"):
        store.read([0])
    np.testing.assert_array_equal(store.read([1, 2, 3]), good[1:4])  # its neighbours read fine
    with pytest.raises(Exception, match="(?i)checksum|crc"):  # plain zarr refuses it too
        zarr.open_group(str(tiles / "s0.zarr"), mode="r")["tiles"][0]


def test_verify_command_names_each_damaged_store(tiled, tmp_path, capsys):
    tiles = _copy(tiled, tmp_path)
    assert main(["verify", "--tiles", str(tiles), "--no-progress"]) == 0
    assert "3 store(s) verified, 0 damaged" in capsys.readouterr().out
    _files(tiles / "s0.zarr", "coords")[0].unlink()
    shard = _files(tiles / "s2.zarr", "tiles")[-1]
    data = bytearray(shard.read_bytes())
    data[40] ^= 0x01
    shard.write_bytes(bytes(data))
    rc = main(["verify", "--tiles", str(tiles), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "s0" in out and "missing" in out and "s2" in out and "checksum" in out and "1 ok" not in out
    assert "3 store(s) verified, 2 damaged" in out


def test_tiling_rebuilds_a_damaged_store(tiled, small_slides, tmp_path):
    from wsi_pipeline.data.store import open_store

    tiles = _copy(tiled, tmp_path)
    before = open_store(tiles / "s1.zarr").read()
    _files(tiles / "s1.zarr", "tiles")[0].unlink()
    rc = main(["tile", "--slides", str(small_slides), "--out", str(tiles), "--no-progress", "--workers", "0",
               "--shard-tiles", "4", "--no-qc-images"])
    assert rc == 0
    report = pd.read_csv(tiles / "tiling_report.csv").set_index("slide_id")
    assert report.loc["s1", "status"] == "ok" and report.loc["s0", "status"] == "skipped"
    np.testing.assert_array_equal(open_store(tiles / "s1.zarr").read(), before)


def _cohort_copy(store_cohort: Path, tmp_path: Path) -> Path:
    """A copy of the session's store cohort (manifest + tiles) that a test may damage."""
    shutil.copytree(store_cohort.parent / "tiles", tmp_path / "tiles")
    shutil.copy(store_cohort, tmp_path / store_cohort.name)
    return tmp_path / store_cohort.name


FROZEN = [{"name": "m", "strategy": "frozen", "chunk_size": 16}]


def _cfg(tmp_path: Path, manifest: Path, shared: Path | None = None, methods: list | None = None, **kw) -> Path:
    """A pipeline YAML (``test_train_loop.make_config``) whose frozen features are ``shared``'s, extracted once."""
    from pipeline_helpers import make_config

    path = make_config(tmp_path, manifest, methods or FROZEN, **kw)
    if shared is not None:
        raw = yaml.safe_load(path.read_text())
        raw["data"]["features_dir"] = str(shared / "features")
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory, store_cohort) -> Path:
    """One finished frozen-encoder run (``<root>/runs/t/m/seed0``) and its features (``<root>/features``)."""
    root = tmp_path_factory.mktemp("shared")
    cfg = _cfg(root, store_cohort, root, train={"epochs": 1})
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    return root


def test_train_refuses_a_damaged_training_slide_by_name(store_cohort, tmp_path, capsys):
    from pipeline_helpers import make_config

    m = _cohort_copy(store_cohort, tmp_path)
    df = pd.read_csv(m)
    sid = df.loc[df["split"] == "train", "slide_id"].iloc[0]
    _files(tmp_path / "tiles" / f"{sid}.zarr", "tiles")[0].unlink()
    cfg = make_config(tmp_path, m, [{"name": "m", "strategy": "accumulate", "chunk_size": 4}])
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and sid in err and "missing" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("last.pt"))


def test_eval_scores_the_healthy_slides_and_names_the_damaged_one(store_cohort, shared, tmp_path, capsys):
    m = _cohort_copy(store_cohort, tmp_path)
    cfg = _cfg(tmp_path, m, shared, train={"epochs": 1}, runs=str(shared / "runs"), results_dir=str(tmp_path / "results"))
    df = pd.read_csv(m)
    test_ids = df.loc[df["split"] == "test", "slide_id"].tolist()
    shard = _files(tmp_path / "tiles" / f"{test_ids[0]}.zarr", "tiles")[0]
    data = bytearray(shard.read_bytes())
    data[20:84] = bytes(b ^ 0xFF for b in data[20:84])
    shard.write_bytes(bytes(data))
    rc = main(["eval", "--config", str(cfg), "--no-progress", "--bootstrap", "0", "--no-heatmaps"])
    out = capsys.readouterr()
    assert rc == 1, out.err
    assert test_ids[0] in out.err and "checksum" in out.err
    pred = pd.read_csv(tmp_path / "results" / "t" / "predictions_synthetic_all.csv")
    assert set(pred["slide_id"]) == set(test_ids[1:])
    assert main(["eval", "--config", str(cfg), "--no-progress", "--bootstrap", "0", "--no-heatmaps", "--allow-failures"]) == 0


# ----------------------------------------------------------------------------------------------
# Checkpoints verify themselves
# ----------------------------------------------------------------------------------------------


def _flip(path: Path, at: int, n: int) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    path.write_bytes(bytes(data))


def test_flipped_checkpoint_bytes_are_refused(tmp_path):
    import torch

    from wsi_pipeline.checkpoints.files import load_checkpoint, save_checkpoint

    p = save_checkpoint(tmp_path / "best.pt", {"models": {"w": torch.linspace(0, 1, 4096)}, "epoch": 3})
    assert load_checkpoint(p)["epoch"] == 3
    raw = p.read_bytes()
    at = raw.index(torch.linspace(0, 1, 4096)[1000:1004].numpy().tobytes())  # inside the tensor's data
    _flip(p, at, 16)
    assert float(torch.load(p, weights_only=True)["models"]["w"][1001]) != pytest.approx(1001 / 4095)  # torch reads it
    with pytest.raises(ValueError, match=r"best\.pt.*sha256.*does not match"):
        load_checkpoint(p)


def test_a_crash_between_checkpoint_and_its_hash_still_loads(tmp_path, monkeypatch):
    import torch

    import wsi_pipeline.checkpoints.files as ck

    p = ck.save_checkpoint(tmp_path / "last.pt", {"models": {"w": torch.ones(3)}, "epoch": 1})
    real_replace = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(dst)
        if str(dst).endswith(".sha256") and len([c for c in calls if str(c).endswith(".sha256")]) == 2:
            raise KeyboardInterrupt  # killed after the checkpoint was replaced, before its hash was
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(p, {"models": {"w": torch.zeros(3)}, "epoch": 2})
    monkeypatch.undo()
    assert ck.load_checkpoint(p)["epoch"] == 2


def test_stale_temporary_checkpoints_are_removed_on_the_next_run(store_cohort, shared, tmp_path):
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1})
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    run.mkdir(parents=True)
    left = run / ".last.pt.tmp-999999.pt"
    left.write_bytes(b"half a checkpoint")
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    assert not left.exists()


# ----------------------------------------------------------------------------------------------
# Bounded config parsing
# ----------------------------------------------------------------------------------------------

BOMB = """name: bomb
methods: [{name: m, strategy: frozen}]
data:
  n_classes: 2
  manifest:
    - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    - &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]
    - &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]
    - &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]
    - &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]
    - &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]
    - &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]
    - &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]
    - &i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys):
    """A 728-byte config whose field expands to 12**9 strings (the issue's case took 12.7 GB and 79 s)."""
    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 800
    rc = main(["train", "--config", str(tmp_path / "bomb.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "aliases" in err and len(err) < 600, err[:2000]


def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path):
    from wsi_pipeline.config.io import read_yaml

    (tmp_path / "d.yaml").write_text("name: x\ntrain:\n  epochs: 3\n  lr: 0.1\n  epochs: 5\n")
    with pytest.raises(ValueError, match=r"d\.yaml.*duplicate key 'epochs'.*line 5.*line 3"):
        read_yaml(tmp_path / "d.yaml")


def test_a_huge_yaml_document_is_refused(tmp_path):
    from wsi_pipeline.config.io import MAX_YAML_BYTES, read_yaml

    (tmp_path / "big.yaml").write_text("name: x\nnote: '" + "y" * MAX_YAML_BYTES + "'\n")
    with pytest.raises(ValueError, match=r"big\.yaml.*larger than"):
        read_yaml(tmp_path / "big.yaml")


def test_error_messages_quote_long_values_shortly(tmp_path, capsys):
    (tmp_path / "long.yaml").write_text(yaml.safe_dump({"name": "x", "train": {"epochs": "z" * 100_000}}))
    rc = main(["train", "--config", str(tmp_path / "long.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "epochs" in err and len(err) < 1000, len(err)


# ----------------------------------------------------------------------------------------------
# Disk and permission errors: one line, before compute where it can be checked
# ----------------------------------------------------------------------------------------------


def test_train_on_a_full_disk_is_one_line(store_cohort, shared, tmp_path, monkeypatch, capsys):
    import wsi_pipeline.checkpoints.files as ck

    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1})

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write to a full disk raises it: no file name

    monkeypatch.setattr(ck._HashingWriter, "write", full)
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "No space left on device" in err and ".pt" in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert not list((tmp_path / "runs").rglob(".*.tmp-*"))


def test_tile_on_a_full_disk_stops_at_once(small_slides, tmp_path, monkeypatch, capsys):
    import wsi_pipeline.data.store as store_mod

    tried = []

    def full(self):
        tried.append(self.path.name)
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(store_mod.StoreWriter, "commit", full)
    out = tmp_path / "tiles"
    rc = main(["tile", "--slides", str(small_slides), "--out", str(out), "--no-progress", "--workers", "0", "--no-qc-images"])
    err = capsys.readouterr().err
    assert rc == 2 and "No space left on device" in err and "disk is full" in err and "Traceback" not in err, err
    assert tried == ["s0.zarr"]  # the other slides were not attempted


@pytest.mark.parametrize("command", ["train", "eval", "features", "manifest"])
def test_an_output_path_that_is_a_file_is_refused_before_compute(command, store_cohort, shared, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    runs = str(shared / "runs") if command == "eval" else str(blocker / "runs")
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1}, runs=runs, results_dir=str(blocker / "results"))
    argv = {
        "train": ["train", "--config", str(cfg), "--no-progress"],
        "eval": ["eval", "--config", str(cfg), "--no-progress", "--bootstrap", "0"],
        "features": ["features", "--manifest", str(store_cohort), "--tiles", str(store_cohort.parent / "tiles"),
                     "--out", str(blocker / "feat"), "--no-progress"],
        "manifest": ["manifest", "split", "--manifest", str(store_cohort), "--out", str(blocker / "m.csv")],
    }[command]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and str(blocker) in err and "Traceback" not in err, err
    assert "not a folder" in err or "Not a directory" in err, err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_output_is_refused_before_compute(store_cohort, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cfg = _cfg(tmp_path, store_cohort, runs=str(ro / "runs"))
    try:
        rc = main(["train", "--config", str(cfg), "--no-progress"])
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert rc == 2 and str(ro) in err and "Traceback" not in err, err


def test_a_read_only_output_is_refused_before_compute_as_root_too(store_cohort, tmp_path, monkeypatch, capsys):
    """The same as the test above where it cannot run (root): the write probe meets EROFS."""
    import wsi_pipeline.output_dirs as output_dirs

    ro = tmp_path / "ro"
    real_open = os.open

    def erofs(path, *a, **k):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(output_dirs.os, "open", erofs)
    cfg = _cfg(tmp_path, store_cohort, runs=str(ro / "runs"))
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Read-only file system" in err and str(ro) in err and "Traceback" not in err, err
    assert not (tmp_path / "features").exists()  # nothing computed


def test_manifest_folder_on_a_symlink_loop(tmp_path, small_slides, capsys, caplog):
    d = tmp_path / "slides"
    d.mkdir()
    shutil.copy(small_slides / "s0.svs", d / "good.svs")
    os.symlink("loop.svs", d / "loop.svs")
    rc = main(["manifest", "folder", "--slides", str(d), "--out", str(tmp_path / "m.csv")])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert any("loop.svs" in r.getMessage() and "link loop" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert rc == 0
    assert pd.read_csv(tmp_path / "m.csv")["slide_id"].tolist() == ["good"]


def test_tissue_predict_with_a_missing_folder_or_a_refused_model(tmp_path, small_slides, capsys):
    rc = main(["tissue", "predict", "--slides", str(tmp_path / "nowhere"), "--model", str(tmp_path / "m.pt"),
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere" in err and "Traceback" not in err, err
    (tmp_path / "slides").mkdir()
    shutil.copy(small_slides / "s0.svs", tmp_path / "slides" / "s0.svs")
    (tmp_path / "m.pt").write_bytes(b"not a model")
    rc = main(["tissue", "predict", "--slides", str(tmp_path / "slides"), "--model", str(tmp_path / "m.pt"),
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "m.pt" in err and "Traceback" not in err, err


def test_a_failed_lock_write_leaves_no_lock_file(tmp_path, monkeypatch):
    import wsi_pipeline.tiling.locks as locks

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(locks.os, "write", full)
    ld = locks.LockDir(tmp_path / "locks")
    with pytest.raises(OSError, match="No space"):
        ld.try_acquire("s0")
    monkeypatch.undo()
    assert not list((tmp_path / "locks").glob("*.lock"))
    assert ld.try_acquire("s0")  # at once, not after the stale timeout
    ld.release_all()


# ----------------------------------------------------------------------------------------------
# Weak points: concurrent training, changed finished runs, empty labels, exit codes
# ----------------------------------------------------------------------------------------------


def test_a_run_folder_another_process_trains_is_left_alone(store_cohort, shared, tmp_path, capsys):
    from wsi_pipeline.tiling.locks import LockDir

    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1}, seeds=[0, 1])
    run0 = tmp_path / "runs" / "t" / "m" / "seed0"
    run0.mkdir(parents=True)
    other = LockDir(run0)
    assert other.try_acquire("training")
    try:
        # another process holds it: the same pid would be this one, so pretend it is pid 1 (alive)
        info = json.loads((run0 / "training.lock").read_text())
        info.update(pid=1, pid_start=None)
        (run0 / "training.lock").write_text(json.dumps(info))
        rc = main(["train", "--config", str(cfg), "--no-progress"])
    finally:
        other.release_all()
    out = capsys.readouterr()
    assert rc == 1, out.err
    assert "seed0" in out.err and "another process" in out.err and "pid 1" in out.err
    assert not (run0 / "done").exists() and (tmp_path / "runs" / "t" / "m" / "seed1" / "done").exists()


def test_a_finished_run_whose_config_changed_is_a_warning(store_cohort, shared, tmp_path, caplog):
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 2}, runs=str(shared / "runs"))
    with caplog.at_level("WARNING"):
        assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("seed0" in w and "train.epochs" in w and "done" in w for w in warned), warned


def test_training_slides_without_a_label_are_named(store_cohort, shared, tmp_path, caplog):
    m = _cohort_copy(store_cohort, tmp_path)
    df = pd.read_csv(m)
    sid = df.loc[df["split"] == "train", "slide_id"].iloc[0]
    df.loc[df["slide_id"] == sid, "label"] = None
    df.to_csv(m, index=False)
    cfg = _cfg(tmp_path, m, shared, train={"epochs": 1})
    with caplog.at_level("WARNING"):
        assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    assert any(sid in r.getMessage() and "no label" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert main(["train", "--config", str(cfg), "--no-progress", "--strict"]) == 2


def test_predict_exit_status_says_slides_failed(shared, small_slides, tmp_path, capsys):
    d = tmp_path / "new"
    d.mkdir()
    shutil.copy(small_slides / "s0.svs", d / "good.svs")
    (d / "broken.svs").write_bytes(b"not a slide at all" * 100)
    model = shared / "runs" / "t" / "m" / "seed0"
    argv = ["predict", "--model", str(model), "--slides", str(d), "--out", str(tmp_path / "pred"), "--no-progress",
            "--no-heatmaps", "--allow-other-tiling", "--device", "cpu", "--workers", "0"]
    assert main(argv) == 1
    out = capsys.readouterr()
    assert "broken" in out.out + out.err
    assert pd.read_csv(tmp_path / "pred" / "predictions.csv")["slide_id"].tolist() == ["good"]
    assert main(argv + ["--allow-failures"]) == 0


# ----------------------------------------------------------------------------------------------
# Issue 41: locks held for a whole run, full disks in torch's writer, no network, survival
# inputs, replaced slides, named inputs read or refused, regions, bounded requests
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def short_stale(monkeypatch):
    """Locks go stale after 1 s without a refresh (heartbeat every 0.1 s): a run of a few seconds outlives it."""
    import wsi_pipeline.tiling.locks as locks

    monkeypatch.setattr(locks, "STALE_AFTER_S", 1.0)
    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.1)
    return 1.0


def test_a_lock_is_refreshed_without_a_with_block(tmp_path, short_stale):
    import time

    from wsi_pipeline.tiling.locks import LockDir

    a, b = LockDir(tmp_path), LockDir(tmp_path)
    assert a.try_acquire("s")
    try:
        time.sleep(3 * short_stale)  # three stale periods: only a heartbeat keeps it live
        assert a.stale_reason("s") is None and not b.try_acquire("s")
    finally:
        a.release_all()
    assert b.try_acquire("s")  # released: free at once
    b.release_all()


@pytest.mark.slow
def test_a_training_run_longer_than_the_stale_time_is_not_taken_over(store_cohort, shared, tmp_path, monkeypatch,
                                                                     short_stale, capsys, caplog):
    """Run A trains for 3x the stale time; run B, started meanwhile, must leave the run folder to A."""
    import time

    import wsi_pipeline.training.loop as loop

    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1})
    real = loop._train_and_validate
    second: dict = {}

    def long_epoch(run, epoch):
        if not second:
            second["started"] = True
            time.sleep(3 * short_stale)  # run A's epoch outlives the stale time
            second["rc"] = main(["train", "--config", str(cfg), "--no-progress"])  # run B, while A holds the lock
            second["err"] = capsys.readouterr().err
        return real(run, epoch)

    monkeypatch.setattr(loop, "_train_and_validate", long_epoch)
    with caplog.at_level("WARNING"):
        rc = main(["train", "--config", str(cfg), "--no-progress"])
    assert rc == 0 and second["rc"] == 1, second
    assert "another process is training it" in second["err"], second["err"]
    assert not any("took over" in r.getMessage() for r in caplog.records)
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    assert (run / "done").exists() and (run / "best.pt").exists() and not (run / "training.lock").exists()


@pytest.mark.parametrize("content", [b"", b"{not json", b"\x00\x01\x02"])
def test_an_unreadable_training_lock_is_held_by_unknown_never_trained(content, store_cohort, shared, tmp_path, capsys):
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1})
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    run.mkdir(parents=True)
    (run / "training.lock").write_bytes(content)
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    out = capsys.readouterr()
    assert rc == 1, out
    assert "trained 1 run" not in out.out and "seed0" in out.err and "unknown" in out.err, out
    assert not (run / "best.pt").exists()


@pytest.mark.slow
def test_a_full_disk_inside_torchs_zip_writer_is_one_line_and_a_rerun_continues(store_cohort, shared, tmp_path,
                                                                                monkeypatch, capsys):
    """torch's writer turns an ENOSPC part way through into ``RuntimeError: [enforce fail at inline_container.cc]``."""
    import wsi_pipeline.checkpoints.files as ck

    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 2})
    real = ck._HashingWriter.write
    written = {"n": 0, "saves": 0}

    def fills_up(self, data):
        written["n"] += len(data)
        if written["n"] > 2000:  # the disk fills part way through a checkpoint
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(ck._HashingWriter, "write", fills_up)
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "No space left on device" in err and ".pt" in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    assert not list(run.glob(".*.tmp-*")) and not list(run.glob("*.pt"))  # nothing half written
    monkeypatch.undo()
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    assert (run / "done").exists()


@pytest.mark.parametrize("name", ["timm:hf-hub:timm/resnet18.a1_in1k", "timm:hf_hub:timm/resnet18", "timm:local-dir:/any/dir",
                                  "timm:https://example.org/model", "timm:timm/resnet18", "timm:../x"])
def test_timm_names_with_a_source_are_refused_naming_the_value(name, store_cohort, tmp_path, capsys):
    from wsi_pipeline.config.schema import build
    from wsi_pipeline.config.model import EncoderConfig

    with pytest.raises(ValueError, match="network|folder|source") as e:
        build(EncoderConfig, {"name": name})
    assert name in str(e.value)
    tiles = store_cohort.parent / "tiles"
    rc = main(["features", "--manifest", str(store_cohort), "--tiles", str(tiles), "--out", str(tmp_path / "f"),
               "--encoder", name, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and name in err and "Traceback" not in err, err


@pytest.fixture
def no_sockets(monkeypatch):
    """Every attempt to reach the network is recorded and refused."""
    import socket

    tried: list = []

    def refuse(self, address, *a, **k):
        tried.append(address)
        raise OSError(errno.ENETUNREACH, f"test: no network (tried {address})")

    def refuse_lookup(host, *a, **k):
        tried.append(host)
        raise socket.gaierror(socket.EAI_NONAME, f"test: no DNS (tried {host})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    return tried


@pytest.mark.slow
def test_features_and_train_with_a_timm_encoder_open_no_socket(store_cohort, tmp_path, no_sockets, monkeypatch, capsys):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    enc = {"name": "timm:test_vit", "input_size": 32, "timm_kwargs": {"img_size": 32}}
    tiles = store_cohort.parent / "tiles"
    rc = main(["features", "--manifest", str(store_cohort), "--tiles", str(tiles), "--out", str(tmp_path / "f"),
               "--encoder", "timm:test_vit", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    cfg = _cfg(tmp_path, store_cohort, methods=[{"name": "m", "strategy": "frozen", "chunk_size": 16, "encoder": enc}],
               train={"epochs": 1})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0, capsys.readouterr().err
    assert no_sockets == []
    hub = "timm:hf-hub:timm/resnet18.a1_in1k"  # timm would ask the Hugging Face Hub for its config
    rc = main(["features", "--manifest", str(store_cohort), "--tiles", str(tiles), "--out", str(tmp_path / "g"),
               "--encoder", hub, "--no-progress"])
    assert rc == 2 and hub in capsys.readouterr().err
    assert no_sockets == []
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def _endpoint_cohort(store_cohort: Path, tmp_path: Path, **cols) -> Path:
    """The store cohort's manifest with endpoint columns (``time``/``event`` or ``target``) added."""
    df = pd.read_csv(store_cohort)
    n = len(df)
    for col, values in cols.items():
        df[col] = values(n) if callable(values) else values
    m = tmp_path / "m.csv"
    df.to_csv(m, index=False)
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    return m


SURV = [{"name": "m", "strategy": "frozen", "chunk_size": 16, "task": "survival", "loss": "cox"}]
REGR = [{"name": "m", "strategy": "frozen", "chunk_size": 16, "task": "regression", "loss": "mse"}]


@pytest.mark.parametrize("col,bad", [("time", "inf"), ("time", "-inf"), ("target", "inf"), ("target", "-Infinity")])
def test_non_finite_times_and_targets_are_refused_naming_the_slide(col, bad, store_cohort, tmp_path):
    from wsi_pipeline.manifests.schema import ManifestError, read_manifest

    value = bad
    extra = {"time": lambda n: [float(i + 1) for i in range(n)], "event": lambda n: [i % 2 for i in range(n)]} \
        if col == "time" else {"target": lambda n: [float(i) for i in range(n)]}
    m = _endpoint_cohort(store_cohort, tmp_path, **extra)
    df = pd.read_csv(m)
    df[col] = df[col].astype(object)
    df.loc[3, col] = value
    df.to_csv(m, index=False)
    sid = df.loc[3, "slide_id"]
    with pytest.raises(ManifestError, match=rf"{col}.*{sid}.*finite|{col}.*finite.*{sid}") as e:
        read_manifest(m)
    assert str(m) in str(e.value)


@pytest.mark.parametrize("events", [0, 1])
def test_a_training_split_with_fewer_than_two_events_is_refused_before_training(events, store_cohort, shared, tmp_path, capsys):
    df = pd.read_csv(store_cohort)
    train = (df["split"] == "train").to_numpy()
    event = np.zeros(len(df), dtype=int)
    event[np.flatnonzero(train)[:events]] = 1
    event[~train] = 1  # events outside the training split do not count
    m = _endpoint_cohort(store_cohort, tmp_path, time=lambda n: [float(i + 1) for i in range(n)], event=event)
    cfg = _cfg(tmp_path, m, shared, methods=SURV, train={"epochs": 1})
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "event" in err and f"{events} " in err and "Traceback" not in err, err
    assert not list((tmp_path / "runs").rglob("*.pt")) if (tmp_path / "runs").exists() else True


def test_a_regression_target_that_overflows_float32_is_refused_before_training(store_cohort, shared, tmp_path, capsys):
    m = _endpoint_cohort(store_cohort, tmp_path, target=lambda n: [1e308 / 3 * (i % 3) for i in range(n)])
    cfg = _cfg(tmp_path, m, shared, methods=REGR, train={"epochs": 1})
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "target" in err and "float32" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.pt"))


def test_a_replaced_slide_of_the_same_size_and_first_mib_is_tiled_again(tmp_path):
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path / "slides"
    d.mkdir()
    a = make_slide(d / "a.svs", size=2048, mpp=0.5, seed=1, tile_size=256, noise=20, quality=98).path
    b = make_slide(tmp_path / "b.svs", size=2048, mpp=0.5, seed=2, tile_size=256, noise=20, quality=98).path
    mib = 1 << 20
    old = Path(a).read_bytes()
    assert len(old) > 2 * mib
    argv = ["tile", "--slides", str(d), "--out", str(tmp_path / "tiles"), "--no-progress", "--workers", "0", "--no-qc-images"]
    assert main(argv) == 0
    other = Path(b).read_bytes()[mib:len(old)]
    new = old[:mib] + other + old[mib + len(other):]  # same size, same first MiB, the rest another slide's
    assert len(new) == len(old) and new[:mib] == old[:mib] and new != old
    Path(a).write_bytes(new)
    main(argv)
    row = pd.read_csv(tmp_path / "tiles" / "tiling_report.csv").set_index("slide_id").loc["a"]
    assert row["status"] != "skipped", row.to_dict()


def test_the_slide_identity_samples_the_whole_file(tmp_path):
    from wsi_pipeline.slides.fingerprint import same_slide, slide_fingerprint

    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(0, 256, 5 << 20, dtype=np.uint8).tobytes())
    p = tmp_path / "x.bin"
    p.write_bytes(bytes(data))
    first = slide_fingerprint(p)
    for at in (int(len(data) * 0.37), int(len(data) * 0.81), len(data) - 10):  # middle, late, the tail
        changed = bytearray(data)
        changed[at:at + 65536] = bytes(65536)
        p.write_bytes(bytes(changed))
        assert slide_fingerprint(p) != first and not same_slide(first, slide_fingerprint(p))
    p.write_bytes(bytes(data))
    assert slide_fingerprint(p) == first
    legacy = "-".join(first.split("-")[:2])  # a store recorded by the head-only identity keeps matching
    assert same_slide(legacy, first) and not same_slide(legacy, "1-" + first.split("-")[1] + "-x")


@pytest.mark.slow
def test_a_lesion_mask_that_is_not_an_image_fails_that_slide_by_name(store_cohort, shared, tmp_path, capsys, caplog):
    """A FIFO, /dev/zero and a text file as masks fail their slides by name; a missing mask is named in a warning."""
    m = _cohort_copy(store_cohort, tmp_path)
    shutil.copytree(store_cohort.parent / "masks", tmp_path / "masks")
    df = pd.read_csv(m)
    test_ids = df.loc[df["split"] == "test", "slide_id"].tolist()
    fifo = tmp_path / "mask.fifo"
    os.mkfifo(fifo)
    text = tmp_path / "passwd.png"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    bad = {test_ids[0]: str(fifo), test_ids[1]: "/dev/zero", test_ids[2]: str(text)}
    for sid, path in bad.items():
        df.loc[df["slide_id"] == sid, "lesion_mask"] = path
    df.to_csv(m, index=False)
    cfg = _cfg(tmp_path, m, shared, train={"epochs": 1}, runs=str(shared / "runs"), results_dir=str(tmp_path / "results"))
    argv = ["eval", "--config", str(cfg), "--no-progress", "--bootstrap", "0", "--no-heatmaps"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    for sid, path in bad.items():
        assert any(sid in ln and path in ln and "lesion_mask" in ln for ln in err.splitlines()), (sid, err)
    df.loc[df["slide_id"] == test_ids[0], "lesion_mask"] = str(tmp_path / "no_such_mask.png")
    df.loc[df["slide_id"].isin(test_ids[1:]), "lesion_mask"] = [f"masks/{s}.png" for s in test_ids[1:]]
    df.to_csv(m, index=False)
    with caplog.at_level("WARNING"):
        assert main(argv) == 0
    assert any(test_ids[0] in r.getMessage() and "no_such_mask.png" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_copied_without_its_sidecar_still_verifies_itself(shared, tmp_path, small_slides, capsys):
    """best.pt alone on another machine with 8 flipped bytes inside a tensor: refused, never predicted with."""
    import torch

    from wsi_pipeline.checkpoints.files import load_checkpoint, save_checkpoint

    p = save_checkpoint(tmp_path / "a" / "best.pt", {"models": {"w": torch.linspace(0, 1, 4096)}, "epoch": 3})
    p.with_name("best.pt.sha256").unlink()  # copied alone
    assert load_checkpoint(p)["epoch"] == 3  # verified by the digest inside it, no sidecar needed
    raw = p.read_bytes()
    _flip(p, raw.index(torch.linspace(0, 1, 4096)[2000:2002].numpy().tobytes()), 8)
    with pytest.raises(ValueError, match=r"best\.pt.*(damaged|digest)"):
        load_checkpoint(p)
    # the same through predict, with a real run's best.pt copied alone
    copy = tmp_path / "copy" / "best.pt"
    copy.parent.mkdir()
    shutil.copy(shared / "runs" / "t" / "m" / "seed0" / "best.pt", copy)
    state = torch.load(copy, weights_only=True)
    w = next(v for v in state["models"]["aggregator"].values() if v.numel() >= 64)
    _flip(copy, copy.read_bytes().index(w.reshape(-1)[:8].numpy().tobytes()), 8)
    argv = ["predict", "--model", str(copy), "--slides", str(small_slides), "--out", str(tmp_path / "pred"), "--no-progress",
            "--no-heatmaps", "--allow-other-tiling", "--device", "cpu", "--workers", "0"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "best.pt" in err and "Traceback" not in err, err


def test_an_unverifiable_checkpoint_is_refused_unless_trusted(tmp_path):
    import torch

    from wsi_pipeline.checkpoints import files as ck

    p = tmp_path / "old.pt"
    torch.save({"format": ck.FORMAT, "models": {"w": torch.ones(3)}, "epoch": 1}, p)  # no digest, no sidecar
    with pytest.raises(ValueError, match=r"old\.pt.*(unverified|cannot be verified).*--trust-unverified"):
        ck.load_checkpoint(p)
    assert ck.load_checkpoint(p, trust_unverified=True)["epoch"] == 1


def test_the_shipped_tissue_model_is_verified_without_a_warning(caplog):
    from wsi_pipeline.tissue_seg.stage import load_tissue_model
    from wsi_pipeline.tissue_seg.tiling_mask import resolve_tissue_model

    with caplog.at_level("WARNING"):
        load_tissue_model(resolve_tissue_model(None))
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records


@pytest.mark.slow
def test_predict_takes_trust_unverified_for_an_old_checkpoint(shared, small_slides, tmp_path, capsys):
    import torch

    old = tmp_path / "old" / "best.pt"
    old.parent.mkdir()
    state = torch.load(shared / "runs" / "t" / "m" / "seed0" / "best.pt", weights_only=True)
    state.pop("integrity", None)
    torch.save(state, old)  # as an older version wrote it, copied without its .sha256
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(small_slides / "s0.svs", d / "s0.svs")
    argv = ["predict", "--model", str(old), "--slides", str(d), "--out", str(tmp_path / "pred"), "--no-progress",
            "--no-heatmaps", "--allow-other-tiling", "--device", "cpu", "--workers", "0"]
    assert main(argv) == 2 and "--trust-unverified" in capsys.readouterr().err
    assert main(argv + ["--trust-unverified"]) == 0
    from wsi_pipeline.checkpoints import files as ck

    with pytest.raises(ValueError, match="cannot be verified"):  # the flag lasts one command
        ck.load_checkpoint(old)


def _garble_metadata(store: Path, how: str) -> None:
    meta = store / "tiles" / "zarr.json"
    if how == "not json":
        meta.write_text('{"zarr_format": 3, "node_type": "arr')
    else:  # valid JSON, a shape the chunks do not hold
        raw = json.loads(meta.read_text())
        raw["shape"][0] = raw["shape"][0] + 7
        meta.write_text(json.dumps(raw))


@pytest.mark.parametrize("how", ["not json", "wrong shape"])
def test_tile_and_verify_agree_on_garbled_array_metadata(how, tiled, small_slides, tmp_path, capsys):
    tiles = _copy(tiled, tmp_path)
    _garble_metadata(tiles / "s1.zarr", how)
    assert main(["verify", "--tiles", str(tiles), "--no-progress"]) == 1
    assert "s1" in capsys.readouterr().out
    rc = main(["tile", "--slides", str(small_slides), "--out", str(tiles), "--no-progress", "--workers", "0",
               "--shard-tiles", "4", "--no-qc-images"])
    assert rc == 0
    report = pd.read_csv(tiles / "tiling_report.csv").set_index("slide_id")
    assert report.loc["s1", "status"] == "ok" and report.loc["s0", "status"] == "skipped"  # rebuilt, not "complete"
    assert main(["verify", "--tiles", str(tiles), "--no-progress"]) == 0


@pytest.mark.slow
def test_predict_over_stores_fails_only_the_damaged_one(shared, tiled, tmp_path, capsys):
    tiles = _copy(tiled, tmp_path)
    _garble_metadata(tiles / "s1.zarr", "not json")
    model = shared / "runs" / "t" / "m" / "seed0"
    argv = ["predict", "--model", str(model), "--slides", str(tiles), "--out", str(tmp_path / "pred"), "--no-progress",
            "--no-heatmaps", "--allow-other-tiling", "--device", "cpu", "--workers", "0"]
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 1 and "s1" in out.out + out.err and "Traceback" not in out.err, out.err
    assert sorted(pd.read_csv(tmp_path / "pred" / "predictions.csv")["slide_id"]) == ["s0", "s2"]


SQUARE = [[[0, 0], [100, 0], [100, 100], [0, 100], [0, 0]]]


def _feature(coords, name="a", kind="Polygon") -> dict:
    return {"type": "Feature", "geometry": {"type": kind, "coordinates": coords},
            "properties": {"name": name, "classification": {"name": "Tumor"}}}


@pytest.mark.parametrize("case,text,expected", [
    ("nan", json.dumps({"type": "FeatureCollection", "features": [
        _feature(SQUARE, "fine"), _feature([[[0, 0], [float("nan"), 0], [100, 100], [0, 0]]], "odd")]}),
     r"feature 1.*odd.*finite|feature 1.*finite"),
    ("inf", '{"type": "FeatureCollection", "features": [' + json.dumps(_feature(SQUARE)).replace("100, 0]", "1e999, 0]") + "]}",
     r"feature 0.*finite"),
    ("list of numbers", "[1, 2, 3]", r"item 0|not a GeoJSON|expected"),
    ("string features", '{"type": "FeatureCollection", "features": ["a", "b"]}', r"feature 0.*str"),
    ("string geometry", '{"type": "FeatureCollection", "features": [{"type": "Feature", "geometry": "x"}]}', r"feature 0.*geometry"),
    ("deep", "[" * 100_000 + "]" * 100_000, r"nested|deep"),
])
def test_malformed_regions_are_refused_naming_file_and_feature(case, text, expected, tmp_path):
    from wsi_pipeline.tiling.regions import read_regions

    p = tmp_path / f"{case.replace(' ', '_')}.geojson"
    p.write_text(text)
    with pytest.raises(ValueError, match=expected) as e:
        read_regions(p)
    assert str(p) in str(e.value) and len(str(e.value)) < 600


def test_a_huge_regions_file_is_refused_before_parsing(tmp_path, monkeypatch):
    import wsi_pipeline.tiling.regions as regions

    monkeypatch.setattr(regions, "MAX_REGIONS_BYTES", 1000)
    p = tmp_path / "big.geojson"
    p.write_text(json.dumps({"type": "FeatureCollection", "features": [_feature(SQUARE, f"f{i}") for i in range(50)]}))
    with pytest.raises(ValueError, match=r"big\.geojson.*larger than"):
        regions.read_regions(p)


def test_one_regions_file_is_parsed_once_per_run(small_slides, tmp_path, monkeypatch):
    import wsi_pipeline.tiling.regions as regions

    p = tmp_path / "all.geojson"
    p.write_text(json.dumps({"type": "FeatureCollection", "features": [_feature([[[0, 0], [600, 0], [600, 600], [0, 600], [0, 0]]])]}))
    parsed = []
    real = json.loads

    def counting(text, *a, **k):
        parsed.append(len(text))
        return real(text, *a, **k)

    monkeypatch.setattr(regions.json, "loads", counting)
    rc = main(["tile", "--slides", str(small_slides), "--out", str(tmp_path / "tiles"), "--no-progress", "--workers", "0",
               "--no-qc-images", "--regions", str(p)])
    assert rc == 0
    assert parsed.count(len(p.read_text())) == 1, parsed  # three slides, one parse of the regions file


@pytest.mark.parametrize("text", ["sub8x1000000000", "ens8x1000000000", "sub1000000000000x2"])
def test_a_subsample_protocol_is_bounded_up_front(text, shared, tmp_path, capsys):
    from wsi_pipeline.config.evaluation import parse_protocol

    with pytest.raises(ValueError, match=rf"{text}.*(at most|too many)"):
        parse_protocol(text)
    argv = ["predict", "--model", str(shared / "runs" / "t" / "m" / "seed0"), "--slides", str(tmp_path), "--out",
            str(tmp_path / "pred"), "--protocol", text, "--no-progress", "--device", "cpu"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and text in err and "Traceback" not in err, err


def test_an_unwritable_tensorboard_folder_is_refused_in_the_preflight(store_cohort, shared, tmp_path, capsys, monkeypatch):
    import wsi_pipeline.training.loop as loop

    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1, "log": "tensorboard"})
    run = tmp_path / "runs" / "t" / "m" / "seed0"
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("a file where the event folder goes")
    computed = []
    monkeypatch.setattr(loop, "train_run", lambda *a, **k: computed.append(1))
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "tensorboard" in err and "Traceback" not in err, err
    assert computed == []  # refused before any training


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\xe9\nmethods: []\n".encode("latin-1"))
    rc = main(["train", "--config", str(p)])
    err = capsys.readouterr().err
    assert rc == 2 and str(p) in err and "UTF-8" in err and "Traceback" not in err, err


def test_long_warnings_are_summarised(tmp_path, capsys):
    n = 5000
    df = pd.DataFrame({"slide_id": [f"s{i}" for i in range(n)], "path": ["same.svs"] * n, "label": [i % 2 for i in range(n)],
                       "split": [""] * n, "cohort": ["c"] * n})
    df.to_csv(tmp_path / "m.csv", index=False)
    assert main(["manifest", "split", "--manifest", str(tmp_path / "m.csv"), "--out", str(tmp_path / "o.csv")]) == 0
    err = capsys.readouterr().err
    assert "s0" in err and str(n) in err, err[:500]
    assert max(len(ln) for ln in err.splitlines()) < 1000


def test_an_empty_tiling_lock_is_a_visible_warning_not_a_hidden_wait(small_slides, tmp_path, caplog):
    out = tmp_path / "tiles"
    (out / ".locks").mkdir(parents=True)
    lock = out / ".locks" / "s0.lock"
    lock.write_bytes(b"")
    os.utime(lock, (os.path.getmtime(lock) - 2.5,) * 2)  # left by a run that died 2.5 s ago, not yet stale (4 s)
    with caplog.at_level("WARNING"):
        rc = main(["tile", "--slides", str(small_slides), "--out", str(out), "--no-progress", "--workers", "0", "--no-qc-images",
                   "--lock-stale-after", "4"])
    assert rc == 0
    assert any("s0" in r.getMessage() and "empty or unreadable" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING"), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("kind", ["pickle", "truncated"])
def test_bad_torchvision_weights_are_one_line_naming_the_file(kind, store_cohort, tmp_path, capsys):
    import torch

    from wsi_pipeline.models import build_encoder

    p = tmp_path / "w.pth"
    if kind == "pickle":
        torch.save({"model": torch.nn.Linear(2, 2)}, p)  # a pickled module: weights_only refuses it
    else:
        torch.save(build_encoder("resnet18").state_dict(), p)
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    rc = main(["features", "--manifest", str(store_cohort), "--tiles", str(store_cohort.parent / "tiles"),
               "--out", str(tmp_path / "f"), "--encoder", "resnet18", "--weights", str(p), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and str(p) in err and "Traceback" not in err, err


def test_a_huge_bootstrap_is_refused_up_front(store_cohort, shared, tmp_path, capsys):
    from wsi_pipeline.config.evaluation import EvalConfig
    from wsi_pipeline.config.schema import build

    with pytest.raises(ValueError, match="bootstrap"):
        build(EvalConfig, {"bootstrap": 10**9})
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1}, runs=str(shared / "runs"), results_dir=str(tmp_path / "r"))
    rc = main(["eval", "--config", str(cfg), "--bootstrap", str(10**9), "--no-progress", "--no-heatmaps"])
    err = capsys.readouterr().err
    assert rc == 2 and "--bootstrap" in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------
# Issue 51, part B: folds and labels fail by name, nothing overwrites its inputs, a checkpoint of
# another task or tiling is refused by eval, bounds on every user number
# ----------------------------------------------------------------------------------------------


def _labels(path: Path, ids: list[str], labels: list[int]) -> Path:
    pd.DataFrame({"slide_id": ids, "label": labels}).to_csv(path, index=False)
    return path


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("wsi-pipeline ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_crossval_of_a_one_class_labels_file_is_refused_naming_the_file_and_the_class(small_slides, tmp_path, capsys):
    d = tmp_path / "slides"
    d.mkdir()
    ids = [f"c{i:02d}" for i in range(6)]
    for i, sid in enumerate(ids):
        shutil.copy(small_slides / f"s{i % 3}.svs", d / f"{sid}.svs")
    one = _labels(tmp_path / "one.csv", ids, [1] * 6)
    out = tmp_path / "cv.csv"
    rc = main(["manifest", "folder", "--slides", str(d), "--labels", str(one), "--crossval", "3", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(one) in line and "one class" in line and "label 1" in line, line
    assert not out.exists() and not list(tmp_path.glob("cv_fold*.csv"))
    two = _labels(tmp_path / "two.csv", ids, [0, 1] * 3)  # the control: two classes cross-validate
    assert main(["manifest", "folder", "--slides", str(d), "--labels", str(two), "--crossval", "3", "--out", str(out)]) == 0
    assert out.is_file() and len(list(tmp_path.glob("cv_fold*.csv"))) == 3


@pytest.mark.parametrize("bad", ["../s0", "x/s0", "..", "a\\s0"])
def test_label_ids_are_matched_exactly_a_path_in_an_id_is_refused_naming_the_row(bad, small_slides, tmp_path, capsys):
    labels = _labels(tmp_path / "labels.csv", ["s1", bad, "s2"], [0, 1, 0])
    out = tmp_path / "m.csv"
    rc = main(["manifest", "folder", "--slides", str(small_slides), "--labels", str(labels), "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(labels) in line and bad in line and "row 2" in line, line
    assert not out.exists()
    # file endings are still taken off: s0.svs names slide s0
    _labels(labels, ["s1", "s0.svs", "s2"], [0, 1, 0])
    assert main(["manifest", "folder", "--slides", str(small_slides), "--labels", str(labels), "--out", str(out)]) == 0
    assert pd.read_csv(out).set_index("slide_id").loc["s0", "label"] == 1


def test_training_on_a_one_class_training_split_warns_naming_the_class(store_cohort, shared, tmp_path, caplog):
    df = pd.read_csv(store_cohort)
    train = df["split"] == "train"
    df.loc[train, "label"] = 1
    m = tmp_path / "m.csv"
    df.to_csv(m, index=False)
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    cfg = _cfg(tmp_path, m, shared, train={"epochs": 1})
    with caplog.at_level("WARNING"):
        assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "one class" in r.getMessage()]
    assert len(warned) == 1 and str(m) in warned[0] and "train split" in warned[0] and "class 1" in warned[0], [r.getMessage() for r in caplog.records]
    caplog.clear()
    (tmp_path / "ok").mkdir()
    cfg2 = _cfg(tmp_path / "ok", store_cohort, shared, train={"epochs": 1})
    with caplog.at_level("WARNING"):
        assert main(["train", "--config", str(cfg2), "--no-progress"]) == 0  # both classes: no such warning
    assert not [r for r in caplog.records if "one class" in r.getMessage()]


def test_eval_folds_checks_every_fold_before_evaluating_any(store_cohort, shared, tmp_path, capsys):
    cv = tmp_path / "cv.csv"
    assert main(["manifest", "split", "--manifest", str(store_cohort), "--crossval", "3", "--out", str(cv)]) == 0
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    cfg = _cfg(tmp_path, cv, shared, train={"epochs": 1}, results_dir=str(tmp_path / "results"))
    assert main(["train", "--config", str(cfg), "--folds", "--no-progress", "--quiet"]) == 0
    (tmp_path / "runs" / "t_fold1" / "m" / "seed0" / "done").unlink()  # fold 1 unfinished
    shutil.rmtree(tmp_path / "runs" / "t_fold2")  # fold 2 never trained
    capsys.readouterr()
    rc = main(["eval", "--config", str(cfg), "--folds", "--no-progress", "--no-heatmaps", "--bootstrap", "0"])
    out = capsys.readouterr()
    line = _one_error_line(out.err)
    assert rc == 2 and "t_fold1" in line and "t_fold2" in line and "t_fold0" not in line, line
    assert "evaluating" not in out.out
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_predict_out_inside_the_slides_folder_is_refused_before_any_work(shared, small_slides, tmp_path, capsys):
    d = tmp_path / "new"
    d.mkdir()
    shutil.copy(small_slides / "s0.svs", d / "s0.svs")
    model = shared / "runs" / "t" / "m" / "seed0"
    for out in (d / "pred", d, d / "a" / "b"):
        rc = main(["predict", "--model", str(model), "--slides", str(d), "--out", str(out), "--no-progress",
                   "--device", "cpu", "--workers", "0"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and "--out" in line and "--slides" in line and str(d) in line, line
    assert sorted(p.name for p in d.iterdir()) == ["s0.svs"]


def test_tile_out_inside_the_slides_folder_is_refused_before_any_work(small_slides, tmp_path, capsys):
    d = tmp_path / "slides"
    shutil.copytree(small_slides, d)
    before = sorted(p.name for p in d.iterdir())
    for out in (d / "tiles", d):
        rc = main(["tile", "--slides", str(d), "--out", str(out), "--no-progress", "--workers", "0", "--no-qc-images"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and "--out" in line and "--slides" in line, line
    assert sorted(p.name for p in d.iterdir()) == before


def test_manifest_out_equal_to_its_labels_file_is_refused(small_slides, tmp_path, capsys, monkeypatch):
    labels = _labels(tmp_path / "labels.csv", ["s0", "s1", "s2"], [0, 1, 0])
    text = labels.read_text()
    monkeypatch.chdir(tmp_path)
    for out in (str(labels), "labels.csv", "./sub/../labels.csv"):
        rc = main(["manifest", "folder", "--slides", str(small_slides), "--labels", str(labels), "--out", out])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and "--out" in line and "--labels" in line, line
        assert labels.read_text() == text


def test_eval_refuses_a_checkpoint_of_another_task_naming_both(store_cohort, shared, tmp_path, capsys):
    import dataclasses

    import torch

    from wsi_pipeline.methods.endpoints import Endpoint

    def survival(ckpt):
        config = json.loads(json.dumps(ckpt.config))
        method = {**ckpt.method, "task": "survival", "loss": "cox"}
        config["methods"] = [method]
        config["data"]["n_classes"] = None
        agg = dict(ckpt.models["aggregator"])
        last = [k for k, v in agg.items() if v.ndim >= 1 and v.shape[0] == 2][-2:]  # the classifier's weight and bias
        agg.update({k: torch.zeros((1, *agg[k].shape[1:]), dtype=agg[k].dtype) for k in last})
        return dataclasses.replace(ckpt, config=config, method=method, models={**ckpt.models, "aggregator": agg},
                                   endpoint=Endpoint(task="survival", loss="cox", n_outputs=1).to_state())

    run = replace_best(shared, tmp_path, survival)
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1}, results_dir=str(tmp_path / "results"))
    rc = main(["eval", "--config", str(cfg), "--no-progress", "--no-heatmaps", "--bootstrap", "0"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(run / "best.pt") in line and "'survival'" in line and "'classification'" in line, line
    assert not list((tmp_path / "results").rglob("*.csv")) if (tmp_path / "results").exists() else True


def test_eval_refuses_a_checkpoint_of_another_tiling_naming_both(store_cohort, shared, tmp_path, capsys):
    import dataclasses

    def other_tiling(ckpt):
        config = json.loads(json.dumps(ckpt.config))
        config["data"]["tiling"]["tile_size"] = 64
        return dataclasses.replace(ckpt, config=config)

    run = replace_best(shared, tmp_path, other_tiling)
    cfg = _cfg(tmp_path, store_cohort, shared, train={"epochs": 1}, results_dir=str(tmp_path / "results"))
    rc = main(["eval", "--config", str(cfg), "--no-progress", "--no-heatmaps", "--bootstrap", "0"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(run / "best.pt") in line and "tile_size" in line and "64" in line and "32" in line, line
    # the run's own checkpoint, with eval-only settings changed (bootstrap, heatmaps), is evaluated
    for p in run.glob("best.pt*"):
        p.unlink()
    shutil.copy(shared / "runs" / "t" / "m" / "seed0" / "best.pt", run / "best.pt")
    for p in (shared / "runs" / "t" / "m" / "seed0").glob("best.pt.*"):
        shutil.copy(p, run / p.name)
    assert main(["eval", "--config", str(cfg), "--no-progress", "--no-heatmaps", "--bootstrap", "0"]) == 0


@pytest.mark.parametrize("section,key,value,allowed", [
    ("train", "epochs", 10**23, "100000"),
    ("train", "bag_size", 10**12, "1000000"),
    ("train", "batch_bags", 10**9, "10000"),
    ("method", "chunk_size", 10**9, "100000"),
    ("tiling", "tile_size", 100_000_000, "8192"),
])
def test_user_numbers_out_of_range_are_refused_up_front_with_the_range(section, key, value, allowed, store_cohort, tmp_path,
                                                                       capsys):
    (tmp_path / "tiles").symlink_to(store_cohort.parent / "tiles")
    cfg = _cfg(tmp_path, store_cohort)
    raw = yaml.safe_load(cfg.read_text())
    {"train": raw["train"], "method": raw["methods"][0], "tiling": raw["data"]["tiling"]}[section][key] = value
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    rc = main(["train", "--config", str(cfg), "--no-progress"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and key in line and str(value) in line and allowed in line, line
    assert not (tmp_path / "runs").exists()


def test_tile_refuses_a_huge_tile_size_with_the_range(small_slides, tmp_path, capsys):
    out = tmp_path / "tiles"
    rc = main(["tile", "--slides", str(small_slides), "--out", str(out), "--tile-size", "100000000", "--no-progress",
               "--workers", "0"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "tile" in line and "100000000" in line and "8192" in line, line
    assert not out.exists()
