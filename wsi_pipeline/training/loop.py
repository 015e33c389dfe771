"""The training loop: one loop for every strategy, runs that resume exactly.

:func:`train_pipeline` checks everything it can before any training (:func:`preflight`: config,
manifest, labels, tile stores, strategies and their building blocks, models, run folders),
extracts missing frozen features, then trains each (method, seed) into
``<runs_dir>/<pipeline>/<method>/seed<k>/`` (:mod:`wsi_pipeline.training.rundir`):

- ``config.yaml``  the resolved config of the run (this method, this seed);
- ``history.csv``  per epoch: ``epoch, train_loss, val_<metric>..., lr, seconds``;
- ``last.pt``      written atomically after every epoch: models, optimiser, schedule, RNG states,
                   best metric, history (see :mod:`wsi_pipeline.checkpoints.files`);
- ``best.pt``      models of the best validation epoch (state dicts only), with the probability
                   calibration fitted on the validation slides when ``train.calibrate`` asks
                   (:mod:`wsi_pipeline.training.decisions`; ``calibration.json`` says what);
- ``done``         JSON summary, written last; a run with it is skipped.

:func:`train_run` is one run: per epoch it sets the learning rate, trains an epoch (the
strategy's :meth:`~wsi_pipeline.training.strategies.Strategy.train_epoch`, the same call for
every strategy), validates, checkpoints and logs.

Per epoch: the Python, NumPy and torch generators are re-seeded from ``(seed, epoch)`` and the
bags are drawn from ``(seed, epoch)`` (:func:`wsi_pipeline.data.bags.epoch_plan`), so a run
resumed from ``last.pt`` after epoch e computes exactly what the uninterrupted run computes
(on CPU; CUDA kernels may be non-deterministic). The RNG states are saved as well.

Optimisation per epoch: bags come in groups of ``B x S`` (``batch_bags x accumulate_batches``);
each bag's gradient of ``loss / group size`` is added by the strategy, then the gradients are
clipped (optional) and the optimiser steps, so a step follows the mean loss of its group.
Validation runs after every epoch with ``eval.val_protocol`` (each slide embedded once in eval
mode, subsets re-run the aggregator only: :func:`wsi_pipeline.inference.protocol_metrics.validate_model`);
``best.pt`` follows ``train.select_metric`` (AUC for binary, QWK for multi-class tasks).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig, method_by_name, save_config
from wsi_pipeline.config.strategy_traits import strategy_traits
from wsi_pipeline.data.augment import build_augment
from wsi_pipeline.data.bags import FeatureReader, TileReader
from wsi_pipeline.devices import bf16_active, bf16_autocast, resolve_device
from wsi_pipeline.checkpoints.files import capture_rng, save_run_checkpoint
from wsi_pipeline.checkpoints.run import ResumeState, RunCheckpoint
from wsi_pipeline.methods.models import build_models, encoder_checkpoint, frozen_features_dir, random_encoder_note, restore_encoder
from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.training.memory import MemoryPrediction, check_fits, predict_memory, write_memory_record
from wsi_pipeline.training.monitor import StepInfo, StepMonitor, gradient_norm
from wsi_pipeline.progress import progress_bar
from wsi_pipeline.training import distributed
from wsi_pipeline.training.calibration import calibrate_encoder
from wsi_pipeline.training.decisions import calibrate_best
from wsi_pipeline.training.epoch import seed_everything as _seed_everything
from wsi_pipeline.training.frozen_features import ensure_features
from wsi_pipeline.training.optim import EpochSchedule, build_optimizer, clip_gradients
from wsi_pipeline.training.preflight import RunPlan, preflight
from wsi_pipeline.training.rundir import (
    DONE, changed_since_finished, clean_temporary_files, resume, run_config, run_holder, run_lock, write_done, write_history,
)
from wsi_pipeline.training.strategies import Strategy, build_strategy, check_strategy
from wsi_pipeline.training.validation import improves, selection, validate, validation_columns
from wsi_pipeline import interrupt

__all__ = ["train_pipeline", "train_run"]

log = logging.getLogger(__name__)


def train_pipeline(
    config: PipelineConfig,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    resume: bool = True,
    *,
    device: str | None = None,
    progress: bool = True,
    strict: bool = False,
    memory_check: bool = True,
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
    memory_check : refuse a method whose predicted peak memory exceeds what is available
        (:mod:`wsi_pipeline.training.memory`); the prediction is logged and recorded either way.
    """
    if config.data.features is not None:  # precomputed features: the `precomputed` encoder's width D from the files
        from wsi_pipeline.training.precomputed import feature_dim, resolve_precomputed

        config = resolve_precomputed(config, feature_dim(config))
    chosen = [method_by_name(config, m) for m in methods] if methods else list(config.methods)
    seeds = [int(s) for s in seeds] if seeds else list(config.seeds)
    ddp = distributed.init_from_env()  # under torchrun: join the process group (no-op otherwise)
    plan = preflight(config, chosen, seeds, resume=resume, strict=strict)
    if plan.runs:  # fitted once, before any features or training: every run and feature file uses it
        from wsi_pipeline.training.stain import fit_run_stain

        plan.stain_ctx = fit_run_stain(config, [m for m, _, _ in plan.runs], plan.train, plan.manifest, progress=progress)
    for run_dir in plan.finished:
        method = next(m for m in chosen if run_dir.parent.name == m.name)
        changed = changed_since_finished(run_dir, run_config(config, method, int(run_dir.name[4:])))
        if changed:
            log.warning("%s finished with another config (%s%s); it is kept as trained, and eval reports what it was "
                        "trained with. Delete its `done` file (continue from last.pt) or the folder to train it with the "
                        "current config", run_dir, "; ".join(changed[:4]), " ..." if len(changed) > 4 else "")
        else:
            log.info("skipping %s: finished (remove its `done` file to train it again)", run_dir)
    for method in {m.name: m for m, _, _ in plan.runs}.values():
        note = random_encoder_note(method)
        if note and ddp.is_main:
            log.warning(note)
    for method in {m.name: m for m, _, _ in plan.runs}.values():  # before any compute: will it fit?
        if config.data.features is not None:  # precomputed features: the aggregator alone, no tiles to size it by
            continue
        plan.memory[method.name] = _predict_memory(config, method, plan, device, check=memory_check and ddp.is_main)
    features: dict[str, Path] = {}
    for method in {m.name: m for m, _, _ in plan.runs}.values():
        if check_strategy(method).uses_features:
            if ddp.is_main:  # rank 0 extracts, the others wait, then read the files
                ensure_features(config, method, plan, distributed.device_for(resolve_device(device or method.train.device)), progress)
            distributed.barrier()
            features[method.name] = _features_dir(config, method)
    if plan.runs and plan.stain is None and config.data.features is None:  # for `predict`'s off-distribution check
        from wsi_pipeline.data.stain_stats import stain_reference

        plan.stain = stain_reference(plan.train)
    for method, seed, run_dir in plan.runs:
        with run_lock(run_dir) as mine:
            if not mine:
                log.warning("%s: another process is training it (%s); left to that process", run_dir,
                            run_holder(run_dir) or "its lock is held")
                continue
            if distributed.is_main():
                clean_temporary_files(run_dir)
            train_run(config, method, seed, plan, features_dir=features.get(method.name), device=device, progress=progress)
    return [config.run_dir(m.name, s) for m in chosen for s in seeds]


