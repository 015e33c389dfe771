"""PatchGD heads: networks over a slide's latent grid Z instead of a bag of instances.

A PatchGD head sees the tile embeddings laid out on the slide's tile grid, so it keeps the
spatial context that attention pooling throws away. Heads: ``cnn`` (the paper's CNN head made
mask-aware and size-agnostic; the default), ``cnn_paper`` (the paper's as published: fixed-size
Z, flatten + Linear) and ``transformer``. Every head takes the per-tile embeddings
and the store's grid, ``forward(z [n, D], grid [n, 2] (col, row)) -> MILOutput``, and builds Z
itself (:func:`grid_layout`, :func:`tiles_to_z`); :class:`wsi_pipeline.training.patchgd.PatchGDTrainer`
passes a precomputed layout so the grid is laid out once per slide.

Z layout
--------
Z is [B, s, rows, cols] in spatial layout: ``Z[0, :, r, c]`` is the cell at grid row ``r``
(y, downwards) and column ``c`` (x, rightwards), counted from the top-left corner of the
tissue bounding box. (The PatchGD reference code stores the transpose; we do not.)
Cells without a tile (background) are zero and ``mask`` is False there; no head lets their
content influence the output.

Large grids are capped: when the bounding box is larger than ``max_grid`` cells on its longer
side, ``f = ceil(longer side / max_grid)`` neighbouring cells in each direction (the same
``f`` on both axes, so cells stay square) are pooled into one: tile ``(col, row)`` goes to
cell ``((row - row0) // f, (col - col0) // f)`` and a pooled cell holds the mean of the
embeddings of the tissue tiles it contains (background cells are not counted, so a cell half
full of tissue is not diluted). The mean keeps every tile's gradient path (each tile gets
``1 / count`` of its cell's gradient).

Heatmap scores
--------------
``MILOutput.attention`` (computed in eval mode only; zeros in training mode, where nobody
reads it and it would cost a second backward) is gradient x activation at the tile level:
``score_i = <dy/dz_i, z_i>`` with ``y = logit[1] - logit[0]`` for two classes (positive =
evidence for class 1) and the predicted class's logit for more. Tiles pooled into one cell
each get their own score, and the scores of a cell's tiles sum to the cell's
gradient x activation of the projected embedding (exactly so without a projection bias).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsi_pipeline.devices import autocast_off
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.models.registry import Registry
from wsi_pipeline.failures import ConfigTypeError

__all__ = [
    "HEADS",
    "build_head",
    "GridLayout",
    "grid_layout",
    "tiles_to_z",
    "GridHead",
    "CNNHead",
    "PaperCNNHead",
    "TransformerHead",
    "MaskedBatchNorm2d",
]

#: PatchGD heads by name; ``build_head(name, ...)`` constructs one.
HEADS: Registry = Registry("patchgd head")


def build_head(name: str, in_dim: int, n_classes: int, **options: Any) -> GridHead:
    """Build the PatchGD head ``name`` (one of ``HEADS.names()``) for ``in_dim``-wide tile embeddings.

    ``options`` are the head's keyword arguments (all heads take ``proj_dim`` and ``max_grid``);
    an unknown option raises ``TypeError`` listing the valid ones.
    """
    cls = HEADS.get(name)
    valid = _options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigTypeError(f"patchgd head {name!r}: unknown option(s) {unknown}; valid options are {sorted(valid)}")
    return cls(in_dim, n_classes, **options)


def _options_of(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is GridHead or (isinstance(klass, type) and issubclass(klass, GridHead)):
            params = inspect.signature(klass.__init__).parameters.values()
            names += [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return sorted(set(names))


# ----------------------------------------------------------------------------------------------
# Z layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridLayout:
    """Where each tile of a slide lands in Z.

    Attributes
    ----------
    origin : (row0, col0), the top-left cell of the tissue bounding box, in tile-grid cells.
    factor : f, tile-grid cells per Z cell along each axis (1 = no pooling).
    shape : (rows, cols) of Z.
    cell_rc : long [n, 2], (row, col) of each tile's Z cell.
    cell : long [n], flat index ``row * cols + col`` of each tile's Z cell.
    count : float [rows * cols], tiles per Z cell (0 for background).
    mask : bool [rows, cols], True where a cell holds at least one tile.
    """

    origin: tuple[int, int]
    factor: int
    shape: tuple[int, int]
    cell_rc: Tensor
    cell: Tensor
    count: Tensor
    mask: Tensor

    @property
    def n_tiles(self) -> int:
        return int(self.cell.shape[0])

    def clone(self) -> GridLayout:
        """A copy with fresh tensors (turns inference-mode tensors into normal ones outside inference mode)."""
        return GridLayout(
            self.origin, self.factor, self.shape, self.cell_rc.clone(), self.cell.clone(), self.count.clone(),
            self.mask.clone(),
        )

    def to(self, device: torch.device | str) -> GridLayout:
        """The same layout with its tensors on ``device``."""
        return GridLayout(
            self.origin, self.factor, self.shape, self.cell_rc.to(device), self.cell.to(device),
            self.count.to(device), self.mask.to(device),
        )


def grid_layout(grid: np.ndarray | Tensor, *, max_grid: int | None = 128) -> GridLayout:
    """Lay out tiles on Z: crop to the tissue bounding box, pool by ``f`` when it exceeds ``max_grid``.

    Parameters
    ----------
    grid : int [n, 2], each tile's (col, row) on the slide's tile grid (the store's ``grid``).
    max_grid : cap on Z's longer side, in cells (None = no cap). See the module docstring for
        how tiles map to pooled cells.

    Returns
    -------
    GridLayout with tensors on the device of ``grid`` (CPU for numpy input).
    """
    g = torch.as_tensor(np.asarray(grid) if not isinstance(grid, Tensor) else grid)
    if g.ndim != 2 or g.shape[1] != 2 or g.shape[0] < 1:
        raise ValueError(f"grid must be an integer array [n, 2] of (col, row) with n >= 1; got shape {tuple(g.shape)}")
    if g.is_floating_point():
        raise TypeError(f"grid must hold integer (col, row) cells; got dtype {g.dtype}")
    if max_grid is not None and int(max_grid) < 1:
        raise ValueError(f"max_grid={max_grid}; expected a positive number of cells or None (no cap)")
    g = g.long()
    col, row = g[:, 0], g[:, 1]
    row0, col0 = int(row.min()), int(col.min())
    height, width = int(row.max()) - row0 + 1, int(col.max()) - col0 + 1
    f = 1 if max_grid is None else max(1, math.ceil(max(height, width) / int(max_grid)))
    rows, cols = (height - 1) // f + 1, (width - 1) // f + 1
    cell_rc = torch.stack([(row - row0) // f, (col - col0) // f], dim=1)
    cell = cell_rc[:, 0] * cols + cell_rc[:, 1]
    count = torch.bincount(cell, minlength=rows * cols).to(torch.float32)
    mask = (count > 0).view(rows, cols)
    return GridLayout((row0, col0), f, (rows, cols), cell_rc, cell, count, mask)


def tiles_to_z(emb: Tensor, layout: GridLayout) -> Tensor:
    """Place tile embeddings ``emb`` [n, s] on Z [1, s, rows, cols] (cell mean; background zero).

    Differentiable in ``emb``; with ``layout.factor == 1`` each cell is its tile's embedding exactly.
    """
    if emb.ndim != 2 or emb.shape[0] != layout.n_tiles:
        raise ValueError(f"emb must be [n={layout.n_tiles}, s] (one row per tile of the layout); got {tuple(emb.shape)}")
    rows, cols = layout.shape
    flat = emb.new_zeros(rows * cols, emb.shape[1]).index_add(0, layout.cell, emb)
    flat = flat / layout.count.clamp(min=1).to(flat.dtype)[:, None]  # x / 1 is exact: single tiles unchanged
    return flat.t().reshape(1, emb.shape[1], rows, cols)


# ----------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------


class GridHead(nn.Module):
    """Base of the PatchGD heads: projection, Z layout, forward, gradient x activation scores.

    Parameters
    ----------
    in_dim : D, the encoder's embedding size.
    n_classes : C.
    proj_dim : s, optional linear projection of each tile embedding before it enters Z
        (None = Z has the D encoder channels).
    max_grid : cap on Z's longer side in cells (None = no cap); see :func:`grid_layout`.

    Subclasses implement :meth:`forward_z`.
    """

    #: The evaluation stage passes the store's grid to heads that set this.
    needs_grid = True

    def __init__(self, in_dim: int, n_classes: int, *, proj_dim: int | None = None, max_grid: int | None = 128) -> None:
        super().__init__()
        if int(in_dim) < 1 or int(n_classes) < 1:
            raise ValueError(f"in_dim={in_dim} and n_classes={n_classes} must be positive")
        self.in_dim, self.n_classes = int(in_dim), int(n_classes)
        self.max_grid = None if max_grid is None else int(max_grid)
        self.proj: nn.Module = nn.Linear(in_dim, int(proj_dim)) if proj_dim else nn.Identity()
        self.z_dim = int(proj_dim) if proj_dim else self.in_dim

    def layout(self, grid: np.ndarray | Tensor) -> GridLayout:
        """This head's :class:`GridLayout` of a slide's grid [n, 2] (col, row)."""
        return grid_layout(grid, max_grid=self.max_grid)

    def to_z(self, z: Tensor, layout: GridLayout) -> tuple[Tensor, Tensor]:
        """Project tile embeddings ``z`` [n, D] and place them: ``(Z [1, s, rows, cols], mask [1, rows, cols])``."""
        if z.ndim != 2 or z.shape[1] != self.in_dim:
            raise ValueError(f"z must be [n, {self.in_dim}] tile embeddings; got {tuple(z.shape)}")
        return tiles_to_z(self.proj(z), layout), layout.mask[None]

    def forward_z(self, z_grid: Tensor, mask: Tensor) -> Tensor:
        """Logits [B, C] for Z [B, s, rows, cols] with ``mask`` [B, rows, cols] (True = tissue cell)."""
        raise NotImplementedError

    def z_shape(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """(rows, cols) of a batch of Z blocks whose own shapes are ``shapes``: the largest of each."""
        return max(r for r, _ in shapes), max(c for _, c in shapes)

    def batch_z(self, zs: list[Tensor], layouts: list[GridLayout]) -> tuple[Tensor, Tensor]:
        """Z of several slides as one batch: ``(Z [B, s, rows, cols], mask [B, rows, cols])``.

        ``zs[b]`` are slide b's tile embeddings [n_b, D]. Each slide's Z is padded at the bottom
        and right (zero, masked out) to :meth:`z_shape`; a single slide of that shape is not touched.
        """
        if len(zs) != len(layouts) or not zs:
            raise ValueError(f"batch_z needs one layout per slide; got {len(zs)} embeddings and {len(layouts)} layouts")
        rows, cols = self.z_shape([lay.shape for lay in layouts])
        grids, masks = [], []
        for z, lay in zip(zs, layouts):
            z_grid, mask = self.to_z(z, lay)
            pad = (0, cols - z_grid.shape[3], 0, rows - z_grid.shape[2])
            if any(pad):
                z_grid, mask = F.pad(z_grid, pad), F.pad(mask, pad)
            grids.append(z_grid)
            masks.append(mask)
        return torch.cat(grids), torch.cat(masks)

    def forward(self, z: Tensor, grid: np.ndarray | Tensor | None = None, *, layout: GridLayout | None = None, **_: Any) -> MILOutput:
        """Classify one slide from its tile embeddings ``z`` [n, D] and ``grid`` [n, 2] (col, row).

        Pass ``layout`` (from :meth:`layout`) instead of ``grid`` to reuse it. Extra keywords
        (e.g. ``label``) are ignored. Returns logits [C] and, in eval mode, gradient x
        activation scores [n] as ``attention`` (zeros in training mode).
        """
        if layout is None:
            if grid is None:
                raise TypeError(f"{type(self).__name__}.forward needs the tile grid [n, 2] (col, row) or a layout")
            layout = self.layout(grid)
        layout = layout.to(z.device)
        if layout.n_tiles != z.shape[0]:
            raise ValueError(f"z has {z.shape[0]} rows but the grid has {layout.n_tiles} tiles; pass one grid row per tile")
        logits = self.forward_z(*self.to_z(z, layout))[0]
        if self.training:
            attention = torch.zeros(z.shape[0], device=z.device, dtype=logits.dtype)
        else:
            attention = self.explain(z, layout)
        return MILOutput(logits=logits, attention=attention)

    def explain(self, z: Tensor, layout: GridLayout) -> Tensor:
        """Gradient x activation score [n] per tile (see the module docstring); no parameter grads."""
        with torch.inference_mode(False), torch.enable_grad(), autocast_off():
            zz = z.detach().clone().requires_grad_(True)
            logits = self.forward_z(*self.to_z(zz, layout.clone()))[0]
            target = logits[1] - logits[0] if self.n_classes == 2 else logits[int(logits.argmax())]
            (grad,) = torch.autograd.grad(target, zz)
        return (grad * zz).sum(1).detach().to(z.device)


class MaskedBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the masked (tissue) positions only; masked-out positions come out zero.

    In training mode the statistics are those of the valid positions across the batch and the
    running statistics are updated as :class:`torch.nn.BatchNorm2d` does; with fewer than two
    valid positions the running statistics are used (and not updated).
    """

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return super().forward(x)
        b, c, h, w = x.shape
        flat = x.permute(0, 2, 3, 1).reshape(-1, c)
        idx = mask.reshape(-1).nonzero().squeeze(1)
        use_batch = self.training and idx.numel() > 1
        momentum = 0.0 if self.momentum is None else float(self.momentum)
        if use_batch and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm2d does
                momentum = 1.0 / float(self.num_batches_tracked)
        y = F.batch_norm(
            flat[idx], self.running_mean, self.running_var, self.weight, self.bias,
            use_batch or not self.track_running_stats, momentum, self.eps,
        )
        out = flat.new_zeros(flat.shape).index_copy(0, idx, y.to(flat.dtype))
        return out.reshape(b, h, w, c).permute(0, 3, 1, 2)


class CellLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of each cell separately (independent of other cells and slides)."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _NoNorm(nn.Module):
    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return x


@HEADS.register("cnn")
class CNNHead(GridHead):
    """The PatchGD paper's CNN head, made mask-aware and size-agnostic for slides.

    Blocks of Conv3x3 -> ReLU -> norm -> Dropout2d, ``width`` channels: one stride-1 conv, then
    ``n_strided`` stride-2 convs; then global pooling over the tissue cells and a Linear.
    Departures from the reference, each for slides:

    - global pooling instead of flattening a fixed-size map, so one head takes any grid;
    - empty (background) cells never influence the output: Z is zeroed there, the norm
      statistics and the pooling use tissue cells only, and activations are re-masked after
      every block (a coarse cell counts as tissue when its 3x3 stride-2 window holds any);
    - ``partial=True`` (default): partial convolutions, i.e. each window's sum is rescaled by
      9 / (tissue cells in the window), so a cell at the tissue border responds like an
      interior one and the tissue outline (arbitrary on slides) is not an edge in Z, as it is
      with plain zero padding (``partial=False``, the reference's behaviour on full images);
    - ``norm``: ``batch`` is the paper's BatchNorm (masked). The paper's batches hold several
      images; a PatchGD step here sees one slide, so batch statistics are those of one
      slide's cells (an instance norm in training, running statistics in evaluation), which
      generalised poorly in our synthetic experiments. (``patchgd.slides_per_batch`` gives a
      step several slides; ``cnn_paper``, :class:`PaperCNNHead`, is the head as published.) ``layer`` (LayerNorm per cell) and
      ``none`` are offered. On small cohorts every CNN-head variant we tried memorised the
      training slides; the transformer head generalised far better (see the README section).

    Parameters
    ----------
    width : channels of every conv (256 in the paper).
    n_strided : number of stride-2 blocks after the stride-1 block (3 in the paper).
    dropout : Dropout2d probability (0.2 in the paper).
    pool : global pooling over tissue cells: ``"mean"``, ``"max"`` or ``"meanmax"`` (concatenated).
    norm : ``"batch"`` (default, the paper's), ``"layer"`` or ``"none"``.
    partial : partial (mask-normalised) convolutions.
    proj_dim, max_grid : see :class:`GridHead`.
    """

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        width: int = 256,
        n_strided: int = 3,
        dropout: float = 0.2,
        pool: str = "mean",
        norm: str = "batch",
        partial: bool = True,
        proj_dim: int | None = None,
        max_grid: int | None = 128,
    ) -> None:
        super().__init__(in_dim, n_classes, proj_dim=proj_dim, max_grid=max_grid)
        if norm not in ("batch", "layer", "none"):
            raise ValueError(f"norm={norm!r}; expected 'layer' (per-cell LayerNorm), 'batch' (masked BatchNorm) or 'none'")
        if pool not in ("mean", "max", "meanmax"):
            raise ValueError(f"pool={pool!r}; expected 'mean', 'max' or 'meanmax'")
        if int(n_strided) < 0 or int(width) < 1:
            raise ValueError(f"width={width} must be >= 1 and n_strided={n_strided} >= 0")
        self.pool, self.partial = pool, bool(partial)
        self.strides = [1] + [2] * int(n_strided)
        chans = [self.z_dim] + [int(width)] * len(self.strides)
        self.convs = nn.ModuleList(
            nn.Conv2d(chans[i], chans[i + 1], 3, stride=s, padding=1) for i, s in enumerate(self.strides)
        )
        makers: dict[str, Callable[[int], nn.Module]] = {"batch": MaskedBatchNorm2d, "layer": CellLayerNorm,
                                                         "none": lambda _: _NoNorm()}
        make = makers[norm]
        self.norms = nn.ModuleList(make(int(width)) for _ in self.strides)
        self.drop = nn.Dropout2d(float(dropout))
        self.fc = nn.Linear(int(width) * (2 if pool == "meanmax" else 1), n_classes)

    def forward_z(self, z_grid: Tensor, mask: Tensor) -> Tensor:
        m = mask.to(z_grid.dtype)[:, None]
        x = z_grid * m
        ones = m.new_ones(1, 1, 3, 3)
        for conv, norm, stride in zip(self.convs, self.norms, self.strides):
            cover = F.conv2d(m, ones, stride=stride, padding=1)  # tissue cells under each 3x3 window
            if self.partial:
                if not isinstance(conv, nn.Conv2d) or conv.bias is None:
                    raise TypeError(f"partial convolution: expected a Conv2d with a bias, got {conv}")
                x = F.conv2d(x, conv.weight, None, stride, 1) * (9.0 / cover.clamp(min=1.0))
                x = x + conv.bias[None, :, None, None]
            else:
                x = conv(x)
            if stride > 1:
                m = (cover > 0).to(m.dtype)
            x = self.drop(norm(torch.relu(x), m[:, 0] > 0)) * m
        valid = m > 0
        feats = []
        if self.pool in ("mean", "meanmax"):
            feats.append(x.sum((2, 3)) / m.sum((2, 3)).clamp(min=1))
        if self.pool in ("max", "meanmax"):
            feats.append(x.masked_fill(~valid, float("-inf")).amax((2, 3)))
        return self.fc(torch.cat(feats, 1))


