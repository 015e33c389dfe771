"""Partial fine-tuning of a foundation-model ViT: frozen first blocks, LoRA adapters, what a checkpoint keeps.

- :func:`freeze_first_blocks`: the patch embedding, position embedding, class and register
  tokens and the first N transformer blocks stop training (``requires_grad=False``).
- :class:`LoRALinear` / :func:`add_lora`: low-rank adapters (Hu et al. 2021) on the attention's
  ``qkv`` and ``proj`` layers; the base weights are frozen.
- :func:`trained_state` / :func:`load_trained_state`: a checkpoint of a partially trained
  encoder holds only its trained tensors (the rest is the base weights file, identified by its
  sha256; H-optimus-0's is 4.4 GB).

LoRA is ours rather than ``peft``'s: peft 0.21 brings transformers, accelerate, tokenizers and
the Hugging Face hub client (about ten packages, none of which this project uses otherwise; the
project never contacts a hub), and wraps each adapted layer under new state-dict names
(``base_layer``), while here the adapter is a subclass of ``nn.Linear`` that keeps the layer's
own ``weight``/``bias`` names (a published weights file loads before and after adding adapters)
and adds ``lora_a``/``lora_b``: a dozen lines of arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRALinear", "add_lora", "freeze_first_blocks", "load_trained_state", "trained_state"]

#: Parameters before the first block (frozen with it): timm ViT names.
_EMBEDDING_PARAMS = ("patch_embed.", "cls_token", "reg_token", "pos_embed", "norm_pre.")


class LoRALinear(nn.Linear):
    """``y = x W^T + b + (alpha / rank) (x A^T) B^T``: a linear layer with a trained low-rank update.

    Built from an existing ``nn.Linear`` (its ``weight`` and ``bias`` Parameters are reused, so
    their state-dict names stay ``weight``/``bias``, frozen). ``lora_a`` [rank, in] starts as
    ``nn.Linear``'s default (Kaiming-uniform) initialisation, ``lora_b`` [out, rank] at zero, so
    the layer starts equal to the base layer.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = int(rank)
        self.scaling = float(alpha) / float(rank)
        kw: dict[str, Any] = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(self.rank, self.in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, self.rank, **kw))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def _blocks(model: nn.Module, what: str) -> nn.Sequential:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential) or len(blocks) == 0:
        raise ValueError(f"{what} needs a ViT with transformer blocks (timm's `blocks`); {type(model).__name__} has none")
    return blocks


def freeze_first_blocks(model: nn.Module, n: int) -> None:
    """Stop training the embeddings and the first ``n`` blocks of a timm ViT ``model`` (``n`` >= 1).

    Raises ``ValueError`` when ``n`` exceeds the number of blocks.
    """
    blocks = _blocks(model, "encoder.freeze_blocks")
    if n > len(blocks):
        raise ValueError(f"encoder.freeze_blocks={n}, but the encoder has {len(blocks)} blocks")
    if n <= 0:
        return
    for name, p in model.named_parameters():
        if name.startswith(_EMBEDDING_PARAMS):
            p.requires_grad_(False)
    for blk in blocks[:n]:
        blk.requires_grad_(False)


def add_lora(model: nn.Module, rank: int, alpha: float, targets: Iterable[str], *, first_block: int = 0) -> int:
    """Replace ``attn.<target>`` of blocks ``first_block..`` of a timm ViT by :class:`LoRALinear`; freeze everything else.

    Returns the number of adapted layers. Raises ``ValueError`` when a block has no such linear layer.
    """
    blocks = _blocks(model, "encoder.lora")
    model.requires_grad_(False)
    count = 0
    for i, blk in enumerate(blocks):
        if i < first_block:
            continue
        attn = getattr(blk, "attn", None)
        for target in targets:
            layer = getattr(attn, target, None)
            if isinstance(layer, LoRALinear):
                raise ValueError(f"block {i} attn.{target} already has LoRA adapters")
            if not isinstance(layer, nn.Linear):
                raise ValueError(f"encoder.lora.targets: block {i} has no linear layer attn.{target} "
                                 f"(found {type(layer).__name__}); this architecture's attention is not timm's Attention")
            setattr(attn, target, LoRALinear(layer, rank, alpha))
            count += 1
    return count


def trained_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` that train (``requires_grad``), by state-dict name, detached."""
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def load_trained_state(module: nn.Module, state: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Load a :func:`trained_state` into ``module``, whose other tensors come from its base weights.

    Raises ``ValueError`` (naming ``where``) when a key is not one of the module's, or a shape differs.
    """
    own = module.state_dict()
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
              if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    if unexpected or shapes:
        raise ValueError(f"{where}: the trained encoder tensors do not fit this encoder: unexpected keys "
                         f"{unexpected[:8]}, shape mismatches {shapes[:4]}; was it trained with the same encoder config?")
    module.load_state_dict(dict(state), strict=False)
