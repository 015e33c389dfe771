"""Tasks as registered plugins: what a method predicts and everything that depends on it.

:class:`~wsi_pipeline.tasks.base.Task` is the contract, :data:`~wsi_pipeline.tasks.base.TASKS` the
registry (``classification``, ``survival``, ``regression``), :func:`get_task` the way in; the
losses and metrics the tasks use live beside them (:mod:`.losses`, :mod:`.metrics`,
:mod:`.endpoint_metrics`, :mod:`.survival_metrics`).
"""

from wsi_pipeline.tasks import classification, regression, survival  # noqa: F401  (registers the built-in tasks)
from wsi_pipeline.tasks.base import LOWER_IS_BETTER, TASKS, Endpoint, Task, get_task, register_task, task_names

__all__ = ["Endpoint", "LOWER_IS_BETTER", "TASKS", "Task", "get_task", "register_task", "task_names"]
