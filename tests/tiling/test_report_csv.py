"""The tiling report's csv-module reader and writer match pandas' (the table every other stage writes)."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.jobs.slide_jobs import write_report_csv
from wsi_pipeline.tiling.report import REPORT_COLUMNS, _read_report, _write_rows

ROWS = [
    {"slide_id": "a,b", "status": "ok", "n_tiles": 3, "mpp": None, "seconds": 0.1, "error": 'say "x"\nnext line',
     "note": "", "path": "/p", "cpu_seconds": 1e-05, "background_grey": float("nan"), "extra": True, "store_bytes": 7},
    {"slide_id": "c", "status": "failed", "n_tiles": 0, "mpp": 0.25, "seconds": 12.0, "error": "", "note": "n",
     "path": "/q", "cpu_seconds": 2.5, "background_grey": 243.0, "store_bytes": 123456789},
]


def test_written_as_pandas_writes_it_and_read_as_pandas_reads_it(tmp_path: Path) -> None:
    """Rows of one run have every column (SlideResult), so a column is never ints with gaps (pandas: floats)."""
    cols = list(REPORT_COLUMNS) + ["extra"]
    write_report_csv(tmp_path / "pd.csv", ROWS, cols)
    _write_rows(tmp_path / "csv.csv", ROWS, cols)
    assert (tmp_path / "csv.csv").read_bytes() == (tmp_path / "pd.csv").read_bytes()
    want = pd.read_csv(tmp_path / "pd.csv", dtype=str, keep_default_na=False).to_dict("records")
    assert _read_report(tmp_path / "pd.csv") == want


@pytest.mark.parametrize("text", ["", "slide_id,status\na,ok,extra\n", "x,y\n1,2\n"])
def test_an_unreadable_report_is_replaced_with_a_warning(tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tiling_report.csv"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert _read_report(path) == []
    assert "replaced by this run's rows" in caplog.text


def test_short_rows_and_blank_lines_read_as_pandas_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    path.write_text("slide_id,status,note\na,ok\n\nb,failed,x\n")
    assert _read_report(path) == pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
