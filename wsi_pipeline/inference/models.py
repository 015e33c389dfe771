"""Models from a method config: the encoder and aggregator (or PatchGD head) a method trains,
the frozen encoder of the baselines, and a checkpoint's encoder state loaded into them.

Shared by training (which builds and trains them) and by evaluation and prediction (which load a
trained run through :mod:`wsi_pipeline.inference.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.config.patchgd import PatchGDConfig, patchgd_mapping, with_patchgd_head
from wsi_pipeline.models.heads import GridHead, build_head

__all__ = [
    "FROZEN_INIT_SEED",
    "build_models",
    "build_patchgd_head",
    "frozen_encoder",
    "frozen_features_dir",
    "load_encoder_state",
    "patchgd_method",
]

#: Seed of the random initialisation of a frozen encoder without weights (as ``extract_features``).
FROZEN_INIT_SEED = 0


def frozen_encoder(method: Any) -> nn.Module:
    """The frozen encoder of a method: ``encoder.name`` with ``encoder.weights``, eval mode, no gradient.

    Without weights the encoder is initialised from a fixed seed, the one
    :func:`wsi_pipeline.inference.features.extract_features` uses, so features and model agree.
    """
    from wsi_pipeline.models import build_encoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FROZEN_INIT_SEED)
        enc = build_encoder(method.encoder.name, weights=method.encoder.weights)
    enc.eval()
    enc.requires_grad_(False)
    return enc


def frozen_features_dir(method: Any, features_root: str) -> str:
    """Feature folder of a frozen method: its ``features_dir``, else ``<features_root>/<encoder>[-<weights stem>]``."""
    if method.features_dir:
        return method.features_dir
    from pathlib import Path

    tag = method.encoder.name
    if method.encoder.weights:
        tag += "-" + Path(method.encoder.weights).stem
    return str(Path(features_root) / tag)


def build_models(method: Any, n_classes: int, *, device: str | torch.device = "cpu", for_training: bool = True) -> tuple[nn.Module, nn.Module]:
    """Build a method's ``(encoder, aggregator)``; the aggregator is the PatchGD head for ``patchgd``.

    Random initialisation follows torch's global generator (seed it first). ``for_training``
    converts a ``bigl`` encoder to Big-Layers; for inference a ``bigl`` encoder is an
    :class:`~wsi_pipeline.bigl.EmbeddingEncoder` (plain on the device when a call fits
    ``bigl.embed_budget_mib``, Big-Layers otherwise; plain encoder's state dict).
    """
    from wsi_pipeline.models import build_aggregator, build_encoder

    if method.strategy == "frozen":
        encoder = frozen_encoder(method)
    else:
        encoder = build_encoder(method.encoder.name, weights=method.encoder.weights)
    dim = int(encoder.num_features)
    if method.strategy == "patchgd":
        aggregator = build_patchgd_head(patchgd_method(method), dim, n_classes)
    else:
        aggregator = build_aggregator(method.aggregator.name, dim, n_classes, **dict(method.aggregator.options))
    encoder.to(device)
    aggregator.to(device)
    if method.strategy == "bigl":
        encoder = _bigify(method, encoder, device) if for_training else _embedding_encoder(method, encoder)
    return encoder, aggregator


def embed_budget(method: Any) -> int | None:
    mib = getattr(method.bigl, "embed_budget_mib", None)
    return None if mib is None else int(mib * 2**20)


def _embedding_encoder(method: Any, encoder: nn.Module) -> nn.Module:
    """A ``bigl`` method's inference encoder (plain when a call fits the budget, else Big-Layers)."""
    from wsi_pipeline.bigl import EmbeddingEncoder

    return EmbeddingEncoder(encoder, stages=method.bigl.stages, max_elements=method.bigl.max_elements,
                            budget_bytes=embed_budget(method))


def patchgd_method(method: MethodConfig) -> MethodConfig:
    """``method`` with its PatchGD head named in ``patchgd`` (the one rule:
    :func:`wsi_pipeline.config.patchgd.patchgd_mapping`)."""
    return with_patchgd_head(method)


def _bigify(method: Any, encoder: nn.Module, device: str | torch.device) -> nn.Module:
    from wsi_pipeline.bigl import bigify

    dim = encoder.num_features
    big = bigify(encoder, method.bigl.stages, method.bigl.max_elements, device=torch.device(device),
                 device_budget_gb=getattr(method.bigl, "device_budget_gb", None))
    if not hasattr(big, "num_features"):
        big.num_features = dim
    return big


def load_encoder_state(method: Any, encoder: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load a checkpoint's encoder state into a plain encoder (a Big-Layers state is converted when needed).

    Returns the module holding the weights (the plain encoder, or its Big-Layers version when
    the Big-Layers parameter names differ from the plain ones).
    """
    try:
        encoder.load_state_dict(state)
        return encoder
    except RuntimeError:
        if method.strategy != "bigl":
            raise
    big = _bigify(method, encoder, "cpu")
    big.load_state_dict(state)
    return big


def build_patchgd_head(method_cfg: Mapping[str, Any] | PatchGDConfig | None, in_dim: int, n_classes: int) -> GridHead:
    """Build the head a method config asks for (``head``, ``head_options``, ``max_grid``, ``proj_dim``)."""
    cfg = method_cfg if isinstance(method_cfg, PatchGDConfig) else PatchGDConfig.from_mapping(patchgd_mapping(method_cfg))
    options = {"max_grid": cfg.max_grid, "proj_dim": cfg.proj_dim, **dict(cfg.head_options)}
    return build_head(cfg.head, in_dim, n_classes, **options)
