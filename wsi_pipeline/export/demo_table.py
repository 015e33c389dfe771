"""The demo's results table (``results/demo/summary.md``): the headline metrics of each method for one seed.

:func:`demo_summary` turns the demo's ``metrics.json`` records into the markdown the README's demo block
holds (the workbench's ``tools/readme_table.py`` copies it there and checks the README against it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["HEADLINE", "demo_summary"]

#: The README's headline columns: (heading, evaluation split, protocol, metric).
HEADLINE: tuple[tuple[str, str, str, str], ...] = (
    ("internal AUC", "test", "all", "auc"),
    ("internal localisation", "test", "all", "localisation_auc"),
    ("external AUC", "external", "all", "auc"),
    ("external accuracy", "external", "all", "accuracy"),
)


def _value(records: Sequence[Any], method: str, seed: Any, split: str, protocol: str, metric: str) -> float | None:
    for r in records:
        if (r.method, r.seed, r.split, r.protocol, r.metric) == (method, seed, split, protocol, metric) and r.repeat is None:
            return None if r.value is None or (isinstance(r.value, float) and math.isnan(r.value)) else float(r.value)
    return None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def demo_summary(records: Iterable[Any], methods: Sequence[str], seed: int = 0) -> str:
    """Markdown: the headline table (all tiles) and the subsample table, one seed, 2 decimals.

    ``records`` are :class:`~wsi_pipeline.export.metrics_json.MetricRecord` of the demo's
    ``metrics.json``. Subsample cells of the paper's protocol read ``mean (sd r)``: the mean of
    the per-repeat AUCs and their standard deviation over repeats; the ensemble protocol's cell is
    the AUC of per-slide probabilities averaged over the same repeats.
    """
    recs = list(records)
    lines = [f"| method | {' | '.join(h for h, *_ in HEADLINE)} |", "|---" * (len(HEADLINE) + 1) + "|"]
    for m in methods:
        cells = [_fmt(_value(recs, m, seed, split, prot, metric)) for _, split, prot, metric in HEADLINE]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    subs = sorted({r.protocol for r in recs if r.protocol.startswith(("sub", "ens"))}, key=lambda p: (p[3:], p[:3] != "sub"))
    if subs:
        heads = [f"{where} AUC {p}" for p in subs for where in ("internal", "external")]
        lines += ["", f"| method | {' | '.join(heads)} |", "|---" * (len(heads) + 1) + "|"]
        for m in methods:
            cells = []
            for p in subs:
                for split in ("test", "external"):
                    v = _value(recs, m, seed, split, p, "auc")
                    sd = _value(recs, m, seed, split, p, "auc_repeat_std")
                    cells.append(_fmt(v) + (f" (sd {sd:.2f})" if v is not None and sd is not None else ""))
            lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
