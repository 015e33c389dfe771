"""The training loop: one loop for every strategy, runs that resume exactly.

:func:`train_pipeline` checks everything it can before any training (config, manifest,
labels, tile stores, strategies and their building blocks, models, run folders), extracts
missing frozen features, then trains each (method, seed) into
``<runs_dir>/<pipeline>/<method>/seed<k>/``:

- ``config.yaml``  the resolved config of the run (this method, this seed);
- ``history.csv``  per epoch: ``epoch, train_loss, val_<metric>..., lr, seconds``;
- ``last.pt``      written atomically after every epoch: models, optimiser, schedule, RNG states,
                   best metric, history (see :mod:`wsi_pipeline.inference.checkpoint`);
- ``best.pt``      models of the best validation epoch (state dicts only);
- ``done``         JSON summary, written last; a run with it is skipped.

Per epoch: the Python, NumPy and torch generators are re-seeded from ``(seed, epoch)`` and the
bags are drawn from ``(seed, epoch)`` (:func:`wsi_pipeline.data.bags.epoch_plan`), so a run
resumed from ``last.pt`` after epoch e computes exactly what the uninterrupted run computes
(on CPU; CUDA kernels may be non-deterministic). The RNG states are saved as well.

Optimisation per epoch: bags come in groups of ``B x S`` (``batch_bags x accumulate_batches``);
each bag's gradient of ``loss / group size`` is added by the strategy, then the gradients are
clipped (optional) and the optimiser steps, so a step follows the mean loss of its group.
Validation runs after every epoch with the method's ``val_protocol`` (default ``eval.val_protocol``;
each slide embedded once in eval mode, subsets re-run the aggregator only:
:func:`wsi_pipeline.inference.protocols.validate_model`);
``best.pt`` follows ``train.select_metric`` (AUC for binary, QWK for multi-class tasks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from wsi_pipeline.data.augment import build_augment
from wsi_pipeline.devices import resolve_device
from wsi_pipeline.data.bags import FeatureReader, Slide, TileReader, check_stores, check_tiling, drop_empty, epoch_plan, iter_bags, slides_for_split
from wsi_pipeline.training import distributed
from wsi_pipeline.inference.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint
from wsi_pipeline.config.pipeline import (
    BagStatisticsWarning,
    MethodConfig,
    PipelineConfig,
    bag_statistics_warning,
    config_to_dict,
    method_by_name,
    save_config,
)
from wsi_pipeline.training.optim import EpochSchedule, build_optimizer, clip_gradients
from wsi_pipeline.inference.models import build_models, frozen_encoder, frozen_features_dir
from wsi_pipeline.training.strategies import Strategy, build_strategy, check_strategy
from wsi_pipeline.progress import progress_bar

__all__ = ["RunPlan", "preflight", "resolve_device", "train_pipeline", "train_run"]

log = logging.getLogger(__name__)

VAL_METRICS = ("loss", "auc", "qwk", "accuracy", "balanced_accuracy")
DONE = "done"


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


# ----------------------------------------------------------------------------------------------
# Checks before training
# ----------------------------------------------------------------------------------------------


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
    from wsi_pipeline.manifests.schema import read_manifest

    manifest_path = Path(config.data.manifest)
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"data.manifest {manifest_path} not found (pipeline {config.name!r}; relative paths are relative to "
            f"the current directory {os.getcwd()}); build a manifest with `wsi-pipeline manifest` or fix the path"
        )
    manifest = read_manifest(manifest_path, n_classes=config.data.n_classes)
    train = slides_for_split(manifest, "train", config.data.tiles_dir)
    val = slides_for_split(manifest, "val", config.data.tiles_dir)
    check_stores(train + val, config.data.tiles_dir)
    train = drop_empty(train, split="train", strict=strict)
    val = drop_empty(val, split="val", strict=strict)
    tiling = check_tiling(train + val, config.data.tiling)
    if not train:
        raise ValueError(
            f"{manifest_path}: no labelled slides with split=train; set the split column (train/val/test) "
            "or make splits with `wsi-pipeline manifest`"
        )
    if not val:
        log.warning("%s: no labelled slides with split=val; no validation, best.pt is the last epoch", manifest_path)
    for method in methods:
        check_strategy(method)
        resolve_device(method.train.device)
        risk = bag_statistics_warning(method)
        if risk:
            log.warning(risk)
            warnings.warn(risk, BagStatisticsWarning, stacklevel=2)
    for method in methods:
        if method.strategy == "patchgd" and method.train.augment.enabled:
            log.warning("method %s: augmentation is not applied by the %s strategy", method.name, method.strategy)
        with torch.random.fork_rng(devices=[]):
            try:
                build_models(method, config.data.n_classes, device="cpu", for_training=False)
            except (ValueError, TypeError, FileNotFoundError) as e:
                raise type(e)(f"method {method.name!r}: cannot build its models: {e}") from e
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
                    _check_resumable(run_dir, _run_config(config, method, seed))
            runs.append((method, seed, run_dir))
    if unfinished:
        raise ValueError(
            f"unfinished run(s) found: {', '.join(map(str, unfinished))}; run without --no-resume to continue them, "
            "or delete those folders to start over"
        )
    return RunPlan(manifest, train, val, runs, finished, tiling)


def _run_config(config: PipelineConfig, method: MethodConfig, seed: int) -> PipelineConfig:
    return dataclasses.replace(config, methods=(method,), seeds=(int(seed),))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


#: Settings a resumed run may change: where it runs and where runs and results are kept.
_RESUME_FREE = ("device", "runs_dir", "results_dir")


def _config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    a, b = _flatten(saved), _flatten(now)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k, '<absent>')!r} (saved) vs {b.get(k, '<absent>')!r} (now)"
        for k in keys
        if a.get(k) != b.get(k) and k.rsplit(".", 1)[-1] not in _RESUME_FREE
    ]


def _check_resumable(run_dir: Path, run_config: PipelineConfig) -> None:
    state = load_checkpoint(run_dir / "last.pt")
    diff = _config_diff(state["config"], config_to_dict(run_config))
    if diff:
        raise ValueError(
            f"cannot resume {run_dir}: its config differs from the current one ({'; '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}); restore the config, or delete the run folder to start over"
        )


# ----------------------------------------------------------------------------------------------
# Frozen features
# ----------------------------------------------------------------------------------------------


def _ensure_features(config: PipelineConfig, method: MethodConfig, plan: RunPlan, device: torch.device, progress: bool) -> Path:
    """Make sure the slides a frozen method reads as features have up-to-date ones; extract the rest.

    Those are the training and validation slides, or only the validation slides when the method
    augments (its training bags are then embedded on the fly from augmented tiles).
    """
    from wsi_pipeline.inference.features import extract_features, features_path

    out = Path(frozen_features_dir(method, config.data.features_dir))
    slides = plan.val if method.train.augment.enabled else plan.train + plan.val
    if not slides:
        return out
    missing = [s.slide_id for s in slides if not features_path(out, s.slide_id).is_file()]
    if missing:
        log.warning(
            "method %s: %d of %d slides have no feature file in %s; extracting them now with the frozen %s encoder",
            method.name, len(missing), len(slides), out, method.encoder.name,
        )
    rows = plan.manifest[plan.manifest["slide_id"].isin([s.slide_id for s in slides])]
    encoder = frozen_encoder(method).to(device)
    calibrate_encoder(encoder, method, plan.train, device)
    # files that exist are checked against the encoder's weights and the store (stale ones are rebuilt)
    report = extract_features(
        rows, config.data.tiles_dir, out, method.encoder.name, method.encoder.weights,
        encoder=encoder, batch_size=method.chunk_size, device=str(device), progress=progress,
    )
    failed = report[report["status"] == "failed"]
    if len(failed):
        raise RuntimeError(
            f"method {method.name!r}: feature extraction failed for {len(failed)} slide(s): "
            + "; ".join(f"{r.slide_id}: {r.error}" for r in failed.head(5).itertuples())
        )
    return out


#: Seed of the tile draw for BatchNorm calibration: the same tiles for every run and seed of a
#: method and for its feature extraction, so a frozen method's features and model agree.
CALIBRATION_SEED = 0


def calibrate_encoder(
    encoder: torch.nn.Module, method: MethodConfig, slides: Sequence[Slide], device: torch.device, *,
    log_level: int = logging.DEBUG,
) -> None:
    """Calibrate ``encoder``'s BatchNorm statistics on ``method.encoder.calibrate_bn`` training tiles (no-op at 0).

    The calibration is logged at ``log_level``: the run logs its first one, not the repeats
    (feature extraction, per-epoch recalibration).

    Tiles are drawn evenly over ``slides`` with a fixed seed, shuffled so that every batch of
    ``method.chunk_size`` tiles mixes slides; see :mod:`wsi_pipeline.models.bn_calibration`.
    """
    n = method.encoder.calibrate_bn
    if n <= 0 or not slides:
        return
    from wsi_pipeline.data.tensors import tiles_to_tensor
    from wsi_pipeline.models.bn_calibration import calibrate_batchnorm

    reader = TileReader(slides)
    rng = np.random.default_rng(CALIBRATION_SEED)
    per_slide = -(-n // len(slides))
    parts = []
    for i in range(len(slides)):
        count = len(reader.store(i))
        parts.append(reader.read(i, np.sort(rng.choice(count, min(per_slide, count), replace=False))))
    tiles = np.concatenate(parts)
    tiles = tiles[rng.permutation(len(tiles))[:n]]
    step = max(2, method.chunk_size)
    batches = (tiles_to_tensor(tiles[j : j + step], device=device) for j in range(0, len(tiles), step) if len(tiles[j : j + step]) > 1)
    seen = calibrate_batchnorm(encoder, batches)
    log.log(log_level, "method %s: BatchNorm statistics calibrated on %d training tiles (%d batches)", method.name, len(tiles), seen)


class _LazyFeatures(Sequence):
    """Validation features read from h5 one slide at a time (a cohort's features need not fit in memory)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        from wsi_pipeline.inference.features import read_features

        return torch.from_numpy(read_features(self.paths[i])[0])


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train_pipeline(
    config: PipelineConfig,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    resume: bool = True,
    *,
    device: str | None = None,
    progress: bool = True,
    strict: bool = False,
) -> list[Path]:
    """Train every (method, seed) of ``config``; return the run folders (finished ones included).

    Parameters
    ----------
    config : the pipeline.
    methods : method names to train (default: all).
    seeds : seeds to train (default: ``config.seeds``).
    resume : continue runs that have ``last.pt`` but no ``done`` marker (the default; with ``False``
        such runs are an error). A run whose config changed is never resumed: that is an error.
    strict : refuse slides whose store holds 0 tiles instead of leaving them out with a warning.
    device : overrides every method's ``train.device``.
    progress : tqdm bars (shown on terminals only).
    """
    chosen = [method_by_name(config, m) for m in methods] if methods else list(config.methods)
    seeds = [int(s) for s in seeds] if seeds else list(config.seeds)
    ddp = distributed.init_from_env()  # under torchrun: join the process group (no-op otherwise)
    plan = preflight(config, chosen, seeds, resume=resume, strict=strict)
    for run_dir in plan.finished:
        log.info("skipping %s: finished (remove its `done` file to train it again)", run_dir)
    features: dict[str, Path] = {}
    for method in {m.name: m for m, _, _ in plan.runs}.values():
        if method.strategy == "frozen":
            if ddp.is_main:  # rank 0 extracts, the others wait, then read the files
                _ensure_features(
                    config, method, plan, distributed.device_for(resolve_device(device or method.train.device)), progress)
            distributed.barrier()
            features[method.name] = Path(frozen_features_dir(method, config.data.features_dir))
    if plan.runs and plan.stain is None:  # for `predict`'s off-distribution check
        from wsi_pipeline.data.stain_stats import stain_reference

        plan.stain = stain_reference(plan.train)
    for method, seed, run_dir in plan.runs:
        train_run(config, method, seed, plan, features_dir=features.get(method.name), device=device, progress=progress)
    return [config.run_dir(m.name, s) for m in chosen for s in seeds]


def _seed_everything(*keys: int) -> None:
    s = int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1)[0])
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _seed_torch(*keys: int) -> None:
    torch.manual_seed(int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1)[0]))


