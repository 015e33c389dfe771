"""Attention-based MIL (Ilse et al. 2018) in its pathology form (CLAM-SB without instance clustering).

Each instance embedding ``z_i`` is projected to ``h_i = Dropout(ReLU(W z_i))`` (``hidden`` wide), or,
with ``projection=False`` (the paper's own form), used as it is: ``h_i = z_i``.
Attention scores are ``s_i = w^T tanh(V h_i)`` (non-gated) or
``s_i = w^T (tanh(V h_i) * sigmoid(U h_i))`` (gated), with dropout on both branches; the weights
``a = softmax(s)`` over the n instances pool ``h = sum_i a_i h_i``, and a linear layer gives the
slide logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from wsi_pipeline.models.aggregators.base import MILOutput, check_bag

__all__ = ["ABMIL"]


class ABMIL(nn.Module):
    """Gated (default) or non-gated attention MIL.

    Parameters
    ----------
    in_dim : feature size D of the instance embeddings.
    n_classes : number of classes C.
    hidden : width of the instance projection (512 in the pathology default).
    attn_dim : width of the attention branches (256; 384 is CLAM's "big").
    gated : gated attention (tanh * sigmoid) when True, tanh only when False.
    dropout : dropout after the projection and on both attention branches.
    projection : the Linear + ReLU + dropout projection before attention (the pathology form,
        default). ``False`` is Ilse et al.'s own operator: attention and pooling on the instance
        embeddings themselves (``hidden`` is then ignored: the pooled width is ``in_dim``).

    Forward returns :class:`MILOutput` with ``attention`` = the softmax weights [n] (sum 1, in
    the order of the input rows) and ``attention_raw`` = the pre-softmax scores [n].
    """

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        *,
        hidden: int = 512,
        attn_dim: int = 256,
        gated: bool = True,
        dropout: float = 0.25,
        projection: bool = True,
    ) -> None:
        super().__init__()
        self.in_dim, self.n_classes, self.gated = int(in_dim), int(n_classes), bool(gated)
        if not projection:
            hidden = self.in_dim
        self.project: nn.Module = (nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout)) if projection
                                   else nn.Identity())
        self.attn_tanh = nn.Sequential(nn.Linear(hidden, attn_dim), nn.Tanh(), nn.Dropout(dropout))
        self.attn_gate = (
            nn.Sequential(nn.Linear(hidden, attn_dim), nn.Sigmoid(), nn.Dropout(dropout)) if gated else None
        )
        self.attn_score = nn.Linear(attn_dim, 1)
        self.classifier = nn.Linear(hidden, n_classes)

    def pool(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(pooled [hidden], weights [n], raw scores [n])`` for a bag ``z`` [n, in_dim]."""
        check_bag(z, self.in_dim, "abmil")
        h = self.project(z)
        a = self.attn_tanh(h)
        if self.attn_gate is not None:
            a = a * self.attn_gate(h)
        raw = self.attn_score(a).squeeze(-1)
        weights = torch.softmax(raw, dim=0)
        return weights @ h, weights, raw

    def forward(self, z: Tensor, **kw: object) -> MILOutput:
        """Aggregate one bag ``z`` [n, in_dim]; extra keywords (e.g. ``label``) are ignored."""
        pooled, weights, raw = self.pool(z)
        return MILOutput(logits=self.classifier(pooled), attention=weights, attention_raw=raw)
