"""Choosing the compute device, the one rule every stage uses."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_CHOICES", "check_device", "resolve_device"]

#: Device names accepted by ``train.device`` in a pipeline YAML and by every command's ``--device``;
#: ``cuda:<index>`` (e.g. ``cuda:1``) picks one GPU. ``auto``: CUDA when present, else Apple MPS, else CPU.
DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")


def check_device(name: str, where: str = "device") -> str:
    """Return ``name`` when it is one of :data:`DEVICE_CHOICES` or ``cuda:<index>``; ValueError naming ``where`` otherwise."""
    if name in DEVICE_CHOICES or re.fullmatch(r"cuda:\d+", name):
        return name
    raise ValueError(f"{where}={name!r}; expected one of {', '.join(DEVICE_CHOICES)} or cuda:<index>")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/None -> CUDA when present, else Apple MPS when present, else CPU; other names are checked.

    Raises ``ValueError`` when CUDA is asked for on a machine without it.
    """
    import torch  # here, so that the device names above are read without importing torch (``--help``)

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
