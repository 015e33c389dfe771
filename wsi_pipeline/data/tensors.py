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

__all__ = ["DeviceTiles", "tiles_to_tensor"]


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


class DeviceTiles:
    """A bag's uint8 tiles, turned into the encoder's input on ``device`` one slice at a time.

    ``tiles`` is the uint8 ``(k, T, T, 3)`` tensor (on the host, pinned where CUDA is the device, or
    already on the device); ``x[a:b]`` is :func:`tiles_to_tensor` of ``tiles[a:b]`` on ``device``
    (``stain`` applied), float ``(b - a, 3, T, T)``. Exact accumulation slices a bag chunk by chunk,
    twice per chunk: the bytes that cross the bus are uint8 (a quarter of float32's), and the
    conversion runs where it is cheap. Values equal :func:`tiles_to_tensor` of the whole bag.
    """

    def __init__(self, tiles: torch.Tensor, device: torch.device | str, *, stain: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        if tiles.dtype != torch.uint8 or tiles.ndim != 4 or tiles.shape[-1] != 3:
            raise ValueError(f"tiles must be uint8 (k, T, T, 3); got {tiles.dtype} {tuple(tiles.shape)}")
        self.tiles = tiles
        self.device = torch.device(device)
        self.stain = stain
        self.dtype = dtype or torch.get_default_dtype()

    @property
    def shape(self) -> torch.Size:
        """``(k, 3, T, T)``, the shape of the converted bag."""
        k, h, w, c = self.tiles.shape
        return torch.Size((k, c, h, w))

    @property
    def ndim(self) -> int:
        return 4

    def __len__(self) -> int:
        return int(self.tiles.shape[0])

    def is_floating_point(self) -> bool:
        return True  # what slicing returns

    def __getitem__(self, index: slice) -> torch.Tensor:
        part = self.tiles[index].to(self.device, non_blocking=True)
        return tiles_to_tensor(part, dtype=self.dtype, stain=self.stain)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
        """The whole bag converted, on ``device``."""
        return tiles_to_tensor(self.tiles.to(device, non_blocking=non_blocking), dtype=self.dtype, stain=self.stain)
