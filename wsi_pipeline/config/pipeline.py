"""Pipeline configs: YAML files in ``pipelines/`` validated into frozen dataclasses.

A pipeline config names the data, the training hyper-parameters shared by every method, the
evaluation protocols, the seeds, and a list of methods (strategy + encoder + aggregator)::

    name: demo                       # runs/<name>/, results/<name>/ (default: the file's stem)
    data:
      manifest: data_manifests/demo.csv
      tiles_dir: tiles/demo
      features_dir: features/demo    # frozen-encoder h5 files (extracted when missing)
      n_classes: 2
      tiling: {tile_size: 256, min_foreground: 0.6, mpp_target: 0.5}
    train: {epochs: 20, lr: 1.0e-4, bag_size: 256, batch_bags: 2, schedule: cosine}
    eval:
      val_protocol: all
      protocols: [all, {subsample: {k: 256, repeats: 100}}]
    seeds: [0, 1, 2]
    methods:
      - {name: abmil_frozen, strategy: frozen, aggregator: {name: abmil}}
      - name: abmil_e2e
        strategy: accumulate
        encoder: {name: resnet18, bn: frozen}
        chunk_size: 64
        train: {lr: 5.0e-5}         # per-method overrides of the `train` section

Relative paths (manifest, tiles, features, runs, results, encoder weights) are relative to the
current working directory, which is the repository root under ``make train``; they are kept as
written in the saved config so a run folder can be moved together with its data.

:func:`load_config` rejects an unknown key naming it, its section and the valid keys, and a
value of the wrong type naming the field and the expected type. ``overrides`` such as
``train.lr=5e-5`` or ``methods.abmil_e2e.chunk_size=32`` (a list entry by index or by
``name``) are applied to the raw YAML before validation; values are parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from wsi_pipeline.devices import check_device
from wsi_pipeline.config.patchgd_presets import apply_patchgd_preset

__all__ = [
    "AggregatorConfig",
    "AugmentConfig",
    "BagStatisticsWarning",
    "BiglConfig",
    "DataConfig",
    "DemonConfig",
    "EncoderConfig",
    "EvalConfig",
    "MethodConfig",
    "PipelineConfig",
    "Protocol",
    "TilingConfig",
    "TrainConfig",
    "bag_statistics_warning",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "method_by_name",
    "save_config",
]

SCHEDULES = ("cosine", "exponential", "linear", "none")
BN_MODES = ("frozen", "chunk", "train")
SELECT_METRICS = ("auto", "auc", "qwk", "accuracy", "balanced_accuracy", "loss")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Custom:
    """Field metadata: ``parse(value, where)`` for a field whose YAML form is not its dataclass form."""

    def __init__(self, parse: typing.Callable[[Any, str], Any], type_name: str) -> None:
        self.parse = parse
        self.type_name = type_name


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TilingConfig:
    """What the pipeline expects of its tile stores; every field is optional.

    The stores record the settings that made them; training checks that all its stores agree,
    and with each field given here, and saves the stores' settings in the checkpoint, so
    ``predict`` tiles new slides exactly as the training data was tiled. A field left empty
    (None) is taken from the stores.

    Attributes
    ----------
    method : tissue-detection method of the tiler.
    tile_size : tile side in px at the read resolution.
    min_foreground : keep a tile at >= this foreground fraction (0..1).
    mpp_target : read resolution in um/px.
    """

    method: str | None = None
    tile_size: int | None = None
    min_foreground: float | None = None
    mpp_target: float | None = None

    def __post_init__(self) -> None:
        if self.tile_size is not None:
            _positive("data.tiling.tile_size", self.tile_size)
        if self.min_foreground is not None and not 0.0 <= self.min_foreground <= 1.0:
            raise ValueError(f"data.tiling.min_foreground={self.min_foreground}; expected a fraction in [0, 1]")
        if self.mpp_target is not None:
            _positive("data.tiling.mpp_target", self.mpp_target)


@dataclass(frozen=True)
class DataConfig:
    """Where the cohort lives.

    Attributes
    ----------
    manifest : manifest CSV (train/val splits are read from its ``split`` column).
    tiles_dir : folder of ``<slide_id>.zarr`` tile stores.
    n_classes : number of classes C; labels must lie in ``[0, C)``.
    features_dir : root of frozen-encoder feature files; a frozen method reads
        ``<features_dir>/<encoder name>`` unless the method sets its own ``features_dir``.
    tiling : tiling parameters (saved for ``predict``).
    """

    manifest: str
    tiles_dir: str
    n_classes: int
    features_dir: str = "features"
    tiling: TilingConfig = field(default_factory=TilingConfig)

    def __post_init__(self) -> None:
        if self.n_classes < 2:
            raise ValueError(f"data.n_classes={self.n_classes}; expected >= 2 (binary tasks use 2)")


@dataclass(frozen=True)
class DemonConfig:
    """DEMON momentum decay (see :class:`wsi_pipeline.training.optim.DemonAdam`).

    In YAML, ``demon: false`` / ``demon: true`` / ``demon: {beta_init: 0.9}``.
    """

    enabled: bool = False
    beta_init: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta_init < 1.0:
            raise ValueError(f"train.demon.beta_init={self.beta_init}; expected a value in [0, 1)")


def _parse_demon(value: Any, where: str) -> DemonConfig:
    if isinstance(value, bool):
        return DemonConfig(enabled=value)
    if isinstance(value, Mapping):
        raw = dict(value)
        raw.setdefault("enabled", True)
        return _build(DemonConfig, raw, where)
    raise TypeError(f"{where} must be true, false or a mapping like {{beta_init: 0.9}}; got {value!r}")


@dataclass(frozen=True)
class AugmentConfig:
    """Per-slide augmentation: one random draw of parameters per bag, applied to all its tiles.

    Attributes
    ----------
    enabled : off by default.
    blur_p, blur_sigma, blur_kernel : probability, sigma range (px) and kernel side (px, odd) of a Gaussian blur.
    jitter_p, brightness, contrast, saturation, hue : colour-jitter probability and strengths
        (kornia ``ColorJitter`` conventions; hue in [0, 0.5]).
    flips : random horizontal and vertical flips (p = 0.5 each).
    rotation : random rotation by a multiple of 90 degrees (lossless on square tiles).
    """

    enabled: bool = False
    blur_p: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 1.5)
    blur_kernel: int = 5
    jitter_p: float = 0.8
    brightness: float = 0.1
    contrast: float = 0.1
    saturation: float = 0.1
    hue: float = 0.02
    flips: bool = True
    rotation: bool = True

    def __post_init__(self) -> None:
        for name in ("blur_p", "jitter_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"train.augment.{name}={getattr(self, name)}; expected a probability in [0, 1]")
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise ValueError(f"train.augment.blur_kernel={self.blur_kernel}; expected an odd number of px >= 1")
        if not 0 < self.blur_sigma[0] <= self.blur_sigma[1]:
            raise ValueError(f"train.augment.blur_sigma={list(self.blur_sigma)}; expected [low, high] with 0 < low <= high")


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters (the ``train`` section; a method's ``train`` overrides any of them).

    Attributes
    ----------
    epochs : passes over the training slides.
    lr, weight_decay : Adam learning rate and L2 weight decay.
    bag_size : k, tiles sampled at random per slide per epoch (all tiles when a slide has fewer).
    batch_bags, accumulate_batches : B bags per batch, S batches per optimiser step; the
        optimiser steps on the mean loss of B x S bags (bags are processed one at a time).
    schedule : ``cosine`` (annealed to ``min_lr`` over the run), ``exponential`` (lr x gamma per
        epoch), ``linear`` (linear decay to ``min_lr`` over the run, the PatchGD paper's) or
        ``none``; ``warmup_epochs`` of linear warm-up come first.
    demon : DEMON momentum decay on Adam's first moment.
    clip_grad_norm : clip the global gradient norm before each step (None: off).
    select_metric : validation metric for ``best.pt`` and early stopping; ``auto`` is AUC for
        binary and QWK for multi-class tasks.
    early_stopping_patience : stop after this many epochs without improvement (None: off).
    device : one of :data:`wsi_pipeline.devices.DEVICES` (``auto``: CUDA, else MPS, else CPU) or ``cuda:<i>``.
    bf16 : bfloat16 autocast on CUDA (ignored on CPU).
    augment : per-slide augmentation.
    """

    epochs: int = 20
    lr: float = 1e-4
    weight_decay: float = 1e-4
    bag_size: int = 256
    batch_bags: int = 2
    accumulate_batches: int = 1
    schedule: Literal["cosine", "exponential", "linear", "none"] = "cosine"
    gamma: float = 0.955
    min_lr: float = 0.0
    warmup_epochs: int = 0
    demon: DemonConfig = field(default_factory=DemonConfig, metadata={"custom": _Custom(_parse_demon, "bool or mapping")})
    clip_grad_norm: float | None = None
    select_metric: Literal["auto", "auc", "qwk", "accuracy", "balanced_accuracy", "loss"] = "auto"
    early_stopping_patience: int | None = None
    device: str = "auto"
    bf16: bool = False
    augment: AugmentConfig = field(default_factory=AugmentConfig)

    def __post_init__(self) -> None:
        for name in ("epochs", "bag_size", "batch_bags", "accumulate_batches"):
            _positive(f"train.{name}", getattr(self, name))
        _positive("train.lr", self.lr)
        if self.weight_decay < 0 or self.min_lr < 0 or self.warmup_epochs < 0:
            raise ValueError("train.weight_decay, train.min_lr and train.warmup_epochs must be >= 0")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"train.gamma={self.gamma}; expected a per-epoch decay factor in (0, 1]")
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"train.warmup_epochs={self.warmup_epochs} must be smaller than train.epochs={self.epochs}")
        if self.clip_grad_norm is not None:
            _positive("train.clip_grad_norm", self.clip_grad_norm)
        if self.early_stopping_patience is not None:
            _positive("train.early_stopping_patience", self.early_stopping_patience)
        check_device(self.device, "train.device")

    @property
    def bags_per_step(self) -> int:
        """Bags whose mean loss one optimiser step follows (B x S)."""
        return self.batch_bags * self.accumulate_batches


@dataclass(frozen=True)
class Protocol:
    """An evaluation protocol: all tiles of a slide, or ``repeats`` draws of ``k`` random tiles.

    In YAML: ``all``, ``{subsample: {k: 256, repeats: 100}}`` (the papers' score: the metric of
    each repeat's predictions, averaged over repeats) or ``{subsample_ensemble: {k: 256, repeats:
    100}}`` (the metric of each slide's probabilities averaged over repeats); see
    :mod:`wsi_pipeline.inference.protocols`.
    """

    kind: Literal["all", "subsample", "subsample_ensemble"] = "all"
    k: int | None = None
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.kind != "all":
            if self.k is None or self.k < 1 or self.repeats < 1:
                raise ValueError(f"subsample protocol needs k >= 1 and repeats >= 1; got k={self.k}, repeats={self.repeats}")

    @property
    def name(self) -> str:
        """Short name used in file and column names: ``all``, ``sub256x100`` or ``ens256x100`` (as :mod:`wsi_pipeline.inference.protocols`)."""
        if self.kind == "all":
            return "all"
        return f"{'ens' if self.kind == 'subsample_ensemble' else 'sub'}{self.k}x{self.repeats}"

    def _to_raw(self) -> Any:
        return "all" if self.kind == "all" else {self.kind: {"k": self.k, "repeats": self.repeats}}


