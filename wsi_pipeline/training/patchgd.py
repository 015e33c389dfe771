"""PatchGD (Gupta et al.) on slides: a Z block over the tile grid, updated a few tiles at a time.

One batch of ``slides_per_batch`` slides (default one) per :meth:`PatchGDTrainer.batch_step`:

1. **Fill** (no gradient): embed every tile of each store; the per-tile cache ``E`` [n, D]
   laid out by the head's :class:`~wsi_pipeline.models.heads.GridLayout` *is* Z
   [1, s, rows, cols] (spatial layout, row = y, col = x; background cells zero and masked;
   large grids cropped to the tissue bounding box and pooled, see :mod:`wsi_pipeline.models.heads`).
2. **zeta inner iterations**. Iteration j takes, from every slide, the next k tiles of a stream
   of random permutations of its tiles (:func:`~wsi_pipeline.training.patchgd_plan.plan_inner_iterations`,
   the batch's plan in :mod:`wsi_pipeline.training.patchgd_plan`: every tile exactly once
   per pass, never twice in one iteration), re-embeds them *with* gradient (all slides' live
   tiles in one encoder call), writes them into detached copies of the Z blocks
   (``E.index_copy``: gradient reaches the encoder through those tiles only), runs the head
   over the whole Z (the batch's Z blocks padded to one shape) and backpropagates
   ``loss / window`` (the loss is the mean over the batch's slides). The fresh embeddings are
   then written (detached) into the caches, so later iterations see them. In a batch, k and
   the pass length are each slide's own and zeta is the largest slide's.
3. **Optimiser step every epsilon inner iterations** (default epsilon = zeta, one step per
   batch). ``optimizer_step()`` (the caller's callback: step, then zero the gradients) is
   called at the end of each window of epsilon iterations. When zeta is not a multiple of
   epsilon, ``partial_window: step`` (default) makes the last window shorter and divides its
   losses by its own length, so no gradient is lost; ``partial_window: drop`` is the paper's
   Algorithm 1, whose trailing partial window is never applied (here: not run).

Defaults and the paper (``patchgd: {preset: paper}``, :mod:`wsi_pipeline.config.patchgd_presets`)
-----------------------------------------------------------------------------------------------
Each default departs from the paper where that is better for slides; the preset restores the
paper's choice. ``backbone_scale`` ``full`` vs ``paper`` (1/epsilon): below. ``encoder.bn``
``frozen`` vs ``train``: frozen keeps a live tile's embedding equal to its cached one and the
gradient exact; train-mode statistics of k tiles of one slide carry slide-level information
between tiles (the pitfall in ``../shared/docs/methods.md``) and differ between fill and
inner iterations. ``slides_per_batch`` 1 vs 14: one slide's live tiles and Z fit on any
device, and our heads need no batch statistics; the paper's head BatchNorm does. ``fraction``
0.25 vs 0.1: fewer inner iterations per slide for the same pass; the paper's Table 11 prefers
0.1 on PANDA. epsilon = zeta in both, ``partial_window`` ``step`` vs ``drop``: no inner
iteration's gradient is wasted. Head ``cnn`` (masked, size-agnostic, global pooling, partial
convolutions) or ``transformer`` vs ``cnn_paper`` (fixed-size Z, flatten + Linear): slides
differ in size and shape and their background is not an image edge; on our small cohorts the
transformer head generalised best. Schedule: the pipeline's (cosine by default) vs
``linear`` (2 warm-up epochs, linear decay to half the peak lr 1e-3, Adam without weight decay).

Gradient scale (``backbone_scale``) and when the gradient is exact
------------------------------------------------------------------
Within one window the head's gradient is the gradient of the window's mean loss. The encoder
only sees the k live tiles of each iteration, so backpropagating ``loss / epsilon`` (what the
reference does, ``backbone_scale: paper``) gives the encoder ``1 / epsilon`` of the full-slide
gradient when the window covers every tile once, while the head gets all of its gradient.
The default ``backbone_scale: full`` multiplies the gradient entering the live embeddings by
``n / k``: each iteration's encoder gradient is then an unbiased estimate of the full-slide
gradient ``sum_i dL/dz_i dz_i/dtheta`` (each tile is live with probability k/n).

The step's gradient equals the gradient of the slide's loss with every tile embedded with
gradient (plain autograd), for head and encoder alike, **exactly when** all of these hold:
``backbone_scale: full``; one window (epsilon = zeta); ``k`` divides ``n`` and zeta = n / k,
so one pass makes every tile live exactly once; the encoder is one fixed function (frozen
BatchNorm, no dropout); and the head is deterministic (no dropout: each inner iteration draws
its own dropout masks, so the mean of the iterations' losses is not the all-tiles loss). The
head's part alone needs only the one window and no head dropout (its input Z is the same in
every iteration). It is not exact otherwise: when k does not divide n the last iteration wraps
into the next pass and some tiles are live twice while the n / k scale assumes once. Relative
error of the encoder gradient against all-tiles autograd, float64 (``tests/training/test_patchgd.py``,
which checks the exact case to 1e-10 and both inexact ones to differ): 13-tile slide, k = 4,
zeta = 4: 0.59 (the audit of issue 15 measured 0.51 on another model); 12 tiles, k = 4 (exact
without dropout: 7e-16) with head dropout 0.2: 1.5 (audit: 2.1). With ``paper`` scale the
encoder gets 1/epsilon of the exact gradient in the exact case. (With Adam the scale hardly
matters, being per-parameter; it matters for SGD, coupled weight decay and gradient-norm
clipping.) A batch of slides is exact under the same conditions for every slide with one
common zeta: the gradient of the batch's mean loss (tested with the ``cnn_paper`` head).

BatchNorm in the encoder (``freeze_bn``, from ``encoder.bn``)
-------------------------------------------------------------
Default ``freeze_bn: true`` (``bn: frozen``): the encoder's BatchNorm layers run on their
running statistics in both the fill and the live passes (their affine parameters still
train), so the encoder is one fixed function per step and a live tile's embedding equals its
cached one bit for bit; this is what makes the gradients above exact. ``freeze_bn: false``
(``bn: train``, the paper's) runs the encoder in train mode throughout, as the reference does:
the fill embeds each slide's tiles in random groups of at most k (the batch's g-th groups in one
call) with batch statistics, the live tiles of an iteration are normalised with their own batch
statistics, and the running statistics are updated by every such call. Not exact.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.devices import autocast_off
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.models.heads import GridHead, GridLayout
from wsi_pipeline.config.patchgd import PatchGDConfig, resolve_patchgd_options
from wsi_pipeline.methods.models import build_patchgd_head
from wsi_pipeline.training.patchgd_plan import BatchPlan, plan_batch
from wsi_pipeline.types import TileStoreLike

__all__ = ["PatchGDTrainer", "embed_store"]

log = logging.getLogger(__name__)


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@contextlib.contextmanager
def _modes(module: nn.Module, *, train: bool, freeze_bn: bool) -> Iterator[None]:
    """Set ``module``'s train/eval mode (BatchNorm layers to eval when ``freeze_bn``); restore on exit."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(train)
    if freeze_bn:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


