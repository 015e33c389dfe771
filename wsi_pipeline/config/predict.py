"""The ``predict`` section: settings of ``wsi-pipeline predict`` (new slides, a trained model).

In a YAML file given with ``predict --config FILE`` (a pipeline YAML may carry it too)::

    predict: {protocols: [all, sub256x100], batch_size: 128, mpp: 0.25, heatmap_mode: minmax}

Each ``predict`` flag sets one key (``--seed 3`` is ``--set predict.seed=3``); the model, the slides
and the output folder (``--model``, ``--slides``, ``--out``) stay flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import HeatmapMode
from wsi_pipeline.config.evaluation import ALL, EvalProtocol, parse_protocol_tuple
from wsi_pipeline.config.limits import MAX_CHUNK_TILES, MAX_WORKERS
from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.devices import check_device

__all__ = ["PredictConfig"]


@dataclass(frozen=True)
class PredictConfig(Checked):
    """How new slides are tiled, embedded and scored.

    Attributes
    ----------
    protocols : scoring protocols (``all``, ``sub<k>x<R>``, ``ens<k>x<R>``; default ``[all]``).
    workers : tiling processes (None: one per core; 0: in this process).
    device : ``auto``, ``cpu``, ``cuda``, ``cuda:<i>`` or ``mps``.
    batch_size : tiles per encoder call (> 0; None: the method's ``chunk_size``).
    mpp : level-0 resolution in um/px (> 0) assumed for slides whose files do not record it.
    seed : seed of the random tile subsets of subsample protocols.
    heatmaps : write heatmaps (PNG, GeoJSON, per-tile scores) besides the predictions.
    heatmap_mode : colour normalisation of the heatmaps: ``rank``, ``minmax`` or ``raw``.
    encoder_weights : the base weights file of a fine-tuned foundation encoder, when it is no longer
        where the training config says (its sha256 must match the one recorded at training).
    allow_other_tiling : score stores tiled with other settings than the model's with a warning
        instead of refusing them.
    tissue_model : the tissue model file (``tile --tissue-model``) that tiled the model's training stores, for a
        model trained on ``unet`` stores of a model other than the shipped one; new slides are tiled with it, and a
        file whose fingerprint is not the recorded one is refused (None: the shipped model).
    """

    protocols: tuple[EvalProtocol, ...] = field(default=(ALL,), metadata=spec(parse=parse_protocol_tuple))
    workers: int | None = field(default=None, metadata=spec(ge=0, le=MAX_WORKERS))
    device: str = field(default="auto", metadata=spec(check=check_device))
    batch_size: int | None = field(default=None, metadata=spec(gt=0, le=MAX_CHUNK_TILES))
    mpp: float | None = field(default=None, metadata=spec(gt=0))
    seed: int = 0
    heatmaps: bool = True
    heatmap_mode: HeatmapMode = "rank"
    encoder_weights: str | None = None
    allow_other_tiling: bool = False
    tissue_model: str | None = None

    def keywords(self) -> dict[str, Any]:
        """The settings as keywords of :func:`wsi_pipeline.evaluation.predict.predict_slides`."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
