"""Lock files that let many tiling runs share one output folder.

A lock is a small JSON file (host, pid, start time, a random token) created atomically with
``O_CREAT | O_EXCL``, which works on local disks and on NFS v3+ shared by many machines. Its
holder refreshes the file's modification time every ``heartbeat_s`` seconds. A lock is
**stale**, and is taken over with a warning in the log, when

- its holder ran on this host and that process is gone (or its pid now belongs to a process
  started later), or
- its file has not been refreshed for ``stale_after_s`` seconds (a holder on another host that
  died, or a hung one; hosts sharing a folder need clocks within a few seconds of each other).

Take-over runs under a second, short-lived ``<name>.takeover`` lock, so of two runs finding the
same stale lock only one wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from wsi_pipeline.slide_ids import slide_output_path

__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "LockInfo", "LockDir", "die_with_parent"]

logger = logging.getLogger(__name__)

#: Seconds between refreshes of a held lock.
HEARTBEAT_S = 30.0
#: Seconds without a refresh after which any lock counts as stale (20 missed heartbeats).
STALE_AFTER_S = 600.0
#: A take-over mutex is held for milliseconds; older than this, its holder died inside it.
_TAKEOVER_STALE_S = 30.0


def _proc_start(pid: int) -> str | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    if start is not None:
        now = _proc_start(pid)
        return now is None or now == start
    return True


@dataclass(frozen=True)
class LockInfo:
    """Who holds a lock: host name, process id, its start (ISO time, UTC) and a random token."""

    host: str
    pid: int
    started: str
    token: str
    pid_start: str | None = None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.started}"


def _me() -> LockInfo:
    return LockInfo(
        socket.gethostname(), os.getpid(), datetime.now(timezone.utc).isoformat(timespec="seconds"),
        secrets.token_hex(8), _proc_start(os.getpid()),
    )


def _read(path: Path) -> LockInfo | None:
    """The lock's holder; None when the file is missing, half written or not a lock."""
    try:
        d = json.loads(path.read_text())
        return LockInfo(str(d["host"]), int(d["pid"]), str(d["started"]), str(d["token"]), d.get("pid_start"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _create(path: Path, info: LockInfo) -> bool:
    """Create ``path`` holding ``info`` if it does not exist (atomically); False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        # no fsync: existence is what locks; a file left empty by a machine crash reads as
        # unreadable and goes stale after stale_after_s like any other
        os.write(fd, json.dumps(info.__dict__).encode())
    except BaseException:
        # a failed write (a full disk) must not leave an empty lock that others wait on until it goes stale
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return True


def _age(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


class LockDir:
    """Named locks in one folder, held by this process, refreshed by a heartbeat thread.

    The heartbeat starts with the first lock taken (:meth:`try_acquire`, :meth:`acquire_wait`) and
    ends when the last is released, so a lock is refreshed for as long as it is held, however long
    the run; using the object as a context manager releases what is still held on leaving.

    Parameters
    ----------
    folder : where the ``<name>.lock`` files live (created).
    stale_after_s : seconds without a refresh after which a lock is stale (default :data:`STALE_AFTER_S`).
    heartbeat_s : seconds between refreshes of the locks this process holds (default :data:`HEARTBEAT_S`,
        at most a quarter of ``stale_after_s``).
    """

    def __init__(self, folder: str | os.PathLike, *, stale_after_s: float | None = None, heartbeat_s: float | None = None) -> None:
        # the module's values when not given, read now (a test may shorten them)
        stale_after_s = STALE_AFTER_S if stale_after_s is None else stale_after_s
        heartbeat_s = min(HEARTBEAT_S, stale_after_s / 4) if heartbeat_s is None else heartbeat_s
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"heartbeat_s={heartbeat_s} must be > 0 and below stale_after_s={stale_after_s}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stale_after_s = float(stale_after_s)
        self.heartbeat_s = float(heartbeat_s)
        self.me = _me()
        self._held: dict[str, Path] = {}
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: list[str] = []

    def path(self, name: str) -> Path:
        """``<folder>/<name>.lock``; ``name`` (a slide id) must be a plain name inside the folder."""
        return slide_output_path(self.folder, name, ".lock")

    def holder(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now (None: free, or a file not yet written)."""
        return _read(self.path(name))

    def held(self, name: str) -> bool:
        return name in self._held

    def stale_reason(self, name: str) -> str | None:
        """Why the existing lock ``name`` is stale, or None when it is live (or absent)."""
        p = self.path(name)
        age = _age(p)
        if age is None:
            return None
        info = _read(p)
        if age > self.stale_after_s:
            who = info.describe() if info else "an unreadable lock file"
            return f"not refreshed for {age:.0f} s (> {self.stale_after_s:g} s; {who})"
        if info is not None and info.host == self.me.host and info.pid != self.me.pid and not _alive(info.pid, info.pid_start):
            return f"its process is gone ({info.describe()})"
        return None

    def try_acquire(self, name: str) -> bool:
        """Take lock ``name`` when it is free or stale; False when another live holder has it."""
        if name in self._held:
            return True
        p = self.path(name)
        if _create(p, self.me):
            self._hold(name, p)
            return True
        reason = self.stale_reason(name)
        if reason is None:
            return False
        judged = _read(p)
        with self._takeover(name) as mine:
            if not mine:
                return False
            if p.exists():
                now = _read(p)
                if (now.token if now else None) != (judged.token if judged else None) or self.stale_reason(name) is None:
                    return False  # changed since we judged it (someone took it over), or live again
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            if not _create(p, self.me):
                return False
        logger.warning("took over the stale lock %s: %s", p, reason)
        self._hold(name, p)
        return True

    def _hold(self, name: str, p: Path) -> None:
        """Record ``name`` as held and make sure the heartbeat runs: no lock is held without it."""
        with self._mutex:
            self._held[name] = p
            if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._beat, args=(self._stop,), name="lock-heartbeat", daemon=True)
                self._thread.start()

    @contextlib.contextmanager
    def _takeover(self, name: str) -> Iterator[bool]:
        m = self.folder / f"{name}.takeover"
        if not _create(m, self.me):
            age = _age(m)
            if age is None or age < _TAKEOVER_STALE_S:
                yield False
                return
            with contextlib.suppress(FileNotFoundError):
                m.unlink()
            if not _create(m, self.me):
                yield False
                return
        try:
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                m.unlink()

    def acquire_wait(self, name: str, timeout_s: float) -> None:
        """Block until ``name`` is held (polling); ``TimeoutError`` naming the holder after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not self.try_acquire(name):
            if time.monotonic() > deadline:
                info = self.holder(name)
                raise TimeoutError(
                    f"lock {self.path(name)} still held after {timeout_s:g} s by "
                    f"{info.describe() if info else 'an unreadable lock file'}; if no such run is alive, delete the file"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def release(self, name: str) -> None:
        """Give up ``name`` (deleting its file only when it is still this process's)."""
        with self._mutex:
            p = self._held.pop(name, None)
            if p is None:
                return
            info = _read(p)
            if info is not None and info.token == self.me.token:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            if not self._held:  # nothing left to refresh: the heartbeat ends (it starts again with the next lock)
                self._stop.set()

    def release_all(self) -> None:
        for name in list(self._held):
            self.release(name)

    def refresh(self) -> None:
        """Heartbeat: refresh every held lock; a lock another run took over is dropped with a warning."""
        for name in list(self._held):
            with self._mutex:  # not while release() removes it
                p = self._held.get(name)
                if p is None:
                    continue
                info = _read(p)
                if info is None or info.token != self.me.token:
                    del self._held[name]
                    self.lost.append(name)
                    if not self._held:
                        self._stop.set()
                    logger.warning(
                        "lock %s was taken over by %s while this run held it (this run was paused for longer than %g s?)",
                        p, info.describe() if info else "another run", self.stale_after_s,
                    )
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.utime(p)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_s):
            try:
                self.refresh()
            except OSError as err:  # a file-system hiccup must not end the heartbeat
                logger.warning("lock heartbeat failed: %s", err)

    def __enter__(self) -> LockDir:
        """``with LockDir(...) as locks``: every lock still held is released on leaving (the heartbeat
        itself runs whenever a lock is held, with or without the block)."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


def die_with_parent() -> None:
    """Linux: have this process killed when its parent dies (a SIGKILLed runner leaves no worker tiling on).

    Without this, a worker orphaned by ``kill -9`` of its runner would go on writing a store
    while the next run, having taken over the runner's stale lock, tiles the same slide.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the runner's lock heartbeat still bounds the damage
        pass
    if os.getppid() == 1:  # the parent died before the call took effect
        os._exit(1)
