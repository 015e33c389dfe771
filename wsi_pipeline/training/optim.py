"""Optimisers and learning-rate schedules: Adam (L2 weight decay), DEMON momentum decay, per-epoch schedules.

Schedules (:func:`lr_at_epoch`, applied once per epoch by :class:`EpochSchedule`): ``cosine``,
``exponential``, ``linear`` (the PatchGD paper's warm-up + linear decay: 2 warm-up epochs, then
linearly down to ``min_lr``, half the peak in that paper) and ``none``, each after optional
``warmup_epochs`` of linear warm-up; ``warmup_steps`` ramps the rate linearly over the run's first
optimiser steps (:meth:`EpochSchedule.before_step`).

DEMON (Chen et al. 2022) decays Adam's first-moment coefficient from ``beta_init`` to 0 over the
``T`` optimiser steps of a run::

    beta_t = beta_init (1 - t/T) / ((1 - beta_init) + beta_init (1 - t/T)),   t = 0, 1, ..., T

The paper's Demon-Adam keeps *undampened* momentum (m_t = g_t + beta_t m_{t-1}), which makes
the step up to 1/(1 - beta) larger than Adam's and so changes the meaning of the learning rate.
We implement the *dampened* form instead, plain Adam with beta_1 replaced by beta_t, so a
learning rate tuned for Adam keeps its meaning (the Big-Layers paper compares Adam and
Adam+DEMON at the same learning rates)::

    g_t   = grad + weight_decay * theta                 (L2, as torch.optim.Adam)
    m_t   = beta_t m_{t-1} + (1 - beta_t) g_t
    v_t   = beta_2 v_{t-1} + (1 - beta_2) g_t^2
    theta = theta - lr * (m_t / (1 - prod_{s<=t} beta_s)) / (sqrt(v_t / (1 - beta_2^t)) + eps)

The first-moment bias correction uses the product of the betas actually used (the exact
normaliser of the weighted average when beta varies); with a constant beta it is Adam's
``1 - beta_1^t``, and :class:`DemonAdam` then equals ``torch.optim.Adam`` step for step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DemonAdam", "EpochSchedule", "build_optimizer", "clip_gradients", "demon_beta", "lr_at_epoch"]


def demon_beta(beta_init: float, step: int, total_steps: int) -> float:
    """DEMON's momentum coefficient before optimiser step ``step`` (0-based) of ``total_steps``.

    ``beta_init`` at step 0, decaying to 0 at ``step >= total_steps``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps}; expected the number of optimiser steps of the run (> 0)")
    remaining = max(0.0, 1.0 - step / total_steps)
    return beta_init * remaining / ((1.0 - beta_init) + beta_init * remaining)


