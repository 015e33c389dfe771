"""Every choice list of the configs and the command line, defined once.

Each fixed list is a ``Literal`` type (used as the dataclass annotation, so the builder checks it
and a type checker sees it) with its tuple of values beside it (for ``argparse`` ``choices=`` and
messages). Lists that grow when code registers a model come from the registries, as functions.

=====================  ===========================================  =================================
name                   values                                       used by
=====================  ===========================================  =================================
``SCHEDULES``          cosine, exponential, linear, none            ``train.schedule``
``BN_MODES``           frozen, chunk, train                         ``encoder.bn`` (strategy subsets:
                                                                    ``ACCUMULATE_BN_MODES``,
                                                                    ``PATCHGD_BN_MODES``)
``SELECT_METRICS``     auto, auc, qwk, accuracy, balanced_accuracy,  ``train.select_metric``
                       loss, c_index, mae, rmse,
                       pearson, spearman
``CALIBRATIONS``       none, platt, temperature                     ``train.calibrate``
``TIES``               efron, breslow                               ``methods[].loss_options.ties``
``LEVELS``             slide, patient                               ``eval.level``
``PATIENT_POOLS``      mean, max                                    ``eval.patient_pool``
``HEATMAP_MODES``      rank, minmax, raw                            ``eval.heatmap_mode``,
                                                                    ``predict.heatmap_mode``
``BAG_UNITS``          slide, patient                               ``data.bags``
``strategy_names()``   the strategy traits table                    ``methods[].strategy``
``DEVICES``            auto, cpu, cuda, mps (and ``cuda:<i>``)      ``train.device``, ``--device``
``TILING_METHODS``     tissue, greyscale, otsu, unet                ``tile --method``, ``data.tiling``
``QC_MODES``           drop, flag, off                              ``tile --qc``
``QC_ARTIFACTS``       pen, blur, fold                              ``tile --qc-drop``
``POINT_EDGES``        pad, skip                                    ``tile --points-edge``
``COMPRESSIONS``       zstd, none, jpeg                             ``tile --compression``
``BACKENDS``           auto, openslide, tiffslide, wsidicom, pillow ``tile --backend``
``BACKBONE_SCALES``    full, paper                                  ``patchgd.backbone_scale``
``PARTIAL_WINDOWS``    step, drop                                   ``patchgd.partial_window``
``PATCHGD_PRESETS``    default, paper                               ``patchgd.preset``
``encoder_names()``    the encoder registry                         ``encoder.name``, ``--encoder``
``aggregator_names()`` the aggregator registry                      ``aggregator.name`` (MIL)
``head_names()``       the PatchGD head registry                    ``patchgd.head``
=====================  ===========================================  =================================
"""

from __future__ import annotations

import typing
from typing import Literal

from wsi_pipeline.data.store import COMPRESSIONS
from wsi_pipeline.config.strategy_traits import strategy_names
from wsi_pipeline.devices import DEVICES
from wsi_pipeline.slides.opener import BACKENDS

__all__ = [
    "ACCUMULATE_BN_MODES", "BAG_UNITS", "CALIBRATIONS", "Calibration", "BACKBONE_SCALES", "BACKENDS", "BN_MODES", "COMPRESSIONS", "DEVICES", "HEATMAP_MODES", "HeatmapMode", "LEVELS",
    "PARTIAL_WINDOWS", "PATCHGD_BN_MODES", "POINT_EDGES", "PointEdge", "PATCHGD_PRESETS", "PATIENT_POOLS", "QC_ARTIFACTS", "QC_MODES", "SCHEDULES",
    "SELECT_METRICS", "TIES", "TILING_METHODS", "TRAIN_LOGS", "TrainLog",
    "BackboneScale", "BagUnit", "BNMode", "Level", "PartialWindow", "PatchGDPreset", "PatientPool", "QCArtifact",
    "QCMode", "Schedule", "SelectMetric", "Ties", "TilingMethod", "aggregator_names", "encoder_names",
    "head_names", "model_names", "strategy_names", "task_names",
]

