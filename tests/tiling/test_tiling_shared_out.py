"""Runs sharing one --out (slide locks, merged report), outputs checked before work, and no slides as an error."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import zarr

from wsi_pipeline.cli.main import main
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline import output_dirs as outdir
from wsi_pipeline.tiling import cohort as tiling_cohort, pool
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.locks import LockDir
from wsi_pipeline.output_dirs import OutputDirError
from wsi_pipeline.tiling.report import _merge_rows
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import is_complete
from wsi_pipeline.tiling.job import SlideJob, SlideResult

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

# Runs the CLI with tile_slide wrapped: each real tiling (made after the slide's lock is held) is
# appended to a log as "<slide_id> <status>", and slowed by a delay so that runs overlap.
_WRAPPER = """
import sys, time
import wsi_pipeline.tiling.cohort as runner
from wsi_pipeline.cli.main import main
log, delay = sys.argv[1], float(sys.argv[2])
orig = runner.tile_slide
def wrapped(job, *args, **kwargs):
    with open(log, "a") as f:
        f.write(f"{job.slide_id} start\\n")
    time.sleep(delay)
    r = orig(job, *args, **kwargs)
    with open(log, "a") as f:
        f.write(f"{job.slide_id} {r.status}\\n")
    return r
runner.tile_slide = wrapped
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cohort")
    for k in range(6):
        make_slide(folder / f"s{k}.svs", size=384, seed=40 + k, tissue_fraction=0.6)
    return folder


def _wrapper(tmp_path: Path) -> Path:
    p = tmp_path / "wrapped_tile.py"
    p.write_text(_WRAPPER)
    return p


