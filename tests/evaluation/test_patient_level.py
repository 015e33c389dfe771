"""Patient-level evaluation (``eval.level: patient``) on a generated cohort with several slides per patient.

Hand-built run folders (random ResNet-18 + ABMIL saved in the checkpoint format, as in
``test_eval_runner``) are evaluated by the evaluation stage; the patient metrics it records must
equal a hand computation here: each patient's score is the mean (or the max) of its slides'
scores read back from the predictions CSV, and the C-index / AUC of those is computed with a
loop over pairs (survival) or scikit-learn (classification).
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from wsi_pipeline.export.metrics_json import read_metrics_json
from wsi_pipeline.export.predictions import predictions_path, read_predictions
from wsi_pipeline.manifests.schema import read_manifest, write_manifest

pytestmark = pytest.mark.slow


def _harrell_by_pairs(time, event, risk) -> float:
    """Concordant pairs / comparable pairs, ties in risk counting one half."""
    num = den = 0.0
    for i, j in itertools.permutations(range(len(time)), 2):
        if event[i] and (time[i] < time[j] or (time[i] == time[j] and not event[j])):
            den += 1
            num += 1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0
    return num / den


def _cohort(tmp):
    """24 slides of 8 patients (3 slides each): patients 0-2 train, 3 val, 4-7 test; survival per patient."""
    from wsi_pipeline.synthetic.stores import make_store_cohort

    df = read_manifest(make_store_cohort(tmp / "data", n_slides=24, tile_size=16, tiles_per_slide=(3, 5), seed=0))
    rng = np.random.default_rng(0)
    patient = np.arange(24) // 3
    p_time = np.round(rng.uniform(5, 50, 8), 1)
    p_event = np.array([1, 0, 1, 1, 1, 0, 1, 1])
    df["patient_id"] = [f"p{k}" for k in patient]
    df["split"] = np.where(patient < 3, "train", np.where(patient == 3, "val", "test"))
    df["time"] = p_time[patient]
    df["event"] = p_event[patient]
    df["label"] = ((patient % 2 == 1) & (np.arange(24) % 3 == 0)).astype(int)  # odd patients: one positive slide of three
    df["target"] = np.round(rng.uniform(0, 20, 8), 2)[patient]
    return write_manifest(df, tmp / "data" / "patients.csv")


def _evaluate(tmp, manifest, task: str, pool: str):
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.tasks import Endpoint
    from wsi_pipeline.methods.models import build_models

    method = {"name": "m", "strategy": "full", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}, "chunk_size": 16}
    data = {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles")}
    if task == "survival":
        method.update(task="survival", loss="cox", train={"batch_bags": 4})
    elif task == "regression":
        method.update(task="regression", loss="huber")
    else:
        data["n_classes"] = 2
    raw = {"name": f"{task}_{pool}", "data": data, "seeds": [0], "methods": [method],
           "eval": {"protocols": ["all"], "level": "patient", "patient_pool": pool, "bootstrap": 0},
           "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results")}
    cfg = config_from_dict(raw)
    # a wide target sd spreads the random model's nearly constant outputs far beyond the CSV's 6 significant digits
    endpoint = Endpoint(task=task, loss=cfg.methods[0].loss, n_outputs=2 if task == "classification" else 1,
                        target_mean=0.0, target_sd=1000.0)
    torch.manual_seed(0)
    enc, agg = build_models(cfg.methods[0], endpoint.n_outputs, for_training=False)
    run = cfg.run_dir("m", 0)
    save_run_checkpoint(run / "best.pt", RunCheckpoint.build(
        cfg, cfg.methods[0], seed=0, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()},
        endpoint=endpoint))
    (run / "done").touch()
    summary = evaluate_pipeline(cfg, device="cpu", heatmaps=False, progress=False)
    records = {r.metric: r.value for r in read_metrics_json(summary.results_dir / "metrics.json")
               if r.seed == 0 and r.split == "test" and r.repeat is None}
    preds = read_predictions(predictions_path(summary.results_dir, "synthetic", "all"))
    return records, preds


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("patients")
    return tmp, _cohort(tmp)


def test_patient_c_index_equals_hand_computation(cohort):
    tmp, manifest = cohort
    pool = "mean"
    records, preds = _evaluate(tmp, manifest, "survival", pool)
    assert list(preds["patient_id"]) == [f"p{i // 3}" for i in range(12, 24)]  # every test slide, with its patient
    # slides: the C-index of the CSV's risks
    assert records["c_index"] == pytest.approx(_harrell_by_pairs(preds["time"].to_numpy(), preds["event"].to_numpy(),
                                                                 preds["risk"].to_numpy()), abs=1e-12)
    # patients: pool the slides' risks by hand
    per = preds.groupby("patient_id", sort=False).agg(time=("time", "first"), event=("event", "first"), risk=("risk", pool))
    assert len(per) == 4
    want = _harrell_by_pairs(per["time"].to_numpy(), per["event"].to_numpy(), per["risk"].to_numpy())
    assert records["patient_c_index"] == pytest.approx(want, abs=1e-6)  # the CSV holds 6 significant digits
    assert records["patient_n_slides"] == 4


def test_patient_pooling_by_hand():
    """``pool_patients``: mean, or the scores of the slide with the highest risk / P(last class), per repeat."""
    from wsi_pipeline.evaluation.endpoint_records import pool_patients

    patients = ["a", "b", "a", "b", "c"]
    risk = np.array([0.1, 2.0, 0.7, -1.0, 0.3])
    curves = np.arange(10.0).reshape(5, 2)
    targets = [(5.0, 1), (7.0, 0), (5.0, 1), (7.0, 0), (2.0, 1)]
    ids, pt, pooled = pool_patients(patients, targets, [{"risk": risk, "survival": curves}], "mean", "survival")
    assert ids == ["a", "b", "c"] and pt == [(5.0, 1), (7.0, 0), (2.0, 1)]
    assert pooled[0]["risk"] == pytest.approx([0.4, 0.5, 0.3]) and pooled[0]["survival"][0] == pytest.approx([2.0, 3.0])
    _, _, top = pool_patients(patients, targets, [{"risk": risk, "survival": curves}], "max", "survival")
    assert top[0]["risk"] == pytest.approx([0.7, 2.0, 0.3]) and top[0]["survival"][1] == pytest.approx([2.0, 3.0])
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5], [0.3, 0.7]])
    _, labels, top = pool_patients(patients, [0, 1, 1, 0, 0], [{"probs": probs}], "max", "classification")
    assert labels == [1, 1, 0] and top[0]["probs"].tolist() == [[0.6, 0.4], [0.2, 0.8], [0.3, 0.7]]


def test_patient_auc_equals_hand_computation(cohort):
    tmp, manifest = cohort
    records, preds = _evaluate(tmp, manifest, "classification", "mean")
    truth = read_manifest(manifest).set_index("slide_id")["label"]
    per = preds.assign(true=[int(truth[s]) for s in preds["slide_id"]]).groupby("patient_id", sort=False).agg(
        prob=("prob_1", "mean"), label=("true", "max"))  # a patient is positive when any of its slides is
    assert records["patient_auc"] == pytest.approx(roc_auc_score(per["label"], per["prob"]), abs=1e-6)
    assert records["patient_n_slides"] == 4 and records["n_slides"] == 12


def test_regression_metrics_of_slides_and_patients_equal_hand_computation(cohort):
    """A regression model's evaluation: the predictions CSV's values are the standardised output mapped back,
    and the slide and patient (max pooling) metrics are those of the CSV's values, computed here."""
    from scipy.stats import pearsonr, spearmanr

    tmp, manifest = cohort
    records, preds = _evaluate(tmp, manifest, "regression", "max")
    y, p = preds["target"].to_numpy(), preds["prediction"].to_numpy()
    assert records["mae"] == pytest.approx(np.mean(np.abs(y - p)), rel=1e-5)  # the CSV holds 6 significant digits
    assert records["rmse"] == pytest.approx(np.sqrt(np.mean((y - p) ** 2)), rel=1e-5)
    per = preds.groupby("patient_id", sort=False).agg(target=("target", "first"), prediction=("prediction", "max"))
    assert records["patient_mae"] == pytest.approx(np.mean(np.abs(per["target"] - per["prediction"])), rel=1e-5)
    assert records["patient_pearson"] == pytest.approx(pearsonr(per["target"], per["prediction"]).statistic, abs=1e-4)
    assert records["patient_spearman"] == pytest.approx(spearmanr(per["target"], per["prediction"]).statistic, abs=1e-9)


