"""A trained method loaded from its run folder or checkpoint, ready to embed tiles and aggregate them.

:func:`load_trained_model` reads the checkpoint through :func:`wsi_pipeline.checkpoints.load_run_checkpoint`
(any layout this package wrote, migrated) and rebuilds the encoder and aggregator from the method's config
(:mod:`wsi_pipeline.methods.models`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wsi_pipeline.checkpoints.files import load_run_checkpoint
from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig

__all__ = ["TrainedModel", "load_trained_model"]

log = logging.getLogger(__name__)


@dataclass
class TrainedModel:
    """A trained method, ready to embed tiles and aggregate them.

    Attributes
    ----------
    encoder : the tile encoder in eval mode, ``[B, 3, H, W] -> [B, D]`` (for ``frozen`` methods,
        the frozen encoder that produced the features, so new slides can be embedded).
    aggregator : the MIL aggregator in eval mode, ``[n, D] -> MILOutput`` (for ``patchgd``, the head).
    config : the run's :class:`~wsi_pipeline.config.pipeline.PipelineConfig`.
    method : its :class:`~wsi_pipeline.config.pipeline.MethodConfig`.
    n_classes : C, ``data.n_classes`` (None for survival and regression pipelines).
    tiling : the settings that tiled the training stores (a dict saved at training time: tile
        size, method, thresholds, mpp target, ...), or for checkpoints written before stores
        recorded them, the config's :class:`~wsi_pipeline.config.pipeline.TilingConfig`.
    checkpoint : the file loaded; ``epoch`` and ``seed`` of the run.
    stain_reference : the training tiles' stain summary (:func:`wsi_pipeline.data.stain_stats.stain_reference`),
        or None for checkpoints written without one.
    endpoint : what the model predicts (:class:`~wsi_pipeline.tasks.base.Endpoint`).
    stain : the fitted stain normalisation (a :class:`~wsi_pipeline.data.stain_slides.StainContext`,
        restored exactly from the checkpoint), applied unchanged to every slide ``eval`` and
        ``predict`` score; None when the run did not normalise (nor a checkpoint written before it could).
    """

    encoder: torch.nn.Module
    aggregator: torch.nn.Module
    config: PipelineConfig
    method: MethodConfig
    n_classes: int | None
    tiling: Any
    checkpoint: Path
    epoch: int
    seed: int
    stain_reference: dict | None = None
    endpoint: Any = None
    stain: Any = None

    @property
    def strategy(self) -> str:
        return self.method.strategy


def load_trained_model(
    run_or_checkpoint: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    which: str = "best",
    encoder_weights: str | os.PathLike | None = None,
    expected: PipelineConfig | None = None,
) -> TrainedModel:
    """Rebuild a run's encoder and aggregator from ``runs/<pipeline>/<method>/seed<k>/`` or a ``.pt`` file.

    Parameters
    ----------
    run_or_checkpoint : a run folder (``which`` picks ``best.pt`` or ``last.pt``) or a checkpoint file.
    device : where the models go.
    which : ``best`` or ``last`` (run folders only).
    encoder_weights : the base weights file of a foundation encoder when it is no longer where
        the config says (checkpoints that store only the trained tensors need it; its sha256
        must be the one recorded at training, else ``ValueError``); given for a checkpoint that needs no base
        weights file, ``ValueError`` (it would be ignored).
    expected : the one-method run config the checkpoint is read for (``eval``: the pipeline's run,
        :func:`wsi_pipeline.training.rundir.run_config`); a checkpoint whose saved config differs in a
        model setting (:data:`~wsi_pipeline.config.compare.MODEL_SETTINGS`: its task, tiling, models) is refused
        with a ``ValueError`` naming both values, before any model is built.
    """
    from wsi_pipeline.methods.models import build_models, restore_encoder

    path = Path(run_or_checkpoint)
    if path.is_dir():
        if which not in ("best", "last"):
            raise ValueError(f"which={which!r}; expected 'best' or 'last'")
        path = path / f"{which}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the run has not finished an epoch yet (train it with `wsi-pipeline train`)")
    ckpt = load_run_checkpoint(path)
    config = ckpt.pipeline_config()
    if expected is not None:
        _check_expected(path, config, expected)
    method = ckpt.method_config(config, where=str(path))
    info = ckpt.encoder_info
    endpoint = ckpt.endpoint_spec()
    models = ckpt.models
    build = ckpt.build_method(method, where=str(path))
    if info is not None and info.get("stored") == "trained":
        # only the trained tensors are stored: the rest is the base weights file, checked by its sha256
        weights = encoder_weights or method.encoder.weights
        if not weights or not Path(weights).is_file():
            raise FileNotFoundError(
                f"{path}: its encoder {info.get('name')!r} is stored as the trained tensors only; the rest is the weights file "
                f"{info.get('weights_file')} (sha256 {info.get('weights_sha256')}), not found{'' if not weights else ' at ' + str(weights)}. "
                "Point at it with --encoder-weights FILE"
            )
        build = dataclasses.replace(build, encoder=dataclasses.replace(method.encoder, weights=str(weights)))
    elif encoder_weights is not None:  # asked for, and nothing would read it: refused, never ignored
        raise ValueError(
            f"--encoder-weights {encoder_weights}: {path} needs no base weights file (its encoder "
            f"{method.encoder.name!r} is {'stored whole in it' if models.get('encoder') is not None else 'rebuilt from its config'}, "
            "not as trained tensors over a base file); leave --encoder-weights out")
    elif models.get("encoder") is not None and method.encoder.weights:
        # the checkpoint holds the encoder: the initial weights file is not needed (it may have moved)
        build = dataclasses.replace(build, encoder=dataclasses.replace(method.encoder, weights=None))
    encoder, aggregator = build_models(build, endpoint.n_outputs, device="cpu", for_training=False)
    if models.get("encoder") is not None:
        encoder = restore_encoder(method, encoder, models["encoder"], info, where=str(path))
    aggregator.load_state_dict(models["aggregator"])
    encoder.to(device).eval()
    aggregator.to(device).eval()
    stain = None
    if ckpt.stain is not None:
        from wsi_pipeline.data.stain_slides import StainContext

        try:
            stain = StainContext.from_state(ckpt.stain)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: its stain normalisation cannot be restored ({e})") from e
        if stain.method == "none":
            stain = None  # stain mixing needed estimates at training time; nothing to apply at inference
    return TrainedModel(
        encoder=encoder, aggregator=aggregator, config=config, method=method, n_classes=config.data.n_classes,
        tiling=ckpt.tiling or config.data.tiling, checkpoint=path, epoch=ckpt.epoch, seed=ckpt.seed,
        stain_reference=ckpt.stain_reference, endpoint=endpoint, stain=stain,
    )


def _check_expected(path: Path, saved: PipelineConfig, expected: PipelineConfig) -> None:
    """``ValueError`` naming ``path`` and every model setting in which its saved config differs from ``expected``."""
    from wsi_pipeline.config.compare import config_differences, is_model_setting
    from wsi_pipeline.config.pipeline import config_to_dict

    diff = config_differences(config_to_dict(saved), config_to_dict(expected), keys=is_model_setting,
                              names=("checkpoint", f"pipeline {expected.name}"))
    if diff:
        raise ValueError(
            f"{path} was trained for another task, tiling or model than pipeline {expected.name!r} method "
            f"{expected.methods[0].name!r} ({'; '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}); evaluate it with "
            "the pipeline that trained it, or train this run again")
