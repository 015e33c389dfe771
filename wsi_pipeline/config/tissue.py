"""The ``tissue`` section: settings of ``wsi-pipeline tissue train`` and ``tissue predict`` (the whole-image U-Net).

In a YAML file given with ``tissue train --config FILE`` / ``tissue predict --config FILE``::

    tissue:
      train: {mpp: 2.0, epochs: 20, lr: 1.0e-3, channels: 8, device: cuda}
      predict: {mpp: null, device: cuda}

Each flag sets one key (``tissue train --epochs 5`` is ``--set tissue.train.epochs=5``); the inputs
and outputs (``--slides`` / ``--manifest``, ``--model``, ``--out``) stay flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.devices import check_device

__all__ = ["TissuePredictConfig", "TissueTrainConfig"]


@dataclass(frozen=True)
class TissueTrainConfig(Checked):
    """How the tissue U-Net is trained on whole images, one slide per step.

    Attributes
    ----------
    mpp : working resolution in um/px (> 0).
    size : crop (top-left) or pad every image to (H, W) px, multiples of 32 (the paper: 16000 x 64000);
        None: the whole slide padded to multiples of 32.
    slide_mpp : level-0 um/px (> 0) for slides whose metadata has none (the slide's own value wins).
    epochs : passes over the training slides (> 0).
    lr : Adam learning rate (> 0; the paper: 1e-3).
    seed : seed of the weights, the slide order and a drawn validation split.
    val_fraction : share of slides drawn for validation when the manifest has no split, in [0, 1).
    channels : hidden channels (> 0; 8: 4,409 parameters; the paper: 4,492).
    device : ``cpu``, ``cuda``, ``cuda:<i>``, ``mps`` or ``auto``; it runs the chunks, activations stay in host memory.
    max_elements : device budget of one chunk step in elements (> 0); None: 64 Mi (256 MiB float32).
    """

    mpp: float = field(default=2.0, metadata=spec(gt=0))
    size: tuple[int, int] | None = None
    slide_mpp: float | None = field(default=None, metadata=spec(gt=0))
    epochs: int = field(default=20, metadata=spec(gt=0))
    lr: float = field(default=1e-3, metadata=spec(gt=0))
    seed: int = 0
    val_fraction: float = field(default=0.2, metadata=spec(ge=0, lt=1))
    channels: int = field(default=8, metadata=spec(gt=0))
    device: str = field(default="cpu", metadata=spec(check=check_device))
    max_elements: int | None = field(default=None, metadata=spec(gt=0))


@dataclass(frozen=True)
class TissuePredictConfig(Checked):
    """How tissue masks are predicted.

    Attributes
    ----------
    mpp : working resolution in um/px (> 0); None: the model's.
    slide_mpp : level-0 um/px (> 0) for slides whose metadata has none.
    device : ``cpu``, ``cuda``, ``cuda:<i>``, ``mps`` or ``auto``.
    max_elements : device budget of one chunk step in elements (> 0); None: 64 Mi.
    """

    mpp: float | None = field(default=None, metadata=spec(gt=0))
    slide_mpp: float | None = field(default=None, metadata=spec(gt=0))
    device: str = field(default="cpu", metadata=spec(check=check_device))
    max_elements: int | None = field(default=None, metadata=spec(gt=0))
