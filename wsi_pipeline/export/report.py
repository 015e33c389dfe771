"""``report.html``: one self-contained page (no external files; images inline) summarising an evaluation.

The page leads with the best: methods are listed best on validation first everywhere (mean over
seeds of each run's best validation value, as recorded by training; never the test slides).

Sections: a summary (the model chosen on validation, and per method its validation value, the
headline test metric and the localisation AUC per cohort); the heatmaps of the model chosen on
validation (PNG, base64-embedded, shrunk to at most 480 px, each linking to the full-size file
beside the report; ground-truth lesions outlined in black when known, the slide's localisation
AUC in its caption), the most and least confident slides, beside the per-method localisation
table; tables like the papers' (method x cohort x protocol, every metric the terminal prints:
AUC, QWK, accuracy, balanced accuracy; mean +- std over seeds, with the bootstrap 95 % interval
of the seed mean; for ``sub<k>x<R>`` the per-seed value is the mean over repeats of the
per-repeat metric, and the std over repeats is shown beside it); ROC curves (inline SVG;
binary tasks: one curve per model; multi-class: one-vs-rest per class of each method's
seed-mean probabilities); confusion matrices (inline SVG, counts summed over seeds).

After the summary come the results in the papers' layout (:mod:`wsi_pipeline.export.paper_table`),
the one table whose methods keep the pipeline's order instead.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from wsi_pipeline.inference.metrics import BOOTSTRAP_MAX_REPEATS, headline_metric, metric_order
from wsi_pipeline.export.metrics_json import MetricRecord, read_metrics_json
from wsi_pipeline.export.curves import curves_html, read_histories
from wsi_pipeline.export.gallery import gallery_html
from wsi_pipeline.export.paper_table import paper_table_html
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.types import ValidationScore

__all__ = ["write_report", "best_on_validation", "rank_methods", "roc_svg", "confusion_svg"]

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]
REPORT_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:center}th{background:#f3f3f3}
td.m{text-align:left;font-weight:600}.ci{color:#777;font-size:11px}.note{color:#555;font-size:13px}
.grid{display:flex;flex-wrap:wrap;gap:12px}.card{border:1px solid #ddd;padding:6px;font-size:12px;max-width:490px}
.card img{max-width:480px;display:block}
tr.best td{background:#fff8d6}.side{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
.side>.loc{flex:0 0 auto;max-width:400px}.side>.gal{flex:1 1 500px}.gal .card{max-width:410px}.gal .card img{max-width:400px}
.cbar{display:flex;align-items:center;gap:8px;font-size:13px;margin:6px 0}.cbar .ramp{display:inline-block;width:240px;height:14px;border:1px solid #888}
.warn{color:#8a4b00;background:#fff4e0;border-left:4px solid #e69500;padding:6px 10px;font-size:13px}
"""


def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _lookup(records: Sequence[MetricRecord]) -> dict[tuple, float | None]:
    """Headline values (per-repeat records left out) keyed by (method, seed, cohort, split, protocol, metric)."""
    return {(r.method, str(r.seed), r.cohort, r.split, r.protocol, r.metric): r.value for r in records if r.repeat is None}


def _score(score: tuple) -> ValidationScore:
    """A recorded validation result as a :class:`~wsi_pipeline.types.ValidationScore`, from either that
    or a ``(metric, value)`` pair (no loss)."""
    return ValidationScore(*score)


def _order_key(metric: str, value: float, loss: float | None) -> tuple[float, float]:
    """Sort key, best first: the better validation ``value`` (lowest for a ``loss`` metric), ties by the
    lower validation ``loss`` (an unknown loss after every known one)."""
    return (float(value) if metric == "loss" else -float(value),
            float(loss) if loss is not None and math.isfinite(loss) else math.inf)


def _validation_by_method(validation: Mapping[tuple[str, int], tuple]) -> dict[str, tuple[str, float, float, int]]:
    """``{method: (metric, mean, sample std (nan for one seed), n seeds)}`` of the runs' best validation values."""
    by: dict[str, list[tuple[str, float]]] = {}
    for (meth, _), score in validation.items():
        metric, value, _loss = _score(score)
        by.setdefault(meth, []).append((metric, float(value)))
    out = {}
    for meth, vals in by.items():
        v = np.asarray([x for _, x in vals], np.float64)
        out[meth] = (vals[0][0], float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else math.nan, len(v))
    return out


