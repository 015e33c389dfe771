"""Tile one slide: open, plan the grid, find foreground tiles, write the zarr store and QC image.

The slide is decoded once: a low-resolution overview (the background estimate, the
pre-screen, the Otsu mask and the QC thumbnail all come from it) and then only the candidate
tiles, read in runs along each row. A slide with no pyramid level coarse enough for the
overview is decoded twice (the overview, then the candidates). Slides whose background is dark
(fluorescence) are skipped unless ``allow_dark_background``.

Candidate tiles are read from the slide's stored tiles directly
(:class:`~wsi_pipeline.slides.direct.DirectTiles`, bit-equal to OpenSlide, each stored tile decoded
once) wherever that reader serves the read level, otherwise with :meth:`Slide.read_level`. With
``threads`` > 1 the runs are decoded, tested and their kept tiles compressed in a pool of threads
(libjpeg-turbo, OpenSlide, OpenCV and zstd release the GIL) while a writer thread writes them in
grid order, so one slide uses every core it is given; the store does not depend on the thread count.

The steps live in their own modules: :mod:`~wsi_pipeline.tiling.identity` (is a store current),
:mod:`~wsi_pipeline.tiling.plan` (mpp, grid, overview, candidates), :mod:`~wsi_pipeline.tiling.decode`
(runs of tiles, threads), :mod:`~wsi_pipeline.tiling.tile_loop` (the loop writing the kept tiles),
:mod:`~wsi_pipeline.tiling.writers` (the store writer thread); this module
holds :func:`tile_slide`. The settings are :class:`~wsi_pipeline.config.tiling.TilingConfig`, the job
and result types are in :mod:`~wsi_pipeline.tiling.job`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

import wsi_pipeline
from wsi_pipeline.failures import describe_failure, disk_unwritable, is_slide_error
from wsi_pipeline.slides import MissingMppError, open_slide, slide_fingerprint
from wsi_pipeline.slides.direct import DirectTiles
from wsi_pipeline.slides.truncation import check_complete, unreadable_reason
from wsi_pipeline.slides.base import Slide
from wsi_pipeline.tiling.artifacts import qc_loss_note
from wsi_pipeline.tiling.detectors import detector_for
from wsi_pipeline.tiling.decode import IN_FLIGHT_PER_THREAD, available_cores, level_source
from wsi_pipeline.tiling.identity import clean_stale, stat_key, store_identity, store_matches, valid_mpp
from wsi_pipeline.tiling.job import DARK_NOTE, SlideJob, SlideResult
from wsi_pipeline.tiling.plan import TilePlan, plan_tiles
from wsi_pipeline.tiling.qc import qc_path, render_qc, write_png
from wsi_pipeline.tiling.tile_loop import TileLoop
from wsi_pipeline.data.store import StoreWriter, store_bytes, store_path
from wsi_pipeline.config.tiling import TilingConfig

__all__ = ["precheck", "tile_slide"]

logger = logging.getLogger(__name__)

def tile_slide(
    job: SlideJob,
    out_dir: str | os.PathLike,
    config: TilingConfig,
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    background_write: bool = True,
    threads: int | None = None,
) -> SlideResult:
    """Tile one slide into ``<out_dir>/<slide_id>.zarr``; never raises for a bad slide.

    Parameters
    ----------
    job : the slide.
    out_dir : the tiles folder.
    config : :class:`TilingConfig`.
    overwrite : rebuild even when a matching complete store exists.
    progress : called with the number of tiles kept since the previous call.
    background_write : compress and write tiles in a second thread, overlapping decoding (worth
        it when a core is free for it); False also means one thread in all.
    threads : threads decoding, testing and (when > 1) compressing tiles, plus one writing them;
        None = the cores this process may use (:func:`available_cores`). The runner gives each of
        its worker processes its share of the cores. The store does not depend on it.

    Returns
    -------
    :class:`SlideResult` with status ``ok`` (store written), ``skipped`` (a complete store
    with the same slide fingerprint and settings exists, or a dark-background slide: note
    ``DARK_NOTE``, no store) or ``failed`` (``error`` says why).
    """
    t0 = time.perf_counter()
    c0 = time.process_time()
    out = Path(out_dir)
    res = SlideResult(job.slide_id, "failed", path=str(job.path))
    try:
        early = precheck(job, out, config, overwrite=overwrite)
        if early is not None:
            return early
        path = Path(job.path)
        identity = store_identity(job, config, slide_fingerprint(path) if path.is_file() else "")
        out.mkdir(parents=True, exist_ok=True)
        clean_stale(out, job.slide_id)
        check_complete(path)  # a copy cut short is refused by name, even where the pieces tiled would read whole
        with open_slide(path, config.backend) as slide:
            res.n_tiles, res.mpp, res.note = _tile_open_slide(
                slide, job, out, config, identity, progress, background_write, res, threads=threads
            )
        res.status = "skipped" if res.note.startswith(DARK_NOTE) else "ok"
    except MissingMppError as err:
        res.error, res.mpp_source = str(err), "none"
    except Exception as err:  # a bad slide is a report row (wsi_pipeline.failures); a bug stops the run
        if not (is_slide_error(err) or disk_unwritable(err)):
            raise
        # a full disk is a row too: the cohort runner stops the run on it (also for a worker process's row, by its text);
        # a slide file cut short is called truncated, not by the reader's error deep inside it
        res.error = describe_failure(err) if disk_unwritable(err) else unreadable_reason(Path(job.path) if job.path else None, err)
        logger.debug("slide %s failed", job.slide_id, exc_info=True)
    finally:
        res.seconds = round(time.perf_counter() - t0, 3)
        res.cpu_seconds = round(time.process_time() - c0, 3)
    return res


def precheck(job: SlideJob, out_dir: str | os.PathLike, config: TilingConfig, *, overwrite: bool = False) -> SlideResult | None:
    """The result of ``job`` when it is known without opening the slide, else None.

    ``skipped`` when a complete store from the same slide file (fingerprint) and settings
    exists; ``failed`` for a listing problem or a missing file. Cheap: hashes 1 MiB of the slide.
    """
    t0 = time.perf_counter()
    res = SlideResult(job.slide_id, "failed", path=str(job.path))
    try:
        if job.problem:
            raise ValueError(job.problem)
        if not job.path:
            raise ValueError(f"slide {job.slide_id!r} has no path; fill the manifest's `path` column")
        path = Path(job.path)
        if not path.exists():
            raise FileNotFoundError(f"slide file not found: {path}; fix the path or remove the row/file")
        if overwrite or not path.is_file():
            return None
        attrs = store_matches(store_path(out_dir, job.slide_id), job, config)
        if attrs is None:
            return None
        res.status, res.n_tiles, res.mpp = "skipped", int(attrs.get("n_tiles", 0)), attrs.get("mpp")
        res.store_bytes, res.slide_bytes = store_bytes(attrs), path.stat().st_size
        res.background_grey = (attrs.get("background") or {}).get("grey")
        res.slide_mpp, res.mpp_source = attrs.get("slide_mpp"), str(attrs.get("mpp_source", ""))
        res.note = "complete store from the same slide and settings exists"
    except (ValueError, OSError) as err:
        res.error = f"{type(err).__name__}: {err}"
    res.seconds = round(time.perf_counter() - t0, 3)
    return res


def _tile_open_slide(
    slide: Slide,
    job: SlideJob,
    out: Path,
    config: TilingConfig,
    identity: dict[str, Any],
    progress: Callable[[int], None] | None,
    background_write: bool = True,
    res: SlideResult | None = None,
    *,
    threads: int | None = None,
) -> tuple[int, float | None, str]:
    """Tile an open slide; returns (tiles kept, um per tile px, note); fills ``res``'s mpp columns.

    Plan the tiles, choose how the read level is decoded, open the store, run the tile loop,
    mark the store complete, then write the QC image.
    """
    plan = plan_tiles(slide, job, config)
    grid, background = plan.grid, plan.background
    if res is not None:
        res.slide_mpp, res.mpp_source, res.background_grey = plan.mpp, plan.mpp_source, background.grey
    if plan.candidates is None:
        logger.warning("slide %s: dark background (grey %.0f), fluorescence? skipped; --allow-dark-background tiles it",
                       job.slide_id, background.grey)
        return 0, grid.mpp, f"{DARK_NOTE}; background grey {background.grey:.0f}; --allow-dark-background tiles it anyway"
    if config.points is not None:
        return _tile_points(slide, job, out, config, identity, plan, progress, res)
    budget = 1 if not background_write else max(1, int(threads) if threads is not None else available_cores())
    read, direct, thread_safe = level_source(slide, grid, IN_FLIGHT_PER_THREAD * budget)
    n_threads = budget if thread_safe else 1  # threads decoding and testing
    try:
        writer = StoreWriter(
            store_path(out, job.slide_id), tile_size=grid.tile_size, capacity=max(1, int(plan.candidates.sum())),
            attrs=_store_attrs(slide, job, config, plan, identity, direct), compression=config.compression,
            shard_tiles=config.shard_tiles,
        )
    except BaseException:
        if direct is not None:
            direct.close()
        raise
    loop = TileLoop(writer, plan, config, read, direct, progress, budget, n_threads)
    loop.run()
    try:
        writer.commit()
    except BaseException:  # a full disk, a folder in the way: remove the temporary store, keep the old one
        writer.abort()
        raise
    loop.flush_progress()
    if res is not None:
        res.store_bytes = writer.bytes_written
        res.slide_bytes = Path(job.path).stat().st_size
    note = _slide_note(loop.n_kept, plan)
    if loop.qc_counts is not None:
        loss = qc_loss_note(job.slide_id, loop.qc_counts, loop.n_kept, config.qc_params.drop)
        note = (note + "; " if note and loss else note) + loss
    if res is not None and loop.qc_counts is not None:
        res.qc_dropped = loop.qc_counts["n_dropped"]
        for name in ("pen", "blur", "fold"):
            setattr(res, f"qc_{name}", loop.qc_counts["flagged"][name] + loop.qc_counts["dropped"][name])
    note = _write_side_outputs(out, job, plan, writer, note)
    if config.qc:
        note = _write_qc(out, job, plan, loop, note)
    return loop.n_kept, grid.mpp, note


def _tile_points(slide: Slide, job: SlideJob, out: Path, config: TilingConfig, identity: dict[str, Any], plan: TilePlan,
                 progress: Callable[[int], None] | None, res: SlideResult | None) -> tuple[int, float | None, str]:
    """Tile an open slide on its points (:mod:`~wsi_pipeline.tiling.points`): one level-0 tile per point, in
    file order; returns (tiles kept, um per tile px, note)."""
    from wsi_pipeline.tiling.points import class_codes, describe_points, mask_fraction, point_origins, read_points
    from wsi_pipeline.tiling.tissue import tiles_foreground

    T = int(config.tile_size)
    pts = read_points(config.points, job.slide_id)  # type: ignore[arg-type]  # set: the caller checked
    where = point_origins(pts.xy, T, slide.dimensions, config.points_edge)
    tiles = np.empty((len(where.index), T, T, 3), np.uint8)
    for i, (x, y) in enumerate(where.origins.tolist()):  # the glass colour outside the image (Slide.read_level)
        tiles[i] = slide.read_level(0, (x, y), (T, T))
    if plan.grey_band is not None or plan.mask is None:  # a detector measuring decoded tiles
        fg = tiles_foreground(tiles, *(plan.grey_band or (0, 255)))
    else:  # the detector's tissue mask over each tile's footprint
        fg = mask_fraction(plan.mask[0], plan.mask[1], where.origins, T)
    keep = fg >= config.threshold - 1e-9 if config.points_filter else np.ones(len(tiles), bool)
    codes, names = class_codes(pts.classes)
    info = describe_points(pts, where, config.points_edge, int((~keep).sum()), not config.points_filter)
    attrs = _store_attrs(slide, job, config, plan, identity, None)
    attrs.update(points=info, point_classes=names, n_candidates=int(len(where.index)), tile_origin="points")
    writer = StoreWriter(store_path(out, job.slide_id), tile_size=T, capacity=max(1, int(keep.sum())), attrs=attrs,
                         compression=config.compression, shard_tiles=config.shard_tiles)
    try:
        writer.append(np.ascontiguousarray(tiles[keep]), where.origins[keep], where.grid[keep], fg[keep])
        writer.add_array("point_class", codes[where.index][keep])
        writer.add_array("point_xy", pts.xy[where.index][keep])
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    n = int(keep.sum())
    if progress is not None:
        progress(n)
    if res is not None:
        res.store_bytes = writer.bytes_written
        res.slide_bytes = Path(job.path).stat().st_size
    parts = [f"points: {n} of {info['n_points']} tiled"]
    for key, what in (("n_outside", "outside the image"), ("n_edge_skipped", "skipped at the edge"),
                      ("n_padded", "padded at the edge"), ("n_filtered", "below the foreground rule")):
        if info[key]:
            parts.append(f"{info[key]} {what}")
    note = ", ".join(parts)
    if plan.mpp_note:
        note += "; " + plan.mpp_note
    if config.qc:
        try:
            img = render_qc(plan.overview, plan.overview_downsample, where.origins[keep], float(T), legend=f"point tiles {n}")
            write_png(qc_path(out, job.slide_id), img)
        except Exception as err:  # the store is complete; a QC failure is only noted
            logger.warning("QC image for %s failed: %s", job.slide_id, err)
            note += f"; QC image failed: {err}"
    return n, plan.grid.mpp, note


def _store_attrs(slide: Slide, job: SlideJob, config: TilingConfig, plan: TilePlan, identity: dict[str, Any],
                 direct: DirectTiles | None) -> dict[str, Any]:
    """The store's attributes: the slide, where its mpp came from, the grid, the settings and the identity."""
    grid = plan.grid
    detector = detector_for(config)
    attrs_extra: dict[str, Any] = {} if plan.density_info is None else {"tissue_info": plan.density_info}
    if plan.found is not None:
        if plan.found.info is not None:
            attrs_extra[f"{config.method}_info"] = plan.found.info
        attrs_extra.update(detector.attrs(plan.found))
    attrs = {
        "slide_id": job.slide_id,
        "slide_path": str(Path(slide.path).resolve()),
        "slide_fingerprint": identity["fingerprint"],
        "slide_stat": stat_key(Path(slide.path)),
        "slide_dimensions": list(slide.dimensions),
        "slide_mpp": plan.mpp,
        "mpp_source": plan.mpp_source,
        "metadata_mpp": slide.mpp,
        "metadata_mpp_source": slide.mpp_source,
        "manifest_mpp": valid_mpp(job.mpp),
        "backend": slide.backend,
        "level_reader": slide.level_reader(grid.level),
        "tile_decoder": "direct" if direct is not None else "read_level",
        **grid.describe(),
        "method": config.method,
        "min_foreground": config.threshold,
        "compression": config.compression,
        "package_version": wsi_pipeline.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tiling_identity": identity,
        "n_candidates": int(plan.candidates.sum()),  # type: ignore[union-attr]  # a dark slide has no store
        "background": plan.background.as_dict(),
        **attrs_extra,
    }
    return attrs


