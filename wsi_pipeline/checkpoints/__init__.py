"""Run checkpoints: the typed, versioned :class:`RunCheckpoint` and the file layer under it.

- :mod:`wsi_pipeline.checkpoints.run`: :class:`RunCheckpoint` (its fields, ``to_state`` / ``from_state``, schema version);
- :mod:`wsi_pipeline.checkpoints.migrations`: every migration of older checkpoint layouts, one step per version;
- :mod:`wsi_pipeline.checkpoints.files`: writing and reading a checkpoint file (atomic, ``weights_only``, the
  SHA-256 beside it and the digest inside it), :func:`save_run_checkpoint` / :func:`load_run_checkpoint`.

A trained model is loaded from a checkpoint by :func:`wsi_pipeline.inference.trained.load_trained_model`.
"""

from wsi_pipeline.checkpoints.files import load_run_checkpoint, save_run_checkpoint
from wsi_pipeline.checkpoints.run import RunCheckpoint

__all__ = ["RunCheckpoint", "load_run_checkpoint", "save_run_checkpoint"]
