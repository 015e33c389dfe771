"""The ``train`` section: epochs, optimiser, schedule, DEMON, augmentation, device (a method's
``train`` mapping overrides any of it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import Calibration, Schedule, SelectMetric, TrainLog
from wsi_pipeline.config.limits import MAX_BAG_TILES, MAX_BATCH_BAGS, MAX_EPOCHS
from wsi_pipeline.config.schema import Checked, build, coerce, spec
from wsi_pipeline.devices import check_device
from wsi_pipeline.config.io import short_repr
from wsi_pipeline.failures import ConfigTypeError

__all__ = ["ALL_TILES", "AugmentConfig", "DemonConfig", "TrainConfig"]


@dataclass(frozen=True)
class DemonConfig(Checked):
    """DEMON momentum decay (see :class:`wsi_pipeline.training.optim.DemonAdam`).

    In YAML, ``demon: false`` / ``demon: true`` / ``demon: {beta_init: 0.9}``.
    """

    enabled: bool = False
    beta_init: float = field(default=0.9, metadata=spec(ge=0.0, lt=1.0))


def _parse_demon(value: Any, where: str) -> DemonConfig:
    if isinstance(value, bool):
        return DemonConfig(enabled=value)
    if isinstance(value, Mapping):
        raw = dict(value)
        raw.setdefault("enabled", True)
        return build(DemonConfig, raw, where)
    raise ConfigTypeError(f"{where} must be true, false or a mapping like {{beta_init: 0.9}}; got {short_repr(value)}")


#: ``train.bag_size: all``: every tile of a slide in its bag (the count is larger than any slide's).
ALL_TILES = 2**31 - 1


def _parse_bag_size(value: Any, where: str) -> int:
    """``all`` (every tile of the slide: :data:`ALL_TILES`) or a whole number of tiles (checked as any int field)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return ALL_TILES
    try:
        n = int(coerce(value, int, where))
    except ConfigTypeError as e:
        raise ConfigTypeError(f"{e} (or 'all': every tile of a slide)") from e
    if n > MAX_BAG_TILES and n != ALL_TILES:  # 'all' is stored (config.yaml, checkpoints) as ALL_TILES, beyond the bound
        raise ValueError(f"{where}={short_repr(value)}; expected a value <= {MAX_BAG_TILES} (allowed: > 0 and <= "
                         f"{MAX_BAG_TILES}, or 'all': every tile of a slide)")
    return n


@dataclass(frozen=True)
class AugmentConfig(Checked):
    """Per-slide augmentation: one random draw of parameters per bag, applied to all its tiles.

    Attributes
    ----------
    enabled : off by default.
    blur_p, blur_sigma, blur_kernel : probability, sigma range (px) and kernel side (px, odd) of a Gaussian blur.
    jitter_p, brightness, contrast, saturation, hue : colour-jitter probability and strengths
        (kornia ``ColorJitter`` conventions; hue in [0, 0.5]).
    flips : random horizontal and vertical flips (p = 0.5 each).
    rotation : random rotation by a multiple of 90 degrees (lossless on square tiles).
    hed_p, hed_scale, hed_shift : HED jitter (Tellez et al.) with probability ``hed_p`` per bag:
        each of the haematoxylin, eosin and DAB channels (optical density, natural log; see
        :func:`wsi_pipeline.data.stain.hed_jitter`) becomes ``U(1 - hed_scale, 1 + hed_scale) * s +
        U(-hed_shift, hed_shift)``, one draw per bag. Off by default (``hed_p: 0``); 0.05 / 0.05 is a
        mild jitter (a few grey levels), 0.2 / 0.1 a strong one.
    stain_mix_p, stain_mix : stain mixing with probability ``stain_mix_p`` per bag: the bag's
        stain matrix and intensities move a fraction ``U(0, stain_mix)`` of the way towards those
        of a training slide drawn at random (:func:`wsi_pipeline.data.stain.mix_stains`). Off by default.
    """

    enabled: bool = False
    blur_p: float = field(default=0.5, metadata=spec(ge=0.0, le=1.0))
    blur_sigma: tuple[float, float] = (0.1, 1.5)
    blur_kernel: int = field(default=5, metadata=spec(ge=1))
    jitter_p: float = field(default=0.8, metadata=spec(ge=0.0, le=1.0))
    brightness: float = 0.1
    contrast: float = 0.1
    saturation: float = 0.1
    hue: float = 0.02
    flips: bool = True
    rotation: bool = True
    hed_p: float = field(default=0.0, metadata=spec(ge=0.0, le=1.0))
    hed_scale: float = field(default=0.05, metadata=spec(ge=0.0, lt=1.0))
    hed_shift: float = field(default=0.05, metadata=spec(ge=0.0, lt=1.0))
    stain_mix_p: float = field(default=0.0, metadata=spec(ge=0.0, le=1.0))
    stain_mix: float = field(default=0.5, metadata=spec(ge=0.0, le=1.0))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.blur_kernel % 2 == 0:
            raise ValueError(f"train.augment.blur_kernel={self.blur_kernel}; expected an odd number of px >= 1")
        if not 0 < self.blur_sigma[0] <= self.blur_sigma[1]:
            raise ValueError(f"train.augment.blur_sigma={list(self.blur_sigma)}; expected [low, high] with 0 < low <= high")


