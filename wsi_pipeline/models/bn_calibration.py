"""Re-estimating BatchNorm running statistics on data ("precise BN"), before they are frozen.

A randomly initialised encoder (no pretrained weights: the demo, or a user without network
access) has running statistics of 0 mean and unit variance that do not describe its
activations. Frozen BatchNorm, the exact choice for accumulation and PatchGD, would then
normalise with the wrong numbers and the embeddings come out nearly constant. Calibration runs
the encoder in training mode without gradient over sample batches with a cumulative moving
average (``momentum=None``), so each running statistic becomes the mean over batches of the
batch statistic; parameters are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["calibrate_batchnorm"]


@torch.no_grad()
def calibrate_batchnorm(encoder: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Reset and re-estimate the running statistics of every BatchNorm layer of ``encoder``.

    Parameters
    ----------
    encoder : module; its training flag and every layer's momentum are restored afterwards.
    batches : input batches (already on the encoder's device), e.g. [k, 3, T, T] tiles.

    Returns
    -------
    Number of batches seen (0 leaves the statistics reset to their initial values).
    """
    norms = [m for m in encoder.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    was_training = encoder.training
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    encoder.train()
    n = 0
    try:
        for x in batches:
            encoder(x)
            n += 1
    finally:
        for m, mom in zip(norms, momenta):
            m.momentum = mom
        encoder.train(was_training)
    return n
