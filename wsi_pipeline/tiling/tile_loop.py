"""The tile loop of one slide: decode and test the candidate runs, write the kept tiles in grid order."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from typing import TYPE_CHECKING, Any

import numpy as np

from wsi_pipeline.data.store import StoreWriter
from wsi_pipeline.slides.direct import DirectTiles
from wsi_pipeline.tiling.artifacts import describe, flags_of
from wsi_pipeline.tiling.decode import LevelRead, split_runs, RunResult, decode_run, decode_stored_run, decoded_runs
from wsi_pipeline.tiling.plan import TilePlan
from wsi_pipeline.tiling.prescreen import rows_to_reject
from wsi_pipeline.tiling.writers import BackgroundWriter, InlineWriter

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig

__all__ = ["TileLoop"]


class TileLoop:
    """Decode and test the candidate runs (in ``n_threads`` threads), write the kept tiles in grid order.

    ``budget`` > 1 writes through a writer thread; with several decoding threads these also
    compress the kept tiles. On any error the store is aborted; the direct reader is closed at the end.
    """

    def __init__(self, writer: StoreWriter, plan: TilePlan, config: TilingConfig, read: LevelRead,
                 direct: DirectTiles | None, progress: Callable[[int], None] | None, budget: int, n_threads: int) -> None:
        self.writer, self.plan, self.config, self.read, self.direct = writer, plan, config, read, direct
        self.progress, self.budget, self.n_threads = progress, budget, n_threads
        self.kept_coords: list[np.ndarray] = []
        self.dropped_coords: list[np.ndarray] = []  # tiles QC dropped
        self.dropped_flags: list[np.ndarray] = []
        self.n_kept = 0
        self.reported = 0
        self.test_cpu = 0.0
        self.stored_grid = False
        self.qc_counts: dict[str, Any] | None = None
        self.writer_flags: np.ndarray | None = None  # qc_flags of the kept tiles, store order

    def _tester(self) -> Callable[[int, np.ndarray], RunResult]:
        """``test(row, run)``: stored tiles of exactly the grid's tiles are tested as decoded (no strip copy)."""
        grid, direct, T = self.plan.grid, self.direct, self.plan.grid.tile_size
        stored_grid = self.stored_grid = (direct is not None and not grid.resized and direct.stored_tile_size(grid.level) == (T, T)
                                          and grid.level_step == (float(T), float(T)))
        # with several decoding threads they compress the kept tiles too; the writer thread only writes
        encode = self.writer.tile_encoder if self.n_threads > 1 else None
        config, read, grey_band, otsu_fg, qc = self.config, self.read, self.plan.grey_band or (0, 255), self.plan.otsu_fg, self.plan.qc
        if stored_grid and direct is not None:
            top_rows = rows_to_reject(T, self.config.threshold)
            top_first = self.plan.top_first if top_rows < T else None

            def test_stored(row: int, run: np.ndarray) -> RunResult:
                return decode_stored_run(direct, grid, row, run, config=config, grey_band=grey_band, otsu_fg=otsu_fg,
                                         encode=encode, top_first=top_first, top_rows=top_rows, qc=qc)

            return test_stored

        def test(row: int, run: np.ndarray) -> RunResult:
            return decode_run(read, grid, row, run, config=config, grey_band=grey_band, otsu_fg=otsu_fg, encode=encode, qc=qc)

        return test

    @property
    def candidates(self) -> np.ndarray:
        """The plan's tiles to decode and test (a plan without them, a skipped slide, never gets here)."""
        if self.plan.candidates is None:
            raise ValueError("internal error: the tile loop got a plan without candidates (a slide to skip)")
        return self.plan.candidates

    def run(self) -> None:
        grid, writer = self.plan.grid, self.writer
        main_cpu0 = time.thread_time()
        # a writer thread when there is a second core for it
        sink: BackgroundWriter | InlineWriter = BackgroundWriter(writer) if self.budget > 1 else InlineWriter(writer)
        tasks = [(row, run) for row in range(grid.rows)
                 for run in split_runs(np.flatnonzero(self.candidates[row]), self.config.read_run)]
        try:
            with closing(decoded_runs(tasks, self._tester(), self.n_threads)) as tested:  # closing stops the pool on an error
                self._write(tested, sink)
            sink.close()
            self._finish_store(sink, main_cpu0)
        except BaseException:
            try:
                sink.close()
            except BaseException:
                pass
            writer.abort()
            raise
        finally:
            if self.direct is not None:
                self.direct.close()

    def _write(self, tested: Any, sink: BackgroundWriter | InlineWriter) -> None:
        grid = self.plan.grid
        last_report = time.monotonic()
        for row, run, (tiles, sel, keep, fg, encoded, cpu, qc) in tested:
            self.test_cpu += cpu
            if qc is not None and qc["dropped"].any():
                dc = run[qc["dropped"]]
                self.dropped_coords.append(grid.coords(dc, np.full(len(dc), row)))
                self.dropped_flags.append(qc["dropped_flags"])
            if not keep.any():
                continue
            kc = run[keep]
            coords = grid.coords(kc, np.full(len(kc), row))
            gridxy = np.stack([kc, np.full(len(kc), row)], axis=1).astype(np.int32)
            sink.put(tiles, sel, coords, gridxy, fg[keep], encoded, None if qc is None else {"qc_focus": qc["focus"]})
            self.kept_coords.append(coords)
            self.n_kept += len(kc)
            if self.progress is not None and time.monotonic() - last_report > 0.5:
                self.progress(self.n_kept - self.reported)
                self.reported, last_report = self.n_kept, time.monotonic()

    def _finish_store(self, sink: BackgroundWriter | InlineWriter, main_cpu0: float) -> None:
        """Add each tile's source origin (px of the read level) and the CPU split of the tile pass."""
        grid, writer, n_threads = self.plan.grid, self.writer, self.n_threads
        n = writer.n
        cols, rows = writer.grid[:n, 0].astype(np.int64), writer.grid[:n, 1].astype(np.int64)
        writer.add_array("level_coords", grid.level_coords(cols, rows))
        self._finish_qc(rows, cols)
        # CPU split of the tile pass: decoding + testing (all decoding threads) vs compression + writes
        main_cpu = time.thread_time() - main_cpu0 - (0.0 if isinstance(sink, BackgroundWriter) else sink.cpu_seconds)
        writer.set_attrs({"timing": {
            "main_thread_cpu": round(main_cpu + (self.test_cpu if n_threads > 1 else 0.0), 3),
            "decode_test_cpu": round(self.test_cpu, 3),
            "threads": n_threads,
            "background_write": isinstance(sink, BackgroundWriter),
            "writer_thread_cpu": round(sink.cpu_seconds, 3),
            "n_decoded": int(self.candidates.sum()),
            "stored_tiles_decoded": None if self.direct is None else int(self.direct.decoded),
            "stored_tiles_top_decoded": None if self.direct is None else int(self.direct.decoded_top),
            # each candidate is one stored tile here, decoded whole unless its top rows decided it
            "decided_by_top_rows": (int(self.candidates.sum()) - int(self.direct.decoded)
                                    if self.stored_grid and self.direct is not None else 0),
        }})

    def _finish_qc(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """Per-tile QC and region arrays of the kept tiles (store order), and their summary attributes."""
        plan, writer = self.plan, self.writer
        if plan.qc is not None:
            qc = plan.qc
            if "qc_focus" not in writer.extra:  # no tile kept
                writer.add_array("qc_focus", np.zeros(0, np.float32))
                focus = np.zeros(0, np.float32)
            else:
                focus = np.concatenate(writer.extra["qc_focus"])
            flags = self.writer_flags = qc.flags(rows, cols, focus)
            writer.add_array("qc_flags", flags)
            writer.add_array("qc_pen", qc.pen[rows, cols].astype(np.float32))
            writer.add_array("qc_fold", qc.fold[rows, cols].astype(np.float32))
            dropped = np.concatenate(self.dropped_flags) if self.dropped_flags else np.zeros(0, np.uint8)
            # where QC dropped tiles and why (the viewer outlines them): level-0 (x, y) and qc_flags bits
            writer.add_array("qc_dropped_coords", np.concatenate(self.dropped_coords).astype(np.int64)
                             if self.dropped_coords else np.zeros((0, 2), np.int64))
            writer.add_array("qc_dropped_flags", dropped.astype(np.uint8))
            self.qc_counts = {"flagged": flags_of(flags), "dropped": flags_of(dropped), "n_dropped": int(len(dropped))}
            writer.set_attrs({"qc": {**describe(qc.params, qc.mode), **self.qc_counts}})
        if plan.regions is not None:
            writer.add_array("region_fraction", plan.regions.fraction[rows, cols].astype(np.float32))
            writer.add_array("region_label", plan.regions.label[rows, cols].astype(np.int16))
            writer.set_attrs({"regions": plan.regions.info})

    def flush_progress(self) -> None:
        if self.progress is not None and self.n_kept > self.reported:
            self.progress(self.n_kept - self.reported)
