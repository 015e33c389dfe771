"""The evaluation stage end to end, on hand-built run folders (checkpoints saved here) over tiny store cohorts.

The models are randomly initialised ResNet-18 + ABMIL saved in the checkpoint format of
:mod:`wsi_pipeline.checkpoints.files`; what is checked is that evaluation reproduces what the
saved model computes, follows the schemas, and orders its work correctly.
"""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from PIL import Image
from sklearn.metrics import accuracy_score, roc_auc_score

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
from wsi_pipeline.evaluation.sets import evaluation_sets
from wsi_pipeline.evaluation.localisation import localisation_auc
from wsi_pipeline.evaluation.predict import predict_slides
from wsi_pipeline.export.predictions import prediction_columns
from wsi_pipeline.data.store import store_level0_size
from wsi_pipeline.export.thumbnail import thumbnail_shape
from wsi_pipeline.manifests.schema import read_manifest, write_manifest
from wsi_pipeline.data.store import open_store, store_path

pytestmark = pytest.mark.slow

METHOD = "abmil_e2e"


def _raw_config(tmp, manifest, seeds):
    return {
        "name": "t",
        "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles"), "n_classes": 2, "tiling": {"tile_size": 32}},
        "eval": {"val_protocol": "all", "protocols": ["all", "sub8x5", "ens8x5"], "seed": 0},
        "seeds": seeds,
        "methods": [{"name": METHOD, "strategy": "full", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}, "chunk_size": 16}],
        "runs_dir": str(tmp / "runs"),
        "results_dir": str(tmp / "results"),
    }


def _save_run(cfg, seed, done=True):
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.methods.models import build_models

    torch.manual_seed(seed)
    enc, agg = build_models(cfg.methods[0], 2, for_training=False)
    d = cfg.run_dir(METHOD, seed)
    save_run_checkpoint(d / "best.pt", RunCheckpoint.build(
        cfg, cfg.methods[0], seed=seed, epoch=3, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()}))
    if done:
        (d / "done").touch()


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.config.pipeline import config_from_dict

    tmp = tmp_path_factory.mktemp("eval")
    internal = read_manifest(make_store_cohort(tmp / "data", n_slides=8, tiles_per_slide=(12, 20), seed=0))
    external = read_manifest(make_store_cohort(tmp / "data", n_slides=4, tiles_per_slide=(12, 20), cohort="ext",
                                              splits={"test": 1.0}, tint=(1.0, 0.9, 1.05), seed=1))
    manifest = write_manifest(pd.concat([internal, external]), tmp / "data" / "all.csv")
    raw = _raw_config(tmp, manifest, [0, 1, 2])
    cfg = config_from_dict(raw)
    _save_run(cfg, 0)
    _save_run(cfg, 1)
    _save_run(cfg, 2, done=False)  # unfinished: must be skipped
    (tmp / "t.yaml").write_text(yaml.safe_dump(raw))

    # record the order of model loads and test-store reads
    import wsi_pipeline.evaluation.evaluate as runner_mod
    import wsi_pipeline.inference.trained as ckpt_mod

    events = []
    orig_load, orig_open = ckpt_mod.load_trained_model, runner_mod.open_store
    mp = pytest.MonkeyPatch()
    mp.setattr(ckpt_mod, "load_trained_model", lambda *a, **k: (events.append(("load", str(a[0]))), orig_load(*a, **k))[1])
    mp.setattr(runner_mod, "open_store", lambda p: (events.append(("open", str(p))), orig_open(p))[1])
    try:
        summary = evaluate_pipeline(cfg, device="cpu", n_boot=40, progress=False)
    finally:
        mp.undo()
    return {"cfg": cfg, "summary": summary, "events": events, "tmp": tmp, "manifest": read_manifest(manifest)}


def test_evaluation_sets_internal_and_external():
    df = pd.DataFrame({
        "slide_id": list("abcdefg"), "label": [0, 1, 0, 1, 0, 1, 1],
        "split": ["train", "val", "test", "test", "", "test", "train"], "cohort": ["A", "A", "A", "A", "B", "B", "C"],
    })
    df.loc[6, "cohort"] = "A"
    sets = {(s.cohort, s.split): sorted(s.slides["slide_id"]) for s in evaluation_sets(df)}
    assert sets == {("A", "test"): ["c", "d"], ("B", "external"): ["e", "f"]}


def test_localisation_auc_is_sklearn():
    att = np.array([0.1, 0.5, 0.2, 0.9, 0.3])
    frac = np.array([0.0, 0.6, 0.4, 1.0, 0.5])
    assert localisation_auc(att, frac) == pytest.approx(roc_auc_score(frac >= 0.5, att))
    assert math.isnan(localisation_auc(att, np.zeros(5)))


