"""Plan a slide's tiles before decoding any: mpp, grid, overview, background, and the candidate tiles.

The overview (the slide at tile extent / ``_OVERVIEW_PER_TILE``) gives the background estimate
and serves the tissue detector (:mod:`~wsi_pipeline.tiling.detectors`), tile QC and the QC image.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from wsi_pipeline.slides import read_scaled, resolve_mpp
from wsi_pipeline.slides.base import Slide
from wsi_pipeline.tiling.artifacts import QCOverview, TileQC, grow_ink, ink_mask, qc_overview, slide_qc
from wsi_pipeline.tiling.background import Background, estimate_background
from wsi_pipeline.tiling.density import clean_tissue, stained_mask
from wsi_pipeline.tiling.detectors import DetectorMask, MaskView, detector_for, resample_mask
from wsi_pipeline.tiling.grid import TileGrid, make_grid
from wsi_pipeline.tiling.regions import RegionTiles, read_regions, region_file, region_outlines, region_tiles

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.job import SlideJob

__all__ = ["TilePlan", "plan_tiles"]

logger = logging.getLogger(__name__)

#: Overview pixels per tile side (the overview is the slide at tile extent / 16).
_OVERVIEW_PER_TILE = 16


def _overview_downsample(grid: TileGrid) -> float:
    """Overview downsample in level-0 px per overview px (``_OVERVIEW_PER_TILE`` px per tile side)."""
    return max(1.0, grid.extent / _OVERVIEW_PER_TILE)


@dataclass
class TilePlan:
    """What is known about a slide's tiles before any tile is decoded (:func:`plan_tiles`).

    Attributes
    ----------
    grid : the tile grid.
    mpp, mpp_source : um per level-0 px used and where it came from.
    mpp_note : a report note when that mpp replaces the slide's own ("" otherwise).
    overview : uint8 (H, W, 3), the slide at ``overview_downsample`` level-0 px per px.
    overview_downsample : level-0 px per overview px.
    background : the glass (or dark background) estimate from the overview.
    candidates : bool (rows, cols), the tiles to decode and test (None: a dark-background slide to skip).
    otsu_fg : float32 (rows, cols), each tile's foreground fraction of the detector's mask; None for a detector
        that measures decoded tiles (``greyscale``: then ``grey_band`` is its band).
    grey_band : (grey_min, grey_max in effect) of a detector measuring decoded tiles, else None.
    top_first : bool (rows, cols), candidates that are probably background: their top rows are decoded
        first where the slide allows it (greyscale method with the pre-screen), else None.
    density_info : the stained-tissue density mask's description (computed for the detector or for QC), else None.
    found : the detector's answer (:class:`~wsi_pipeline.tiling.detectors.DetectorMask`; None for a skipped slide).
    qc : tile QC of the grid (None with ``qc_mode="off"``).
    regions : fractions and labels of the grid's tiles in the slide's regions (``regions`` set), else None.
    mask : (bool mask, level-0 px per mask px): the tissue mask whose contours are exported.
    """

    grid: TileGrid
    mpp: float | None
    mpp_source: str
    mpp_note: str
    overview: np.ndarray
    overview_downsample: float
    background: Background
    candidates: np.ndarray | None
    otsu_fg: np.ndarray | None = None
    grey_band: tuple[int, int] | None = None
    top_first: np.ndarray | None = None
    density_info: dict[str, Any] | None = None
    found: DetectorMask | None = None
    qc: TileQC | None = None
    regions: RegionTiles | None = None
    mask: tuple[np.ndarray, float] | None = None

    @property
    def grey_max(self) -> int:
        """The upper grey level a per-tile detector measures (255 for mask detectors: unused)."""
        return self.grey_band[1] if self.grey_band is not None else 255

    @property
    def grey_note(self) -> str:
        """The detector's report note ("" when none)."""
        return self.found.note if self.found is not None else ""


