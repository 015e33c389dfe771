"""Writing a slide's kept tiles into its store: in the caller's thread, or in a writer thread."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from wsi_pipeline.data.store import StoreWriter

__all__ = ["BackgroundWriter", "InlineWriter"]


class InlineWriter:
    """Feed :meth:`StoreWriter.append` in the caller's thread (what :class:`BackgroundWriter` runs in its own).

    Used on its own when every core already runs a worker: a second thread per worker would only
    compete with the other workers for the cores.
    """

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.cpu_seconds = 0.0  # CPU time spent in append

    def put(self, tiles: np.ndarray, keep: np.ndarray, coords: np.ndarray, grid: np.ndarray, fg: np.ndarray,
            encoded: list[Any] | None = None, extra: dict[str, np.ndarray] | None = None) -> None:
        """Write ``tiles[keep]`` with their level-0 ``coords``, ``grid`` cells and foreground ``fg`` (already
        selected); ``encoded``: those tiles already encoded (:attr:`StoreWriter.tile_encoder`); ``extra``: more
        per-tile arrays of the kept tiles (:meth:`StoreWriter.append`)."""
        c0 = time.thread_time()
        self.writer.append(tiles if keep.all() else tiles[keep], coords, grid, fg, encoded, extra)
        self.cpu_seconds += time.thread_time() - c0

    def close(self) -> None:
        pass


class BackgroundWriter:
    """Feed :meth:`StoreWriter.append` from a thread; errors surface on the next call.

    Batches arrive as (tiles, keep, coords, grid, foreground) with ``tiles`` possibly a strided
    view of a decoded strip: selecting and copying the kept tiles happens here, off the
    decoding thread.
    """

    def __init__(self, writer: StoreWriter, depth: int = 8) -> None:
        self._inline = InlineWriter(writer)
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self.cpu_seconds = 0.0  # the writer thread's CPU time, set when it ends
        self._thread = threading.Thread(target=self._run, name="tile-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self.cpu_seconds = time.thread_time()
                return
            if self._error is None:
                try:
                    self._inline.put(*item)
                except BaseException as err:  # re-raised in the main thread
                    self._error = err

    def put(self, tiles: np.ndarray, keep: np.ndarray, coords: np.ndarray, grid: np.ndarray, fg: np.ndarray,
            encoded: list[Any] | None = None, extra: dict[str, np.ndarray] | None = None) -> None:
        """Queue ``tiles[keep]`` with their level-0 ``coords``, ``grid`` cells and foreground ``fg`` (already
        selected); ``encoded``: those tiles already encoded; ``extra``: more per-tile arrays of the kept tiles."""
        if self._error is not None:
            raise self._error
        self._q.put((tiles, keep, coords, grid, fg, encoded, extra))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
