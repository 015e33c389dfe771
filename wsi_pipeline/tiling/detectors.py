"""Tissue detectors: which tiles of a slide hold tissue, decided before any tile is decoded.

A detector is a :class:`TissueDetector` subclass registered with :func:`register_detector` under the
name ``tile --method`` and ``data.tiling.method`` take. It owns

- its parameters: a frozen :class:`~wsi_pipeline.config.tiling_params.DetectorParams` dataclass (bounds in
  its fields' ``spec``; ``min_foreground`` its default keep threshold; registered in the config layer
  too, so a config file or the command line is checked before any slide is opened);
- its mask: :meth:`TissueDetector.detect` maps a :class:`MaskView` of the slide (its overview, the
  glass estimate, the tile grid, ...) to a :class:`DetectorMask`;
- what it records: :meth:`TissueDetector.settings` (in the store's settings, compared on resume and
  saved with a model) and :meth:`TissueDetector.attrs` (further store attributes).

The built-in detectors: ``tissue`` (optical density against the slide's glass,
:mod:`~wsi_pipeline.tiling.density`), ``greyscale`` (the papers' grey band, measured on each decoded
tile), ``otsu`` (:func:`~wsi_pipeline.tiling.tissue.otsu_tissue_mask`) and ``unet`` (the tissue
U-Net, :mod:`wsi_pipeline.tissue_seg`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from wsi_pipeline.config.tiling_params import (
    DETECTOR_PARAMS, DetectorParams, GreyscaleParams, OtsuParams, TissueParams, UNetParams, register_params,
)
from wsi_pipeline.models.registry import Registry
from wsi_pipeline.tiling.background import auto_grey_max
from wsi_pipeline.tiling.prescreen import likely_background, prescreen_candidates
from wsi_pipeline.tiling.tissue import grey, otsu_tissue_mask

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import TilingConfig
    from wsi_pipeline.slides.base import Slide
    from wsi_pipeline.tiling.background import Background
    from wsi_pipeline.tiling.grid import TileGrid

__all__ = ["DETECTORS", "PAPER_GREY_MAX", "DetectorMask", "MaskView", "TissueDetector", "detector_for", "register_detector"]

logger = logging.getLogger(__name__)

#: The paper's brightest foreground grey, used by ``grey_max="auto"`` when a slide shows no glass.
PAPER_GREY_MAX = 230

P = TypeVar("P", bound=DetectorParams)


@dataclass
class MaskView:
    """What a detector sees of a slide, before any tile is decoded.

    Attributes
    ----------
    slide : the open slide (a detector may read it at its own scale, as ``unet`` does).
    overview : uint8 (H, W, 3), the slide at ``downsample`` level-0 px per px (16 px per tile side).
    downsample : level-0 px per overview px.
    background : the glass (or dark background) estimate of the overview.
    mpp : um per level-0 px, or None when the slide has none (a detector with ``needs_mpp`` always gets one).
    grid : the tile grid.
    threshold : the keep threshold in effect (fraction of a tile).
    density : bool (H, W), the stained-tissue mask of the overview (ink removed) when the detector's
        ``uses_density`` or tile QC asked for it, else None.
    slide_id : for messages.
    """

    slide: Slide
    overview: np.ndarray
    downsample: float
    background: Background
    mpp: float | None
    grid: TileGrid
    threshold: float
    density: np.ndarray | None = None
    slide_id: str = ""


@dataclass
class DetectorMask:
    """A detector's answer for one slide.

    Attributes
    ----------
    mask : bool (h, w), True = tissue (its contours become ``tissue/<slide_id>.geojson``).
    downsample : level-0 px per mask px.
    info : the mask's description, stored as the attribute ``<name>_info`` (None: nothing stored).
    per_tile : the foreground fraction is measured on each decoded tile (``greyscale``) instead of on the
        mask's footprint; then ``candidates`` says which tiles to decode and ``grey_band`` the band measured.
    candidates : bool (rows, cols), the tiles worth decoding (``per_tile`` detectors); None: the tiles whose
        footprint fraction of ``mask`` reaches the threshold.
    top_first : bool (rows, cols), candidates probably background, whose top rows are decoded first, or None.
    grey_band : (grey_min, grey_max) of a ``per_tile`` detector.
    note : a report note ("" when none).
    """

    mask: np.ndarray
    downsample: float
    info: dict[str, Any] | None = None
    per_tile: bool = False
    candidates: np.ndarray | None = None
    top_first: np.ndarray | None = None
    grey_band: tuple[int, int] | None = None
    note: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)


class TissueDetector(ABC, Generic[P]):
    """A tissue detector (see the module's description); ``self.params`` are its parameters.

    Class attributes
    ----------------
    name, Params : set by :func:`register_detector`.
    needs_mpp : why the detector needs the slide's mpp (the error names it), or None.
    uses_density : its mask needs the stained-tissue density mask (:attr:`MaskView.density`).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[DetectorParams]] = DetectorParams
    needs_mpp: ClassVar[str | None] = None
    uses_density: ClassVar[bool] = False

    def __init__(self, params: P) -> None:
        if not isinstance(params, self.Params):
            raise TypeError(f"tissue detector {self.name!r}: expected {self.Params.__name__}, got {type(params).__name__}")
        self.params: P = params

    @abstractmethod
    def detect(self, view: MaskView) -> DetectorMask:
        """The slide's tissue mask (and, for a per-tile detector, the tiles to decode)."""

    def settings(self) -> dict[str, Any]:
        """The detector's settings the store records (compared on resume; saved with a model)."""
        return self.params.recorded()

    def attrs(self, found: DetectorMask) -> dict[str, Any]:
        """Store attributes beyond the settings (by default its parameters as recorded, and what ``detect`` added)."""
        return {**self.params.recorded(), **found.attrs}