def best_on_validation(scores: Mapping[tuple[str, int], tuple]) -> tuple[str, int] | None:
    """The (method, seed) with the best validation value (lowest for a ``loss`` metric).

    ``scores`` maps (method, seed) to ``(metric, value)`` or :class:`~wsi_pipeline.types.ValidationScore`
    ``(metric, value, loss)``. Ties on value, common when AUC saturates at 1.0 on a small validation
    split, go to the lower validation loss (a run without one ranks after those with one); then the first.
    """
    if not scores:
        return None
    return min(scores, key=lambda k: _order_key(*_score(scores[k])))  # min: the first of full ties


def rank_methods(methods: Sequence[str], validation: Mapping[tuple[str, int], tuple]) -> list[str]:
    """``methods`` best on validation first (seed-mean best validation value; lowest first for ``loss``),
    ties by the seed-mean validation loss of those epochs, as :func:`best_on_validation` breaks them
    (methods without one after those with one); methods without a validation value keep their
    order, after the others."""
    val = _validation_by_method(validation)
    losses: dict[str, list[float]] = {}
    for (meth, _), score in validation.items():
        loss = _score(score).loss
        losses.setdefault(meth, []).append(loss if loss is not None and math.isfinite(loss) else math.inf)
    scored = [m for m in methods if m in val and math.isfinite(val[m][1])]
    scored.sort(key=lambda m: _order_key(val[m][0], val[m][1], float(np.mean(losses[m]))))  # stable: full ties keep their order
    return scored + [m for m in methods if m not in scored]


def _metric_tables(records: Sequence[MetricRecord], protocols: Sequence[str], n_classes: int,
                   methods: Sequence[str] | None = None) -> str:
    look = _lookup(records)
    methods = list(methods) if methods is not None else list(dict.fromkeys(r.method for r in records))
    sets = list(dict.fromkeys((r.cohort, r.split) for r in records))
    present = {r.metric for r in records}
    # every metric the terminal prints (AUC, QWK, accuracy) and balanced accuracy; AUC first for
    # binary tasks (CAMELYON), QWK first for graded ones (PANDA); every metric stays in metrics.json
    shown = metric_order(n_classes)
    metrics = [m for m in shown if m in present]
    n_seeds = {m: len({r.seed for r in records if r.method == m and isinstance(r.seed, int)}) for m in methods}
    parts = []
    for prot in protocols:
        head1 = "".join(f'<th colspan="{len(metrics)}">{html.escape(c)} ({html.escape(s)})</th>' for c, s in sets)
        head2 = "".join(f"<th>{m}</th>" for _ in sets for m in metrics)
        body = []
        for meth in methods:
            cells = []
            for c, s in sets:
                for m in metrics:
                    mean = look.get((meth, "mean", c, s, prot, m))
                    std = look.get((meth, "std", c, s, prot, m))
                    lo = look.get((meth, "mean", c, s, prot, f"{m}_ci_low"))
                    hi = look.get((meth, "mean", c, s, prot, f"{m}_ci_high"))
                    rep = look.get((meth, "mean", c, s, prot, f"{m}_repeat_std"))
                    txt = _fmt(mean) + ("" if std is None or math.isnan(std) else f" ± {_fmt(std)}")
                    ci = "" if lo is None or math.isnan(lo) else f'<br><span class="ci">[{_fmt(lo)}, {_fmt(hi)}]</span>'
                    sd = "" if rep is None or math.isnan(rep) else f'<br><span class="ci">repeats sd {_fmt(rep)}</span>'
                    cells.append(f"<td>{txt}{ci}{sd}</td>")
            body.append(f'<tr><td class="m">{html.escape(meth)} <span class="ci">({n_seeds[meth]} seed{"s" * (n_seeds[meth] != 1)})</span></td>{"".join(cells)}</tr>')
        parts.append(
            f"<h3>Protocol <code>{html.escape(prot)}</code></h3><table><tr><th rowspan=2>method</th>{head1}</tr>"
            f"<tr>{head2}</tr>{''.join(body)}</table>"
        )
    return "\n".join(parts)


