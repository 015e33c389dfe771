"""Tiling settings: the tiler's :class:`TilingConfig` (with :class:`OtsuParams`), the pipeline's
``data.tiling`` section (:class:`StoreTiling`, the same field names, all optional) and the one
bridge from either, or from a store's recorded settings, to a tiler config (:func:`tiler_config`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import (
    BACKENDS, COMPRESSIONS, POINT_EDGES, QC_ARTIFACTS, QC_MODES, TILING_METHODS, PointEdge, QCMode, TilingMethod,
)
from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.data.codecs import DEFAULT_SHARD_TILES

__all__ = [
    "DEFAULT_MIN_FOREGROUND", "DEFAULT_REGION_EXCLUDE", "OtsuParams", "QCParams", "StoreTiling", "TilingConfig",
    "TissueParams", "tiler_config",
]

#: Foreground methods and their default keep thresholds (fraction of the tile).
DEFAULT_MIN_FOREGROUND: dict[str, float] = dict(zip(TILING_METHODS, (0.5, 0.6, 0.5, 0.5), strict=True))
#: QuPath classifications whose regions exclude tiles by default (QuPath's own "Ignore*" class among them).
DEFAULT_REGION_EXCLUDE: tuple[str, ...] = ("Ignore*", "Exclude", "Excluded", "Background")


@dataclass(frozen=True)
class TissueParams(Checked):
    """The ``tissue`` method (:mod:`wsi_pipeline.tiling.density`): stained tissue by optical density
    against each slide's own glass. Sizes are in overview px (the overview has 16 px per tile side).

    Attributes
    ----------
    min_od : an overview pixel is tissue when, in some RGB channel, its optical density
        ``log10(glass / value)`` reaches this (0.03: 6.7 % of the light absorbed; on the
        generated fields glass stays under 0.015 and the palest tissue over 0.05).
    glass_margin_od : the threshold is at least the glass pixels' 99.9th percentile plus this
        (an unevenly lit slide raises it).
    min_object : tissue components smaller than this fraction of a tile's area are dropped (dust).
    max_hole : holes smaller than this fraction of a tile's area are filled.
    """

    min_od: float = 0.03
    glass_margin_od: float = 0.01
    min_object: float = 0.05
    max_hole: float = 0.1


@dataclass(frozen=True)
class QCParams(Checked):
    """Tile artifact QC (:mod:`wsi_pipeline.tiling.artifacts`): thresholds and what ``--qc drop`` drops.

    Attributes
    ----------
    drop : artifacts dropped by ``qc_mode="drop"`` (the others are only flagged).
    pen_fraction : a tile is ``pen`` when at least this fraction of it is ink (green, blue, red
        or black marker, by colour on the overview).
    focus_min : a tile is ``blur`` when its focus measure (:func:`~wsi_pipeline.tiling.artifacts.focus_measure`)
        is below this and it holds stained tissue.
    fold_fraction : a tile is ``fold`` when at least this fraction of it is folded tissue (a
        double layer: optical density at least ``fold_od_ratio`` times the slide's median tissue
        density, in the same colour direction).
    fold_od_ratio : see ``fold_fraction``.
    fold_min_area_um2 : folded regions smaller than this (um^2) are not folds (a fold runs along the section).
    overview_um : um per pixel of the overview ink and folds are judged on (at least: a coarser tiler overview
        is used as it is); a fixed physical scale, so the verdict does not depend on the tile size or the
        magnification. Slides without an mpp are taken to be at 0.5 um/px.
    """

    drop: tuple[str, ...] = ("pen", "blur")
    pen_fraction: float = 0.1
    focus_min: float = 0.12
    fold_fraction: float = 0.25
    fold_od_ratio: float = 2.5
    fold_min_area_um2: float = 20_000.0
    overview_um: float = 16.0


@dataclass(frozen=True)
class OtsuParams(Checked):
    """Otsu tissue-mask settings; sizes in um / um^2 (independent of the mask resolution).

    Attributes
    ----------
    median_um : median-blur kernel width.
    closing_um : radius of the disk used for morphological closing.
    min_object_um2 : tissue components smaller than this are removed.
    min_hole_um2 : holes smaller than this are filled.
    min_contrast : levels (0..255) below which the image is taken as uniform (a blank slide),
        no tissue: on a bright background with glass, between the upper Otsu class's mean and
        the glass's median; otherwise between the two Otsu class means.
    glass_margin : levels (0..255) of the thresholded channel above the glass's 99th
        percentile at which a pixel is tissue even when Otsu's threshold is higher.
    background : ``"auto"`` (dark when :func:`~wsi_pipeline.tiling.background.estimate_background`
        says so), ``"bright"`` (brightfield) or ``"dark"`` (fluorescence).
    channel : what Otsu thresholds. ``"auto"``: on a bright background the HSV saturation
        (stained tissue, pale stroma included, against grey-white glass, as CLAM does); on a
        dark background the brightest channel (a DAPI-blue nucleus has faint luma).
        ``"grey"``: luma, tissue darker than the threshold (bright) or brighter (dark).
    """

    median_um: float = 30.0
    closing_um: float = 30.0
    min_object_um2: float = 10_000.0
    min_hole_um2: float = 10_000.0
    min_contrast: float = 15.0
    glass_margin: float = 20.0
    background: str = "auto"
    channel: str = "auto"


@dataclass(frozen=True)
class TilingConfig(Checked):
    """Tiling settings (all lengths in px at the tile resolution unless stated).

    Attributes
    ----------
    method : ``"tissue"`` (the default: optical density against each slide's glass, any stain, any
        glass level; :mod:`wsi_pipeline.tiling.density`), ``"greyscale"`` (the paper's 3..230 band),
        ``"otsu"`` or ``"unet"`` (mask of the tissue U-Net, :mod:`wsi_pipeline.tissue_seg`).
    tile_size : T.
    min_foreground : keep a tile when its foreground fraction is at least this; None = the
        method's default (greyscale 0.6, tissue, otsu and unet 0.5).
    grey_min, grey_max : inclusive grey range of a foreground pixel (greyscale method);
        ``grey_max="auto"``: each slide's glass grey level (estimated from its thumbnail,
        :mod:`wsi_pipeline.tiling.background`) minus ``grey_auto_margin``, or 230 when the
        slide shows no glass.
    grey_auto_margin : grey levels between the glass level and ``grey_max="auto"`` (10: on
        CMU-1, 0.06 % of level-0 glass pixels lie 10 or more levels below the glass level).
    allow_dark_background : tile slides whose background is dark (fluorescence) with these
        brightfield rules; by default they are ``skipped`` with the note ``DARK_NOTE``.
    mpp_target : um per tile px, or None for native level 0.
    mpp_tolerance : relative mpp difference within which a pyramid level is used without resizing.
    mpp : run-wide fallback mpp (um per level-0 px, ``--mpp``) for slides with no mpp of their own
        (neither in their metadata nor in the manifest).
    mpp_force : run-wide mpp (``--mpp-force``) used for every slide, over the slides' metadata
        and the manifest; at most one of ``mpp`` and ``mpp_force``.
    compression : tile compression, one of ``zstd`` (lossless), ``jpeg`` (lossy), ``none``.
    shard_tiles : tiles per shard file of the store (zarr v3 sharding); 0 = one file per tile.
        The layout does not change a store's content, so it is not compared on resume.
    backend : slide reader, ``auto``, ``openslide`` or ``tiffslide``.
    prescreen : skip tiles the low-resolution bound proves to be background, and decide tiles that are
        probably glass from their top rows first where the stored tiles are JPEG (greyscale only;
        the kept set is unchanged).
    prescreen_margin : grey levels of slack in that bound.
    otsu : :class:`OtsuParams`.
    qc : write ``qc/<slide_id>.png``.
    tissue_model : ``unet`` method: the model file (``best.pt`` of ``wsi-pipeline tissue train``); None = the shipped one.
    read_run : most tiles read by one level read (one task of the decoding threads).
    tissue : :class:`TissueParams` (``tissue`` method).
    qc_mode : tile artifact QC: ``"drop"`` (drop the artifacts in ``qc_params.drop``, flag the
        rest), ``"flag"`` (record every artifact, drop none) or ``"off"``.
    qc_params : :class:`QCParams`.
    regions : a QuPath GeoJSON file, or a folder of ``<slide_id>.geojson`` files: keep only tiles
        inside include regions and outside exclude regions (:mod:`wsi_pipeline.tiling.regions`).
    region_include : classification names whose regions include tiles (``*`` wildcards); empty =
        every region not excluded.
    region_exclude : classification names whose regions exclude tiles.
    region_min_fraction : keep a tile when at least this fraction of it lies inside the included,
        not excluded area.
    points : a points file (CSV ``slide_id,x,y[,class]``) or a folder of ``<slide_id>.csv`` /
        ``<slide_id>.geojson`` files: one tile centred on each point instead of the grid
        (:mod:`wsi_pipeline.tiling.points`); level 0 only (no ``mpp_target``).
    points_edge : a point tile crossing the image edge: ``"pad"`` with the slide's glass colour
        (default) or ``"skip"`` (left out and counted).
    points_filter : apply the foreground rule (``method``, ``min_foreground``) to point tiles; by
        default (False) every point inside the image keeps its tile (the foreground fraction is
        still stored). Tile QC (pen, blur, fold) is never applied to point tiles.
    """

    method: str = TILING_METHODS[0]
    tile_size: int = 256
    min_foreground: float | None = None
    grey_min: int = 3
    grey_max: int | str = 230
    grey_auto_margin: int = 10
    allow_dark_background: bool = False
    mpp_target: float | None = None
    mpp_tolerance: float = 0.05
    mpp: float | None = None
    mpp_force: float | None = None
    compression: str = "zstd"
    shard_tiles: int = DEFAULT_SHARD_TILES
    backend: str = "auto"
    prescreen: bool = True
    prescreen_margin: float = 8.0
    otsu: OtsuParams = field(default_factory=OtsuParams)
    qc: bool = True
    read_run: int = 32
    tissue_model: str | None = None
    tissue: TissueParams = field(default_factory=TissueParams)
    qc_mode: str = "drop"
    qc_params: QCParams = field(default_factory=QCParams)
    regions: str | None = None
    region_include: tuple[str, ...] = ()
    region_exclude: tuple[str, ...] = DEFAULT_REGION_EXCLUDE
    region_min_fraction: float = 0.5
    points: str | None = None
    points_edge: str = "pad"
    points_filter: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in TILING_METHODS:
            raise ValueError(f"method={self.method!r}; expected one of {sorted(TILING_METHODS)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}; expected one of {COMPRESSIONS}")
        if int(self.shard_tiles) < 0:
            raise ValueError(f"shard_tiles={self.shard_tiles}; expected tiles per shard >= 1, or 0 for one file per tile")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")
        if int(self.tile_size) < 8:
            raise ValueError(f"tile_size={self.tile_size} px is too small; use >= 8 (256 is the default)")
        if isinstance(self.grey_max, str):
            if self.grey_max != "auto":
                raise ValueError(f"grey_max={self.grey_max!r}; expected a grey level 0..255 or 'auto'")
            if not 0 <= self.grey_min <= 255 or not 0 <= self.grey_auto_margin <= 255:
                raise ValueError(f"grey_min={self.grey_min} and grey_auto_margin={self.grey_auto_margin} must be in [0, 255]")
        elif not 0 <= self.grey_min <= self.grey_max <= 255:
            raise ValueError(f"grey range [{self.grey_min}, {self.grey_max}] must satisfy 0 <= grey_min <= grey_max <= 255")
        if self.min_foreground is not None and not 0 <= self.min_foreground <= 1:
            raise ValueError(f"min_foreground={self.min_foreground} must be a fraction in [0, 1]")
        for name in ("mpp_target", "mpp", "mpp_force"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v} must be a positive number of um/px")
        if self.mpp is not None and self.mpp_force is not None:
            raise ValueError(
                f"mpp={self.mpp} and mpp_force={self.mpp_force}: give --mpp (fills in slides without an mpp) "
                "or --mpp-force (overrides every slide's), not both"
            )
        if self.read_run < 1:
            raise ValueError(f"read_run={self.read_run} must be >= 1")
        if self.qc_mode not in QC_MODES:
            raise ValueError(f"qc_mode={self.qc_mode!r}; expected one of {QC_MODES}")
        bad = [a for a in self.qc_params.drop if a not in QC_ARTIFACTS]
        if bad:
            raise ValueError(f"qc_params.drop={self.qc_params.drop!r}: unknown artifact(s) {bad}; expected some of {QC_ARTIFACTS}")
        if not 0 <= self.region_min_fraction <= 1:
            raise ValueError(f"region_min_fraction={self.region_min_fraction} must be a fraction in [0, 1]")
        if self.points_edge not in POINT_EDGES:
            raise ValueError(f"points_edge={self.points_edge!r}; expected one of {POINT_EDGES}")
        if self.points is not None and self.mpp_target is not None:
            raise ValueError(f"points={self.points!r} with mpp_target={self.mpp_target}: point tiles are cut at the native "
                             "resolution (level 0); leave out --mpp-target")
        if self.points is not None and self.regions is not None:
            raise ValueError(f"points={self.points!r} with regions={self.regions!r}: give one of them (points choose the "
                             "tiles themselves)")

    @property
    def threshold(self) -> float:
        """The keep threshold in effect."""
        return DEFAULT_MIN_FOREGROUND[self.method] if self.min_foreground is None else float(self.min_foreground)


def _grey_max_value(value: Any, where: str) -> int | str | None:
    """``data.tiling.grey_max``: a grey level 0..255 or ``"auto"``."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"{where}: expected a grey level 0..255 or 'auto', got {value!r}")
    return int(value)


