"""The one reader of torch model files: every ``.pt`` / ``.pth`` / ``.bin`` the package loads comes through here.

:func:`load_torch_file` first screens the file's pickle (:func:`~wsi_pipeline.model_files.pickle_scan.scan_model_file`:
no callable that allocates from a number, no count above 2**31), then reads it with
``torch.load(weights_only=True)``. Its callers: run and tissue checkpoints
(:func:`~wsi_pipeline.checkpoints.files.load_checkpoint`: ``train`` resume, ``eval``, ``predict --model``,
``tile --tissue-model``, ``tissue predict``), encoder weights (``features --weights``, ``encoder.weights``:
:func:`~wsi_pipeline.models.encoders.load_torchvision_weights`,
:func:`~wsi_pipeline.models.foundation.load_state_file`, :func:`~wsi_pipeline.models.small_cnn.load_state_file`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from wsi_pipeline.model_files.pickle_scan import scan_model_file

__all__ = ["load_torch_file"]


def load_torch_file(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, map_location, weights_only=True)`` after the pickle screen.

    Raises
    ------
    UnsafeModelFileError : (a ``ValueError``) the pickle allocates from a number; one line naming the file and
        what was found, raised before ``torch.load`` reads anything.
    Whatever ``torch.load`` raises for the rest (a pickled object refused by ``weights_only``, a truncated file);
    the callers turn those into messages naming the file.
    """
    scan_model_file(path)
    return torch.load(path, map_location=map_location, weights_only=True)
