"""The demo end to end on a tiny cohort: every stage runs, outputs are complete, a rerun reuses them."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from wsi_pipeline.cli.main import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_every_stage_and_reuses_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo config's paths are relative to the working directory
    args = ["demo", "--config", str(REPO / "pipelines" / "demo.yaml"), "--internal", "8", "--external", "4",
            "--size", "512", "--workers", "0", "--no-progress",
            "--set", "train.epochs=1", "--set", "train.bag_size=16", "--set", "eval.protocols=[all, {subsample: {k: 8, repeats: 3}}]"]
    assert main(args) == 0
    out = capsys.readouterr().out
    results = tmp_path / "results" / "demo"
    assert "time per stage" in out and str(Path("results") / "demo" / "report.html") in out

    records = pd.DataFrame(json.loads((results / "metrics.json").read_text())["records"])
    assert set(records["method"]) == {"abmil_frozen", "abmil_e2e", "abmil_bigl", "patchgd"}
    assert set(records["cohort"]) == {"internal", "external"}
    assert {"all", "sub8x3"} <= set(records["protocol"])
    assert "localisation_auc" in set(records["metric"])
    for cohort in ("internal", "external"):
        for protocol in ("all", "sub8x3"):
            preds = pd.read_csv(results / f"predictions_{cohort}_{protocol}.csv")
            assert len(preds) == 4 * (2 if cohort == "internal" else 4)  # 4 methods x test slides

    # report.html is self-contained: everything it renders is embedded (its links only point at
    # the full-size heatmaps beside it), and every embedded image decodes
    html = (results / "report.html").read_text()
    assert not re.search(r'src="(?!data:)', html) and "<link" not in html
    for href in re.findall(r'href="(?!data:|#)([^"]+)"', html):
        assert (results / href).is_file(), href
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert images
    for b64 in images:
        Image.open(io.BytesIO(base64.b64decode(b64))).verify()
    assert any(p.suffix == ".png" for p in (results / "heatmaps").iterdir())

    # a second run reuses every finished stage
    mtime = (results / "metrics.json").stat().st_mtime
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reusing" in out
    assert (results / "metrics.json").stat().st_mtime == mtime


def test_demo_refuses_a_cohort_made_with_other_settings(tmp_path):
    from dataclasses import asdict

    from wsi_pipeline.demo import DemoCohort, make_cohort

    folder = tmp_path / "runs" / "demo" / "cohort"
    folder.mkdir(parents=True)
    (folder / "manifest.csv").write_text("slide_id,path,label\n")
    (folder / "demo_cohort.json").write_text(json.dumps(asdict(DemoCohort(n_internal=8))))
    assert make_cohort(folder, DemoCohort(n_internal=8)) == folder / "manifest.csv"  # same settings: reused
    with pytest.raises(ValueError, match=r"other settings.*delete"):
        make_cohort(folder, DemoCohort(n_internal=8, lesion_contrast=0.9))
