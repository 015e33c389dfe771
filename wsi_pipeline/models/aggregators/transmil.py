"""TransMIL (Shao et al., NeurIPS 2021): Nystrom transformer with a pyramid position encoding.

``nystrom`` picks the attention's treatment of its own left padding to a multiple of the
landmark count (:mod:`~wsi_pipeline.models.aggregators.nystrom`): ``reference`` (default), the
numerics of the ``nystrom-attention`` package the paper's code uses, where the zero pads act as
keys and landmarks, so this is the model the paper trained; or ``masked``, where the pads are
masked out (closer to exact attention, and exact when ``H^2 + 1 <= num_landmarks``; with shared
weights the two differ by up to tens of percent on bags of a few hundred tiles, less on large
bags). Parameters are the same in both modes, so a state dict loads into either.

One forward on a bag of n instances:

1. ``h = ReLU(Linear(z))`` (512 wide).
2. Square padding: the sequence is extended to ``H^2`` tokens, ``H = ceil(sqrt(n))``, by
   repeating the first tokens (token j of the padded sequence is ``h[j mod n]``: duplicates,
   never zeros); a learned CLS token is prepended, so the transformer sees ``H^2 + 1`` tokens.
3. TransLayer (``x + NystromAttention(LayerNorm(x))``, no MLP), then PPEG on the non-CLS tokens
   laid out row-major as a 512 x H x H image (``x + DW7(x) + DW5(x) + DW3(x)``, depthwise, same
   padding, with bias), then a second TransLayer, LayerNorm, and a linear classifier on the CLS
   token.

``attention`` is the last layer's CLS-to-token attention, averaged over heads, taken from the
Nystrom factors (one row, never an N x N matrix). A real instance that appears several times in
the padded sequence gets the SUM of the weights of its copies (all copies feed the CLS output
with the same value). The CLS token's weight on itself is dropped, and the depthwise-conv
residual on V (which is not attention) is not part of the score. With Nystrom the row is an
approximation and need not be positive or sum exactly to one; in ``reference`` mode the weight
on the attention's zero pads is left out; in ``masked`` mode with ``H^2 + 1 <= num_landmarks`` it
equals the exact softmax attention row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from wsi_pipeline.models.aggregators.base import MILOutput, check_bag
from wsi_pipeline.models.aggregators.nystrom import NystromAttention, NystromMode, check_nystrom_mode

__all__ = ["TransMIL", "PPEG", "TransLayer", "square_pad_index"]


def square_pad_index(n: int) -> tuple[Tensor, int]:
    """Return ``(index [H^2], H)``: padded position j holds instance ``index[j] = j mod n``, ``H = ceil(sqrt(n))``."""
    if n < 1:
        raise ValueError(f"square_pad_index: n={n}; a bag needs at least one instance")
    side = math.isqrt(n - 1) + 1
    return torch.arange(side * side) % n, side


class TransLayer(nn.Module):
    """``x + NystromAttention(LayerNorm(x))`` over [B, N, dim]."""

    def __init__(
        self,
        dim: int = 512,
        *,
        num_landmarks: int = 256,
        pinv_iterations: int = 6,
        dropout: float = 0.1,
        nystrom: NystromMode = "reference",
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = NystromAttention(
            dim,
            heads=8,
            dim_head=dim // 8,
            num_landmarks=num_landmarks,
            pinv_iterations=pinv_iterations,
            residual=True,
            residual_kernel=33,
            dropout=dropout,
            mode=nystrom,
        )

    def forward(self, x: Tensor, *, return_row: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if return_row is None:
            return x + self.attn(self.norm(x))
        out, row = self.attn(self.norm(x), return_row=return_row)
        return x + out, row


class PPEG(nn.Module):
    """Pyramid position encoding: depthwise 7x7, 5x5 and 3x3 convolutions on the H x W token grid."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(dim, dim, k, padding=k // 2, groups=dim) for k in (7, 5, 3))

    def forward(self, x: Tensor, side: int) -> Tensor:
        """``x`` [B, 1 + side^2, dim] (CLS first) -> same shape."""
        b, _, d = x.shape
        cls, tokens = x[:, :1], x[:, 1:]
        grid = tokens.transpose(1, 2).reshape(b, d, side, side)
        grid = grid + sum(conv(grid) for conv in self.convs)
        return torch.cat([cls, grid.flatten(2).transpose(1, 2)], dim=1)


class TransMIL(nn.Module):
    """TransMIL aggregator.

    Parameters
    ----------
    in_dim : feature size D of the instance embeddings.
    n_classes : number of classes C.
    dim : transformer width (512; 8 heads of dim // 8).
    num_landmarks : Nystrom landmarks (256).
    pinv_iterations : pseudo-inverse iterations (6).
    dropout : dropout after each attention's output projection (0.1).
    nystrom : ``reference`` (the nystrom-attention package's numerics, as the paper trained) or
        ``masked`` (pads masked out); see the module docstring.
    """

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        dim: int = 512,
        num_landmarks: int = 256,
        pinv_iterations: int = 6,
        dropout: float = 0.1,
        nystrom: NystromMode = "reference",
    ) -> None:
        super().__init__()
        check_nystrom_mode(nystrom, "transmil: nystrom")
        if dim % 8 != 0:
            raise ValueError(f"transmil: dim={dim} must be a multiple of the 8 heads")
        self.in_dim, self.n_classes = int(in_dim), int(n_classes)
        self.embed = nn.Sequential(nn.Linear(in_dim, dim), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        opts: dict[str, Any] = {"num_landmarks": num_landmarks, "pinv_iterations": pinv_iterations, "dropout": dropout, "nystrom": nystrom}
        self.layer1 = TransLayer(dim, **opts)
        self.ppeg = PPEG(dim)
        self.layer2 = TransLayer(dim, **opts)
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, z: Tensor, **kw: object) -> MILOutput:
        """Aggregate one bag ``z`` [n, in_dim]; extra keywords (e.g. ``label``) are ignored."""
        check_bag(z, self.in_dim, "transmil")
        n = z.shape[0]
        index, side = square_pad_index(n)
        index = index.to(z.device)
        h = self.embed(z)[index].unsqueeze(0)  # [1, side^2, dim]
        x = torch.cat([self.cls_token.to(h.dtype).expand(1, -1, -1), h], dim=1)
        x = self.layer1(x)
        x = self.ppeg(x, side)
        x, row = self.layer2(x, return_row=0)
        logits = self.classifier(self.norm(x[:, 0]))[0]
        attention = torch.zeros(n, dtype=row.dtype, device=row.device).index_add(0, index, row[0, 1:])
        return MILOutput(logits=logits, attention=attention)
