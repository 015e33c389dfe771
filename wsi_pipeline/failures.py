"""The bad-slide policy: which errors fail one slide (reported, the run goes on) and which stop the run.

One rule for every per-slide stage (``tile``, ``features``, ``eval``, ``predict``):

- **A slide error fails that slide alone** (:func:`is_slide_error`): its row in the stage's report
  says ``failed`` and why, and the next slide is processed. These are the errors a bad input file
  causes: ``ValueError`` (every error of ours about an input is one: ``SlideOpenError``,
  ``MissingMppError``, ``StoreDamagedError``, ``ChecksumError``, ``ManifestError``, ...; and the
  readers' own, e.g. ``tifffile.TiffFileError``, a ``UnicodeDecodeError``), ``OSError`` (a missing,
  unreadable or truncated file, ``PIL.UnidentifiedImageError``, a lock timeout), ``EOFError``, and
  any error class defined by a library that reads slides, images or stores
  (:data:`READER_LIBRARIES`: ``openslide.OpenSlideError``, the ``imagecodecs`` decoders' errors,
  ``PIL``'s ``DecompressionBombError``, ...).
- **Everything else stops the run** and reaches the command line, which prints it (a bug with its
  traceback): a bug in our code (``TypeError``, ``AttributeError``, ``KeyError``, ``IndexError``,
  ``NameError``, ``AssertionError``, a plain ``RuntimeError``, ...), ``MemoryError`` and torch's
  out-of-memory error (every later slide would need the same memory), a missing optional dependency
  (``ImportError``), an interrupt (``KeyboardInterrupt``, ``SystemExit``), and an ``OSError`` of
  :data:`STOP_ERRNOS` however a library wrapped it (a full disk or quota, a read-only file system:
  every later slide would fail alike; the command prints one line saying what to do).

:class:`ConfigTypeError` is the one ``TypeError`` that is a user's mistake (a wrong-typed config value), so
the command line can print it as one line and every other ``TypeError`` as the bug it is.

:func:`slide_failures` applies the rule around one slide's work. The per-slide job runner
(:func:`wsi_pipeline.jobs.slide_jobs.run_one`, used by ``features``, ``eval`` and ``predict``) and the
tiler (:func:`wsi_pipeline.tiling.tiler.tile_slide`) go through it.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from wsi_pipeline.io_atomic import os_error_cause

__all__ = [
    "READER_LIBRARIES", "STOP_ERRNOS", "ConfigTypeError", "describe_failure", "reworded", "disk_unwritable", "is_slide_error", "slide_failures",
    "stops_the_run",
]

class ConfigTypeError(TypeError):
    """A value of the wrong type in a user's config (YAML, ``--set``, a method's options): a user error that the
    command line prints as one line, unlike a ``TypeError`` from our code (a bug, printed with its traceback)."""


def reworded(err: Exception, message: str) -> Exception:
    """A new error saying ``message`` about ``err``, to ``raise reworded(err, msg) from err``: of the nearest
    class of ``err`` this project can build with a message alone, so whoever catches it still sees what kind
    of error it is, while a library's class with another constructor is never rebuilt. That class is
    :class:`ConfigTypeError` or the nearest built-in one (``ValueError``, ``TypeError``, ``KeyError``, ...);
    an ``OSError`` keeps its ``errno`` and ``filename`` (``OSError(errno, ...)`` picks the subclass of the
    errno, e.g. ``FileNotFoundError``)."""
    if isinstance(err, OSError) and err.errno is not None:
        return OSError(err.errno, message, err.filename)
    for cls in type(err).__mro__:
        if cls is ConfigTypeError or (cls.__module__ == "builtins" and issubclass(cls, Exception)):
            return cls(message)
    return RuntimeError(message)  # unreachable: every Exception has a built-in base


#: OSError numbers that stop a run at once instead of failing each remaining slide in turn.
STOP_ERRNOS: tuple[int, ...] = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

#: Top-level modules of the libraries that read slides, images and stores: an error class of theirs
#: (not a built-in one they raise) is about the file being read.
READER_LIBRARIES: frozenset[str] = frozenset({
    "openslide", "tiffslide", "tifffile", "imagecodecs", "PIL", "cv2", "zarr", "numcodecs", "h5py", "wsidicom",
    "pydicom", "cucim",
})

#: Built-in types that are about the input, never about our code.
_SLIDE_ERROR_TYPES: tuple[type[BaseException], ...] = (ValueError, OSError, EOFError)


def disk_unwritable(err: BaseException) -> bool:
    """True for a full disk or quota or a read-only file system (an ``OSError`` of :data:`STOP_ERRNOS`), also
    when a library raised its own error while handling it (torch's zip writer's ``RuntimeError``)."""
    cause = os_error_cause(err)
    return cause is not None and cause.errno in STOP_ERRNOS


def stops_the_run(err: BaseException) -> bool:
    """True for an error that must stop the whole run whatever its type: an interrupt, running out of
    memory (``MemoryError``, torch's ``OutOfMemoryError``) or a full disk or quota or a read-only file
    system (an ``OSError`` of :data:`STOP_ERRNOS`, also when a library raised its own error over it)."""
    if not isinstance(err, Exception) or isinstance(err, MemoryError):
        return True
    if type(err).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (a RuntimeError), CUDA or MPS
        return True
    return disk_unwritable(err)


def is_slide_error(err: BaseException) -> bool:
    """True when ``err`` fails the slide being processed and the run goes on; False when it stops the run
    (see the module's rule: a bug, memory, a full disk, an interrupt)."""
    if stops_the_run(err):
        return False
    if isinstance(err, _SLIDE_ERROR_TYPES):
        return True
    return type(err).__module__.split(".")[0] in READER_LIBRARIES


def describe_failure(err: BaseException) -> str:
    """A failed slide's ``error`` column: ``"<Type>: <message>"``."""
    return f"{type(err).__name__}: {err}"


@contextmanager
def slide_failures(on_failure: Callable[[BaseException], None]) -> Iterator[None]:
    """Run one slide's work under the policy: a slide error (:func:`is_slide_error`) is handed to
    ``on_failure`` (which records it in the stage's report) and goes no further; any other error propagates
    and stops the run.

    Example::

        with slide_failures(lambda err: row.update(status="failed", error=describe_failure(err))):
            work(slide)
    """
    try:
        yield
    except Exception as err:
        if not is_slide_error(err):
            raise
        on_failure(err)
