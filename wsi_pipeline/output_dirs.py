"""Checking an output folder before any work starts (and the tiler's again when a write fails).

A folder that cannot be created or written (read-only file system, permission denied, a path
that is an existing file, a full disk) is one :class:`OutputDirError` naming the path and the
cause, so the command line prints one line and exits 2 before minutes of compute, instead of
failing at the first write (or failing every slide in turn). Every stage checks its output
folders this way: tiling, training (runs, features), evaluation, features, predict, manifests.
An output that is one of the command's inputs, or lies inside an input folder, is refused the same
way (:func:`check_not_an_input`): a second run would read the first run's outputs as inputs, or the
output would replace the input.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["OutputDirError", "check_not_an_input", "check_output_dir", "check_output_file", "output_problem"]

_HINTS = {
    errno.EROFS: "the file system is read-only; choose a folder on a writable disk",
    errno.EACCES: "permission denied; choose a folder you may write to, or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you may write to, or fix its permissions",
    errno.ENOSPC: "no space left on the device; free space or choose another disk",
    errno.EDQUOT: "disk quota exceeded; free space or choose another disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EEXIST: "a part of the path is a file, not a folder; choose another path",
}


class OutputDirError(ValueError):
    """The output folder cannot be created or written; ``path`` and ``cause`` say which and why."""

    def __init__(self, path: Path, cause: str, what: str = "output folder") -> None:
        super().__init__(f"{what} {path} is not usable: {cause}")
        self.path = path
        self.cause = cause


def _explain(err: OSError) -> str:
    text = err.strerror or str(err)
    hint = _HINTS.get(err.errno or -1)
    where = f" ({err.filename})" if err.filename else ""
    return f"{text}{where}" + (f"; {hint}" if hint else "")


def _probe_write(folder: Path) -> None:
    """Create, write and remove a small file in ``folder`` (what the tiler's writes need); raises OSError."""
    probe = folder / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
    probe.unlink()


def output_problem(out: str | os.PathLike[str], subfolders: tuple[str, ...] = ()) -> str | None:
    """Why ``out`` cannot take the tiler's files, or None when it can (creating it if missing).

    Checks that ``out`` is (or can be made) a folder, that a file can be created, written and
    removed in it, and that each of ``subfolders`` is a folder where it exists.
    """
    p = Path(out)
    if p.exists() and not p.is_dir():
        return "it is an existing file, not a folder; pass a folder path (it is created when missing)"
    blocker = next((q for q in p.parents if q.exists() and not q.is_dir()), None)
    if blocker is not None:
        return f"{blocker} is a file, not a folder; choose another path"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create it: {_explain(err)}"
    try:
        _probe_write(p)
    except OSError as err:
        return f"cannot write in it: {_explain(err)}"
    for sub in subfolders:
        q = p / sub
        if q.exists() and not q.is_dir():
            return f"{q} is a file where a folder is expected; move it away"
    return None


def check_output_dir(out: str | os.PathLike[str], subfolders: tuple[str, ...] = (), *, what: str = "output folder") -> None:
    """Raise :class:`OutputDirError` when :func:`output_problem` finds one (``what`` names the folder's role)."""
    problem = output_problem(out, subfolders)
    if problem is not None:
        raise OutputDirError(Path(out), problem, what)


def check_output_file(path: str | os.PathLike[str], what: str = "output file") -> None:
    """Raise :class:`OutputDirError` when ``path`` cannot be written: its folder fails
    :func:`output_problem`, or ``path`` itself is a folder."""
    p = Path(path)
    if p.is_dir():
        raise OutputDirError(p, "it is a folder; pass a file path", what)
    check_output_dir(p.parent if str(p.parent) else ".", what=f"the folder of {what} {p}:")


def check_not_an_input(out: str | os.PathLike[str], out_flag: str,
                       inputs: dict[str, str | os.PathLike[str] | None]) -> None:
    """Raise :class:`OutputDirError` when output ``out`` (given as ``out_flag``) is one of ``inputs`` (flag -> path;
    None skipped) or lies inside an input folder, compared after resolving links and ``..``; before any work."""
    o = Path(out).resolve()
    for flag, given in inputs.items():
        if given is None:
            continue
        p = Path(given).resolve()
        if o == p:
            raise OutputDirError(Path(out), f"it is the input {flag} {given}, which it would overwrite; choose another "
                                 f"{out_flag}", what=out_flag)
        if p.is_dir() and p in o.parents:
            raise OutputDirError(Path(out), f"it lies inside the input folder {flag} {given}, so its outputs would be "
                                 f"read as inputs on the next run; choose an {out_flag} outside {given}", what=out_flag)