def plan_tiles(slide: Slide, job: SlideJob, config: TilingConfig) -> TilePlan:
    """Plan a slide's tiles: mpp, grid, overview, background, and the candidate tiles (pre-screen).

    Raises :class:`~wsi_pipeline.slides.MissingMppError` when the settings need an mpp the slide lacks.
    """
    detector = detector_for(config)
    needed = f"--mpp-target {config.mpp_target:g}" if config.mpp_target is not None else detector.needs_mpp
    mpp, mpp_source = resolve_mpp(
        slide.mpp, manifest_mpp=job.mpp, run_mpp=config.mpp, force_mpp=config.mpp_force,
        slide_id=job.slide_id, path=str(slide.path), needed_for=needed,
    )
    if mpp_source == "none" and slide.mpp_source.startswith("ignored"):
        mpp_source = slide.mpp_source  # e.g. "ignored-dpi:72": the file had a tag, not a microscope's
    mpp_note = ""
    if mpp is not None and slide.mpp is not None and mpp_source != "slide" and abs(mpp / slide.mpp - 1) > 0.01:
        mpp_note = f"mpp {mpp:g} um/px ({mpp_source}) replaces the slide's own {slide.mpp:g}"
        logger.info("slide %s: %s", job.slide_id, mpp_note)
    grid = make_grid(
        slide.level_dimensions, slide.level_downsamples, tile_size=config.tile_size,
        slide_mpp=mpp, mpp_target=config.mpp_target, tolerance=config.mpp_tolerance,
        exact_levels=slide.exact_levels() if config.mpp_target is not None else None,  # native: level 0 only
    )
    thr = config.threshold
    ds_over = _overview_downsample(grid)
    # the overview is always read: it gives the background estimate (and serves the detector, QC and the QC
    # image); with no cheap level this decodes the tile level twice
    overview = read_scaled(slide, ds_over)
    background = estimate_background(overview)
    plan = TilePlan(grid, mpp, mpp_source, mpp_note, overview, ds_over, background, None)
    if background.is_dark and not config.allow_dark_background:
        return plan
    tissue = ink = qov = None
    if detector.uses_density or config.qc_mode != "off":
        qov = qc_overview(overview, ds_over, mpp, config.qc_params.overview_um)  # ink and folds: a fixed physical scale
        tissue, ink, plan.density_info = _density_mask(overview, ds_over, qov, background, config, grid.extent / ds_over)
    view = MaskView(slide, overview, ds_over, background, mpp, grid, thr, density=tissue, slide_id=job.slide_id)
    found = plan.found = detector.detect(view)
    plan.mask = (found.mask, found.downsample)
    if found.per_tile:  # decoded tiles are measured: the detector says which to decode (default: all)
        candidates = found.candidates if found.candidates is not None else np.ones((grid.rows, grid.cols), bool)
        plan.top_first, plan.grey_band = found.top_first, found.grey_band or (0, 255)
    else:
        plan.otsu_fg = grid.footprint_means(found.mask.astype(np.float32), found.downsample)
        candidates = plan.otsu_fg >= thr - 1e-9
    if config.qc_mode != "off" and qov is not None and tissue is not None and ink is not None and not background.is_dark:
        glass = background.rgb if background.kind == "bright" else None  # brightfield QC; dark slides: none
        plan.qc = slide_qc(qov, ink, tissue, ds_over, glass, grid, config.qc_params, config.qc_mode)
    if config.regions is not None:
        plan.regions = _regions_of(config, config.regions, job.slide_id, grid, candidates)
        candidates = candidates & (plan.regions.fraction >= config.region_min_fraction - 1e-6)
        if plan.top_first is not None:
            plan.top_first &= candidates
    plan.candidates = candidates
    return plan


def _density_mask(overview: np.ndarray, ds_over: float, qov: QCOverview, background: Background, config: TilingConfig,
                  tile_px: float) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(tissue mask, ink mask, description) of the stained-tissue density rule on the overview
    (:mod:`~wsi_pipeline.tiling.density`); ink is found on the QC overview ``qov``, grown into the overview's
    ink-coloured pixels connected to it (:func:`~wsi_pipeline.tiling.artifacts.grow_ink`), and is not tissue."""
    stained, info = stained_mask(overview, background, config.density)
    stained_q = stained if qov.rgb is overview else stained_mask(qov.rgb, background, config.density)[0]
    ink_q, ink_info = ink_mask(qov.rgb, stained_q, um_per_px=qov.um)
    ink = ink_q if qov.rgb is overview else resample_mask(ink_q, qov.downsample, overview.shape[:2], ds_over)
    ink = grow_ink(ink, overview, ink_info["stain_colours"])
    tissue = clean_tissue(stained & ~ink, config.density, tile_px=tile_px) & ~ink
    info.update(ink_info, tissue_fraction=float(tissue.mean()))
    return tissue, ink, info


def _regions_of(config: TilingConfig, regions_path: str, slide_id: str, grid: TileGrid, candidates: np.ndarray) -> RegionTiles:
    """The slide's regions file (of ``regions_path``, a file or a folder) read and measured on the grid's candidate
    tiles (others get fraction 0, label -1)."""
    path = region_file(regions_path, slide_id)
    regions, counts = read_regions(path)
    rows, cols = np.nonzero(candidates)
    frac, label, classes, info = region_tiles(regions, grid.coords(cols, rows), grid.extent,
                                              include=config.region_include, exclude=config.region_exclude)
    fraction = np.zeros((grid.rows, grid.cols), np.float32)
    labels = np.full((grid.rows, grid.cols), -1, np.int16)
    fraction[rows, cols], labels[rows, cols] = frac, label
    info.update(counts, file=str(path), min_fraction=config.region_min_fraction, classes=classes)
    return RegionTiles(fraction, labels, classes, info, outlines=region_outlines(regions))
