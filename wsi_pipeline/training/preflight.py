"""Checks before any training (:func:`preflight`): everything a run needs, with errors that name the fix."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from wsi_pipeline.config.pipeline import BagStatisticsWarning, MethodConfig, PipelineConfig, bag_statistics_warning
from wsi_pipeline.data.bags import Slide, check_stores, check_tiling, drop_empty, skipped_by_tiler, slides_for_split
from wsi_pipeline.data.patient_bags import patient_units
from wsi_pipeline.devices import resolve_device
from wsi_pipeline.failures import reworded
from wsi_pipeline.methods.endpoints import endpoint_outputs, fit_endpoint
from wsi_pipeline.tasks import Endpoint, get_task
from wsi_pipeline.methods.models import build_models
from wsi_pipeline.training.rundir import DONE, check_resumable, run_config
from wsi_pipeline.training.strategies import check_strategy
from wsi_pipeline.training import distributed
from wsi_pipeline.output_dirs import check_output_dir

__all__ = ["RunPlan", "preflight"]

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """What :func:`preflight` found: the cohort's slides and the runs to do."""

    manifest: pd.DataFrame
    train: list[Slide]
    val: list[Slide]
    runs: list[tuple[MethodConfig, int, Path]]
    finished: list[Path]
    tiling: dict[str, Any] | None = None  # the stores' tiling settings, saved with every checkpoint
    stain: dict[str, Any] | None = None  # the training tiles' stain summary, saved with every checkpoint
    stain_ctx: Any = None  # the fitted stain normalisation (data.stain), a StainContext, or None
    memory: dict[str, Any] = field(default_factory=dict)  # per method, its predicted peak memory (training.memory)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)  # per method, fitted on the training split; saved too
    bags: str = "slide"  # data.bags

    @property
    def train_units(self) -> list[Slide]:
        """What training bags are drawn from: the training slides, or their patients (``data.bags: patient``)."""
        return patient_units(self.train) if self.bags == "patient" else self.train

    @property
    def val_units(self) -> list[Slide]:
        """What validation scores: the validation slides, or their patients."""
        return patient_units(self.val) if self.bags == "patient" else self.val


def preflight(
    config: PipelineConfig,
    methods: Sequence[MethodConfig],
    seeds: Sequence[int],
    *,
    resume: bool = True,
    strict: bool = False,
) -> RunPlan:
    """Check everything before any training; raise a clear error naming the problem and the fix.

    Checks: the manifest exists and validates (labels in ``[0, n_classes)``), there are training
    slides, every training/validation slide has a complete tile store (slides whose store holds 0
    tiles are left out with one warning, or refused with ``strict``), each method's strategy
    exists with its building blocks and options, its models build (encoder, weights,
    aggregator options), and run folders are consistent with ``resume``.
    """
    manifest, train, val, tiling = _cohort(config, strict)
    _check_methods(config, methods)
    if distributed.is_main():  # before minutes of compute: the folders this run writes can be written
        check_output_dir(Path(config.runs_dir) / config.name, what="runs folder")
        if any(check_strategy(m).uses_features for m in methods) and config.data.features is None:
            check_output_dir(config.data.features_dir, what="features folder (data.features_dir)")
    runs, finished, unfinished = [], [], []
    for method in methods:
        for seed in seeds:
            run_dir = config.run_dir(method.name, seed)
            if (run_dir / DONE).exists():
                finished.append(run_dir)
                continue
            if (run_dir / "last.pt").exists():
                if not resume:
                    unfinished.append(run_dir)
                else:
                    check_resumable(run_dir, run_config(config, method, seed))
            if method.train.log == "tensorboard" and distributed.is_main():  # its event folder, before compute
                check_output_dir(run_dir / "tensorboard", what="tensorboard folder (train.log: tensorboard)")
            runs.append((method, seed, run_dir))
    if unfinished:
        raise ValueError(
            f"unfinished run(s) found: {', '.join(map(str, unfinished))}; run without --no-resume to continue them, "
            "or delete those folders to start over"
        )
    endpoints = {}
    for method in methods:
        try:
            units = patient_units(train) if config.data.bags == "patient" else train
            endpoints[method.name] = fit_endpoint(method, config.data.n_classes, [s.y for s in units])
        except ValueError as e:
            raise ValueError(f"method {method.name!r}: {e}") from e
    return RunPlan(manifest, train, val, runs, finished, tiling, endpoints=endpoints, bags=config.data.bags)


