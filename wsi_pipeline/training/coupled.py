"""Exact gradients of a loss that couples the bags of a step (the Cox partial likelihood).

The Cox loss of a step depends on every bag's risk at once (each bag sits in the others' risk
sets), so bags cannot be backpropagated one at a time as :func:`~wsi_pipeline.training.accumulate.accumulate_step`
does. Three passes keep the gradient exact with the memory of one encoder chunk:

1. for each bag, embed its tiles in chunks without gradient -> ``Z_b`` [n_b, D] (the RNG state
   before making each bag's input and before each chunk is saved);
2. make every ``Z_b`` a leaf requiring grad, run the aggregator on each bag, take the loss over
   the step's outputs and backpropagate -> aggregator gradients and ``G_b = dL/dZ_b``;
3. for each bag, make its input again and re-embed each chunk with gradient from the saved RNG
   states, backpropagating ``G_b[chunk]`` into the encoder.

``d L / d theta = sum_b sum_i dL/dz_bi . dz_bi/dtheta``, so the result equals plain autograd of
the loss with every bag embedded with gradient (tested in float64 for the ``frozen``, ``full``,
``accumulate`` and ``bigl`` strategies). As for accumulation, the encoder must compute the same
function in passes 1 and 3: BatchNorm on running statistics (``encoder.bn: frozen``), and
dropout replayed from the saved generator states. Memory: every bag's embeddings of the step
([sum n_b, D]) plus one chunk's activations; time: about two encoder forwards and one backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from wsi_pipeline.devices import autocast_off
from wsi_pipeline.training.accumulate import bn_training, call_aggregator, device_of, save_rng_state, restore_rng_state

__all__ = ["coupled_step"]

GroupLoss = Callable[[Sequence[Any], Sequence[Any]], Tensor]


def _encode(encoder: nn.Module, x: Tensor, device: torch.device) -> Tensor:
    # a Big-Layers encoder takes host tiles chunk by chunk
    return encoder(x if getattr(encoder, "host_input", False) else x.to(device, non_blocking=True))


def coupled_step(
    encoder: nn.Module,
    aggregator: nn.Module,
    inputs: Sequence[Callable[[], Tensor]],
    targets: Sequence[Any],
    group_loss: GroupLoss,
    chunk_size: int | None = None,
    *,
    labels: Sequence[Any] | None = None,
) -> float:
    """Add the exact gradient of ``group_loss`` over a step's bags to every parameter's ``.grad``.

    Parameters
    ----------
    encoder : [k, 3, H, W] -> [k, D] (``nn.Identity()`` when the inputs are embeddings already).
    aggregator : ``forward(z [n, D])`` -> output with ``.logits``.
    inputs : one callable per bag returning its encoder input [n_b, ...]; each is called once in
        pass 1 and once in pass 3, from the same generator state, so a random augmentation draws
        the same both times (the bag's uint8 tiles, not its float input, stay in memory).
    targets : one target per bag, handed to ``group_loss(outputs, targets)`` -> scalar.
    chunk_size : tiles per encoder call (None: each bag in one call).
    labels : passed to the aggregator as ``label`` when its forward takes one (None: not passed).

    Returns
    -------
    The loss (float). The encoder's BatchNorm layers run on running statistics for the step.
    """
    if not inputs or len(inputs) != len(targets):
        raise ValueError(f"coupled_step needs one target per bag and at least one bag; got {len(inputs)} bags, {len(targets)} targets")
    device = device_of(encoder, torch.device("cpu"))
    trainable = any(p.requires_grad for p in encoder.parameters())
    with bn_training(encoder, False):
        made: list[Any] = []  # per bag: generator state before its input was made, chunk bounds, chunk states
        zs: list[Tensor] = []
        with torch.no_grad():
            for make in inputs:
                before = save_rng_state(device)
                x = make()
                n = int(x.shape[0])
                step = int(chunk_size or n)
                bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
                states, parts = [], []
                for a, b in bounds:
                    states.append(save_rng_state(device))
                    parts.append(_encode(encoder, x[a:b], device))
                made.append((before, bounds, states))
                zs.append(torch.cat(parts).detach().requires_grad_(True))
                del x, parts
        outputs = [aggregator(z) if labels is None else call_aggregator(aggregator, z, labels[i], None)
                   for i, z in enumerate(zs)]
        loss = group_loss(outputs, targets)
        with autocast_off():
            loss.backward()
        value = float(loss.detach())
        del outputs, loss
        if trainable:
            after = save_rng_state(device)
            try:
                for make, z, (before, bounds, states) in zip(inputs, zs, made):
                    if z.grad is None:
                        continue
                    restore_rng_state(before, device)
                    x = make()
                    for (a, b), state in zip(bounds, states):
                        restore_rng_state(state, device)
                        part = _encode(encoder, x[a:b], device)
                        with autocast_off():
                            part.backward(z.grad[a:b])
                    del x
            finally:
                restore_rng_state(after, device)
    return value