def _features_dir(config: PipelineConfig, method: MethodConfig) -> Path:
    """The folder of a frozen method's feature files: the pipeline's input files (``data.features``), or the
    method's extracted ones."""
    if config.data.features is not None:
        from wsi_pipeline.training.precomputed import features_input_dir

        return features_input_dir(config)
    return Path(frozen_features_dir(method, config.data.features_dir))


@dataclass
class _Run:
    """One run's state: what nanoGPT keeps in globals."""

    config: PipelineConfig
    method: MethodConfig
    seed: int
    plan: RunPlan
    run_dir: Path
    device: torch.device
    bar: Any
    strategy: Strategy
    reader: TileReader | FeatureReader
    n_tiles: list[int]
    val_inputs: Sequence[Any]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: EpochSchedule
    sync: distributed.StepSync
    main: bool = field(default_factory=distributed.is_main)  # only rank 0 writes the run folder
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    start: int = 0
    monitor: StepMonitor | None = None
    progress: bool = True
    train_seconds: float = 0.0
    val_seconds: float = 0.0
    suggested: bool = False  # the cheaper-validation hint was given

    def optimizer_step(self, info: StepInfo | None = None) -> None:
        """Sum the step's gradients over ranks (under torchrun), clip, step, zero the gradients; record
        the step (``info``: its loss, tiles and data wait, from the epoch) in the run's monitor."""
        self.sync.reduce()
        norm = clip_gradients(self.params, self.method.train.clip_grad_norm)
        if norm is None and self.monitor is not None and self.monitor.enabled:
            norm = gradient_norm(self.params)
        self.schedule.before_step()
        self.optimizer.step()
        # train.bf16: autocast keeps its bfloat16 copies of the weights until its region ends, and the
        # region is the whole epoch; without this every later forward would use the weights the epoch began with
        torch.clear_autocast_cache()
        self.optimizer.zero_grad(set_to_none=True)
        if self.monitor is not None:
            self.monitor.step(info, lr=float(self.optimizer.param_groups[-1]["lr"]), grad_norm=norm)  # the aggregator's rate (the last group)


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
    ``features_dir``: the frozen features of a method whose strategy reads them.
    """
    run_dir = config.run_dir(method.name, seed)
    if (run_dir / DONE).exists():
        return run_dir
    run = _start(config, method, seed, plan, features_dir, device, progress)
    tc = method.train
    epochs = run.bar(range(run.start, tc.epochs), initial=run.start, total=tc.epochs, desc=f"{method.name} seed{seed}", unit="epoch")
    for epoch in epochs:
        interrupt.check()
        if tc.early_stopping_patience and epoch - run.best["epoch"] >= tc.early_stopping_patience:
            log.info("%s: early stopping, no %s improvement since epoch %d", run_dir, run.best["metric"], run.best["epoch"])
            break
        t0 = time.perf_counter()
        _seed_everything(seed, epoch + 1)
        lr = run.schedule.set_epoch(epoch)
        _recalibrate(run, epoch)
        assert run.monitor is not None
        run.monitor.begin_epoch(epoch)
        train_loss, val = _train_and_validate(run, epoch)
        row = {"epoch": epoch + 1, "train_loss": train_loss,
               **{f"val_{k}": val.get(k, math.nan) for k in validation_columns(method.task_key)}}
        row.update(lr=lr, seconds=round(time.perf_counter() - t0, 3), **_epoch_rates(run))
        improved = _record(run, row, val)
        if run.main:
            _checkpoint(run, improved)
            run.monitor.end_epoch(row)
            _log_epoch(run, row, val, epochs)
    if run.monitor is not None:
        run.monitor.close()
    if run.main:  # the best epoch's probability calibration on the validation slides (train.calibrate)
        calibrate_best(run_dir, run.strategy, run.val_inputs, [s.y for s in plan.val_units], config, method, run.device)
    distributed.barrier()
    if run.main:
        if method.name in plan.memory:
            write_memory_record(run_dir, plan.memory[method.name], run.device)
        write_done(run_dir, run.history, run.best)
    return run_dir


def _predict_memory(config: PipelineConfig, method: MethodConfig, plan: RunPlan, device: str | None,
                    *, check: bool) -> MemoryPrediction:
    """The method's predicted peak memory (:mod:`wsi_pipeline.training.memory`), logged; refused when it
    cannot fit and ``check``."""
    from wsi_pipeline.data.bags import TileReader

    dev = distributed.device_for(resolve_device(device or method.train.device))
    train_tiles = TileReader(plan.train_units).n_tiles() if plan.train_units else [0]
    val_tiles = TileReader(plan.val_units).n_tiles() if plan.val_units else [0]
    tile = int((plan.tiling or {}).get("tile_size") or TileReader(plan.train_units).store(0).tile_size)
    with torch.random.fork_rng(devices=[]):
        encoder, aggregator = build_models(method, config.data.n_classes or 2, device="cpu", for_training=False)
        if strategy_traits(method.strategy).big_layers:  # count the plain network: Big-Layers keeps the same activations, on the host
            from wsi_pipeline.models import build_encoder

            encoder = build_encoder(method.encoder.name)
    pred = predict_memory(method, encoder, aggregator, bag_tiles=min(method.train.bag_size, max(train_tiles)),
                          tile_size=tile, val_tiles=max(val_tiles), device=dev, augment=method.train.augment.enabled)
    del encoder, aggregator
    log.info("%s", pred.describe())
    if check:
        check_fits(pred, device=dev)
    return pred


def _epoch_rates(run: _Run) -> dict[str, float]:
    """The epoch's training tiles/s, the share of it the training thread waited for data, the peak
    memory (MiB) and the seconds validation took: ``history.csv`` columns."""
    assert run.monitor is not None
    rates = run.monitor.summary()
    out = {k: round(float(v), 4) for k, v in rates.items() if v == v}
    out["val_seconds"] = round(run.val_seconds, 3)
    return out


def _start(
    config: PipelineConfig, method: MethodConfig, seed: int, plan: RunPlan, features_dir: Path | None,
    device: str | None, progress: bool,
) -> _Run:
    """Build the run's strategy (models seeded from ``seed``), inputs, optimiser and schedule; resume from ``last.pt``."""
    tc = method.train
    distributed.init_from_env()  # under torchrun (no-op when train_pipeline joined already)
    dev = distributed.device_for(resolve_device(device or tc.device))  # cuda:LOCAL_RANK under torchrun
    _seed_everything(seed)
    ctx = plan.stain_ctx
    strategy = build_strategy(method, config.data.n_classes, dev, build_augment(tc.augment, ctx.donors() if ctx else ()),
                              plan.endpoints.get(method.name), stain=ctx)
    # overwritten by last.pt when resuming
    calibrate_encoder(strategy.encoder, method, plan.train, dev, log_level=logging.INFO, stain=ctx)
    reader = strategy.train_reader(plan.train_units, features_dir)
    val_inputs = strategy.val_inputs(plan.val_units, features_dir)
    n_tiles = reader.n_tiles()
    params = strategy.parameters()
    sync = distributed.StepSync(params, strategy.state_modules().values())
    optimizer = build_optimizer(strategy.param_groups(), tc, total_steps=tc.epochs * strategy.epoch_steps(n_tiles))
    run = _Run(
        config=config, method=method, seed=int(seed), plan=plan, run_dir=config.run_dir(method.name, seed), device=dev,
        bar=_bars(progress), strategy=strategy, reader=reader, n_tiles=n_tiles, val_inputs=val_inputs, params=params,
        optimizer=optimizer, schedule=EpochSchedule(optimizer, tc, method.encoder.frozen_epochs), sync=sync,
    )
    run.best = {"metric": selection(tc, config.data.n_classes, method.task_key)[0], "value": None, "epoch": 0}
    last = run.run_dir / "last.pt"
    if last.exists():
        restore = lambda enc, st, info: restore_encoder(method, enc, st, info, where=str(last))  # noqa: E731
        run.history, run.best, run.start = resume(last, strategy.state_modules(), optimizer, run.schedule,
                                                    config=run_config(config, method, seed), restore_encoder=restore)
        log.info("resuming %s after epoch %d", run.run_dir, run.start)
    distributed.broadcast_states(strategy.state_modules().values())  # every rank starts from rank 0's models
    if run.main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(run_config(config, method, seed), run.run_dir / "config.yaml")
        if tc.bf16 and not bf16_active(True, dev):
            log.info("%s: train.bf16 is set, but %s has no native bfloat16 arithmetic (a CPU without AVX-512 BF16 or "
                     "AMX, or Apple MPS): training in float32", run.run_dir, dev)
        if ctx is not None:
            from wsi_pipeline.training.stain import write_run_stain

            write_run_stain(run.run_dir, ctx)
        for name, text in strategy.run_notes(reader, n_tiles).items():  # e.g. the Big-Layers plan
            log.info("%s", text)
            write_text_atomic(run.run_dir / name, text + "\n")
    run.progress = progress
    run.monitor = StepMonitor(run.run_dir, dev, tc.log, enabled=run.main, start_epoch=run.start)
    return run


