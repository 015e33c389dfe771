"""Tasks as registered plugins: what a method predicts and everything that depends on it.

:class:`~wsi_pipeline.tasks.base.Task` is the contract, :data:`~wsi_pipeline.tasks.base.TASKS` the
registry (``classification``, ``survival``, ``regression``, ``multilabel``), :func:`get_task` the way in; the
losses and metrics the tasks use live beside them (:mod:`.losses`, :mod:`.metrics`,
:mod:`.endpoint_metrics`, :mod:`.survival_metrics`).
"""

from wsi_pipeline.tasks import classification, multilabel, regression, survival  # noqa: F401  (registers the built-in tasks)
from wsi_pipeline.tasks.base import LOWER_IS_BETTER, TASKS, Endpoint, Task, get_task, register_task, task_key, task_names

#: Validation metrics of the built-in tasks without classes (``val_<name>`` columns), by task name.
ENDPOINT_VALIDATION_METRICS: dict[str, tuple[str, ...]] = {
    n: get_task(n).validation_metrics for n in task_names() if not get_task(n).has_classes}

__all__ = ["ENDPOINT_VALIDATION_METRICS", "Endpoint", "LOWER_IS_BETTER", "TASKS", "Task", "get_task", "register_task", "task_key", "task_names"]
