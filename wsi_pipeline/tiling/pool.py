"""The local process pool of a tiling run: worker processes fed slides over pipes, replaced when they die.

Each worker (:mod:`wsi_pipeline.tiling.worker`) reports progress and results over its own pipe;
a worker that dies (a reader crash, the OOM killer, ``kill -9``) costs only its current slide,
which gets a ``failed`` row saying why, and is replaced.

Workers live for the whole run (one process start per worker, not per slide). A worker whose last
slide took under :data:`PREFETCH_BELOW_S` is sent its next slide before it finishes the current one
(:data:`PREFETCH` slides in its pipe at most), so on many small images it never waits for this
process to record a result, release a lock, claim the next slide and send it: that round trip, on a
loaded machine, costs more than tiling a small image. A slow slide's worker gets one slide at a time,
so no lock on a big slide is held by a run that will not start it for minutes. A slide sent ahead to a
worker that dies is sent to its replacement (its lock still held), never failed.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Sequence
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from wsi_pipeline.jobs.cluster import default_workers
from wsi_pipeline.jobs.slide_jobs import Claims
from wsi_pipeline.tiling.claims import RETRY_S
from wsi_pipeline.tiling.job import SlideJob, SlideResult
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.worker import worker_main

__all__ = ["PREFETCH", "PREFETCH_BELOW_S", "run_pool"]

#: Slides in a fast worker's pipe at most: the one it tiles and those sent ahead.
PREFETCH = 3
#: A worker whose last slide took less than this (s) is sent slides ahead.
PREFETCH_BELOW_S = 2.0


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    index: int | None = None  # the job being tiled
    retired: bool = False  # sent the end-of-work message
    ahead: deque[int] = field(default_factory=deque)  # jobs sent after `index`, in the order it tiles them
    fast: bool = False  # its last slide took under PREFETCH_BELOW_S

    def send(self, i: int, job: SlideJob) -> None:
        self.conn.send(job)
        if self.index is None:
            self.index = i
        else:
            self.ahead.append(i)


def _death_message(exitcode: int | None) -> str:
    """What a worker's exit says about its slide, by cause (the output folder is checked separately)."""
    if exitcode is not None and exitcode < 0:
        sig = -exitcode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            how = (f"was killed by {name}, usually the system's out-of-memory killer (or a `kill -9`); "
                   "use fewer --workers if memory is short")
        elif sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE):
            how = (f"crashed ({name}) inside the slide reader, typically on a damaged or unsupported file; "
                   "check the file, or try --backend tiffslide")
        else:
            how = f"was stopped by {name}"
    else:
        how = (f"exited with code {exitcode} before finishing the slide (an error outside the tiler's own checks); "
               "rerun with -v and --workers 0 to see it")
    return f"the worker process tiling this slide {how}; no store was written. Rerun to retry it"