def _bars(progress: bool) -> Any:
    return lambda *a, **k: progress_bar(*a, enabled=progress, **k)


def _recalibrate(run: _Run, epoch: int) -> None:
    """Re-estimate the encoder's BatchNorm statistics after the first epoch (``encoder.recalibrate_bn``)."""
    encoder = run.strategy.encoder
    if run.method.encoder.recalibrate_bn and epoch > 0 and encoder is not None:
        calibrate_encoder(encoder, run.method, run.plan.train, run.device, stain=run.plan.stain_ctx)
        distributed.broadcast_states([encoder])


def _train_and_validate(run: _Run, epoch: int) -> tuple[float, dict[str, float]]:
    """One training epoch, then validation: ``(mean training loss, validation metrics)``."""
    run.strategy.train()
    with bf16_autocast(run.method.train.bf16, run.device):
        run.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        train_loss = run.strategy.train_epoch(run.reader, run.n_tiles, run.seed, epoch, run.optimizer_step, run.bar, run.sync)
        t1 = time.perf_counter()
        # under torchrun every rank scores its shard of the validation slides; all get the same metrics
        targets = [s.y for s in run.plan.val_units]
        val = validate(run.strategy, run.val_inputs, targets, run.config, run.method, run.device,
                       progress=run.progress and run.main)
        run.train_seconds, run.val_seconds = t1 - t0, time.perf_counter() - t1
        _suggest_cheaper_validation(run)
        return train_loss, distributed.broadcast_object(val)  # rank 0's, so every rank decides alike


