"""The old import path of :mod:`wsi_pipeline.methods.models` (kept for scripts written against an earlier release)."""

from wsi_pipeline.methods.models import *  # noqa: F403
