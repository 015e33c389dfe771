"""The papers' results table: methods x evaluated set x protocol, the primary metric's mean ± std over seeds.

One pipeline of ``pipelines/`` (e.g. ``camelyon.yaml``) holds every row of one of the Big-Layers
paper's tables as a method; :func:`paper_table_html` lays its ``metrics.json`` records out as that
table: one row per method in the pipeline's order (evaluation writes the records method by method
as the config lists them), one column per evaluated set (cohort, split) x protocol, each cell the
primary metric x 100 (as the paper prints it), mean ± sample std (ddof 1) over seeds, read from the
seed ``mean``/``std`` records (:func:`wsi_pipeline.export.metrics_json.aggregate_seeds`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from wsi_pipeline.export.metrics_json import MetricRecord
from wsi_pipeline.inference.metrics import headline_metric

__all__ = ["paper_table_html"]


def _seeds_label(n: int) -> str:
    return f'<span class="ci">({n} seed{"s" * (n != 1)})</span>'


def paper_table_html(records: Sequence[MetricRecord], protocols: Sequence[str], n_classes: int) -> str:
    """An HTML note and ``<table class="paper">`` (module docstring); the row label carries the
    method's number of seeds, and a cell with fewer seeds than its row says how many it has."""
    metric = headline_metric(n_classes)
    head = [r for r in records if r.repeat is None and r.metric == metric]
    # a missing value (None: NaN in metrics.json) reads as NaN
    agg = {(r.method, r.cohort, r.split, r.protocol, r.seed): math.nan if r.value is None else r.value
           for r in head if r.seed in ("mean", "std")}
    seeds: dict[tuple[str, str, str, str], set[int]] = {}
    for r in head:
        if isinstance(r.seed, int) and r.value is not None and not math.isnan(r.value):
            seeds.setdefault((r.method, r.cohort, r.split, r.protocol), set()).add(r.seed)
    methods = list(dict.fromkeys(r.method for r in records))
    sets = list(dict.fromkeys((r.cohort, r.split) for r in records))
    head1 = "".join(f'<th colspan="{len(protocols)}">{html.escape(c)} ({html.escape(s)})</th>' for c, s in sets)
    head2 = "".join(f"<th>{html.escape(p)}</th>" for _ in sets for p in protocols)
    body = []
    for meth in methods:
        n_row = len({r.seed for r in records if r.method == meth and isinstance(r.seed, int)})
        cells = []
        for c, s in sets:
            for prot in protocols:
                mean = agg.get((meth, c, s, prot, "mean"), math.nan)
                std = agg.get((meth, c, s, prot, "std"), math.nan)
                n = len(seeds.get((meth, c, s, prot), ()))
                txt = "–" if math.isnan(mean) else f"{100 * mean:.2f}" + ("" if math.isnan(std) else f" ± {100 * std:.2f}")
                cells.append(f"<td>{txt}{' ' + _seeds_label(n) if n != n_row else ''}</td>")
        body.append(f'<tr><td class="m">{html.escape(meth)} {_seeds_label(n_row)}</td>{"".join(cells)}</tr>')
    return (
        f'<p class="note">{metric.upper()} x 100 (as the papers print it), mean ± sample std (ddof 1) over seeds; '
        "rows in the pipeline's order, columns: evaluated set x protocol. For <code>sub&lt;k&gt;x&lt;R&gt;</code> a seed's "
        "value is the mean of its R per-repeat values (the papers' score). Every metric with its interval: Metrics, below.</p>"
        f'<table class="paper"><tr><th rowspan=2>method</th>{head1}</tr><tr>{head2}</tr>{"".join(body)}</table>'
    )
