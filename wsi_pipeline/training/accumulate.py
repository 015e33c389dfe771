"""Exact gradient accumulation through the encoder over one bag (ABMIL-ACC, generalised).

A bag of n tiles is too big to embed with gradient in one go. The gradient of the loss with
respect to the encoder parameters is ``sum_i dL/dz_i . dz_i/dtheta``, so three passes give it
exactly, for any aggregator:

1. embed all tiles in chunks without gradient -> ``Z`` [n, D];
2. make ``Z`` a leaf requiring grad, run the aggregator and the loss, backpropagate ->
   aggregator gradients and ``G = dL/dZ``;
3. for each chunk, re-embed with gradient and backpropagate ``G[chunk]`` into the encoder.

Cost: about two encoder forwards and one backward; memory: the saved activations of one chunk
(plus the aggregator's graph on [n, D]), independent of n. The reference recomputes the
aggregator per chunk instead (head cost O(n^2 / chunk)).

The encoder must compute the same function in passes 1 and 3:

- ``bn="frozen"`` (default, exact): BatchNorm layers run in eval mode (running statistics) for
  the step and get their previous mode back afterwards.
- ``bn="chunk"`` (``encoder.bn: chunk`` in a pipeline config; the ABMIL-ACC paper's setting:
  the paper's, not exact, as the gradient is that of a model normalising each chunk by its own
  statistics, not the bag by the bag's): BatchNorm layers run in train mode with the
  statistics of each chunk; both
  passes use the same chunks, so pass 3 recomputes exactly what pass 1 computed. Running
  statistics are updated ONCE per bag, with the bag-level mean and unbiased variance of each
  layer's input (merged over the chunks of pass 1), not once per chunk and pass.
- The RNG state (CPU and the encoder's CUDA device) is saved before each chunk of pass 1 and
  restored before the same chunk of pass 3, so dropout draws the same masks in both passes.
  After pass 3 the generators are set back to where they stood before it, so pass 3 consumes
  no random numbers on balance: when :func:`accumulate_step` returns, the CPU and CUDA
  generators are exactly where the encoder's single forward over the bag (pass 1) followed by
  the aggregator's forward and backward (pass 2) left them. Consecutive steps therefore draw
  fresh dropout masks (the generator is never rewound), and a step consumes the same random
  numbers as running the pass-1 chunks and the aggregator once.

Both :func:`accumulate_step` and :func:`full_step` ADD the bag's gradient to each parameter's
``.grad`` (as ``loss.backward()`` does), so a caller can accumulate several bags before one
optimiser step; zero the gradients yourself between steps. Neither steps an optimiser.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from wsi_pipeline.config.choices import ACCUMULATE_BN_MODES
from wsi_pipeline.data.tensors import DeviceTiles
from wsi_pipeline.devices import autocast_off

__all__ = ["accumulate_step", "full_step", "classification_loss", "BN_MODES"]

log = logging.getLogger(__name__)

#: BatchNorm policies of :func:`accumulate_step` ("frozen" exact, "chunk" chunk statistics).
BN_MODES: tuple[str, ...] = ACCUMULATE_BN_MODES

LossFn = Callable[[Any, Any], Tensor]


def classification_loss(output: Any, label: int | Tensor) -> Tensor:
    """The classification task's bag loss (:meth:`wsi_pipeline.tasks.classification.Classification.bag_loss`:
    cross-entropy of ``output.logits`` [C] against the class ``label``, plus ``output.aux_loss`` when set)."""
    from wsi_pipeline.tasks import Endpoint, get_task

    task = get_task("classification")
    return task.bag_loss(Endpoint(task=task.name, loss=task.losses[0], n_outputs=int(output.logits.numel())), output, label)


def device_of(module: nn.Module, fallback: torch.device) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return fallback


def _check(tiles: Tensor, chunk_size: int | None = None) -> None:
    if isinstance(tiles, DeviceTiles):  # uint8 tiles converted on the device chunk by chunk
        return _check_size(tiles, chunk_size)
    if not isinstance(tiles, torch.Tensor) or not tiles.is_floating_point():
        raise TypeError(
            f"tiles must be a float tensor [n, 3, H, W] already normalised (see wsi_pipeline.data.tensors."
            f"tiles_to_tensor); got {type(tiles).__name__} {getattr(tiles, 'dtype', '')}"
        )
    _check_size(tiles, chunk_size)


def _check_size(tiles: Tensor | DeviceTiles, chunk_size: int | None) -> None:
    if tiles.ndim < 2 or tiles.shape[0] < 1:
        raise ValueError(f"tiles must hold at least one tile [n, ...]; got shape {tuple(tiles.shape)}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (tiles embedded with gradient at once)")


def call_aggregator(aggregator: nn.Module, z: Tensor, label: Any, extra: dict[str, Any] | None) -> Any:
    """Call ``aggregator(z, label=label, **extra)``; ``label`` is left out when forward cannot take it."""
    kwargs = dict(extra or {})
    params = inspect.signature(aggregator.forward).parameters
    if "label" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs.setdefault("label", label)
    return aggregator(z, **kwargs)


def _bn_layers(module: nn.Module) -> list[_BatchNorm]:
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


@contextmanager
def bn_training(encoder: nn.Module, training: bool) -> Iterator[list[_BatchNorm]]:
    """Put every BatchNorm layer in train (``training=True``) or eval mode; restore the modes afterwards."""
    layers = _bn_layers(encoder)
    modes = [m.training for m in layers]
    try:
        for m in layers:
            m.train(training)
        yield layers
    finally:
        for m, mode in zip(layers, modes):
            m.train(mode)


def save_rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _BagStats:
    """Per-channel (count, mean, M2) of each BatchNorm layer's input, merged over chunks (Chan et al.)."""

    def __init__(self, layers: list[_BatchNorm]) -> None:
        self.layers = layers
        self.stats: dict[int, tuple[float, Tensor, Tensor]] = {}
        self.handles = [m.register_forward_hook(self._hook) for m in layers]

    def _hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        x = inputs[0].detach()
        c = x.shape[1]
        flat = x.transpose(0, 1).reshape(c, -1).to(torch.float64)
        n_b = float(flat.shape[1])
        mean_b = flat.mean(1)
        m2_b = ((flat - mean_b[:, None]) ** 2).sum(1)
        key = id(module)
        if key not in self.stats:
            self.stats[key] = (n_b, mean_b, m2_b)
            return
        n_a, mean_a, m2_a = self.stats[key]
        n = n_a + n_b
        delta = mean_b - mean_a
        self.stats[key] = (n, mean_a + delta * (n_b / n), m2_a + m2_b + delta**2 * (n_a * n_b / n))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def apply_once(self) -> None:
        """Update each layer's running statistics once, with the merged bag statistics."""
        for m in self.layers:
            if not m.track_running_stats or m.running_mean is None or id(m) not in self.stats:
                continue
            n, mean, m2 = self.stats[id(m)]
            var = m2 / max(n - 1.0, 1.0)  # unbiased, as BatchNorm uses for running_var
            with torch.no_grad():
                m.num_batches_tracked.add_(1)
                factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)