class DemonAdam(torch.optim.Optimizer):
    """Adam with DEMON momentum decay, dampened form (see the module docstring).

    Parameters
    ----------
    params : parameters or parameter groups.
    total_steps : T, the optimiser steps of the whole run (beta reaches 0 there).
    lr, betas, eps, weight_decay : as ``torch.optim.Adam``; ``betas[0]`` is ``beta_init``.
    decay : False keeps beta_1 constant (plain Adam), for tests and ablations.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        total_steps: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay: bool = True,
    ) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps={total_steps}; expected > 0")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas={betas}; expected values in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, total_steps=int(total_steps), decay=bool(decay))
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # torch's contract
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta_init, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("DemonAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # plain Python numbers: Optimizer.load_state_dict would cast tensors to the
                    # parameter's dtype, and the product must stay float64 for an exact resume
                    state["step"] = 0
                    state["beta1_prod"] = 1.0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                t = int(state["step"])
                beta1 = demon_beta(beta_init, t, group["total_steps"]) if group["decay"] else beta_init
                grad = p.grad
                if group["weight_decay"] != 0:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                state["step"] += 1
                state["beta1_prod"] *= beta1
                bias1 = 1.0 - state["beta1_prod"]
                bias2 = 1.0 - beta2 ** (t + 1)
                denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
        return loss


def build_optimizer(params: Iterable[Any], train: Any, total_steps: int) -> torch.optim.Optimizer:
    """Adam (``train.lr``, L2 ``train.weight_decay``), or :class:`DemonAdam` when ``train.demon.enabled``.

    ``params``: parameters, or parameter groups (dicts with ``params`` and optionally
    ``lr_scale``, the group's share of the scheduled rate, and ``weight_decay``).
    ``train`` is a :class:`wsi_pipeline.config.pipeline.TrainConfig`; ``total_steps`` is T for DEMON.
    """
    params = list(params)
    if params and isinstance(params[0], dict):
        params = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in params]
        params = [g for g in params if g["params"]]
        for g in params:
            g.setdefault("lr_scale", 1.0)
            g["lr"] = train.lr * g["lr_scale"]
    else:
        params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: the method has nothing to optimise")
    if train.demon.enabled:
        return DemonAdam(params, total_steps=total_steps, lr=train.lr, betas=(train.demon.beta_init, 0.999), weight_decay=train.weight_decay)
    return torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)


def lr_at_epoch(epoch: int, train: Any) -> float:
    """Learning rate of epoch ``epoch`` (0-based) under ``train``'s schedule.

    Warm-up: ``lr (e + 1) / (w + 1)`` for the first ``w = warmup_epochs`` epochs. Then, with
    ``e' = e - w`` and ``E' = epochs - w``: cosine ``min_lr + (lr - min_lr)(1 + cos(pi e'/E'))/2``
    (``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max=E'``), exponential
    ``lr gamma^e'`` (``ExponentialLR``), linear ``lr - (lr - min_lr) e'/E'`` (``LinearLR`` from
    1 to ``min_lr / lr`` over ``E'`` epochs: the PatchGD paper's decay, which with its 2 warm-up
    epochs and ``min_lr = lr / 2`` ends at half the peak), or constant ``lr``.

    The PatchGD reference steps its schedule per optimiser step, from 0; this one is per epoch,
    so its warm-up epochs run at ``lr / 3`` and ``2 lr / 3`` (means of the per-step ramp:
    ``lr / 4``, ``3 lr / 4``).
    """
    w = train.warmup_epochs
    if epoch < w:
        return train.lr * (epoch + 1) / (w + 1)
    e, span = epoch - w, train.epochs - w
    if train.schedule == "cosine":
        return train.min_lr + (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * e / span)) / 2.0
    if train.schedule == "exponential":
        return train.lr * train.gamma**e
    if train.schedule == "linear":
        return train.lr - (train.lr - train.min_lr) * e / span
    return train.lr


class EpochSchedule:
    """Sets every parameter group's ``lr`` to :func:`lr_at_epoch` (times the group's ``lr_scale``, 1
    unless the encoder's share or layer-wise decay set it) at the start of each epoch; groups marked
    ``encoder`` get rate 0 in the first ``encoder_frozen_epochs`` epochs (the schedule itself runs
    from epoch 0 all the same). Within the first ``train.warmup_steps`` optimiser steps of the run,
    :meth:`before_step` scales those rates by ``(k + 1) / (N + 1)`` at step k (0-based).

    State is the epoch and the step count (plain ints), so checkpoints stay loadable with
    ``weights_only=True``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, train: Any, encoder_frozen_epochs: int = 0) -> None:
        self.optimizer = optimizer
        self.train = train
        self.encoder_frozen_epochs = int(encoder_frozen_epochs)
        self.epoch = 0
        self.steps = 0  # optimiser steps taken in the run

    def _apply(self, factor: float) -> float:
        lr = lr_at_epoch(self.epoch, self.train)
        frozen = self.epoch < self.encoder_frozen_epochs
        for group in self.optimizer.param_groups:
            share = 0.0 if frozen and group.get("encoder", False) else group.get("lr_scale", 1.0)
            group["lr"] = lr * share * factor
        return lr

    def set_epoch(self, epoch: int) -> float:
        """Apply the learning rate of ``epoch``; return it (the full rate, before any group's share
        or the step warm-up)."""
        self.epoch = int(epoch)
        return self._apply(self.warmup_factor(self.steps))

    def warmup_factor(self, step: int) -> float:
        """The step warm-up's factor at optimiser step ``step`` (0-based): ``(k + 1) / (N + 1)``
        for ``k < N = train.warmup_steps``, else 1."""
        n = int(self.train.warmup_steps)
        return (step + 1) / (n + 1) if step < n else 1.0

    def before_step(self) -> None:
        """Call just before each ``optimizer.step()``: sets the step's warm-up rate (a no-op once
        the warm-up is over, which leaves the epoch's rates) and counts the step."""
        n = int(self.train.warmup_steps)
        if self.steps <= n and n:
            self._apply(self.warmup_factor(self.steps))
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # a checkpoint written before step counting: its warm-up (if any) is taken as done
        self.steps = int(state.get("steps", self.train.warmup_steps))
        self.set_epoch(int(state["epoch"]))


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float | None:
    """Clip the global L2 norm of the gradients to ``max_norm`` (no-op when None); return the norm before clipping."""
    if max_norm is None:
        return None
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
