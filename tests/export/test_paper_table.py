"""paper_table_html on records read back from metrics.json, where a NaN value is stored as null (None)."""

from __future__ import annotations

import re

from wsi_pipeline.export.metrics_json import MetricRecord
from wsi_pipeline.export.paper_table import paper_table_html


def _cells(html: str) -> list[str]:
    return re.findall(r"<td>(.*?)</td>", html)


def test_null_values_read_as_missing() -> None:
    # seed 1 failed (its AUC is null in metrics.json) and the std over one usable seed is null too
    recs = [MetricRecord("abmil", 0, "c", "test", "all", "auc", 0.8125),
            MetricRecord("abmil", 1, "c", "test", "all", "auc", None),
            MetricRecord("abmil", "mean", "c", "test", "all", "auc", 0.8125),
            MetricRecord("abmil", "std", "c", "test", "all", "auc", None)]
    out = paper_table_html(recs, ["all"], n_classes=2)
    (cell,) = _cells(out)
    assert cell.startswith(f"{100 * 0.8125:.2f}") and "±" not in cell  # the mean, no std
    assert "(1 seed)" in cell  # one seed with a value, of the row's two
    assert "(2 seeds)" in out


def test_null_mean_is_a_dash() -> None:
    recs = [MetricRecord("abmil", 0, "c", "test", "all", "auc", None),
            MetricRecord("abmil", "mean", "c", "test", "all", "auc", None),
            MetricRecord("abmil", "std", "c", "test", "all", "auc", None)]
    (cell,) = _cells(paper_table_html(recs, ["all"], n_classes=2))
    assert cell.startswith("–")
