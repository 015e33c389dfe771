"""The ``patchgd:`` section of a method config: :class:`PatchGDConfig`, built and checked by the
generic builder (errors by field path). How a method's other sections fill it in is a rule across
sections: :func:`wsi_pipeline.config.pipeline.patchgd_mapping`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import (
    BackboneScale,
    PartialWindow,
    PatchGDPreset,
    head_names,
)
from wsi_pipeline.config.patchgd_presets import preset_patchgd_options
from wsi_pipeline.config.schema import Checked, build, spec

__all__ = ["PatchGDConfig"]

_COUNT = spec(ge=1)  # a positive integer (or null where the type allows it)


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

    def tiles_per_iteration(self, n_tiles: int) -> int:
        """k for a slide of ``n_tiles`` tiles (at least 1, at most n)."""
        k = self.k if self.k is not None else math.ceil(self.fraction * n_tiles)
        return max(1, min(int(k), int(n_tiles)))

    def inner_iterations(self, n_tiles: int) -> int:
        """zeta for a slide of ``n_tiles`` tiles."""
        return self.zeta if self.zeta is not None else math.ceil(n_tiles / self.tiles_per_iteration(n_tiles))