@HEADS.register("cnn_paper")
class PaperCNNHead(GridHead):
    """The PatchGD paper's CNN head as its reference code builds it, on a fixed-size Z.

    Z is padded (bottom, right; zero) to ``max_grid x max_grid`` cells, the paper's fixed
    m x m latent grid; then blocks of Conv3x3 -> ReLU -> BatchNorm2d -> Dropout2d(``dropout``),
    ``width`` channels: one stride-1 conv, then ``n_strided`` stride-2 convs (padding 1, so each
    halves the side, rounding up), then flatten and one Linear over
    ``width * ceil(max_grid / 2^n_strided)^2`` features. Plain zero padding and plain BatchNorm
    over every cell of the batch, background cells included: nothing is masked, as on the
    paper's whole images. It is what ``preset: paper`` uses; on slides the default ``cnn`` head
    (masked, size-agnostic) and the ``transformer`` head are the better choices (see
    :class:`CNNHead`). Its BatchNorm needs several slides per training batch
    (``patchgd.slides_per_batch``) to see batch statistics of more than one slide.

    Parameters
    ----------
    width, n_strided, dropout : as in the paper (256, 3, 0.2).
    proj_dim : see :class:`GridHead`.
    max_grid : side of the fixed Z, in cells (required: a grid larger than this is pooled to it,
        see :func:`grid_layout`).
    """

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        width: int = 256,
        n_strided: int = 3,
        dropout: float = 0.2,
        proj_dim: int | None = None,
        max_grid: int | None = 128,
    ) -> None:
        if max_grid is None:
            raise ValueError("the cnn_paper head flattens a fixed-size Z: max_grid must be a number of cells, not null")
        super().__init__(in_dim, n_classes, proj_dim=proj_dim, max_grid=max_grid)
        if int(n_strided) < 0 or int(width) < 1:
            raise ValueError(f"width={width} must be >= 1 and n_strided={n_strided} >= 0")
        self.strides = [1] + [2] * int(n_strided)
        chans = [self.z_dim] + [int(width)] * len(self.strides)
        self.blocks = nn.Sequential(*(
            nn.Sequential(
                nn.Conv2d(chans[i], chans[i + 1], 3, stride=s, padding=1), nn.ReLU(),
                nn.BatchNorm2d(chans[i + 1]), nn.Dropout2d(float(dropout)),
            )
            for i, s in enumerate(self.strides)
        ))
        side = self.grid_side
        for _ in range(int(n_strided)):
            side = (side - 1) // 2 + 1
        self.fc = nn.Linear(int(width) * side * side, n_classes)

    @property
    def grid_side(self) -> int:
        """Side of the fixed Z in cells (``max_grid``)."""
        if self.max_grid is None:
            raise ValueError("the cnn_paper head needs max_grid (the side of its fixed Z)")
        return int(self.max_grid)

    def z_shape(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        return self.grid_side, self.grid_side

    def to_z(self, z: Tensor, layout: GridLayout) -> tuple[Tensor, Tensor]:
        z_grid, mask = super().to_z(z, layout)
        rows, cols = layout.shape
        pad = (0, self.grid_side - cols, 0, self.grid_side - rows)
        if min(pad) < 0:
            raise ValueError(f"Z of {rows} x {cols} cells exceeds the cnn_paper head's fixed {self.grid_side} x {self.grid_side}")
        return F.pad(z_grid, pad), F.pad(mask, pad)

    def forward_z(self, z_grid: Tensor, mask: Tensor) -> Tensor:
        if tuple(z_grid.shape[2:]) != (self.grid_side, self.grid_side):
            raise ValueError(f"the cnn_paper head takes Z of {self.grid_side} x {self.grid_side} cells; got {tuple(z_grid.shape[2:])}")
        return self.fc(self.blocks(z_grid).flatten(1))


def sincos_2d(rc: Tensor, dim: int) -> Tensor:
    """Fixed 2D sinusoidal position code [n, dim] for (row, col) cells ``rc`` [n, 2]; dim % 4 == 0.

    The first half of the channels encodes the row, the second half the column, each as
    sin/cos at ``dim / 4`` geometric frequencies (as in ViT's 2D sin-cos embedding).
    """
    quarter = dim // 4
    freq = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float32, device=rc.device) / max(quarter, 1)))
    parts = []
    for axis in (0, 1):
        angle = rc[:, axis, None].to(torch.float32) * freq[None]
        parts += [torch.sin(angle), torch.cos(angle)]
    return torch.cat(parts, 1)


