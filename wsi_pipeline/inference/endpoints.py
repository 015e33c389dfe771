"""The old import path of :mod:`wsi_pipeline.methods.endpoints` (kept for scripts written against an earlier release)."""

from wsi_pipeline.methods.endpoints import *  # noqa: F403
