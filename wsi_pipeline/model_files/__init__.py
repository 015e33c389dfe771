"""Reading torch model files: one loader for every ``.pt`` / ``.pth`` / ``.bin`` the package reads.

- :mod:`wsi_pipeline.model_files.pickle_scan`: the pickle screen (:func:`scan_model_file`), refusing a file that
  allocates memory from a number (``bytearray(10**12)``) before anything is unpickled;
- :mod:`wsi_pipeline.model_files.loader`: :func:`load_torch_file`, the screen then ``torch.load(weights_only=True)``.

A helper without imports from the rest of the package, so that models (encoder weights), checkpoints (run and
tissue checkpoints) and every stage above them read model files the same way.
"""

from wsi_pipeline.model_files.loader import load_torch_file
from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError, scan_model_file

__all__ = ["UnsafeModelFileError", "load_torch_file", "scan_model_file"]
