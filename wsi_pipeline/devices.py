"""Choosing the compute device, the one rule every stage uses, and the device names every command accepts."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICES", "DEVICE_HELP", "autocast_off", "bf16_active", "bf16_autocast", "check_device", "cpu_has_bf16", "resolve_device"]

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


#: CPU instruction-set flags (Linux ``/proc/cpuinfo``) of native bfloat16 arithmetic: AVX-512 BF16
#: (AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids) and AMX (Intel Sapphire Rapids on).
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has native bfloat16 dot-product instructions (see ``_BF16_CPU_FLAGS``).

    Read from the ``flags`` line of ``cpuinfo`` (Linux); False where that file is absent or
    unreadable (other systems), so that bfloat16 is never emulated on a CPU without the instructions,
    where it would run slower than float32.
    """
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(_BF16_CPU_FLAGS & set(line.partition(":")[2].split()))
    return False


def bf16_autocast(enabled: bool, device: torch.device | str) -> AbstractContextManager[Any]:
    """bfloat16 autocast on ``device`` when ``enabled``, where it runs natively; nothing otherwise.

    CUDA: always (when enabled). CPU: where :func:`cpu_has_bf16` (oneDNN then runs convolutions and
    matrix products on bfloat16 inputs with float32 accumulation; on this project's AMD EPYC a
    training step of the attention-MIL paper's small network runs about 2x faster,
    ``make bench-small-cnn``). Other devices (Apple MPS): nothing. Weights, gradients and the
    optimiser stay float32; autocast's own lists decide which operations run in bfloat16.
    """
    import torch

    if bf16_active(enabled, device):
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


def bf16_active(enabled: bool, device: torch.device | str) -> bool:
    """Whether :func:`bf16_autocast` casts on ``device`` (``enabled`` and the device runs bfloat16 natively)."""
    import torch

    kind = torch.device(device).type
    return bool(enabled) and (kind == "cuda" or (kind == "cpu" and cpu_has_bf16()))


#: Device types whose autocast :func:`autocast_off` switches off (those this project autocasts on).
_AUTOCAST_TYPES = ("cpu", "cuda")


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast switched off inside (for the device types where it is on), whatever encloses it.

    For every backward pass of training, which must compute in the dtypes of its forward. A backward of
    CPU tensors runs on the calling thread, and an autocast region around it re-casts the backward's
    matrix products to bfloat16, also those of layers that ran in float32 (measured: a float32
    linear layer's weight gradient off by 3e-3 relative under ``torch.autocast("cpu", bfloat16)``
    against 4e-6 without); CUDA's backward runs on the device's own threads, outside it. PyTorch's
    guidance is the same: backward outside autocast; the autograd graph keeps the forward's dtypes.
    """
    import torch

    with contextlib.ExitStack() as stack:
        for kind in _AUTOCAST_TYPES:
            if torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield
