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
      protocols: [all, sub256x100]   # all tiles; 100 draws of 256 tiles
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
import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsi_pipeline.config.choices import BN_MODES, SCHEDULES, SELECT_METRICS, task_names
from wsi_pipeline.config.strategy_traits import strategy_names, strategy_traits
from wsi_pipeline.config.data import DataConfig
from wsi_pipeline.config.endpoint import LossOptions, check_task_loss, check_task_targets
from wsi_pipeline.config.evaluation import ALL, EvalConfig, EvalProtocol, parse_protocol, saved_protocol
from wsi_pipeline.config.io import short_repr, config_to_dict, write_yaml
from wsi_pipeline.config.model import AggregatorConfig, BiglConfig, EncoderConfig
from wsi_pipeline.config.overrides import apply_overrides, build_config, deep_merge
from wsi_pipeline.config.patchgd import PatchGDConfig, resolve_patchgd_options
from wsi_pipeline.config.patchgd_presets import apply_patchgd_preset
from wsi_pipeline.config.limits import MAX_CHUNK_TILES
from wsi_pipeline.config.schema import Checked, build, spec
from wsi_pipeline.config.store_settings import StoreSettings
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.config.train import AugmentConfig, DemonConfig, TrainConfig
from wsi_pipeline.failures import ConfigTypeError

