"""Models: tile encoders (ResNet-18/50 with torchvision parameter names, foundation-model ViTs
built with timm) and MIL aggregators.

``build_encoder`` lives in :mod:`wsi_pipeline.models.encoders`, ``build_aggregator`` in
:mod:`wsi_pipeline.models.aggregators`; both are re-exported here lazily so importing one does
not import the other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_encoder", "build_aggregator", "ENCODERS", "AGGREGATORS", "encoder_choices"]

_LAZY = {
    "build_encoder": "wsi_pipeline.models.encoders",
    "ENCODERS": "wsi_pipeline.models.encoders",
    "encoder_choices": "wsi_pipeline.models.encoders",
    "build_aggregator": "wsi_pipeline.models.aggregators",
    "AGGREGATORS": "wsi_pipeline.models.aggregators",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'wsi_pipeline.models' has no attribute {name!r}")