def _parse_protocol(value: Any, where: str) -> Protocol:
    if value == "all":
        return Protocol()
    kinds = ("subsample", "subsample_ensemble")
    if isinstance(value, Mapping) and len(value) == 1 and list(value)[0] in kinds and isinstance(next(iter(value.values())), Mapping):
        kind = list(value)[0]
        sub = dict(value[kind])
        unknown = sorted(set(sub) - {"k", "repeats"})
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in {where}.{kind}; valid keys: ['k', 'repeats']")
        if "k" not in sub:
            raise ValueError(f"{where}.{kind} needs k (tiles per draw)")
        k = _coerce(sub["k"], int, f"{where}.{kind}.k")
        repeats = _coerce(sub.get("repeats", 1), int, f"{where}.{kind}.repeats")
        return Protocol(kind, k, repeats)
    raise ValueError(
        f"{where}={value!r}; expected `all`, {{subsample: {{k: 256, repeats: 100}}}} or "
        "{subsample_ensemble: {k: 256, repeats: 100}}"
    )


def _parse_protocols(value: Any, where: str) -> tuple[Protocol, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"{where} must be a non-empty list of protocols; got {value!r}")
    return tuple(_parse_protocol(v, f"{where}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class EvalConfig:
    """Validation during training and the evaluation stage's protocols.

    Attributes
    ----------
    val_protocol : protocol of the per-epoch validation (the paper validates with the test protocol).
    protocols : protocols of the evaluation stage.
    seed : seed of the random tile draws of subsampling protocols (and random pseudo-bags).
    bootstrap : resamples of the slides for the 95 % intervals (0: no intervals; each costs one
        scikit-learn call per metric and seed, ~1 ms).
    """

    val_protocol: Protocol = field(default_factory=Protocol, metadata={"custom": _Custom(_parse_protocol, "protocol")})
    protocols: tuple[Protocol, ...] = field(
        default=(Protocol(), Protocol("subsample", 256, 100)),
        metadata={"custom": _Custom(_parse_protocols, "list of protocols")},
    )
    seed: int = 0
    bootstrap: int = 1000

    def __post_init__(self) -> None:
        if self.bootstrap < 0:
            raise ValueError(f"eval.bootstrap={self.bootstrap}; expected 0 (off) or a number of resamples")


@dataclass(frozen=True)
class EncoderConfig:
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

    ``chunk`` and ``train`` normalise with the statistics of the bag (or chunk) being trained on,
    while validation, evaluation and prediction normalise with running statistics: the model can
    learn to read the label from the bag's own statistics and then fails at evaluation. Training
    with them emits a :class:`BagStatisticsWarning` (see :func:`bag_statistics_warning`).
    """

    name: str = "resnet18"
    weights: str | None = None
    bn: Literal["frozen", "chunk", "train"] = "frozen"
    calibrate_bn: int = 0
    recalibrate_bn: bool = False

    def __post_init__(self) -> None:
        if self.calibrate_bn < 0:
            raise ValueError(f"encoder.calibrate_bn={self.calibrate_bn}; expected a number of tiles >= 0 (0 = off)")
        if self.recalibrate_bn and self.calibrate_bn <= 0:
            raise ValueError("encoder.recalibrate_bn needs encoder.calibrate_bn > 0 (the number of tiles to calibrate on)")


class BagStatisticsWarning(UserWarning):
    """Training normalises BatchNorm with bag statistics, evaluation with running statistics."""


def bag_statistics_warning(method: "MethodConfig") -> str | None:
    """Why training ``method`` with bag-statistics BatchNorm is risky; None when it does not use them.

    A method uses bag statistics when its encoder trains (any strategy but ``frozen``) with
    ``encoder.bn`` ``train`` (the whole bag is one BatchNorm batch: ``full``, ``bigl``, and
    ``patchgd``'s tiles of a step) or ``chunk`` (each accumulation chunk is one: the ABMIL-ACC
    paper's setting). Validation, evaluation and prediction run BatchNorm on running statistics,
    so what the model learned from the statistics of its bags is not what it sees there.
    """
    if method.strategy == "frozen" or method.encoder.bn == "frozen":
        return None
    batch = "each chunk of the bag" if method.encoder.bn == "chunk" else "the whole bag"
    return (
        f"method {method.name!r}: encoder.bn={method.encoder.bn!r} normalises BatchNorm with the statistics of "
        f"{batch} in training, but validation, evaluation and prediction use running statistics. A few lesion "
        "tiles shift the statistics of all the others, so the model can learn to read the label from the bag's "
        "statistics instead of from its tiles, and then fail at evaluation (README: 'Bag-statistics BatchNorm'). Prefer "
        "`encoder: {bn: frozen, calibrate_bn: N, recalibrate_bn: true}`; keep bn=" + repr(method.encoder.bn)
        + " only to reproduce a paper, and check the validation metric, not the training loss"
    )


@dataclass(frozen=True)
class AggregatorConfig:
    """MIL aggregator (or PatchGD head): a registered name and its keyword options."""

    name: str = "abmil"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BiglConfig:
    """Big-Layers: residual stages run as Big-Layers after the stem, and the device chunk size in elements.

    ``embed_budget_mib``: validation and evaluation embed with the plain encoder on the device when
    one call's estimated activations fit this many MiB, through Big-Layers otherwise
    (:class:`wsi_pipeline.bigl.EmbeddingEncoder`); None: half the CUDA device's memory, no limit
    on the CPU.
    """

    stages: int = 1
    max_elements: int = 2**27
    embed_budget_mib: float | None = None

    def __post_init__(self) -> None:
        if self.stages < 0:
            raise ValueError(f"bigl.stages={self.stages}; expected >= 0")
        _positive("bigl.max_elements", self.max_elements)
        if self.embed_budget_mib is not None and not self.embed_budget_mib >= 0:
            raise ValueError(f"bigl.embed_budget_mib={self.embed_budget_mib}; expected MiB >= 0 or null (device default)")


@dataclass(frozen=True)
class MethodConfig:
    """One method of the pipeline: how a bag's loss and gradients are computed.

    Attributes
    ----------
    name : folder name under ``runs/<pipeline>/``.
    strategy : ``frozen``, ``full``, ``accumulate``, ``bigl`` or ``patchgd``.
    encoder, aggregator : the models. For ``patchgd`` the head is ``patchgd.head``, or the
        aggregator entry when it names a PatchGD head (``cnn``, ``transformer``).
    chunk_size : tiles per encoder call (accumulation chunks, and embedding for validation).
    bigl : Big-Layers settings (``bigl`` strategy).
    patchgd : options of the PatchGD strategy (:class:`wsi_pipeline.training.patchgd.PatchGDConfig`);
        ``preset: paper`` fills in the PatchGD paper's settings here and in ``encoder``,
        ``aggregator`` and ``train`` (:mod:`wsi_pipeline.config.patchgd_presets`).
    features_dir : feature files of a ``frozen`` method (default ``<data.features_dir>/<encoder>``).
    train : the pipeline's ``train`` section with this method's overrides applied.
    """

    name: str
    strategy: str
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    chunk_size: int = 64
    bigl: BiglConfig = field(default_factory=BiglConfig)
    patchgd: dict[str, Any] = field(default_factory=dict)
    features_dir: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"method name {self.name!r} must be a folder name (letters, digits, _ . -)")
        _positive(f"methods.{self.name}.chunk_size", self.chunk_size)


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline config (see the module docstring for the YAML form)."""

    name: str
    data: DataConfig
    methods: tuple[MethodConfig, ...]
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seeds: tuple[int, ...] = (0, 1, 2)
    runs_dir: str = "runs"
    results_dir: str = "results"

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"pipeline name {self.name!r} must be a folder name (letters, digits, _ . -)")
        if not self.methods:
            raise ValueError("methods is empty; a pipeline needs at least one method")
        names = [m.name for m in self.methods]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate method name(s) {dup}; each method needs its own name")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={list(self.seeds)}; expected a non-empty list of distinct integers")

    def run_dir(self, method: str, seed: int) -> Path:
        """``<runs_dir>/<pipeline>/<method>/seed<seed>``."""
        return Path(self.runs_dir) / self.name / method / f"seed{seed}"


# ----------------------------------------------------------------------------------------------
# Generic validation
# ----------------------------------------------------------------------------------------------


def _positive(where: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{where}={value}; expected a value > 0")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return f"list of {len(args)} values ({', '.join(_type_name(a) for a in args)})"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` (from YAML) against the annotation ``tp``; return the typed value."""
    origin = typing.get_origin(tp)
    wrong = TypeError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise wrong
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except (TypeError, ValueError):
                continue
        raise wrong
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{where}={value!r}; expected {_type_name(tp)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise wrong
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise wrong
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise wrong
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if tp is float:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads `1e-4` (no dot) as a string; accept it as the number it spells.
            try:
                return float(value)
            except ValueError:
                raise wrong from None
        raise wrong
    if tp is str:
        if not isinstance(value, str):
            raise wrong
        return value
    raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a bug in this module, not in the YAML


def _build(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``; unknown keys and wrong types raise naming the field."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"{where or 'config'}: expected a mapping with keys {[f.name for f in dataclasses.fields(cls)]}, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    section = where or "top level"
    for key in raw:
        if key not in fields:
            raise ValueError(f"unknown key {key!r} in section {section!r}; valid keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        sub = f"{where}.{name}" if where else name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing required key {name!r} in section {section!r}")
            continue
        custom = f.metadata.get("custom")
        kwargs[name] = custom.parse(raw[name], sub) if custom else _coerce(raw[name], hints[name], sub)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# Loading, overrides, saving
# ----------------------------------------------------------------------------------------------


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config mapping (in place; also returned).

    The value is parsed with ``yaml.safe_load`` (``5e-5`` -> float, ``[0, 1]`` -> list,
    ``null`` -> None). In lists (``methods``), a path element is an index or a method name.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected section.key=value, e.g. train.lr=5e-5")
        path, text = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise ValueError(f"override {item!r}: empty key path")
        value = yaml.safe_load(text) if text.strip() else None
        node: Any = raw
        for i, key in enumerate(keys):
            last = i == len(keys) - 1
            where = ".".join(keys[: i + 1])
            if isinstance(node, list):
                idx = _list_index(node, key, item)
                if last:
                    node[idx] = value
                else:
                    node = node[idx]
                continue
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {'.'.join(keys[:i])} is not a section")
            if last:
                node[key] = value
            else:
                if node.get(key) is None or isinstance(node.get(key), bool):
                    node[key] = {}  # e.g. train.demon.beta_init when demon was `false`
                elif not isinstance(node[key], (dict, list)):
                    raise ValueError(f"override {item!r}: {where} is a value, not a section")
                node = node[key]
    return raw


def _list_index(node: list, key: str, item: str) -> int:
    if key.lstrip("-").isdigit():
        idx = int(key)
        if not -len(node) <= idx < len(node):
            raise ValueError(f"override {item!r}: index {idx} out of range for a list of {len(node)}")
        return idx
    names = [e.get("name") if isinstance(e, Mapping) else None for e in node]
    if key not in names:
        raise ValueError(f"override {item!r}: no entry named {key!r}; entries: {[n for n in names if n]}")
    return names.index(key)


def config_from_dict(raw: Mapping[str, Any], *, default_name: str | None = None) -> PipelineConfig:
    """Validate a raw mapping (parsed YAML) into a :class:`PipelineConfig`.

    Each method's ``train`` mapping is merged over the pipeline's ``train`` section, so
    ``MethodConfig.train`` is the method's resolved :class:`TrainConfig`.
    """
    if not isinstance(raw, Mapping):
        raise TypeError(f"a pipeline config must be a mapping of sections; got {type(raw).__name__}")
    raw = dict(raw)
    if "name" not in raw and default_name is not None:
        raw["name"] = default_name
    hints = typing.get_type_hints(PipelineConfig)
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    for key in raw:
        if key not in fields:
            raise ValueError(f"unknown key {key!r} in section 'top level'; valid keys: {sorted(fields)}")
    train_raw = raw.get("train") or {}
    _build(TrainConfig, train_raw, "train")  # report problems of the shared section under its own name
    methods_raw = raw.get("methods")
    if not isinstance(methods_raw, list):
        raise TypeError(f"methods: expected a list of methods (name, strategy, ...), got {methods_raw!r}")
    methods = []
    for i, m in enumerate(methods_raw):
        if not isinstance(m, Mapping):
            raise TypeError(f"methods[{i}]: expected a mapping with name, strategy, ...; got {m!r}")
        where = f"methods.{m['name']}" if "name" in m else f"methods[{i}]"
        m = apply_patchgd_preset(m, where)  # `patchgd: {preset: paper}` fills in the paper's settings
        over = m.get("train") or {}
        if not isinstance(over, Mapping):
            raise TypeError(f"{where}.train: expected a mapping of overrides of the train section, got {over!r}")
        m["train"] = _deep_merge(train_raw, over)
        methods.append(_build(MethodConfig, m, where))
    kwargs: dict[str, Any] = {"methods": tuple(methods)}
    for name, f in fields.items():
        if name == "methods":
            continue
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing required key {name!r} in section 'top level'")
            continue
        kwargs[name] = _coerce(raw[name], hints[name], name)
    return PipelineConfig(**kwargs)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Read, override and validate a pipeline YAML file.

    Parameters
    ----------
    path : the YAML file; ``name`` defaults to its stem.
    overrides : ``section.key=value`` strings (``--set`` on the command line).

    Raises
    ------
    FileNotFoundError : no such file.
    ValueError / TypeError : an unknown key (named with its section and the valid keys), a value
        of the wrong type (named with the expected type), an out-of-range value; the message is
        prefixed with the file name.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pipeline config not found: {path}; configs live in pipelines/*.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise TypeError(f"{path}: a pipeline config must be a mapping of sections; got {type(raw).__name__}")
    try:
        apply_overrides(raw, overrides)
        return config_from_dict(raw, default_name=path.stem)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from e


def _to_raw(obj: Any) -> Any:
    if hasattr(obj, "_to_raw"):
        return obj._to_raw()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_raw(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): _to_raw(v) for k, v in obj.items()}
    return obj


def config_to_dict(config: Any) -> Any:
    """Plain YAML-able containers (dict/list/str/int/float/bool/None) for any config dataclass.

    ``config_from_dict(config_to_dict(c)) == c`` for a :class:`PipelineConfig`.
    """
    return _to_raw(config)


def save_config(config: PipelineConfig, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML, atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    os.replace(tmp, path)
    return path


def method_by_name(config: PipelineConfig, name: str) -> MethodConfig:
    """The method called ``name`` (ValueError listing the pipeline's methods otherwise)."""
    for m in config.methods:
        if m.name == name:
            return m
    raise ValueError(f"pipeline {config.name!r} has no method {name!r}; its methods: {[m.name for m in config.methods]}")