def _suggest_cheaper_validation(run: _Run) -> None:
    """Say once per run when validation takes longer than the epoch's training, and what is cheaper."""
    if run.suggested or not run.main or run.val_seconds <= run.train_seconds or run.val_seconds < 30:
        return
    run.suggested = True
    protocol = str(run.method.val_protocol)
    cheaper = (f"val_protocol: sub{min(256, run.method.train.bag_size)}x1 (one random subset of tiles per slide, "
               "as training sees them)") if protocol == "all" else "fewer validation slides"
    log.info("%s: validation took %.0f s, longer than the epoch's training (%.0f s); %s would cut it",
             run.run_dir, run.val_seconds, run.train_seconds, cheaper)


def _record(run: _Run, row: dict[str, Any], val: dict[str, float]) -> bool:
    """Append the epoch's history row and update the best epoch; whether this epoch is the best so far."""
    run.history.append(row)
    metric, higher = selection(run.method.train, run.config.data.n_classes, run.method.task_key)
    value = val.get(metric) if val else None
    loss = val.get("loss") if val else None
    improved = improves(value, loss, run.best, higher) or run.best["epoch"] == 0 or not val
    if improved:
        run.best = {"metric": metric, "value": None if value is None else float(value), "epoch": row["epoch"],
                    "loss": None if loss is None or not math.isfinite(loss) else float(loss)}
    return improved


def _checkpoint(run: _Run, improved: bool) -> None:
    """``history.csv``, ``best.pt`` when ``improved``, then ``last.pt`` (everything needed to resume)."""
    write_history(run.history, run.run_dir / "history.csv")
    models, encoder_info = _model_states(run)
    ckpt = RunCheckpoint.build(
        run_config(run.config, run.method, run.seed), run.method, seed=run.seed, epoch=run.history[-1]["epoch"],
        models=models, endpoint=run.strategy.endpoint, encoder_info=encoder_info, best=run.best, tiling=run.plan.tiling,
        stain_reference=run.plan.stain, stain=run.plan.stain_ctx.state() if run.plan.stain_ctx is not None else None,
    )
    if improved:
        save_run_checkpoint(run.run_dir / "best.pt", ckpt)
    resume = ResumeState(optimizer=run.optimizer.state_dict(), scheduler=run.schedule.state_dict(), rng=capture_rng(),
                         history=run.history)
    save_run_checkpoint(run.run_dir / "last.pt", dataclasses.replace(ckpt, resume=resume))


def _model_states(run: _Run) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's model states and what it records of the encoder
    (:func:`~wsi_pipeline.methods.models.encoder_checkpoint`: a foundation encoder built from a
    weights file keeps only its trained tensors)."""
    models = {name: m.state_dict() for name, m in run.strategy.state_modules().items() if name != "encoder"}
    tile_size = (run.plan.tiling or {}).get("tile_size")
    if tile_size is None and run.plan.train and run.config.data.features is None:  # stores without tiling settings
        from wsi_pipeline.data.store import open_store

        tile_size = open_store(run.plan.train[0].store).tile_size
    models["encoder"], info = encoder_checkpoint(run.method, run.strategy.encoder, tile_size)
    return models, info


def _log_epoch(run: _Run, row: dict[str, Any], val: dict[str, float], epochs: Any) -> None:
    """Log the epoch with the time left (from the epochs this process ran) and update the bar."""
    tc, metric = run.method.train, run.best["metric"]
    value = val.get(metric) if val else None
    done_here = [r["seconds"] for r in run.history[run.start :]]  # epochs run by this process
    left = (tc.epochs - row["epoch"]) * float(np.mean(done_here))
    log.info(
        "%s seed %d epoch %d/%d: train_loss %.4f, val_%s %s, lr %.3g (%.1f s/epoch, ~%s left)",
        run.method.name, run.seed, row["epoch"], tc.epochs, row["train_loss"], metric,
        "n/a" if value is None else f"{value:.4f}", row["lr"], row["seconds"], _duration(left),
    )
    epochs.set_postfix(loss=f"{row['train_loss']:.4f}", **({f"val_{metric}": f"{value:.3f}"} if value is not None else {}))


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"3.2 min"``, ``"1.5 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