def _slide_note(n_kept: int, plan: TilePlan) -> str:
    """The report note: no tiles kept, the grey-max rule's note, an mpp that replaced the slide's own."""
    note = "" if n_kept else "no foreground tiles (blank slide, or thresholds too strict for it)"
    if plan.grey_note:
        note = f"{note}; {plan.grey_note}" if note else plan.grey_note
    if plan.mpp_note:
        note = (note + "; " if note else "") + plan.mpp_note
    return note


def _write_side_outputs(out: Path, job: SlideJob, plan: TilePlan, writer: StoreWriter, note: str) -> str:
    """The tissue contours (``tissue/<slide_id>.geojson``) and, with regions, the tiles' region labels
    (``regions/<slide_id>.csv``); the store is complete already, so a failure only adds to the note."""
    from wsi_pipeline.tiling.regions import write_region_csv, write_tissue_geojson

    try:
        if plan.mask is not None:
            write_tissue_geojson(out / "tissue" / f"{job.slide_id}.geojson", plan.mask[0], plan.mask[1])
        if plan.regions is not None:
            n = writer.n
            cols, rows = writer.grid[:n, 0].astype(np.int64), writer.grid[:n, 1].astype(np.int64)
            write_region_csv(out / "regions" / f"{job.slide_id}.csv", writer.coords[:n], plan.regions.fraction[rows, cols],
                             plan.regions.label[rows, cols], plan.regions.classes)
    except Exception as err:  # the store is complete; a side output failing is only noted
        logger.warning("contours/regions of %s failed: %s", job.slide_id, err)
        note = (note + "; " if note else "") + f"contours/regions export failed: {err}"
    return note


