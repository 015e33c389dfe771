"""The old import path of :mod:`wsi_pipeline.checkpoints.files` and :mod:`wsi_pipeline.inference.trained` (kept for scripts written against an earlier release)."""

from wsi_pipeline.checkpoints.files import *  # noqa: F403
from wsi_pipeline.inference.trained import TrainedModel, load_trained_model  # noqa: F401