def _snapshot_running(layers: list[_BatchNorm]) -> list[dict[str, Tensor]]:
    return [{k: b.detach().clone() for k, b in m.named_buffers(recurse=False)} for m in layers]


def _restore_running(layers: list[_BatchNorm], snaps: list[dict[str, Tensor]]) -> None:
    with torch.no_grad():
        for m, snap in zip(layers, snaps):
            for k, b in m.named_buffers(recurse=False):
                b.copy_(snap[k])


def _replay_backward(
    encoder: nn.Module, tiles: Tensor, bounds: list[tuple[int, int]], states: list[Any], grad: Tensor, device: torch.device
) -> None:
    """Pass 3: re-run each chunk with gradient from its pass-1 RNG state and backpropagate its rows of ``grad``.

    The generators are put back where passes 1 and 2 left them, so the caller's random stream is
    never rewound.
    """
    after = save_rng_state(device)
    try:
        for (a, b), state in zip(bounds, states):
            restore_rng_state(state, device)
            part = encoder(tiles[a:b].to(device, non_blocking=True))
            with autocast_off():
                part.backward(grad[a:b])
    finally:
        restore_rng_state(after, device)


def accumulate_step(
    encoder: nn.Module,
    aggregator: nn.Module,
    tiles: Tensor,
    label: int | Tensor,
    chunk_size: int,
    loss_fn: LossFn | None = None,
    bn: str = "frozen",
    *,
    aggregator_kwargs: dict[str, Any] | None = None,
) -> float:
    """Add the exact full-bag gradient of one bag to every parameter's ``.grad``, embedding ``chunk_size`` tiles at a time.

    Parameters
    ----------
    encoder : module [k, 3, H, W] -> [k, D].
    aggregator : module with ``forward(z [n, D], **kw)`` returning an output with ``.logits``
        (e.g. :class:`~wsi_pipeline.models.aggregators.MILOutput`); it is called with
        ``label=label`` when its forward accepts it (DTFD needs it for ``aux_loss``).
    tiles : float tensor [n, 3, H, W], already normalised; chunks are moved to the encoder's
        device one at a time, so the bag may stay in host memory. Or a
        :class:`~wsi_pipeline.data.tensors.DeviceTiles`: the bag's uint8 tiles, each chunk converted
        on the device (a quarter of the bytes cross the bus; the same values).
    label : the bag's class index (int or 0-d tensor).
    chunk_size : tiles embedded with gradient at once (>= 1); peak activation memory scales
        with it, not with n.
    loss_fn : ``loss_fn(output, label) -> scalar``; :func:`classification_loss` when None.
    bn : BatchNorm policy, ``"frozen"`` (eval statistics, exact) or ``"chunk"`` (chunk
        statistics, running statistics updated once per bag); see the module docstring.
    aggregator_kwargs : extra keywords for the aggregator call (e.g. a DTFD ``generator``).

    Returns
    -------
    float : the loss of the bag. The gradient is added to ``.grad`` (not overwritten).

    Notes
    -----
    Random numbers: pass 3 replays the dropout draws of pass 1 chunk by chunk, then the CPU
    generator and the encoder's CUDA generator are restored to where passes 1 and 2 left them.
    On return the global RNG state is therefore exactly the one after the chunked no-grad
    encoder forward over the bag and the aggregator's forward and backward (with an
    aggregator that draws nothing: the state right after pass 1), never a rewound one.
    """
    _check(tiles, chunk_size)
    if bn not in BN_MODES:
        raise ValueError(f"bn={bn!r}; expected one of {BN_MODES} ('frozen' is exact, 'chunk' uses chunk statistics)")
    loss_fn = loss_fn or classification_loss
    device = device_of(encoder, tiles.device)
    n = tiles.shape[0]
    bounds = [(s, min(s + int(chunk_size), n)) for s in range(0, n, int(chunk_size))]

    with bn_training(encoder, bn == "chunk") as layers:
        stats = snaps = None
        if bn == "chunk":
            snaps = _snapshot_running(layers)
            stats = _BagStats(layers)
        states = []
        try:
            with torch.no_grad():
                parts = []
                for a, b in bounds:
                    states.append(save_rng_state(device))
                    parts.append(encoder(tiles[a:b].to(device, non_blocking=True)))
        finally:
            if stats is not None:
                stats.remove()
        z = torch.cat(parts).detach().requires_grad_(True)
        del parts
        output = call_aggregator(aggregator, z, label, aggregator_kwargs)
        loss = loss_fn(output, label)
        with autocast_off():
            loss.backward()
        value = float(loss.detach())
        del output, loss
        grad = z.grad
        trainable = any(p.requires_grad for p in encoder.parameters())
        if grad is not None and trainable:
            _replay_backward(encoder, tiles, bounds, states, grad, device)
        else:
            log.debug("encoder frozen or loss independent of the embeddings: pass 3 skipped")
        if stats is not None:
            _restore_running(layers, snaps)
            stats.apply_once()
    return value