def _cohort(config: PipelineConfig, strict: bool) -> tuple[pd.DataFrame, list[Slide], list[Slide], dict[str, Any] | None]:
    """The manifest, its training and validation slides with complete stores, and the stores' tiling."""
    from wsi_pipeline.manifests.schema import read_manifest

    manifest_path = Path(config.data.manifest)
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"data.manifest {manifest_path} not found (pipeline {config.name!r}; relative paths are relative to "
            f"the current directory {os.getcwd()}); build a manifest with `wsi-pipeline manifest` or fix the path"
        )
    manifest = read_manifest(manifest_path, n_classes=config.label_classes)
    get_task(config.task).check_manifest(manifest, str(manifest_path))
    try:
        train = slides_for_split(manifest, "train", config.data.tiles_dir or "", task=config.task)
        val = slides_for_split(manifest, "val", config.data.tiles_dir or "", task=config.task)
    except ValueError as e:
        raise ValueError(f"{manifest_path}: {e}") from e
    task = get_task(config.task)
    cols = list(task.target_columns)
    unlabelled = manifest[manifest["split"].isin(("train", "val")) & ~task.has_target(manifest)]["slide_id"].tolist()
    if unlabelled:
        what = (f"{manifest_path}: {len(unlabelled)} train/val slide(s) have no label ({', '.join(cols)}): "
                f"{', '.join(unlabelled[:5])}{' ...' if len(unlabelled) > 5 else ''}")
        if strict:
            raise ValueError(f"{what}; give them a label or clear their split (--strict refuses them)")
        log.warning("%s; they are left out of training and validation (--strict refuses them)", what)
    if config.data.features is not None:  # precomputed feature files instead of tile stores
        from wsi_pipeline.training.precomputed import check_feature_files, with_feature_files

        left_out: dict[str, str] = {}
        train, _ = check_feature_files(config, with_feature_files(config, train), split="train", strict=strict)
        val, _ = check_feature_files(config, with_feature_files(config, val), split="val", strict=strict)
        tiling = None
    else:
        left_out = skipped_by_tiler(config.data.stores_dir())  # read once: the stores check, both splits and the test split
        check_stores(train + val, config.data.stores_dir(), left_out)
        train = drop_empty(train, split="train", strict=strict, skipped=left_out)
        val = drop_empty(val, split="val", strict=strict, skipped=left_out)
        tiling = check_tiling(train + val, config.data.tiling)
    if not train:
        what = task.target_noun
        raise ValueError(
            f"{manifest_path}: no slides with a {what} value and split=train; set the split column (train/val/test) "
            "or make splits with `wsi-pipeline manifest`"
        )
    if not val:
        log.warning("%s: no labelled slides with split=val; no validation, best.pt is the last epoch", manifest_path)
    test = manifest[(manifest["split"] == "test") & task.has_target(manifest)]
    test = test[~test["slide_id"].astype(str).isin(left_out)]
    test_targets = [task.target_of(*task.slide_fields([r[c] for c in task.target_columns])) for _, r in test.iterrows()]
    for split, targets, consequence in (
        ("train", [s.y for s in train], "the model learns that class only and cannot tell the classes apart"),
        ("val", [s.y for s in val], "val_auc is undefined (nan) every epoch and best.pt is chosen on the validation loss"),
        ("test", test_targets,
         "eval cannot compute AUC on it" + (f" ({len(left_out)} slide(s) left out by the tiler)" if left_out else "")),
    ):
        _warn_one_class(manifest_path, split, len(targets), task.lone_class(targets) if targets else None, consequence)
    return manifest, train, val, tiling


def _warn_one_class(manifest_path: Path, split: str, n_slides: int, lone: Any, consequence: str) -> None:
    """One WARNING, before any training, when a non-empty split holds one class only (``lone``, :meth:`Task.lone_class
    <wsi_pipeline.tasks.base.Task.lone_class>`; None: several, or a task without classes)."""
    if lone is not None:
        log.warning("%s: the %s split has %d slide(s), all of class %s (one class only): %s. Redraw label-stratified splits (`wsi-pipeline "
                    "manifest split --manifest M.csv --redraw --out M.csv`, after tiling so that left-out slides are not "
                    "drawn) or add slides of the other class", manifest_path, split, n_slides, lone, consequence)


def _check_methods(config: PipelineConfig, methods: Sequence[MethodConfig]) -> None:
    """Each method's strategy, options, device and models (built on the CPU, torch's RNG left as it was)."""
    for method in methods:
        check_strategy(method)
        resolve_device(method.train.device)
        risk = bag_statistics_warning(method)
        if risk:
            log.warning(risk)
            warnings.warn(risk, BagStatisticsWarning, stacklevel=3)
    for method in methods:
        if method.train.augment.enabled and not check_strategy(method).applies_augment:
            log.warning("method %s: augmentation is not applied by the %s strategy", method.name, method.strategy)
        with torch.random.fork_rng(devices=[]):
            try:
                build_models(method, endpoint_outputs(method, config.data.n_classes), device="cpu", for_training=False)
            except (ValueError, TypeError, FileNotFoundError) as e:
                raise reworded(e, f"method {method.name!r}: cannot build its models: {e}") from e
