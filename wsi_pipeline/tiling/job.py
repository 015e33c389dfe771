"""What the tiler is given and what it reports, per slide: :class:`SlideJob` and :class:`SlideResult`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DARK_NOTE", "SlideJob", "SlideResult"]

#: Report note of a slide skipped for its dark background.
DARK_NOTE = "skipped: dark background (fluorescence?)"


@dataclass(frozen=True)
class SlideJob:
    """One slide to tile: its id, file, optional per-slide mpp, and a problem found while listing it."""

    slide_id: str
    path: str
    mpp: float | None = None
    problem: str | None = None


@dataclass
class SlideResult:
    """One row of ``tiling_report.csv``."""

    slide_id: str
    status: str  # ok / failed / skipped
    n_tiles: int = 0
    mpp: float | None = None
    seconds: float = 0.0
    error: str = ""
    note: str = ""
    path: str = ""
    cpu_seconds: float = 0.0
    background_grey: float | None = None  # glass (or dark background) grey level from the thumbnail; None: no glass seen
    slide_mpp: float | None = None  # um per level-0 px used
    mpp_source: str = ""  # where slide_mpp came from: slide / manifest / run-fallback / run-forced / none
    qc_dropped: int = 0  # tiles tile QC dropped (qc_mode drop)
    qc_pen: int = 0  # tiles with pen ink, of those that passed the tissue test (kept or dropped)
    qc_blur: int = 0  # tiles out of focus, likewise
    qc_fold: int = 0  # tiles with folded tissue, likewise
    store_bytes: int = 0  # bytes of the store's tile, coordinate and QC files (its chunk and shard files)
    slide_bytes: int = 0  # bytes of the slide file (of its first file, for formats of several files)