def _mean_std(look: dict[tuple, float | None], meth: str, c: str, s: str, prot: str, metric: str) -> str:
    mean = look.get((meth, "mean", c, s, prot, metric))
    std = look.get((meth, "std", c, s, prot, metric))
    return _fmt(mean) + ("" if std is None or math.isnan(std) else f" ± {_fmt(std)}")


def _localisation_table(records: Sequence[MetricRecord], methods: Sequence[str], highlight: str | None) -> str:
    """Per-method localisation AUC per evaluated set (mean ± std over seeds), or '' when none was measured."""
    if not any(r.metric == "localisation_auc" for r in records):
        return ""
    look = _lookup(records)
    sets = list(dict.fromkeys((r.cohort, r.split) for r in records))
    rows = []
    for meth in methods:
        cells = "".join(f"<td>{_mean_std(look, meth, c, s, 'all', 'localisation_auc')}</td>" for c, s in sets)
        cls = ' class="best"' if meth == highlight else ""
        rows.append(f'<tr{cls}><td class="m">{html.escape(meth)}</td>{cells}</tr>')
    head = "".join(f"<th>{html.escape(c)} ({html.escape(s)})</th>" for c, s in sets)
    return (
        "<div class=loc><h3>Localisation AUC per method</h3><p class=note>Tile attention vs. ground-truth lesion: per-slide ROC AUC, "
        "mean over slides with both kinds of tile; mean ± std over seeds. Best on validation first"
        f"{'; highlighted: the method whose heatmaps are shown' if highlight else ''}.</p>"
        f"<table><tr><th>method</th>{head}</tr>{''.join(rows)}</table></div>"
    )


def _summary(records: Sequence[MetricRecord], methods: Sequence[str], prot: str, n_classes: int,
             validation: Mapping[tuple[str, int], tuple], chosen: tuple[str, int] | None,
             shown: tuple[str, int] | None) -> str:
    """The page's lead: the model chosen on validation (``chosen``), whose heatmaps are ``shown``,
    and one row per method, best on validation first."""
    look = _lookup(records)
    sets = list(dict.fromkeys((r.cohort, r.split) for r in records))
    headline = headline_metric(n_classes)
    val = _validation_by_method(validation)
    has_loc = any(r.metric == "localisation_auc" for r in records)
    parts = []
    if chosen is not None:
        metric, value, loss = _score(validation[chosen])
        ties = sum(1 for k, v in validation.items() if k != chosen and _score(v).value == value)
        tie_note = (f"; {ties} other run(s) tie on it, this one has the lowest validation loss ({_fmt(loss)})"
                    if ties and loss is not None else f"; {ties} other run(s) tie on it, the first is shown" if ties else "")
        parts.append(f"<p>Model chosen on validation: <b>{html.escape(chosen[0])} seed {chosen[1]}</b> "
                     f"(validation {html.escape(metric)} {_fmt(value)}, the best of {len(validation)} run(s){tie_note}); "
                     + ("its attention heatmaps are shown below.</p>" if shown == chosen else
                        f"heatmaps below: {html.escape(shown[0])} seed {shown[1]}, as requested.</p>" if shown else "no heatmaps drawn.</p>"))
    elif shown is not None:
        parts.append(f"<p>No run recorded a validation value; heatmaps of <b>{html.escape(shown[0])} seed {shown[1]}</b>.</p>")
    metric_name = next(iter(val.values()))[0] if val else "metric"
    head = (f"<th rowspan=2>method</th><th rowspan=2>validation {html.escape(metric_name)}</th>"
            + "".join(f'<th colspan="{1 + has_loc}">{html.escape(c)} ({html.escape(s)})</th>' for c, s in sets))
    head2 = "".join(f"<th>{headline.upper()} ({html.escape(prot)})</th>" + ("<th>localisation</th>" if has_loc else "") for _ in sets)
    rows = []
    for meth in methods:
        v = val.get(meth)
        vtxt = "–" if v is None else _fmt(v[1]) + ("" if math.isnan(v[2]) else f" ± {_fmt(v[2])}") + f' <span class="ci">({v[3]} seed{"s" * (v[3] != 1)})</span>'
        cells = "".join(f"<td>{_mean_std(look, meth, c, s, prot, headline)}</td>"
                        + (f"<td>{_mean_std(look, meth, c, s, 'all', 'localisation_auc')}</td>" if has_loc else "") for c, s in sets)
        cls = ' class="best"' if chosen is not None and meth == chosen[0] else ""
        rows.append(f'<tr{cls}><td class="m">{html.escape(meth)}</td><td>{vtxt}</td>{cells}</tr>')
    parts.append(f"<table><tr>{head}</tr><tr>{head2}</tr>{''.join(rows)}</table>")
    parts.append('<p class="note">Methods ordered best on validation first (mean over seeds of each run\'s best validation '
                 "value, the epoch its <code>best.pt</code> was saved at; ties by that epoch's validation loss); "
                 "test values: mean ± std over seeds.</p>")
    return "".join(parts)


