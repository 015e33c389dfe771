"""wsi-pipeline: whole-slide images to tile stores, end-to-end MIL models, evaluation and heatmaps."""

__all__ = ["__version__"]
__version__ = "0.1.0"
