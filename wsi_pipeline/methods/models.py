"""Models from a method config: the encoder and aggregator (or PatchGD head) a method trains,
the frozen encoder of the baselines, and a checkpoint's encoder state loaded into them.

Shared by training (which builds and trains them) and by evaluation and prediction (which load a
trained run through :mod:`wsi_pipeline.checkpoints.files`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from wsi_pipeline.config.patchgd import PatchGDConfig
from wsi_pipeline.config.pipeline import MethodConfig, with_patchgd_head
from wsi_pipeline.config.strategy_traits import strategy_traits
from wsi_pipeline.models.heads import GridHead, build_head

__all__ = [
    "random_encoder_note",
    "FROZEN_INIT_SEED",
    "build_method_encoder",
    "build_models",
    "build_patchgd_head",
    "encoder_checkpoint",
    "frozen_encoder",
    "frozen_features_dir",
    "load_encoder_state",
    "num_features",
    "patchgd_method",
    "restore_encoder",
]

#: Seed of the random initialisation of a frozen encoder without weights (as ``extract_features``).
FROZEN_INIT_SEED = 0


def build_method_encoder(method: MethodConfig, *, weights: str | None = None, training: bool = True) -> nn.Module:
    """The encoder of ``method.encoder``: built by name with its weights file and options, fine-tuning prepared.

    For a foundation-model encoder: LoRA adapters are added (``encoder.lora``; also for
    inference, so a checkpoint's adapters load), the first blocks frozen (``freeze_blocks``),
    and with ``training`` and weights that train, activation checkpointing is switched on
    (``encoder.checkpointing``, default on). ``weights`` overrides ``method.encoder.weights``
    (``predict --encoder-weights``). Random initialisation follows torch's global generator.
    """
    from wsi_pipeline.models import build_encoder

    cfg = method.encoder
    path = weights if weights is not None else cfg.weights
    encoder = build_encoder(cfg.name, weights=path, **cfg.build_options())
    if not cfg.foundation:
        return encoder
    from wsi_pipeline.models.finetune import add_lora, freeze_first_blocks

    if cfg.lora is not None:
        add_lora(encoder.model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, first_block=cfg.freeze_blocks)
    freeze_first_blocks(encoder.model, cfg.freeze_blocks)
    trains = strategy_traits(method.strategy).trains_encoder and any(p.requires_grad for p in encoder.parameters())
    if training and trains and cfg.checkpointing is not False:
        encoder.model.set_grad_checkpointing(True)
    return encoder


def frozen_encoder(method: MethodConfig, weights: str | None = None) -> nn.Module:
    """The frozen encoder of a method: ``encoder.name`` with ``encoder.weights`` (or ``weights``), eval mode, no gradient.

    Without weights the encoder is initialised from a fixed seed, the one
    :func:`wsi_pipeline.inference.features.extract_features` uses, so features and model agree.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FROZEN_INIT_SEED)
        enc = build_method_encoder(method, weights=weights, training=False)
    enc.eval()
    enc.requires_grad_(False)
    return enc


def random_encoder_note(method: MethodConfig) -> str | None:
    """The warning for a method whose encoder starts from random weights (None when it has a weights file, or
    is ``precomputed``: no encoder runs)."""
    if method.encoder.weights or method.encoder.name == "precomputed":
        return None
    fix = ("`weights: imagenet` (torchvision's ImageNet checkpoint; `wsi-pipeline weights fetch "
           f"{method.encoder.name}` once) or a weights file" if method.encoder.name in ("resnet18", "resnet34", "resnet50")
           else "the weights file its model card publishes")
    return (f"{method.name}: encoder randomly initialised ({method.encoder.name} without weights); "
            f"for a pretrained start set encoder.weights to {fix}")


def frozen_features_dir(method: MethodConfig, features_root: str) -> str:
    """Feature folder of a frozen method: its ``features_dir``, else ``<features_root>/<encoder>[-<weights stem>]``
    (``timm:<architecture>`` becomes ``timm-<architecture>``)."""
    if method.features_dir:
        return method.features_dir
    tag = method.encoder.name.replace(":", "-")
    if method.encoder.weights:
        tag += "-" + Path(method.encoder.weights).stem
    return str(Path(features_root) / tag)


