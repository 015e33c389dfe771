"""The model sections of a method: ``encoder`` (with the BatchNorm mode, and for
foundation-model encoders their timm options and partial fine-tuning), ``aggregator`` (or
PatchGD head) and ``bigl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from wsi_pipeline.config.choices import BNMode, encoder_names, model_names
from wsi_pipeline.config.limits import MAX_COUNT, MAX_EPOCHS
from wsi_pipeline.config.schema import Checked, positive, spec

__all__ = ["AggregatorConfig", "BiglConfig", "EncoderConfig", "LoRAConfig", "check_encoder_name", "is_foundation_encoder"]

#: ``encoder.name`` of precomputed features (``data.features``; ``wsi_pipeline.models.encoders.PRECOMPUTED``).
PRECOMPUTED = "precomputed"
#: ``encoder.name`` prefix of any timm architecture (``wsi_pipeline.models.foundation.TIMM_PREFIX``).
TIMM_PREFIX = "timm:"


def is_foundation_encoder(name: str) -> bool:
    """True when ``encoder.name`` is a foundation-model encoder (a preset or ``timm:<architecture>``), built with timm."""
    from wsi_pipeline.models.foundation import is_foundation_name  # no torch/timm import: presets are plain data

    return is_foundation_name(name)


def check_encoder_name(name: Any, where: str) -> str:
    """``name`` when it is a registered encoder or ``timm:<architecture>`` (``encoder.name``, ``features.encoder``);
    ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(name, str) or (name not in encoder_names() and not name.startswith(TIMM_PREFIX)):
        raise ValueError(f"{where}={name!r}; expected one of {encoder_names()} or 'timm:<architecture>'")
    if name == TIMM_PREFIX:
        raise ValueError(f"{where}={name!r}: name the timm architecture after 'timm:', e.g. timm:vit_small_patch16_224")
    if name.startswith(TIMM_PREFIX):
        from wsi_pipeline.models.offline import check_timm_architecture

        check_timm_architecture(name[len(TIMM_PREFIX):], where)
    return name


@dataclass(frozen=True)
class LoRAConfig(Checked):
    """Low-rank adapters on a ViT's attention projections (``encoder.lora``).

    Each targeted linear layer ``y = W x + b`` becomes ``y = W x + b + (alpha / rank) B A x`` with
    ``A`` [rank, in] and ``B`` [out, rank] trained and ``W``, ``b`` frozen; ``B`` starts at zero, so
    training starts from the pretrained model (:mod:`wsi_pipeline.models.lora`).

    ``targets``: the attention's ``qkv`` and output ``proj`` (names of ``timm`` attention layers).
    """

    rank: int = field(default=8, metadata=spec(gt=0))
    alpha: float = field(default=16.0, metadata=spec(gt=0))
    targets: tuple[Literal["qkv", "proj"], ...] = ("qkv", "proj")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.targets:
            raise ValueError("encoder.lora.targets is empty; name at least one of 'qkv', 'proj'")


