"""Plan a slide's tiles before decoding any: mpp, grid, overview, background, and the candidate tiles.

The overview (the slide at tile extent / ``_OVERVIEW_PER_TILE``) gives the background estimate
and serves the pre-screen, the tissue masks (Otsu, U-Net) and the QC image.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from wsi_pipeline.slides import read_scaled, resolve_mpp
from wsi_pipeline.slides.base import Slide
from wsi_pipeline.tiling.artifacts import QCOverview, TileQC, grow_ink, ink_mask, qc_overview, slide_qc
from wsi_pipeline.tiling.background import Background, auto_grey_max, estimate_background
from wsi_pipeline.tiling.density import clean_tissue, stained_mask
from wsi_pipeline.tiling.grid import TileGrid, make_grid
from wsi_pipeline.tiling.prescreen import likely_background, prescreen_candidates
from wsi_pipeline.tiling.regions import RegionTiles, read_regions, region_file, region_outlines, region_tiles
from wsi_pipeline.tiling.tissue import grey, otsu_tissue_mask

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.tiling.job import SlideJob

__all__ = ["PAPER_GREY_MAX", "TilePlan", "plan_tiles"]

logger = logging.getLogger(__name__)

#: Overview pixels per tile side (the overview is the slide at tile extent / 16).
_OVERVIEW_PER_TILE = 16
#: The paper's brightest foreground grey, used by ``grey_max="auto"`` when a slide shows no glass.
PAPER_GREY_MAX = 230


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
    grey_max : the greyscale rule's upper grey level in effect; ``grey_note`` a report note or "".
    candidates : bool (rows, cols), the tiles to decode and test (None: a dark-background slide to skip).
    otsu_fg : float32 (rows, cols) tissue-mask foreground fractions (otsu and unet methods), else None.
    otsu_info : the Otsu mask's description (otsu method), else None.
    unet_info : the U-Net mask's description (unet method), else None.
    top_first : bool (rows, cols), candidates that are probably background: their top rows are decoded
        first where the slide allows it (greyscale method with the pre-screen), else None.
    tissue_info : the ``tissue`` method's mask description (also computed for QC), else None.
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
    grey_max: int
    grey_note: str
    candidates: np.ndarray | None
    otsu_fg: np.ndarray | None = None
    otsu_info: dict[str, Any] | None = None
    unet_info: dict[str, Any] | None = None
    top_first: np.ndarray | None = None
    tissue_info: dict[str, Any] | None = None
    qc: TileQC | None = None
    regions: RegionTiles | None = None
    mask: tuple[np.ndarray, float] | None = None


def plan_tiles(slide: Slide, job: SlideJob, config: TilingConfig) -> TilePlan:
    """Plan a slide's tiles: mpp, grid, overview, background, and the candidate tiles (pre-screen).

    Raises :class:`~wsi_pipeline.slides.MissingMppError` when the settings need an mpp the slide lacks.
    """
    needed = None
    if config.mpp_target is not None:
        needed = f"--mpp-target {config.mpp_target:g}"
    elif config.method == "otsu":
        needed = "the otsu method (its sizes are in um^2)"
    elif config.method == "unet":
        needed = "the unet method (its model works at a fixed um/px)"
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
    # the overview is always read: it gives the background estimate (and serves the pre-screen,
    # the Otsu mask and the QC image); with no cheap level this decodes the tile level twice
    overview = read_scaled(slide, ds_over)
    background = estimate_background(overview)
    plan = TilePlan(grid, mpp, mpp_source, mpp_note, overview, ds_over, background, 0, "", None)
    if background.is_dark and not config.allow_dark_background:
        return plan
    plan.grey_max, plan.grey_note = _grey_max_for(config, background, job.slide_id)
    tissue = None
    if config.method in ("tissue", "unet") or config.qc_mode != "off":
        qov = qc_overview(overview, ds_over, mpp, config.qc_params.overview_um)  # ink and folds: a fixed physical scale
        tissue, ink, plan.tissue_info = _density_mask(overview, ds_over, qov, background, config, grid.extent / ds_over)
    if config.method == "tissue":
        plan.otsu_fg = grid.footprint_means(tissue.astype(np.float32), ds_over)  # type: ignore[union-attr]
        plan.candidates = plan.otsu_fg >= thr - 1e-9
        plan.mask = (tissue, ds_over)  # type: ignore[assignment]
    elif config.method == "otsu":
        mask, plan.otsu_info = otsu_tissue_mask(overview, float(mpp or 0.0) * ds_over, config.otsu, background=background)
        plan.otsu_fg = grid.footprint_means(mask.astype(np.float32), ds_over)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
        plan.mask = (mask, ds_over)
    elif config.method == "unet":
        from wsi_pipeline.tissue_seg.tiling_mask import unet_tissue_mask

        glass_grey = background.grey if background.kind == "bright" else None
        mask, ds_mask, plan.unet_info = unet_tissue_mask(slide, float(mpp), config.tissue_model, glass_grey=glass_grey)
        if background.kind == "bright":  # the model never keeps glass: its mask within the stain rule's tissue
            mask = mask & _resample(tissue, ds_over, mask.shape, ds_mask)
            plan.unet_info["tissue_fraction_with_glass_rule"] = float(mask.mean())
        plan.otsu_fg = grid.footprint_means(mask.astype(np.float32), ds_mask)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
        plan.mask = (mask, ds_mask)
    else:
        if config.prescreen and thr > 0:
            plan.candidates = prescreen_candidates(
                overview, ds_over, grid, grey_max=plan.grey_max, min_foreground=thr, margin=config.prescreen_margin
            )
            plan.top_first = plan.candidates & likely_background(overview, ds_over, grid, grey_min=config.grey_min, grey_max=plan.grey_max)
        else:
            plan.candidates = np.ones((grid.rows, grid.cols), bool)
        g = grey(overview)
        plan.mask = ((g >= config.grey_min) & (g <= plan.grey_max), ds_over)
    if config.qc_mode != "off" and tissue is not None and not background.is_dark:  # brightfield QC; dark slides: none
        glass = background.rgb if background.kind == "bright" else None
        plan.qc = slide_qc(qov, ink, tissue, ds_over, glass, grid, config.qc_params, config.qc_mode)
    if config.regions is not None:
        plan.regions = _regions_of(config, job.slide_id, grid, plan.candidates)
        plan.candidates = plan.candidates & (plan.regions.fraction >= config.region_min_fraction - 1e-6)
        if plan.top_first is not None:
            plan.top_first &= plan.candidates
    return plan


def _resample(mask: np.ndarray, downsample: float, shape: tuple[int, int], to_downsample: float) -> np.ndarray:
    """Nearest-neighbour resampling of a mask (``downsample`` level-0 px per px) onto a grid of ``shape`` at
    ``to_downsample`` level-0 px per px (each target px takes the source px under its centre; outside: False)."""
    h, w = shape
    ys = np.floor((np.arange(h) + 0.5) * to_downsample / downsample).astype(np.int64)
    xs = np.floor((np.arange(w) + 0.5) * to_downsample / downsample).astype(np.int64)
    out = np.zeros(shape, bool)
    iy, ix = ys < mask.shape[0], xs < mask.shape[1]
    out[np.ix_(iy, ix)] = mask[np.ix_(ys[iy], xs[ix])]
    return out


def _density_mask(overview: np.ndarray, ds_over: float, qov: QCOverview, background: Background, config: TilingConfig,
                  tile_px: float) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(tissue mask, ink mask, description) of the ``tissue`` method on the overview
    (:mod:`~wsi_pipeline.tiling.density`); ink is found on the QC overview ``qov``, grown into the overview's
    ink-coloured pixels connected to it (:func:`~wsi_pipeline.tiling.artifacts.grow_ink`), and is not tissue."""
    stained, info = stained_mask(overview, background, config.tissue)
    stained_q = stained if qov.rgb is overview else stained_mask(qov.rgb, background, config.tissue)[0]
    ink_q, ink_info = ink_mask(qov.rgb, stained_q, um_per_px=qov.um)
    ink = ink_q if qov.rgb is overview else _resample(ink_q, qov.downsample, overview.shape[:2], ds_over)
    ink = grow_ink(ink, overview, ink_info["stain_colours"])
    tissue = clean_tissue(stained & ~ink, config.tissue, tile_px=tile_px) & ~ink
    info.update(ink_info, tissue_fraction=float(tissue.mean()))
    return tissue, ink, info


