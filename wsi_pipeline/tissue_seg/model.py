"""The shared-memory paper's tiny U-Net: 7 convolutions, large kernels at high stride, additive skips.

The paper gives 7 convolutional layers, 4,492 parameters, additive skips, early layers that
downsample with few large kernels at high stride and no pooling. It gives no layer table, so the
layers are chosen here (4,409 parameters, 1.8 % under 4,492; channels ``c = 8``)::

    x   = (255 - grey) / 255                           [1, H,    W   ]  inverted, 0..1
    e1  = relu(conv1(x))     8x8 kernel, stride 8      [c, H/8,  W/8 ]      520 params
    e2  = relu(conv2(e1))    4x4 kernel, stride 4      [c, H/32, W/32]    1,032
    b   = relu(conv3(e2))    3x3, padding 1            [c, H/32, W/32]      584
    b   = relu(conv4(b) + e2)  3x3, padding 1, additive skip                584
    u   = relu(up5(b) + e1)  transposed 4x4, stride 4, additive skip      1,032
    u   = relu(conv6(u))     3x3, padding 1            [c, H/8,  W/8 ]      584
    z8  = conv7(u)           3x3, padding 1            [1, H/8,  W/8 ]       73
    z   = nearest x8 upsampling of z8                  [1, H,    W   ]  (logit; sigmoid gives p)

Why the logit is made at 1/8 scale and upsampled by nearest neighbour: the paper's labels are
themselves built at 1/8 scale and upsampled by nearest neighbour, so a prediction constant on 8 x 8
px blocks loses nothing, and the full-resolution loss then needs no full-resolution float tensor:
over one block of 64 px with logit z and n tissue px, the summed binary cross-entropy is exactly
``64 softplus(z) - n z`` (:mod:`wsi_pipeline.tissue_seg.chunked` uses this identity). The
transposed convolution has kernel = stride, so it upsamples without overlap (no halos when
chunked). Input height and width must be multiples of 32 px (:data:`MULTIPLE`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TissueUNet", "MULTIPLE", "PAPER_PARAMETERS", "prepare_input"]

#: Image height and width must be multiples of this (px): the total stride of the encoder.
MULTIPLE = 32
#: Parameter count reported by the paper.
PAPER_PARAMETERS = 4492


def prepare_input(grey: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 greyscale (0 = black, 255 = glass) -> inverted and scaled to 0..1 (tissue high)."""
    return (255.0 - grey.to(dtype)) / 255.0


class TissueUNet(nn.Module):
    """7-layer large-kernel, high-stride U-Net with additive skips (see the module docstring).

    Parameters
    ----------
    channels
        Feature channels of every hidden layer (8 gives 4,409 parameters).
    """

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        c = int(channels)
        self.channels = c
        self.conv1 = nn.Conv2d(1, c, 8, stride=8)
        self.conv2 = nn.Conv2d(c, c, 4, stride=4)
        self.conv3 = nn.Conv2d(c, c, 3, padding=1)
        self.conv4 = nn.Conv2d(c, c, 3, padding=1)
        self.up5 = nn.ConvTranspose2d(c, c, 4, stride=4)
        self.conv6 = nn.Conv2d(c, c, 3, padding=1)
        self.conv7 = nn.Conv2d(c, 1, 3, padding=1)

    #: Image px per logit px (nearest-neighbour upsampling factor of the output).
    OUTPUT_STRIDE = 8

    def low_logits(self, e1: torch.Tensor) -> torch.Tensor:
        """From ``e1`` (1/8 scale) to the logits ``z8`` (1/8 scale), plain autograd."""
        e2 = F.relu(self.conv2(e1))
        b = F.relu(self.conv3(e2))
        b = F.relu(self.conv4(b) + e2)
        u = F.relu(self.up5(b) + e1)
        u = F.relu(self.conv6(u))
        return self.conv7(u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, 1, H, W]`` inverted 0..1 input -> ``[N, 1, H, W]`` logits (H, W multiples of 32 px)."""
        if x.dim() != 4 or x.shape[1] != 1:
            raise ValueError(f"TissueUNet expects [N, 1, H, W] input, got shape {tuple(x.shape)}")
        h, w = x.shape[2:]
        if h % MULTIPLE or w % MULTIPLE:
            raise ValueError(f"TissueUNet input height and width must be multiples of {MULTIPLE} px, got {h} x {w}")
        e1 = F.relu(self.conv1(x))
        return F.interpolate(self.low_logits(e1), scale_factor=self.OUTPUT_STRIDE, mode="nearest")


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
