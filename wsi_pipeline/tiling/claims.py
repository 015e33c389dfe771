"""Which slide this run tiles next: only slides whose lock it holds (:mod:`wsi_pipeline.tiling.locks`).

A :class:`~wsi_pipeline.jobs.slide_jobs.Claims` for the job runner: slides another live run holds
are deferred and retried; once free, each is checked again (usually ``skipped``: the other run
finished it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from wsi_pipeline.data.store import store_path
from wsi_pipeline.tiling.locks import LockDir
from wsi_pipeline.tiling.job import SlideJob, SlideResult
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.tiler import precheck
from wsi_pipeline.tiling.identity import store_matches

__all__ = ["RETRY_S", "SlideClaims"]

logger = logging.getLogger(__name__)

#: Seconds between attempts on a slide another run holds.
RETRY_S = 1.0


def _current_store(job: SlideJob, out: Path, config: TilingConfig, since: float) -> SlideResult | None:
    """With ``overwrite``: a ``skipped`` result when another run rebuilt this slide's store after ``since``.

    "After" is read from the store's ``zarr.json``, written when it was marked complete (file
    times have ns resolution locally; the ``created`` attribute only has seconds).
    """
    path = Path(job.path)
    if not path.is_file():
        return None
    store = store_path(out, job.slide_id)
    try:
        completed = (store / "zarr.json").stat().st_mtime
    except OSError:
        return None
    if completed <= since:
        return None
    attrs = store_matches(store, job, config)
    if attrs is None:
        return None
    return SlideResult(job.slide_id, "skipped", n_tiles=int(attrs.get("n_tiles", 0)), mpp=attrs.get("mpp"),
                       note="rebuilt by another run during this one", path=job.path)


def _older_than(path: Path, seconds: float) -> bool:
    """True when ``path`` exists and was last changed more than ``seconds`` ago."""
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


class SlideClaims:
    """Hands out this run's slides one at a time, each only while this process holds its lock.

    A slide whose lock another live run holds is deferred and retried every ``RETRY_S``
    seconds; once free it is checked again (usually ``skipped``: the other run finished it).
    """

    def __init__(self, jobs: Sequence[SlideJob], todo: Sequence[int], out: Path, config: TilingConfig,
                 overwrite: bool, locks: LockDir, settle: Callable[[int, SlideResult], None], since: float) -> None:
        self.jobs, self.out, self.config, self.overwrite, self.locks = jobs, out, config, overwrite, locks
        self.pending = deque(todo)
        self.deferred: dict[int, float] = {}  # job index -> next attempt (monotonic s)
        self.settle = settle
        self.since = since  # this run's start (epoch s): stores built after it by others count as current
        self._told: set[int] = set()

    @property
    def done(self) -> bool:
        return not self.pending and not self.deferred

    def _claim(self, i: int) -> bool:
        job = self.jobs[i]
        if not self.locks.try_acquire(job.slide_id):
            self.deferred[i] = time.monotonic() + RETRY_S
            if i not in self._told:
                self._told.add(i)
                info = self.locks.holder(job.slide_id)
                if info is None and _older_than(self.locks.path(job.slide_id), 2.0):  # empty or unreadable, not
                    # just being written (a run that died creating it?): say so, the wait may be long
                    logger.warning("slide %s: its lock %s is empty or unreadable; waiting until it is taken over as "
                                   "stale (%g s after its last change), or delete it if no run is alive", job.slide_id,
                                   self.locks.path(job.slide_id), self.locks.stale_after_s)
                else:
                    logger.info("slide %s is being tiled by another run (%s); waiting for it", job.slide_id,
                                info.describe() if info else "lock being written")
            return False
        self.deferred.pop(i, None)
        # another run may have finished it between our first look and the lock
        early = precheck(job, self.out, self.config, overwrite=self.overwrite)
        if early is None and self.overwrite:
            early = _current_store(job, self.out, self.config, self.since)
        if early is not None:
            self.settle(i, early)  # releases the lock
            return False
        return True

    def next(self) -> int | None:
        """The next job index to tile, its lock held; None when none can start now (see :attr:`done`)."""
        while self.pending:
            i = self.pending.popleft()
            if self._claim(i):
                return i
        now = time.monotonic()
        for i, when in sorted(self.deferred.items(), key=lambda kv: kv[1]):
            if when <= now and self._claim(i):
                return i
        return None