__all__ = [
    "AggregatorConfig",
    "AugmentConfig",
    "BN_MODES",
    "BagStatisticsWarning",
    "BiglConfig",
    "DataConfig",
    "DemonConfig",
    "EncoderConfig",
    "EvalConfig",
    "LossOptions",
    "MethodConfig",
    "PipelineConfig",
    "EvalProtocol",
    "SCHEDULES",
    "SELECT_METRICS",
    "StoreSettings",
    "TilingConfig",
    "TrainConfig",
    "bag_statistics_warning",
    "patchgd_mapping",
    "with_patchgd_head",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "method_by_name",
    "save_config",
    "tiling_of_pipeline",
    "upgrade_saved_config",
    "with_eval",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class MethodConfig(Checked):
    """One method of the pipeline: how a bag's loss and gradients are computed.

    Attributes
    ----------
    name : folder name under ``runs/<pipeline>/``.
    strategy : ``frozen``, ``full``, ``accumulate``, ``bigl``, ``patchgd`` or another strategy with an entry in
        :data:`~wsi_pipeline.config.strategy_traits.STRATEGY_TRAITS` (:func:`strategy_names`).
    encoder, aggregator : the models. For ``patchgd`` the head is ``patchgd.head``, or the
        aggregator entry when it names a PatchGD head (``cnn``, ``transformer``).
    chunk_size : tiles per encoder call (accumulation chunks, and embedding for validation).
    bigl : Big-Layers settings (``bigl`` strategy).
    patchgd : options of the PatchGD strategy (:class:`wsi_pipeline.config.patchgd.PatchGDConfig`, checked on loading);
        ``preset: paper`` fills in the PatchGD paper's settings here and in ``encoder``,
        ``aggregator`` and ``train`` (:mod:`wsi_pipeline.config.patchgd_presets`).
    features_dir : feature files of a ``frozen`` method (default ``<data.features_dir>/<encoder>``).
    train : the pipeline's ``train`` section with this method's overrides applied.
    val_protocol : protocol of this method's per-epoch validation: the method's own
        ``val_protocol`` key, else ``eval.val_protocol`` (the paper validates its sampled-test
        methods with sampled tiles, the others with all tiles).
    task : ``classification`` (the manifest's ``label``), ``survival`` (its ``time`` and
        ``event``), ``regression`` (its ``target``) or ``multilabel`` (the binary columns ``targets``
        names); every method of a pipeline has the same task (and the same ``targets``).
    targets : the manifest columns of a task that takes a method's own (``multilabel``: ``[col, ...]``);
        empty for the others.
    loss : the training loss; None (YAML) means the task's default, and the built config holds
        the loss used (:mod:`wsi_pipeline.config.endpoint`).
    loss_options : options of the survival and regression losses (:class:`LossOptions`).
    """

    name: str
    strategy: str = field(metadata=spec(choices=strategy_names))
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    chunk_size: int = field(default=64, metadata=spec(gt=0, le=MAX_CHUNK_TILES))
    bigl: BiglConfig = field(default_factory=BiglConfig)
    patchgd: dict[str, Any] = field(default_factory=dict)
    features_dir: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    val_protocol: EvalProtocol = field(default=ALL, metadata=spec(parse=parse_protocol))
    task: str = field(default="classification", metadata=spec(choices=task_names))
    loss: str | None = None
    loss_options: LossOptions = field(default_factory=LossOptions)
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _NAME_RE.match(self.name):
            raise ValueError(f"method name {self.name!r} must be a folder name (letters, digits, _ . -)")
        object.__setattr__(self, "loss", check_task_loss(self.task, self.loss, f"methods.{self.name}"))
        check_task_targets(self.task, self.targets, f"methods.{self.name}")

    @property
    def task_key(self) -> str:
        """The task bound to this method's ``targets`` (:func:`wsi_pipeline.tasks.task_key`; the task's name
        without targets): what endpoints, checkpoints and the pipeline's :attr:`PipelineConfig.task` carry."""
        from wsi_pipeline.tasks import task_key

        return task_key(self.task, self.targets)

    @functools.cached_property
    def patchgd_config(self) -> PatchGDConfig:
        """This method's PatchGD options, parsed once (:meth:`PatchGDConfig.for_method`: the ``patchgd``
        section, its preset, and the head and BatchNorm mode the other sections imply)."""
        return PatchGDConfig.for_method(self, f"methods.{self.name}.patchgd")


@dataclass(frozen=True)
class PipelineConfig(Checked):
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
        super().__post_init__()
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
        tasks = {m.task_key for m in self.methods}
        if len(tasks) > 1:
            by: dict[str, list[str]] = {t: [] for t in sorted(tasks)}
            for m in self.methods:
                by[m.task_key].append(m.name)
            raise ValueError(f"methods have different tasks {by}; every method of a pipeline has one task "
                             "(their results are compared in one table): put the others in a pipeline of their own")
        if self.data.bags == "patient":
            grid = [m.name for m in self.methods if strategy_traits(m.strategy).grid_head]
            if grid:
                raise ValueError(f"data.bags: patient puts several slides in one bag, whose tile grids do not join; "
                                 f"PatchGD methods {grid} need one slide's grid: use data.bags: slide")
        self._check_feature_input()
        from wsi_pipeline.tasks import get_task

        get_task(self.task).classes(self.data.n_classes)  # ValueError when the task needs data.n_classes

    def _check_feature_input(self) -> None:
        """``data.features`` (precomputed feature files) and ``encoder: {name: precomputed}`` go together, with
        ``strategy: frozen`` and no augmentation or BatchNorm calibration (there are no tiles)."""
        pre = [m.name for m in self.methods if m.encoder.name == "precomputed"]
        if pre and self.data.features is None:
            raise ValueError(f"methods {pre} use encoder 'precomputed' but data.features is not set; give the folder of "
                             "the feature files: data.features: {dir: DIR, format: auto}")
        if self.data.features is None:
            return
        for m in self.methods:
            if m.encoder.name != "precomputed":  # the cohort's slides are feature files: no tiles for an encoder
                raise ValueError(f"method {m.name!r}: encoder {m.encoder.name!r} embeds tiles, but this pipeline's input is "
                                 "precomputed feature files (data.features); use encoder: {name: precomputed}, or a "
                                 "pipeline of its own with data.tiles_dir for this method")
            if strategy_traits(m.strategy).trains_encoder:
                raise ValueError(f"method {m.name!r}: strategy {m.strategy!r} trains the encoder on tiles; precomputed "
                                 "features (data.features) train the aggregator only: use strategy: frozen")
            if m.train.augment.enabled or m.encoder.calibrate_bn:
                what = "train.augment" if m.train.augment.enabled else "encoder.calibrate_bn"
                raise ValueError(f"method {m.name!r}: {what} needs tiles; precomputed features (data.features) have "
                                 "none: turn it off")
        if self.data.bags == "patient":
            raise ValueError("data.bags: patient is not supported with data.features; use bags: slide")

    def check_eval_methods(self) -> None:
        """``ValueError`` unless ``eval.methods`` and ``eval.heatmap_method`` name methods of this pipeline.

        Checked by the evaluation stage (and :func:`with_eval`), not on construction: a run's saved
        config holds one method but the pipeline's ``eval`` section.
        """
        names = [m.name for m in self.methods]
        for key, asked in (("eval.methods", list(self.eval.methods)), ("eval.heatmap_method", [self.eval.heatmap_method])):
            unknown = [n for n in asked if n is not None and n not in names]
            if unknown:
                raise ValueError(f"{key}: {unknown[0]!r} is not a method of pipeline {self.name!r}; its methods: {names}")

    @property
    def task(self) -> str:
        """The methods' task (``classification``, ``survival``, ``regression``; with a method's targets
        ``multilabel[<col>,...]``, :attr:`MethodConfig.task_key`)."""
        return self.methods[0].task_key

    @property
    def label_classes(self) -> int | None:
        """``data.n_classes`` for a task with classes (manifest labels are checked against it; :meth:`Task.classes
        <wsi_pipeline.tasks.base.Task.classes>`), else None."""
        from wsi_pipeline.tasks import get_task

        return get_task(self.task).classes(self.data.n_classes)

    def run_dir(self, method: str, seed: int) -> Path:
        """``<runs_dir>/<pipeline>/<method>/seed<seed>``."""
        return Path(self.runs_dir) / self.name / method / f"seed{seed}"


def _method(m: Any, i: int, train_raw: Mapping[str, Any], val_protocol: EvalProtocol) -> MethodConfig:
    """Method ``i`` of the list: its preset expanded, its ``train`` merged over the shared section,
    ``val_protocol`` (the pipeline's ``eval.val_protocol``) unless it sets its own, built, and for
    ``patchgd`` its options checked (errors under ``methods.<name>``)."""
    if not isinstance(m, Mapping):
        raise ConfigTypeError(f"methods[{i}]: expected a mapping with name, strategy, ...; got {short_repr(m)}")
    where = f"methods.{m['name']}" if "name" in m else f"methods[{i}]"
    m = apply_patchgd_preset(m, where)  # `patchgd: {preset: paper}` fills in the paper's settings
    over = m.get("train") or {}
    if not isinstance(over, Mapping):
        raise ConfigTypeError(f"{where}.train: expected a mapping of overrides of the train section, got {short_repr(over)}")
    m["train"] = deep_merge(train_raw, over)
    m.setdefault("val_protocol", val_protocol.name)
    method = build(MethodConfig, m, where)
    if strategy_traits(method.strategy).grid_head:
        _ = method.patchgd_config  # parsed once, here: errors name methods.<name>.patchgd
    return method


def config_from_dict(raw: Mapping[str, Any], *, default_name: str | None = None) -> PipelineConfig:
    """Validate a raw mapping (parsed YAML) into a :class:`PipelineConfig`.

    Each method's ``train`` mapping is merged over the pipeline's ``train`` section, so
    ``MethodConfig.train`` is the method's resolved :class:`TrainConfig`. Errors name the field's
    path (``methods.abmil.train.lr: expected a number, got str 'x'``).
    """
    if not isinstance(raw, Mapping):
        raise ConfigTypeError(f"a pipeline config must be a mapping of sections; got {type(raw).__name__}")
    raw = dict(raw)
    if "name" not in raw and default_name is not None:
        raw["name"] = default_name
    valid = sorted(f.name for f in dataclasses.fields(PipelineConfig))
    for key in raw:
        if key not in valid:
            raise ValueError(f"unknown key {key!r} in section 'top level'; valid keys: {valid}")
    train_raw = raw.get("train") or {}
    build(TrainConfig, train_raw, "train")  # report problems of the shared section under its own name
    eval_cfg = build(EvalConfig, raw.get("eval") or {}, "eval")  # likewise; its val_protocol is each method's default
    methods_raw = raw.get("methods")
    if not isinstance(methods_raw, list):
        raise ConfigTypeError(f"methods: expected a list of methods (name, strategy, ...), got {short_repr(methods_raw)}")
    methods = tuple(_method(m, i, train_raw, eval_cfg.val_protocol) for i, m in enumerate(methods_raw))
    return build(PipelineConfig, {**raw, "methods": methods})


def tiling_of_pipeline(raw: Mapping[str, Any], *, default_name: str | None = None) -> tuple[StoreSettings, str | None, str | None]:
    """(``data.tiling``, ``data.manifest``, ``data.tiles_dir``) of a pipeline mapping, for ``tile --config``.

    A pipeline with ``methods`` is checked whole (:func:`config_from_dict`). One without (a file that only says how
    to tile) needs none: its top-level keys, its ``train`` and ``eval`` sections and its ``data`` section (with
    ``manifest`` optional: ``tile --slides`` gives the slides) are checked as a whole pipeline's are; the manifest
    and tiles folder are None where it names none.
    """
    if not isinstance(raw, Mapping) or raw.get("methods") is not None:
        config = config_from_dict(raw, default_name=default_name)
        return config.data.tiling, str(config.data.manifest), None if config.data.tiles_dir is None else str(config.data.tiles_dir)
    valid = sorted(f.name for f in dataclasses.fields(PipelineConfig))
    for key in raw:
        if key not in valid:
            raise ValueError(f"unknown key {key!r} in section 'top level'; valid keys: {valid}")
    build(TrainConfig, raw.get("train") or {}, "train")
    build(EvalConfig, raw.get("eval") or {}, "eval")
    data_raw = raw.get("data") or {}
    if not isinstance(data_raw, Mapping):
        raise ConfigTypeError(f"data: expected a mapping (manifest, tiles_dir, tiling, ...), got {short_repr(data_raw)}")
    data = build(DataConfig, {"manifest": "", "tiles_dir": "", **data_raw}, "data")  # the paths may be flags
    manifest, tiles_dir = data_raw.get("manifest"), data_raw.get("tiles_dir")
    return data.tiling, None if manifest is None else str(manifest), None if tiles_dir is None else str(tiles_dir)


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = (), values: Mapping[str, Any] | None = None) -> PipelineConfig:
    """Read, override and validate a pipeline YAML file (:func:`~wsi_pipeline.config.overrides.build_config`).

    Parameters
    ----------
    path : the YAML file; ``name`` defaults to its stem.
    overrides : ``section.key=value`` strings (``--set`` on the command line,
        :mod:`wsi_pipeline.config.overrides`).
    values : ``{key path: value}`` set before ``overrides`` (a command's own flags, e.g.
        ``{"eval.bootstrap": 0}`` for ``eval --bootstrap 0``).

    Raises
    ------
    FileNotFoundError : no such file.
    ValueError / TypeError : an unknown key (named with its section and the valid keys), a value
        of the wrong type (named with the expected type), an out-of-range value; the message is
        prefixed with the file name.
    """
    stem = Path(path).stem
    return build_config(path, lambda raw: config_from_dict(raw, default_name=stem), values=values, overrides=overrides)


