"""The per-slide job runner: for each slide, run (or skip), record ok / skipped / failed, report, go on.

Every per-slide stage (tiling, feature extraction, prediction, the evaluation's scoring pass)
goes through this module:

- :class:`SlideRun` keeps the bookkeeping of one pass: one result per slide in slide order, the
  progress bar (slides, with running totals such as tiles in its postfix), the count of failed
  slides, a report written while the run goes on and at its end, and on an error or an interrupt
  (``KeyboardInterrupt`` is never swallowed) the report of what is known before the error goes on.
  A stage plugs in its own steps: ``before_record`` (e.g. the tiler releases the slide's lock and
  checks its output folder, which may stop the run), ``on_result`` and the ``report`` writer (the
  tiler merges its rows with other runs' under a lock).
- :func:`run_slides` drives a list of slides through a work function in this process or as one
  Dask task per slide (:func:`wsi_pipeline.jobs.cluster.map_slides`), each slide's row made by
  :func:`run_one`: ``slide_id, status, error, seconds`` plus the stage's own columns.
- :func:`run_claimed` runs slides one at a time as a stage's claim step hands them out (the
  tiler's slide locks, :mod:`wsi_pipeline.tiling.claims`); the tiler's process pool and Dask
  executors hand it their results through :meth:`SlideRun.record` the same way.
- :func:`write_report_csv` writes a report atomically (:func:`wsi_pipeline.io_atomic.atomic_path`).

A row is a mapping or an object with ``slide_id`` / ``status`` / ``error`` attributes (the
tiler's :class:`~wsi_pipeline.tiling.job.SlideResult`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from wsi_pipeline import failures
from wsi_pipeline.io_atomic import atomic_path
from wsi_pipeline import interrupt
from wsi_pipeline.progress import progress_bar

__all__ = [
    "ROW_COLUMNS", "STATUSES", "Claims", "InOrder", "SlideRun", "row_field", "run_claimed", "run_one", "run_slides",
    "write_report_csv",
]

logger = logging.getLogger(__name__)

#: A slide's outcome: its output written, already up to date (or not to be made), or an error.
STATUSES: tuple[str, ...] = ("ok", "skipped", "failed")
#: Columns every report row has (stages add their own).
ROW_COLUMNS: tuple[str, ...] = ("slide_id", "status", "error", "seconds")


def row_field(row: Any, name: str, default: Any = None) -> Any:
    """``row[name]`` for a mapping row, ``row.name`` for a dataclass row."""
    if isinstance(row, Mapping):
        return row.get(name, default)
    return getattr(row, name, default)


class Claims(Protocol):
    """Hands out the slides (their indices) a run may work on now, e.g. only while it holds their locks."""

    @property
    def done(self) -> bool:
        """True when no slide is left to hand out."""

    def next(self) -> int | None:
        """The next slide index to run, or None when none can start now (see :attr:`done`)."""


class InOrder:
    """:class:`Claims` without locks: the given indices, in order."""

    def __init__(self, todo: Iterable[int]) -> None:
        self._todo = list(todo)[::-1]

    @property
    def done(self) -> bool:
        return not self._todo

    def next(self) -> int | None:
        return self._todo.pop() if self._todo else None


class SlideRun:
    """The bookkeeping of one per-slide pass (see the module docstring); use it as a context manager.

    Parameters
    ----------
    n : slides in the run; :attr:`results` holds one entry per slide (None until recorded).
    desc, unit, progress, leave : the progress bar (``progress=False`` shows none).
    totals : names of running totals shown in the bar's postfix (e.g. ``("tiles",)``, see :meth:`add`).
    before_record : ``(index, row)`` called first when a slide's row arrives; may change the row or
        raise to stop the run (the row is then not recorded).
    on_result : called with each recorded row.
    report : ``(results, final)`` writes the report; called at most every ``report_every_s``
        seconds while the run goes on (None: only at the end), by :meth:`write_report`, and
        (best effort) when the run stops on an error.
    """

    def __init__(
        self,
        n: int,
        *,
        desc: str = "slides",
        unit: str = "slide",
        progress: bool = True,
        leave: bool = True,
        totals: Sequence[str] = (),
        before_record: Callable[[int, Any], None] | None = None,
        on_result: Callable[[Any], None] | None = None,
        report: Callable[[Sequence[Any], bool], None] | None = None,
        report_every_s: float | None = None,
    ) -> None:
        self.results: list[Any] = [None] * n
        self.totals: dict[str, int] = {name: 0 for name in totals}
        self.n_failed = 0
        self.desc = desc
        self._before, self._on_result = before_record, on_result
        self._report, self._every = report, report_every_s
        self._last_write = 0.0
        self.bar = progress_bar(total=n, unit=unit, desc=desc, enabled=progress, leave=leave)

    def __enter__(self) -> SlideRun:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        self.bar.close()
        if kind is not None and self._report is not None:
            try:  # keep what is known; the error in flight matters more than a report that cannot be written
                self._report(self.results, True)
            except (OSError, TimeoutError) as write_err:
                logger.error("%s: could not write the report: %s", self.desc, write_err)
        # returning None lets the error (KeyboardInterrupt included) go on

    def _postfix(self, refresh: bool) -> None:
        if self.totals or self.n_failed:
            self.bar.set_postfix(**self.totals, failed=self.n_failed, refresh=refresh)

    def add(self, name: str, n: int, refresh: bool = True) -> None:
        """Add ``n`` to the running total ``name`` shown in the bar."""
        self.totals[name] = self.totals.get(name, 0) + int(n)
        self._postfix(refresh)

    def record(self, i: int, row: Any) -> None:
        """Record slide ``i``'s row (``before_record`` first), move the bar, write the report when due;
        then stop if Ctrl-C was pressed (:func:`wsi_pipeline.interrupt.check`)."""
        if self._before is not None:
            self._before(i, row)
        if row_field(row, "status") == "failed":
            self.n_failed += 1
            logger.warning("slide %s failed: %s", row_field(row, "slide_id"), row_field(row, "error"))
        self.results[i] = row
        if self._on_result is not None:
            self._on_result(row)
        self._postfix(refresh=False)
        self.bar.update(1)
        if self._every is not None and self._report is not None and time.monotonic() - self._last_write > self._every:
            self._report(self.results, False)
            self._last_write = time.monotonic()
        interrupt.check()

    def write_report(self, final: bool = True) -> None:
        """Write the report now (errors propagate)."""
        if self._report is not None:
            self._report(self.results, final)

    def count(self, status: str) -> int:
        return sum(r is not None and row_field(r, "status") == status for r in self.results)


def run_claimed(run: SlideRun, claims: Claims, work: Callable[[int], Any], *, idle_s: float = 0.25) -> None:
    """Run slides in this process, one at a time, as ``claims`` hands them out: ``run.record(i, work(i))``.

    While only slides that cannot start yet remain (another run holds them), wait ``idle_s`` seconds between tries.
    """
    while not claims.done:
        i = claims.next()
        if i is None:
            time.sleep(idle_s)
            continue
        run.record(i, work(i))


@dataclass(frozen=True)
class _Guarded:
    """``work`` wrapped by :func:`run_one` (picklable, so it can be a Dask task)."""

    work: Callable[..., Any]
    slide_id: Callable[[Any], str]
    catch: tuple[type[BaseException], ...] | None
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, item: Any, *args: Any) -> dict[str, Any]:
        return run_one(self.work, item, args, slide_id=self.slide_id(item), catch=self.catch, defaults=self.defaults)


#: OSError numbers that stop a per-slide run at once (:data:`wsi_pipeline.failures.STOP_ERRNOS`).
STOP_ERRNOS = failures.STOP_ERRNOS


def run_one(
    work: Callable[..., Any],
    item: Any,
    args: tuple[Any, ...] = (),
    *,
    slide_id: str,
    catch: tuple[type[BaseException], ...] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One slide's report row: ``work(item, row, *args)`` fills in ``row`` and returns nothing (or a mapping to add).

    ``row`` starts as ``{slide_id, status: "ok", error: "", seconds: 0, **defaults}``; the work sets
    ``status`` ``skipped`` / ``failed`` (and ``error``) itself when it knows. A slide error of the
    project's bad-slide policy (:func:`wsi_pipeline.failures.is_slide_error`; with ``catch``, only an
    exception of those types) makes the row ``failed`` with ``error`` ``"<Type>: <message>"`` (the
    columns the work filled before it are kept); any other exception (a bug), an ``OSError`` of
    :data:`STOP_ERRNOS` (a full disk or quota, a read-only file system), running out of memory and
    always ``KeyboardInterrupt`` propagate and stop the run. ``seconds`` is the wall time of the work
    (s, 3 decimals).
    """
    t0 = time.perf_counter()
    row: dict[str, Any] = {"slide_id": slide_id, "status": "ok", "error": "", "seconds": 0.0, **(defaults or {})}

    def fail(err: BaseException) -> None:
        row.update(status="failed", error=failures.describe_failure(err))

    if catch is None:
        with failures.slide_failures(fail):
            extra = work(item, row, *args)
            if extra:
                row.update(extra)
    else:
        try:
            extra = work(item, row, *args)
            if extra:
                row.update(extra)
        except catch as err:
            if failures.stops_the_run(err):  # an interrupt, memory, a full disk: every later slide would fail alike
                raise
            fail(err)
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def run_slides(
    items: Sequence[Any],
    work: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    slide_id: Callable[[Any], str] = str,
    catch: tuple[type[BaseException], ...] | None = None,
    defaults: Mapping[str, Any] | None = None,
    broadcast: Any = None,
    cluster: Any = None,
    retries: int | None = None,
    workers: int | None = None,
    desc: str = "slides",
    progress: bool = True,
    leave: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    report_path: str | os.PathLike | None = None,
    columns: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``work`` on every item; one report row per item (:func:`run_one`), in the order of ``items``.

    Parameters
    ----------
    items : the slides (ids, manifest rows, ...); ``slide_id(item)`` names each in its row.
    work : ``work(item, row, *args)`` (``work(item, row, broadcast, *args)`` with ``broadcast``).
    catch : None = the project's bad-slide policy (:mod:`wsi_pipeline.failures`) says which errors make a
        slide ``failed`` and the run go on; else exactly these exception types do (others stop it).
    defaults : the stage's own columns, with the values of a slide the work did not reach.
    broadcast : an object every call gets (on a cluster, sent once to each worker, e.g. an encoder).
    cluster : None = in this process, one slide after the other; else one Dask task per slide
        (a ``--cluster`` string, a :class:`~wsi_pipeline.jobs.cluster.ClusterSpec` or a
        ``distributed.Client``): a task whose workers kept dying (or that raised a slide error
        outside the work) becomes a ``failed`` row ``"the Dask task failed: <Type>: <message>"``;
        an error that stops the run (a bug, memory, a full disk) raised on a worker stops it here too.
    retries, workers : with ``cluster``: extra runs of a task whose worker died; local worker count.
    desc, progress, leave : the progress bar.
    on_result : called in this process with each row as it is recorded (rows arrive in order).
    report_path, columns : write the rows (these columns) to this CSV atomically at the end, and
        the rows finished so far when the run stops on an error.
    """
    guarded = _Guarded(work, slide_id, None if catch is None else tuple(catch), dict(defaults or {}))
    head = () if broadcast is None else (broadcast,)
    report = None
    if report_path is not None:
        cols = list(columns) if columns is not None else list(ROW_COLUMNS)
        report = lambda results, final: write_report_csv(report_path, [r for r in results if r is not None], cols)  # noqa: E731
    if cluster is None:
        with SlideRun(len(items), desc=desc, progress=progress, leave=leave, on_result=on_result, report=report) as run:
            for i, item in enumerate(items):
                run.record(i, guarded(item, *head, *args))
    else:
        from wsi_pipeline.jobs.cluster import DEFAULT_RETRIES, map_slides

        n_retries = DEFAULT_RETRIES if retries is None else int(retries)
        outcomes = map_slides(cluster, guarded, list(items), args, broadcast=broadcast, progress=progress, desc=desc,
                              retries=n_retries, workers=workers)
        with SlideRun(len(items), desc=desc, progress=False, on_result=on_result, report=report) as run:
            for i, (item, outcome) in enumerate(zip(items, outcomes)):
                if isinstance(outcome, BaseException):
                    if _stops_on_cluster(outcome):
                        raise outcome
                    error = f"the Dask task failed: {type(outcome).__name__}: {outcome}"
                    outcome = {"slide_id": slide_id(item), "status": "failed", "error": "", "seconds": 0.0, **(defaults or {})}
                    outcome["error"] = error
                run.record(i, outcome)
    run.write_report(final=True)
    return list(run.results)


def _stops_on_cluster(err: BaseException) -> bool:
    """Whether a Dask task's exception stops the run: the work's own error that :func:`run_one` let
    through (a bug, memory, a full disk); a worker that kept dying (``KilledWorker``) or a cancelled
    task costs only its slide."""
    if type(err).__module__.split(".")[0] == "distributed" or type(err).__name__.endswith("CancelledError"):
        return False
    return not failures.is_slide_error(err)


def write_report_csv(path: str | os.PathLike, rows: Sequence[Any], columns: Sequence[str]) -> None:
    """Write ``rows`` (mappings) with ``columns`` as a CSV table, atomically."""
    import pandas as pd

    df = pd.DataFrame(list(rows), columns=list(columns))
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)
