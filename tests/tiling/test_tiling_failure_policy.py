"""The bad-slide policy in tiling (wsi_pipeline.failures): a bad slide is a failed row and the run goes on;
a bug in the per-slide work stops the run, in this process and from a worker process."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.data.store import is_complete
from wsi_pipeline.slides.opener import SlideOpenError
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling import pool, tiler, worker
from wsi_pipeline.tiling.cohort import tile_cohort

CONFIG = TilingConfig(method="greyscale", qc="off")


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("policy_cohort")
    for k in range(3):
        make_slide(folder / f"s{k}.svs", size=384, seed=70 + k, tissue_fraction=0.6)
    return folder


def _failing_on(slide_id: str, err: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the per-slide tiling work raise ``err`` for ``slide_id`` only."""
    real = tiler._tile_open_slide

    def work(slide, job, *args, **kwargs):
        if job.slide_id == slide_id:
            raise err
        return real(slide, job, *args, **kwargs)

    monkeypatch.setattr(tiler, "_tile_open_slide", work)


def test_a_corrupt_file_and_a_slide_error_fail_their_slide_and_the_run_goes_on(tmp_path: Path, cohort: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for p in cohort.iterdir():
        (slides / p.name).symlink_to(p)
    (slides / "broken.svs").write_bytes(b"II*\x00" + b"\x00garbage" * 64)  # a TIFF header and nothing readable
    _failing_on("s1", SlideOpenError("s1.svs: tile 3 does not decode", {"openslide": "bad JPEG"}), monkeypatch)
    report = tile_cohort(slides, tmp_path / "tiles", CONFIG, workers=0, progress=False)
    status = {r.slide_id: r.status for r in report.results}
    assert status == {"broken": "failed", "s0": "ok", "s1": "failed", "s2": "ok"}
    errors = {r.slide_id: r.error for r in report.results}
    assert errors["s1"] == "SlideOpenError: s1.svs: tile 3 does not decode"
    assert errors["broken"]  # names why the reader refused it
    assert is_complete(tmp_path / "tiles" / "s2.zarr")
    csv = pd.read_csv(report.report_path, keep_default_na=False).set_index("slide_id")
    assert csv.loc["s1", "status"] == "failed" and csv.loc["s2", "status"] == "ok"


@pytest.mark.parametrize("bug", [TypeError("unsupported operand type(s)"), AttributeError("'NoneType' has no attribute 'level'"),
                                 KeyError("mpp")], ids=lambda e: type(e).__name__)
def test_a_bug_in_the_per_slide_work_stops_the_run(tmp_path: Path, cohort: Path, monkeypatch: pytest.MonkeyPatch,
                                                  bug: Exception) -> None:
    _failing_on("s1", bug, monkeypatch)
    with pytest.raises(type(bug)):
        tile_cohort(cohort, tmp_path / "tiles", CONFIG, workers=0, progress=False)
    assert not (tmp_path / "tiles" / "s2.zarr").exists()  # stopped at s1: s2 was never tiled
    csv = pd.read_csv(tmp_path / "tiles" / "tiling_report.csv", keep_default_na=False)
    assert csv.set_index("slide_id").loc["s0", "status"] == "ok"
    assert not csv["error"].str.contains(type(bug).__name__).any()  # no slide blamed for the bug
    assert csv["error"].iloc[1:].str.startswith("not processed").all()  # s1 and s2 are left to a rerun


def test_a_bug_in_a_worker_process_reaches_the_parent(tmp_path: Path) -> None:
    """The worker sends the exception with its traceback; the pool raises it instead of failing the slide."""
    try:
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
    except TypeError as e:
        sent = worker._portable(e)
    assert isinstance(sent, TypeError) and "in the tiling worker process" in sent.__notes__[-1]
    assert "test_a_bug_in_a_worker_process_reaches_the_parent" in sent.__notes__[-1]  # the worker's traceback
    parent, child = mp.Pipe(duplex=True)
    child.send(("progress", 5))
    child.send(("error", pickle.loads(pickle.dumps(sent))))
    added: list[int] = []
    p = pool._Pool([], None, tmp_path, CONFIG, False, 1, lambda i, r: None, lambda n, **k: added.append(n))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unsupported operand"):
        p._drain(pool._Worker(proc=None, conn=parent, index=0))
    assert added == [5]
