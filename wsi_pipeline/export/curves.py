"""Training curves for the report: train loss and each validation column of ``history.csv`` per epoch.

One small inline SVG per quantity (``train_loss``, ``val_loss``, ``val_auc``, ...), one line per
run (method and seed), so a user sees whether a model converged, overfitted or diverged without
opening the run folders.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence

import pandas as pd

__all__ = ["CURVE_COLUMNS", "curves_html", "line_svg", "read_histories"]

#: Columns drawn, in this order, when present: the loss, then the validation metrics.
CURVE_COLUMNS: tuple[str, ...] = ("train_loss", "val_loss", "val_auc", "val_qwk", "val_accuracy", "val_c_index", "val_rmse")

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def read_histories(runs: Mapping[str, str | os.PathLike]) -> dict[str, pd.DataFrame]:
    """``{run label: history}`` from ``{run label: path of history.csv}``; runs without a readable file are left out."""
    out = {}
    for label, path in runs.items():
        try:
            df = pd.read_csv(path)
        except (OSError, ValueError, pd.errors.ParserError):
            continue
        if "epoch" in df.columns and len(df):
            out[label] = df
    return out


def line_svg(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *, title: str, width: int = 330,
             height: int = 200) -> str:
    """Inline SVG of lines ``[(label, x, y)]`` with axes from the data's range (NaN points skipped)."""
    xs = [float(x) for _, xv, yv in series for x, y in zip(xv, yv) if not math.isnan(float(y))]
    ys = [float(y) for _, _, yv in series for y in yv if not math.isnan(float(y))]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, top, right, bottom = 44, 18, 10, 30
    iw, ih = width - left - right, height - top - bottom

    def pt(x: float, y: float) -> str:
        return f"{left + (x - x0) / (x1 - x0) * iw:.1f},{top + (1 - (y - y0) / (y1 - y0)) * ih:.1f}"

    els = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 14 * len(series)}" font-size="11" '
           'font-family="sans-serif">',
           f'<rect x="{left}" y="{top}" width="{iw}" height="{ih}" fill="white" stroke="#888"/>',
           f'<text x="{left + iw / 2:.0f}" y="12" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
           f'<text x="{left + iw / 2:.0f}" y="{height - 4}" text-anchor="middle">epoch</text>']
    for v in (y0, y1):
        els.append(f'<text x="{left - 4}" y="{top + (1 - (v - y0) / (y1 - y0)) * ih + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for v in (x0, x1):
        els.append(f'<text x="{left + (v - x0) / (x1 - x0) * iw:.1f}" y="{top + ih + 13}" text-anchor="middle">{v:g}</text>')
    for i, (label, xv, yv) in enumerate(series):
        colour = _PALETTE[i % len(_PALETTE)]
        pts = " ".join(pt(float(x), float(y)) for x, y in zip(xv, yv) if not math.isnan(float(y)))
        els.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        ly = height + 14 * i + 6
        els.append(f'<line x1="{left}" y1="{ly}" x2="{left + 16}" y2="{ly}" stroke="{colour}" stroke-width="2"/>')
        els.append(f'<text x="{left + 20}" y="{ly + 4}">{html.escape(label)}</text>')
    els.append("</svg>")
    return "".join(els)


def curves_html(histories: Mapping[str, pd.DataFrame]) -> str:
    """One SVG per :data:`CURVE_COLUMNS` column any history has, each with a line per run; "" without histories."""
    plots = []
    for col in CURVE_COLUMNS:
        series = [(label, df["epoch"].tolist(), pd.to_numeric(df[col], errors="coerce").tolist())
                  for label, df in histories.items() if col in df.columns]
        svg = line_svg(series, title=col) if series else ""
        if svg:
            plots.append(svg)
    return '<div class=grid>' + "".join(plots) + "</div>" if plots else ""