@dataclass(frozen=True)
class EncoderConfig(Checked):
    """Tile encoder: a name from ``wsi_pipeline.models.ENCODERS``, optional weights file, BatchNorm mode.

    ``bn``: ``frozen`` (running statistics, exact for every strategy), ``chunk`` (batch
    statistics per chunk, ``accumulate`` only; the ABMIL-ACC paper's setting, "the paper's, not exact": each
    chunk is normalised by its own statistics, not the bag's) or ``train`` (batch statistics of
    the whole bag; ``full`` and ``bigl``; ``patchgd``: train mode throughout, the PatchGD paper's).

    ``calibrate_bn``: before training, re-estimate the BatchNorm running statistics on this many
    randomly drawn training tiles (0: off). Meant for an encoder without pretrained weights
    (whose initial statistics describe nothing) used with ``bn: frozen``; a frozen method's
    feature files are extracted with the calibrated encoder.

    ``recalibrate_bn``: calibrate again at the start of every epoch, so that frozen statistics
    follow the weights as they train (an encoder trained from scratch otherwise drifts away from
    the statistics it started with, and training can diverge). Exact gradients within each epoch
    are kept: the statistics are constant while the epoch's steps are taken.

    Foundation-model encoders (``uni_v1``, ``uni_v2``, ``virchow2``, ``hoptimus0``, ``hoptimus1``,
    ``gigapath``, ``timm:<architecture>``; :mod:`wsi_pipeline.models.foundation`): ``weights`` is the
    file the model card publishes. ``timm:`` names also take ``timm_kwargs`` (for
    ``timm.create_model``), ``mean``/``std`` (default ImageNet's), ``input_size`` (px; default
    ``timm_kwargs.img_size`` or 224) and ``embedding`` (``pooled``: the model's pooled output;
    ``cls_mean``: class token ++ mean of the patch tokens). When the encoder trains:
    ``freeze_blocks`` freezes the patch embedding, position embedding, class/register tokens and
    the first N transformer blocks; ``layer_decay`` multiplies the learning rate of block i
    (0-based) of L by ``layer_decay ** (L - 1 - i)`` and of the embeddings by ``layer_decay ** L``
    (timm's layer grouping: the last block and the final norm keep the full rate, as does the
    aggregator); ``lora`` trains low-rank adapters on the attention projections with the
    base weights frozen (:class:`LoRAConfig`); ``checkpointing`` recomputes each block's
    activations in the backward pass (peak memory set by the chunk, not by the depth; None: on
    for foundation encoders whose weights train).

    ``dropout``: ``ilse_cnn`` only, the dropout rate after each of its fully connected layers
    (None: the network's default, 0.5; the paper's network has dropout there but states no rate).
    ``init``: ``ilse_cnn`` only, its weight initialisation (None: ``pytorch``, each layer's default;
    ``he``: variance-preserving through the ReLU layers, :class:`wsi_pipeline.models.small_cnn.IlseCNN`).

    ``lr_scale``: the encoder's share of the learning rate (each epoch's rate times this; the
    aggregator and classifier keep the full rate; with ``layer_decay`` the two multiply).
    ``frozen_epochs``: the first N epochs train the aggregator and classifier only (the encoder's
    rate is 0), so the encoder is first trained through a head that has learned something rather
    than a random one (linear probing, then fine-tuning: Kumar et al., ICLR 2022). Both apply to a
    method whose encoder trains (not ``strategy: frozen``). On a weak contrast, a small encoder
    trained end to end at the aggregator's rate from the first step can shrink to a constant and
    lose to its own random initialisation (docs/real-data.md).

    ``precomputed``: no encoder; the features come from files (``data.features``, ``strategy: frozen``).
    ``dim`` is their width D, read from the files when training starts (leave it out).

    ``chunk`` and ``train`` normalise with the statistics of the bag (or chunk) being trained on,
    while validation, evaluation and prediction normalise with running statistics: the model can
    learn to read the label from the bag's own statistics and then fails at evaluation. Training
    with them emits a :class:`BagStatisticsWarning` (see :func:`bag_statistics_warning`).
    """

    name: str = field(default="resnet18", metadata=spec(check=check_encoder_name))
    weights: str | None = None
    bn: BNMode = "frozen"
    calibrate_bn: int = field(default=0, metadata=spec(ge=0, le=MAX_COUNT))
    recalibrate_bn: bool = False
    timm_kwargs: dict[str, Any] = field(default_factory=dict)
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    input_size: int | None = field(default=None, metadata=spec(gt=0))
    embedding: Literal["pooled", "cls_mean"] | None = None
    freeze_blocks: int = field(default=0, metadata=spec(ge=0))
    layer_decay: float | None = field(default=None, metadata=spec(gt=0, le=1))
    lora: LoRAConfig | None = None
    checkpointing: bool | None = None
    dropout: float | None = field(default=None, metadata=spec(ge=0, lt=1))
    init: Literal["pytorch", "he"] | None = None
    lr_scale: float = field(default=1.0, metadata=spec(gt=0, le=1))
    frozen_epochs: int = field(default=0, metadata=spec(ge=0, le=MAX_EPOCHS))
    dim: int | None = field(default=None, metadata=spec(gt=0))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name == PRECOMPUTED and self.weights is not None:
            raise ValueError(f"encoder.weights={self.weights!r} with encoder 'precomputed': the features are computed "
                             "already (data.features); leave weights out")
        if self.dim is not None and self.name != PRECOMPUTED:
            raise ValueError(f"encoder.dim is set for encoder {self.name!r}; it is the feature width of 'precomputed' only")
        if self.recalibrate_bn and self.calibrate_bn <= 0:
            raise ValueError("encoder.recalibrate_bn needs encoder.calibrate_bn > 0 (the number of tiles to calibrate on)")
        timm_only = {k: getattr(self, k) for k in ("mean", "std", "input_size", "embedding") if getattr(self, k) is not None}
        if self.timm_kwargs:
            timm_only["timm_kwargs"] = self.timm_kwargs
        if timm_only and not self.name.startswith(TIMM_PREFIX):
            raise ValueError(
                f"encoder.{sorted(timm_only)[0]} is set for encoder {self.name!r}; {sorted(timm_only)} apply to "
                "'timm:<architecture>' encoders only (a preset is defined by its model card)"
            )
        vit_only = {k: v for k, v in (("freeze_blocks", self.freeze_blocks), ("layer_decay", self.layer_decay),
                                      ("lora", self.lora), ("checkpointing", self.checkpointing)) if v}
        if vit_only and not is_foundation_encoder(self.name):
            raise ValueError(
                f"encoder.{sorted(vit_only)[0]} is set for encoder {self.name!r}; partial fine-tuning and activation "
                "checkpointing apply to foundation-model (timm) encoders only"
            )
        if self.dropout is not None and self.name != "ilse_cnn":
            raise ValueError(f"encoder.dropout is set for encoder {self.name!r}; it is the rate of 'ilse_cnn' only")
        if self.init is not None and self.name != "ilse_cnn":
            raise ValueError(f"encoder.init is set for encoder {self.name!r}; it is the initialisation of 'ilse_cnn' only")
        if self.std is not None and not all(x > 0 for x in self.std):
            raise ValueError(f"encoder.std={list(self.std)}; expected three values > 0")

    @property
    def foundation(self) -> bool:
        """True for a foundation-model (timm) encoder."""
        return is_foundation_encoder(self.name)

    def build_options(self) -> dict[str, Any]:
        """Keyword options of :func:`wsi_pipeline.models.build_encoder` for this section (``timm:`` names)."""
        opts = {"timm_kwargs": dict(self.timm_kwargs) or None, "mean": self.mean, "std": self.std,
                "input_size": self.input_size, "embedding": self.embedding, "dim": self.dim, "dropout": self.dropout,
                "init": self.init}
        return {k: v for k, v in opts.items() if v is not None}


