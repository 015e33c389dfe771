"""Pathology foundation-model tile encoders (UNI, UNI2-h, Virchow/Virchow2, H-optimus-0/1, H0-mini, Prov-GigaPath,
Kaiko, Lunit, GPFM, Phikon/Phikon-v2, Midnight), and any timm model.

Each preset is defined as its model card defines it: the timm architecture and the keyword
arguments its card passes to ``timm.create_model``, the input size, the normalisation, which
output is the embedding and the checkpoint file the card publishes. The network is timm's own
(``timm.create_model(arch, pretrained=False, **kwargs)``): nothing here re-implements a ViT, so
our encoder cannot drift from the definition the weights were trained with. Weights come only
from a local file (``.bin`` / ``.pth`` / ``.pt`` read with ``torch.load(weights_only=True)``,
``.safetensors`` with safetensors), loaded strictly; nothing is downloaded and no hub is asked.
Cards that publish transformers or DINOv2-hub keys are read through one key map per layout
(:mod:`wsi_pipeline.models.layouts`). ``timm:<architecture>`` builds any other timm model with
keyword arguments from the YAML. The six first presets are below; the others are in
:mod:`wsi_pipeline.models.catalogue`; the README's table is generated from :data:`PRESETS`.

=============  ===============================  =====  ======  ================================
preset         timm architecture                px     D       embedding
=============  ===============================  =====  ======  ================================
``uni_v1``     vit_large_patch16_224 (ViT-L/16)  224   1024    class token
``uni_v2``     vit_giant_patch14_224 (UNI2-h)    224   1536    class token
``virchow2``   vit_huge_patch14_224 (ViT-H/14)   224   2560    class token ++ mean of patch tokens
``hoptimus0``  vit_giant_patch14_reg4_dinov2     224   1536    class token
``hoptimus1``  vit_giant_patch14_reg4_dinov2     224   1536    class token
``gigapath``   vit_giant_patch14_dinov2 (p=16)   224   1536    class token
=============  ===============================  =====  ======  ================================

Input convention. Every stage of the pipeline converts tiles once, with
:func:`wsi_pipeline.data.tensors.tiles_to_tensor` (uint8 / 255, then ImageNet mean/std). A
:class:`FoundationEncoder` takes that tensor and applies its preset's preprocessing as its first
step, so every path (features, training, validation, evaluation, prediction, PatchGD,
augmentation) feeds each preset what its card asks for without knowing which preset it runs:

1. resize, only when the tile's side differs from the preset's input size (224 px tiles go in
   untouched): ``torch.nn.functional.interpolate`` antialiased (the PIL-style filter torchvision
   applies to PIL images), ``align_corners=False``, with the preset's interpolation. Where the card's
   transform resizes (``resize_policy="card"``) it is the card's: bilinear for UNI and UNI2-h (their
   ``Resize(224)``), bicubic for Virchow2; for Prov-GigaPath, whose card resizes to 256 px and crops
   the central 224 px, the same (a 256 px tile is only cropped). Where the card resizes nothing
   (H-optimus-0/1 expect 224 px tiles at 0.5 um/px: ``resize_policy="ours"``) the bicubic resize is
   our choice; the peers differ (TRIDENT and STAMP ``Resize(224)`` bilinear, LazySlide bicubic and
   a centre crop); each preset's ``resize_note`` says which;
2. the affine map from ImageNet normalisation to the preset's (exactly the identity, and skipped,
   for presets normalised with ImageNet statistics; for H-optimus the composition equals
   ``(x / 255 - mean) / std`` up to float rounding, a few units in the last place).

Interpolation is linear in the pixel values and keeps constants, so resizing the normalised
tensor equals normalising the resized tile (no clamping to 0..255 happens, unlike PIL).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from wsi_pipeline.model_files import UnsafeModelFileError, load_torch_file
from wsi_pipeline.models.catalogue import CATALOGUE
from wsi_pipeline.models.input_norm import IMAGENET_MEAN, IMAGENET_STD
from wsi_pipeline.models.layouts import detect_layout, to_timm_layout
from wsi_pipeline.models.preset import EMBEDDINGS, Preset

__all__ = [
    "PRESETS",
    "TIMM_PREFIX",
    "FoundationEncoder",
    "build_foundation_encoder",
    "file_sha256",
    "is_foundation_name",
    "load_state_file",
    "preprocessing_record",
    "replace_preset",
    "resolve_preset",
]

log = logging.getLogger(__name__)

#: ``encoder.name`` prefix for any timm architecture: ``timm:vit_small_patch16_224``.
TIMM_PREFIX = "timm:"
#: The file extensions read, and how.
WEIGHT_SUFFIXES: tuple[str, ...] = (".bin", ".pth", ".pt", ".safetensors")


_HOPTIMUS_MEAN = (0.707223, 0.578729, 0.703617)
_HOPTIMUS_STD = (0.211883, 0.230117, 0.177517)
#: H-optimus cards resize nothing (they expect 224 px tiles at 0.5 um/px); the resize of other sides is ours.
_HOPTIMUS_RESIZE = ("card: none (224 px tiles at 0.5 um/px expected); ours: bicubic antialiased; TRIDENT and STAMP: "
                    "Resize(224) bilinear; LazySlide: Resize(224) bicubic + CenterCrop(224)")

#: The presets, by ``encoder.name``.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "uni_v1", "vit_large_patch16_224",
            dict(img_size=224, patch_size=16, init_values=1e-5, num_classes=0, dynamic_img_size=True),
            embed_dim=1024, interpolation="bilinear", source="huggingface.co/MahmoodLab/UNI", licence="CC-BY-NC-ND-4.0 (gated)",
            resize_note="card: torchvision Resize(224) (bilinear); TRIDENT the same", model="UNI (Mahmood lab)",
        ),
        Preset(
            "uni_v2", "vit_giant_patch14_224",
            dict(img_size=224, patch_size=14, depth=24, num_heads=24, init_values=1e-5, embed_dim=1536,
                 mlp_ratio=2.66667 * 2, num_classes=0, no_embed_class=True, mlp_layer="SwiGLUPacked",
                 act_layer="silu", reg_tokens=8, dynamic_img_size=True),
            embed_dim=1536, interpolation="bilinear", source="huggingface.co/MahmoodLab/UNI2-h", licence="CC-BY-NC-ND-4.0 (gated)",
            resize_note="card: torchvision Resize(224) (bilinear); TRIDENT the same", model="UNI2-h (Mahmood lab)",
        ),
        Preset(
            "virchow2", "vit_huge_patch14_224",
            dict(img_size=224, init_values=1e-5, num_classes=0, mlp_ratio=5.3375, reg_tokens=4, global_pool="",
                 dynamic_img_size=True, mlp_layer="SwiGLUPacked", act_layer="silu"),
            embed_dim=2560, embedding="cls_mean", weights_files=("pytorch_model.bin", "model.safetensors"),
            source="huggingface.co/paige-ai/Virchow2", licence="CC-BY-NC-ND-4.0 (gated)",
            resize_note="card: Resize(224) bicubic + CenterCrop(224) (timm's data config); TRIDENT the same",
            model="Virchow2 (Paige)",
        ),
        Preset(
            "hoptimus0", "vit_giant_patch14_reg4_dinov2",
            dict(img_size=224, init_values=1e-5, num_classes=0, dynamic_img_size=False, global_pool="token"),
            embed_dim=1536, mean=_HOPTIMUS_MEAN, std=_HOPTIMUS_STD, weights_files=("pytorch_model.bin", "model.safetensors"),
            source="huggingface.co/bioptimus/H-optimus-0", licence="Apache-2.0 (not gated)", resize_policy="ours",
            resize_note=_HOPTIMUS_RESIZE, model="H-optimus-0 (Bioptimus)",
        ),
        Preset(
            "hoptimus1", "vit_giant_patch14_reg4_dinov2",
            dict(img_size=224, init_values=1e-5, num_classes=0, dynamic_img_size=False, global_pool="token"),
            embed_dim=1536, mean=_HOPTIMUS_MEAN, std=_HOPTIMUS_STD, weights_files=("pytorch_model.bin", "model.safetensors"),
            source="huggingface.co/bioptimus/H-optimus-1", licence="CC-BY-NC-ND-4.0 (gated: access form)", resize_policy="ours",
            resize_note=_HOPTIMUS_RESIZE, model="H-optimus-1 (Bioptimus)",
        ),
        Preset(
            "gigapath", "vit_giant_patch14_dinov2",
            dict(img_size=224, in_chans=3, patch_size=16, embed_dim=1536, depth=40, num_heads=24, init_values=1e-5,
                 mlp_ratio=5.33334, num_classes=0),
            embed_dim=1536, crop_pct=224 / 256, source="huggingface.co/prov-gigapath/prov-gigapath",
            licence="Apache-2.0 (gated; see the model card's terms)",
            resize_note="card: Resize(256) bicubic + CenterCrop(224); TRIDENT the same", model="Prov-GigaPath tile encoder",
        ),
    )
}
PRESETS.update(CATALOGUE)


def is_foundation_name(name: str) -> bool:
    """True for a preset name or a ``timm:<architecture>`` name."""
    return name in PRESETS or (name.startswith(TIMM_PREFIX) and len(name) > len(TIMM_PREFIX))


def resolve_preset(
    name: str,
    *,
    timm_kwargs: Mapping[str, Any] | None = None,
    mean: tuple[float, float, float] | None = None,
    std: tuple[float, float, float] | None = None,
    input_size: int | None = None,
    embedding: str | None = None,
) -> Preset:
    """The :class:`Preset` of ``name``: a registered preset, or one made for ``timm:<architecture>``.

    The keyword options apply to ``timm:`` names only (a preset is what its card says); for
    ``timm:`` names ``timm_kwargs`` go to ``timm.create_model``, ``mean``/``std`` default to
    ImageNet's, ``input_size`` to ``timm_kwargs["img_size"]`` else 224, ``embedding`` to ``pooled``.

    Raises ``ValueError`` for an unknown name or options given to a preset.
    """
    given = {k: v for k, v in dict(timm_kwargs=timm_kwargs or None, mean=mean, std=std, input_size=input_size,
                                     embedding=embedding).items() if v is not None}
    if name in PRESETS:
        if given:
            raise ValueError(
                f"encoder {name!r} is a preset defined by its model card; {sorted(given)} apply to 'timm:<architecture>' "
                f"encoders only (use e.g. name: timm:{PRESETS[name].architecture} to change it)"
            )
        return PRESETS[name]
    if not is_foundation_name(name):
        raise ValueError(f"unknown foundation encoder {name!r}; choose one of {sorted(PRESETS)} or 'timm:<architecture>'")
    kwargs = dict(timm_kwargs or {})
    if embedding is not None and embedding not in EMBEDDINGS:
        raise ValueError(f"encoder.embedding={embedding!r}; expected one of {list(EMBEDDINGS)}")
    size = input_size if input_size is not None else int(kwargs.get("img_size", 224))
    return Preset(
        name=name, architecture=name[len(TIMM_PREFIX):], timm_kwargs=kwargs, embed_dim=None, input_size=int(size),
        mean=tuple(mean) if mean is not None else IMAGENET_MEAN,  # type: ignore[arg-type]
        std=tuple(std) if std is not None else IMAGENET_STD,  # type: ignore[arg-type]
        embedding=embedding or "pooled", weights_files=("<your file>.safetensors / .bin / .pth",),
    )


def _timm_kwargs(preset: Preset) -> dict[str, Any]:
    """``timm.create_model`` keywords of a preset: layer names resolved, no classifier."""
    import timm.layers

    out: dict[str, Any] = {}
    for k, v in preset.timm_kwargs.items():
        # "SwiGLUPacked" -> timm.layers.SwiGLUPacked; act_layer / norm_layer strings ("silu") timm resolves itself
        if k.endswith("_layer") and k not in ("act_layer", "norm_layer") and isinstance(v, str):
            if not callable(getattr(timm.layers, v, None)):
                raise ValueError(f"encoder {preset.name!r}: {k}={v!r} is not a layer of timm.layers")
            v = getattr(timm.layers, v)
        out[k] = v
    if preset.norm_eps is not None:  # the card's library's LayerNorm epsilon (transformers' ViT: 1e-12)
        out["norm_layer"] = functools.partial(nn.LayerNorm, eps=preset.norm_eps)
    out["num_classes"] = 0
    return out


class _TimmTrunk(Protocol):
    """The two methods of a timm model this wrapper calls."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor: ...