def test_model_fixed_before_test_slides_and_unfinished_runs_skipped(evaluated):
    ev = evaluated["events"]
    assert [e[0] for e in ev].count("load") == 2
    loads = [i for i, e in enumerate(ev) if e[0] == "load"]
    assert loads[0] == 0  # nothing read before the first model is loaded
    # each model is loaded before any store read of its pass, and each pass reads every test store
    n_test = len(ev[loads[0] + 1 : loads[1]])
    assert n_test == len(ev) - loads[1] - 1 > 0
    assert any("seed2" in s for s in evaluated["summary"].skipped_runs)
    assert evaluated["summary"].models == [(METHOD, 0), (METHOD, 1)]


def test_predictions_schema_and_values_match_the_saved_model(evaluated):
    from wsi_pipeline.inference.trained import load_trained_model

    cfg, out = evaluated["cfg"], evaluated["summary"].results_dir
    man = evaluated["manifest"]
    for cohort, split_ids in (("synthetic", man[(man.cohort == "synthetic") & (man.split == "test")].slide_id),
                              ("ext", man[man.cohort == "ext"].slide_id)):
        for prot, n_rep in (("all", 1), ("sub8x5", 5), ("ens8x5", 5)):
            df = pd.read_csv(out / f"predictions_{cohort}_{prot}.csv")
            assert list(df.columns) == prediction_columns(2)
            assert sorted(df.slide_id.unique()) == sorted(split_ids)  # train/val slides never evaluated
            assert len(df) == 2 * len(split_ids)  # one row per slide and seed
            assert set(df.seed) == {0, 1} and set(df.method) == {METHOD} and set(df.protocol) == {prot}
            assert (df.n_repeats == n_rep).all()
            np.testing.assert_allclose(df[["prob_0", "prob_1"]].sum(axis=1), 1.0, atol=1e-5)
    # the all-tiles probabilities equal a plain forward of the saved model on the store's tiles
    df = pd.read_csv(out / "predictions_ext_all.csv")
    row = df[df.seed == 1].iloc[0]
    model = load_trained_model(cfg.run_dir(METHOD, 1))
    store = open_store(store_path(cfg.data.tiles_dir, row.slide_id))
    with torch.no_grad():
        p = torch.softmax(model.aggregator(model.encoder.eval()(tiles_to_tensor(store.read()))).logits, 0).numpy()
    np.testing.assert_allclose([row.prob_0, row.prob_1], p, atol=1e-5)
    assert row.n_tiles == len(store)


