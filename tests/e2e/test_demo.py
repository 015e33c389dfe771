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

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_every_stage_and_reuses_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo config's paths are relative to the working directory
    args = ["demo", "--config", str(REPO / "pipelines" / "demo.yaml"), "--internal", "8", "--external", "4",
            "--size", "512", "--workers", "0", "--no-progress",
            "--set", "train.epochs=1", "--set", "train.bag_size=16", "--set", "eval.protocols=[all, sub8x3]",
            # methods with their own epochs in demo.yaml
            "--set", "methods.abmil_e2e.train.epochs=1", "--set", "methods.abmil_bigl.train.epochs=1"]
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
    # user text names no class of ours (a rename once leaked "EvalProtocol" into the headings)
    assert not re.search(r"EvalProtocol|MetricRecord|PipelineConfig", re.sub(r"<[^>]+>", " ", html))
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

    from wsi_pipeline.synthetic.cohort import DemoCohort
    from wsi_pipeline.demo import make_cohort

    folder = tmp_path / "runs" / "demo" / "cohort"
    folder.mkdir(parents=True)
    (folder / "manifest.csv").write_text("slide_id,path,label\n")
    (folder / "demo_cohort.json").write_text(json.dumps(asdict(DemoCohort(n_internal=8))))
    assert make_cohort(folder, DemoCohort(n_internal=8)) == folder / "manifest.csv"  # same settings: reused
    with pytest.raises(ValueError, match=r"other settings \(lesion_contrast: 0\.7 there, 0\.9 now; .*delete"):
        make_cohort(folder, DemoCohort(n_internal=8, lesion_contrast=0.9))


def test_demo_command_reports_a_stale_cohort_in_one_error_line(tmp_path, monkeypatch, capsys):
    """A cohort left by an earlier version (other lesion contrast): `wsi-pipeline demo` exits with
    status 2 and an `error:` line naming the setting and the folders to delete, no traceback."""
    from dataclasses import asdict, replace
    from pathlib import Path

    from wsi_pipeline.cli.main import main
    from wsi_pipeline.synthetic.cohort import DemoCohort

    config = Path(__file__).resolve().parents[2] / "pipelines" / "demo.yaml"
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "demo" / "cohort"
    folder.mkdir(parents=True)
    (folder / "manifest.csv").write_text("slide_id,path,label\n")
    (folder / "demo_cohort.json").write_text(json.dumps(asdict(replace(DemoCohort(), lesion_contrast=0.5))))
    assert main(["demo", "--config", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wsi-pipeline demo: error: runs/demo/cohort holds a demo cohort made with other settings (lesion_contrast: 0.5 there")
    assert "rm -rf runs/demo" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------
# Seed study (`wsi-pipeline demo --seeds`)
# ----------------------------------------------------------------------------------------------


def test_seeds_argument_parses_lists_and_ranges_and_rejects_the_rest(capsys):
    from wsi_pipeline.cli.main import build_parser
    from wsi_pipeline.demo import parse_seeds

    assert parse_seeds("0,1,2,3,4") == (0, 1, 2, 3, 4) == parse_seeds("0-4") == parse_seeds(" 0-2, 3,4 ")
    assert parse_seeds("7") == (7,)
    for bad, why in (("a,1", "not an integer"), ("1,1", "distinct"), ("-1", ">= 0"), ("3-1", "not an integer"),
                     ("", "not an integer"), ("0-2,2", "distinct")):
        with pytest.raises(ValueError, match=why):
            parse_seeds(bad)
    assert build_parser().parse_args(["demo", "--seeds", "0,2"]).seeds == (0, 2)
    assert build_parser().parse_args(["demo"]).seeds is None
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--seeds", "0,x"])
    assert e.value.code == 2 and "--seeds '0,x'" in capsys.readouterr().err


def test_seed_study_table_is_mean_sd_and_min_over_the_seeds(tmp_path):
    import math
    import statistics

    from wsi_pipeline.demo import format_seed_study, seed_study_table
    from wsi_pipeline.export.metrics_json import MetricRecord, read_metrics_json, write_metrics_json

    rng = __import__("numpy").random.default_rng(0)
    seeds = [0, 1, 2, 3, 4]
    values = {}  # (method, heading) -> per-seed values, the reference
    recs = []
    for method in ("frozen", "e2e"):
        for s in seeds:
            for heading, cohort, split, metric in (("internal AUC", "internal", "test", "auc"),
                                                   ("localisation", "internal", "test", "localisation_auc"),
                                                   ("external AUC", "external", "external", "auc")):
                v = float(rng.uniform(0.3, 1.0))
                values.setdefault((method, heading), []).append(v)
                recs.append(MetricRecord(method, s, cohort, split, "all", metric, v))
                # other protocols and metrics are not part of the study
                recs.append(MetricRecord(method, s, cohort, split, "sub64x10", metric, 0.0))
                recs.append(MetricRecord(method, s, cohort, split, "all", "accuracy", 0.0))
    path = write_metrics_json(tmp_path / "metrics.json", recs)  # adds the runner's mean/std rows: ignored
    table = seed_study_table(read_metrics_json(path), ["e2e", "frozen"])
    assert list(table.index) == ["e2e", "frozen"]
    for (method, heading), v in values.items():
        assert table.loc[method, (heading, "mean")] == pytest.approx(statistics.fmean(v), abs=1e-12)
        assert table.loc[method, (heading, "sd")] == pytest.approx(statistics.stdev(v), abs=1e-12)
        assert table.loc[method, (heading, "min")] == min(v)
        assert table.loc[method, (heading, "n")] == 5
    text = format_seed_study(table, seeds)
    row = next(line for line in text.splitlines() if line.startswith("| `frozen`"))
    v = values[("frozen", "external AUC")]
    assert f"{statistics.fmean(v):.2f} +- {statistics.stdev(v):.2f} (min {min(v):.2f})" in row
    assert "seeds 0, 1, 2, 3, 4" in text
    # one seed: no sd; a method without values: a dash
    one = seed_study_table([r for r in recs if r.seed == 0], ["frozen", "absent"])
    assert math.isnan(one.loc["frozen", ("internal AUC", "sd")]) and one.loc["frozen", ("internal AUC", "n")] == 1
    lines = format_seed_study(one, [0]).splitlines()
    assert "+-" not in lines[-2] and lines[-1] == "| `absent` | - | - | - |"