class FoundationEncoder(nn.Module):
    """A timm model with its preset's preprocessing and embedding: ``[B, 3, T, T]`` -> ``[B, D]``.

    The input is what :func:`~wsi_pipeline.data.tensors.tiles_to_tensor` gives (RGB / 255, ImageNet
    mean/std, any tile side T); see the module docstring for the steps. The state dict is the timm
    model's, under ``model.``.

    Attributes
    ----------
    model : the timm model (``model.blocks`` are the transformer blocks).
    preset : the :class:`Preset`.
    num_features : D.
    base_weights : ``{"file": path, "sha256": hex}`` of the weights file loaded, or None.
    """

    # the input normalisation's buffers, registered in __init__ (declared for the type checker)
    _scale: torch.Tensor
    _shift: torch.Tensor

    def __init__(self, model: nn.Module, preset: Preset) -> None:
        super().__init__()
        self.model = model
        self.preset = preset
        self.base_weights: dict[str, str] | None = None
        self._renormalise = tuple(preset.mean) != tuple(IMAGENET_MEAN) or tuple(preset.std) != tuple(IMAGENET_STD)
        # x_preset = (x_imagenet * std_in + mean_in - mean) / std: one multiply-add per pixel
        scale = [si / s for si, s in zip(IMAGENET_STD, preset.std)]
        shift = [(mi - m) / s for mi, m, s in zip(IMAGENET_MEAN, preset.mean, preset.std)]
        self.register_buffer("_scale", torch.tensor(scale).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("_shift", torch.tensor(shift).view(1, 3, 1, 1), persistent=False)
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))
        width = int(getattr(model, "num_features", 0) or getattr(model, "embed_dim", 0))
        self.num_features = 2 * width if preset.embedding == "cls_mean" else width

    @property
    def blocks(self) -> nn.Sequential | None:
        """The transformer blocks, in order (None for a timm model without ``blocks``)."""
        return getattr(self.model, "blocks", None)

    def resize_plan(self, tile_size: int) -> str:
        """What happens to a ``tile_size`` px tile before the model (words, for records and messages)."""
        p = self.preset
        if p.crop_pct < 1.0:
            scale = int(math.floor(p.input_size / p.crop_pct))
            resize = "" if tile_size == scale else f"{p.interpolation} antialiased resize {tile_size} -> {scale} px, "
            return f"{resize}central {p.input_size} px crop"
        if tile_size == p.input_size:
            return "none"
        return f"{p.interpolation} antialiased resize {tile_size} -> {p.input_size} px"

    def preprocessing(self, tile_size: int) -> dict[str, Any]:
        """The preprocessing of a ``tile_size`` px tile, as recorded in feature files and checkpoints."""
        p = self.preset
        return {"input": "RGB uint8 / 255", "resize": self.resize_plan(int(tile_size)), "mean": list(p.mean),
                "std": list(p.std), "input_size": p.input_size, "embedding": p.embedding}

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        p = self.preset
        side = p.input_size
        if p.crop_pct < 1.0:
            scale = int(math.floor(side / p.crop_pct))
            if x.shape[-2:] != (scale, scale):
                x = F.interpolate(x, size=(scale, scale), mode=p.interpolation, align_corners=False, antialias=True)
            top = (scale - side) // 2
            return x[..., top : top + side, top : top + side]
        if x.shape[-2:] != (side, side):
            x = F.interpolate(x, size=(side, side), mode=p.interpolation, align_corners=False, antialias=True)
        return x

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The model's input: ImageNet-normalised tiles ``[B, 3, T, T]`` resized (when T differs) and
        normalised with the preset's mean/std, ``[B, 3, S, S]`` with S the preset's input size."""
        x = self._resize(x)
        if self._renormalise:
            x = x * self._scale.to(x.dtype) + self._shift.to(x.dtype)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, D]`` of ImageNet-normalised tiles ``[B, 3, T, T]``."""
        # nn.Module types its attributes as `Tensor | Module`; every timm model has these methods
        trunk = cast(_TimmTrunk, self.model)
        tokens = trunk.forward_features(self.prepare(x))
        if self.preset.embedding == "cls_mean":
            return torch.cat([tokens[:, 0], tokens[:, self.num_prefix_tokens :].mean(1)], dim=-1)
        return trunk.forward_head(tokens, pre_logits=True)


