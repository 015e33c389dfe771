"""The settings that determine a tile store's content, recorded in the store and compared on resume."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from wsi_pipeline.config.tiling import TilingConfig

__all__ = ["output_params"]


def output_params(config: TilingConfig) -> dict[str, Any]:
    """The settings of ``config`` that determine a store's content (compared on resume).

    The ``unet`` method records the fingerprint of its model file (the shipped one when
    ``tissue_model`` is None; ``FileNotFoundError`` when the file is missing). With tile QC on, its
    mode and thresholds; with regions, the selection rule (each slide's regions file is identified
    per slide, :func:`~wsi_pipeline.tiling.identity.store_identity`). ``qc_mode="off"`` records no QC
    key, as stores made before tile QC existed.
    """
    p: dict[str, Any] = {
        "method": config.method,
        "tile_size": int(config.tile_size),
        "min_foreground": config.threshold,
        "mpp_target": config.mpp_target,
        "mpp_tolerance": config.mpp_tolerance if config.mpp_target is not None else None,
        "compression": config.compression,
        "backend": config.backend,
    }
    if config.qc_mode != "off":
        p.update(qc_mode=config.qc_mode, qc_params=asdict(config.qc_params))
    if config.method in ("tissue", "unet") or config.qc_mode != "off":
        p.update(tissue=asdict(config.tissue))
    if config.regions is not None:
        p.update(region_include=list(config.region_include), region_exclude=list(config.region_exclude),
                 region_min_fraction=float(config.region_min_fraction))
    if config.points is not None:
        p.update(points=True, points_edge=config.points_edge, points_filter=bool(config.points_filter))
    if config.method == "greyscale":
        p.update(grey_min=int(config.grey_min), grey_max=config.grey_max if config.grey_max == "auto" else int(config.grey_max))
        if config.grey_max == "auto":
            p.update(grey_auto_margin=int(config.grey_auto_margin))
    elif config.method == "unet":
        from wsi_pipeline.slides.fingerprint import slide_fingerprint
        from wsi_pipeline.tissue_seg.tiling_mask import resolve_tissue_model

        p.update(tissue_model_fingerprint=slide_fingerprint(resolve_tissue_model(config.tissue_model)))
    elif config.method == "otsu":
        p.update(otsu=asdict(config.otsu))
    return p