@dataclass(frozen=True)
class StoreTiling(Checked):
    """The ``data.tiling`` section: what the pipeline expects of its tile stores; every field is optional.

    The fields are :class:`TilingConfig`'s of the same names. The stores record the settings that
    made them; training checks that all its stores agree, and with each field given here, and
    saves the stores' settings in the checkpoint, so ``predict`` tiles new slides exactly as the
    training data was tiled. A field left empty (None) is taken from the stores.

    Attributes
    ----------
    method : tissue-detection method of the tiler.
    tile_size : tile side in px at the read resolution.
    min_foreground : keep a tile at >= this foreground fraction (0..1).
    mpp_target : read resolution in um/px.
    qc_mode : tile artifact QC of the tiler (``drop``, ``flag``, ``off``); the paper pipelines and the
        demo set ``off`` (the papers' tiles).
    grey_min, grey_max : the greyscale method's grey band (``grey_max``: a level or ``"auto"``).
    points, points_edge, points_filter : tiles centred on given points (``tile --points``): the
        points file or folder (relative to the current directory), the edge rule and whether the
        foreground rule applies. ``tile --config`` uses them; ``predict`` tiles new slides on the grid.
    """

    method: TilingMethod | None = None
    tile_size: int | None = field(default=None, metadata=spec(gt=0))
    min_foreground: float | None = field(default=None, metadata=spec(ge=0.0, le=1.0))
    mpp_target: float | None = field(default=None, metadata=spec(gt=0))
    qc_mode: QCMode | None = None
    grey_min: int | None = field(default=None, metadata=spec(ge=0, le=255))
    grey_max: int | str | None = field(default=None, metadata=spec(parse=_grey_max_value))
    points: str | None = None
    points_edge: PointEdge | None = None
    points_filter: bool | None = None


