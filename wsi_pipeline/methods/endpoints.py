"""What a model predicts and how it is trained, from a method's config: its task's :class:`Endpoint`.

The behaviour belongs to the registered task (:mod:`wsi_pipeline.tasks`: outputs, losses, scores,
metrics); the losses are in :mod:`wsi_pipeline.tasks.losses`. Here a method's config
(``task``/``loss``/``loss_options``) becomes the aggregator's output size (:func:`endpoint_outputs`)
and, with what is learnt from the training split (discrete-time bin edges, the targets' mean and
sd), an :class:`Endpoint` (:func:`fit_endpoint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.tasks import Endpoint, get_task

__all__ = [
    "endpoint_outputs",
    "fit_endpoint",
    "plain_endpoint",
]


def _loss(method: MethodConfig) -> str:
    """The method's loss (a built config holds it; the task's default otherwise)."""
    return method.loss or get_task(method.task_key).losses[0]


def endpoint_outputs(method: MethodConfig, n_classes: int | None) -> int:
    """The aggregator's output size for a method (config only: what :class:`Endpoint` says, without data)."""
    try:
        return get_task(method.task_key).n_outputs(_loss(method), method.loss_options, n_classes)
    except ValueError as e:
        raise ValueError(f"method {method.name!r} {e}") from e


def plain_endpoint(method: MethodConfig, n_classes: int | None) -> Endpoint:
    """The method's :class:`Endpoint` without training data (the defaults of what :func:`fit_endpoint` learns)."""
    return Endpoint(task=method.task_key, loss=_loss(method), n_outputs=endpoint_outputs(method, n_classes))


def fit_endpoint(method: MethodConfig, n_classes: int | None, targets: Sequence[Any]) -> Endpoint:
    """The :class:`Endpoint` of ``method`` with what it needs from the training split's ``targets``
    (``(time, event)`` pairs for survival, values for regression; unused for classification)."""
    return get_task(method.task_key).fit(_loss(method), method.loss_options, n_classes, targets)