def embed_store(
    encoder: nn.Module,
    store: TileStoreLike,
    *,
    batch: int = 64,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Embed every tile of ``store`` with ``encoder`` in eval mode and without gradient: [n, D] of ``dtype``.

    Rows follow the store's tile order (as ``store.grid`` and ``store.coords``).
    """
    device = torch.device(device) if device is not None else _device_of(encoder)
    n = len(store)
    out: list[Tensor] = []
    with _modes(encoder, train=False, freeze_bn=True), torch.no_grad():
        for start in range(0, n, batch):
            idx = np.arange(start, min(start + batch, n))
            out.append(encoder(tiles_to_tensor(store.read(idx), device=device, stain=getattr(store, "stain", None))).to(dtype))
    return torch.cat(out)


class PatchGDTrainer:
    """The PatchGD algorithm: trains on a batch of slides at a time (see the module docstring). The
    registered ``patchgd`` strategy (:class:`wsi_pipeline.training.strategies.PatchGDStrategy`) drives it.

    Parameters
    ----------
    method_cfg : the method's parsed options (:attr:`~wsi_pipeline.config.pipeline.MethodConfig.patchgd_config`),
        or a method config mapping / bare ``patchgd`` mapping, parsed here (:meth:`PatchGDConfig.for_method`).
    encoder : tile encoder, [B, 3, T, T] -> [B, D], with ``num_features`` = D.
    head : a :class:`~wsi_pipeline.models.heads.GridHead`; None builds the configured one
        (:func:`build_patchgd_head`; put its parameters in the optimiser via :attr:`head`).
    n_classes : C.

    Attributes
    ----------
    last_plan : the tile indices of each inner iteration run by the latest :meth:`batch_step`
        (its first slide); ``last_plans`` holds every slide's.
    """

    def __init__(self, method_cfg: Mapping[str, Any] | PatchGDConfig | None, encoder: nn.Module, head: GridHead | None, n_classes: int) -> None:
        if isinstance(method_cfg, PatchGDConfig):  # a method's parsed options (MethodConfig.patchgd_config)
            self.cfg, explicit = method_cfg, set[str]()
        else:
            options = resolve_patchgd_options(method_cfg)
            self.cfg, explicit = PatchGDConfig.from_mapping(options), set(options)
        self.encoder = encoder
        self.n_classes = int(n_classes)
        if head is None:
            in_dim = getattr(encoder, "num_features", None)
            if in_dim is None:
                raise ValueError("encoder has no `num_features`; build the head yourself and pass it as head=")
            head = build_patchgd_head(self.cfg, int(in_dim), self.n_classes)
        if not isinstance(head, GridHead):
            raise TypeError(
                f"PatchGD needs a grid head from wsi_pipeline.models.heads (build_head); got {type(head).__name__}"
            )
        if "max_grid" in explicit and head.max_grid != self.cfg.max_grid:
            # the cap only changes the layout, so the strategy's setting can be applied to a built head
            head.max_grid = self.cfg.max_grid
        if "proj_dim" in explicit and (self.cfg.proj_dim or head.in_dim) != head.z_dim:
            raise ValueError(
                f"patchgd.proj_dim={self.cfg.proj_dim} but the head was built with proj_dim={head.z_dim}; "
                "set proj_dim in the head's options (it creates parameters) and drop it from patchgd"
            )
        if self.n_classes != head.n_classes:
            raise ValueError(f"n_classes={self.n_classes} but the head was built for {head.n_classes} classes")
        self.head = head
        self.last_plan: list[Tensor] = []
        self.last_plans: list[list[Tensor]] = []

    @property
    def device(self) -> torch.device:
        return _device_of(self.encoder)

    def _embed_all(self, store: TileStoreLike) -> Tensor:
        dtype = next(self.head.parameters()).dtype
        return embed_store(self.encoder, store, batch=self.cfg.fill_batch, device=self.device, dtype=dtype)

    def fill_z(self, store: TileStoreLike) -> tuple[Tensor, Tensor, GridLayout]:
        """Z for a slide without gradient: ``(Z [1, s, rows, cols], mask [1, rows, cols], layout)``."""
        emb = self._embed_all(store)
        layout = self.head.layout(store.grid).to(emb.device)
        with torch.no_grad():
            z_grid, mask = self.head.to_z(emb, layout)
        return z_grid, mask, layout

    def predict(self, store: TileStoreLike) -> MILOutput:
        """Evaluate a slide: fill Z with all tiles and run the head in eval mode (logits [C], scores [n])."""
        emb = self._embed_all(store)
        was = self.head.training
        self.head.eval()
        try:
            with torch.no_grad():
                out = self.head(emb, store.grid)
        finally:
            self.head.train(was)
        return out

    def _fill(self, stores: list[TileStoreLike], ks: list[int], generator: torch.Generator | None, part: list[int] | None = None) -> list[Tensor]:
        """Each slide's tile embeddings [n, D] without gradient (Z-filling).

        Frozen BatchNorm: :func:`embed_store` (eval mode). Train-mode BatchNorm (the paper's):
        the encoder in train mode, each slide's tiles split at random into G nearly equal groups
        (G = the most of ``ceil(n / k)`` over the batch, so at most k tiles a group), the batch's
        g-th groups embedded together, as the reference fills Z from its patch sampler.

        ``part``: embed only these slides of the batch (the groups are drawn for all of them).
        """
        keep = list(range(len(stores))) if part is None else list(part)
        if self.cfg.freeze_bn or not self.encoder.training:
            return [self._embed_all(stores[b]) for b in keep]
        device, dtype = self.device, next(self.head.parameters()).dtype
        n_groups = max(math.ceil(len(store) / k) for store, k in zip(stores, ks))
        # every slide in n_groups nearly equal groups (at most k tiles each), so no call of the
        # batch holds a lone leftover tile of one slide
        groups = [torch.randperm(len(store), generator=generator).tensor_split(n_groups) for store in stores]
        out: list[Tensor | None] = [None] * len(stores)
        with _modes(self.encoder, train=True, freeze_bn=False), torch.no_grad():
            for g in range(n_groups):
                parts = [(b, groups[b][g]) for b in keep if len(groups[b][g])]
                if not parts:
                    continue
                x = torch.cat([tiles_to_tensor(stores[b].read(idx.numpy()), device=device, stain=getattr(stores[b], "stain", None))
                               for b, idx in parts])
                emb = self.encoder(x).to(dtype)
                for (b, idx), e in zip(parts, emb.split([len(idx) for _, idx in parts])):
                    if out[b] is None:
                        out[b] = emb.new_zeros(len(stores[b]), emb.shape[1])
                    out[b][idx.to(device)] = e  # type: ignore[index]
        return [out[b] for b in keep]  # type: ignore[misc]

    def bag_step(
        self,
        store: TileStoreLike,
        label: int | Tensor,
        optimizer_step: Callable[[], None],
        generator: torch.Generator | None = None,
    ) -> float:
        """Run the inner iterations on one slide (:meth:`batch_step` with a batch of one)."""
        return self.batch_step([store], [label], optimizer_step, generator)

    def batch_step(
        self,
        stores: list[TileStoreLike],
        labels: list[int | Tensor],
        optimizer_step: Callable[[], None],
        generator: torch.Generator | None = None,
        *,
        part: list[int] | None = None,
    ) -> float:
        """Run the inner iterations on a batch of slides, stepping the optimiser every epsilon of them.

        Parameters
        ----------
        stores : the slides' TileStores (``read``, ``grid``, ``len``); usually
            ``slides_per_batch`` of them (the last batch of an epoch may be smaller).
        labels : each slide's class in [0, C).
        optimizer_step : called after every window of epsilon inner iterations; it must step
            the optimiser and zero the gradients (the caller's schedule, clipping, scaler...).
        generator : the source of the tile sampling (CPU generator).
        part : data-parallel training (:mod:`wsi_pipeline.training.distributed`): run only these
            positions of the batch; the other ranks run the rest. zeta, the windows and every
            slide's tile plan are those of the whole batch (same draws on every rank), a slide's
            loss is divided by the whole batch's size, and ``optimizer_step`` (which sums the
            gradients over ranks) is called after every window even with no slide here.

        Returns
        -------
        The mean loss over the inner iterations (each loss is the full task loss of one
        iteration, the mean over the batch's slides, not divided by epsilon); with ``part``,
        this rank's share of it (the sum over ranks is the batch's).
        """
        ns, ys = self._check_batch(stores, labels)
        batch_plan = plan_batch(self.cfg, ns, generator)
        self.last_plan = batch_plan.plans[0]
        self.last_plans = batch_plan.plans
        live = self._live_batch(stores, ns, ys, batch_plan, generator, part)
        losses: list[float] = []
        j = 0
        with _modes(self.encoder, train=self.encoder.training, freeze_bn=self.cfg.freeze_bn):
            for length in batch_plan.windows:
                for _ in range(length):
                    losses.append(self._inner_iteration(live, j, length))
                    j += 1
                optimizer_step()
        return float(np.mean(losses))

    def _check_batch(self, stores: list[TileStoreLike], labels: list[int | Tensor]) -> tuple[list[int], list[int]]:
        """The slides' tile counts and labels, checked: ``(ns, ys)``."""
        if not stores or len(stores) != len(labels):
            raise ValueError(f"batch_step needs one label per store and at least one store; got {len(stores)} stores, {len(labels)} labels")
        ns = [len(store) for store in stores]
        for store, n in zip(stores, ns):
            if n < 1:
                raise ValueError(f"store {getattr(store, 'path', store)} has no tiles; PatchGD needs at least one")
        ys = [int(label) for label in labels]
        for y in ys:
            if not 0 <= y < self.n_classes:
                raise ValueError(f"label={y} outside [0, n_classes={self.n_classes})")
        return ns, ys

    def _live_batch(
        self, stores: list[TileStoreLike], ns: list[int], ys: list[int], plan: BatchPlan, generator: torch.Generator | None,
        part: list[int] | None,
    ) -> _LiveBatch:
        """Fill the batch's Z caches and gather what its inner iterations use (this rank's slides with ``part``)."""
        ks, plans = plan.ks, plan.plans
        device = self.device
        batched, n_batch = len(stores) > 1, len(stores)
        caches = self._fill(stores, ks, generator, part)
        z_shape = None
        if part is not None:  # this rank's slides of the batch, padded to the whole batch's Z shape
            z_shape = self.head.z_shape([self.head.layout(store.grid).shape for store in stores]) if batched else None
            stores = [stores[b] for b in part]
            ns, ks, ys = [ns[b] for b in part], [ks[b] for b in part], [ys[b] for b in part]
            plans = [plans[b] for b in part]
        target = torch.tensor(ys, device=device)
        scale = self._live_scale(ns, ks, caches, device)
        layouts = [self.head.layout(store.grid).to(device) for store in stores]
        log.debug(
            "patchgd batch of %d: n=%s tiles, Z %s, k=%s, zeta=%d, windows=%s",
            len(stores), ns, [lay.shape for lay in layouts], ks, plan.zeta, plan.windows,
        )
        return _LiveBatch(stores, plans, ks, caches, layouts, target, scale, device, batched, z_shape, n_batch, part is not None)

    def _live_scale(self, ns: list[int], ks: list[int], caches: list[Tensor], device: torch.device) -> float | Tensor:
        """The factor on the gradient entering the live embeddings: n / k (``backbone_scale: full``) or 1;
        one per live row when the slides' factors differ."""
        scales = [n / k if self.cfg.backbone_scale == "full" else 1.0 for n, k in zip(ns, ks)]
        if len(set(scales)) <= 1:
            return scales[0] if scales else 1.0
        per_row = torch.repeat_interleave(torch.tensor(scales, dtype=torch.float64), torch.tensor(ks))
        return per_row.to(device=device, dtype=caches[0].dtype)[:, None]

    def _inner_iteration(self, b: _LiveBatch, j: int, length: int) -> float:
        """Inner iteration ``j``: re-embed its live tiles with gradient, run the head over Z, backpropagate
        ``loss / length`` (the window's length), write the live embeddings into the caches; return the loss."""
        if not b.stores:  # data-parallel: no slide of this batch on this rank
            return 0.0
        device = b.device
        idx = [plan[j].to(device) for plan in b.plans]
        x = torch.cat([tiles_to_tensor(st.read(plan[j].numpy()), device=device, stain=getattr(st, "stain", None))
                       for st, plan in zip(b.stores, b.plans)])
        live = self.encoder(x).to(b.caches[0].dtype)
        scale = b.scale
        if not isinstance(scale, float) or scale != 1.0:
            live.register_hook(lambda g, s=scale: g * s)
        parts = live.split(b.ks) if len(b.stores) > 1 else [live]
        zs = [cache.index_copy(0, i, p) for cache, i, p in zip(b.caches, idx, parts)]
        logits, aux = self._logits(b, zs)
        # the mean over the batch's slides (with part: this rank's share of it)
        if not b.sharded:
            loss = F.cross_entropy(logits, b.target)
        else:
            loss = F.cross_entropy(logits, b.target, reduction="sum") / b.n_batch
        if aux is not None:
            loss = loss + aux
        with autocast_off():
            (loss / length).backward()
        with torch.no_grad():
            for cache, i, p in zip(b.caches, idx, parts):
                cache.index_copy_(0, i, p.detach())
        return float(loss.detach())

    def _logits(self, b: _LiveBatch, zs: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """The head on the slides' embeddings ``zs``: ``(logits [B, C], auxiliary loss or None)``."""
        if not b.batched:
            out = self.head(zs[0], layout=b.layouts[0])
            return out.logits[None], out.aux_loss
        z_grid, mask = self.head.batch_z(zs, b.layouts)
        if b.z_shape is not None:  # the shape the single process pads to (heads need not be pad-invariant)
            pad = (0, b.z_shape[1] - z_grid.shape[3], 0, b.z_shape[0] - z_grid.shape[2])
            z_grid, mask = F.pad(z_grid, pad), F.pad(mask, pad)
        return self.head.forward_z(z_grid, mask), None


@dataclass
class _LiveBatch:
    """This process's slides of a batch during its inner iterations (all of them without ``part``).

    ``caches[b]``: slide b's tile embeddings [n, D], updated in place; ``scale``: the live
    embeddings' gradient factor; ``batched``: the whole batch has several slides (the head runs on
    padded Z blocks); ``z_shape``: the whole batch's Z shape when sharded; ``n_batch``: the whole
    batch's size; ``sharded``: only a part of the batch is here (data-parallel).
    """

    stores: list[TileStoreLike]
    plans: list[list[Tensor]]
    ks: list[int]
    caches: list[Tensor]
    layouts: list[GridLayout]
    target: Tensor
    scale: float | Tensor
    device: torch.device
    batched: bool
    z_shape: tuple[int, int] | None
    n_batch: int
    sharded: bool