def tiler_config(settings: StoreTiling | Mapping[str, Any] | None, mpp: float | None = None) -> TilingConfig:
    """The tiler config that reproduces ``settings``: a store's recorded settings (a mapping, as a
    checkpoint saves them) or a :class:`StoreTiling` section; fields it leaves empty take the
    tiler's defaults. ``mpp`` (um per level-0 px) becomes the run-wide fallback ``mpp``.

    A store records how its tiles were made, not where they were written or how they were
    compressed, so ``backend``, ``compression`` and ``mpp`` are never taken from ``settings``; nor
    ``regions`` or ``points`` (annotations belong to their own slides).
    """
    if settings is None:
        raw: dict[str, Any] = {}
    elif isinstance(settings, Mapping):
        raw = dict(settings)
        if raw.get("method") and "qc_mode" not in raw:
            raw["qc_mode"] = "off"  # recorded before tile QC existed: its stores were made without it
    else:
        raw = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    # regions are drawn per slide: a new slide has none of the training slides' annotations
    names = {f.name for f in dataclasses.fields(TilingConfig)} - {"mpp", "backend", "compression", "regions", "points"}
    kw = {k: v for k, v in raw.items() if k in names and v is not None}
    if not kw.get("method"):
        kw.pop("method", None)
    for key, cls in (("otsu", OtsuParams), ("tissue", TissueParams), ("qc_params", QCParams)):
        if isinstance(kw.get(key), Mapping):
            kw[key] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw[key].items()})
    for key in ("region_include", "region_exclude"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    if mpp is not None:
        kw["mpp"] = float(mpp)
    return TilingConfig(**kw)
