"""Tile encoders: ResNet-18/34/50 written here, with torchvision's parameter and buffer names, and
the foundation-model presets (UNI, UNI2-h, Virchow2, H-optimus-0/1, Prov-GigaPath) and
``timm:<architecture>`` built with timm (:mod:`wsi_pipeline.models.foundation`).

The names (``conv1``, ``bn1``, ``layer1.0.conv1``, ``layer2.0.downsample.0``, ...) match
torchvision's ``ResNet`` so a torchvision checkpoint file loads with ``weights=path``; the
classifier (``fc.*``) is not part of the encoder and its keys are ignored when loading.
Every encoder maps ``[B, 3, H, W]`` to ``[B, num_features]`` (global average of the last stage).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from wsi_pipeline.model_files import UnsafeModelFileError, load_torch_file
from wsi_pipeline.models.registry import Registry

__all__ = [
    "ENCODERS",
    "EncoderNames",
    "encoder_choices",
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "build_encoder",
    "is_resnet",
    "load_torchvision_weights",
]

log = logging.getLogger(__name__)

ENCODERS: Registry[Callable[..., nn.Module]] = Registry("encoder")


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34).

    Children: ``conv1, bn1, relu, conv2, bn2`` and ``downsample`` (``None`` or
    ``Sequential(conv1x1, BatchNorm2d)``) when the shape changes.
    """

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = _conv3x3(c_in, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(_conv1x1(c_in, c_out, stride), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, as torchvision's "ResNet v1.5") -> 1x1 with a residual (ResNet-50).

    Children: ``conv1, bn1, conv2, bn2, conv3, bn3, relu`` and ``downsample``.
    """

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = _conv1x1(c_in, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, c_out)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(_conv1x1(c_in, c_out, stride), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A ResNet trunk without classifier: ``[B, 3, H, W]`` -> ``[B, num_features]``.

    Parameters
    ----------
    block
        ``BasicBlock`` or ``Bottleneck``.
    layers
        Number of blocks in each of the four stages, e.g. ``(2, 2, 2, 2)`` for ResNet-18.
    zero_init_residual
        Start the last BatchNorm of every block at zero weight (each block starts as identity).

    Attributes
    ----------
    num_features : int
        Channels of the last stage (512 for BasicBlock, 2048 for Bottleneck): the output width.
    """

    # the stages, added by name in __init__ (declared for the type checker)
    layer1: nn.Sequential
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        *,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        c_in = 64
        for i, (width, n_blocks) in enumerate(zip((64, 128, 256, 512), layers), start=1):
            stride = 1 if i == 1 else 2
            blocks = [block(c_in, width, stride)]
            c_in = width * block.expansion
            blocks += [block(c_in, width) for _ in range(n_blocks - 1)]
            self.add_module(f"layer{i}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.num_features = c_in
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                last_bn = m.bn3 if isinstance(m, Bottleneck) else m.bn2 if isinstance(m, BasicBlock) else None
                if last_bn is not None:
                    nn.init.zeros_(last_bn.weight)

    def stages(self) -> list[nn.Sequential]:
        """The four residual stages ``[layer1, layer2, layer3, layer4]``."""
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Last-stage feature map ``[B, num_features, H/32, W/32]`` (sizes rounded up)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in self.stages():
            x = stage(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features ``[B, num_features]`` of images ``[B, 3, H, W]``."""
        return torch.flatten(self.avgpool(self.forward_features(x)), 1)


@ENCODERS.register("resnet18")
def resnet18(**kw) -> ResNet:
    """ResNet-18 trunk, 512 features."""
    return ResNet(BasicBlock, (2, 2, 2, 2), **kw)


@ENCODERS.register("resnet34")
def resnet34(**kw) -> ResNet:
    """ResNet-34 trunk, 512 features."""
    return ResNet(BasicBlock, (3, 4, 6, 3), **kw)


@ENCODERS.register("resnet50")
def resnet50(**kw) -> ResNet:
    """ResNet-50 trunk, 2048 features."""
    return ResNet(Bottleneck, (3, 4, 6, 3), **kw)


_CLASSIFIER_PREFIXES = ("fc.",)


def load_torchvision_weights(model: nn.Module, path: str | Path) -> None:
    """Load a torchvision ResNet checkpoint file into ``model`` (in place).

    Parameters
    ----------
    model
        An encoder from :func:`build_encoder`.
    path
        A file written by ``torch.save(state_dict)`` (torchvision's published files are such
        files); a dict holding the state dict under ``"state_dict"`` or ``"model"`` also works.

    Raises
    ------
    FileNotFoundError
        When ``path`` does not exist.
    ValueError
        When keys (other than the classifier's ``fc.*``) are missing or unexpected, or shapes
        differ; the message names them. A missing ``num_batches_tracked`` (checkpoints saved by
        PyTorch < 0.4.1) is accepted, as ``nn.BatchNorm2d`` accepts it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"encoder weights {path} not found; pass the path of a torchvision ResNet .pth file")
    try:
        state = load_torch_file(path)  # the pickle screened first
    except UnsafeModelFileError:
        raise  # already one line naming the file and what it holds
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:  # pickled objects, truncated files
        text = str(e).strip().splitlines()
        raise ValueError(f"encoder weights {path}: cannot read it ({type(e).__name__}: {text[0][:300] if text else ''}); "
                         "expected a state dict saved with torch.save (weights only: pickled Python objects are refused)") from e
    if isinstance(state, Mapping):
        for wrapper in ("state_dict", "model"):
            if wrapper in state and isinstance(state[wrapper], Mapping):
                state = state[wrapper]
                break
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, expected a state dict (name -> tensor)")
    # DataParallel / DistributedDataParallel checkpoints prefix every key with "module."
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith(_CLASSIFIER_PREFIXES)}

    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    wrong_shape = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong_shape:
        arch = type(model).__name__
        raise ValueError(
            f"{path} does not match this {arch} encoder: missing keys {missing}, unexpected keys "
            f"{unexpected}, shape mismatches {wrong_shape}; check that the file is a torchvision "
            f"checkpoint of the same architecture (e.g. resnet18 vs resnet50)"
        )
    model.load_state_dict(state, strict=False)
    log.info("loaded %d tensors from %s", len(state), path)


def _preset_factory(preset: str) -> Callable[..., nn.Module]:
    def factory(weights: str | Path | None = None, **kw) -> nn.Module:
        from wsi_pipeline.models.foundation import build_foundation_encoder  # imports timm: only when built

        return build_foundation_encoder(preset, weights, **kw)

    factory.__doc__ = f"The {preset} foundation-model encoder (:mod:`wsi_pipeline.models.foundation`)."
    return factory


def _register_presets() -> None:
    from wsi_pipeline.models.foundation import PRESETS

    for preset in PRESETS:
        ENCODERS.register(preset)(_preset_factory(preset))


_register_presets()


@ENCODERS.register("ilse_cnn")
def ilse_cnn(weights: str | Path | None = None, **kw) -> nn.Module:
    """The two-convolution instance network of Ilse et al. 2018 for 27-32 px patches, 512 features
    (:mod:`wsi_pipeline.models.small_cnn`); ``weights``: a file of its own state dict."""
    from wsi_pipeline.models.small_cnn import IlseCNN, load_state_file

    model = IlseCNN(**kw)
    if weights is not None:
        load_state_file(model, weights)
    return model


#: ``encoder.name`` of precomputed features (``data.features``): no encoder runs, D comes from the files.
PRECOMPUTED = "precomputed"


class PrecomputedEncoder(nn.Module):
    """The encoder of precomputed features (``encoder: {name: precomputed}``): no parameters, ``num_features`` D
    taken from the feature files; features [B, D] pass through unchanged, images are refused."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if int(dim) < 1:
            raise ValueError(f"precomputed encoder: feature width {dim}; expected >= 1 (D of the feature files)")
        self.num_features = int(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.num_features:
            raise ValueError(f"encoder 'precomputed' embeds nothing: it takes features [B, {self.num_features}], got a "
                             f"tensor of shape {list(x.shape)} (tiles need a real encoder)")
        return x


@ENCODERS.register(PRECOMPUTED)
def precomputed(weights: str | Path | None = None, dim: int | None = None, **kw) -> nn.Module:
    """Precomputed features (``data.features``): :class:`PrecomputedEncoder` of width ``dim`` (filled in from the
    feature files when training starts, :func:`wsi_pipeline.training.precomputed.resolve_precomputed`)."""
    if weights is not None:
        raise ValueError(f"encoder 'precomputed' takes no weights (got {weights}); the features are computed already")
    if dim is None:
        raise ValueError("encoder 'precomputed' needs its feature width D (encoder.dim), read from the feature files "
                         "(data.features) when training starts")
    return PrecomputedEncoder(int(dim))


def is_resnet(name: str) -> bool:
    """True for the ResNet encoders (``resnet18``, ``resnet34``, ``resnet50``): the CNNs Big-Layers converts."""
    return name in _RESNETS


class EncoderNames:
    """The encoder names ``--encoder`` and ``encoder.name`` accept: the registry's, and ``timm:<architecture>``.

    Iterating lists them for ``--help`` (``timm:<architecture>`` stands for the pattern);
    ``in`` accepts any ``timm:`` name (timm checks the architecture when the model is built).
    """

    def __iter__(self):
        return iter([*ENCODERS.names(), "timm:<architecture>"])

    def __len__(self) -> int:
        return len(ENCODERS.names()) + 1

    def __getitem__(self, i: int) -> str:
        return list(self)[i]

    def __contains__(self, name: object) -> bool:
        from wsi_pipeline.models.foundation import is_foundation_name

        return isinstance(name, str) and (name in ENCODERS or is_foundation_name(name))

    def names(self) -> list[str]:
        return list(self)


#: What :class:`wsi_pipeline.cli._common.LazyChoices` reads for ``--encoder``.
encoder_choices = EncoderNames()


def build_encoder(name: str, weights: str | Path | None = None, **kw) -> nn.Module:
    """Build an encoder by name.

    Parameters
    ----------
    name
        One of ``ENCODERS.names()`` (``resnet18``, ``resnet34``, ``resnet50``, ``ilse_cnn`` (a small
        network for 27-32 px patches, :mod:`wsi_pipeline.models.small_cnn`), and the foundation
        presets ``uni_v1``, ``uni_v2``, ``virchow2``, ``hoptimus0``, ``hoptimus1``, ``gigapath``)
        or ``timm:<architecture>``.
    weights
        Optional weights file: a torchvision checkpoint for the ResNets (classifier keys
        ignored), or ``"imagenet"`` for torchvision's ImageNet checkpoint from its cache
        (:mod:`wsi_pipeline.models.imagenet`); for a foundation encoder the file its model card publishes (``.bin``, ``.pth``,
        ``.safetensors``), loaded strictly (:func:`wsi_pipeline.models.foundation.build_foundation_encoder`).
    **kw
        Passed to the architecture (e.g. ``zero_init_residual=True``; for ``timm:`` names
        ``timm_kwargs``, ``mean``, ``std``, ``input_size``, ``embedding``).

    Returns
    -------
    nn.Module
        Maps images ``[B, 3, H, W]`` (float, ImageNet-normalised: ``tiles_to_tensor``) to
        features ``[B, D]``; ``.num_features`` is D (512 for resnet18/34, 2048 for resnet50, the
        preset's embedding width for a foundation encoder).
    """
    from wsi_pipeline.models.foundation import TIMM_PREFIX, build_foundation_encoder
    from wsi_pipeline.models.imagenet import resolve_weights

    weights = resolve_weights(name, weights)
    if name.startswith(TIMM_PREFIX):
        return build_foundation_encoder(name, weights, **kw)
    factory = ENCODERS.get(name)
    if name not in _RESNETS:
        return factory(weights, **kw)
    model = factory(**kw)
    if weights is not None:
        load_torchvision_weights(model, weights)
    return model


_RESNETS = ("resnet18", "resnet34", "resnet50")
