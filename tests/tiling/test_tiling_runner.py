"""`wsi-pipeline tile` end to end: real scans against brute force, bad inputs, crash and resume,
the pre-screen, target resolution, compression and QC images."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import openslide
import pandas as pd
import pytest
import tifffile
import zarr

from wsi_pipeline.cli.main import main
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.sources import jobs_from_folder
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import StoreDamagedError, is_complete, open_store
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.config.tiling_params import GreyscaleParams
from wsi_pipeline.tiling.tiler import tile_slide

REPO = Path(__file__).resolve().parents[2]


def _report(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id")


def _brute_greyscale(rgb: np.ndarray, T: int, lo: int = 3, hi: int = 230, keep: float = 0.6) -> dict[tuple[int, int], float]:
    """Independent reference: every full T x T tile on the (0, 0) grid, kept at >= keep foreground."""
    g = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY).astype(np.int32)
    fg = (g >= lo) & (g <= hi)
    out = {}
    for y in range(0, g.shape[0] - T + 1, T):
        for x in range(0, g.shape[1] - T + 1, T):
            f = fg[y : y + T, x : x + T].mean()
            if f >= keep:
                out[(x, y)] = f
    return out


def _tifffile_level0(path: Path) -> np.ndarray:
    with tifffile.TiffFile(path) as tf:
        return tf.pages[0].asarray()


# ---------------------------------------------------------------------------------- real scans


@pytest.mark.real_slides
@pytest.mark.slow
def test_real_svs_greyscale_level0_equals_brute_force(real_slides_dir: Path, tmp_path: Path, capsys) -> None:
    src = real_slides_dir / "CMU-1-Small-Region.svs"
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / src.name).symlink_to(src)
    out = tmp_path / "tiles"
    assert main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(folder), "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    assert "1 tiled" in capsys.readouterr().out

    # reference: OpenSlide (not the package) reads level 0; numpy/cv2 test every full tile
    osr = openslide.OpenSlide(str(src))
    w, h = osr.dimensions
    rgba = np.asarray(osr.read_region((0, 0), 0, (w, h)))
    assert (rgba[..., 3] == 255).all()
    rgb = rgba[..., :3]
    assert (w // 256) * (h // 256) == 88
    ref = _brute_greyscale(rgb, 256)

    store = open_store(out / "CMU-1-Small-Region.zarr")
    assert store.attrs["grid_shape"] == [h // 256, w // 256]
    got = {(int(x), int(y)) for x, y in store.coords}
    assert got == set(ref) and len(got) > 0
    np.testing.assert_allclose(store.foreground, [ref[(int(x), int(y))] for x, y in store.coords], atol=1e-6)
    np.testing.assert_array_equal(store.grid, store.coords // 256)
    tiles = store.read()
    for i, (x, y) in enumerate(store.coords):
        direct = np.asarray(osr.read_region((int(x), int(y)), 0, (256, 256)))[..., :3]
        np.testing.assert_array_equal(tiles[i], direct)
    assert store.attrs["mpp"] == pytest.approx(0.499) and store.attrs["complete"] is True
    report = _report(out)
    assert report.loc["CMU-1-Small-Region", "status"] == "ok"
    assert int(report.loc["CMU-1-Small-Region", "n_tiles"]) == len(ref)
    assert (out / "qc" / "CMU-1-Small-Region.png").is_file()


@pytest.mark.real_slides
def test_real_svs_otsu_keeps_tissue_and_its_borders(real_slides_dir: Path, tmp_path: Path) -> None:
    src = real_slides_dir / "CMU-1-Small-Region.svs"
    rep = tile_cohort([SlideJob("cmu", str(src))], tmp_path, TilingConfig(method="otsu"), workers=0, progress=False)
    assert rep.ok and rep.results[0].n_tiles > 0
    store = open_store(tmp_path / "cmu.zarr")
    osr = openslide.OpenSlide(str(src))
    w, h = osr.dimensions
    g = cv2.cvtColor(np.ascontiguousarray(np.asarray(osr.read_region((0, 0), 0, (w, h)))[..., :3]), cv2.COLOR_RGB2GRAY)
    background = np.median(g[g > np.percentile(g, 50)])  # the glass: the bright half's median
    kept = {(int(x), int(y)) for x, y in store.coords}
    stats = {}
    for y in range(0, h - 255, 256):
        for x in range(0, w - 255, 256):
            t = g[y : y + 256, x : x + 256]
            stats[(x, y)] = (t.mean(), (t > background - 10).mean())  # mean grey, fraction of glass pixels
    assert all(stats[k][0] < background - 10 for k in kept)  # kept tiles are darker than the glass
    assert not any(stats[k][1] > 0.95 for k in kept)  # no glass-only tile kept
    assert all(k not in kept for k, (_, glass) in stats.items() if glass > 0.98)  # glass tiles dropped
    assert any(0.2 < stats[k][1] < 0.8 for k in kept)  # tiles on the tissue border are kept
    assert store.attrs["method"] == "otsu" and store.attrs["otsu_info"]["background"] == "bright"


@pytest.mark.real_slides
@pytest.mark.filterwarnings("ignore:hamamatsu-format metadata parsing")
def test_real_ndpi_and_dicom_are_tiled_or_reported(real_slides_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "slides"
    (folder / "dicom-bone").mkdir(parents=True)
    (folder / "test3-DAPI-2-387.ndpi").symlink_to(real_slides_dir / "test3-DAPI-2-387.ndpi")
    (folder / "dicom-bone" / "jpeg.dcm").symlink_to(real_slides_dir / "dicom-bone" / "jpeg.dcm")
    rep = tile_cohort(folder, tmp_path / "out", workers=0, progress=False)
    by_id = {r.slide_id: r for r in rep.results}
    assert set(by_id) == {"test3-DAPI-2-387", "dicom-bone"}
    for r in rep.results:
        assert r.status == "ok" or (r.status == "failed" and len(r.error) > 20) or r.note.startswith("skipped: dark background"), r
    assert by_id["test3-DAPI-2-387"].status == "skipped"  # fluorescence: dark background (tests/test_background.py)
    assert by_id["dicom-bone"].status == "ok" and open_store(tmp_path / "out" / "dicom-bone.zarr").attrs["backend"] == "openslide"
    # forcing tiffslide on the DICOM slide: a failed row that says why
    rep = tile_cohort(folder, tmp_path / "out_ts", TilingConfig(method="greyscale", qc_mode="off", backend="tiffslide"), workers=0, progress=False)
    dicom = next(r for r in rep.results if r.slide_id == "dicom-bone")
    assert dicom.status == "failed" and "tiffslide" in dicom.error and "not a TIFF" in dicom.error


# -------------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def good_slide(tmp_path_factory) -> Path:
    return make_slide(tmp_path_factory.mktemp("good") / "good.svs", size=1024, seed=21, n_lesions=1, tissue_fraction=0.5).path


@pytest.mark.slow
def test_bad_inputs_in_a_folder_get_specific_rows_and_the_rest_is_tiled(tmp_path: Path, good_slide: Path, capsys) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "good.svs").symlink_to(good_slide)
    (folder / "zero.svs").write_bytes(b"")
    (folder / "notes.svs").write_text("scanner export log\n" * 100)
    (folder / "noise.tiff").write_bytes(np.random.default_rng(0).bytes(50_000))
    make_slide(folder / "blank.svs", size=768, seed=2, blank=True)
    out = tmp_path / "tiles"
    code = main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(folder), "--out", str(out), "--workers", "2", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 1
    assert "3 failed" in text and "2 tiled" in text
    r = _report(out)
    assert r.loc["zero", "status"] == "failed" and "empty (0 bytes)" in r.loc["zero", "error"]
    assert r.loc["notes", "status"] == "failed"
    assert "openslide: " in r.loc["notes", "error"] and "tiffslide: " in r.loc["notes", "error"]
    assert r.loc["noise", "status"] == "failed" and "not a readable whole-slide image" in r.loc["noise", "error"]
    # documented choice: a blank slide is a valid, deterministic result (ok, 0 tiles, with a note),
    # so a rerun skips it instead of retrying it forever
    assert r.loc["blank", "status"] == "ok" and int(r.loc["blank", "n_tiles"]) == 0
    assert "no foreground tiles" in r.loc["blank", "note"]
    assert len(open_store(out / "blank.zarr")) == 0
    assert r.loc["good", "status"] == "ok" and len(open_store(out / "good.zarr")) == int(r.loc["good", "n_tiles"]) > 0
    for bad in ("zero", "notes", "noise"):
        assert not (out / f"{bad}.zarr").exists()


def test_manifest_missing_file_and_missing_mpp(tmp_path: Path, good_slide: Path, capsys) -> None:
    make_slide(tmp_path / "nompp.svs", size=768, seed=5, mpp=None, tissue_fraction=0.5)  # a slide without mpp
    manifest = tmp_path / "m.csv"
    pd.DataFrame({
        "slide_id": ["good", "gone", "nompp", "nompp_fixed"],
        "path": [str(good_slide), "missing/gone.svs", "nompp.svs", "nompp.svs"],
        "label": [1, 0, 0, 0],
        "mpp": [None, None, None, 0.5],
    }).to_csv(manifest, index=False)
    out = tmp_path / "tiles"
    args = ["tile", "--method", "greyscale", "--qc", "off", "--manifest", str(manifest), "--out", str(out), "--workers", "0", "--no-progress", "--mpp-target", "1.0"]
    assert main(args) == 1
    assert "2 failed" in capsys.readouterr().out
    r = _report(out)
    assert r.loc["gone", "status"] == "failed" and "slide file not found" in r.loc["gone", "error"]
    assert "gone.svs" in r.loc["gone", "error"]
    err = r.loc["nompp", "error"]
    assert r.loc["nompp", "status"] == "failed"
    assert "'nompp'" in err and "--mpp-target 1" in err and "--mpp <um/px>" in err and "`mpp` column" in err
    assert r.loc["nompp_fixed", "status"] == "ok" and r.loc["good", "status"] == "ok"
    assert open_store(out / "good.zarr").attrs["mpp"] == pytest.approx(1.0)
    # the run-wide --mpp fixes the slide; the manifest's own value still wins where given
    assert main(args[:-2] + ["--mpp-target", "1.0", "--mpp", "0.5"]) == 1  # "gone" still fails
    r = _report(out)
    assert r.loc["nompp", "status"] == "ok" and r.loc["nompp_fixed", "status"] == "skipped"


# ------------------------------------------------------------------------ interruption, resume


@pytest.mark.slow
def test_sigkill_of_a_worker_mid_slide_then_rerun(tmp_path: Path) -> None:
    folder = tmp_path / "slides"
    make_slide(folder / "a_small.svs", size=512, seed=31, tissue_fraction=0.5)
    make_slide(folder / "b_big.svs", size=1024, seed=32, tissue_fraction=0.6)
    make_slide(folder / "c_small.svs", size=512, seed=33, tissue_fraction=0.5)
    out = tmp_path / "tiles"
    # 32 px tiles: ~600 kept tiles on b_big, so killing it mid-slide is easy to time (~19 shards of 32 tiles)
    cmd = [sys.executable, "-m", "wsi_pipeline.cli.main", "tile", "--method", "greyscale", "--qc", "off", "--slides", str(folder), "--out", str(out),
           "--workers", "1", "--tile-size", "32", "--no-progress", "--shard-tiles", "32"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        temps = list(out.glob(".b_big.zarr.tmp-*")) if out.exists() else []
        chunks = list((temps[0] / "tiles").glob("c.*")) if temps else []
        if len(chunks) >= 5:  # mid-slide: tiles are being written
            killed = int(temps[0].name.rsplit("-", 1)[1])
            assert not zarr.open_group(str(temps[0]), mode="r").attrs["complete"]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.005)
    stdout, stderr = proc.communicate(timeout=120)
    assert killed is not None, f"never caught b_big mid-slide: {stdout} {stderr}"
    assert proc.returncode == 1, stderr
    r = _report(out)
    assert r.loc["b_big", "status"] == "failed" and "SIGKILL" in r.loc["b_big", "error"]
    assert r.loc["a_small", "status"] == "ok" and r.loc["c_small", "status"] == "ok"
    assert not (out / "b_big.zarr").exists() and not list(out.glob(".b_big.zarr.tmp-*"))
    for store in out.glob("*.zarr"):
        assert is_complete(store)

    # rerun (in this process this time): the finished slides are skipped, the killed one is
    # rebuilt completely and correctly
    assert main(["tile", "--method", "greyscale", "--qc", "off", "--slides", str(folder), "--out", str(out), "--workers", "0", "--tile-size", "32", "--no-progress"]) == 0
    r = _report(out)
    assert r.loc["a_small", "status"] == "skipped" and r.loc["c_small", "status"] == "skipped"
    assert r.loc["b_big", "status"] == "ok"
    got = open_store(out / "b_big.zarr")
    ref = _brute_greyscale(_tifffile_level0(folder / "b_big.svs"), 32)
    assert {(int(x), int(y)) for x, y in got.coords} == set(ref)
    full = _tifffile_level0(folder / "b_big.svs")
    tiles = got.read()
    for i in range(0, len(got), 97):
        x, y = got.coords[i]
        np.testing.assert_array_equal(tiles[i], full[y : y + 32, x : x + 32])


def test_resume_skips_current_rebuilds_changed_partial_and_stale(tmp_path: Path, good_slide: Path) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "one.svs").symlink_to(good_slide)
    make_slide(folder / "two.svs", size=768, seed=41, tissue_fraction=0.5)
    out = tmp_path / "tiles"
    cfg = TilingConfig(method="greyscale", qc_mode="off", qc=False)

    def run(config: TilingConfig = cfg) -> dict[str, str]:
        rep = tile_cohort(folder, out, config, workers=0, progress=False)
        return {r.slide_id: r.status for r in rep.results}

    assert run() == {"one": "ok", "two": "ok"}
    n_two = len(open_store(out / "two.zarr"))
    assert run() == {"one": "skipped", "two": "skipped"}
    # changed settings rebuild
    assert run(TilingConfig(method="greyscale", qc_mode="off", qc=False, tile_size=128)) == {"one": "ok", "two": "ok"}
    assert open_store(out / "two.zarr").tile_size == 128
    assert run() == {"one": "ok", "two": "ok"}
    assert len(open_store(out / "two.zarr")) == n_two
    # a store not marked complete is rebuilt; a replaced slide file is rebuilt
    zarr.open_group(str(out / "one.zarr"), mode="r+").attrs["complete"] = False
    make_slide(folder / "two.svs", size=768, seed=42, tissue_fraction=0.5)
    # a temporary store left by a dead process is removed
    stale = out / ".two.zarr.tmp-999999999"
    (stale / "tiles").mkdir(parents=True)
    assert run() == {"one": "ok", "two": "ok"}
    assert not stale.exists()
    assert run() == {"one": "skipped", "two": "skipped"}
    # a touched but unchanged file (new mtime, same bytes) is recognised by its fingerprint
    st = (folder / "two.svs").stat()
    os.utime(folder / "two.svs", ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    assert run() == {"one": "skipped", "two": "skipped"}
    ref = _brute_greyscale(_tifffile_level0(folder / "two.svs"), 256)
    assert {(int(x), int(y)) for x, y in open_store(out / "two.zarr").coords} == set(ref)


# ------------------------------------------------------------------------------ the pre-screen


@pytest.mark.slow
def test_prescreen_keeps_exactly_the_exhaustive_set_where_it_matters(tmp_path: Path) -> None:
    specs = {
        "pens": dict(size=(1536, 1280), seed=51, n_lesions=2, pen_marks=3, tissue_fraction=0.35),
        "external": dict(size=1280, seed=52, n_lesions=1, tint=(0.92, 0.97, 1.06), noise=8.0, tissue_fraction=0.4),
        "sparse": dict(size=(1792, 1024), seed=53, tissue_fraction=0.15, pen_marks=1),
    }
    jobs = []
    for name, kw in specs.items():
        jobs.append(SlideJob(name, str(make_slide(tmp_path / f"{name}.svs", **kw).path)))
    grid_tiles = cand = 0
    borderline = 0
    for job in jobs:
        fast = tile_slide(job, tmp_path / "pre", TilingConfig(method="greyscale", qc_mode="off", qc=False))
        # the exhaustive run also writes in the decoding thread (as a worker does when every core
        # has one): the store must not depend on which thread compressed it
        slow = tile_slide(job, tmp_path / "exh", TilingConfig(method="greyscale", qc_mode="off", qc=False, detector=GreyscaleParams(prescreen=False)), background_write=False)
        assert fast.status == slow.status == "ok"
        a, b = open_store(tmp_path / "pre" / f"{job.slide_id}.zarr"), open_store(tmp_path / "exh" / f"{job.slide_id}.zarr")
        np.testing.assert_array_equal(a.coords, b.coords)
        np.testing.assert_array_equal(a.foreground, b.foreground)
        np.testing.assert_array_equal(a.read(), b.read())
        assert a.attrs["prescreen"] and not b.attrs["prescreen"]
        grid_tiles += a.attrs["grid_shape"][0] * a.attrs["grid_shape"][1]
        cand += a.attrs["n_candidates"]
        borderline += int(((a.foreground >= 0.6) & (a.foreground < 0.7)).sum())
        # and the exhaustive set is the brute-force set
        ref = _brute_greyscale(_tifffile_level0(Path(job.path)), 256)
        assert {(int(x), int(y)) for x, y in b.coords} == set(ref)
    assert cand < 0.7 * grid_tiles  # the pre-screen skipped a good share of the grid
    assert borderline > 0  # tiles close to the threshold were among those compared


# ------------------------------------------------------------------- resolution, codecs, QC, CLI


def test_mpp_target_reads_the_right_level_and_resizes(tmp_path: Path) -> None:
    path = make_slide(tmp_path / "s40.svs", size=(1536, 1024), seed=61, mpp=0.25, tissue_fraction=0.6).path
    full = _tifffile_level0(path)
    # 0.5 um/px: no 2x level (the pyramid is 1, 4, 16), so read level 0 and downsize 512 -> 256 px
    rep = tile_cohort([SlideJob("s", str(path))], tmp_path / "t05", TilingConfig(method="greyscale", qc_mode="off", mpp_target=0.5, qc=False), workers=0, progress=False)
    assert rep.ok
    st = open_store(tmp_path / "t05" / "s.zarr")
    assert (st.attrs["read_level"], st.attrs["downsample"], st.attrs["mpp"]) == (0, 2.0, 0.5)
    assert st.attrs["grid_shape"] == [1024 // 512, 1536 // 512]
    np.testing.assert_array_equal(st.coords, st.grid * 512)
    tiles = st.read()
    for i, (x, y) in enumerate(st.coords):
        block = full[y : y + 512, x : x + 512].astype(np.float64).reshape(256, 2, 256, 2, 3).mean(axis=(1, 3))
        assert np.abs(tiles[i] - block).max() <= 1.0
    # 1.0 um/px: level 1 (4x) as stored, no resizing; coordinates in level-0 px
    rep = tile_cohort([SlideJob("s", str(path))], tmp_path / "t1", TilingConfig(method="greyscale", qc_mode="off", mpp_target=1.0, min_foreground=0.3, qc=False),
                      workers=0, progress=False)
    st = open_store(tmp_path / "t1" / "s.zarr")
    assert (st.attrs["read_level"], st.attrs["downsample"]) == (1, 4.0) and len(st) > 0
    with tifffile.TiffFile(path) as tf:
        level1 = tf.pages[2].asarray()
    np.testing.assert_array_equal(st.coords, st.grid * 1024)
    for i, (x, y) in enumerate(st.coords):
        np.testing.assert_array_equal(st.read([i])[0], level1[y // 4 : y // 4 + 256, x // 4 : x // 4 + 256])


def test_jpeg_store_and_qc_image(tmp_path: Path, good_slide: Path) -> None:
    job = [SlideJob("g", str(good_slide))]
    tile_cohort(job, tmp_path / "z", TilingConfig(method="greyscale", qc_mode="off"), workers=0, progress=False)
    tile_cohort(job, tmp_path / "j", TilingConfig(method="greyscale", qc_mode="off", compression="jpeg"), workers=0, progress=False)
    z, j = open_store(tmp_path / "z" / "g.zarr"), open_store(tmp_path / "j" / "g.zarr")
    np.testing.assert_array_equal(z.coords, j.coords)
    diff = np.abs(z.read().astype(int) - j.read().astype(int))
    assert 0 < diff.mean() < 4
    chunk_bytes = sum(p.stat().st_size for p in (tmp_path / "j" / "g.zarr" / "tiles").glob("c.*"))
    assert chunk_bytes < 0.25 * z.read().nbytes
    qc = cv2.imread(str(tmp_path / "z" / "qc" / "g.png"))
    assert qc is not None and max(qc.shape[:2]) >= 256  # 16 px or more per 256 px tile
    outline = (qc[..., 1] == 170) & (qc[..., 0] == 0) & (qc[..., 2] == 0)  # BGR of the green outline
    assert outline.sum() > 4 * 16 * len(z)  # every kept tile drawn


def test_folder_listing_dicom_duplicates_and_skips(tmp_path: Path) -> None:
    (tmp_path / "a.svs").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.ndpi").write_bytes(b"x")
    (tmp_path / "scan7").mkdir()
    for n in ("1.dcm", "0.dcm"):
        (tmp_path / "scan7" / n).write_bytes(b"x")
    (tmp_path / "x.ome.tiff").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.svs").write_bytes(b"x")
    (tmp_path / "old.zarr").mkdir()
    (tmp_path / "old.zarr" / "z.svs").write_bytes(b"x")
    jobs = {j.path: j for j in jobs_from_folder(tmp_path)}
    ids = sorted(j.slide_id for j in jobs.values())
    assert ids == ["a", "a", "scan7", "x"]
    assert jobs[str((tmp_path / "scan7" / "0.dcm").resolve())].slide_id == "scan7"
    dup = [j for j in jobs.values() if j.slide_id == "a"]
    assert all(j.problem and "duplicate slide_id 'a'" in j.problem for j in dup)


def test_cli_help_documents_every_option(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["tile", "--help"])
    text = capsys.readouterr().out
    for opt in ("--slides", "--manifest", "--out", "--method", "--tile-size", "--min-foreground", "--grey-min",
                "--grey-max", "--mpp-target", "--mpp", "--workers", "--compression", "--backend", "--no-prescreen",
                "--no-qc-images", "--overwrite", "--no-progress", "--lock-stale-after"):
        assert opt in text
    assert main(["tile", "--method", "greyscale", "--qc", "off", "--slides", "/nonexistent/dir", "--out", "/tmp/x"]) == 2


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("separator", [".", "/"])
def test_store_writes_chunk_files_identical_to_zarr(tmp_path: Path, compression: str, separator: str) -> None:
    """StoreWriter's direct chunk writes (plain zstd / raw tiles) produce the bytes zarr itself writes."""
    from wsi_pipeline.data.codecs import tile_codecs_for
    from wsi_pipeline.data.store import StoreWriter

    tiles = (np.random.default_rng(7).integers(0, 60, (5, 16, 16, 3)) + 90).astype(np.uint8)
    codecs = {**tile_codecs_for(compression), "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}}}
    w = StoreWriter(tmp_path / "a.zarr", tile_size=16, capacity=2, attrs={"slide_id": "a"}, tile_codecs=codecs, shard_tiles=0)
    assert w._direct is not None  # the fast path is taken for these layouts
    w.append(tiles[:3], np.zeros((3, 2)), np.zeros((3, 2)), np.zeros(3))
    w.append(tiles[3:], np.zeros((2, 2)), np.zeros((2, 2)), np.zeros(2))
    w.commit()
    ref = zarr.open_group(str(tmp_path / "b.zarr"), mode="w").create_array(
        "tiles", shape=tiles.shape, chunks=(1, 16, 16, 3), dtype="uint8", **codecs)
    ref[:] = tiles
    for i in range(5):
        key = ref.metadata.chunk_key_encoding.encode_chunk_key((i, 0, 0, 0))
        assert (tmp_path / "a.zarr" / "tiles" / key).read_bytes() == (tmp_path / "b.zarr" / "tiles" / key).read_bytes()
    np.testing.assert_array_equal(open_store(tmp_path / "a.zarr").read(), tiles)
    # reading: the direct path returns what zarr itself reads, for any order, with repeats; a chunk
    # file that goes missing is damage: found on open (zarr alone would read its fill value)
    a = open_store(tmp_path / "a.zarr")
    assert a._direct is not None
    idx = np.array([4, 0, 4, 2, 1, 3])
    np.testing.assert_array_equal(a.read(idx), zarr.open_array(str(tmp_path / "a.zarr" / "tiles"), mode="r")[:][idx])
    key2 = ref.metadata.chunk_key_encoding.encode_chunk_key((2, 0, 0, 0))
    (tmp_path / "a.zarr" / "tiles" / key2).unlink()
    with pytest.raises(StoreDamagedError, match=f"chunk file tiles/{key2} is missing"):
        open_store(tmp_path / "a.zarr")
    with pytest.raises(StoreDamagedError, match="tile 2: its chunk file"):  # and on read, for a store opened before
        a.read([2, 1])