@dataclass(frozen=True)
class AggregatorConfig(Checked):
    """MIL aggregator (or PatchGD head): a registered name and its keyword options."""

    name: str = field(default="abmil", metadata=spec(choices=model_names))
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BiglConfig(Checked):
    """Big-Layers: residual stages run as Big-Layers after the stem, and the device chunk size in elements.

    ``device_budget_gb``: device memory a training step may use, in GB (10^9 bytes). The step is
    plain when it fits; otherwise the early units (stem, residual blocks) that do not fit run as
    fused runs, recomputed chunk by chunk, their checkpoints on the device when they fit and in
    host memory when not (:mod:`wsi_pipeline.bigl.budget` states the rule; the plan is logged and
    written to the run folder as ``bigl_plan.txt``). ``auto`` (default): the CUDA device's free
    memory minus a margin (10 % of its memory, at least 1 GiB); on the CPU, where host and device
    memory are one, ``auto`` keeps the fixed plan. ``null``: the fixed plan, the paper's: the stem
    and ``stages`` residual stages offloaded layer by layer. ``max_elements`` caps one chunk step
    in both.

    ``embed_budget_mib``: validation and evaluation embed with the plain encoder on the device when
    one call's estimated activations fit this many MiB, through Big-Layers otherwise
    (:class:`wsi_pipeline.bigl.EmbeddingEncoder`); None: half the CUDA device's memory, no limit
    on the CPU.
    """

    stages: int = field(default=1, metadata=spec(ge=0))
    max_elements: int = field(default=2**27, metadata=spec(gt=0))
    embed_budget_mib: float | None = field(default=None, metadata=spec(ge=0))
    device_budget_gb: float | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.device_budget_gb, (int, float)) and not isinstance(self.device_budget_gb, bool):
            positive("bigl.device_budget_gb", self.device_budget_gb)
