"""What a foundation-model encoder preset is: a model as its card defines it (plain data, no torch, no timm).

The presets themselves are in :mod:`wsi_pipeline.models.foundation` (the first six) and
:mod:`wsi_pipeline.models.catalogue` (the rest); :mod:`wsi_pipeline.models.layouts` maps the key
layouts cards publish (transformers, DINOv2 hub) onto timm's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wsi_pipeline.models.input_norm import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["EMBEDDINGS", "INTERPOLATIONS", "LAYOUTS", "RESIZE_POLICIES", "Preset"]

#: Which output is the embedding: the model's own pooled output (``forward_head(pre_logits=True)``:
#: the class token for ``global_pool="token"``), or the class token concatenated with the mean of
#: the patch tokens (register tokens left out), Virchow's.
EMBEDDINGS: tuple[str, ...] = ("pooled", "cls_mean")
#: Resampling used when a tile's side differs from the preset's input size.
INTERPOLATIONS: tuple[str, ...] = ("bilinear", "bicubic")
#: Key layouts a weights file may be published in (:mod:`wsi_pipeline.models.layouts`).
LAYOUTS: tuple[str, ...] = ("timm", "transformers_vit", "transformers_dinov2", "dinov2_hub")
#: Who decided a preset's resize of tiles whose side is not the input size: its model card's
#: transform ("card"), or we, where the card resizes nothing ("ours").
RESIZE_POLICIES: tuple[str, ...] = ("card", "ours")


@dataclass(frozen=True)
class Preset:
    """A foundation model as its model card defines it.

    Attributes
    ----------
    name : the preset's ``encoder.name``.
    architecture : the timm model name.
    timm_kwargs : keyword arguments for ``timm.create_model``; a ``*_layer`` given as a string
        names a layer of ``timm.layers`` (``mlp_layer: SwiGLUPacked``), except ``act_layer`` and
        ``norm_layer``, whose names timm resolves itself (``act_layer: silu``); ``num_classes`` is
        always 0 (no classifier).
    embed_dim : D, the embedding's width.
    input_size : side in px the model takes; other tiles are resized (see the module docstring).
    mean, std : per-channel normalisation of RGB in [0, 1].
    embedding : one of :data:`EMBEDDINGS`.
    interpolation : one of :data:`INTERPOLATIONS`.
    crop_pct : the card's centre crop: resize to ``floor(input_size / crop_pct)`` then crop
        ``input_size`` (1.0: resize straight to ``input_size``).
    weights_files : the file name(s) the card publishes (named in refusals).
    source : where the weights are published; licence : their licence, as the card states it.
    resize_policy : one of :data:`RESIZE_POLICIES`; resize_note : where the card or the peers
        (TRIDENT, STAMP, LazySlide) differ.
    layout : the key layout of the published file (one of :data:`LAYOUTS`); a file in timm's
        own layout is accepted as well.
    norm_eps : epsilon of every LayerNorm where the card's library differs from timm's 1e-6
        (transformers' ViT: 1e-12); None: timm's.
    model : the model's name in words; unconfirmed : card facts this project could not check.
    """

    name: str
    architecture: str
    timm_kwargs: Mapping[str, Any]
    embed_dim: int | None
    input_size: int = 224
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    embedding: str = "pooled"
    interpolation: str = "bicubic"
    crop_pct: float = 1.0
    weights_files: tuple[str, ...] = ("pytorch_model.bin",)
    source: str = ""
    licence: str = ""
    resize_policy: str = "card"
    resize_note: str = ""
    layout: str = "timm"
    norm_eps: float | None = None
    model: str = ""
    unconfirmed: str = ""

    def describe(self) -> str:
        """One line for messages: ``uni_v1 (vit_large_patch16_224 from hf.co/MahmoodLab/UNI)``."""
        return f"{self.name} ({self.architecture}{' from ' + self.source if self.source else ''})"