def roc_svg(curves: Sequence[tuple[str, str, np.ndarray, np.ndarray]], *, size: int = 300, title: str = "") -> str:
    """Inline SVG of ROC curves: ``curves`` = ``[(label, colour, fpr, tpr)]``, axes 0..1 with a chance diagonal."""
    pad, W = 36, size
    inner = W - pad - 10

    def pt(x: float, y: float) -> str:
        return f"{pad + x * inner:.1f},{10 + (1 - y) * inner:.1f}"

    els = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + 150}" height="{W}" font-size="11" font-family="sans-serif">',
        f'<rect x="{pad}" y="10" width="{inner}" height="{inner}" fill="white" stroke="#888"/>',
        f'<polyline points="{pt(0, 0)} {pt(1, 1)}" fill="none" stroke="#bbb" stroke-dasharray="4 3"/>',
    ]
    for t in (0, 0.5, 1):
        els.append(f'<text x="{pad + t * inner:.1f}" y="{W - 12}" text-anchor="middle">{t:g}</text>')
        els.append(f'<text x="{pad - 4}" y="{10 + (1 - t) * inner + 4:.1f}" text-anchor="end">{t:g}</text>')
    els.append(f'<text x="{pad + inner / 2:.1f}" y="{W - 1}" text-anchor="middle">false positive rate</text>')
    els.append(f'<text x="10" y="{10 + inner / 2:.1f}" transform="rotate(-90 10 {10 + inner / 2:.1f})" text-anchor="middle">true positive rate</text>')
    dashes = ["", "6 3", "2 2", "8 3 2 3"]
    seen: dict[str, int] = {}
    for i, (label, colour, fpr, tpr) in enumerate(curves):
        k = seen[colour] = seen.get(colour, -1) + 1  # curves sharing a colour (seeds of a method) differ in dash
        dash = f' stroke-dasharray="{dashes[k % len(dashes)]}"' if dashes[k % len(dashes)] else ""
        pts = " ".join(pt(float(x), float(y)) for x, y in zip(fpr, tpr))
        els.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
        els.append(f'<line x1="{W + 4}" y1="{16 + 14 * i}" x2="{W + 22}" y2="{16 + 14 * i}" stroke="{colour}" stroke-width="1.6"{dash}/>')
        els.append(f'<text x="{W + 26}" y="{20 + 14 * i}" fill="{colour}">{html.escape(label)}</text>')
    if title:
        els.append(f'<text x="{pad + inner / 2:.1f}" y="9" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>')
    els.append("</svg>")
    return "".join(els)