#: The tissue detectors by name.
DETECTORS: Registry[type[TissueDetector[Any]]] = Registry("tissue detector")


def register_detector(name: str, params: type[DetectorParams]) -> Callable[[type[TissueDetector[Any]]], type[TissueDetector[Any]]]:
    """Class decorator: register a :class:`TissueDetector` subclass as ``name`` with its parameters ``params``
    (registered in :data:`~wsi_pipeline.config.tiling.DETECTOR_PARAMS` too, unless already there)."""

    def deco(cls: type[TissueDetector[Any]]) -> type[TissueDetector[Any]]:
        if name not in DETECTOR_PARAMS:
            register_params(name)(params)
        elif DETECTOR_PARAMS.get(name) is not params:
            raise ValueError(f"tissue detector {name!r}: parameters {DETECTOR_PARAMS.get(name).__name__} are registered, "
                             f"not {params.__name__}")
        cls.name, cls.Params = name, params
        DETECTORS.register(name)(cls)
        return cls

    return deco


def detector_for(config: TilingConfig) -> TissueDetector[Any]:
    """The detector ``config.method`` names, with ``config.detector`` as its parameters."""
    return DETECTORS.get(config.method)(config.detector)


@register_detector("tissue", TissueParams)
class DensityDetector(TissueDetector[TissueParams]):
    """Stained tissue by optical density against the slide's own glass (:mod:`~wsi_pipeline.tiling.density`)."""

    uses_density = True

    def detect(self, view: MaskView) -> DetectorMask:
        assert view.density is not None  # uses_density
        return DetectorMask(view.density, view.downsample)


@register_detector("otsu", OtsuParams)
class OtsuDetector(TissueDetector[OtsuParams]):
    """Otsu's threshold of the overview (:func:`~wsi_pipeline.tiling.tissue.otsu_tissue_mask`); sizes in um."""

    needs_mpp = "the otsu method (its sizes are in um^2)"

    def detect(self, view: MaskView) -> DetectorMask:
        um = float(view.mpp or 0.0) * view.downsample
        mask, info = otsu_tissue_mask(view.overview, um, self.params, background=view.background)
        return DetectorMask(mask, view.downsample, info)


