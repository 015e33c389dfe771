"""The report leads with the best: model chosen on validation, lesion outlines on its heatmaps, the
per-method localisation beside them, every metric the terminal prints.

References: nearest-neighbour indices in exact integer arithmetic for the mask sampling, SciPy's binary erosion and
Euclidean distance transform for where an outline may and must be drawn, and values read back
from the metrics records written here.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from scipy import ndimage

from wsi_pipeline.export.heatmap import OUTLINE_COLOUR, mask_to_thumbnail, outline_width, render_heatmap
from wsi_pipeline.export.metrics_json import MetricRecord, write_metrics_json
from wsi_pipeline.export.report import best_on_validation, rank_methods, write_report


@pytest.mark.parametrize("mask_shape,ds,thumb", [((37, 53), 16.0, (300, 430)), ((40, 40), 8.0, (97, 97)), ((25, 60), 32.0, (64, 150))])
def test_mask_to_thumbnail_samples_the_mask_px_under_each_centre(mask_shape, ds, thumb):
    rng = np.random.default_rng(0)
    mask = rng.random(mask_shape) > 0.6
    level0 = (int(mask_shape[1] * ds), int(mask_shape[0] * ds))  # the mask covers level 0 exactly
    got = mask_to_thumbnail(mask, ds, level0, thumb)
    # nearest neighbour in exact integer arithmetic: thumbnail px x has its centre at (x + 1/2) * mw / w mask px
    h, w = thumb
    ix = [((2 * x + 1) * mask_shape[1]) // (2 * w) for x in range(w)]
    iy = [((2 * y + 1) * mask_shape[0]) // (2 * h) for y in range(h)]
    ref = mask[np.ix_(iy, ix)]
    np.testing.assert_array_equal(got, ref)
    # a level 0 larger than the mask: the part beyond the mask is False, the rest unchanged
    big = mask_to_thumbnail(mask, ds, (2 * level0[0], level0[1]), (thumb[0], 2 * thumb[1]))
    np.testing.assert_array_equal(big[:, thumb[1]:], False)
    np.testing.assert_array_equal(big[:, : thumb[1]], ref)
    with pytest.raises(ValueError, match="2-D"):
        mask_to_thumbnail(mask[None], ds, level0, thumb)


def test_outline_is_drawn_on_the_lesion_border_and_nowhere_else():
    rng = np.random.default_rng(1)
    h, w, T = 240, 320, 20
    thumb = rng.integers(150, 255, (h, w, 3), dtype=np.uint8)
    gx, gy = np.meshgrid(np.arange(w // T), np.arange(h // T))
    coords = np.stack([gx.ravel(), gy.ravel()], 1) * T  # level 0 = thumbnail px here
    scores = rng.random(len(coords))
    yy, xx = np.mgrid[0:h, 0:w]
    lesion = ((yy - 110) ** 2 + (xx - 150) ** 2 < 55**2) | ((yy > 20) & (yy < 60) & (xx > 250) & (xx < 300))
    plain = render_heatmap(thumb, coords, T, scores, level0_size=(w, h), legend=False)
    drawn = render_heatmap(thumb, coords, T, scores, level0_size=(w, h), legend=False, outline=lesion)
    # border px: lesion px with a 4-neighbour outside it (the border following definition of OpenCV's contours)
    border = lesion & ~ndimage.binary_erosion(lesion, structure=ndimage.generate_binary_structure(2, 1))
    assert border.sum() > 100
    assert (drawn[border] == OUTLINE_COLOUR).all()  # every border px of the lesion is outlined
    # beyond the line's half width (plus one px of rasterisation) from the border, nothing changes
    far = ndimage.distance_transform_edt(~border) > outline_width((h, w)) / 2 + 1.5
    np.testing.assert_array_equal(drawn[far], plain[far])
    # the legend says what the line is
    with_legend = render_heatmap(thumb, coords, T, scores, level0_size=(w, h), outline=lesion)
    assert with_legend.shape == thumb.shape
    with pytest.raises(ValueError, match="outline mask has shape"):
        render_heatmap(thumb, coords, T, scores, level0_size=(w, h), outline=lesion[:-1])


def _records(methods_auc: dict[str, list[float]], loc: dict[str, float]) -> list[MetricRecord]:
    recs = []
    for meth, aucs in methods_auc.items():
        for seed, auc in enumerate(aucs):
            for metric, v in (("auc", auc), ("qwk", auc - 0.3), ("accuracy", auc - 0.1), ("balanced_accuracy", auc - 0.12)):
                recs.append(MetricRecord(meth, seed, "internal", "test", "all", metric, v))
            recs.append(MetricRecord(meth, seed, "internal", "test", "all", "localisation_auc", loc[meth] + 0.01 * seed))
    return recs


def test_report_leads_with_the_model_chosen_on_validation(tmp_path):
    recs = _records({"frozen": [0.70, 0.72], "e2e": [0.95, 0.91], "bigl": [0.80, 0.84]},
                    {"frozen": 0.61, "e2e": 0.97, "bigl": 0.85})
    mpath = write_metrics_json(tmp_path / "metrics.json", recs)
    # validation ranks e2e first, bigl second, frozen last (test values play no part in the order)
    val = {("frozen", 0): ("auc", 0.60), ("frozen", 1): ("auc", 0.64), ("e2e", 0): ("auc", 0.90), ("e2e", 1): ("auc", 0.98),
           ("bigl", 0): ("auc", 0.75), ("bigl", 1): ("auc", 0.70)}
    png = tmp_path / "heatmaps" / "internal_000.png"
    png.parent.mkdir()
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(png)
    gallery = [{"slide_id": "internal_000", "cohort": "internal", "label": 1, "png": png, "probs": np.array([0.2, 0.8]),
                "localisation": 0.9321, "outline": True}]
    pred = pd.DataFrame({"slide_id": ["a", "b"] * 3, "cohort": "internal", "label": [0, 1] * 3, "pred": [0, 1] * 3,
                         "prob_0": [0.8, 0.3] * 3, "prob_1": [0.2, 0.7] * 3, "protocol": "all",
                         "method": ["frozen"] * 2 + ["e2e"] * 2 + ["bigl"] * 2, "seed": 0})
    out = write_report(tmp_path / "report.html", pipeline="p", predictions=pred, metrics_path=mpath, n_classes=2,
                       gallery=gallery, protocols=["all"], validation=val, heatmap_run=("e2e", 1), heatmap_chosen_on_validation=True)
    page = out.read_text()
    text = re.sub(r"<[^>]+>", " ", page)
    assert "Model chosen on validation:" in text and "e2e seed 1" in text and "validation auc 0.980" in text
    # sections: the summary, then heatmaps with localisation, then the metric tables
    assert page.index("<h2>Summary") < page.index("<h2>Heatmaps and localisation") < page.index("<h2>Metrics")
    # every table lists the methods best on validation first
    for table in re.findall(r"<table>.*?</table>", page)[:3]:
        names = re.findall(r'<td class="m">([a-z0-9_]+)', table)
        assert names == ["e2e", "bigl", "frozen"], names
    # ROC legend and confusion matrices in the same order
    assert [page.index(f">{m} s0<") for m in ("e2e", "bigl", "frozen")] == sorted(page.index(f">{m} s0<") for m in ("e2e", "bigl", "frozen"))
    assert [page.index(f">{m}, internal<") for m in ("e2e", "bigl", "frozen")] == sorted(page.index(f">{m}, internal<") for m in ("e2e", "bigl", "frozen"))
    # the summary's validation cell is the seed mean +- sample std of the recorded values
    assert f"{np.mean([0.90, 0.98]):.3f} ± {np.std([0.90, 0.98], ddof=1):.3f}" in page
    # every metric the terminal prints is in the metrics table, QWK included, with its value
    metrics_table = page[page.index("<h2>Metrics"):]
    for m in ("auc", "qwk", "accuracy", "balanced_accuracy"):
        assert f"<th>{m}</th>" in metrics_table
    assert f"{np.mean([0.95 - 0.3, 0.91 - 0.3]):.3f} ± {np.std([0.65, 0.61], ddof=1):.3f}" in metrics_table
    # the per-method localisation beside the heatmaps, the shown method highlighted, the slide's own AUC in its caption
    loc = page[page.index("Localisation AUC per method"):page.index("<h2>Metrics")]
    assert re.search(r'<tr class="best"><td class="m">e2e</td><td>0\.975 ± 0\.007', loc)
    assert "localisation AUC 0.932" in text and "lesions outlined" in text
    assert "(chosen on validation)" in text
    # heatmaps of another method asked for: the page still names the model chosen on validation
    out = write_report(tmp_path / "r2.html", pipeline="p", predictions=pred, metrics_path=mpath, n_classes=2,
                       gallery=gallery, protocols=["all"], validation=val, heatmap_run=("bigl", 0))
    text = re.sub(r"<[^>]+>", " ", out.read_text())
    assert "Model chosen on validation:  e2e seed 1" in text and "heatmaps below: bigl seed 0, as requested" in text
    assert "bigl seed 0  (as requested)" in text


def test_rank_methods_orders_by_validation_and_keeps_the_rest():
    val = {("a", 0): ("auc", 0.7), ("b", 0): ("auc", 0.9), ("b", 1): ("auc", 0.5), ("c", 0): ("auc", 0.8)}
    assert rank_methods(["a", "b", "c", "d"], val) == ["c", "a", "b", "d"]  # b's mean 0.7 ties a: a stays first
    loss = {("a", 0): ("loss", 0.4), ("b", 0): ("loss", 0.2)}
    assert rank_methods(["a", "b"], loss) == ["b", "a"]
    assert rank_methods(["x", "y"], {}) == ["x", "y"]
    # a tie on the value goes to the lower validation loss (seed mean), as the chosen model's does
    from wsi_pipeline.types import ValidationScore
    tied = {("a", 0): ValidationScore("auc", 1.0, 0.4), ("b", 0): ValidationScore("auc", 1.0, 0.1),
            ("b", 1): ValidationScore("auc", 1.0, 0.2), ("c", 0): ("auc", 1.0), ("d", 0): ValidationScore("auc", 0.9, 0.01)}
    assert rank_methods(["a", "b", "c", "d"], tied) == ["b", "a", "c", "d"]
    assert best_on_validation(tied)[0] == rank_methods(["a", "b", "c", "d"], tied)[0]


def test_ties_on_validation_value_go_to_the_lower_validation_loss(tmp_path):
    """Three runs reach validation AUC 1.0 (a 10-slide split saturates): the one with the lowest
    validation loss is chosen, whatever the order; a strictly better value still wins over a lower
    loss, a run without a recorded loss ranks after tied runs with one, and for a ``loss`` metric
    lower values win. The loss comes from the ``done`` record training writes."""
    from wsi_pipeline.evaluation.sets import validation_scores
    from wsi_pipeline.training.rundir import write_done
    from wsi_pipeline.types import ValidationScore

    tied = {("a", 0): ValidationScore("auc", 1.0, 0.31), ("b", 0): ValidationScore("auc", 1.0, 0.12),
            ("c", 0): ValidationScore("auc", 1.0, 0.20)}
    assert best_on_validation(tied) == ("b", 0)
    assert best_on_validation(dict(reversed(list(tied.items())))) == ("b", 0)
    assert best_on_validation({**tied, ("d", 0): ValidationScore("auc", 0.96, 0.01)}) == ("b", 0)
    assert best_on_validation({("x", 0): ("auc", 1.0), ("y", 0): ValidationScore("auc", 1.0, 0.5)}) == ("y", 0)
    assert best_on_validation({("x", 0): ("auc", 1.0), ("y", 1): ("auc", 1.0)}) == ("x", 0)
    assert best_on_validation({("l", 0): ValidationScore("loss", 0.3, 0.3), ("l", 1): ValidationScore("loss", 0.2, 0.2)}) == ("l", 1)

    class M:
        def __init__(self, name: str) -> None:
            self.name = name

    runs = []
    for name, loss in (("a", 0.4), ("b", 0.1), ("c", None)):
        d = tmp_path / name
        d.mkdir()
        write_done(d, [{}] * 3, {"metric": "auc", "epoch": 2, "value": 1.0, "loss": loss})
        runs.append((M(name), 0, d))
    scores = validation_scores(runs)
    assert scores[("a", 0)] == ValidationScore("auc", 1.0, 0.4) and scores[("c", 0)].loss is None
    assert best_on_validation(scores) == ("b", 0)


@pytest.mark.slow
def test_evaluation_draws_heatmaps_of_the_run_best_on_validation(tmp_path):
    """Two seeds with recorded validation values: the heatmaps (scores CSV) are the better seed's
    attention, recomputed here with the saved model; its lesions are outlined on the PNG."""
    import torch

    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.evaluation.evaluate import evaluate_pipeline
    from wsi_pipeline.export.thumbnail import thumbnail_shape
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.synthetic.stores import make_store_cohort
    from wsi_pipeline.data.store import open_store, store_path
    from wsi_pipeline.checkpoints.files import save_run_checkpoint
    from wsi_pipeline.inference.trained import load_trained_model
    from wsi_pipeline.checkpoints.run import RunCheckpoint
    from wsi_pipeline.config.pipeline import config_from_dict
    from wsi_pipeline.methods.models import build_models

    manifest = make_store_cohort(tmp_path / "data", n_slides=8, tiles_per_slide=(12, 20), seed=0)
    raw = {"name": "t", "seeds": [0, 1], "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results"),
           "data": {"manifest": str(manifest), "tiles_dir": str(tmp_path / "data" / "tiles"), "n_classes": 2, "tiling": {"tile_size": 32}},
           "eval": {"protocols": ["all"], "seed": 0},
           "methods": [{"name": "m", "strategy": "full", "encoder": {"name": "resnet18"}, "aggregator": {"name": "abmil"}, "chunk_size": 16}]}
    cfg = config_from_dict(raw)
    for seed, best in ((0, 0.6), (1, 0.9)):
        torch.manual_seed(seed)
        enc, agg = build_models(cfg.methods[0], 2, for_training=False)
        d = cfg.run_dir("m", seed)
        save_run_checkpoint(d / "best.pt", RunCheckpoint.build(
            cfg, cfg.methods[0], seed=seed, epoch=1, models={"encoder": enc.state_dict(), "aggregator": agg.state_dict()}))
        (d / "done").write_text(json.dumps({"select_metric": "auc", "best_value": best}))
    summary = evaluate_pipeline(cfg, device="cpu", n_boot=0, progress=False)
    man = read_manifest(manifest).set_index("slide_id")
    model = load_trained_model(cfg.run_dir("m", 1))
    sid = next(s for s in man.index if man.loc[s, "split"] == "test" and man.loc[s, "label"] == 1)
    store = open_store(store_path(cfg.data.tiles_dir, sid))
    with torch.no_grad():
        att = model.aggregator(model.encoder(tiles_to_tensor(store.read()))).attention.numpy()
    scores = pd.read_csv(summary.results_dir / "heatmaps" / f"{sid}_scores.csv")
    np.testing.assert_allclose(scores["attention"], att, rtol=1e-4, atol=1e-6)
    # the lesion tiles' thumbnail footprint has a black border drawn on the PNG
    img = np.asarray(Image.open(summary.results_dir / "heatmaps" / f"{sid}.png").convert("RGB"))
    h, w = thumbnail_shape((int(store.coords[:, 0].max()) + 32, int(store.coords[:, 1].max()) + 32))
    mask = np.asarray(Image.open(man.loc[sid, "lesion_mask"]).convert("L")) > 127
    thumb_mask = mask_to_thumbnail(mask, 32.0, (int(store.coords[:, 0].max()) + 32, int(store.coords[:, 1].max()) + 32), (h, w))
    border = thumb_mask & ~ndimage.binary_erosion(thumb_mask, structure=ndimage.generate_binary_structure(2, 1))
    assert border.any() and (img[border] == OUTLINE_COLOUR).all()
    page = (summary.results_dir / "report.html").read_text()
    assert "Model chosen on validation: <b>m seed 1</b>" in page
    assert not math.isnan(float(re.search(r"localisation AUC (\d\.\d+)", page).group(1)))
