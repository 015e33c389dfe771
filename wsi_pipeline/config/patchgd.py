"""The ``patchgd:`` section of a method config: :class:`PatchGDConfig` and how a method's other
sections fill it in (:func:`patchgd_mapping`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from wsi_pipeline.config.patchgd_presets import PRESETS, preset_patchgd_options
from wsi_pipeline.models.heads import HEADS

__all__ = ["BACKBONE_SCALES", "PARTIAL_WINDOWS", "PatchGDConfig", "patchgd_mapping"]

BACKBONE_SCALES = ("full", "paper")
PARTIAL_WINDOWS = ("step", "drop")


@dataclass(frozen=True)
class PatchGDConfig:
    """The ``patchgd:`` options of a method config.

    Attributes
    ----------
    k : tiles sampled per inner iteration (None = ``ceil(fraction * n)`` for a slide of n tiles);
        clipped to n.
    fraction : fraction of the slide's tiles per inner iteration when ``k`` is None.
    zeta : inner iterations per slide (None = one pass: ``ceil(n / k)``).
    epsilon : inner iterations per optimiser step (None = zeta, one step per batch).
    partial_window : ``"step"`` (default; a trailing window shorter than epsilon is stepped,
        its losses divided by its length) or ``"drop"`` (the paper's: never applied, not run).
    backbone_scale : ``"full"`` (default; encoder gradient scaled by n/k, see module docstring)
        or ``"paper"`` (the reference's 1/epsilon scale).
    freeze_bn : encoder BatchNorm on running statistics (exact; default) or train mode (the paper's).
    slides_per_batch : slides per inner loop (default 1; the paper trains a batch of images).
    preset : ``"default"`` or ``"paper"``: defaults for the options not given
        (:mod:`wsi_pipeline.config.patchgd_presets`).
    fill_batch : tiles per no-grad encoder batch when filling Z.
    head : PatchGD head name, ``cnn`` (default, the paper's made mask-aware), ``cnn_paper``
        (the paper's as published) or ``transformer``. On the small
        synthetic cohorts the CNN head memorised the training slides while the transformer
        head generalised (README): prefer ``transformer`` for small cohorts.
    head_options : keyword options of the head (width, dropout, pool, dim, ...).
    max_grid : cap on Z's longer side in cells (None = no cap); passed to the head.
    proj_dim : optional linear projection of embeddings to s channels; passed to the head.
    """

    k: int | None = None
    fraction: float = 0.25
    zeta: int | None = None
    epsilon: int | None = None
    backbone_scale: str = "full"
    freeze_bn: bool = True
    fill_batch: int = 64
    head: str = "cnn"
    head_options: Mapping[str, Any] = field(default_factory=dict)
    max_grid: int | None = 128
    proj_dim: int | None = None
    partial_window: str = "step"
    slides_per_batch: int = 1
    preset: str = "default"

    def __post_init__(self) -> None:
        for name in ("k", "zeta", "epsilon", "max_grid", "proj_dim", "slides_per_batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"patchgd.{name}={v!r}; expected a positive integer or null")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise ValueError(f"patchgd.fraction={self.fraction!r}; expected a number in (0, 1]")
        if self.backbone_scale not in BACKBONE_SCALES:
            raise ValueError(f"patchgd.backbone_scale={self.backbone_scale!r}; expected one of {BACKBONE_SCALES}")
        if self.partial_window not in PARTIAL_WINDOWS:
            raise ValueError(f"patchgd.partial_window={self.partial_window!r}; expected one of {PARTIAL_WINDOWS}")
        if self.preset not in PRESETS:
            raise ValueError(f"patchgd.preset={self.preset!r}; expected one of {list(PRESETS)}")
        if self.slides_per_batch is None:
            raise ValueError("patchgd.slides_per_batch=None; expected a positive integer")
        if not isinstance(self.freeze_bn, bool):
            raise TypeError(f"patchgd.freeze_bn={self.freeze_bn!r}; expected true or false")
        if isinstance(self.fill_batch, bool) or not isinstance(self.fill_batch, int) or self.fill_batch < 1:
            raise ValueError(f"patchgd.fill_batch={self.fill_batch!r}; expected a positive integer")
        if not isinstance(self.head_options, Mapping):
            raise TypeError(f"patchgd.head_options must be a mapping of head keyword options; got {type(self.head_options).__name__}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> PatchGDConfig:
        """Validate a ``patchgd:`` mapping; unknown keys raise ``ValueError`` naming them and the valid keys.

        A ``preset`` fills in its defaults for the options the mapping does not give.
        """
        options = preset_patchgd_options(dict(options or {}))
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown patchgd option(s) {unknown}; valid options are {valid}")
        return cls(**options)

    def tiles_per_iteration(self, n_tiles: int) -> int:
        """k for a slide of ``n_tiles`` tiles (at least 1, at most n)."""
        k = self.k if self.k is not None else math.ceil(self.fraction * n_tiles)
        return max(1, min(int(k), int(n_tiles)))

    def inner_iterations(self, n_tiles: int) -> int:
        """zeta for a slide of ``n_tiles`` tiles."""
        return self.zeta if self.zeta is not None else math.ceil(n_tiles / self.tiles_per_iteration(n_tiles))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def patchgd_mapping(method_cfg: Any) -> dict[str, Any]:
    """The ``patchgd`` options of a method config (a mapping or a config object with a ``patchgd``
    attribute), or a bare ``patchgd`` mapping.

    Defaults taken from the rest of the method config: ``freeze_bn`` from the encoder's
    BatchNorm mode (``encoder.bn``: ``frozen`` or ``train``), and ``head`` / ``head_options``
    from the ``aggregator`` entry when it names a registered PatchGD head (``cnn``, ``transformer``).
    """
    if method_cfg is None:
        return {}
    inner = _get(method_cfg, "patchgd")
    keys = {f.name for f in fields(PatchGDConfig)}
    if inner is None and isinstance(method_cfg, Mapping) and set(method_cfg) <= keys:
        return dict(method_cfg)
    if inner is not None and not isinstance(inner, Mapping):
        raise TypeError(f"method config 'patchgd' must be a mapping of PatchGD options; got {type(inner).__name__}")
    options = dict(inner or {})
    bn = _get(_get(method_cfg, "encoder"), "bn") if _get(method_cfg, "encoder") is not None else None
    if "freeze_bn" not in options and bn is not None:
        if bn not in ("frozen", "train"):
            raise ValueError(f"encoder.bn={bn!r} is not supported by patchgd; use 'frozen' (exact) or 'train'")
        options["freeze_bn"] = bn == "frozen"
    agg = _get(method_cfg, "aggregator")
    if agg is not None and "head" not in options and _get(agg, "name") in HEADS:
        options["head"] = _get(agg, "name")
        if "head_options" not in options:
            options["head_options"] = dict(_get(agg, "options") or {})
    return options
