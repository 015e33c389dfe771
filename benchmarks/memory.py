"""Memory meters of the benchmarks (and of the tests that bound memory).

:class:`SavedTensorMeter` counts the bytes autograd keeps for backward while a block runs
(``torch.autograd.graph.saved_tensors_hooks``), on any device, without the allocator's caching
or fragmentation in the figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SavedTensorMeter"]


class SavedTensorMeter:
    """Context manager: peak and current bytes of tensors saved for backward inside it.

    Each saved tensor counts ``numel * element_size`` bytes from when autograd saves it until
    its graph is freed (tensors shared by several nodes count once per node, so this is an
    upper bound of the true memory; it is exact as a comparison between two methods). Tensors
    whose storage is one of ``exclude``'s parameters (weights saved by convolutions) are not
    counted, so the figure is activations only.
    """

    def __init__(self, exclude: Sequence[torch.nn.Module] = ()) -> None:
        self.live = 0
        self.peak = 0
        self._skip = {p.data_ptr() for m in exclude for p in m.parameters()}

    def __enter__(self) -> SavedTensorMeter:
        meter = self

        class _Packed:
            __slots__ = ("t", "nbytes")

            def __init__(self, t: torch.Tensor) -> None:
                self.t = t
                self.nbytes = 0 if t.data_ptr() in meter._skip else t.numel() * t.element_size()
                meter.live += self.nbytes
                meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                meter.live -= self.nbytes

        self._hooks = torch.autograd.graph.saved_tensors_hooks(_Packed, lambda p: p.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
