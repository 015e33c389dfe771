"""The per-slide job runner (wsi_pipeline.jobs.slide_jobs): rows, failures, interrupts, the report, local vs Dask."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.jobs.slide_jobs import InOrder, SlideRun, run_claimed, run_slides

COLUMNS = ["slide_id", "status", "value", "seconds", "error"]


def _work(item: int, row: dict, factor: int) -> None:
    """A stage in miniature: multiples of 3 are up to date, 4 is a bad slide (ValueError), 7 a bug (TypeError)."""
    if item % 3 == 0:
        row["status"] = "skipped"
        return
    row["value"] = item  # filled before the failure: a failed row keeps what the work learnt
    if item == 4:
        raise ValueError(f"slide {item} is damaged")
    if item == 7:
        raise TypeError("a bug, not a bad slide")
    row["value"] = item * factor


def _expected(items: list[int], factor: int) -> list[dict]:
    """The rows the rules in :func:`_work` give, written out independently of the runner."""
    out = []
    for i in items:
        if i % 3 == 0:
            out.append({"slide_id": f"s{i}", "status": "skipped", "value": -1, "error": ""})
        elif i == 4:
            out.append({"slide_id": f"s{i}", "status": "failed", "value": 4, "error": "ValueError: slide 4 is damaged"})
        else:
            out.append({"slide_id": f"s{i}", "status": "ok", "value": i * factor, "error": ""})
    return out


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("slide_id", "status", "value", "error")} for r in rows]


def test_rows_ok_skipped_failed_and_a_failure_does_not_stop_the_others(tmp_path: Path) -> None:
    items = [1, 2, 3, 4, 5, 6]
    seen = []
    rows = run_slides(items, _work, (10,), slide_id=lambda i: f"s{i}", catch=(ValueError,), defaults={"value": -1},
                      progress=False, on_result=lambda r: seen.append(r["slide_id"]),
                      report_path=tmp_path / "report.csv", columns=COLUMNS)
    assert _strip(rows) == _expected(items, 10)
    assert seen == [f"s{i}" for i in items]  # every slide after the failed one ran, in order
    assert all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in rows)
    df = pd.read_csv(tmp_path / "report.csv", keep_default_na=False)
    assert list(df.columns) == COLUMNS
    assert df[["slide_id", "status", "value", "error"]].to_dict("records") == _expected(items, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.csv"]  # no temporary file left


def test_an_error_not_listed_stops_the_run_and_keeps_the_finished_rows(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="a bug"):
        run_slides([1, 2, 7, 8], _work, (10,), slide_id=lambda i: f"s{i}", catch=(ValueError,), defaults={"value": -1},
                   progress=False, report_path=tmp_path / "report.csv", columns=COLUMNS)
    df = pd.read_csv(tmp_path / "report.csv", keep_default_na=False)
    assert df[["slide_id", "status", "value", "error"]].to_dict("records") == _expected([1, 2], 10)


def test_keyboard_interrupt_is_not_swallowed(tmp_path: Path) -> None:
    def work(item: int, row: dict) -> None:
        if item == 2:
            raise KeyboardInterrupt
        row["value"] = item

    with pytest.raises(KeyboardInterrupt):
        # even listing BaseException as a slide's failure must not turn an interrupt into a row
        run_slides([1, 2, 3], work, catch=(BaseException,), progress=False, slide_id=lambda i: f"s{i}",
                   report_path=tmp_path / "report.csv", columns=COLUMNS)
    df = pd.read_csv(tmp_path / "report.csv", keep_default_na=False)
    assert list(df["slide_id"]) == ["s1"] and list(df["status"]) == ["ok"]


def test_report_is_replaced_atomically(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "report.csv"
    run_slides([1, 2], _work, (10,), slide_id=lambda i: f"s{i}", defaults={"value": -1}, progress=False,
               report_path=path, columns=COLUMNS)
    before = path.read_bytes()

    def half_then_fail(self, target, *a, **k):
        Path(target).write_text("slide_id,sta")  # a write that breaks off half way
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        run_slides([5], _work, (10,), slide_id=lambda i: f"s{i}", defaults={"value": -1}, progress=False,
                   report_path=path, columns=COLUMNS)
    assert path.read_bytes() == before  # the old report, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.csv"]


def test_slide_run_with_a_claim_step_and_a_stage_check_that_stops_it(tmp_path: Path) -> None:
    class Claims:
        """Slide 1 is held by another run the first time it is asked for; it comes back later."""

        def __init__(self) -> None:
            self.order, self.held_once = [0, 1, 2], False

        @property
        def done(self) -> bool:
            return not self.order

        def next(self):
            i = self.order.pop(0)
            if i == 1 and not self.held_once:
                self.held_once = True
                self.order.append(1)
                return None
            return i

    written = []
    released = []
    run = SlideRun(3, progress=False, totals=("tiles",), report=lambda results, final: written.append((list(results), final)),
                   before_record=lambda i, r: released.append(i))
    with run:
        run_claimed(run, Claims(), lambda i: {"slide_id": f"s{i}", "status": "ok", "error": ""}, idle_s=0.0)
    assert [r["slide_id"] for r in run.results] == ["s0", "s1", "s2"] and released == [0, 2, 1]
    assert written == []  # no report_every_s: only on request or on an error
    run.write_report()
    assert written[-1][1] is True and run.count("ok") == 3

    def out_of_disk(i: int, r: dict) -> None:
        if i == 1:
            raise OSError("output folder gone")

    run = SlideRun(3, progress=False, before_record=out_of_disk, report=lambda results, final: written.append((list(results), final)))
    with pytest.raises(OSError, match="output folder gone"), run:
        run_claimed(run, InOrder(range(3)), lambda i: {"slide_id": f"s{i}", "status": "ok", "error": ""})
    results, final = written[-1]
    assert final and [r and r["slide_id"] for r in results] == ["s0", None, None]  # slide 1 not recorded


@pytest.mark.slow
def test_dask_local_cluster_gives_the_rows_of_the_local_run(tmp_path: Path) -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this test module
    try:
        items = [1, 2, 3, 4, 5]
        kw = dict(slide_id=lambda i: f"s{i}", catch=(ValueError,), defaults={"value": -1}, progress=False, columns=COLUMNS)
        local = run_slides(items, _work, (10,), report_path=tmp_path / "local.csv", **kw)
        dask = run_slides(items, _work, (10,), cluster="local:1", report_path=tmp_path / "dask.csv", **kw)
        # a task that raises what the work does not catch (a bug) stops the run on a cluster too
        with pytest.raises(TypeError, match="a bug, not a bad slide"):
            run_slides([7, 8], _work, (10,), cluster="local:1", retries=0, **kw)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert _strip(dask) == _strip(local) == _expected(items, 10)
    drop = ["seconds"]
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "dask.csv").drop(columns=drop),
                                  pd.read_csv(tmp_path / "local.csv").drop(columns=drop))
