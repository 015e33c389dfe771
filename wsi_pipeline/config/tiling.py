"""The tiler's settings: :class:`TilingConfig`, and :func:`tiler_config`, the one bridge from recorded or expected
settings (:class:`~wsi_pipeline.config.store_settings.StoreSettings`, also ``data.tiling``) to a tiler config.

The parameter classes of the detectors and of tile QC are in :mod:`wsi_pipeline.config.tiling_params`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import BACKENDS, COMPRESSIONS, POINT_EDGES, QC_MODES, TILING_METHODS, PointEdge, QCMode
from wsi_pipeline.config.limits import MAX_CHUNK_TILES, MAX_COUNT, MAX_TILE_SIZE
from wsi_pipeline.config.schema import Checked, build, spec
from wsi_pipeline.config.store_settings import StoreSettings
from wsi_pipeline.config.tiling_params import (
    DEFAULT_REGION_EXCLUDE, DETECTOR_PARAMS, MIN_TILE_SIZE, QCParams, TissueParams, detector_names,
)
from wsi_pipeline.data.codecs import DEFAULT_SHARD_TILES

__all__ = ["DEFAULT_MIN_FOREGROUND", "TilingConfig", "tiler_config"]

#: The built-in detectors' default keep thresholds (fraction of the tile); ``DetectorParams.min_foreground``.
DEFAULT_MIN_FOREGROUND: dict[str, float] = {n: DETECTOR_PARAMS.get(n).min_foreground for n in TILING_METHODS}


@dataclass(frozen=True)
class TilingConfig(Checked):
    """Tiling settings (all lengths in px at the tile resolution unless stated).

    Attributes
    ----------
    method : the tissue detector (:func:`detector_names`): ``"tissue"`` (the default: optical density against each
        slide's glass, any stain, any glass level; :mod:`wsi_pipeline.tiling.density`), ``"greyscale"`` (the
        paper's 3..230 band), ``"otsu"`` or ``"unet"`` (mask of the tissue U-Net, :mod:`wsi_pipeline.tissue_seg`).
    detector : the detector's parameters (its :class:`DetectorParams` subclass: :class:`TissueParams`,
        :class:`GreyscaleParams`, :class:`OtsuParams`, :class:`UNetParams`; a mapping of its fields is built into
        it); None = its defaults.
    tile_size : T (>= :data:`MIN_TILE_SIZE`).
    min_foreground : keep a tile when its foreground fraction is at least this; None = the detector's default
        (greyscale 0.6, tissue, otsu and unet 0.5).
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
    qc : write ``qc/<slide_id>.png``.
    read_run : most tiles read by one level read (one task of the decoding threads).
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

    method: str = field(default=TILING_METHODS[0], metadata=spec(choices=detector_names))
    detector: Any = None
    tile_size: int = field(default=256, metadata=spec(ge=MIN_TILE_SIZE, le=MAX_TILE_SIZE))
    min_foreground: float | None = field(default=None, metadata=spec(ge=0.0, le=1.0))
    allow_dark_background: bool = False
    mpp_target: float | None = field(default=None, metadata=spec(gt=0.0))
    mpp_tolerance: float = field(default=0.05, metadata=spec(ge=0.0))
    mpp: float | None = field(default=None, metadata=spec(gt=0.0))
    mpp_force: float | None = field(default=None, metadata=spec(gt=0.0))
    compression: str = field(default="zstd", metadata=spec(choices=COMPRESSIONS))
    shard_tiles: int = field(default=DEFAULT_SHARD_TILES, metadata=spec(ge=0, le=MAX_COUNT))
    backend: str = field(default="auto", metadata=spec(choices=BACKENDS))
    qc: bool = True
    read_run: int = field(default=32, metadata=spec(ge=1, le=MAX_CHUNK_TILES))
    qc_mode: QCMode = field(default="drop", metadata=spec(choices=QC_MODES))
    qc_params: QCParams = field(default_factory=QCParams)
    regions: str | None = None
    region_include: tuple[str, ...] = ()
    region_exclude: tuple[str, ...] = DEFAULT_REGION_EXCLUDE
    region_min_fraction: float = field(default=0.5, metadata=spec(ge=0.0, le=1.0))
    points: str | None = None
    points_edge: PointEdge = field(default="pad", metadata=spec(choices=POINT_EDGES))
    points_filter: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        params_cls = DETECTOR_PARAMS.get(self.method)
        if self.detector is None:
            object.__setattr__(self, "detector", params_cls())
        elif isinstance(self.detector, Mapping):
            object.__setattr__(self, "detector", build(params_cls, self.detector, f"{self.method} detector"))
        elif type(self.detector) is not params_cls:
            raise TypeError(f"detector={type(self.detector).__name__}(...) with method={self.method!r}; expected "
                            f"{params_cls.__name__} (the {self.method!r} detector's parameters) or None")
        for name in ("mpp_target", "mpp", "mpp_force"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name}={v} must be a positive number of um/px")
        if self.mpp is not None and self.mpp_force is not None:
            raise ValueError(
                f"mpp={self.mpp} and mpp_force={self.mpp_force}: give --mpp (fills in slides without an mpp) "
                "or --mpp-force (overrides every slide's), not both"
            )
        if self.points is not None and self.mpp_target is not None:
            raise ValueError(f"points={self.points!r} with mpp_target={self.mpp_target}: point tiles are cut at the native "
                             "resolution (level 0); leave out --mpp-target")
        if self.points is not None and self.regions is not None:
            raise ValueError(f"points={self.points!r} with regions={self.regions!r}: give one of them (points choose the "
                             "tiles themselves)")

    @property
    def threshold(self) -> float:
        """The keep threshold in effect."""
        return float(self.detector.min_foreground) if self.min_foreground is None else float(self.min_foreground)

    @property
    def density(self) -> TissueParams:
        """The stained-tissue density settings tile QC (and the ``unet`` detector's glass rule) use: the ``tissue``
        detector's parameters when it is the detector, else the defaults."""
        return self.detector if isinstance(self.detector, TissueParams) else TissueParams()


def tiler_config(settings: StoreSettings | Mapping[str, Any] | None, mpp: float | None = None) -> TilingConfig:
    """The tiler config that reproduces ``settings``: recorded settings (a mapping: a store's or a checkpoint's, read
    through :meth:`~wsi_pipeline.config.store_settings.StoreSettings.from_state`) or a ``StoreSettings``
    (``data.tiling``); fields left empty take the tiler's defaults (None: every field). ``mpp`` (um per level-0 px)
    becomes the run-wide fallback ``mpp``.

    A store records how its tiles were made, not where they were written or how they were compressed, so
    ``backend`` and ``compression`` are never taken from ``settings``; nor ``regions`` or ``points`` files
    (annotations belong to their own slides).
    """
    if settings is None:
        settings = StoreSettings()
    elif isinstance(settings, Mapping):
        settings = StoreSettings.from_state(settings)
    kw: dict[str, Any] = {}
    for name in ("method", "tile_size", "min_foreground", "mpp_target", "mpp_tolerance", "qc_mode", "qc_params",
                 "region_include", "region_exclude", "region_min_fraction", "points_edge", "points_filter"):
        if getattr(settings, name) is not None:
            kw[name] = getattr(settings, name)
    kw["detector"] = DETECTOR_PARAMS.get(settings.method or TILING_METHODS[0]).from_recorded(settings.detector_state())
    if mpp is not None:
        kw["mpp"] = float(mpp)
    return TilingConfig(**kw)
