"""The bad-slide policy (wsi_pipeline.failures): which errors fail one slide, which stop the run."""

from __future__ import annotations

import errno

import pytest

from wsi_pipeline.failures import ConfigTypeError, describe_failure, is_slide_error, slide_failures, stops_the_run
from wsi_pipeline.jobs.slide_jobs import run_slides


def _wrapped_disk_full() -> BaseException:
    """torch's zip writer style: a RuntimeError raised while handling the ENOSPC of a write."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file") from e
    except RuntimeError as e:
        return e


def _our_slide_errors() -> list[BaseException]:
    from wsi_pipeline.data.store import StoreDamagedError
    from wsi_pipeline.slides.mpp import MissingMppError
    from wsi_pipeline.slides.opener import SlideOpenError

    return [SlideOpenError("no backend opened x.svs", {"openslide": "bad"}), MissingMppError("x.svs has no mpp"),
            StoreDamagedError("x.zarr", "tiles 0: checksum")]


@pytest.mark.parametrize("err", [
    ValueError("bad value"), FileNotFoundError(2, "No such file", "x.svs"), PermissionError(13, "denied", "x.svs"),
    EOFError("truncated"), OSError(errno.EIO, "I/O error"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte"),
], ids=lambda e: type(e).__name__)
def test_input_errors_fail_the_slide(err: BaseException) -> None:
    assert is_slide_error(err) and not stops_the_run(err)


def test_our_input_errors_and_the_readers_own_errors_fail_the_slide() -> None:
    from PIL import Image, UnidentifiedImageError

    found = [*_our_slide_errors(), UnidentifiedImageError("cannot identify image file"),
             Image.DecompressionBombError("too many pixels")]
    import tifffile

    found.append(tifffile.TiffFileError("not a TIFF file"))
    assert [is_slide_error(e) for e in found] == [True] * len(found)
    # a built-in type raised inside a reader is still judged by its type: only the readers' own classes count
    assert type(Image.DecompressionBombError("x")).__module__.startswith("PIL")
    assert not issubclass(Image.DecompressionBombError, (ValueError, OSError))  # it counts by its library alone


@pytest.mark.parametrize("err", [
    TypeError("unsupported operand"), AttributeError("no attribute x"), KeyError("slide_id"), IndexError("out of range"),
    NameError("name y is not defined"), AssertionError("invariant"), RuntimeError("shape mismatch"),
    NotImplementedError("todo"), ImportError("no module openslide"), ZeroDivisionError("division by zero"),
], ids=lambda e: type(e).__name__)
def test_bugs_stop_the_run(err: BaseException) -> None:
    assert not is_slide_error(err)


@pytest.mark.parametrize("err", [
    MemoryError(), KeyboardInterrupt(), SystemExit(1), OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"), OSError(errno.EROFS, "Read-only file system"),
], ids=lambda e: f"{type(e).__name__}-{getattr(e, 'errno', '')}")
def test_memory_interrupts_and_a_full_disk_stop_the_run(err: BaseException) -> None:
    assert stops_the_run(err) and not is_slide_error(err)


def test_a_full_disk_under_a_library_error_stops_the_run() -> None:
    err = _wrapped_disk_full()
    assert isinstance(err, RuntimeError) and stops_the_run(err) and not is_slide_error(err)


def test_torch_out_of_memory_stops_the_run() -> None:
    torch = pytest.importorskip("torch")
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert isinstance(err, RuntimeError) and stops_the_run(err)


def test_slide_failures_records_a_slide_error_and_lets_a_bug_through() -> None:
    seen: list[str] = []
    with slide_failures(lambda e: seen.append(describe_failure(e))):
        raise ValueError("slide a: damaged")
    assert seen == ["ValueError: slide a: damaged"]
    with pytest.raises(TypeError, match="a bug"), slide_failures(lambda e: seen.append("recorded")):
        raise TypeError("a bug")
    with pytest.raises(OSError, match="No space"), slide_failures(lambda e: seen.append("recorded")):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert seen == ["ValueError: slide a: damaged"]


def test_the_runner_applies_the_policy_when_no_types_are_listed() -> None:
    """run_slides without ``catch``: each slide error is a failed row, the next slide runs; a bug stops the run."""
    errors: dict[int, BaseException] = {2: _our_slide_errors()[0], 3: FileNotFoundError(2, "No such file", "c.zarr"),
                                        4: EOFError("truncated")}

    def work(item: int, row: dict) -> None:
        if item in errors:
            raise errors[item]
        if item == 9:
            raise AttributeError("'NoneType' object has no attribute 'read'")
        row["error"] = ""

    rows = run_slides([1, 2, 3, 4, 5], work, slide_id=lambda i: f"s{i}", progress=False)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed", "failed", "ok"]
    assert [r["error"] for r in rows[1:4]] == [describe_failure(errors[i]) for i in (2, 3, 4)]
    with pytest.raises(AttributeError, match="no attribute 'read'"):
        run_slides([1, 9, 5], work, slide_id=lambda i: f"s{i}", progress=False)


class _Foreign(ValueError):
    """A library's error class whose constructor takes other arguments than a message."""

    def __init__(self, code: int, path: str) -> None:
        super().__init__(f"code {code} at {path}")


@pytest.mark.parametrize(("err", "kind"), [
    (_Foreign(3, "a.tif"), ValueError),
    (ConfigTypeError("epochs: expected an int"), ConfigTypeError),
    (TypeError("bad"), TypeError),
    (KeyError("x"), KeyError),
    (FileNotFoundError(errno.ENOENT, "No such file", "m.csv"), FileNotFoundError),
    (FileNotFoundError("feature file f.h5 not found"), FileNotFoundError),
    (PermissionError(errno.EACCES, "Permission denied", "/out"), PermissionError),
])
def test_reworded_keeps_the_kind_of_error_and_never_rebuilds_a_foreign_class(err, kind):
    from wsi_pipeline.failures import reworded

    new = reworded(err, f"pipeline.yaml: {err}")
    assert type(new) is kind
    if isinstance(err, OSError) and err.errno is not None:
        assert (new.errno, new.filename) == (err.errno, err.filename) and new.strerror.startswith("pipeline.yaml: ")
    else:
        assert new.args == (f"pipeline.yaml: {err}",)
