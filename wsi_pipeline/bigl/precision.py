"""Precision policy of Big-Layers under autocast: the one plain PyTorch applies to the same layers.

Plain ``torch.autocast(device_type, dtype)`` runs a convolution in the autocast dtype (its
float32 input and weight are cast; the output is in that dtype) and its backward in the same
dtype, the gradient reaching a float32 parameter being cast back to float32. BatchNorm is on no
autocast list: it runs on its input's dtype, with statistics and arithmetic in float32 when the
input is bfloat16/float16 (PyTorch's accumulate type), output in the input's dtype. ReLU,
max pooling and the residual add keep their input's dtype. float64 tensors are never cast.

Big-Layers take the decision once per call, outside their autograd Function, from the autocast
state of the *compute* device (``runner.device``), and pass it to both passes; the chunk loop
itself runs with autocast off (:class:`~wsi_pipeline.bigl.chunk_loop.ChunkRunner`), so nothing is
cast twice or differently in the backward pass.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype", "math_dtype"]


def autocast_dtype(device: torch.device, *tensors: torch.Tensor | None) -> torch.dtype | None:
    """The dtype plain autocast would run a convolution in on ``device``, or None (no cast).

    None when autocast is off for ``device.type`` (or the device type has no autocast, e.g. a
    ``meta`` dry run) or when any given floating tensor is float64 (autocast leaves float64
    alone).
    """
    kind = device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return None
    if any(t is not None and (not t.is_floating_point() or t.dtype == torch.float64) for t in tensors):
        return None
    return torch.get_autocast_dtype(kind)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of BatchNorm on ``dtype`` data: float32 for bfloat16/float16, else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)
