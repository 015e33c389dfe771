"""The report's heatmap gallery: the most confident slides of each predicted class, the least
confident, and every misclassified slide, with a colour bar drawn in the page itself.

The heatmap PNGs carry their own legend, but the report shows them shrunk to at most 480 px,
where that legend's text is a few pixels high; the page's colour bar is text at the page's size.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from wsi_pipeline.export.heatmap import colormap

__all__ = ["colour_bar_html", "gallery_html", "png_data_uri"]


def png_data_uri(path: Path, max_side: int = 480) -> str:
    """A PNG file as a ``data:`` URI, shrunk to at most ``max_side`` px (the report embeds every image)."""
    img = Image.open(path).convert("RGB")
    img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def colour_bar_html(low: str = "low attention", high: str = "high attention", *, stops: int = 9) -> str:
    """A horizontal colour bar of the heatmaps' colour map (CSS gradient) with its end labels, at page text size."""
    rgb = colormap(np.linspace(0.0, 1.0, stops))
    grad = ", ".join(f"rgb({r},{g},{b}) {100 * i / (stops - 1):.0f}%" for i, (r, g, b) in enumerate(rgb.tolist()))
    return ('<div class="cbar"><span>' + html.escape(low) + f'</span><span class="ramp" style="background:linear-gradient(to right, {grad})">'
            '</span><span>' + html.escape(high) + "</span></div>")


def _card(g: dict, report_dir: Path) -> str:
    p = np.asarray(g["probs"])
    rel = os.path.relpath(g["png"], report_dir)
    loc = g.get("localisation")
    cap = (f"<b>{html.escape(g['slide_id'])}</b> ({html.escape(g['cohort'])}) label {g['label'] if g['label'] is not None else '–'}, "
           f"pred {int(p.argmax())}, p = {p.max():.3f}"
           + ("" if loc is None or (isinstance(loc, float) and math.isnan(loc)) else f", localisation AUC {loc:.3f}")
           + (", lesions outlined" if g.get("outline") else ""))
    return (f'<div class=card><a href="{html.escape(rel)}"><img src="{png_data_uri(Path(g["png"]))}" '
            f'alt="{html.escape(g["slide_id"])}"></a>{cap}</div>')


def _grid(title: str, items: Sequence[dict], report_dir: Path, note: str = "") -> str:
    if not items:
        return ""
    head = f"<h3>{html.escape(title)}</h3>" + (f'<p class="note">{html.escape(note)}</p>' if note else "")
    return head + "<div class=grid>" + "".join(_card(g, report_dir) for g in items) + "</div>"


def _misclassified(g: dict) -> bool:
    return g.get("label") is not None and int(np.asarray(g["probs"]).argmax()) != int(g["label"])


def gallery_html(gallery: Sequence[dict], report_dir: Path, k: int) -> str:
    """The gallery sections for ``gallery`` (per slide ``slide_id, cohort, label, png, probs``; see ``write_report``).

    - "Most confident, predicted class c": for each predicted class, its ``k`` slides with the
      highest probability of that class (a cohort of one class's predictions shows only it);
    - "Least confident": the ``k`` slides whose top probability is lowest;
    - "Misclassified": every slide whose prediction differs from its label (labelled slides only),
      most confidently wrong first.
    """
    if not gallery:
        return '<p class="note">No heatmaps were written (no attention, or heatmaps disabled).</p>'
    items = list(gallery)
    by_class: dict[int, list[dict]] = {}
    for g in items:
        by_class.setdefault(int(np.asarray(g["probs"]).argmax()), []).append(g)
    parts = [colour_bar_html()]
    for c in sorted(by_class):
        top = sorted(by_class[c], key=lambda g: -float(np.asarray(g["probs"])[c]))[:k]
        parts.append(_grid(f"Most confident, predicted class {c}", top, report_dir))
    shown = {g["slide_id"] for c in by_class for g in sorted(by_class[c], key=lambda g: -float(np.asarray(g["probs"])[c]))[:k]}
    least = [g for g in sorted(items, key=lambda g: float(np.max(g["probs"]))) if g["slide_id"] not in shown][:k]
    parts.append(_grid("Least confident", least, report_dir))
    wrong = sorted((g for g in items if _misclassified(g)), key=lambda g: -float(np.max(g["probs"])))
    if any(g.get("label") is not None for g in items):
        parts.append(_grid(f"Misclassified ({len(wrong)})", wrong, report_dir,
                           "every slide whose prediction differs from its label, most confidently wrong first")
                     if wrong else '<h3>Misclassified (0)</h3><p class="note">every labelled slide is predicted as labelled</p>')
    return "".join(parts)
