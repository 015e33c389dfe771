"""PatchGD's plan of a batch: which tiles each inner iteration re-embeds, and the optimiser-step windows.

The algorithm is described in :mod:`wsi_pipeline.training.patchgd`, whose engine runs these plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from wsi_pipeline.config.choices import PARTIAL_WINDOWS
from wsi_pipeline.config.patchgd import PatchGDConfig

__all__ = ["BatchPlan", "accumulation_windows", "plan_batch", "plan_inner_iterations"]


def plan_inner_iterations(n_tiles: int, k: int, zeta: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """The tiles of each inner iteration: ``zeta`` long tensors of ``k`` distinct indices in [0, n).

    The iterations read consecutive k-blocks of a stream of random permutations of the tiles,
    so every tile appears exactly once per pass of n draws. When a pass ends inside an
    iteration, the tiles already taken in that iteration are moved to the end of the next
    permutation, so no iteration holds a tile twice and the pass property still holds.
    """
    if not 1 <= k <= n_tiles:
        raise ValueError(f"k={k} tiles per inner iteration must be in [1, n_tiles={n_tiles}]")
    if zeta < 1:
        raise ValueError(f"zeta={zeta}; expected at least one inner iteration")
    plan: list[Tensor] = []
    pending = torch.randperm(n_tiles, generator=generator)
    pos = 0
    for _ in range(zeta):
        take = pending[pos : pos + k]
        pos += len(take)
        if len(take) < k:
            nxt = torch.randperm(n_tiles, generator=generator)
            taken = torch.zeros(n_tiles, dtype=torch.bool)
            taken[take] = True
            nxt = torch.cat([nxt[~taken[nxt]], nxt[taken[nxt]]])
            need = k - len(take)
            take = torch.cat([take, nxt[:need]])
            pending, pos = nxt, need
        plan.append(take)
    return plan


def accumulation_windows(zeta: int, epsilon: int, partial: str = "step") -> list[int]:
    """Lengths of the optimiser-step windows of ``zeta`` inner iterations: ``epsilon`` each.

    ``partial="step"``: the last window is shorter when epsilon does not divide zeta.
    ``partial="drop"`` (the paper's Algorithm 1): that partial window is left out; ``ValueError``
    when no full window remains (epsilon > zeta: the paper would never step).
    """
    if zeta < 1 or epsilon < 1:
        raise ValueError(f"zeta={zeta} and epsilon={epsilon} must be positive")
    if partial not in PARTIAL_WINDOWS:
        raise ValueError(f"partial={partial!r}; expected one of {PARTIAL_WINDOWS}")
    full, rest = divmod(zeta, epsilon)
    if partial == "drop":
        if full == 0:
            raise ValueError(
                f"patchgd.epsilon={epsilon} exceeds zeta={zeta} inner iterations with partial_window 'drop' "
                "(the paper's): no optimiser step would be taken; lower epsilon, raise zeta or use partial_window 'step'"
            )
        return [epsilon] * full
    return [epsilon] * full + ([rest] if rest else [])


@dataclass
class BatchPlan:
    """The inner iterations of one batch of slides.

    ``ks[b]``: tiles per inner iteration of slide b; ``zeta``: inner iterations (the largest
    slide's); ``windows``: optimiser-step window lengths; ``plans[b][j]``: the tiles slide b
    re-embeds in iteration j (only the iterations the windows run).
    """

    ks: list[int]
    zeta: int
    windows: list[int]
    plans: list[list[Tensor]]


def plan_batch(cfg: PatchGDConfig, ns: list[int], generator: torch.Generator | None = None) -> BatchPlan:
    """The plan of a batch of slides of ``ns`` tiles; each slide's tile plan drawn from ``generator`` in turn."""
    ks = [cfg.tiles_per_iteration(n) for n in ns]
    zeta = max(cfg.inner_iterations(n) for n in ns)
    windows = accumulation_windows(zeta, cfg.epsilon if cfg.epsilon is not None else zeta, cfg.partial_window)
    plans = [plan_inner_iterations(n, k, zeta, generator)[: sum(windows)] for n, k in zip(ns, ks)]
    return BatchPlan(ks, zeta, windows, plans)