Schedule = Literal["cosine", "exponential", "linear", "none"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
#: ``train.log``: where per-step training records go besides ``steps.csv``.
TrainLog = Literal["none", "tensorboard"]
TRAIN_LOGS: tuple[str, ...] = typing.get_args(TrainLog)

#: Encoder BatchNorm modes in training: running statistics, each chunk's, or the whole bag's.
BNMode = Literal["frozen", "chunk", "train"]
BN_MODES: tuple[str, ...] = typing.get_args(BNMode)
#: The modes the ``accumulate`` strategy supports (exact, or the ABMIL-ACC paper's chunk statistics).
ACCUMULATE_BN_MODES: tuple[str, ...] = ("frozen", "chunk")
#: The modes ``patchgd`` supports (``patchgd.freeze_bn`` true / false).
PATCHGD_BN_MODES: tuple[str, ...] = ("frozen", "train")

SelectMetric = Literal[
    "auto", "auc", "qwk", "accuracy", "balanced_accuracy", "loss", "c_index", "mae", "rmse", "pearson",
    "spearman",
]
SELECT_METRICS: tuple[str, ...] = typing.get_args(SelectMetric)

#: ``train.calibrate``: the probability calibration fitted on the validation slides after training
#: (:func:`wsi_pipeline.tasks.calibration.fit_logit_map` implements each).
Calibration = Literal["none", "platt", "temperature"]
CALIBRATIONS: tuple[str, ...] = typing.get_args(Calibration)
#: How the Cox partial likelihood treats tied event times.
Ties = Literal["efron", "breslow"]
TIES: tuple[str, ...] = typing.get_args(Ties)
#: Whether evaluation also scores patients (their slides' scores pooled), and how they are pooled.
Level = Literal["slide", "patient"]
LEVELS: tuple[str, ...] = typing.get_args(Level)
PatientPool = Literal["mean", "max"]
PATIENT_POOLS: tuple[str, ...] = typing.get_args(PatientPool)
#: Colour normalisation of heatmaps: per-slide rank, per-slide min-max, raw scores
#: (``wsi_pipeline.export.heatmap.MODES`` holds the same names).
HeatmapMode = Literal["rank", "minmax", "raw"]
HEATMAP_MODES: tuple[str, ...] = typing.get_args(HeatmapMode)
#: What one bag holds in training and evaluation: one slide's tiles, or all tiles of a patient's slides.
BagUnit = Literal["slide", "patient"]
BAG_UNITS: tuple[str, ...] = typing.get_args(BagUnit)

#: The built-in tissue detectors (the first is the default); every registered one: ``tiling_params.detector_names()``.
TilingMethod = Literal["tissue", "greyscale", "otsu", "unet"]
TILING_METHODS: tuple[str, ...] = typing.get_args(TilingMethod)
#: What the tiler does with tile artifacts: drop the kinds named in ``qc_drop`` (and flag the rest), flag all, or skip QC.
QCMode = Literal["drop", "flag", "off"]
QC_MODES: tuple[str, ...] = typing.get_args(QCMode)
#: The artifacts tile QC detects.
QCArtifact = Literal["pen", "blur", "fold"]
QC_ARTIFACTS: tuple[str, ...] = typing.get_args(QCArtifact)
#: A point tile crossing the image edge: padded with the slide's glass colour, or skipped and counted.
PointEdge = Literal["pad", "skip"]
POINT_EDGES: tuple[str, ...] = typing.get_args(PointEdge)

BackboneScale = Literal["full", "paper"]
BACKBONE_SCALES: tuple[str, ...] = typing.get_args(BackboneScale)
PartialWindow = Literal["step", "drop"]
PARTIAL_WINDOWS: tuple[str, ...] = typing.get_args(PartialWindow)
PatchGDPreset = Literal["default", "paper"]
PATCHGD_PRESETS: tuple[str, ...] = typing.get_args(PatchGDPreset)


def encoder_names() -> list[str]:
    """Registered tile encoders (``encoder.name``, ``features --encoder``)."""
    from wsi_pipeline.models.encoders import ENCODERS  # the registries import torch: only when asked

    return ENCODERS.names()


def aggregator_names() -> list[str]:
    """Registered MIL aggregators."""
    from wsi_pipeline.models.aggregators import AGGREGATORS

    return AGGREGATORS.names()


def head_names() -> list[str]:
    """Registered PatchGD heads (``patchgd.head``, or ``aggregator.name`` of a ``patchgd`` method)."""
    from wsi_pipeline.models.heads import HEADS

    return HEADS.names()


def task_names() -> list[str]:
    """Registered tasks (``methods[].task``): :data:`wsi_pipeline.tasks.TASKS`."""
    from wsi_pipeline.tasks import task_names as names  # the task registry imports scikit-learn: only when asked

    return names()


def model_names() -> list[str]:
    """What ``aggregator.name`` may be: an aggregator, or for ``patchgd`` a head."""
    return sorted({*aggregator_names(), *head_names()})
