"""Key maps from the layouts model cards publish onto timm's ``VisionTransformer``: one small map per layout.

A card publishes its weights the way its own library saves them: timm (most), transformers
(``ViTModel``: Phikon; ``Dinov2Model``: Phikon-v2, Midnight) or the DINOv2 hub code (``cls_token``,
``register_tokens``, ``blocks.N.mlp.w12`` ...: DINOv2-trained checkpoints). :func:`to_timm_layout`
renames a file's keys to timm's, splits nothing and re-implements nothing: every tensor is the
file's, except where the layouts store one thing differently:

* transformers keeps query, key and value as three linear layers; timm packs them as ``qkv``
  (concatenated in that order along the output dimension);
* DINOv2 with registers adds the class token's position to the class token and none to the
  registers; timm's ``no_embed_class`` models hold the patch positions only, so the class
  position is folded into ``cls_token`` (timm's own rule for these checkpoints);
* position embeddings stored for another grid than the model's (DINOv2-trained files hold
  37 x 37 for 518 px) are resampled once, at load time, as the card's library does at every
  forward: transformers (5.x) ``interpolate(size=grid, mode="bicubic", align_corners=False)`` in
  float32, no antialiasing; the DINOv2 hub code with a scale factor of ``(grid + 0.1) / M`` and no
  antialiasing. The model then runs at its own grid without resampling anything.

Keys that carry no part of the embedding are dropped by name (transformers' ``pooler.dense``, the
masked-training ``mask_token``); any other key a map does not know is refused, naming the file's
layout, the keys and what was expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F

__all__ = ["detect_layout", "resample_grid", "to_timm_layout"]

#: Keys read and dropped, per layout: they do not take part in the embedding.
DROPPED: dict[str, tuple[str, ...]] = {
    "transformers_vit": ("pooler.dense.weight", "pooler.dense.bias"),
    "transformers_dinov2": ("embeddings.mask_token",),
    "dinov2_hub": ("mask_token",),
}

_BLOCK_TF = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_BLOCK_HUB = re.compile(r"^blocks\.(?:\d+\.)?(\d+)\.(.+)$")  # block-chunked training checkpoints: blocks.<chunk>.<i>.

#: Per layout, the names inside one transformer block: the file's suffix -> timm's suffix.
_BLOCK_KEYS: dict[str, dict[str, str]] = {
    "transformers_vit": {
        "layernorm_before": "norm1", "layernorm_after": "norm2", "attention.output.dense": "attn.proj",
        "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
    },
    "transformers_dinov2": {
        "norm1": "norm1", "norm2": "norm2", "attention.output.dense": "attn.proj", "layer_scale1.lambda1": "ls1.gamma",
        "layer_scale2.lambda1": "ls2.gamma", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "mlp.weights_in": "mlp.fc1",
        "mlp.weights_out": "mlp.fc2",
    },
    "dinov2_hub": {
        "norm1": "norm1", "norm2": "norm2", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "ls1.gamma": "ls1.gamma",
        "ls2.gamma": "ls2.gamma", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "mlp.w12": "mlp.fc1", "mlp.w3": "mlp.fc2",
    },
}
#: Per layout, the names outside the blocks: the file's key -> timm's key.
_TOP_KEYS: dict[str, dict[str, str]] = {
    "transformers_vit": {
        "embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
        "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
        "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
        "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
    },
    "dinov2_hub": {
        "cls_token": "cls_token", "pos_embed": "pos_embed", "register_tokens": "reg_token",
        "patch_embed.proj.weight": "patch_embed.proj.weight", "patch_embed.proj.bias": "patch_embed.proj.bias",
        "norm.weight": "norm.weight", "norm.bias": "norm.bias",
    },
}
_TOP_KEYS["transformers_dinov2"] = {**_TOP_KEYS["transformers_vit"], "embeddings.register_tokens": "reg_token"}
_QKV = ("query", "key", "value")


def detect_layout(state: Mapping[str, torch.Tensor]) -> str:
    """The layout a state dict is in, from its keys: ``transformers_vit`` / ``transformers_dinov2``
    (``embeddings.*``, told apart by DINOv2's LayerScale ``lambda1``), ``dinov2_hub`` (DINOv2's
    ``mask_token`` / ``register_tokens`` / ``mlp.w12``), else ``timm``."""
    keys = list(state)
    if any(k.startswith("embeddings.patch_embeddings.") for k in keys):
        return "transformers_dinov2" if any(k.endswith(".lambda1") or k == "embeddings.mask_token" for k in keys) else "transformers_vit"
    if "mask_token" in state or "register_tokens" in state or any(".mlp.w12." in k for k in keys):
        return "dinov2_hub"
    return "timm"


def resample_grid(pos: torch.Tensor, grid: tuple[int, int], *, method: str) -> torch.Tensor:
    """Patch position embeddings ``[1, M*M, D]`` resampled to ``grid`` (rows, cols) -> ``[1, rows*cols, D]``.

    ``method``: ``"transformers"`` (bicubic to the size, float32, no antialiasing: transformers 5.x
    ``Dinov2Embeddings.interpolate_pos_encoding``) or ``"dinov2_hub"`` (bicubic by the scale factor
    ``(grid + 0.1) / M``, no antialiasing: the DINOv2 hub code's ``interpolate_offset``).
    """
    n, dim = pos.shape[1], pos.shape[2]
    m = math.isqrt(n)
    if m * m != n:
        raise ValueError(f"position embeddings of {n} patches are not a square grid")
    x = pos.reshape(1, m, m, dim).permute(0, 3, 1, 2).float()
    if method == "transformers":
        x = F.interpolate(x, size=grid, mode="bicubic", align_corners=False)
    elif method == "dinov2_hub":
        scale = (float(grid[1] + 0.1) / m, float(grid[0] + 0.1) / m)  # the hub code passes (w, h) factors to a (h, w) map
        x = F.interpolate(x, scale_factor=scale, mode="bicubic", antialias=False)
        if tuple(x.shape[-2:]) != tuple(grid):
            raise ValueError(f"resampled position grid {tuple(x.shape[-2:])}, expected {grid}")
    else:
        raise ValueError(f"unknown resampling method {method!r}")
    return x.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], dim).to(pos.dtype)


def _rename(state: Mapping[str, torch.Tensor], layout: str, what: str) -> dict[str, torch.Tensor]:
    top, block = _TOP_KEYS[layout], _BLOCK_KEYS[layout]
    pattern = _BLOCK_HUB if layout == "dinov2_hub" else _BLOCK_TF
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        if key in DROPPED.get(layout, ()):
            continue
        if key in top:
            out[top[key]] = value
            continue
        hit = pattern.match(key)
        if hit:
            i, rest = int(hit.group(1)), hit.group(2)
            name, _, kind = rest.rpartition(".")
            if layout != "dinov2_hub" and name.startswith("attention.attention.") and name.rsplit(".", 1)[1] in _QKV:
                qkv.setdefault((i, kind), {})[name.rsplit(".", 1)[1]] = value
                continue
            if name in block:
                out[f"blocks.{i}.{block[name]}.{kind}"] = value
                continue
            if rest in block:  # a parameter without .weight/.bias (lambda1, gamma)
                out[f"blocks.{i}.{block[rest]}"] = value
                continue
        unknown.append(key)
    if unknown:
        more = f" ... ({len(unknown) - 8} more)" if len(unknown) > 8 else ""
        raise ValueError(f"{what}: keys unknown to the {layout} layout: {', '.join(unknown[:8])}{more}; expected the "
                         f"keys of {'/'.join(top)} and per block {'/'.join(block)}"
                         f"{'/attention.attention.query|key|value' if layout != 'dinov2_hub' else ''}")
    for (i, kind), parts in sorted(qkv.items()):
        if set(parts) != set(_QKV):
            raise ValueError(f"{what}: block {i} has {sorted(parts)} of attention {kind}, expected query, key and value")
        out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts[p] for p in _QKV], dim=0)
    return out


def to_timm_layout(
    state: Mapping[str, torch.Tensor],
    layout: str,
    model_shapes: Mapping[str, torch.Size],
    *,
    what: str,
) -> dict[str, torch.Tensor]:
    """A state dict in ``layout`` as timm's ``VisionTransformer`` names it, fitted to ``model_shapes``.

    ``layout``: ``timm`` (returned as it is), ``transformers_vit``, ``transformers_dinov2`` or
    ``dinov2_hub``. ``model_shapes``: the timm model's state-dict shapes (where its position grid
    and whether it keeps the class position are read). ``what`` names the file in errors.

    Raises ``ValueError`` for a key the layout does not know, or an incomplete attention.
    """
    if layout == "timm":
        return dict(state)
    if layout not in _TOP_KEYS:
        raise ValueError(f"{what}: unknown layout {layout!r}; expected timm or one of {sorted(_TOP_KEYS)}")
    out = _rename(state, layout, what)
    pos, target = out.get("pos_embed"), model_shapes.get("pos_embed")
    if pos is not None and target is not None:
        with_cls = pos.shape[1] - 1  # every layout here stores the class position first
        patches = pos[:, 1:]
        if "reg_token" in out and target[1] == math.isqrt(target[1]) ** 2:  # timm's no_embed_class: patches only
            out["cls_token"] = out["cls_token"] + pos[:, :1]
            keep_cls = None
        else:
            keep_cls = pos[:, :1]
        n_target = target[1] - (0 if keep_cls is None else 1)
        side = math.isqrt(n_target)
        if with_cls != n_target:
            method = "dinov2_hub" if layout == "dinov2_hub" else "transformers"
            patches = resample_grid(patches, (side, side), method=method)
        out["pos_embed"] = patches if keep_cls is None else torch.cat([keep_cls, patches], dim=1)
    return out
