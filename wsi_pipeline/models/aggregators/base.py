"""The output every MIL aggregator returns, and small helpers shared by the aggregators."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MILOutput", "check_bag"]


@dataclass
class MILOutput:
    """What an aggregator's ``forward(z)`` returns for one bag of n instances.

    Attributes
    ----------
    logits : Tensor [C]
        Slide-level class scores (before softmax).
    attention : Tensor [n]
        One score per instance, in the order of the input rows, for heatmaps. Its meaning is
        documented by each aggregator (ABMIL: softmax attention weights; DTFD: tier-1
        attention weights within each pseudo-bag; TransMIL: last-layer CLS-to-token attention).
    aux_loss : Tensor [] or None
        An extra loss term the aggregator wants added to the task loss (DTFD: mean tier-1
        cross-entropy over pseudo-bags); only computed when the label is passed to forward.
    instance_scores : Tensor [n, C] or None
        Per-instance class scores when the method defines them (DTFD: CAM-like probabilities).
    attention_raw : Tensor [n] or None
        The pre-softmax attention scores behind ``attention`` when the method has them (ABMIL,
        DTFD tier 1); heatmaps that want an unnormalised score use these.
    """

    logits: Tensor
    attention: Tensor
    aux_loss: Tensor | None = None
    instance_scores: Tensor | None = None
    attention_raw: Tensor | None = None


def check_bag(z: Tensor, in_dim: int, name: str) -> None:
    """Raise ``ValueError`` unless ``z`` is a float [n, in_dim] bag with n >= 1."""
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"{name}: z must be a torch.Tensor [n, {in_dim}]; got {type(z).__name__}")
    if z.ndim != 2 or z.shape[1] != in_dim:
        raise ValueError(
            f"{name}: z must have shape [n, {in_dim}] (one row per instance); got {tuple(z.shape)}. "
            f"Pass a single bag (no batch dimension) whose feature size matches in_dim={in_dim}."
        )
    if z.shape[0] < 1:
        raise ValueError(f"{name}: empty bag (n=0); a bag needs at least one instance")