def _lines(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []  # type: ignore[misc]


def _wait_for(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------------------------- locks


def _write_lock(path: Path, host: str, pid: int, age_s: float) -> None:
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01T00:00:00+00:00", "token": "x" * 16}))
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_lock_is_exclusive_and_stale_rules(tmp_path: Path, caplog) -> None:
    a = LockDir(tmp_path, stale_after_s=60, heartbeat_s=10)
    b = LockDir(tmp_path, stale_after_s=60, heartbeat_s=10)
    assert a.try_acquire("s1") and not b.try_acquire("s1")  # one holder (same pid, other token: live)
    info = json.loads((tmp_path / "s1.lock").read_text())
    assert info["host"] == socket.gethostname() and info["pid"] == os.getpid() and info["started"]
    a.release("s1")
    assert not (tmp_path / "s1.lock").exists() and b.try_acquire("s1")

    # another host, refreshed 10 s ago: live; 61 s ago (> 60 s without a heartbeat): stale
    _write_lock(tmp_path / "far.lock", "other-host.example", 4242, age_s=10)
    assert not a.try_acquire("far")
    _write_lock(tmp_path / "far.lock", "other-host.example", 4242, age_s=61)
    with caplog.at_level(logging.WARNING, logger="wsi_pipeline.tiling.locks"):
        assert a.try_acquire("far")
    assert "took over the stale lock" in caplog.text and "not refreshed for 61 s" in caplog.text
    assert json.loads((tmp_path / "far.lock").read_text())["pid"] == os.getpid()

    # this host: a live process's fresh lock is respected, a finished process's is taken over at once
    _write_lock(tmp_path / "live.lock", socket.gethostname(), os.getppid(), age_s=0)
    assert not a.try_acquire("live")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lock(tmp_path / "dead.lock", socket.gethostname(), int(done.stdout), age_s=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_pipeline.tiling.locks"):
        assert a.try_acquire("dead")
    assert "its process is gone" in caplog.text


def test_heartbeat_refreshes_and_notices_a_lost_lock(tmp_path: Path, caplog) -> None:
    with LockDir(tmp_path, stale_after_s=2.0, heartbeat_s=0.05) as locks:
        assert locks.try_acquire("s") and locks.try_acquire("t")
        old = time.time() - 100
        os.utime(tmp_path / "s.lock", (old, old))
        assert _wait_for(lambda: time.time() - (tmp_path / "s.lock").stat().st_mtime < 1.0, 5)
        _write_lock(tmp_path / "t.lock", "other-host.example", 1, age_s=0)  # someone took "t" over
        with caplog.at_level(logging.WARNING, logger="wsi_pipeline.tiling.locks"):
            assert _wait_for(lambda: not locks.held("t"), 5)
        assert "t.lock was taken over by host other-host.example" in caplog.text
    assert not (tmp_path / "s.lock").exists()  # released on exit
    assert (tmp_path / "t.lock").exists()  # not ours any more: left alone


def test_report_merge_keeps_finished_rows_of_other_runs() -> None:
    jobs = [SlideJob("a", "/a.svs"), SlideJob("b", "/b.svs"), SlideJob("c", "/c.svs")]
    existing = [
        {"slide_id": "a", "status": "ok", "n_tiles": "7"},  # another run finished it
        {"slide_id": "b", "status": "pending", "n_tiles": "0"},
        {"slide_id": "z", "status": "ok", "n_tiles": "3"},  # a slide only the other run has
    ]
    rows = {r["slide_id"]: r for r in _merge_rows(existing, [None, None, SlideResult("c", "ok", n_tiles=2)], jobs, final=True)}
    assert rows["a"]["status"] == "ok" and rows["a"]["n_tiles"] == "7"  # our unfinished view never replaces it
    assert rows["b"]["status"] == "failed" and "not processed" in rows["b"]["error"]
    assert rows["c"]["n_tiles"] == 2 and rows["z"]["status"] == "ok" and len(rows) == 4
    rows = {r["slide_id"]: r for r in _merge_rows(existing, [SlideResult("a", "failed", error="boom"), None, None], jobs, final=False)}
    assert rows["a"]["status"] == "failed" and rows["c"]["status"] == "pending"  # our finished result replaces


# ----------------------------------------------------------------------- runs sharing one folder


@pytest.mark.slow
def test_two_runs_on_one_folder_tile_each_slide_once(tmp_path: Path, cohort: Path) -> None:
    out = tmp_path / "tiles"
    wrapper = _wrapper(tmp_path)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    args = ["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(out), "--workers", "0", "--no-progress", "--tile-size", "64"]
    first = subprocess.Popen([sys.executable, str(wrapper), str(logs[0]), "1.0", *args], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: bool(_lines(logs[0]))), "the first run never started a slide"
    second = subprocess.Popen([sys.executable, str(wrapper), str(logs[1]), "1.0", *args], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=240) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outs

    done = [[sid for sid, what in _lines(log) if what == "ok"] for log in logs]
    ids = sorted(p.stem for p in cohort.glob("*.svs"))
    assert sorted(done[0] + done[1]) == ids  # every slide tiled exactly once, by one of the runs
    assert done[0] and done[1], f"the runs did not overlap: {done}"  # both did part of the work
    assert all(what != "failed" for log in logs for _, what in _lines(log))
    for (stdout, _), mine in zip(outs, done):
        assert f"{len(mine)} tiled" in stdout and f"{len(ids) - len(mine)} reused" in stdout

    report = pd.read_csv(out / "tiling_report.csv", keep_default_na=False)
    assert sorted(report["slide_id"]) == ids  # one row per slide
    assert set(report["status"]) <= {"ok", "skipped"}
    for sid in ids:
        assert is_complete(out / f"{sid}.zarr")
    assert not list((out / ".locks").glob("*.lock"))  # all released


@pytest.mark.slow
def test_a_run_killed_holding_a_lock_is_taken_over(tmp_path: Path, cohort: Path, caplog) -> None:
    out = tmp_path / "tiles"
    log = tmp_path / "killed.log"
    args = ["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(out), "--workers", "0", "--no-progress", "--tile-size", "64"]
    proc = subprocess.Popen([sys.executable, str(_wrapper(tmp_path)), str(log), "600", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: bool(_lines(log))), "the run never started a slide"
    held = _lines(log)[0][0]
    lock = out / ".locks" / f"{held}.lock"
    assert json.loads(lock.read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert lock.exists()  # the killed run could not clean up

    # the lock is fresh (well inside lock_stale_s), but its process is gone on this host: taken over
    with caplog.at_level(logging.WARNING, logger="wsi_pipeline.tiling.locks"):
        rep = tile_cohort(cohort, out, TilingConfig(method="greyscale", qc_mode="off", tile_size=64), workers=0, progress=False)
    assert f"took over the stale lock {lock}" in caplog.text and "its process is gone" in caplog.text
    assert rep.ok and rep.count("ok") == 6
    report = pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id")
    assert report.loc[held, "status"] == "ok" and len(report) == 6
    assert not list((out / ".locks").glob("*.lock"))


@pytest.mark.slow
def test_killing_a_runner_kills_its_worker_too(tmp_path: Path) -> None:
    folder = tmp_path / "slides"
    make_slide(folder / "big.svs", size=1024, seed=3, tissue_fraction=0.7)
    out = tmp_path / "tiles"
    cmd = [sys.executable, "-m", "wsi_pipeline.cli.main", "tile", "--method", "greyscale", "--qc", "off", "--slides", str(folder), "--out", str(out),
           "--workers", "1", "--tile-size", "32", "--no-progress"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    temps: list[Path] = []
    assert _wait_for(lambda: bool(temps.extend(out.glob(".big.zarr.tmp-*")) or temps), 120), "no worker started writing"
    worker = int(temps[0].name.rsplit("-", 1)[1])
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    def gone() -> bool:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{worker}/status").exists() and "zombie" in Path(f"/proc/{worker}/status").read_text()

    assert _wait_for(gone, 10), "the worker outlived its runner and would race the next run"
    rep = tile_cohort(folder, out, TilingConfig(method="greyscale", qc_mode="off", tile_size=32), workers=0, progress=False)
    assert rep.ok and rep.count("ok") == 1 and is_complete(out / "big.zarr")
    assert zarr.open_group(str(out / "big.zarr"), mode="r").attrs["n_tiles"] == rep.results[0].n_tiles


# ------------------------------------------------------------------------------ output checks


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err


def test_out_that_is_a_file_or_under_a_file_is_one_error(tmp_path: Path, cohort: Path, capsys) -> None:
    afile = tmp_path / "taken.txt"
    afile.write_text("x")
    for bad, why in ((afile, "is an existing file"), (afile / "tiles", f"{afile} is a file, not a folder")):
        code = main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(bad), "--workers", "0", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert str(bad) in err and why in err and err.count("error:") == 1
        _no_traceback(err)
    assert afile.read_text() == "x"


def test_read_only_out_is_one_error_before_any_work(tmp_path: Path, cohort: Path, capsys, monkeypatch) -> None:
    def read_only(folder: Path) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / ".write-test"))

    monkeypatch.setattr(outdir, "_probe_write", read_only)
    called = []
    monkeypatch.setattr(tiling_cohort, "tile_slide", lambda *a, **k: called.append(a))
    out = tmp_path / "tiles"
    code = main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(out), "--workers", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and not called
    assert f"output folder {out} is not usable: cannot write in it: Read-only file system" in err
    assert "read-only; choose a folder on a writable disk" in err
    _no_traceback(err)
    assert not (out / "tiling_report.csv").exists()  # no slide marked failed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 folder anyway; the read-only case is covered by the monkeypatched probe")
def test_permission_denied_out(tmp_path: Path, cohort: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code = main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(cohort), "--out", str(locked / "tiles"), "--workers", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Permission denied" in err
    _no_traceback(err)


def test_output_failing_mid_run_stops_the_run_instead_of_failing_slides(tmp_path: Path, cohort: Path, monkeypatch) -> None:
    out = tmp_path / "tiles"
    seen: list[str] = []

    def disk_gone(job, *a, **k):  # the store write fails because the output folder turned read-only
        seen.append(job.slide_id)
        def read_only(folder: Path) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(outdir, "_probe_write", read_only)
        return SlideResult(job.slide_id, "failed", error=f"OSError: [Errno 30] Read-only file system: '{out}/x'", path=job.path)

    monkeypatch.setattr(tiling_cohort, "tile_slide", disk_gone)
    with pytest.raises(OutputDirError, match=r"output folder .*tiles is not usable: cannot write in it: Read-only.*while tiling s0"):
        tile_cohort(cohort, out, workers=0, progress=False)
    assert seen == ["s0"]  # stopped at the first: the other slides were not each failed for it
    report = pd.read_csv(out / "tiling_report.csv", keep_default_na=False)
    assert not report["error"].str.contains("Read-only").any()  # no slide blamed for the output


def test_worker_death_messages_name_the_cause() -> None:
    assert "out-of-memory" in pool._death_message(-signal.SIGKILL)
    assert "crashed (SIGSEGV) inside the slide reader" in pool._death_message(-signal.SIGSEGV)
    assert "exited with code 3" in pool._death_message(3)


# -------------------------------------------------------------------------------- no slides


def test_no_slides_is_an_error_naming_the_folder_and_extensions(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    (empty / "photo.gif").write_bytes(b"x")  # not an image ending read as a slide (.png .jpg .jpeg .bmp are)
    code = main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(empty), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"no slide files under {empty}" in err and ".svs" in err and ".ome.tiff" in err and ".dcm" in err
    assert "notes.txt" in err and "photo.gif" in err and ".png" in err
    _no_traceback(err)
    assert not (tmp_path / "out").exists()  # nothing written

    manifest = tmp_path / "m.csv"
    manifest.write_text("slide_id,path\n")
    code = main(["tile", "--method", "greyscale", "--qc", "off", "--manifest", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and str(manifest) in err
    _no_traceback(err)


def test_overwrite_does_not_rebuild_what_another_run_rebuilt_meanwhile(tmp_path: Path, cohort: Path, monkeypatch) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    for k in (0, 1):
        (folder / f"s{k}.svs").symlink_to(cohort / f"s{k}.svs")
    out = tmp_path / "tiles"
    cfg = TilingConfig(method="greyscale", qc_mode="off", tile_size=64)
    assert tile_cohort(folder, out, cfg, workers=0, progress=False).count("ok") == 2
    # back to back, --overwrite rebuilds everything (a store finished just before a run started is old)
    assert tile_cohort(folder, out, cfg, workers=0, progress=False, overwrite=True).count("ok") == 2
    orig = tiling_cohort.tile_slide
    tiled: list[str] = []

    def and_another_run(job, *a, **k):
        tiled.append(job.slide_id)
        if job.slide_id == "s0":  # meanwhile another --overwrite run rebuilds s1
            orig(SlideJob("s1", str(folder / "s1.svs")), out, cfg, overwrite=True)
        return orig(job, *a, **k)

    monkeypatch.setattr(tiling_cohort, "tile_slide", and_another_run)
    rep = tile_cohort(folder, out, cfg, workers=0, progress=False, overwrite=True)
    by_id = {r.slide_id: r for r in rep.results}
    assert tiled == ["s0"] and by_id["s0"].status == "ok"
    assert by_id["s1"].status == "skipped" and "rebuilt by another run" in by_id["s1"].note


def test_an_output_write_error_is_not_blamed_on_the_slide(tmp_path: Path, cohort: Path, monkeypatch) -> None:
    out = tmp_path / "tiles"
    store = out / ".s0.zarr.tmp-1" / "tiles"

    def denied(job, *a, **k):  # a write error on the output that the probe does not see (a subfolder's permissions)
        return SlideResult(job.slide_id, "failed", error=f"PermissionError: [Errno 13] Permission denied: '{store}'", path=job.path)

    monkeypatch.setattr(tiling_cohort, "tile_slide", denied)
    rep = tile_cohort(cohort, out, workers=0, progress=False)
    errors = {r.slide_id: r.error for r in rep.results}
    assert errors["s0"].startswith("writing to the output folder failed (the slide itself may be fine): PermissionError: [Errno 13]")


def test_a_full_disk_stops_the_run_at_the_first_slide(tmp_path: Path, cohort: Path, monkeypatch) -> None:
    """A full disk fails every remaining slide alike: the run stops with one error (the issue-34 case)."""
    out = tmp_path / "tiles"
    tried = []

    def full_disk(job, *a, **k):  # as a worker reports it: text, even when the probe still finds room
        tried.append(job.slide_id)
        return SlideResult(job.slide_id, "failed", error=f"OSError: [Errno 28] No space left on device: '{out}'", path=job.path)

    monkeypatch.setattr(tiling_cohort, "tile_slide", full_disk)
    with pytest.raises(OutputDirError, match="disk is full"):
        tile_cohort(cohort, out, workers=0, progress=False)
    assert len(tried) == 1