def test_patient_targets_must_agree(cohort):
    tmp, manifest = cohort
    df = read_manifest(manifest)
    df.loc[0, "time"] = 999.0
    with pytest.raises(ValueError, match=r"patient\(s\) p0 disagree on time"):
        write_manifest(df, tmp / "bad.csv")
    df = pd.read_csv(manifest)
    df.loc[1, "event"] = 2
    with pytest.raises(ValueError, match="event must be 0 .censored. or 1"):
        write_manifest(df, tmp / "bad.csv")


def test_predict_exports_risk_and_the_discrete_time_survival_curve(cohort, tmp_path):
    """``predict`` with a discrete-time model: ``risk`` and ``survival_at_<t>`` per slide, equal to the model's
    hazards computed here (S after interval k = prod_{i<=k} (1 - sigmoid(z_i)), risk = -sum_k S_k)."""
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.evaluation.predict import predict_slides
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.tasks import Endpoint
    from wsi_pipeline.methods.models import build_models

    tmp, manifest = cohort
    method = {"name": "d", "strategy": "full", "task": "survival", "loss": "nll_discrete", "loss_options": {"bins": 3},
              "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}}
    cfg = config_from_dict({"name": "disc", "data": {"manifest": str(manifest), "tiles_dir": str(tmp / "data" / "tiles")},
                            "methods": [method], "seeds": [0]})
    endpoint = Endpoint(task="survival", loss="nll_discrete", n_outputs=3, edges=(12.5, 30.0))
    torch.manual_seed(1)
    enc, agg = build_models(cfg.methods[0], 3, for_training=False)
    ckpt = save_run_checkpoint(tmp_path / "best.pt", RunCheckpoint.build(
        cfg, cfg.methods[0], seed=0, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()},
        endpoint=endpoint))
    import shutil

    for sid in ("synthetic_000", "synthetic_017"):  # a folder of two stores
        shutil.copytree(tmp / "data" / "tiles" / f"{sid}.zarr", tmp_path / "new" / f"{sid}.zarr")
    summary = predict_slides(ckpt, tmp_path / "new", tmp_path / "out", device="cpu", heatmaps=False, progress=False)
    df = pd.read_csv(summary.predictions)
    assert ["risk", "survival_at_12.5", "survival_at_30", "survival_at_inf"] == [
        c for c in df.columns if c == "risk" or c.startswith("survival_at_")]
    enc.eval(), agg.eval()
    for sid in ("synthetic_000", "synthetic_017"):
        store = open_store(tmp_path / "new" / f"{sid}.zarr")
        with torch.no_grad():
            z = agg(enc(tiles_to_tensor(store.read(np.arange(len(store)))))).logits.double().numpy()
        surv = np.cumprod(1 - 1 / (1 + np.exp(-z)))
        row = df[df["slide_id"] == sid].iloc[0]
        assert [row["survival_at_12.5"], row["survival_at_30"], row["survival_at_inf"]] == pytest.approx(surv, rel=1e-4)
        assert row["risk"] == pytest.approx(-surv.sum(), rel=1e-4)


