"""A pipeline with several methods gives the paper's table: training validates each method with its own
protocol, and ``wsi-pipeline eval`` writes one report whose paper-layout table has one row per method
in the YAML's order and one column per evaluated set x protocol, each cell the primary metric's mean
+- std over seeds.

References: the protocols the training loop hands to validation, recorded here; the table's cells
recomputed with numpy (mean, ``std(ddof=1)``, x 100) from the per-seed records of ``metrics.json``.
"""

from __future__ import annotations

import html
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from wsi_pipeline.config.pipeline import EvalProtocol, config_from_dict


def test_training_validates_each_method_with_its_own_protocol(tmp_path, monkeypatch):
    import wsi_pipeline.inference.protocol_metrics as protocols_mod
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.training.loop import train_pipeline

    seen: list[EvalProtocol] = []
    real = protocols_mod.endpoint_validation_metrics  # what training validates through, for every task

    def spy(endpoint, labels, preds, protocol):
        seen.append(protocol)
        return real(endpoint, labels, preds, protocol)

    monkeypatch.setattr(protocols_mod, "endpoint_validation_metrics", spy)
    store_cohort = make_store_cohort(tmp_path / "data", n_slides=6, tiles_per_slide=(4, 6), seed=0)
    root = store_cohort.parent
    raw = {
        "name": "t", "seeds": [0], "runs_dir": str(tmp_path / "runs"),
        "data": {"manifest": str(store_cohort), "tiles_dir": str(root / "tiles"), "features_dir": str(tmp_path / "features"),
                 "n_classes": 2, "tiling": {"tile_size": 32}},
        "train": {"epochs": 1, "bag_size": 8, "batch_bags": 2},
        "eval": {"val_protocol": "sub4x3"},
        "methods": [{"name": "own", "strategy": "frozen", "chunk_size": 32, "val_protocol": "all"},
                    {"name": "default", "strategy": "frozen", "chunk_size": 32}],
    }
    cfg = config_from_dict(raw)
    train_pipeline(cfg, progress=False)
    assert seen == [EvalProtocol(), EvalProtocol(4, 3)]  # methods train in the config's order


# ----------------------------------------------------------------------------------------------
# The report's paper-layout table on a tiny evaluated pipeline
# ----------------------------------------------------------------------------------------------