def test_metrics_json_matches_sklearn_on_the_predictions(evaluated):
    from wsi_pipeline.config.evaluation import EvalProtocol
    from wsi_pipeline.inference.protocols import protocol_rng, subset_indices
    from wsi_pipeline.inference.trained import load_trained_model

    cfg, out = evaluated["cfg"], evaluated["summary"].results_dir
    recs = json.loads((out / "metrics.json").read_text())["records"]
    for r in recs:
        assert set(r) - {"repeat"} == {"method", "seed", "cohort", "split", "protocol", "metric", "value"}
    head = [r for r in recs if "repeat" not in r]
    look = {(r["seed"], r["cohort"], r["split"], r["protocol"], r["metric"]): r["value"] for r in head}
    assert len(look) == len(head)  # one headline value per key
    per_rep = {(r["seed"], r["cohort"], r["protocol"], r["metric"], r["repeat"]): r["value"] for r in recs if "repeat" in r}

    # the ensemble protocol: sklearn on the CSV's mean probabilities
    ens = pd.read_csv(out / "predictions_synthetic_ens8x5.csv")
    for seed in (0, 1):
        d = ens[ens.seed == seed]
        assert look[(seed, "synthetic", "test", "ens8x5", "accuracy")] == pytest.approx(
            accuracy_score(d.label, d[["prob_0", "prob_1"]].to_numpy().argmax(1)))
        assert look[(seed, "synthetic", "test", "ens8x5", "auc")] == pytest.approx(roc_auc_score(d.label, d.prob_1))

    # the papers' protocol: every repeat re-predicted here from the saved model on that repeat's
    # tiles, scored by sklearn; the model's value is the mean over repeats
    man = evaluated["manifest"]
    test = man[(man.cohort == "synthetic") & (man.split == "test")]
    y = test.label.astype(int).to_numpy()
    means = {"accuracy": [], "auc": []}
    for seed in (0, 1):
        model = load_trained_model(cfg.run_dir(METHOD, seed))
        enc = model.encoder.eval()
        p1 = np.zeros((5, len(test)))
        with torch.no_grad():
            for i, sid in enumerate(test.slide_id):
                store = open_store(store_path(cfg.data.tiles_dir, sid))
                subsets = subset_indices(len(store), EvalProtocol(8, 5), protocol_rng(cfg.eval.seed, sid, "sub8x5"))
                assert len(subsets) == 5  # every store has more than 8 tiles
                for r, idx in enumerate(subsets):
                    p1[r, i] = torch.softmax(model.aggregator(enc(tiles_to_tensor(store.read(idx)))).logits, 0)[1].item()
        accs = [accuracy_score(y, p1[r] > 0.5) for r in range(5)]
        aucs = [roc_auc_score(y, p1[r]) for r in range(5)]
        for r in range(5):
            assert per_rep[(seed, "synthetic", "sub8x5", "accuracy", r)] == pytest.approx(accs[r])
            assert per_rep[(seed, "synthetic", "sub8x5", "auc", r)] == pytest.approx(aucs[r], abs=1e-6)
        assert look[(seed, "synthetic", "test", "sub8x5", "accuracy")] == pytest.approx(np.mean(accs))
        assert look[(seed, "synthetic", "test", "sub8x5", "auc")] == pytest.approx(np.mean(aucs), abs=1e-6)
        assert look[(seed, "synthetic", "test", "sub8x5", "auc_repeat_std")] == pytest.approx(np.std(aucs, ddof=1), abs=1e-6)
        assert look[(seed, "synthetic", "test", "sub8x5", "n_repeats")] == 5
        means["accuracy"].append(np.mean(accs))
        means["auc"].append(np.mean(aucs))
    # mean +- std over seeds of the per-seed repeat means
    assert look[("mean", "synthetic", "test", "sub8x5", "accuracy")] == pytest.approx(np.mean(means["accuracy"]))
    assert look[("std", "synthetic", "test", "sub8x5", "accuracy")] == pytest.approx(np.std(means["accuracy"], ddof=1))
    assert look[("mean", "synthetic", "test", "sub8x5", "auc")] == pytest.approx(np.mean(means["auc"]), abs=1e-6)
    for prot in ("all", "sub8x5", "ens8x5"):
        lo, hi = look[("mean", "ext", "external", prot, "auc_ci_low")], look[("mean", "ext", "external", prot, "auc_ci_high")]
        assert lo is None or lo <= hi


def test_localisation_and_heatmaps_of_the_first_model(evaluated):
    cfg, out = evaluated["cfg"], evaluated["summary"].results_dir
    recs = json.loads((out / "metrics.json").read_text())["records"]
    loc = {r["cohort"]: r["value"] for r in recs if r["metric"] == "localisation_auc" and r["seed"] == 0}
    man = evaluated["manifest"]
    for cohort in ("synthetic", "ext"):
        ids = man[(man.cohort == cohort) & ((man.split == "test") | (cohort == "ext"))].slide_id
        per_slide = []
        for sid in ids:
            store = open_store(store_path(cfg.data.tiles_dir, sid))
            scores = pd.read_csv(out / "heatmaps" / f"{sid}_scores.csv")
            np.testing.assert_array_equal(scores[["x", "y"]].to_numpy(), store.coords)
            # truth read directly from the mask (one mask px per grid cell), not via tile_lesion_fraction
            mask = np.asarray(Image.open(man.set_index("slide_id").loc[sid, "lesion_mask"]).convert("L")) > 127
            truth = mask[store.grid[:, 1], store.grid[:, 0]]
            if 0 < truth.sum() < len(truth):
                per_slide.append(roc_auc_score(truth, scores.attention))
            with Image.open(out / "heatmaps" / f"{sid}.png") as png:  # closed: no ResourceWarning
                png_size = png.size
            extent = store.tile_size
            h, w = thumbnail_shape(store_level0_size(store.attrs, store.coords, extent))
            assert png_size == (w, h)
            geo = json.loads((out / "heatmaps" / f"{sid}.geojson").read_text())
            assert len(geo["features"]) == len(store)
        assert loc[cohort] == pytest.approx(np.mean(per_slide))


def test_report_is_self_contained(evaluated):
    html = (evaluated["summary"].results_dir / "report.html").read_text()
    assert "<svg" in html and "data:image/png;base64," in html
    assert "sub8x5" in html and "ens8x5" in html and "synthetic (test)" in html and "ext (external)" in html
    assert "repeats sd" in html  # the per-repeat protocol shows its std over repeats
    import re

    srcs = re.findall(r'src="([^"]+)"', html)
    assert srcs and all(s.startswith("data:") for s in srcs)


