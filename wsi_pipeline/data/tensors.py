"""Tiles (uint8 RGB arrays) to normalised float tensors, the one conversion every stage uses.

Stain normalisation happens here too: a slide's :class:`~wsi_pipeline.data.stain_slides.SlideStain`
(``stain=``; the stages pass ``store.stain`` or ``bag.stain``) is applied to the [0, 1] pixels on
the tensors' device before the ImageNet standardisation, so training, validation, feature
extraction, evaluation and prediction all see the same normalised tiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from wsi_pipeline.models.input_norm import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["tiles_to_tensor"]


def tiles_to_tensor(
    tiles: np.ndarray | torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stain: Any = None,
) -> torch.Tensor:
    """Convert uint8 tiles (k, T, T, 3) RGB to a float tensor (k, 3, T, T) normalised with ImageNet statistics.

    ``stain``: the slide's :class:`~wsi_pipeline.data.stain_slides.SlideStain` (None: no stain
    normalisation), applied to the [0, 1] pixels first.

    Values are scaled to [0, 1] and then standardised per channel, the convention of the
    torchvision ResNet weights our encoders can load, and the one input every encoder takes
    (a foundation encoder converts it to its own preset's normalisation and size itself). ``dtype`` defaults to torch's default dtype
    (float32 unless a caller sets ``torch.set_default_dtype``; the numerics tests run in float64).
    """
    dtype = dtype or torch.get_default_dtype()
    t = torch.as_tensor(tiles)
    if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
        raise ValueError(f"tiles must be uint8 (k, T, T, 3); got {t.dtype} {tuple(t.shape)}")
    t = t.to(device=device).permute(0, 3, 1, 2).to(dtype).div_(255.0)
    if stain is not None:
        t = stain.apply(t)
    mean = torch.tensor(IMAGENET_MEAN, dtype=dtype, device=t.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=dtype, device=t.device).view(1, 3, 1, 1)
    return t.sub_(mean).div_(std).contiguous()
