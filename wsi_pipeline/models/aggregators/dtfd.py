"""DTFD-MIL (Zhang et al., CVPR 2022): double-tier feature distillation over random pseudo-bags.

One forward on a bag of n instances:

1. ``m_i = ReLU(W z_i)`` (``DimReduction``, no bias, 512 wide).
2. The instances are shuffled and split into ``n_groups`` pseudo-bags whose sizes differ by at
   most one (fewer pseudo-bags when n < ``n_groups``: one instance each). Each pseudo-bag gets a
   gated-attention pooling (softmax within the pseudo-bag) and tier-1 logits.
3. CAM-like instance probabilities: ``cam[c, i] = W1_c . (a_i m_i)`` with ``W1`` the tier-1
   classifier weight (no bias), softmax over classes per instance. Instances are ranked by the
   probability of the pseudo-bag's *predicted* class (argmax of its tier-1 logits), never the
   true label and never a fixed class, so multi-class grading (ISUP 0-5) works.
4. Distillation builds the tier-2 bag, one block per pseudo-bag: ``maxs`` = the ``ipg``
   top-ranked ``m_i``; ``maxmins`` = the ``ipg`` top and ``ipg`` bottom ``m_i`` (the whole
   pseudo-bag when it has at most ``2 ipg`` instances, so nothing is taken twice); ``afs`` = the
   pooled vector.
5. Tier 2: gated attention over the tier-2 bag and a linear classifier -> ``logits``.

Decisions (see ``docs/methods.md``):

- The tier-2 input is detached by default (``detach_tier2=True``). The reference trains tier 1
  with the tier-1 loss only (it steps the tier-1 optimiser before backpropagating tier 2, which
  crashes with "modified by an inplace operation" on current PyTorch); detaching is exactly that
  training signal without the crash. Consequence: gradients reach the dimension reduction and
  tier 1 (and, end to end, the encoder) only through ``aux_loss``, so the training loss must
  include it (``classification_loss`` in :mod:`wsi_pipeline.training.accumulate` does).
- ``aux_loss`` = mean tier-1 cross-entropy over the pseudo-bags, computed only when
  ``forward(z, label=...)`` receives the label (the pseudo-bags take the slide label).
- ``attention`` (the per-instance score for heatmaps) = the tier-1 attention score softmaxed
  over the whole bag. The raw tier-1 score of an instance depends on that instance only, so this
  map does not depend on the random split; ``attention_raw`` holds the raw scores and
  ``instance_scores`` the CAM probabilities [n, C] (which do depend on the split).
- ``ipg = 0`` is rejected (the reference then silently takes whole pseudo-bags for MaxMinS).
- Pseudo-bags: in training mode they come from ``generator`` when one is passed to forward,
  else from torch's global RNG; in eval mode from a generator seeded with ``eval_seed`` on every
  call, so predictions are reproducible.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsi_pipeline.models.aggregators.base import MILOutput, check_bag

__all__ = ["DTFD", "DISTILL_MODES", "GatedAttention", "pseudo_bags"]

#: Tier-2 feature distillation modes.
DISTILL_MODES: tuple[str, ...] = ("maxs", "maxmins", "afs")


class GatedAttention(nn.Module):
    """Gated attention scores ``w^T (tanh(V m) * sigmoid(U m))`` [n] for inputs [n, dim]."""

    def __init__(self, dim: int, attn_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.v = nn.Sequential(nn.Linear(dim, attn_dim), nn.Tanh())
        self.u = nn.Sequential(nn.Linear(dim, attn_dim), nn.Sigmoid())
        self.drop = nn.Dropout(dropout)
        self.w = nn.Linear(attn_dim, 1)

    def forward(self, m: Tensor) -> Tensor:
        return self.w(self.drop(self.v(m) * self.u(m))).squeeze(-1)


def pseudo_bags(n: int, n_groups: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """Shuffle ``range(n)`` and split it into ``min(n_groups, n)`` index tensors whose sizes differ by at most 1.

    The pieces partition ``range(n)`` (every index exactly once). ``generator`` (a CPU generator)
    makes the split reproducible.
    """
    if n < 1:
        raise ValueError(f"pseudo_bags: n={n}; a bag needs at least one instance")
    if n_groups < 1:
        raise ValueError(f"pseudo_bags: n_groups={n_groups}; use at least 1 pseudo-bag")
    perm = torch.randperm(n, generator=generator)
    return list(torch.tensor_split(perm, min(n_groups, n)))


class DTFD(nn.Module):
    """Double-tier feature distillation MIL.

    Parameters
    ----------
    in_dim : feature size D of the instance embeddings.
    n_classes : number of classes C.
    hidden : width of the dimension reduction (512).
    attn_dim : width of both gated attentions (128).
    n_groups : number of pseudo-bags per bag (``numGroup``, 4).
    distill : tier-2 distillation, one of :data:`DISTILL_MODES` (``afs``, the reference default).
    ipg : instances per group taken by ``maxs`` / ``maxmins`` (>= 1).
    dropout : dropout inside the attentions and before the classifiers (0 in the reference).
    detach_tier2 : detach the tier-2 input (default, see the module docstring).
    eval_seed : seed of the pseudo-bag split in eval mode.
    """

    #: trains classification only: its tier-1 loss is a cross-entropy on the slide's class
    classes_only: ClassVar[bool] = True

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        hidden: int = 512,
        attn_dim: int = 128,
        n_groups: int = 4,
        distill: str = "afs",
        ipg: int = 1,
        dropout: float = 0.0,
        detach_tier2: bool = True,
        eval_seed: int = 0,
    ) -> None:
        super().__init__()
        distill = str(distill).lower()
        if distill not in DISTILL_MODES:
            raise ValueError(f"dtfd: distill={distill!r}; expected one of {DISTILL_MODES}")
        if int(ipg) < 1:
            raise ValueError(
                f"dtfd: ipg={ipg} (instances per group) must be >= 1; ipg=0 would select nothing "
                "(the reference silently takes the whole pseudo-bag). Use ipg=1 or more."
            )
        if int(n_groups) < 1:
            raise ValueError(f"dtfd: n_groups={n_groups} must be >= 1")
        self.in_dim, self.n_classes = int(in_dim), int(n_classes)
        self.n_groups, self.distill, self.ipg = int(n_groups), distill, int(ipg)
        self.detach_tier2, self.eval_seed = bool(detach_tier2), int(eval_seed)
        self.reduce = nn.Sequential(nn.Linear(in_dim, hidden, bias=False), nn.ReLU())
        self.attn1 = GatedAttention(hidden, attn_dim, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.cls1 = nn.Linear(hidden, n_classes)
        self.attn2 = GatedAttention(hidden, attn_dim, dropout)
        self.drop2 = nn.Dropout(dropout)
        self.cls2 = nn.Linear(hidden, n_classes)

    def _select(self, probs: Tensor) -> Tensor:
        """Positions (within one pseudo-bag) to distil, ranked by ``probs`` [k] (descending)."""
        k = probs.shape[0]
        order = torch.argsort(probs, descending=True)
        if self.distill == "maxs":
            return order[: min(self.ipg, k)]
        if k <= 2 * self.ipg:  # maxmins: top and bottom would overlap; take the pseudo-bag once
            return order
        return torch.cat([order[: self.ipg], order[-self.ipg :]])

    def forward(
        self,
        z: Tensor,
        label: int | Tensor | None = None,
        generator: torch.Generator | None = None,
        **kw: object,
    ) -> MILOutput:
        """Aggregate one bag ``z`` [n, in_dim].

        ``label`` (class index) enables ``aux_loss`` (mean tier-1 cross-entropy); ``generator``
        (CPU) draws the pseudo-bags in training mode. Other keywords are ignored.
        """
        check_bag(z, self.in_dim, "dtfd")
        n = z.shape[0]
        if not self.training:
            generator = torch.Generator().manual_seed(self.eval_seed)
        groups = [g.to(z.device) for g in pseudo_bags(n, self.n_groups, generator)]

        m = self.reduce(z)
        raw = self.attn1(m)  # [n]; depends on instance i only
        logits1, tier2, cam_rows = [], [], []
        for idx in groups:
            mg = m[idx]
            a = torch.softmax(raw[idx], dim=0)
            weighted = a.unsqueeze(-1) * mg  # [k, hidden]
            pooled = weighted.sum(0)
            lg = self.cls1(self.drop1(pooled))
            logits1.append(lg)
            # CAM: class scores of each attention-weighted instance, without the bias
            cam = torch.softmax(weighted @ self.cls1.weight.t(), dim=1)  # [k, C]
            cam_rows.append(cam)
            if self.distill == "afs":
                tier2.append(pooled.unsqueeze(0))
            else:
                pred = int(lg.detach().argmax())
                tier2.append(mg[self._select(cam[:, pred].detach())])
        t2 = torch.cat(tier2, 0)
        if self.detach_tier2:
            t2 = t2.detach()
        a2 = torch.softmax(self.attn2(t2), dim=0)
        logits = self.cls2(self.drop2(a2 @ t2))

        order = torch.cat(groups)
        inst = torch.empty(n, self.n_classes, dtype=m.dtype, device=m.device)
        inst[order] = torch.cat(cam_rows, 0).detach()

        aux = None
        if label is not None:
            target = torch.as_tensor(label, dtype=torch.long, device=z.device).reshape(1)
            stacked = torch.stack(logits1, 0)
            aux = F.cross_entropy(stacked, target.expand(stacked.shape[0]))
        return MILOutput(
            logits=logits,
            attention=torch.softmax(raw, dim=0),
            aux_loss=aux,
            instance_scores=inst,
            attention_raw=raw,
        )
