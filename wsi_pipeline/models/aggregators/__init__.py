"""MIL aggregators: one bag of instance embeddings [n, D] -> :class:`MILOutput` (logits [C], attention [n]).

Registered: ``abmil`` (gated or plain attention), ``dtfd``, ``transmil``, and the fixed pooling
operators ``mean`` and ``max`` (:mod:`wsi_pipeline.models.aggregators.pooling`).

Every aggregator is built by name with :func:`build_aggregator` (names from :data:`AGGREGATORS`)
and has ``forward(z: Tensor [n, D], **kw) -> MILOutput``. Keywords an aggregator does not use
are ignored; ``label`` lets DTFD compute its tier-1 ``aux_loss``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from wsi_pipeline.models.aggregators.abmil import ABMIL
from wsi_pipeline.models.aggregators.base import MILOutput
from wsi_pipeline.models.aggregators.dtfd import DTFD
from wsi_pipeline.models.aggregators.pooling import MaxPoolMIL, MeanPoolMIL
from wsi_pipeline.models.aggregators.transmil import TransMIL
from wsi_pipeline.models.registry import Registry
from wsi_pipeline.failures import ConfigTypeError

__all__ = ["AGGREGATORS", "MILOutput", "build_aggregator", "ABMIL", "DTFD", "MaxPoolMIL", "MeanPoolMIL", "TransMIL"]

#: Aggregator factories by name: ``factory(in_dim, n_classes, **options) -> nn.Module``.
AGGREGATORS: Registry = Registry("aggregator")
AGGREGATORS.register("abmil")(ABMIL)
AGGREGATORS.register("dtfd")(DTFD)
AGGREGATORS.register("transmil")(TransMIL)
AGGREGATORS.register("mean")(MeanPoolMIL)
AGGREGATORS.register("max")(MaxPoolMIL)


def build_aggregator(name: str, in_dim: int, n_classes: int, **options: Any) -> nn.Module:
    """Build the aggregator ``name`` for ``in_dim``-wide embeddings and ``n_classes`` classes.

    ``options`` are the aggregator's keyword options (e.g. ``gated=False`` for ``abmil``,
    ``distill="maxmins", ipg=2`` for ``dtfd``, ``num_landmarks=128`` for ``transmil``); an unknown
    option raises ``TypeError`` naming it.
    """
    factory = AGGREGATORS.get(name)
    if int(in_dim) < 1 or int(n_classes) < 1:
        raise ValueError(f"build_aggregator({name!r}): in_dim={in_dim} and n_classes={n_classes} must be >= 1")
    try:
        return factory(int(in_dim), int(n_classes), **options)
    except TypeError as e:
        raise ConfigTypeError(f"build_aggregator({name!r}): bad option in {sorted(options)}: {e}") from e
