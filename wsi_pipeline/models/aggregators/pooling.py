"""Mean and max pooling over instance embeddings: the fixed MIL pooling operators of Ilse et al. 2018.

Both follow the same shape as :class:`~wsi_pipeline.models.aggregators.abmil.ABMIL`, so that the
pooling operator is the only difference between them: each instance embedding ``z_i`` is
projected to ``h_i = Dropout(ReLU(W z_i))`` (``hidden`` wide), the projections are pooled over
the n instances, elementwise, and a linear layer gives the slide logits. With ``projection=False``
(the paper's embedding-level pooling) the instance embeddings are pooled as they are (``h_i = z_i``).

- ``mean``: ``h = (1/n) sum_i h_i``. Every instance contributes equally, so ``attention`` is
  uniform, ``1/n`` for each instance.
- ``max``: ``h_d = max_i h_{i,d}`` for each of the ``hidden`` dimensions d. ``attention`` is the
  share of the pooled dimensions an instance supplies: ``a_i = #{d : argmax_j h_{j,d} = i} / hidden``
  (sums to 1; an instance that wins no dimension has no influence on the logits and scores 0;
  ties go to the first instance, as :func:`torch.max` picks). The gradient reaches only the
  winning instance of each dimension.

Neither has learned attention parameters; ``attention_raw`` is None.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from wsi_pipeline.models.aggregators.base import MILOutput, check_bag

__all__ = ["MaxPoolMIL", "MeanPoolMIL"]


class _PoolMIL(nn.Module):
    """Projection + a fixed pooling operator + linear classifier (subclasses define :meth:`pool`)."""

    name = ""

    def __init__(self, in_dim: int, n_classes: int, *, hidden: int = 512, dropout: float = 0.25,
                 projection: bool = True) -> None:
        super().__init__()
        if not projection:
            hidden = int(in_dim)
        if int(hidden) < 1:
            raise ValueError(f"{self.name}: hidden={hidden}; expected a width >= 1")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"{self.name}: dropout={dropout}; expected a probability in [0, 1)")
        self.in_dim, self.n_classes, self.hidden = int(in_dim), int(n_classes), int(hidden)
        self.project: nn.Module = (nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout)) if projection
                                   else nn.Identity())
        self.classifier = nn.Linear(hidden, n_classes)

    def pool(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(pooled [hidden], per-instance score [n])`` of projected instances ``h`` [n, hidden]."""
        raise NotImplementedError

    def forward(self, z: Tensor, **kw: object) -> MILOutput:
        """Aggregate one bag ``z`` [n, in_dim]; extra keywords (e.g. ``label``) are ignored."""
        check_bag(z, self.in_dim, self.name)
        pooled, scores = self.pool(self.project(z))
        return MILOutput(logits=self.classifier(pooled), attention=scores)


class MeanPoolMIL(_PoolMIL):
    """Mean pooling: ``h = mean_i h_i``; ``attention`` uniform (1/n each)."""

    name = "mean"

    def pool(self, h: Tensor) -> tuple[Tensor, Tensor]:
        n = h.shape[0]
        return h.mean(dim=0), torch.full((n,), 1.0 / n, dtype=h.dtype, device=h.device)


class MaxPoolMIL(_PoolMIL):
    """Elementwise max pooling: ``h_d = max_i h_{i,d}``; ``attention`` = each instance's share of the winning dimensions."""

    name = "max"

    def pool(self, h: Tensor) -> tuple[Tensor, Tensor]:
        pooled, winner = h.max(dim=0)
        counts = torch.bincount(winner, minlength=h.shape[0]).to(h.dtype)
        return pooled, counts / h.shape[1]