def test_eval_cli(evaluated, capsys):
    from wsi_pipeline.cli.main import main

    tmp = evaluated["tmp"]
    rc = main(["eval", "--config", str(tmp / "t.yaml"), "--bootstrap", "0", "--no-heatmaps", "--quiet",
               "--results", str(tmp / "cli_results"), "--set", "eval.protocols=[all]"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Evaluated 2 model(s)" in out and "report.html" in out
    assert sorted(p.name for p in (tmp / "cli_results").glob("predictions_*.csv")) == ["predictions_ext_all.csv", "predictions_synthetic_all.csv"]


def test_eval_on_no_scorable_slide_exits_1_with_the_reason(evaluated, tmp_path, capsys):
    """Every test slide left out by the tiler: not "Evaluated 2 model(s) on 0 slide(s)" and exit 0."""
    from wsi_pipeline.cli.main import main

    tmp = evaluated["tmp"]
    manifest = evaluated["manifest"]
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    test_ids = manifest.loc[manifest["split"] == "test", "slide_id"].tolist()
    pd.DataFrame([{"slide_id": sid, "status": "skipped", "n_tiles": 0, "note": "skipped: dark background (fluorescence?)"}
                  for sid in test_ids]).to_csv(tiles / "tiling_report.csv", index=False)
    rc = main(["eval", "--config", str(tmp / "t.yaml"), "--bootstrap", "0", "--no-heatmaps", "--quiet",
               "--results", str(tmp_path / "res"), "--set", "eval.protocols=[all]", "--set", f"data.tiles_dir={tiles}"])
    out = capsys.readouterr()
    assert rc == 1
    assert f"{len(test_ids)} left out by the tiler" in out.err and "no test or external slide could be scored" in out.err
    assert "run `wsi-pipeline tile` for them" not in out.out  # the tiler did run: that hint would be wrong


def test_predict_on_a_folder_of_stores(evaluated, tmp_path, capsys):
    import shutil

    cfg = evaluated["cfg"]
    stores = tmp_path / "stores"
    stores.mkdir()
    for sid in ("ext_000", "ext_001"):
        shutil.copytree(store_path(cfg.data.tiles_dir, sid), stores / f"{sid}.zarr")
    from wsi_pipeline.cli.main import main

    rc = main(["predict", "--model", str(cfg.run_dir(METHOD, 0)), "--slides", str(stores), "--out", str(tmp_path / "pred"),
               "--device", "cpu", "--protocol", "all", "--protocol", "sub8x5", "--quiet"])
    assert rc == 0
    df = pd.read_csv(tmp_path / "pred" / "predictions.csv")
    extra = ["stain_distance", "off_distribution", "stain_normalised", "stain_problem"]
    assert list(df.columns) == prediction_columns(2) + extra and df.label.isna().all()
    assert len(df) == 4 and set(df.protocol) == {"all", "sub8x5"}
    ref = pd.read_csv(evaluated["summary"].results_dir / "predictions_ext_all.csv")
    ref = ref[(ref.seed == 0)].set_index("slide_id")
    got = df[df.protocol == "all"].set_index("slide_id")
    np.testing.assert_allclose(got.loc[["ext_000", "ext_001"], "prob_1"], ref.loc[["ext_000", "ext_001"], "prob_1"], atol=1e-5)
    assert (tmp_path / "pred" / "heatmaps" / "ext_000.png").is_file()
    assert "predictions.csv" in capsys.readouterr().out
    # a friendly error, not a traceback, for a wrong path
    assert main(["predict", "--model", str(cfg.run_dir(METHOD, 0)), "--slides", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "slides folder not found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="slides folder not found"):
        predict_slides(cfg.run_dir(METHOD, 0), tmp_path / "nope", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no finished run of pipeline 't'"):
        evaluate_pipeline(dataclasses.replace(cfg, runs_dir=str(tmp_path / "empty_runs")), device="cpu", progress=False)


def test_trained_end_to_end_abmil_localises_planted_lesions(tmp_path):
    """Train ResNet-18 + ABMIL end to end (the training loop) on the synthetic store cohort, then
    evaluate: tile attention must separate planted-lesion tiles from normal ones (AUC >= 0.8)."""
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.training.loop import train_pipeline

    manifest = make_store_cohort(tmp_path / "data", n_slides=12, tiles_per_slide=(12, 20), seed=0)
    raw = _raw_config(tmp_path, manifest, [0])
    raw["eval"]["protocols"] = ["all"]
    raw["train"] = {"epochs": 2, "lr": 2.0e-4, "bag_size": 64, "batch_bags": 1}
    raw["methods"][0]["encoder"] = {"name": "resnet18", "bn": "frozen"}
    cfg = config_from_dict(raw)
    train_pipeline(cfg, device="cpu", progress=False)
    summary = evaluate_pipeline(cfg, device="cpu", n_boot=0, heatmaps=False, progress=False)
    recs = json.loads((summary.results_dir / "metrics.json").read_text())["records"]
    loc = {(r["seed"], r["cohort"]): r["value"] for r in recs if r["metric"] == "localisation_auc"}
    assert loc[(0, "synthetic")] >= 0.8, loc


def _damaged_tiles(src: Path, dest: Path, damaged: str) -> Path:
    """A copy of the tile stores in ``src`` with every tile shard of ``damaged`` overwritten (checksums fail)."""
    import shutil

    shutil.copytree(src, dest)
    for shard in (dest / f"{damaged}.zarr" / "tiles").glob("c*"):
        if shard.is_file():
            shard.write_bytes(b"\x00" * shard.stat().st_size)
    return dest


def _bug_for(slide_id: str, real):
    def scored(model, config, store, *args, **kwargs):
        if str(store.path.name).startswith(slide_id):
            raise TypeError("unsupported operand type(s) for /: 'NoneType' and 'int'")
        return real(model, config, store, *args, **kwargs)
    return scored


def test_bad_slide_policy_in_eval(evaluated, tmp_path, monkeypatch):
    """wsi_pipeline.failures in eval: a damaged store fails that slide by name and the others are scored; a
    TypeError inside the per-slide scoring (a bug) stops the run."""
    import wsi_pipeline.evaluation.evaluate as runner_mod
    from wsi_pipeline.config.pipeline import config_from_dict

    raw = _raw_config(evaluated["tmp"], evaluated["cfg"].data.manifest, [0])
    raw["data"]["tiles_dir"] = str(_damaged_tiles(Path(evaluated["cfg"].data.tiles_dir), tmp_path / "tiles", "ext_001"))
    raw["eval"]["protocols"] = ["all"]
    raw["results_dir"] = str(tmp_path / "results")
    cfg = config_from_dict(raw)
    summary = evaluate_pipeline(cfg, device="cpu", n_boot=0, heatmaps=False, progress=False)
    assert list(summary.failed_slides) == ["ext_001"] and "checksum" in summary.failed_slides["ext_001"]
    pred = pd.read_csv(summary.results_dir / "predictions_ext_all.csv")
    assert sorted(pred.slide_id) == ["ext_000", "ext_002", "ext_003"]  # the slides after the damaged one too

    monkeypatch.setattr(runner_mod, "score_slide", _bug_for("ext_001", runner_mod.score_slide))
    raw["data"]["tiles_dir"] = evaluated["cfg"].data.tiles_dir
    raw["results_dir"] = str(tmp_path / "results2")
    with pytest.raises(TypeError, match="unsupported operand"):
        evaluate_pipeline(config_from_dict(raw), device="cpu", n_boot=0, heatmaps=False, progress=False)


def test_bad_slide_policy_in_predict(evaluated, tmp_path, monkeypatch):
    """wsi_pipeline.failures in predict: a damaged store is a failed slide named in the summary and the next
    slide is predicted; a TypeError inside the per-slide scoring (a bug) stops the run."""
    import shutil

    import wsi_pipeline.evaluation.predict as predict_mod

    tiles = Path(evaluated["cfg"].data.tiles_dir)
    stores = tmp_path / "stores"
    stores.mkdir()
    for sid in ("ext_000", "ext_001", "ext_002"):
        shutil.copytree(tiles / f"{sid}.zarr", stores / f"{sid}.zarr")
    _damaged_tiles(stores, tmp_path / "bad", "ext_001")
    model = evaluated["cfg"].run_dir(METHOD, 0)
    summary = predict_slides(model, tmp_path / "bad", tmp_path / "pred", protocols=["all"], device="cpu", heatmaps=False,
                             progress=False)
    assert [sid for sid, _ in summary.failed] == ["ext_001"]
    assert summary.failed[0][1].startswith("StoreDamagedError") and "checksum" in summary.failed[0][1]
    assert pd.read_csv(tmp_path / "pred" / "predictions.csv")["slide_id"].tolist() == ["ext_000", "ext_002"]

    monkeypatch.setattr(predict_mod, "score_slide", _bug_for("ext_001", predict_mod.score_slide))
    with pytest.raises(TypeError, match="unsupported operand"):
        predict_slides(model, stores, tmp_path / "pred2", protocols=["all"], device="cpu", heatmaps=False, progress=False)
    assert not (tmp_path / "pred2" / "predictions.csv").exists()