def full_step(
    encoder: nn.Module,
    aggregator: nn.Module,
    tiles: Tensor,
    label: int | Tensor,
    loss_fn: LossFn | None = None,
    bn: str = "frozen",
    *,
    aggregator_kwargs: dict[str, Any] | None = None,
) -> float:
    """Add the gradient of one bag to every ``.grad`` by embedding all n tiles with gradient at once.

    The reference for :func:`accumulate_step` and the cheaper choice for bags that fit. ``bn``:
    ``"frozen"`` (eval statistics) or ``"chunk"`` (train-mode statistics of the whole bag, which
    is then the single chunk; running statistics are updated once by the forward). Other
    arguments as :func:`accumulate_step`. Returns the loss as a float.
    """
    _check(tiles)
    if bn not in BN_MODES:
        raise ValueError(f"bn={bn!r}; expected one of {BN_MODES}")
    loss_fn = loss_fn or classification_loss
    device = device_of(encoder, tiles.device)
    with bn_training(encoder, bn == "chunk"):
        # a Big-Layers encoder takes host tiles chunk by chunk: sending the bag first would be a round trip
        z = encoder(tiles if getattr(encoder, "host_input", False) else tiles.to(device, non_blocking=True))
        output = call_aggregator(aggregator, z, label, aggregator_kwargs)
        loss = loss_fn(output, label)
        with autocast_off():
            loss.backward()
    return float(loss.detach())
