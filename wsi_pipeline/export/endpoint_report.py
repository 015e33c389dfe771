"""``report.html`` of a survival or regression pipeline: metric tables, Kaplan-Meier curves, heatmaps.

Sections: the metrics of every method x cohort x protocol (mean +- sd over seeds, the bootstrap
95 % interval of the seed mean under it; patient-level metrics, ``patient_<metric>``, in their own
table when evaluated), then for survival the Kaplan-Meier curves of the low- and high-risk groups
(split at the median training risk, ``risk_group`` in the predictions) of each method's model
chosen on validation, with the log-rank p-value, and the heatmaps of attention.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.export.metrics_json import MetricRecord, read_metrics_json
from wsi_pipeline.export.gallery import png_data_uri
from wsi_pipeline.export.report import COLOURS, REPORT_CSS, best_on_validation
from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["km_svg", "write_endpoint_report"]


def _fmt(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def _table(records: Sequence[MetricRecord], metrics: Sequence[str], protocols: Sequence[str]) -> str:
    look = {(r.method, r.seed, r.cohort, r.split, r.protocol, r.metric): r.value for r in records if r.repeat is None}
    sets = list(dict.fromkeys((r.cohort, r.split) for r in records))
    methods = list(dict.fromkeys(r.method for r in records))
    head = "".join(f"<th>{html.escape(m)}</th>" for m in metrics)
    out = []
    for c, s in sets:
        for prot in protocols:
            rows = []
            for meth in methods:
                cells = []
                for m in metrics:
                    mean = look.get((meth, "mean", c, s, prot, m))
                    if mean is None:
                        cells.append("<td></td>")
                        continue
                    sd = look.get((meth, "std", c, s, prot, m))
                    lo, hi = look.get((meth, "mean", c, s, prot, f"{m}_ci_low")), look.get((meth, "mean", c, s, prot, f"{m}_ci_high"))
                    txt = _fmt(mean) + ("" if sd is None or math.isnan(sd) else f" ± {_fmt(sd)}")
                    if lo is not None and hi is not None and not (math.isnan(lo) or math.isnan(hi)):
                        txt += f'<br><span class="ci">[{_fmt(lo)}, {_fmt(hi)}]</span>'
                    cells.append(f"<td>{txt}</td>")
                rows.append(f'<tr><td class="m">{html.escape(meth)}</td>{"".join(cells)}</tr>')
            out.append(f"<h3>{html.escape(c)} ({html.escape(s)}), protocol <code>{html.escape(prot)}</code></h3>"
                       f"<table><tr><th>method</th>{head}</tr>{''.join(rows)}</table>")
    return "".join(out)


def _kaplan_meier_steps(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from wsi_pipeline.tasks.survival_metrics import kaplan_meier

    t, s = kaplan_meier(time, event)
    return np.r_[0.0, t], np.r_[1.0, s]


def km_svg(curves: Sequence[tuple[str, str, np.ndarray, np.ndarray]], *, t_max: float, size: int = 300, title: str = "") -> str:
    """Inline SVG of Kaplan-Meier step curves ``[(label, colour, times, survival)]`` on 0..``t_max`` x 0..1."""
    pad, W = 36, size
    inner = W - pad - 10
    t_max = t_max or 1.0

    def pt(x: float, y: float) -> str:
        return f"{pad + min(x / t_max, 1.0) * inner:.1f},{10 + (1 - y) * inner:.1f}"

    els = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + 170}" height="{W}" font-size="11" font-family="sans-serif">',
           f'<rect x="{pad}" y="10" width="{inner}" height="{inner}" fill="white" stroke="#888"/>']
    for f in (0, 0.5, 1):
        els.append(f'<text x="{pad + f * inner:.1f}" y="{W - 12}" text-anchor="middle">{f * t_max:.3g}</text>')
        els.append(f'<text x="{pad - 4}" y="{10 + (1 - f) * inner + 4:.1f}" text-anchor="end">{f:g}</text>')
    els.append(f'<text x="{pad + inner / 2:.1f}" y="{W - 1}" text-anchor="middle">time</text>')
    els.append(f'<text x="10" y="{10 + inner / 2:.1f}" transform="rotate(-90 10 {10 + inner / 2:.1f})" text-anchor="middle">event-free</text>')
    for i, (label, colour, t, s) in enumerate(curves):
        pts = [pt(float(t[0]), float(s[0]))]
        for k in range(1, len(t)):
            pts += [pt(float(t[k]), float(s[k - 1])), pt(float(t[k]), float(s[k]))]
        pts.append(pt(t_max, float(s[-1])))
        els.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        els.append(f'<line x1="{W + 4}" y1="{16 + 14 * i}" x2="{W + 22}" y2="{16 + 14 * i}" stroke="{colour}" stroke-width="1.6"/>')
        els.append(f'<text x="{W + 26}" y="{20 + 14 * i}" fill="{colour}">{html.escape(label)}</text>')
    if title:
        els.append(f'<text x="{pad + inner / 2:.1f}" y="9" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>')
    els.append("</svg>")
    return "".join(els)


def _km_section(pred: pd.DataFrame, records: Sequence[MetricRecord], protocol: str,
                validation: Mapping[tuple[str, int], tuple]) -> str:
    if pred.empty or "risk_group" not in pred.columns:
        return ""
    pred = pred[(pred["protocol"] == protocol) & pred["time"].notna() & (pred["risk_group"].astype(str) != "")]
    look = {(r.method, r.seed, r.cohort, r.metric): r.value for r in records if r.repeat is None and r.protocol == protocol}
    out = []
    for meth, g in pred.groupby("method", sort=False):
        seeds = sorted({int(s) for s in g["seed"]})
        best = best_on_validation({k: v for k, v in validation.items() if k[0] == meth})
        seed = best[1] if best else seeds[0]
        g = g[g["seed"].astype(int) == seed]
        for cohort, c in g.groupby("cohort", sort=False):
            curves = []
            for i, grp in enumerate(("low", "high")):
                sel = c[c["risk_group"] == grp]
                if len(sel):
                    t, s = _kaplan_meier_steps(sel["time"].to_numpy(float), sel["event"].to_numpy(int))
                    curves.append((f"{grp} risk (n={len(sel)})", COLOURS[i], t, s))
            p = look.get((meth, seed, cohort, "logrank_p"))
            title = f"{meth} seed {seed}, {cohort}: log-rank p = {_fmt(p)}"
            out.append(km_svg(curves, t_max=float(c["time"].max()), title=title))
    return "<div class=grid>" + "".join(out) + "</div>"


def _gallery(gallery: Sequence[dict], report_dir: Path) -> str:
    if not gallery:
        return '<p class="note">No heatmaps were written (no attention, or heatmaps disabled).</p>'
    cards = []
    for g in gallery[:8]:
        rel = os.path.relpath(g["png"], report_dir)
        cards.append(f'<div class=card><a href="{html.escape(rel)}"><img src="{png_data_uri(Path(g["png"]))}" '
                     f'alt="{html.escape(g["slide_id"])}"></a><b>{html.escape(g["slide_id"])}</b> ({html.escape(g["cohort"])})</div>')
    return "<div class=grid>" + "".join(cards) + "</div>"


def write_endpoint_report(path: str | os.PathLike, *, pipeline: str, task: str, predictions: pd.DataFrame,
                          metrics_path: str | os.PathLike, gallery: Sequence[dict] = (), protocols: Sequence[str] = ("all",),
                          validation: Mapping[tuple[str, int], tuple] | None = None,
                          heatmap_run: tuple[str, int] | None = None) -> Path:
    """Write the report (module docstring) atomically; returns its path."""
    from wsi_pipeline.tasks import get_task
    from wsi_pipeline.tasks.endpoint_metrics import PATIENT_PREFIX

    path = Path(path)
    records = read_metrics_json(metrics_path)
    kind = get_task(task)
    metrics = kind.report_metrics([r.metric for r in records])
    body = [f"<h1>wsi-pipeline evaluation: {html.escape(pipeline)} ({html.escape(task)})</h1>",
            '<p class="note">Mean ± sd over seeds; under it the bootstrap 95 % interval of the seed mean.</p>',
            "<h2>Slides</h2>", _table(records, metrics, protocols)]
    if any(r.metric.startswith(PATIENT_PREFIX) for r in records):
        body += ["<h2>Patients</h2>", _table(records, [PATIENT_PREFIX + m for m in metrics], protocols)]
    if kind.risk_groups:
        body += [f"<h2>Kaplan-Meier curves by predicted risk group (protocol <code>{html.escape(protocols[0])}</code>)</h2>",
                 '<p class="note">High risk: above the median risk of the training slides (the same threshold for every '
                 "cohort); the model of each method best on validation.</p>",
                 _km_section(predictions, records, protocols[0], dict(validation or {}))]
    body += ["<h2>Heatmaps</h2>",
             f'<p class="note">Attention of {html.escape(f"{heatmap_run[0]} seed {heatmap_run[1]}") if heatmap_run else "–"}.</p>',
             _gallery(gallery, path.parent)]
    doc = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(pipeline)}: evaluation</title>"
           f"<style>{REPORT_CSS}</style></head><body>{''.join(body)}</body></html>\n")
    return write_text_atomic(path, doc)