def _regions_of(config: TilingConfig, slide_id: str, grid: TileGrid, candidates: np.ndarray) -> RegionTiles:
    """The slide's regions file read and measured on the grid's candidate tiles (others get fraction 0, label -1)."""
    path = region_file(config.regions, slide_id)
    regions, counts = read_regions(path)
    rows, cols = np.nonzero(candidates)
    frac, label, classes, info = region_tiles(regions, grid.coords(cols, rows), grid.extent,
                                              include=config.region_include, exclude=config.region_exclude)
    fraction = np.zeros((grid.rows, grid.cols), np.float32)
    labels = np.full((grid.rows, grid.cols), -1, np.int16)
    fraction[rows, cols], labels[rows, cols] = frac, label
    info.update(counts, file=str(path), min_fraction=config.region_min_fraction, classes=classes)
    return RegionTiles(fraction, labels, classes, info, outlines=region_outlines(regions))


def _grey_max_for(config: TilingConfig, background: Background, slide_id: str) -> tuple[int, str]:
    """(grey_max in effect for this slide, a report note or ""); warns when glass counts as foreground."""
    note = ""
    if config.grey_max == "auto":
        auto = auto_grey_max(background, config.grey_auto_margin)
        grey_max = PAPER_GREY_MAX if auto is None else auto
        if auto is None and config.method == "greyscale":
            note = f"grey-max auto: no glass seen on the thumbnail, used {PAPER_GREY_MAX}"
    else:
        grey_max = int(config.grey_max)
    if config.method == "greyscale" and background.kind == "bright" and background.grey is not None:
        if config.grey_min <= background.grey <= grey_max:
            note = (
                f"glass grey {background.grey:.0f} lies inside the foreground band [{config.grey_min}, {grey_max}]: "
                "empty glass counts as foreground; try --grey-max auto"
            )
            logger.warning("slide %s: %s", slide_id, note)
    return grey_max, note
