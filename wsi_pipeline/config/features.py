"""The ``features`` section: settings of ``wsi-pipeline features`` (frozen-encoder feature files).

In a YAML file given with ``features --config FILE`` (a pipeline YAML may carry it too)::

    features: {encoder: uni_v1, weights: weights/uni/pytorch_model.bin, batch_size: 128, bf16: true}

Each ``features`` flag sets one key (``--batch-size 128`` is ``--set features.batch_size=128``); the
inputs and outputs (``--manifest``, ``--tiles``, ``--out``) stay flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wsi_pipeline.config.model import check_encoder_name
from wsi_pipeline.config.limits import MAX_CHUNK_TILES
from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.devices import check_device

__all__ = ["FeaturesConfig"]


@dataclass(frozen=True)
class FeaturesConfig(Checked):
    """How tile stores are embedded into feature files.

    Attributes
    ----------
    encoder : tile encoder: a registered name (ResNets, foundation presets) or ``timm:<architecture>``.
    weights : weights file (a torchvision checkpoint, ``imagenet``, or the file a foundation model's
        card publishes); None: randomly initialised (seed 0).
    batch_size : tiles per forward pass (> 0).
    bf16 : embed under bfloat16 autocast (features stored as float32; the precision is recorded).
    device : ``auto``, ``cpu``, ``cuda``, ``cuda:<i>`` or ``mps`` (:data:`wsi_pipeline.devices.DEVICES`).
    """

    encoder: str = field(default="resnet18", metadata=spec(check=check_encoder_name))
    weights: str | None = None
    batch_size: int = field(default=64, metadata=spec(gt=0, le=MAX_CHUNK_TILES))
    bf16: bool = False
    device: str = field(default="auto", metadata=spec(check=check_device))
