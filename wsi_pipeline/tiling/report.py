"""``tiling_report.csv``: one row per slide, merged with other runs' rows under a lock, replaced atomically.

Columns: those of :class:`~wsi_pipeline.tiling.job.SlideResult` (slide_id, status, n_tiles, mpp,
seconds, error, note, path, cpu_seconds, background_grey, slide_mpp, mpp_source). This run's
finished slides replace older rows; its unfinished ones are ``pending`` (``failed`` at the end of
an interrupted run) unless the report already has a row for them.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline.tiling.locks import LockDir
from wsi_pipeline.tiling.job import DARK_NOTE, SlideJob, SlideResult

__all__ = ["LOCK_DIR", "REPORT_COLUMNS", "REPORT_NAME", "CohortReport", "write_report"]

logger = logging.getLogger(__name__)

REPORT_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SlideResult))
REPORT_NAME = "tiling_report.csv"
#: Lock files of the slides being tiled and of the report, inside the output folder.
LOCK_DIR = ".locks"
_REPORT_LOCK = "_report"


@dataclass
class CohortReport:
    """Outcome of :func:`tile_cohort`: one :class:`SlideResult` per job, the report path and the wall time."""

    results: list[SlideResult]
    report_path: Path
    seconds: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        """True when no slide failed."""
        return self.count("failed") == 0

    @property
    def n_tiles(self) -> int:
        return sum(r.n_tiles for r in self.results if r.status in ("ok", "skipped"))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(r) for r in self.results], columns=list(REPORT_COLUMNS))

    def summary(self) -> str:
        empty = sum(r.status == "ok" and r.n_tiles == 0 for r in self.results)
        # "skipped" in the report is either a complete store from an earlier run (reused) or a slide
        # left untiled by a rule (a dark, fluorescence background): the summary says which
        dark = sum(r.status == "skipped" and r.note.startswith(DARK_NOTE) for r in self.results)
        reused = self.count("skipped") - dark
        parts = [f"{self.count('ok')} tiled", f"{reused} reused", f"{dark} skipped", f"{self.count('failed')} failed"]
        text = f"tiling: {len(self.results)} slides: " + ", ".join(parts)
        if empty:
            text += f" ({empty} with 0 tiles)"
        if dark:
            text += f" ({dark} skipped: a dark background, fluorescence?, not tiled)"
        text += f"; {self.n_tiles} tiles in {self.seconds:.1f} s"
        stored = [r for r in self.results if r.status in ("ok", "skipped") and r.store_bytes and r.slide_bytes]
        if stored:
            sb, lb, n = (sum(getattr(r, k) for r in stored) for k in ("store_bytes", "slide_bytes", "n_tiles"))
            text += (f"; stores {sb / 2**20:.0f} MiB for {lb / 2**20:.0f} MiB of slides ({sb / lb:.2f}x, "
                     f"{sb / max(n, 1) / 1024:.0f} KiB per tile)")
        text += _qc_share(self.results)
        text += f"; report: {self.report_path}"
        if not self.ok:
            failed = [r.slide_id for r in self.results if r.status == "failed"]
            more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            text += f"\nfailed: {', '.join(failed[:5])}{more} (see the error column)"
        return text


def _qc_share(results: Sequence[SlideResult]) -> str:
    """``; QC dropped d of n tissue tiles (x %), pen a %, blur b %, fold c %`` over the tiled slides, or ""."""
    done = [r for r in results if r.status == "ok"]
    total = sum(r.n_tiles + r.qc_dropped for r in done)
    if not total or not any(r.qc_pen or r.qc_blur or r.qc_fold or r.qc_dropped for r in done):
        return ""
    dropped = sum(r.qc_dropped for r in done)
    per = ", ".join(f"{k} {100.0 * sum(getattr(r, 'qc_' + k) for r in done) / total:.1f} %" for k in ("pen", "blur", "fold"))
    return f"; QC dropped {dropped} of {total} tissue tiles ({100.0 * dropped / total:.1f} %; found: {per})"


def unfinished_result(job: SlideJob, final: bool) -> SlideResult:
    if final:
        return SlideResult(job.slide_id, "failed", error="not processed: the run was interrupted; rerun to resume", path=job.path)
    return SlideResult(job.slide_id, "pending", path=job.path)


def _read_report(path: Path) -> list[dict[str, Any]]:
    """The rows of an existing report (strings), in file order; [] when there is none or it is unreadable.

    Read with the ``csv`` module as pandas would read it with ``dtype=str, keep_default_na=False`` (blank lines
    skipped, missing trailing fields empty, a row with more fields than the header unreadable): the report is
    merged every 2 s while a run goes on, and pandas spent several times a small image's tiling on each merge.
    """
    if not path.exists():
        return []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            records = [rec for rec in csv.reader(f) if rec]
        if not records:
            raise ValueError("no columns to parse from file")
        header, rows = records[0], []
        for k, rec in enumerate(records[1:], start=2):
            if len(rec) > len(header):
                raise ValueError(f"line {k}: expected {len(header)} fields, saw {len(rec)}")
            rows.append(dict(zip(header, rec + [""] * (len(header) - len(rec)))))
    except (ValueError, csv.Error, UnicodeDecodeError, OSError) as err:
        logger.warning("%s is unreadable (%s); it is replaced by this run's rows", path, err)
        return []
    if "slide_id" not in header or "status" not in header:
        logger.warning("%s has no slide_id/status columns; it is replaced by this run's rows", path)
        return []
    return rows


def _cell(value: Any) -> Any:
    """A report value as pandas' ``to_csv`` writes it: None and NaN empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def _write_rows(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Write ``rows`` with ``columns`` as a CSV table, atomically (the table ``write_report_csv`` writes, with the
    ``csv`` module: see :func:`_read_report`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(columns)
            w.writerows([_cell(row.get(c)) for c in columns] for row in rows)


def _merge_rows(existing: list[dict[str, Any]], results: Sequence[SlideResult | None], jobs: Sequence[SlideJob], final: bool) -> list[dict[str, Any]]:
    """One row per slide: this run's finished results replace older rows; its unfinished slides
    only fill in slides without a row (another run may have finished them)."""
    rows: dict[str, dict[str, Any]] = {}
    for row in existing:
        rows[str(row["slide_id"])] = row
    for job, r in zip(jobs, results):
        old = rows.get(job.slide_id)
        if r is None:
            if old is None or old.get("status") == "pending":
                rows[job.slide_id] = asdict(unfinished_result(job, final))
            continue
        rows[job.slide_id] = asdict(r)
    return list(rows.values())


def write_report(
    results: Sequence[SlideResult | None], jobs: Sequence[SlideJob], path: Path, *, final: bool = False,
    locks: LockDir | None = None,
) -> None:
    """Merge this run's rows into ``tiling_report.csv`` under the report lock and replace it atomically.

    Unfinished slides are ``pending`` (``failed`` when ``final``) unless the report already has
    a row for them.
    """
    if locks is None:
        locks = LockDir(path.parent / LOCK_DIR, stale_after_s=60.0, heartbeat_s=30.0)
    locks.acquire_wait(_REPORT_LOCK, timeout_s=120.0)
    try:
        rows = _merge_rows(_read_report(path), results, jobs, final)
        columns = list(REPORT_COLUMNS) + [c for c in (rows[0] if rows else {}) if c not in REPORT_COLUMNS]
        _write_rows(path, rows, columns)
    finally:
        locks.release(_REPORT_LOCK)
