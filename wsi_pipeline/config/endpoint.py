"""A method's endpoint: ``task`` (classification, survival, regression, multilabel), ``loss``, ``loss_options``
and, for a task that takes them, ``targets``.

In a method of the pipeline YAML::

    task: survival            # classification (default) | survival | regression | multilabel
    loss: cox                 # classification: cross_entropy; survival: cox | nll_discrete; regression: mse | huber
    loss_options: {ties: efron, bins: 4, huber_delta: 1.0}

A ``multilabel`` method names its binary manifest columns: ``targets: [tp53, kras]`` (loss ``bce``).

``loss`` defaults to the task's first loss (``cross_entropy``, ``cox``, ``mse``). Each option
applies to one loss (the others ignore it): ``ties`` to ``cox``, ``bins`` to ``nll_discrete``,
``huber_delta`` to ``huber``. What each loss computes: :mod:`wsi_pipeline.methods.endpoints`.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsi_pipeline.config.schema import Checked

from wsi_pipeline.config.choices import Ties

__all__ = ["LossOptions", "check_task_loss", "check_task_targets", "default_loss"]


@dataclass(frozen=True)
class LossOptions(Checked):
    """Options of the survival and regression losses.

    Attributes
    ----------
    ties : ``cox``: ``efron`` (default) or ``breslow`` handling of tied event times in the partial likelihood.
    bins : ``nll_discrete``: number K of time intervals (>= 2); the K - 1 inner edges are the
        quantiles 1/K .. (K-1)/K of the event times of the training split (computed before
        training and stored with the model).
    huber_delta : ``huber``: where the loss turns from quadratic to linear, in units of the
        training targets' standard deviation (targets are standardised with the training split's
        mean and sd, stored with the model).
    """

    ties: Ties = "efron"
    bins: int = 4
    huber_delta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bins < 2:
            raise ValueError(f"loss_options.bins={self.bins}; expected >= 2 time intervals")
        if not self.huber_delta > 0:
            raise ValueError(f"loss_options.huber_delta={self.huber_delta}; expected a value > 0")


def default_loss(task: str) -> str:
    """The loss a task trains with when ``loss`` is not given."""
    from wsi_pipeline.tasks import get_task  # the task registry imports scikit-learn: only when asked

    return get_task(task).losses[0]


def check_task_loss(task: str, loss: str | None, where: str) -> str:
    """The method's loss (``loss``, or the task's default), checked against the task.

    Raises ``ValueError`` naming ``where`` when the loss belongs to another task.
    """
    from wsi_pipeline.tasks import get_task

    losses = get_task(task).losses
    if loss is None:
        return losses[0]
    if loss not in losses:
        raise ValueError(f"{where}.loss={loss!r} does not fit task {task!r}; expected one of {list(losses)}")
    return loss


def check_task_targets(task: str, targets: tuple[str, ...], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` when the method's ``targets`` do not fit the task
    (:meth:`~wsi_pipeline.tasks.base.Task.check_method`)."""
    from wsi_pipeline.tasks import get_task

    get_task(task).check_method(targets, where)