def _selection(train_cfg: Any, n_classes: int) -> tuple[str, bool]:
    """(metric name, higher is better)."""
    if train_cfg.select_metric == "loss":
        return "loss", False
    if train_cfg.select_metric == "auto":
        return ("auc" if n_classes == 2 else "qwk"), True
    return train_cfg.select_metric, True


def _better(value: float | None, best: float | None, higher: bool) -> bool:
    if value is None or not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    return value > best if higher else value < best


def improves(value: float | None, loss: float | None, best: dict[str, Any], higher: bool) -> bool:
    """Whether an epoch with validation ``value`` (the selection metric) and ``loss`` beats ``best``.

    A better metric wins; an equal metric wins with a lower validation loss. Without the
    tie-break a metric that saturates early (AUC 1.0 on a small validation set after one epoch)
    would pin ``best.pt`` to that first, barely trained, epoch.
    """
    if _better(value, best.get("value"), higher):
        return True
    tied = value is not None and best.get("value") is not None and value == best["value"]
    return tied and _better(loss, best.get("loss"), higher=False)


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pd.DataFrame(rows).to_csv(tmp, index=False)
    os.replace(tmp, path)


def _write_json(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _bars(progress: bool) -> Any:
    return lambda *a, **k: progress_bar(*a, enabled=progress, **k)


def train_run(
    config: PipelineConfig,
    method: MethodConfig,
    seed: int,
    plan: RunPlan,
    *,
    features_dir: Path | None = None,
    device: str | None = None,
    progress: bool = True,
) -> Path:
    """Train one (method, seed) into its run folder, resuming from ``last.pt`` when present; return the folder.

    ``plan`` comes from :func:`preflight` (which also decides whether resuming is allowed).
    """
    run_dir = config.run_dir(method.name, seed)
    if (run_dir / DONE).exists():
        return run_dir
    tc = method.train
    n_classes = config.data.n_classes
    distributed.init_from_env()  # under torchrun (no-op when train_pipeline joined already)
    dev = distributed.device_for(resolve_device(device or tc.device))  # cuda:LOCAL_RANK under torchrun
    main = distributed.is_main()  # only rank 0 writes the run folder
    run_config = _run_config(config, method, seed)
    metric, higher = _selection(tc, n_classes)
    bar = _bars(progress)

    _seed_everything(seed)
    strategy = build_strategy(method, n_classes, dev, build_augment(tc.augment))
    calibrate_encoder(strategy.encoder, method, plan.train, dev, log_level=logging.INFO)  # overwritten by last.pt when resuming
    if "features" in (strategy.input, strategy.val_input):
        from wsi_pipeline.inference.features import features_path, read_features

        if features_dir is None:
            raise ValueError(f"method {method.name!r} is frozen: pass the folder of its feature files (features_dir)")
    reader: TileReader | FeatureReader
    if strategy.input == "features":
        reader = FeatureReader(plan.train, [features_path(features_dir, s.slide_id) for s in plan.train], read_features)
    else:
        reader = TileReader(plan.train)
    val_inputs: Sequence[Any]
    if strategy.val_input == "features":
        val_inputs = _LazyFeatures([features_path(features_dir, s.slide_id) for s in plan.val])
    else:
        val_reader = TileReader(plan.val)
        val_inputs = [val_reader.store(i) for i in range(len(plan.val))]
    val_labels = [s.label for s in plan.val]
    n_tiles = reader.n_tiles()
    if strategy.steps_optimizer:
        steps_per_epoch = strategy.epoch_steps(n_tiles)  # type: ignore[attr-defined]
    else:
        steps_per_epoch = math.ceil(len(n_tiles) / tc.bags_per_step)
    params = strategy.parameters()
    sync = distributed.StepSync(params, strategy.state_modules().values())
    optimizer = build_optimizer(params, tc, total_steps=tc.epochs * steps_per_epoch)
    schedule = EpochSchedule(optimizer, tc)

    history: list[dict[str, Any]] = []
    best: dict[str, Any] = {"metric": metric, "value": None, "epoch": 0}
    start = 0
    last = run_dir / "last.pt"
    if last.exists():
        state = load_checkpoint(last)  # on the CPU: RNG states must stay there; load_state_dict moves the rest
        for name, module in strategy.state_modules().items():
            module.load_state_dict(state["models"][name])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        history, best, start = list(state["history"]), dict(state["best"]), int(state["epoch"])
        log.info("resuming %s after epoch %d", run_dir, start)
    distributed.broadcast_states(strategy.state_modules().values())  # every rank starts from rank 0's models
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(run_config, run_dir / "config.yaml")

    def optimizer_step() -> None:
        sync.reduce()  # under torchrun: the step's gradients summed over ranks
        clip_gradients(params, tc.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    autocast = (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16) if tc.bf16 and dev.type == "cuda" else nullcontext()
    )
    epochs = bar(range(start, tc.epochs), initial=start, total=tc.epochs, desc=f"{method.name} seed{seed}", unit="epoch")
    for epoch in epochs:
        if tc.early_stopping_patience and epoch - best["epoch"] >= tc.early_stopping_patience:
            log.info("%s: early stopping, no %s improvement since epoch %d", run_dir, metric, best["epoch"])
            break
        t0 = time.perf_counter()
        _seed_everything(seed, epoch + 1)
        lr = schedule.set_epoch(epoch)
        if method.encoder.recalibrate_bn and epoch > 0 and strategy.encoder is not None:
            calibrate_encoder(strategy.encoder, method, plan.train, dev)
            distributed.broadcast_states([strategy.encoder])
        strategy.train()
        with autocast:
            train_loss = _train_epoch(strategy, reader, n_tiles, tc, seed, epoch, optimizer, optimizer_step, bar, sync=sync)
            # under torchrun: validated on rank 0, the result sent to all (they decide early stopping alike)
            val = distributed.broadcast_object(_validate(strategy, val_inputs, val_labels, config, method, dev) if main else None)
        row = {"epoch": epoch + 1, "train_loss": train_loss, **{f"val_{k}": val.get(k, math.nan) for k in VAL_METRICS}}
        row.update(lr=lr, seconds=round(time.perf_counter() - t0, 3))
        history.append(row)
        value = val.get(metric) if val else None
        loss = val.get("loss") if val else None
        improved = improves(value, loss, best, higher) or best["epoch"] == 0 or not val
        if improved:
            best = {"metric": metric, "value": None if value is None else float(value), "epoch": epoch + 1,
                    "loss": None if loss is None or not math.isfinite(loss) else float(loss)}
        if not main:
            continue
        _write_csv(history, run_dir / "history.csv")
        models = {name: m.state_dict() for name, m in strategy.state_modules().items()}
        common = {"config": config_to_dict(run_config), "method": config_to_dict(method), "seed": int(seed), "epoch": epoch + 1,
                  **({"tiling": plan.tiling} if plan.tiling is not None else {}),
                  **({"stain_reference": plan.stain} if plan.stain is not None else {})}
        if improved:
            save_checkpoint(run_dir / "best.pt", {**common, "models": models, "best": best})
        save_checkpoint(last, {
            **common, "models": models, "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict(),
            "rng": capture_rng(), "best": best, "history": history,
        })
        done_here = [r["seconds"] for r in history[-(epoch + 1 - start):]]  # epochs run by this process
        left = (tc.epochs - epoch - 1) * float(np.mean(done_here))
        log.info(
            "%s seed %d epoch %d/%d: train_loss %.4f, val_%s %s, lr %.3g (%.1f s/epoch, ~%s left)",
            method.name, seed, epoch + 1, tc.epochs, train_loss, metric,
            "n/a" if value is None else f"{value:.4f}", lr, row["seconds"], _duration(left),
        )
        epochs.set_postfix(loss=f"{train_loss:.4f}", **({f"val_{metric}": f"{value:.3f}"} if value is not None else {}))
    distributed.barrier()
    if not main:
        return run_dir
    _write_json(
        {
            "epochs": len(history), "select_metric": metric, "best_epoch": best["epoch"],
            "best_value": best["value"] if best["value"] is not None and math.isfinite(best["value"]) else None,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        run_dir / DONE,
    )
    return run_dir


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"3.2 min"``, ``"1.5 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _train_epoch(
    strategy: Strategy,
    reader: TileReader | FeatureReader,
    n_tiles: list[int],
    tc: Any,
    seed: int,
    epoch: int,
    optimizer: torch.optim.Optimizer,
    optimizer_step: Any,
    bar: Any,
    *,
    sync: distributed.StepSync | None = None,
) -> float:
    """One pass over the training slides; returns the mean bag loss (over all ranks under torchrun).

    Under torchrun each rank trains its share of every step's bags (of every PatchGD batch),
    :func:`wsi_pipeline.training.distributed.shard_plan`; ``optimizer_step`` sums the gradients.
    """
    losses: list[float] = []
    optimizer.zero_grad(set_to_none=True)
    ddp = distributed.current()
    if strategy.steps_optimizer:
        # slides_per_batch slides at a time (PatchGD's batch), the strategy steps the optimiser;
        # the whole store is its input
        plan = epoch_plan(n_tiles, bag_size=max(n_tiles), bags_per_step=1, seed=seed, epoch=epoch)
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch, 2]).generate_state(1)[0]))
        bags = bar(total=len(plan), desc=f"epoch {epoch + 1}", unit="slide", leave=False)
        order = [i for (i, _), in plan]
        per = int(getattr(strategy, "slides_per_batch", 1))
        for a in range(0, len(order), per):
            group = order[a : a + per]
            part = {"part": distributed.shard(len(group))} if ddp.enabled else {}  # this rank's slides of the batch
            losses.append(strategy.run_batch(  # type: ignore[attr-defined]
                [reader.store(i) for i in group], [reader.slides[i].label for i in group], optimizer_step, gen, **part))  # type: ignore[union-attr]
            bags.update(len(group))
            bags.set_postfix(loss=f"{np.mean(losses):.4f}")
        bags.close()
        return float(np.mean(distributed.all_sum(losses)))  # a rank's batch loss is its share of the batch's
    plan = epoch_plan(n_tiles, bag_size=tc.bag_size, bags_per_step=tc.bags_per_step, seed=seed, epoch=epoch)
    local, numbers = distributed.shard_plan(plan)  # this rank's bags (all of them in a single process)
    bags = bar(total=sum(map(len, local)), desc=f"epoch {epoch + 1}", unit="bag", leave=False)
    loaded = iter_bags(local, reader)
    first = 0
    for g, group in enumerate(plan):
        if sync is not None:
            sync.begin_group(first, len(group))
        for b in numbers[g]:
            _, bag = next(loaded)
            # every bag starts from its own seed: its augmentation and dropout draws depend on
            # (seed, epoch, bag) only, not on how many numbers earlier bags consumed, so strategies
            # that draw differently per bag still give a bag the same augmentation (and so does
            # the rank that trains it under torchrun)
            _seed_torch(seed, epoch, b)
            with sync.bag(b) if sync is not None else nullcontext():
                losses.append(strategy.bag_step(bag, 1.0 / len(group)))
            bags.update()
            bags.set_postfix(loss=f"{np.mean(losses):.4f}")
        optimizer_step()
        first += len(group)
    bags.close()
    if not ddp.enabled:
        return float(np.mean(losses))
    total, count = distributed.all_sum([sum(losses), len(losses)])
    return total / count


def _validate(
    strategy: Strategy,
    inputs: Sequence[Any],
    labels: list[int],
    config: PipelineConfig,
    method: MethodConfig,
    device: torch.device,
) -> dict[str, float]:
    """Validation metrics (``loss, auc, qwk, accuracy, balanced_accuracy``); empty without validation slides."""
    if not labels:
        return {}
    from wsi_pipeline.inference.protocols import validate_model

    encoder = None if strategy.val_input == "features" else strategy.embedder()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.eval.seed)
        return validate_model(
            encoder, strategy.aggregator, inputs, labels, method.val_protocol,
            n_classes=config.data.n_classes, device=device, batch_size=method.chunk_size, seed=config.eval.seed,
        )

