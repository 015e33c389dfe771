"""The ``patchgd:`` section of a method config: :class:`PatchGDConfig`, built and checked by the
generic builder (errors by field path).

A method's PatchGD options are parsed once, when its config is built: :meth:`PatchGDConfig.for_method`
(the ``patchgd`` section, its preset's defaults, and what the method's other sections imply:
:func:`resolve_patchgd_options`), kept on the method as
:attr:`wsi_pipeline.config.pipeline.MethodConfig.patchgd_config`; every consumer (the strategy, the
trainer, the head builder) takes that object. :meth:`PatchGDConfig.to_state` /
:meth:`~PatchGDConfig.from_state` are its stored form (plain values and a ``schema_version``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from wsi_pipeline.config.choices import (
    PATCHGD_BN_MODES,
    BackboneScale,
    PartialWindow,
    PatchGDPreset,
    head_names,
)
from wsi_pipeline.config.patchgd_presets import preset_patchgd_options
from wsi_pipeline.failures import ConfigTypeError
from wsi_pipeline.config.limits import MAX_COUNT
from wsi_pipeline.config.schema import Checked, build, spec

__all__ = ["SCHEMA_VERSION", "PatchGDConfig", "resolve_patchgd_options"]

#: The layout of :meth:`PatchGDConfig.to_state` (no migrations yet: version 1 is the first).
SCHEMA_VERSION = 1

_COUNT = spec(ge=1, le=MAX_COUNT)  # a positive integer up to MAX_COUNT (or null where the type allows it)


@dataclass(frozen=True)
class PatchGDConfig(Checked):
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
    backbone_scale : ``"full"`` (default; encoder gradient scaled by n/k, see
        :mod:`wsi_pipeline.training.patchgd`) or ``"paper"`` (the reference's 1/epsilon scale).
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

    k: int | None = field(default=None, metadata=_COUNT)
    fraction: float = field(default=0.25, metadata=spec(gt=0.0, le=1.0))
    zeta: int | None = field(default=None, metadata=_COUNT)
    epsilon: int | None = field(default=None, metadata=_COUNT)
    backbone_scale: BackboneScale = "full"
    freeze_bn: bool = True
    fill_batch: int = field(default=64, metadata=_COUNT)
    head: str = field(default="cnn", metadata=spec(choices=head_names))
    head_options: dict[str, Any] = field(default_factory=dict)
    max_grid: int | None = field(default=128, metadata=_COUNT)
    proj_dim: int | None = field(default=None, metadata=_COUNT)
    partial_window: PartialWindow = "step"
    slides_per_batch: int = field(default=1, metadata=_COUNT)
    preset: PatchGDPreset = "default"

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None, where: str = "patchgd") -> PatchGDConfig:
        """Build from a ``patchgd:`` mapping; errors name the field's path under ``where``.

        A ``preset`` fills in its defaults for the options the mapping does not give.
        """
        return build(cls, preset_patchgd_options(dict(options or {}), f"{where}.preset"), where)

    @classmethod
    def for_method(cls, method_cfg: Any, where: str = "patchgd") -> PatchGDConfig:
        """The options of a method config (a :class:`~wsi_pipeline.config.pipeline.MethodConfig`, a method
        mapping, or a bare ``patchgd`` mapping), resolved by :func:`resolve_patchgd_options`."""
        return cls.from_mapping(resolve_patchgd_options(method_cfg), where)

    def to_state(self) -> dict[str, Any]:
        """Plain values (``torch.load(..., weights_only=True)`` and YAML read them) with ``schema_version``."""
        return {"schema_version": SCHEMA_VERSION, **self.to_mapping()}

    def to_mapping(self) -> dict[str, Any]:
        """Every option as a ``patchgd:`` mapping (YAML form): :meth:`for_method` of a method with this
        section gives these options back, whatever its other sections say."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"head_options": dict(self.head_options)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], where: str = "patchgd") -> PatchGDConfig:
        """Read :meth:`to_state`'s form (``ValueError`` naming ``where`` for a newer schema or a bad field)."""
        raw = dict(state)
        version = raw.pop("schema_version", 1)
        if version != SCHEMA_VERSION:
            raise ValueError(f"{where}: PatchGD options of schema version {version!r}; this version reads {SCHEMA_VERSION}")
        return build(cls, raw, where)

    def tiles_per_iteration(self, n_tiles: int) -> int:
        """k for a slide of ``n_tiles`` tiles (at least 1, at most n)."""
        k = self.k if self.k is not None else math.ceil(self.fraction * n_tiles)
        return max(1, min(int(k), int(n_tiles)))

    def inner_iterations(self, n_tiles: int) -> int:
        """zeta for a slide of ``n_tiles`` tiles."""
        return self.zeta if self.zeta is not None else math.ceil(n_tiles / self.tiles_per_iteration(n_tiles))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def resolve_patchgd_options(method_cfg: Any) -> dict[str, Any]:
    """The ``patchgd`` options of a method config (a mapping or a config object with a ``patchgd``
    attribute) with what the rest of the method implies filled in, or a bare ``patchgd`` mapping as it is.

    - ``freeze_bn`` (unless given): from ``encoder.bn``, ``frozen`` -> true, ``train`` -> false;
      ``chunk`` raises ``ValueError`` (patchgd has no chunks).
    - ``head`` (unless given): ``aggregator.name`` when it names a PatchGD head, its ``options``
      under ``head_options`` (keys given in ``patchgd.head_options`` win). An aggregator that is
      neither a head nor the default ``abmil`` raises ``ValueError``: patchgd trains a grid head.
    """
    if method_cfg is None:
        return {}
    if isinstance(method_cfg, PatchGDConfig):
        return method_cfg.to_mapping()
    inner = _get(method_cfg, "patchgd")
    keys = {f.name for f in fields(PatchGDConfig)}
    if inner is None and isinstance(method_cfg, Mapping) and set(method_cfg) <= keys:
        return dict(method_cfg)
    if inner is not None and not isinstance(inner, Mapping):
        raise ConfigTypeError(f"method config 'patchgd' must be a mapping of PatchGD options; got {type(inner).__name__}")
    options = dict(inner or {})
    encoder = _get(method_cfg, "encoder")
    bn = _get(encoder, "bn") if encoder is not None else None
    if "freeze_bn" not in options and bn is not None:
        if bn not in PATCHGD_BN_MODES:
            raise ValueError(f"encoder.bn={bn!r} is not supported by patchgd; use 'frozen' (exact) or 'train'")
        options["freeze_bn"] = bn == "frozen"
    agg = _get(method_cfg, "aggregator")
    if agg is not None and "head" not in options:
        name, agg_options = _get(agg, "name"), dict(_get(agg, "options") or {})
        if name in head_names():
            options["head"] = name
            options["head_options"] = {**agg_options, **dict(options.get("head_options", {}))}
        elif name != "abmil" or agg_options:
            raise ValueError(
                f"method {_get(method_cfg, 'name')!r}: patchgd trains a grid head, not the aggregator {name!r}; name "
                f"the head in aggregator.name or patchgd.head (one of {head_names()})"
            )
    return options
