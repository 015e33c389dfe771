"""The tiling worker process: receives slide jobs over a pipe, tiles them, reports back.

Kept apart from :mod:`wsi_pipeline.tiling.cohort` so that a freshly spawned worker imports only
what tiling needs (not pandas or the CLI): a worker is ready about 0.4 s sooner.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from wsi_pipeline.tiling.locks import die_with_parent
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.tiler import tile_slide

__all__ = ["worker_main"]


def worker_main(conn: Connection, out_dir: str, config: TilingConfig, overwrite: bool, threads: int) -> None:
    """Receive :class:`~wsi_pipeline.tiling.job.SlideJob` objects until ``None``.

    Sends ``("progress", n_tiles)`` while a slide is tiled and ``("done", SlideResult)`` at its
    end; ``("error", exception)`` and stops for an error that stops the run (a bug, memory). ``threads`` (this worker's share of the cores: decoding threads, plus a writer thread
    when > 1) is passed to :func:`~wsi_pipeline.tiling.tiler.tile_slide`.
    """
    import cv2

    die_with_parent()  # a runner killed with -9 must not leave a worker writing a slide whose lock goes stale
    cv2.setNumThreads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            result = tile_slide(
                job, out_dir, config, overwrite=overwrite, threads=threads,
                progress=lambda n: conn.send(("progress", n)),
            )
        except Exception as err:  # a bug or memory (wsi_pipeline.failures): the parent stops the run with it
            conn.send(("error", _portable(err)))
            return
        conn.send(("done", result))


def _portable(err: Exception) -> Exception:
    """``err`` with the worker's traceback in a note, as the parent can unpickle it (else a RuntimeError)."""
    import pickle
    import traceback

    err.add_note("in the tiling worker process:\n" + "".join(traceback.format_exception(err)).rstrip())
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # any exception that does not survive pickling is sent as text
        return RuntimeError(f"{type(err).__name__}: {err}\n{err.__notes__[-1]}")
    return err