def encoder_checkpoint(method: MethodConfig, encoder: nn.Module, tile_size: int | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What a checkpoint keeps of ``encoder``: ``(state, info)``.

    ``info``: ``name``, ``weights_file`` and ``weights_sha256`` (the file the encoder started
    from, or None), ``preprocessing`` (JSON, for ``tile_size`` px tiles) and ``stored``:
    ``"trained"`` for a foundation encoder built from a weights file, whose ``state`` holds only
    the tensors that train (none for a frozen method; LoRA adapters; the unfrozen blocks; all of
    them for full fine-tuning), the rest being the file, which must then be found with the same
    sha256 to use the checkpoint; ``"full"`` otherwise (the whole state dict).
    """
    from wsi_pipeline.models.finetune import trained_state
    from wsi_pipeline.models.foundation import file_sha256, preprocessing_record

    from wsi_pipeline.models.imagenet import resolve_weights

    base = getattr(encoder, "base_weights", None)
    weights = method.encoder.weights
    if weights is not None and not base:
        weights = str(resolve_weights(method.encoder.name, weights))
    info: dict[str, Any] = {
        "name": method.encoder.name,
        "weights_file": None if weights is None else str(weights),
        "weights_sha256": base["sha256"] if base else (file_sha256(weights) if weights and Path(weights).is_file() else None),
        "preprocessing": None if tile_size is None else preprocessing_record(encoder, int(tile_size)),
        "stored": "trained" if base else "full",
    }
    state = trained_state(encoder) if base else encoder.state_dict()
    return state, info


def restore_encoder(method: MethodConfig, encoder: nn.Module, state: dict[str, torch.Tensor], info: dict[str, Any] | None, *,
                    where: str) -> nn.Module:
    """Load a checkpoint's encoder ``state`` (see :func:`encoder_checkpoint`) into ``encoder`` built for ``method``.

    With ``info["stored"] == "trained"`` the encoder must have been built from the base weights
    file whose sha256 ``info`` records: a different file is refused (``ValueError``), naming both.
    Returns the module holding the weights (see :func:`load_encoder_state`).
    """
    if not info or info.get("stored") != "trained":
        return load_encoder_state(method, encoder, state)
    from wsi_pipeline.models.finetune import load_trained_state

    base = getattr(encoder, "base_weights", None)
    want = info.get("weights_sha256")
    if base is None or base["sha256"] != want:
        found = "no weights file" if base is None else f"{base['file']} (sha256 {base['sha256'][:16]}...)"
        raise ValueError(
            f"{where}: this checkpoint stores only the trained part of encoder {info.get('name')!r}; the rest is the base "
            f"weights file {info.get('weights_file')} with sha256 {want}. Found {found}, which differs: point at the original "
            "file (predict --encoder-weights FILE, or encoder.weights in the config)"
        )
    load_trained_state(encoder, state, where=where)
    return encoder


def build_models(method: MethodConfig, n_classes: int, *, device: str | torch.device = "cpu", for_training: bool = True,
                 encoder_weights: str | None = None) -> tuple[nn.Module, nn.Module]:
    """Build a method's ``(encoder, aggregator)``; the aggregator is the PatchGD head for ``patchgd``.

    ``encoder_weights`` replaces ``encoder.weights`` (a trained method's encoder whose base file moved).

    Random initialisation follows torch's global generator (seed it first). ``for_training``
    converts a ``bigl`` encoder to Big-Layers; for inference a ``bigl`` encoder is an
    :class:`~wsi_pipeline.bigl.EmbeddingEncoder` (plain on the device when a call fits
    ``bigl.embed_budget_mib``, Big-Layers otherwise; plain encoder's state dict).
    """
    from wsi_pipeline.models import build_aggregator

    traits = strategy_traits(method.strategy)
    if not traits.trains_encoder:
        encoder = frozen_encoder(method, encoder_weights)
    else:
        encoder = build_method_encoder(method, weights=encoder_weights, training=for_training)
    dim = num_features(encoder)
    if traits.grid_head:
        aggregator = build_patchgd_head(method.patchgd_config, dim, n_classes)
    else:
        aggregator = build_aggregator(method.aggregator.name, dim, n_classes, **dict(method.aggregator.options))
    encoder.to(device)
    aggregator.to(device)
    if traits.big_layers:
        encoder = _bigify(method, encoder, device) if for_training else _embedding_encoder(method, encoder)
    return encoder, aggregator


def embed_budget(method: MethodConfig) -> int | None:
    mib = getattr(method.bigl, "embed_budget_mib", None)
    return None if mib is None else int(mib * 2**20)


def _embedding_encoder(method: MethodConfig, encoder: nn.Module) -> nn.Module:
    """A ``bigl`` method's inference encoder (plain when a call fits the budget, else Big-Layers)."""
    from wsi_pipeline.bigl import EmbeddingEncoder
    from wsi_pipeline.models.encoders import ResNet

    return EmbeddingEncoder(cast(ResNet, encoder), stages=method.bigl.stages, max_elements=method.bigl.max_elements,
                            budget_bytes=embed_budget(method))


def num_features(encoder: nn.Module) -> int:
    """D, the embedding size of a tile encoder (its ``num_features``)."""
    n = getattr(encoder, "num_features", None)
    if n is None:
        raise TypeError(f"encoder {type(encoder).__name__} has no `num_features` (its embedding size)")
    return int(n)


def patchgd_method(method: MethodConfig) -> MethodConfig:
    """``method`` with its PatchGD head named in ``patchgd`` (the one rule:
    :func:`wsi_pipeline.config.pipeline.patchgd_mapping`)."""
    return with_patchgd_head(method)


def _bigify(method: MethodConfig, encoder: nn.Module, device: str | torch.device) -> nn.Module:
    from wsi_pipeline.bigl import bigify

    dim = num_features(encoder)
    big = bigify(encoder, method.bigl.stages, method.bigl.max_elements, device=torch.device(device),
                 device_budget_gb=getattr(method.bigl, "device_budget_gb", None))
    if not hasattr(big, "num_features"):
        big.num_features = dim
    return big


def load_encoder_state(method: MethodConfig, encoder: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load a checkpoint's encoder state into a plain encoder (a Big-Layers state is converted when needed).

    Returns the module holding the weights (the plain encoder, or its Big-Layers version when
    the Big-Layers parameter names differ from the plain ones).
    """
    try:
        encoder.load_state_dict(state)
        return encoder
    except RuntimeError:
        if not strategy_traits(method.strategy).big_layers:
            raise
    big = _bigify(method, encoder, "cpu")
    big.load_state_dict(state)
    return big


def build_patchgd_head(method_cfg: Mapping[str, Any] | PatchGDConfig | None, in_dim: int, n_classes: int) -> GridHead:
    """Build the head a method config asks for (``head``, ``head_options``, ``max_grid``, ``proj_dim``)."""
    cfg = method_cfg if isinstance(method_cfg, PatchGDConfig) else PatchGDConfig.for_method(method_cfg)
    options = {"max_grid": cfg.max_grid, "proj_dim": cfg.proj_dim, **dict(cfg.head_options)}
    return build_head(cfg.head, in_dim, n_classes, **options)