# YAML order, deliberately neither alphabetical nor the validation ranking
METHODS = ["dtfd_frozen", "abmil_bigl", "abmil_frozen"]
BEST_VAL = {"dtfd_frozen": 0.5, "abmil_bigl": 0.9, "abmil_frozen": 0.7}
SEEDS = [0, 1, 2]
PROTOCOLS = ["all", "sub4x3"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Three methods x three seeds (``abmil_frozen`` seed 2 unfinished) saved as trained runs, evaluated."""
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.methods.models import build_models
    from wsi_pipeline.manifests.schema import read_manifest, write_manifest
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.training.rundir import run_config

    tmp = tmp_path_factory.mktemp("paper")
    internal = read_manifest(make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(6, 10), seed=0))
    external = read_manifest(make_store_cohort(tmp / "data", n_slides=4, tiles_per_slide=(6, 10), cohort="ext",
                                              splits={"test": 1.0}, tint=(1.0, 0.9, 1.05), seed=1))
    manifest = write_manifest(pd.concat([internal, external]), tmp / "data" / "all.csv")
    raw = {
        "name": "paper", "seeds": SEEDS, "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results"),
        "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "eval": {"protocols": PROTOCOLS, "seed": 0, "bootstrap": 0},
        "methods": [{"name": m, "strategy": "full", "encoder": {"name": "resnet18"},
                     "aggregator": {"name": m.split("_")[0]}, "chunk_size": 16} for m in METHODS],
    }
    cfg = config_from_dict(raw)
    for i, method in enumerate(cfg.methods):
        for seed in SEEDS:
            torch.manual_seed(100 * i + seed)
            enc, agg = build_models(method, 2, for_training=False)
            d = cfg.run_dir(method.name, seed)
            save_run_checkpoint(d / "best.pt", RunCheckpoint.build(  # the run's own config, as training saves it
                run_config(cfg, method, seed), method, seed=seed, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()}))
            if not (method.name == "abmil_frozen" and seed == 2):
                (d / "done").write_text(json.dumps({"select_metric": "auc", "best_value": BEST_VAL[method.name] + 0.01 * seed}))
    summary = evaluate_pipeline(cfg, device="cpu", heatmaps=False, progress=False)
    return cfg, summary.results_dir


def _paper_table(page: str) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(set headers, protocol headers, {method: cells}) of the report's paper-layout table."""
    table = re.search(r'<table class="paper">(.*?)</table>', page, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    strip = lambda c: html.unescape(re.sub(r"<[^>]+>", "", c)).strip()  # noqa: E731
    sets = [strip(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", rows[0])][1:]
    prots = [strip(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", rows[1])]
    body = {}
    for row in rows[2:]:
        cells = [strip(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        body[cells[0]] = cells[1:]
    return sets, prots, body


def _expected_cells(records: list[dict], metric: str, sets: list[tuple[str, str]], prots: list[str]) -> dict[str, list[str]]:
    """The cells recomputed from the per-seed records: x 100, numpy mean and sample std (ddof 1)."""
    out = {}
    for meth in METHODS:
        n_row = len({r["seed"] for r in records if r["method"] == meth and isinstance(r["seed"], int)})
        cells = []
        for cohort, split in sets:
            for prot in prots:
                v = np.array([r["value"] for r in records if (r["method"], r["cohort"], r["split"], r["protocol"], r["metric"])
                              == (meth, cohort, split, prot, metric) and isinstance(r["seed"], int) and "repeat" not in r
                              and r["value"] is not None], np.float64)
                assert len(v) == n_row  # every seed scored every set and protocol
                cells.append(f"{100 * v.mean():.2f} ± {100 * v.std(ddof=1):.2f}")
        out[f"{meth} ({n_row} seeds)"] = cells
    return out


@pytest.mark.slow
def test_report_has_the_papers_table_with_seed_mean_and_std(evaluated):
    cfg, out = evaluated
    page = (out / "report.html").read_text()
    records = json.loads((out / "metrics.json").read_text())["records"]
    sets, prots, body = _paper_table(page)
    assert sorted(sets) == ["ext (external)", "synthetic (test)"] and prots == ["all", "sub4x3"] * 2
    assert list(body) == [f"{m} ({2 if m == 'abmil_frozen' else 3} seeds)" for m in METHODS]  # the YAML's order
    order = [tuple(x.rstrip(")").split(" (")) for x in sets]
    assert body == _expected_cells(records, "auc", order, ["all", "sub4x3"])
    # sub4x3: a seed's value is the mean of its three per-repeat AUCs
    for r in records:
        if r["protocol"] == "sub4x3" and r["metric"] == "auc" and isinstance(r["seed"], int) and "repeat" not in r:
            reps = [q["value"] for q in records if {**q, "value": 0, "repeat": 0} == {**r, "value": 0, "repeat": 0} and "repeat" in q]
            assert len(reps) == 3 and r["value"] == pytest.approx(np.mean(reps), abs=1e-12)
    # the other tables still rank the methods best on validation first
    summary = page[page.index("<h2>Summary"):page.index("<h2>Results in the papers")]
    assert re.findall(r'<td class="m">([a-z_]+)', summary) == ["abmil_bigl", "abmil_frozen", "dtfd_frozen"]


@pytest.mark.parametrize("n_classes,metric", [(6, "qwk"), (2, "auc")])
def test_paper_table_from_records(tmp_path, n_classes, metric):
    """Per-seed records -> metrics.json -> report: QWK for graded tasks (PANDA), AUC for binary ones
    (CAMELYON); rows in the records' order whatever the validation ranking; a cell missing a seed says
    how many it has."""
    from wsi_pipeline.export.metrics_json import MetricRecord, read_metrics_json, write_metrics_json
    from wsi_pipeline.export.report import write_report

    rng = np.random.default_rng(0)
    sets, prots = [("panda", "test"), ("tcga_prad", "external")], ["all", "sub256x100"]
    drop = ("dtfd_frozen", 1, "tcga_prad", "all")  # one seed's value missing in one cell
    recs = [MetricRecord(meth, seed, c, s, p, m, float(rng.uniform(0.3, 0.95)))
            for meth in METHODS for seed in SEEDS for c, s in sets for p in prots for m in ("qwk", "auc", "accuracy")
            if (meth, seed, c, p) != drop]
    mpath = write_metrics_json(tmp_path / "metrics.json", recs)
    val = {(m, 0): ("auc", BEST_VAL[m]) for m in METHODS}
    page = write_report(tmp_path / "report.html", pipeline="p", predictions=pd.DataFrame(), metrics_path=mpath,
                        n_classes=n_classes, protocols=prots, validation=val).read_text()
    assert f"{metric.upper()} x 100" in page
    head_sets, head_prots, body = _paper_table(page)
    assert head_sets == ["panda (test)", "tcga_prad (external)"] and head_prots == prots * 2
    assert [k.split(" ")[0] for k in body] == METHODS  # the records' (the YAML's) order, not the validation ranking
    per_seed = [r for r in read_metrics_json(mpath) if isinstance(r.seed, int)]
    for meth in METHODS:
        row = body[f"{meth} (3 seeds)"]
        col = 0
        for c, s in sets:
            for p in prots:
                v = np.array([r.value for r in per_seed if (r.method, r.cohort, r.split, r.protocol, r.metric) == (meth, c, s, p, metric)])
                txt = f"{100 * v.mean():.2f} ± {100 * v.std(ddof=1):.2f}"
                if (meth, c, p) == ("dtfd_frozen", "tcga_prad", "all"):
                    assert len(v) == 2 and row[col] == f"{txt} (2 seeds)"
                else:
                    assert len(v) == 3 and row[col] == txt, (meth, c, p, row[col], txt)
                col += 1
