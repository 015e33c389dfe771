"""mpp precedence in `wsi-pipeline tile`: manifest > slide metadata > --mpp (fallback only); --mpp-force
overrides all; the store attributes and tiling_report.csv record the mpp used and its source."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.cli.main import main
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.data.store import open_store

OWN = 0.346  # the mpp one slide's metadata records


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mpp_slides")
    make_slide(d / "own.svs", size=768, seed=3, mpp=OWN, tissue_fraction=0.6)
    make_slide(d / "bare.svs", size=768, seed=4, mpp=None, tissue_fraction=0.6)
    return d


def _tile(source: list[str], out: Path, *extra: str) -> int:
    return main(["tile", "--method", "greyscale", "--qc", "off", *source, "--out", str(out), "--workers", "0", "--no-progress", "--no-qc-images", "--mpp-target", "1.0", *extra])


def _used(out: Path) -> dict[str, tuple[str, float, str]]:
    """slide_id -> (status, slide_mpp, mpp_source) from the report, checked against the store's attributes."""
    r = pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id")
    used = {}
    for sid, row in r.iterrows():
        if row["status"] in ("ok", "skipped"):
            a = open_store(out / f"{sid}.zarr").attrs
            assert (a["slide_mpp"], a["mpp_source"]) == (pytest.approx(float(row["slide_mpp"])), row["mpp_source"])
            assert a["downsample"] == pytest.approx(1.0 / a["slide_mpp"])  # the tiles really use that mpp
            assert a["metadata_mpp"] == (OWN if sid == "own" else None)
        used[sid] = (row["status"], float(row["slide_mpp"]) if row["slide_mpp"] != "" else None, row["mpp_source"])
    return used


def test_run_mpp_only_fills_in_slides_without_one_and_forced_overrides_all(folder: Path, tmp_path: Path, capsys) -> None:
    src = ["--slides", str(folder)]
    # no mpp for "bare": its row fails and names the flags that fix it
    assert _tile(src, tmp_path / "none") == 1
    err = pd.read_csv(tmp_path / "none" / "tiling_report.csv").set_index("slide_id").loc["bare", "error"]
    assert "--mpp <um/px>" in err and "--mpp-force <um/px>" in err and "`mpp` column" in err
    assert _used(tmp_path / "none")["own"] == ("ok", OWN, "slide")

    out = tmp_path / "fallback"
    assert _tile(src, out, "--mpp", "0.25") == 0
    assert _used(out) == {"own": ("ok", OWN, "slide"), "bare": ("ok", 0.25, "run-fallback")}
    # another fallback value rebuilds only the slide that used it
    assert _tile(src, out, "--mpp", "0.3") == 0
    assert _used(out) == {"own": ("skipped", OWN, "slide"), "bare": ("ok", 0.3, "run-fallback")}

    assert _tile(src, out, "--mpp-force", "0.25") == 0
    assert _used(out) == {"own": ("ok", 0.25, "run-forced"), "bare": ("ok", 0.25, "run-forced")}
    note = pd.read_csv(out / "tiling_report.csv", keep_default_na=False).set_index("slide_id").loc["own", "note"]
    assert "replaces the slide's own 0.346" in note
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        _tile(src, tmp_path / "both", "--mpp", "0.25", "--mpp-force", "0.25")
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_manifest_mpp_overrides_the_slide_and_the_fallback(folder: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    pd.DataFrame({"slide_id": ["own", "bare"], "path": [str(folder / "own.svs"), str(folder / "bare.svs")],
                  "label": [0, 1], "mpp": [0.3, None]}).to_csv(manifest, index=False)
    out = tmp_path / "m"
    assert _tile(["--manifest", str(manifest)], out, "--mpp", "0.5") == 0
    assert _used(out) == {"own": ("ok", 0.3, "manifest"), "bare": ("ok", 0.5, "run-fallback")}
    assert open_store(out / "own.zarr").attrs["manifest_mpp"] == 0.3
    assert _tile(["--manifest", str(manifest)], out, "--mpp-force", "0.25") == 0
    assert _used(out) == {"own": ("ok", 0.25, "run-forced"), "bare": ("ok", 0.25, "run-forced")}
