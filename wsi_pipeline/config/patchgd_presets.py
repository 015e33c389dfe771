"""PatchGD presets: named sets of defaults for a ``strategy: patchgd`` method (pure data, no torch).

``patchgd: {preset: paper}`` in a pipeline config fills in the PatchGD paper's settings
(Gupta et al., ``../shared/papers/000_*.txt``, and its reference code) wherever the method does
not set them itself: the values sit above the pipeline's ``train`` section and below the
method's own keys, so ``train: {lr: 5.0e-4}`` in the method still wins. The expansion happens in
:func:`wsi_pipeline.config.pipeline.config_from_dict`, so the saved ``config.yaml`` of a run holds
every resolved value. ``preset: default`` (or no preset) changes nothing.

What ``paper`` sets, and where each comes from:

- ``patchgd.backbone_scale: paper``: the encoder gets ``1 / epsilon`` of the gradient (the
  reference divides each inner iteration's loss by epsilon and the encoder sees only the k live
  tiles), the head all of it.
- ``encoder.bn: train``: train-mode BatchNorm in the encoder, in the Z fill and in the inner
  iterations (the reference trains with ``model.train()`` throughout).
- ``patchgd.slides_per_batch: 14``: a batch of slides per inner loop, their live tiles in one
  encoder call and their Z blocks in one head call (the paper maximises the batch under its
  memory limit; 14 is its 16 GB PANDA 2048 px / 128 px row, Table 3).
- ``patchgd.fraction: 0.1``: 10 % of the tiles per inner iteration, one pass (Table 11's best).
- ``patchgd.epsilon: null`` (= zeta) with ``partial_window: drop``: the paper's accumulation
  (Algorithm 1): the loss divided by epsilon, an optimiser step every epsilon inner iterations,
  and a trailing partial window never applied; epsilon = zeta is the reference code's setting
  with gradient accumulation on ("epsilon = zeta proves effective" at 2048 px / 128 px).
- ``aggregator: {name: cnn_paper}``: the paper's CNN head (fixed-size Z, plain BatchNorm,
  Dropout2d 0.2, flatten + Linear), see :class:`wsi_pipeline.models.heads.PaperCNNHead`.
- ``train``: Adam at lr 1e-3 without weight decay, 2 warm-up epochs then linear decay to half
  the peak (``schedule: linear``, ``min_lr = lr / 2``; Appendix B).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wsi_pipeline.config.strategy_traits import grid_head_strategies

__all__ = ["PRESETS", "MIN_LR_FRACTION", "apply_patchgd_preset", "preset_patchgd_options"]

#: Fraction of the peak learning rate the paper's linear decay ends at.
MIN_LR_FRACTION = 0.5

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {},
    "paper": {
        "encoder": {"bn": "train"},
        "aggregator": {"name": "cnn_paper"},
        "patchgd": {
            "backbone_scale": "paper",
            "slides_per_batch": 14,
            "fraction": 0.1,
            "epsilon": None,
            "partial_window": "drop",
        },
        "train": {"lr": 1e-3, "weight_decay": 0.0, "schedule": "linear", "warmup_epochs": 2},
    },
}

#: PatchGD options a preset implies when the strategy is built from a bare ``patchgd`` mapping
#: (no ``encoder`` / ``aggregator`` entries to carry them).
_IMPLIED = {"paper": {"freeze_bn": False, "head": "cnn_paper"}}


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"{where}={name!r}; expected one of {list(PRESETS)}")
    return name


def preset_patchgd_options(options: Mapping[str, Any], where: str = "patchgd.preset") -> dict[str, Any]:
    """``options`` (a ``patchgd`` mapping) with its preset's PatchGD defaults filled in (explicit keys win)."""
    name = _check_name(options.get("preset", "default"), where)
    preset = PRESETS[name]
    return {**preset.get("patchgd", {}), **_IMPLIED.get(name, {}), **dict(options)}


def apply_patchgd_preset(method: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Expand ``method``'s ``patchgd.preset`` (a raw method mapping from YAML) into its sections.

    Keys the method sets itself are kept; the preset fills the rest of ``encoder``, ``patchgd``
    and ``train`` and supplies ``aggregator`` when the method names none. ``train.min_lr``
    defaults to ``MIN_LR_FRACTION`` times the resolved peak lr. Raises ``ValueError`` for an
    unknown preset or a preset on a strategy other than ``patchgd``.
    """
    out = dict(method)
    pg = out.get("patchgd")
    if not isinstance(pg, Mapping) or "preset" not in pg:
        return out
    name = _check_name(pg["preset"], f"{where}.patchgd.preset")
    grid = grid_head_strategies()
    if out.get("strategy") not in grid:
        raise ValueError(f"{where}.patchgd.preset={name!r} applies to strategy {' or '.join(map(repr, grid))}; "
                         f"got strategy {out.get('strategy')!r}")
    preset = PRESETS[name]
    if not preset:
        return out
    enc = out.get("encoder")
    if enc is None or isinstance(enc, Mapping):
        out["encoder"] = {**preset["encoder"], **dict(enc or {})}
    if "aggregator" not in out:
        out["aggregator"] = dict(preset["aggregator"])
    out["patchgd"] = {**preset["patchgd"], **dict(pg)}
    over = out.get("train")
    if over is None or isinstance(over, Mapping):
        over = dict(over or {})
        train = {**preset["train"], **over}
        if "min_lr" not in over:
            try:
                train["min_lr"] = float(train["lr"]) * MIN_LR_FRACTION
            except (TypeError, ValueError):
                pass  # a malformed lr is reported by the train section's validation
        out["train"] = train
    return out