@register_detector("unet", UNetParams)
class UNetDetector(TissueDetector[UNetParams]):
    """The whole-image tissue U-Net (:mod:`wsi_pipeline.tissue_seg`), kept within the stained area on brightfield."""

    needs_mpp = "the unet method (its model works at a fixed um/px)"
    uses_density = True

    def detect(self, view: MaskView) -> DetectorMask:
        from wsi_pipeline.tissue_seg.tiling_mask import unet_tissue_mask

        bright = view.background.kind == "bright"
        mask, ds_mask, info = unet_tissue_mask(view.slide, float(view.mpp),  # type: ignore[arg-type]  # needs_mpp
                                               self.params.tissue_model, glass_grey=view.background.grey if bright else None)
        if bright and view.density is not None:  # the model never keeps glass: its mask within the stain rule's tissue
            mask = mask & resample_mask(view.density, view.downsample, mask.shape, ds_mask)
            info["tissue_fraction_with_glass_rule"] = float(mask.mean())
        return DetectorMask(mask, ds_mask, info)

    def settings(self) -> dict[str, Any]:
        """The model file's fingerprint (the shipped model when ``tissue_model`` is None; ``FileNotFoundError`` when
        the file is missing)."""
        from wsi_pipeline.slides.fingerprint import slide_fingerprint
        from wsi_pipeline.tissue_seg.tiling_mask import resolve_tissue_model

        return {"tissue_model_fingerprint": slide_fingerprint(resolve_tissue_model(self.params.tissue_model))}


@register_detector("greyscale", GreyscaleParams)
class GreyscaleDetector(TissueDetector[GreyscaleParams]):
    """The papers' rule: the fraction of a decoded tile's pixels with a grey level in ``[grey_min, grey_max]``.

    The overview serves the pre-screen (tiles it proves to be background are not decoded,
    :mod:`~wsi_pipeline.tiling.prescreen`) and ``grey_max="auto"`` (the slide's glass level minus a margin).
    """

    def detect(self, view: MaskView) -> DetectorMask:
        p = self.params
        grey_max, note = self._grey_max(view)
        grid, thr = view.grid, view.threshold
        top_first = None
        if p.prescreen and thr > 0:
            candidates = prescreen_candidates(view.overview, view.downsample, grid, grey_max=grey_max, min_foreground=thr,
                                              margin=p.prescreen_margin)
            top_first = candidates & likely_background(view.overview, view.downsample, grid, grey_min=p.grey_min,
                                                       grey_max=grey_max)
        else:
            candidates = np.ones((grid.rows, grid.cols), bool)
        g = grey(view.overview)
        mask = (g >= p.grey_min) & (g <= grey_max)
        attrs = {"grey_min": int(p.grey_min), "grey_max": int(grey_max), "grey_max_rule": str(p.grey_max),
                 "prescreen": bool(p.prescreen and thr > 0)}
        return DetectorMask(mask, view.downsample, None, per_tile=True, candidates=candidates, top_first=top_first,
                            grey_band=(int(p.grey_min), int(grey_max)), note=note, attrs=attrs)

    def attrs(self, found: DetectorMask) -> dict[str, Any]:
        return dict(found.attrs)  # the band in effect (grey_max "auto" resolved), not the settings

    def _grey_max(self, view: MaskView) -> tuple[int, str]:
        """(grey_max in effect for this slide, a report note or ""); warns when glass counts as foreground."""
        p, background = self.params, view.background
        note = ""
        if p.grey_max == "auto":
            auto = auto_grey_max(background, p.grey_auto_margin)
            grey_max = PAPER_GREY_MAX if auto is None else auto
            if auto is None:
                note = f"grey-max auto: no glass seen on the thumbnail, used {PAPER_GREY_MAX}"
        else:
            grey_max = int(p.grey_max)
        if background.kind == "bright" and background.grey is not None and p.grey_min <= background.grey <= grey_max:
            note = (f"glass grey {background.grey:.0f} lies inside the foreground band [{p.grey_min}, {grey_max}]: "
                    "empty glass counts as foreground; try --grey-max auto")
            logger.warning("slide %s: %s", view.slide_id, note)
        return grey_max, note


def resample_mask(mask: np.ndarray, downsample: float, shape: tuple[int, ...], to_downsample: float) -> np.ndarray:
    """Nearest-neighbour resampling of a mask (``downsample`` level-0 px per px) onto a grid of ``shape`` at
    ``to_downsample`` level-0 px per px (each target px takes the source px under its centre; outside: False)."""
    h, w = shape[:2]
    ys = np.floor((np.arange(h) + 0.5) * to_downsample / downsample).astype(np.int64)
    xs = np.floor((np.arange(w) + 0.5) * to_downsample / downsample).astype(np.int64)
    out = np.zeros((h, w), bool)
    iy, ix = ys < mask.shape[0], xs < mask.shape[1]
    out[np.ix_(iy, ix)] = mask[np.ix_(ys[iy], xs[ix])]
    return out
