"""The pipeline's one input convention for encoders: RGB / 255, then ImageNet mean and std per channel.

:func:`wsi_pipeline.data.tensors.tiles_to_tensor` produces it; encoders that were trained with
another normalisation convert from it themselves (:class:`wsi_pipeline.models.foundation.FoundationEncoder`).
"""

from __future__ import annotations

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
