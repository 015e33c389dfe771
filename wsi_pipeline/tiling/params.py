"""The settings that determine a tile store's content, recorded in the store and compared on resume."""

from __future__ import annotations

from typing import Any

from wsi_pipeline.config.store_settings import StoreSettings
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.tiling.detectors import detector_for

__all__ = ["output_params", "store_settings"]


def store_settings(config: TilingConfig) -> StoreSettings:
    """The settings of ``config`` that determine a store's content (recorded in it; compared on resume).

    The detector records its own settings (:meth:`~wsi_pipeline.tiling.detectors.TissueDetector.settings`; the
    ``unet`` detector its model file's fingerprint, ``FileNotFoundError`` when the file is missing). With tile QC
    on, its mode and thresholds; the stained-tissue density settings when the detector or QC uses them; with
    regions, the selection rule (each slide's regions file is identified per slide,
    :func:`~wsi_pipeline.tiling.identity.store_identity`); with points, the point rule.
    """
    detector = detector_for(config)
    qc = config.qc_mode != "off"
    regions = config.regions is not None
    points = config.points is not None
    return StoreSettings(
        method=config.method, tile_size=int(config.tile_size), min_foreground=config.threshold,
        mpp_target=config.mpp_target, mpp_tolerance=config.mpp_tolerance if config.mpp_target is not None else None,
        compression=config.compression, backend=config.backend,
        qc_mode=config.qc_mode, qc_params=config.qc_params if qc else None,
        tissue=config.density if detector.uses_density or qc else None,
        region_include=tuple(config.region_include) if regions else None,
        region_exclude=tuple(config.region_exclude) if regions else None,
        region_min_fraction=float(config.region_min_fraction) if regions else None,
        points=True if points else None, points_edge=config.points_edge if points else None,
        points_filter=bool(config.points_filter) if points else None,
        detector=detector.settings(),
    )


def output_params(config: TilingConfig) -> dict[str, Any]:
    """:func:`store_settings` as the store records it (:meth:`~wsi_pipeline.config.store_settings.StoreSettings.to_state`)."""
    return store_settings(config).to_state()