@HEADS.register("transformer")
class TransformerHead(GridHead):
    """A small transformer over the tissue cells of Z, with 2D sin-cos positions and a CLS token.

    Tokens are the non-empty cells only (so background never enters), projected to ``dim``
    plus the fixed 2D sinusoidal code of their (row, col) in Z, which works for any grid size.
    ``depth`` pre-norm encoder layers (``heads`` heads, MLP ``mlp_ratio * dim``), then LayerNorm
    and a Linear on the CLS token. The paper's transformer head is one layer with 2 heads.

    Parameters
    ----------
    dim : token width (divisible by 4 and by ``heads``).
    heads, depth, mlp_ratio, dropout : the encoder layers' settings.
    proj_dim, max_grid : see :class:`GridHead`.
    """

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        dim: int = 192,
        heads: int = 2,
        depth: int = 1,
        mlp_ratio: float = 2.0,
        dropout: float = 0.1,
        proj_dim: int | None = None,
        max_grid: int | None = 128,
    ) -> None:
        super().__init__(in_dim, n_classes, proj_dim=proj_dim, max_grid=max_grid)
        if int(dim) % 4 or int(dim) % int(heads):
            raise ValueError(f"dim={dim} must be divisible by 4 (2D sin-cos positions) and by heads={heads}")
        self.dim = int(dim)
        self.embed = nn.Linear(self.z_dim, self.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, self.dim))
        nn.init.normal_(self.cls, std=0.02)
        layer = nn.TransformerEncoderLayer(
            self.dim, int(heads), int(mlp_ratio * self.dim), float(dropout), batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, int(depth), enable_nested_tensor=False)
        self.norm = nn.LayerNorm(self.dim)
        self.fc = nn.Linear(self.dim, n_classes)

    def forward_z(self, z_grid: Tensor, mask: Tensor) -> Tensor:
        b = z_grid.shape[0]
        lengths = mask.reshape(b, -1).sum(1)
        n_max = int(lengths.max())
        tokens = z_grid.new_zeros(b, n_max, self.dim)
        pad = torch.ones(b, n_max + 1, dtype=torch.bool, device=z_grid.device)
        pad[:, 0] = False
        for i in range(b):
            rc = mask[i].nonzero()  # [L, 2] (row, col), row-major order
            cells = z_grid[i][:, rc[:, 0], rc[:, 1]].t()
            tokens[i, : len(rc)] = self.embed(cells) + sincos_2d(rc, self.dim).to(cells.dtype)
            pad[i, 1 : len(rc) + 1] = False
        x = torch.cat([self.cls.expand(b, -1, -1).to(tokens.dtype), tokens], 1)
        x = self.encoder(x, src_key_padding_mask=pad if bool(pad.any()) else None)
        return self.fc(self.norm(x[:, 0]))