def confusion_svg(cm: np.ndarray, *, title: str = "", cell: int = 34) -> str:
    """Inline SVG of a confusion matrix (rows: true class, columns: predicted), shaded by row fraction."""
    cm = np.asarray(cm)
    C = cm.shape[0]
    off = 40
    W = max(off + C * cell + 10, int(len(title) * 6.5) + off)
    H = off + C * cell + 24
    row_sum = np.maximum(cm.sum(1, keepdims=True), 1)
    frac = cm / row_sum
    els = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="11" font-family="sans-serif">']
    if title:
        els.append(f'<text x="{off}" y="11" font-weight="bold">{html.escape(title)}</text>')
    els.append(f'<text x="{off + C * cell / 2:.0f}" y="{H - 2}" text-anchor="middle">predicted</text>')
    els.append(f'<text x="9" y="{off + C * cell / 2:.0f}" transform="rotate(-90 9 {off + C * cell / 2:.0f})" text-anchor="middle">true</text>')
    for i in range(C):
        els.append(f'<text x="{off + i * cell + cell / 2:.0f}" y="{off - 4}" text-anchor="middle">{i}</text>')
        els.append(f'<text x="{off - 4}" y="{off + i * cell + cell / 2 + 4:.0f}" text-anchor="end">{i}</text>')
        for j in range(C):
            g = int(round(255 - 180 * frac[i, j]))
            colour = f"rgb({g},{g},255)"
            text = "white" if frac[i, j] > 0.6 else "black"
            x, y = off + j * cell, off + i * cell
            els.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="{colour}" stroke="#999"/>')
            els.append(f'<text x="{x + cell / 2:.0f}" y="{y + cell / 2 + 4:.0f}" text-anchor="middle" fill="{text}">{int(cm[i, j])}</text>')
    els.append("</svg>")
    return "".join(els)


def _ordered(present: Sequence[str], order: Sequence[str] | None) -> list[str]:
    """``present`` methods in ``order`` (best on validation first), any others after them."""
    order = [m for m in (order or []) if m in set(present)]
    return order + [m for m in present if m not in order]


def _roc_section(pred: pd.DataFrame, n_classes: int, protocol: str, order: Sequence[str] | None = None) -> str:
    from sklearn.metrics import roc_curve

    df = pred[(pred["protocol"] == protocol) & pred["label"].notna()]
    if df.empty:
        return '<p class="note">No labelled slides: no ROC curves.</p>'
    out = []
    methods = _ordered(list(dict.fromkeys(df["method"])), order)
    for cohort in dict.fromkeys(df["cohort"]):
        d = df[df["cohort"] == cohort]
        curves = []
        if n_classes == 2:
            for mi, meth in enumerate(methods):
                for seed, g in d[d["method"] == meth].groupby("seed", sort=True):
                    y = g["label"].astype(int).to_numpy()
                    if len(set(y)) < 2:
                        continue
                    fpr, tpr, _ = roc_curve(y, g["prob_1"].to_numpy())
                    curves.append((f"{meth} s{seed}", COLOURS[mi % len(COLOURS)], fpr, tpr))
            title = f"{cohort} ({protocol})"
            if curves:
                out.append(roc_svg(curves, title=title))
        else:
            for meth in methods:
                g = d[d["method"] == meth]
                mean = g.groupby("slide_id", sort=False)[[f"prob_{c}" for c in range(n_classes)] + ["label"]].mean()
                y = mean["label"].astype(int).to_numpy()
                curves = []
                for c in range(n_classes):
                    if 0 < (y == c).sum() < len(y):
                        fpr, tpr, _ = roc_curve(y == c, mean[f"prob_{c}"].to_numpy())
                        curves.append((f"class {c} vs rest", COLOURS[c % len(COLOURS)], fpr, tpr))
                if curves:
                    out.append(roc_svg(curves, title=f"{meth}, {cohort} ({protocol}, seed mean)"))
    return "<div class=grid>" + "".join(f"<div>{s}</div>" for s in out) + "</div>" if out else '<p class="note">ROC undefined (one class per cohort).</p>'


def _confusion_section(pred: pd.DataFrame, n_classes: int, protocol: str, order: Sequence[str] | None = None) -> str:
    from wsi_pipeline.inference.metrics import confusion

    df = pred[(pred["protocol"] == protocol) & pred["label"].notna()]
    out = []
    for cohort in dict.fromkeys(df["cohort"]):
        for meth in _ordered(list(dict.fromkeys(df["method"])), order):
            g = df[(df["cohort"] == cohort) & (df["method"] == meth)]
            if g.empty:
                continue
            P = g[[f"prob_{c}" for c in range(n_classes)]].to_numpy()
            cm = confusion(g["label"].astype(int).to_numpy(), P, n_classes)
            out.append(confusion_svg(cm, title=f"{meth}, {cohort}"))
    return "<div class=grid>" + "".join(f"<div>{s}</div>" for s in out) + "</div>" if out else ""