@dataclass(frozen=True)
class TrainConfig(Checked):
    """Training hyper-parameters (the ``train`` section; a method's ``train`` overrides any of them).

    Attributes
    ----------
    epochs : passes over the training slides.
    lr, weight_decay : Adam learning rate and L2 weight decay.
    bag_size : k, tiles sampled at random per slide per epoch (all tiles when a slide has fewer);
        ``all``: every tile of every slide, whole slides as bags (the attention-MIL paper's training).
    batch_bags, accumulate_batches : B bags per batch, S batches per optimiser step; the
        optimiser steps on the mean loss of B x S bags (bags are processed one at a time).
    schedule : ``cosine`` (annealed to ``min_lr`` over the run), ``exponential`` (lr x gamma per
        epoch), ``linear`` (linear decay to ``min_lr`` over the run, the PatchGD paper's) or
        ``none``; ``warmup_epochs`` of linear warm-up come first.
    warmup_steps : the first N optimiser steps of the run take the scheduled rate times
        ``(k + 1) / (N + 1)`` at step k (0-based), a linear ramp within the first epoch(s); 0: off.
        Adam moves every parameter by about the full rate on its first steps whatever the gradient's
        size, which on a freshly initialised network can saturate the output in one step.
    demon : DEMON momentum decay on Adam's first moment.
    clip_grad_norm : clip the global gradient norm before each step (None: off).
    select_metric : validation metric for ``best.pt`` and early stopping; ``auto`` is AUC for
        binary and QWK for multi-class tasks.
    early_stopping_patience : stop after this many epochs without improvement (None: off).
    calibrate : after training, fit a probability calibration of ``best.pt`` on the validation
        slides (all their tiles) and store it in the checkpoint, where ``eval`` and ``predict`` apply
        it (:mod:`wsi_pipeline.tasks.calibration`): ``platt`` (binary: the log-odds ``a s + b``, which
        also moves the decision threshold to the one the validation split supports), ``temperature``
        (any number of classes) or ``none`` (default). Classification only; other tasks ignore it.
    device : ``auto`` (CUDA, then Apple MPS, then CPU), ``cpu``, ``cuda``, ``cuda:<i>`` or ``mps``
        (:data:`wsi_pipeline.devices.DEVICES`, as every command's ``--device``).
    bf16 : bfloat16 autocast for each training step's forward and loss, on CUDA and on CPUs with
        bfloat16 instructions (:func:`wsi_pipeline.devices.cpu_has_bf16`; float32 elsewhere).
        Weights, gradients and optimiser state stay float32; the backward runs outside autocast;
        validation runs under it, the calibration and ``eval`` in float32.
    augment : per-slide augmentation.
    log : where per-step records go besides the run folder's ``steps.csv`` (loss, learning rate,
        gradient norm, tiles/s, share of the step spent waiting for data, peak memory):
        ``none`` (default) or ``tensorboard`` (event files in ``<run>/tensorboard``; needs the
        ``tensorboard`` package: ``pip install 'wsi-pipeline[tensorboard]'``).
    """

    epochs: int = field(default=20, metadata=spec(gt=0, le=MAX_EPOCHS))
    lr: float = field(default=1e-4, metadata=spec(gt=0))
    weight_decay: float = field(default=1e-4, metadata=spec(ge=0))
    bag_size: int = field(default=256, metadata=spec(gt=0, le=ALL_TILES, parse=_parse_bag_size))
    batch_bags: int = field(default=2, metadata=spec(gt=0, le=MAX_BATCH_BAGS))
    accumulate_batches: int = field(default=1, metadata=spec(gt=0, le=MAX_BATCH_BAGS))
    schedule: Schedule = "cosine"
    gamma: float = field(default=0.955, metadata=spec(gt=0, le=1))
    min_lr: float = field(default=0.0, metadata=spec(ge=0))
    warmup_epochs: int = field(default=0, metadata=spec(ge=0, le=MAX_EPOCHS))
    warmup_steps: int = field(default=0, metadata=spec(ge=0))
    demon: DemonConfig = field(default_factory=DemonConfig, metadata=spec(parse=_parse_demon))
    clip_grad_norm: float | None = field(default=None, metadata=spec(gt=0))
    select_metric: SelectMetric = "auto"
    early_stopping_patience: int | None = field(default=None, metadata=spec(gt=0, le=MAX_EPOCHS))
    calibrate: Calibration = "none"
    device: str = field(default="auto", metadata=spec(check=check_device))
    bf16: bool = False
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    log: TrainLog = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"train.warmup_epochs={self.warmup_epochs} must be smaller than train.epochs={self.epochs}")

    @property
    def bags_per_step(self) -> int:
        """Bags whose mean loss one optimiser step follows (B x S)."""
        return self.batch_bags * self.accumulate_batches