# ------------------------------------------------------------------------------------------------
# weights files

_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, read in 16 MiB blocks (a 4.4 GB file takes a few seconds);
    cached per process by path, size and modification time."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(16 * 2**20):
                h.update(block)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


def load_state_file(path: str | os.PathLike, *, what: str) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` (safetensors) or ``.bin``/``.pth``/``.pt`` (:func:`~wsi_pipeline.model_files.load_torch_file`: the pickle screened, then ``torch.load(weights_only=True)``).

    A dict holding the state dict under ``state_dict``, ``model`` or ``teacher`` (DINOv2 training
    checkpoints) is unwrapped; a ``module.`` prefix on every key (DataParallel) is removed.
    ``what`` names the expected content in errors (``"weights of preset uni_v1"``).

    Raises ``FileNotFoundError`` (no such file) or ``ValueError`` (unknown extension, unreadable,
    not a state dict), each naming the file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: file {p} not found")
    suffix = p.suffix.lower()
    if suffix not in WEIGHT_SUFFIXES:
        raise ValueError(f"{what}: {p} has extension {suffix or '(none)'!r}; expected one of {list(WEIGHT_SUFFIXES)}")
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(p), device="cpu")
        else:
            state = load_torch_file(p)  # the pickle screened first (UnsafeModelFileError names the file)
    except Exception as e:  # every reader error becomes one message naming the file
        if isinstance(e, (MemoryError, UnsafeModelFileError)):
            raise
        raise ValueError(f"{what}: cannot read {p} ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); "
                         "expected a state dict saved with torch.save or safetensors") from e
    if isinstance(state, Mapping):
        for wrapper in ("state_dict", "model", "teacher"):
            if wrapper in state and isinstance(state[wrapper], Mapping):
                state = state[wrapper]
                break
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{what}: {p} holds a {type(state).__name__}, expected a state dict (name -> tensor)")
    state = dict(state)
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _listed(keys: list[str], limit: int = 8) -> str:
    if not keys:
        return "none"
    more = f" ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _load_strict(encoder: FoundationEncoder, path: Path, *, assign: bool = False) -> None:
    """Load a published weights file into ``encoder.model``, strictly, or refuse naming what differs.

    ``assign``: the model was built on the meta device; its parameters become the file's tensors
    (converted to torch's default dtype) instead of being copied into.
    """
    preset = encoder.preset
    what = f"weights of encoder {preset.name!r}"
    state = load_state_file(path, what=what)
    own = encoder.model.state_dict()
    # the published layout, or timm's own (e.g. our exports); a DINOv2 network also from DINOv2's own training code
    accepted = {preset.layout, "timm"} | ({"dinov2_hub"} if preset.layout == "transformers_dinov2" else set())
    found = detect_layout(state)
    layout = found if found in accepted else preset.layout
    state = to_timm_layout(state, layout, {k: v.shape for k, v in own.items()}, what=f"{what}: {path}")
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in own
              if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise ValueError(
            f"{path} is not a checkpoint of {preset.describe()}: missing keys: {_listed(missing)}; unexpected keys: "
            f"{_listed(unexpected)}; shape mismatches: {_listed(shapes, 4)}. The preset expects the file its model card "
            f"publishes ({' or '.join(preset.weights_files)}"
            f"{' from ' + preset.source if preset.source else ''}), "
            f"{'a plain timm state dict' if preset.layout == 'timm' else 'with ' + preset.layout + ' keys (or timm keys)'}"
        )
    if assign:
        dtype = torch.get_default_dtype()
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    encoder.model.load_state_dict(state, strict=True, assign=assign)
    encoder.base_weights = {"file": str(path), "sha256": file_sha256(path)}
    log.info("loaded %d tensors of %s from %s", len(state), preset.name, path)


def build_foundation_encoder(
    name: str,
    weights: str | os.PathLike | None = None,
    *,
    preset: Preset | None = None,
    **options: Any,
) -> FoundationEncoder:
    """Build a foundation encoder by name, with weights from a local file.

    Parameters
    ----------
    name : a key of :data:`PRESETS` or ``timm:<architecture>``.
    weights : the weights file (``.bin``, ``.pth``, ``.pt``, ``.safetensors``) in the layout the
        card publishes (a plain timm state dict). None: timm's random initialisation (torch's
        global generator; seed it first).
    preset : use this preset instead of resolving ``name`` (tests of reduced models).
    **options : ``timm_kwargs``, ``mean``, ``std``, ``input_size``, ``embedding`` for ``timm:``
        names (:func:`resolve_preset`).

    Returns
    -------
    FoundationEncoder in training mode, parameters of torch's default dtype.

    Raises
    ------
    ValueError : unknown architecture, or a file that is not a strict match (missing and
        unexpected keys, shapes and the file the preset expects are named).
    FileNotFoundError : ``weights`` does not exist.
    """
    spec = preset or resolve_preset(name, **options)
    if weights is not None:
        # built without initialising (a giant ViT's random init takes longer than reading its file), then
        # the file's tensors are assigned; a model holding buffers that no file carries is built normally
        if not Path(weights).is_file():
            raise FileNotFoundError(f"weights of encoder {name!r}: file {weights} not found; the preset expects "
                                    f"{' or '.join(spec.weights_files)}{' from ' + spec.source if spec.source else ''}")
        try:
            with torch.device("meta"):
                model: nn.Module | None = _create(name, spec)
        except RuntimeError as e:  # timm < 1.0 reads tensor values while it builds (.item() on meta): build normally
            log.debug("building %s on the meta device failed (%s); initialising it instead", name, e)
            model = None
        if model is not None and not any(True for _ in model.buffers()):
            encoder = _wrap(name, model, spec)
            _load_strict(encoder, Path(weights), assign=True)
            return encoder
    encoder = _wrap(name, _create(name, spec), spec)
    if weights is not None:
        _load_strict(encoder, Path(weights))
    return encoder


def _create(name: str, spec: Preset) -> nn.Module:
    from wsi_pipeline.models.offline import check_timm_architecture, go_offline

    go_offline()
    check_timm_architecture(spec.architecture, "encoder.name")
    import timm

    try:
        return timm.create_model(spec.architecture, pretrained=False, **_timm_kwargs(spec))
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise ValueError(f"encoder {name!r}: timm has no architecture {spec.architecture!r} (timm.list_models() lists them)") from e
        raise


def _wrap(name: str, model: nn.Module, spec: Preset) -> FoundationEncoder:
    encoder = FoundationEncoder(model, spec)
    if spec.embed_dim is not None and encoder.num_features != spec.embed_dim:
        raise ValueError(f"encoder {name!r} gives {encoder.num_features}-d embeddings, its card says {spec.embed_dim}")
    return encoder


def preprocessing_record(encoder: nn.Module, tile_size: int) -> str:
    """JSON of what an encoder does to a ``tile_size`` px tile before its first layer (feature files, checkpoints)."""
    if isinstance(encoder, FoundationEncoder):
        rec = encoder.preprocessing(tile_size)
    else:  # our ResNets take the pipeline's input as it is
        rec = {"input": "RGB uint8 / 255", "resize": "none", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    return json.dumps(rec, sort_keys=True)


def replace_preset(preset: Preset, **changes: Any) -> Preset:
    """A copy of ``preset`` with ``changes`` (``timm_kwargs`` merged into the preset's)."""
    if "timm_kwargs" in changes:
        changes["timm_kwargs"] = {**preset.timm_kwargs, **changes["timm_kwargs"]}
    return dataclasses.replace(preset, **changes)