def _intro_note(models: Sequence[tuple[str, int]]) -> str:
    """The page's opening note: when and by what version it was made, the models, how to read the tables."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from wsi_pipeline import __version__

    return (
        f'<p class="note">Generated {now} by wsi-pipeline {html.escape(str(__version__))}. '
        f"{len(models)} model(s): {html.escape(', '.join(f'{m} seed {s}' for m, s in models))}. "
        "Each model is its run's <code>best.pt</code> (chosen on validation). Protocol <code>sub&lt;k&gt;x&lt;R&gt;</code> "
        "(the papers'): each repeat of k random tiles per slide is scored over all slides, and a model's value is the mean "
        "of its R per-repeat values (every repeat's value is in <code>metrics.json</code>); <code>ens&lt;k&gt;x&lt;R&gt;</code>: "
        "the metric of each slide's probabilities averaged over the R repeats (an ensemble, not the papers' number). "
        "Cells: mean ± sample std over seeds; grey: bootstrap 95 % interval of the seed mean (slides resampled; "
        f"per-repeat protocols average at most {BOOTSTRAP_MAX_REPEATS} repeats per resample, the interval then moved onto "
        "the all-repeats score) and, for per-repeat protocols, the std over "
        "repeats (mean over seeds). ROC curves and confusion matrices of a subsample protocol use the probabilities "
        "averaged over repeats.</p>"
    )


def _heatmap_note(heatmap_model: str, chosen_on_validation: bool, has_validation: bool) -> str:
    """The note above the heatmap gallery: whose attention it shows and why that model."""
    how = ("chosen on validation" if chosen_on_validation else
           "as requested" if has_validation else "no run recorded a validation value")
    return (f'<p class="note">Attention of <b>{html.escape(heatmap_model)}</b> ({how}) over each slide (all tiles), '
            "colour = per-slide rank unless stated in the image; ground-truth lesions, when known, are outlined "
            "in black. Click an image for the full-size PNG; <code>heatmaps/&lt;slide&gt;.geojson</code> opens in QuPath.</p>")


def _curve_sections(pred: pd.DataFrame, n_classes: int, protocol: str, methods: Sequence[str]) -> list[str]:
    """ROC and confusion-matrix sections (headings included) of ``protocol``."""
    return [f"<h2>ROC curves (protocol <code>{html.escape(protocol)}</code>)</h2>", _roc_section(pred, n_classes, protocol, methods),
            f"<h2>Confusion matrices (protocol <code>{html.escape(protocol)}</code>, counts over seeds)</h2>",
            _confusion_section(pred, n_classes, protocol, methods)]


def _stain_section(stain: pd.DataFrame) -> str:
    """How many slides each model normalised, and the slides that fell back with the reason (column ``stain_problem``)."""
    per_slide = stain.drop_duplicates("slide_id")
    n_ok = int((per_slide["stain_normalised"] == True).sum())  # noqa: E712 (a pandas column)
    note = (f"<p>{n_ok} of {len(per_slide)} evaluated slides were stain-normalised with the normaliser stored in "
            "each model's checkpoint (fitted at training time, <code>data.stain</code>).")
    fell = per_slide[per_slide["stain_normalised"] != True]  # noqa: E712
    if not len(fell):
        return note + "</p>"
    rows = "".join(f"<tr><td>{html.escape(str(r.slide_id))}</td><td>{html.escape(str(r.cohort))}</td>"
                   f"<td>{html.escape(str(r.stain_problem))}</td></tr>" for r in fell.itertuples())
    return (note + f" {len(fell)} fell back to no normalisation (their stain could not be estimated):</p>"
            f"<table><tr><th>slide</th><th>cohort</th><th>stain_problem</th></tr>{rows}</table>")


def write_report(
    path: str | os.PathLike,
    *,
    pipeline: str,
    predictions: pd.DataFrame,
    metrics_path: str | os.PathLike,
    n_classes: int,
    gallery: Sequence[dict] = (),
    heatmap_model: str | None = None,
    protocols: Sequence[str] | None = None,
    gallery_size: int = 4,
    validation: Mapping[tuple[str, int], tuple] | None = None,
    heatmap_run: tuple[str, int] | None = None,
    heatmap_chosen_on_validation: bool = False,
    stain: pd.DataFrame | None = None,
    notes: Sequence[str] = (),
    histories: Mapping[str, str | os.PathLike] | None = None,
) -> Path:
    """Write ``report.html`` atomically.

    Parameters
    ----------
    predictions : all prediction rows (the columns of the predictions CSVs).
    metrics_path : the ``metrics.json`` to tabulate.
    gallery : per slide ``{"slide_id", "cohort", "label", "png" (path), "probs" (C,)}``, optionally
        ``"localisation"`` (the slide's localisation AUC) and ``"outline"`` (truth drawn on it).
    heatmap_model : which model made the heatmaps (stated in the page; default from ``heatmap_run``).
    protocols : protocol names in display order (default: those in the records).
    validation : ``{(method, seed): (select metric, best validation value)}``; orders the methods
        best first and names the model chosen on validation.
    heatmap_run : (method, seed) of the heatmaps.
    heatmap_chosen_on_validation : whether ``heatmap_run`` was chosen on validation (stated in the page).
    stain : per method and slide ``method, slide_id, cohort, stain_normalised, stain_problem`` (the
        results' ``stain.csv``): a section with the count normalised and every slide that fell back.
    notes : warnings shown under the title (e.g. "encoder randomly initialised"), one per line.
    histories : ``{"method seed k": path of the run's history.csv}``: training curves (loss and
        validation metrics per epoch).
    """
    path = Path(path)
    records = read_metrics_json(metrics_path)
    prots = list(protocols) if protocols else list(dict.fromkeys(r.protocol for r in records))
    pred = predictions.copy()
    if len(pred):
        pred["label"] = pred["label"].astype("Int64")
    models = sorted({(r.method, r.seed) for r in records if isinstance(r.seed, int)}, key=str)
    validation = dict(validation or {})
    methods = rank_methods(list(dict.fromkeys(r.method for r in records)), validation)
    if heatmap_model is None and heatmap_run is not None:
        heatmap_model = f"{heatmap_run[0]} seed {heatmap_run[1]}"
    best = best_on_validation(validation)
    body = [
        f"<h1>wsi-pipeline evaluation: {html.escape(pipeline)}</h1>",
        _intro_note(models),
        *(f'<p class="warn">Warning: {html.escape(n)}</p>' for n in notes),
        "<h2>Summary</h2>",
        _summary(records, methods, prots[0] if prots else "all", n_classes, validation, best, heatmap_run),
        "<h2>Results in the papers' layout</h2>",
        paper_table_html(records, prots, n_classes),
    ]
    loc_table = _localisation_table(records, methods, heatmap_run[0] if heatmap_run else None)
    body.append("<h2>Heatmaps and localisation</h2>")
    if heatmap_model:
        body.append(_heatmap_note(heatmap_model, heatmap_chosen_on_validation, bool(validation)))
    body.append(f'<div class=side>{loc_table}<div class=gal>{gallery_html(gallery, path.parent, gallery_size)}</div></div>')
    body += ["<h2>Metrics</h2>", _metric_tables(records, prots, n_classes, methods)]
    curves = curves_html(read_histories(histories or {}))
    if curves:
        body += ["<h2>Training curves</h2>", '<p class="note">Per epoch, from each run\'s <code>history.csv</code>: the '
                 "training loss and the validation values best.pt was chosen on.</p>", curves]
    if stain is not None and len(stain):
        body += ["<h2>Stain normalisation</h2>", _stain_section(stain)]
    if len(pred):
        body += _curve_sections(pred, n_classes, prots[0], methods)
    doc = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(pipeline)}: evaluation</title>"
           f"<style>{REPORT_CSS}</style></head><body>{''.join(body)}</body></html>\n")
    return write_text_atomic(path, doc)
