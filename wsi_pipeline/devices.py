"""Choosing the compute device, the one rule every stage uses."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/None -> CUDA when present, else Apple MPS when present, else CPU; other names are checked.

    Raises ``ValueError`` when CUDA is asked for on a machine without it.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available on this machine; use device auto or cpu")
    return dev