def _write_qc(out: Path, job: SlideJob, plan: TilePlan, loop: TileLoop, note: str) -> str:
    """Write ``qc/<slide_id>.png`` (kept tiles green, kept but flagged orange, dropped by QC red); the store
    is complete already, so a failure only adds to the note."""
    try:
        kept = np.concatenate(loop.kept_coords) if loop.kept_coords else np.zeros((0, 2), np.int64)
        groups: list[tuple[np.ndarray, tuple[int, int, int]]] = []
        legend = f"kept {loop.n_kept}"
        if plan.qc is not None and loop.qc_counts is not None:
            flags = loop.writer_flags if loop.writer_flags is not None else np.zeros(len(kept), np.uint8)
            flagged = flags != 0
            dropped = np.concatenate(loop.dropped_coords) if loop.dropped_coords else np.zeros((0, 2), np.int64)
            groups = [(kept[flagged], (255, 140, 0)), (dropped, (220, 0, 0))]
            kept = kept[~flagged]
            c = loop.qc_counts
            legend += (f" | flagged {int(flagged.sum())} | QC dropped {c['n_dropped']} (" +
                       ", ".join(f"{k} {c['flagged'][k] + c['dropped'][k]}" for k in c["flagged"]) + ")")
        outlines = plan.regions.outlines if plan.regions is not None else []
        if outlines:
            legend += f" | regions outlined blue ({len(outlines)})"
        img = render_qc(plan.overview, plan.overview_downsample, kept, plan.grid.extent, others=groups, legend=legend,
                        outlines=outlines)
        write_png(qc_path(out, job.slide_id), img)
    except Exception as err:  # the store is complete; a QC failure is only noted
        logger.warning("QC image for %s failed: %s", job.slide_id, err)
        note = (note + "; " if note else "") + f"QC image failed: {err}"
    return note