#: ``eval`` keys added when the evaluation stage's flags moved into :class:`EvalConfig` (absent from older saved configs).
_LATER_EVAL_KEYS = ("methods", "device", "batch_size", "heatmaps", "heatmap_method", "heatmap_mode", "results")


def upgrade_saved_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as saved in a checkpoint or ``config.yaml`` by an earlier version, in today's form
    (protocols written as mappings become their names; a method without ``val_protocol`` gets the
    pipeline's ``eval.val_protocol``; ``eval`` keys added since get their defaults); today's form is
    returned unchanged (a copy).

    For reading saved runs only: a pipeline YAML is held to today's spelling.
    """
    out = dict(raw)
    ev = out.get("eval")
    if isinstance(ev, Mapping):
        ev = dict(ev)
        if "val_protocol" in ev:
            ev["val_protocol"] = saved_protocol(ev["val_protocol"])
        if isinstance(ev.get("protocols"), list):
            ev["protocols"] = [saved_protocol(p) for p in ev["protocols"]]
        # keys the eval section gained later (the evaluation stage's settings, e.g. eval.batch_size): their defaults
        ev = {**{k: v for k, v in config_to_dict(EvalConfig()).items() if k in _LATER_EVAL_KEYS}, **ev}
        out["eval"] = ev
    if isinstance(out.get("methods"), list):  # before methods had their own val_protocol: the pipeline's
        default = saved_protocol(ev.get("val_protocol", "all")) if isinstance(ev, Mapping) else "all"
        # ... and before a method could name its targets (multilabel): none
        out["methods"] = [{"val_protocol": default, "targets": [], **m} if isinstance(m, Mapping) else m for m in out["methods"]]
    return out


def save_config(config: PipelineConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as YAML, atomically (:func:`wsi_pipeline.io_atomic.write_text_atomic`)."""
    return write_yaml(config, path)


def with_eval(config: PipelineConfig, **changes: Any) -> PipelineConfig:
    """``config`` with the :class:`EvalConfig` fields named in ``changes`` replaced (a None value keeps
    the config's), checked as a section and against the pipeline (:meth:`PipelineConfig.check_eval_methods`).

    For callers that set evaluation settings in code: ``with_eval(cfg, device="cpu", bootstrap=0)``.
    """
    given = {k: v for k, v in changes.items() if v is not None}
    if given:
        if "methods" in given:
            given["methods"] = tuple(given["methods"])
        if "results" in given:
            given["results"] = str(given["results"])
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, **given))
    config.check_eval_methods()
    return config


