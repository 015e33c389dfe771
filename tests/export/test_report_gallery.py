"""The report's gallery (most confident per predicted class, least confident, misclassified), its colour
bar, the training curves from history.csv and the warnings under the title."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from PIL import Image

from wsi_pipeline.export.curves import curves_html, line_svg
from wsi_pipeline.export.gallery import colour_bar_html, gallery_html
from wsi_pipeline.export.heatmap import colormap
from wsi_pipeline.export.metrics_json import MetricRecord, write_metrics_json
from wsi_pipeline.export.report import write_report


def _gallery(tmp_path, probs_and_labels):
    out = []
    for i, (p1, label) in enumerate(probs_and_labels):
        png = tmp_path / f"s{i}.png"
        Image.fromarray(np.full((20, 30, 3), 100 + i, np.uint8)).save(png)
        out.append({"slide_id": f"s{i}", "cohort": "internal", "label": label, "png": png, "probs": np.array([1 - p1, p1])})
    return out


def _section(page: str, title: str) -> list[str]:
    """Slide ids shown in the section whose heading starts with ``title``."""
    m = re.search(r"<h3>" + re.escape(title) + r"[^<]*</h3>(.*?)(?=<h3>|$)", page, re.S)
    return re.findall(r'alt="([^"]+)"', m.group(1)) if m else []


def test_most_confident_panels_come_from_each_predicted_class_and_misclassified_are_listed(tmp_path):
    # p(class 1), label: 6 confident negatives, 2 positives, one confident mistake, one unsure slide
    cases = [(0.01, 0), (0.02, 0), (0.03, 0), (0.04, 0), (0.05, 0), (0.06, 0), (0.97, 1), (0.80, 1), (0.95, 0), (0.52, 1)]
    page = gallery_html(_gallery(tmp_path, cases), tmp_path, k=2)
    # the old gallery (top-2 by max probability) showed s0 and s1 only: negatives with nothing to see
    assert _section(page, "Most confident, predicted class 0") == ["s0", "s1"]
    assert _section(page, "Most confident, predicted class 1") == ["s6", "s8"]
    want_wrong = [f"s{i}" for i, (p, y) in sorted(enumerate(cases), key=lambda t: -max(t[1][0], 1 - t[1][0]))
                  if int(p > 0.5) != y]
    assert _section(page, "Misclassified") == want_wrong == ["s8"]
    assert _section(page, "Least confident")[0] == "s9"


def test_the_colour_bar_is_the_heatmaps_colour_map_in_page_text(tmp_path):
    bar = colour_bar_html()
    stops = [tuple(int(v) for v in m) for m in re.findall(r"rgb\((\d+),(\d+),(\d+)\)", bar)]
    assert stops[0] == tuple(colormap(np.array(0.0)).tolist()) and stops[-1] == tuple(colormap(np.array(1.0)).tolist())
    assert "low attention" in bar and "high attention" in bar


def test_curves_draw_each_history_column_with_one_line_per_run(tmp_path):
    h0 = pd.DataFrame({"epoch": [1, 2, 3], "train_loss": [0.7, 0.5, 0.4], "val_auc": [0.6, np.nan, 0.8], "lr": [1, 1, 1]})
    h1 = pd.DataFrame({"epoch": [1, 2], "train_loss": [0.69, 0.6]})
    page = curves_html({"a seed 0": h0, "b seed 0": h1})
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2  # train_loss and val_auc; lr is not a curve
    assert svgs[0].count("<polyline") == 2 and svgs[1].count("<polyline") == 1
    # the NaN epoch is skipped: two points on the val_auc line
    pts = re.search(r'<polyline points="([^"]+)"', svgs[1]).group(1).split()
    assert len(pts) == 2
    assert line_svg([], title="x") == ""


def test_report_has_curves_gallery_sections_and_warnings(tmp_path):
    recs = [MetricRecord(method="m", seed=0, cohort="internal", split="test", protocol="all", metric="auc", value=0.8),
            MetricRecord(method="m", seed="mean", cohort="internal", split="test", protocol="all", metric="auc", value=0.8)]
    mpath = write_metrics_json(tmp_path / "metrics.json", recs)
    hist = tmp_path / "history.csv"
    pd.DataFrame({"epoch": [1, 2], "train_loss": [0.7, 0.6], "val_auc": [0.5, 0.7]}).to_csv(hist, index=False)
    pred = pd.DataFrame({"slide_id": ["a", "b"], "cohort": "internal", "label": [0, 1], "pred": [0, 1], "prob_0": [0.8, 0.3],
                         "prob_1": [0.2, 0.7], "protocol": "all", "method": "m", "seed": 0})
    out = write_report(tmp_path / "report.html", pipeline="p", predictions=pred, metrics_path=mpath, n_classes=2,
                       gallery=_gallery(tmp_path, [(0.2, 0), (0.7, 1)]), protocols=["all"],
                       notes=["m: encoder randomly initialised (resnet18 without weights)"], histories={"m seed 0": hist})
    page = out.read_text()
    assert "<h2>Training curves" in page and page.count("<polyline") >= 2
    assert 'class="warn">Warning: m: encoder randomly initialised' in page
    assert "Most confident, predicted class 0" in page and "Misclassified (0)" in page