def test_patient_bags_train_and_evaluate(cohort):
    """``data.bags: patient``: training draws one bag per patient (the tiles of its 3 slides), and evaluation
    scores each patient as one bag: its risk equals the trained model applied here to the concatenated
    tiles of its slides, and the C-index is that of those risks."""
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.training.loop import train_pipeline

    tmp, manifest = cohort
    tiles = tmp / "data" / "tiles"
    cfg = config_from_dict({
        "name": "bags", "data": {"manifest": str(manifest), "tiles_dir": str(tiles), "bags": "patient"}, "seeds": [0],
        "methods": [{"name": "cox", "strategy": "accumulate", "task": "survival", "loss": "cox", "chunk_size": 8,
                     "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}}],
        "train": {"epochs": 1, "batch_bags": 3, "bag_size": 8},
        "eval": {"protocols": ["all"], "bootstrap": 0}, "runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results"),
    })
    run = train_pipeline(cfg, device="cpu", progress=False)[0]
    summary = evaluate_pipeline(cfg, device="cpu", progress=False)
    preds = read_predictions(predictions_path(summary.results_dir, "synthetic", "all"))
    assert list(preds["slide_id"]) == ["p4", "p5", "p6", "p7"] and list(preds["patient_id"]) == list(preds["slide_id"])
    model = load_trained_model(run, device="cpu")
    for k, row in preds.iterrows():
        stores = [open_store(tiles / f"synthetic_{3 * (4 + k) + j:03d}.zarr") for j in range(3)]
        x = np.concatenate([s.read(np.arange(len(s))) for s in stores])
        with torch.no_grad():
            risk = float(model.aggregator(model.encoder(tiles_to_tensor(x))).logits[0])
        assert row["risk"] == pytest.approx(risk, rel=1e-4, abs=1e-5)
    records = {r.metric: r.value for r in read_metrics_json(summary.results_dir / "metrics.json")
               if r.seed == 0 and r.split == "test" and r.repeat is None}
    assert records["c_index"] == pytest.approx(
        _harrell_by_pairs(preds["time"].to_numpy(), preds["event"].to_numpy(), preds["risk"].to_numpy()), abs=1e-12)
    assert records["n_slides"] == 4  # the units are patients


def test_manifest_folder_takes_survival_columns_by_any_name(tmp_path):
    """``manifest folder --labels`` with a survival CSV named otherwise (``--time-column`` / ``--event-column``),
    no label column: the manifest carries ``time`` and ``event``, splits drawn per patient; bad values are named."""
    from wsi_pipeline.cli.main import main

    slides = tmp_path / "slides"
    slides.mkdir()
    ids = [f"s{i}" for i in range(12)]
    for s in ids:
        (slides / f"{s}.svs").write_bytes(b"x")
    patient = np.arange(12) // 2  # two slides per patient, which share the patient's time and event
    labels = pd.DataFrame({"slide_id": ids, "os_months": patient * 3 + 1.5, "dead": patient % 2,
                           "patient_id": [f"p{k}" for k in patient]})
    labels.to_csv(tmp_path / "labels.csv", index=False)
    out = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(tmp_path / "labels.csv"),
                 "--time-column", "os_months", "--event-column", "dead", "--out", str(out)]) == 0
    df = read_manifest(out).set_index("slide_id")
    assert df.loc["s3", "time"] == 4.5 and df.loc["s3", "event"] == 1 and df["label"].isna().all()
    assert set(df["split"]) <= {"train", "val", "test"} and (df.groupby("patient_id")["split"].nunique() == 1).all()
    labels.loc[3, "os_months"] = -2.0
    labels.to_csv(tmp_path / "bad.csv", index=False)
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(tmp_path / "bad.csv"), "--time-column",
                 "os_months", "--event-column", "dead", "--out", str(tmp_path / "b.csv")]) != 0