def method_by_name(config: PipelineConfig, name: str) -> MethodConfig:
    """The method called ``name`` (ValueError listing the pipeline's methods otherwise)."""
    for m in config.methods:
        if m.name == name:
            return m
    raise ValueError(f"pipeline {config.name!r} has no method {name!r}; its methods: {[m.name for m in config.methods]}")


# Rules across a method's sections


class BagStatisticsWarning(UserWarning):
    """Training normalises BatchNorm with bag statistics, evaluation with running statistics."""


def bag_statistics_warning(method: MethodConfig) -> str | None:
    """Why training ``method`` with bag-statistics BatchNorm is risky; None when it does not use them.

    A method uses bag statistics when its encoder trains (any strategy but ``frozen``) with
    ``encoder.bn`` ``train`` (the whole bag is one BatchNorm batch: ``full``, ``bigl``, and
    ``patchgd``'s tiles of a step) or ``chunk`` (each accumulation chunk is one: the ABMIL-ACC
    paper's setting). Validation, evaluation and prediction run BatchNorm on running statistics,
    so what the model learned from the statistics of its bags is not what it sees there.
    """
    if not strategy_traits(method.strategy).trains_encoder or method.encoder.bn == "frozen":
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


#: The old name of :func:`wsi_pipeline.config.patchgd.resolve_patchgd_options` (kept importable).
patchgd_mapping = resolve_patchgd_options


def with_patchgd_head(method: MethodConfig) -> MethodConfig:
    """``method`` (a config dataclass) with its ``patchgd`` options resolved by :func:`patchgd_mapping`."""
    return dataclasses.replace(method, patchgd=patchgd_mapping(method))
