"""Atomic file writes: a file is either the old one or the complete new one, never half written.

Write to a temporary name in the same folder (same file system, so the rename is atomic), then
``os.replace`` it over the destination; on any failure the temporary file is removed and the
destination is left as it was. Every writer of the package goes through :func:`atomic_path`
(whole tile stores, which are folders, are swapped by :mod:`wsi_pipeline.data.store`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "os_error_cause", "temp_path", "write_text_atomic", "write_bytes_atomic"]


def temp_path(path: str | os.PathLike[str], *, suffix: str | None = None) -> Path:
    """The temporary name :func:`atomic_path` writes ``path`` under, in the same folder.

    ``.<name>.tmp-<pid>[-<thread>]<suffix>``: hidden, tells which process left it, and ends with
    ``suffix`` (default: the destination's own suffix, e.g. ``.png``), so writers that pick the
    format from the file name (``np.savez``, ``PIL.Image.save``, ``cv2.imwrite``) write the right one.
    The thread id is added outside the main thread, so two threads never share a temporary file.
    """
    dest = Path(path)
    if suffix is None:
        suffix = dest.suffix
    tag = str(os.getpid())
    if threading.current_thread() is not threading.main_thread():
        tag += f"-{threading.get_ident()}"
    return dest.with_name(f".{dest.name}.tmp-{tag}{suffix}")


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed.

    The parent folder is created. The temporary name is :func:`temp_path`'s (``suffix`` as there).
    A body that leaves no file at the temporary path raises ``FileNotFoundError`` naming it.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest, suffix=suffix)
    try:
        yield tmp
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; return ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def os_error_cause(err: BaseException) -> OSError | None:
    """The ``OSError`` (with an errno) that ``err`` is or was raised while handling, else None.

    Libraries that write through a callback wrap the file system's error in their own: torch's
    zip writer raises ``RuntimeError: [enforce fail at inline_container.cc]`` over the ``ENOSPC``
    of a full disk. Walking ``__cause__`` / ``__context__`` finds the error a user can act on.
    """
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None
