"""Choosing the compute device, the one rule every stage uses, and the device names every command accepts."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICES", "DEVICE_HELP", "check_device", "resolve_device"]

#: Device names accepted in ``train.device`` and by every command's ``--device`` (plus ``cuda:<i>``).
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")
DEVICE_HELP = "auto (CUDA, then Apple MPS, then CPU), cpu, cuda, cuda:<i> or mps"
_DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def check_device(name: str, where: str = "device") -> str:
    """``name`` when it is one of :data:`DEVICES` or ``cuda:<i>``; ``ValueError`` naming ``where`` otherwise.

    Usable as an argparse ``type=`` (argparse turns the ValueError into a usage error).
    """
    if not isinstance(name, str) or not _DEVICE_RE.fullmatch(name):
        raise ValueError(f"{where}={name!r}; expected {', '.join(DEVICES)} or cuda:<index>")
    return name


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/None -> CUDA when present, else Apple MPS when present, else CPU; other names are checked.

    Raises ``ValueError`` when CUDA is asked for on a machine without it.
    """
    import torch  # here, so that reading the device names (a command's --help) does not import torch

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