class _Pool:
    """Worker processes tiling the slides ``claims`` hands out; ``finish(index, result)`` gets each outcome."""

    def __init__(self, jobs: Sequence[SlideJob], claims: Claims, out: Path, config: TilingConfig, overwrite: bool,
                 n_workers: int, finish: Callable[[int, SlideResult], None], add_tiles: Callable[..., None]) -> None:
        self.jobs, self.claims, self.out, self.config, self.overwrite = jobs, claims, out, config, overwrite
        self.finish, self.add_tiles = finish, add_tiles
        # spawn: workers must not inherit a parent's threads or CUDA state (predict may have torch loaded)
        self.ctx = mp.get_context("spawn")
        # each worker decodes, tests and writes a slide with its share of the cores (threads); a worker
        # whose share is one core does all in one thread, not competing with the other workers
        self.threads = max(1, default_workers() // n_workers)
        self.n_workers = n_workers
        self.workers: list[_Worker] = []

    def start(self) -> _Worker:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=worker_main, args=(child, str(self.out), self.config, self.overwrite, self.threads),
                                daemon=True, name="wsi-tile-worker")
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        self.workers.append(w)
        return w

    def assign(self, w: _Worker) -> None:
        """Give ``w`` the next claimable slide when it has none, and slides ahead while it is fast (up to
        :data:`PREFETCH` in its pipe); retire it when no slide is left and it has none."""
        while w.index is None or (w.fast and len(w.ahead) < PREFETCH - 1):
            i = self.claims.next()
            if i is None:
                break
            w.send(i, self.jobs[i])
        if w.index is None and self.claims.done and not w.retired:
            w.retired = True
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def bury(self, w: _Worker) -> None:
        """Remove a dead worker; its slide gets a ``failed`` row, the slides sent ahead to it go to a new
        worker (their locks still held), which then takes over."""
        w.proc.join(timeout=5)
        self.workers.remove(w)
        w.conn.close()
        ahead = list(w.ahead)
        w.ahead.clear()
        if w.index is not None:
            job = self.jobs[w.index]
            i, w.index = w.index, None
            _remove_temp(self.out, job.slide_id, w.proc.pid)
            self.finish(i, SlideResult(job.slide_id, "failed", error=_death_message(w.proc.exitcode), path=job.path))
        if ahead or not self.claims.done:
            new = self.start()
            for i in ahead:
                new.send(i, self.jobs[i])
            self.assign(new)

    def _drain(self, w: _Worker) -> None:
        """Take ``w``'s messages: progress, and a finished slide (then give it the next one); raise the error
        that stopped it (a bug)."""
        error: BaseException | None = None
        try:
            while w.conn.poll():
                kind, payload = w.conn.recv()
                if kind == "progress":
                    self.add_tiles(int(payload))
                elif kind == "error":  # a bug or memory in the worker stops the run (wsi_pipeline.failures)
                    error = payload
                    break
                elif kind == "done" and w.index is not None:
                    r: SlideResult = payload
                    i, w.index = w.index, (w.ahead.popleft() if w.ahead else None)
                    w.fast = r.seconds < PREFETCH_BELOW_S
                    if r.status == "skipped":
                        self.add_tiles(r.n_tiles, refresh=False)
                    self.finish(i, r)
                    self.assign(w)
        except (EOFError, OSError):
            self.bury(w)
        if error is not None:
            raise error

    def step(self) -> None:
        """Wait up to ``RETRY_S`` for a message or a death, handle what came, give idle workers work."""
        busy = [w for w in self.workers if w.index is not None]
        handles: list[Any] = [w.conn for w in busy] + [w.proc.sentinel for w in busy]
        ready: list[Any] = []
        if handles:
            ready = wait(handles, timeout=RETRY_S)
        else:
            time.sleep(RETRY_S / 4)
        for w in busy:
            if w.conn in ready:
                self._drain(w)
                if w not in self.workers:
                    continue
            if w in self.workers and w.proc.sentinel in ready and not w.conn.poll():
                self.bury(w)
        for w in [w for w in self.workers if not w.retired and (w.index is None or (w.fast and len(w.ahead) < PREFETCH - 1))]:
            if w.index is None and not w.proc.is_alive():
                self.bury(w)
                continue
            if not self.claims.done or w.index is None:
                self.assign(w)
        if not self.workers and not self.claims.done:
            self.assign(self.start())

    def run(self) -> None:
        for _ in range(self.n_workers):
            self.assign(self.start())
        try:
            while any(w.index is not None for w in self.workers) or not self.claims.done:
                self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Ask the workers to stop, wait up to 10 s, terminate the rest; remove their unfinished stores."""
        for w in list(self.workers):
            if w.proc.is_alive():
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 10
        for w in list(self.workers):
            w.proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=5)
            for i in ([w.index] if w.index is not None else []) + list(w.ahead):  # stopped in any of them
                _remove_temp(self.out, self.jobs[i].slide_id, w.proc.pid)


def run_pool(
    jobs: Sequence[SlideJob],
    claims: Claims,
    out: Path,
    config: TilingConfig,
    overwrite: bool,
    n_workers: int,
    finish: Callable[[int, SlideResult], None],
    add_tiles: Callable[..., None],
) -> None:
    """Tile the slides ``claims`` hands out in ``n_workers`` spawned worker processes; ``finish(index, result)``
    gets each outcome in this process, ``add_tiles(n)`` the tiles kept as they are written."""
    _Pool(jobs, claims, out, config, overwrite, n_workers, finish, add_tiles).run()


def _remove_temp(out: Path, slide_id: str, pid: int | None) -> None:
    import shutil

    if pid is not None:
        shutil.rmtree(out / f".{slide_id}.zarr.tmp-{pid}", ignore_errors=True)
