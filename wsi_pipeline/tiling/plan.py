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
from wsi_pipeline.slides.reader import Slide
from wsi_pipeline.tiling.background import Background, auto_grey_max, estimate_background
from wsi_pipeline.tiling.grid import TileGrid, make_grid
from wsi_pipeline.tiling.prescreen import likely_background, prescreen_candidates
from wsi_pipeline.tiling.tissue import otsu_tissue_mask

if TYPE_CHECKING:
    from wsi_pipeline.tiling.tiler import SlideJob, TilingConfig

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
    if config.method == "otsu":
        mask, plan.otsu_info = otsu_tissue_mask(overview, float(mpp or 0.0) * ds_over, config.otsu, background=background)
        plan.otsu_fg = grid.footprint_means(mask.astype(np.float32), ds_over)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
    elif config.method == "unet":
        from wsi_pipeline.tissue_seg.tiling_mask import unet_tissue_mask

        mask, ds_mask, plan.unet_info = unet_tissue_mask(slide, float(mpp), config.tissue_model)  # type: ignore[arg-type]
        plan.otsu_fg = grid.footprint_means(mask.astype(np.float32), ds_mask)
        plan.candidates = plan.otsu_fg >= thr - 1e-9
    elif config.prescreen and thr > 0:
        plan.candidates = prescreen_candidates(
            overview, ds_over, grid, grey_max=plan.grey_max, min_foreground=thr, margin=config.prescreen_margin
        )
        plan.top_first = plan.candidates & likely_background(overview, ds_over, grid, grey_min=config.grey_min, grey_max=plan.grey_max)
    else:
        plan.candidates = np.ones((grid.rows, grid.cols), bool)
    return plan


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
