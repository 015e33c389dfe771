"""Training strategies: how one bag's loss and gradients are computed. One loop drives them all.

=============  ==============================================================================
``frozen``     aggregator only, on frozen-encoder features: read from h5 files, or with
               augmentation embedded on the fly from augmented tiles (the baselines)
``full``       the whole bag through the encoder with gradient at once (the reference)
``accumulate`` exact gradient accumulation over chunks of the bag (ABMIL-ACC, generalised)
``bigl``       the encoder converted to Big-Layers, the whole bag as one batch
``patchgd``    PatchGD inner iterations on the slide's tile grid (steps the optimiser itself)
=============  ==============================================================================

Every strategy has the same interface (:class:`Strategy`), so the loop never asks which one it
runs: ``train_reader`` / ``val_inputs`` open what its training bags and validation read (tile
stores or frozen features), ``epoch_steps`` counts an epoch's optimiser steps, ``train_epoch``
runs one epoch (:mod:`wsi_pipeline.training.epoch`) and ``embedder`` is the encoder validation
embeds with (None: validation reads features). For the bag strategies ``bag_step(bag, scale)``
ADDS the gradient of ``scale * loss(bag)`` to the parameters' ``.grad`` and returns the bag's
loss, and the loop's ``optimizer_step`` (reduce over ranks, clip, step, zero) follows each group
of bags; PatchGD runs a batch of slides per call and calls ``optimizer_step`` itself.

BatchNorm (``encoder.bn``): ``frozen`` runs BatchNorm on running statistics (exact in every
strategy; the default); ``chunk`` uses batch statistics per chunk (``accumulate``: the ABMIL-ACC
paper's setting, "the paper's, not exact"), which for ``full`` and ``bigl`` is the whole bag;
``train`` is batch statistics of the whole bag (``full``, ``bigl``; rejected by ``accumulate``,
where it could not be exact; ``patchgd``: train mode throughout, the PatchGD paper's). Validation,
evaluation and prediction use running statistics, so training with ``chunk`` or ``train``
warns (:func:`wsi_pipeline.config.pipeline.bag_statistics_warning`): a model can learn the
label from its bags' statistics and fail at evaluation.

The models a strategy trains come from :func:`wsi_pipeline.methods.models.build_models`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from wsi_pipeline.data.augment import SlideAugment, tiles_to_input
from wsi_pipeline.data.bags import Bag, FeatureReader, Slide, TileReader
from wsi_pipeline.data.tensors import DeviceTiles, tiles_to_tensor
from wsi_pipeline.config.choices import ACCUMULATE_BN_MODES, BN_MODES, PATCHGD_BN_MODES
from wsi_pipeline.config.pipeline import MethodConfig
from wsi_pipeline.types import TileStoreLike
from wsi_pipeline.devices import bf16_active
from wsi_pipeline.methods.endpoints import plain_endpoint
from wsi_pipeline.tasks import Endpoint, get_task
from wsi_pipeline.tasks.classification import CLASS_LOSS
from wsi_pipeline.methods.models import embed_budget, build_models
from wsi_pipeline.models import AGGREGATORS
from wsi_pipeline.models.registry import Registry
from wsi_pipeline.training import distributed
from wsi_pipeline.training.epoch import bag_epoch, seed_torch, slide_batch_epoch
from wsi_pipeline.inference.features import LazyFeatures

__all__ = [
    "STRATEGIES",
    "Strategy",
    "build_strategy",
    "check_strategy",
]

log = logging.getLogger(__name__)

STRATEGIES: Registry = Registry("strategy")

# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------


class Strategy:
    """Base class: builds the models and defines how a bag's gradient is computed.

    Attributes
    ----------
    name : registry name.
    input : what a training bag carries: ``"tiles"`` (uint8 tiles), ``"features"`` (frozen
        features) or ``"store"`` (the whole tile store; PatchGD).
    val_input : what validation reads: ``"tiles"`` (tile stores, embedded by :attr:`encoder`)
        or ``"features"`` (the frozen method's h5 files, aggregator only).
    steps_optimizer : True when the strategy steps the optimiser itself (PatchGD).
    uses_features : True when the method reads frozen-encoder feature files, which the loop
        extracts before training (:mod:`wsi_pipeline.training.frozen_features`).
    applies_augment : False when ``train.augment`` is not applied (the loop warns).
    bn_modes : accepted ``encoder.bn`` values.
    classes_only : True when the strategy trains its own cross-entropy on the slide's class (a method whose loss is
        :data:`~wsi_pipeline.tasks.classification.CLASS_LOSS`, ``classification``), not any registered task.
    encoder, aggregator : the models (``aggregator`` is the head for PatchGD).
    endpoint : what the models predict and the loss (:class:`~wsi_pipeline.tasks.base.Endpoint`).

    A loss that couples the bags of a step (``loss: cox``) is trained by :meth:`group_step`
    (three passes, :mod:`wsi_pipeline.training.coupled`): supported by ``frozen``, ``full``,
    ``accumulate`` and ``bigl`` with ``encoder.bn: frozen``; PatchGD trains classification only.
    """

    name: ClassVar[str] = ""
    input: ClassVar[str] = "tiles"
    val_input: ClassVar[str] = "tiles"
    steps_optimizer: ClassVar[bool] = False
    uses_features: ClassVar[bool] = False
    applies_augment: ClassVar[bool] = True
    bn_modes: ClassVar[tuple[str, ...]] = BN_MODES
    classes_only: ClassVar[bool] = False
    augment: SlideAugment | None = None
    #: the fitted stain normalisation (a :class:`~wsi_pipeline.data.stain_slides.StainContext`), or None
    stain: Any = None

    def __init__(self, method: MethodConfig, n_classes: int | None, device: torch.device, endpoint: Endpoint | None = None) -> None:
        self.method = method
        self.endpoint = endpoint or plain_endpoint(method, n_classes)
        self.n_classes = int(self.endpoint.n_outputs)
        self.device = torch.device(device)
        self.encoder, self.aggregator = build_models(method, self.endpoint.n_outputs, device=self.device)

    @classmethod
    def check(cls, method: MethodConfig) -> None:
        """Raise before training if this strategy cannot run ``method`` (missing block, bad option)."""
        if method.encoder.bn not in cls.bn_modes:
            raise ValueError(
                f"method {method.name!r}: encoder.bn={method.encoder.bn!r} is not supported by strategy "
                f"{cls.name!r}; use one of {list(cls.bn_modes)}"
            )
        task = getattr(method, "task_key", "classification")
        kind = get_task(task)
        loss = str(getattr(method, "loss", None) or kind.losses[0])
        # a classes_only block trains its own cross-entropy on the slide's class index: the method's loss must be that one
        on_class = loss == CLASS_LOSS
        if cls.classes_only and not on_class:
            raise ValueError(f"method {method.name!r}: strategy {cls.name!r} trains classification only, not "
                             f"task {task!r}; use frozen, full, accumulate or bigl")
        agg = "" if on_class else method.aggregator.name  # a classification method has any aggregator
        if agg in AGGREGATORS and getattr(AGGREGATORS.get(agg), "classes_only", False):
            raise ValueError(f"method {method.name!r}: the {agg} aggregator trains classification only (its tier-1 loss "
                             f"is a cross-entropy on the slide's class); use abmil or transmil for task {task!r}")
        if kind.coupled(loss):  # the loss compares a step's bags with each other (Cox's risk sets)
            if cls.name != "frozen" and method.encoder.bn != "frozen":
                raise ValueError(f"method {method.name!r}: loss {loss} is trained exactly by re-embedding each bag of the step "
                                 f"(passes 1 and 3 must compute the same function): set encoder.bn: frozen, not "
                                 f"{method.encoder.bn!r}")
            if method.train.bags_per_step < 2:
                raise ValueError(f"method {method.name!r}: loss {loss} compares the bags of an optimiser step with each "
                                 f"other (the risk sets); train.batch_bags x accumulate_batches is "
                                 f"{method.train.bags_per_step}: use at least 2 (README: survival, e.g. 16)")
        enc = method.encoder
        tuning = [k for k, v in (("freeze_blocks", enc.freeze_blocks), ("layer_decay", enc.layer_decay), ("lora", enc.lora),
                                 ("lr_scale", enc.lr_scale != 1.0), ("frozen_epochs", enc.frozen_epochs)) if v]
        if tuning and cls.name == "frozen":
            raise ValueError(
                f"method {method.name!r}: encoder.{tuning[0]} fine-tunes the encoder, but strategy 'frozen' never trains it; "
                "use strategy 'accumulate' (or remove the option)"
            )
        if enc.frozen_epochs and enc.frozen_epochs >= method.train.epochs:
            raise ValueError(f"method {method.name!r}: encoder.frozen_epochs={enc.frozen_epochs} leaves no epoch to train the "
                             f"encoder in (train.epochs={method.train.epochs}); use fewer, or strategy 'frozen'")

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimiser's parameter groups, each with its ``lr_scale`` (its share of the scheduled rate).

        One group when the encoder does not train, or trains at the full rate from the first epoch
        (the same optimiser state as before these settings existed, so older ``last.pt`` files resume).
        Otherwise the encoder's parameters, at scale ``encoder.lr_scale`` and marked ``encoder: True``
        (the schedule holds them at rate 0 for the first ``encoder.frozen_epochs`` epochs), as one
        group or, with ``encoder.layer_decay``, one per encoder layer (timm's layer grouping:
        embeddings, each block, final norm; the layer's decay times ``lr_scale``); then everything
        else at scale 1. Weight decay stays ``train.weight_decay`` for every parameter."""
        enc = self.method.encoder
        if self.encoder not in self.trainable() or not (enc.layer_decay or enc.lr_scale != 1.0 or enc.frozen_epochs):
            return [{"params": self.parameters()}]
        if enc.layer_decay:
            from timm.optim import param_groups_layer_decay

            layers = param_groups_layer_decay(self.encoder.model, weight_decay=self.method.train.weight_decay,
                                              weight_decay_exclude_1d=False, layer_decay=float(enc.layer_decay))
            groups = [{"params": g["params"], "lr_scale": g["lr_scale"] * enc.lr_scale, "encoder": True} for g in layers]
        else:
            groups = [{"params": [p for p in self.encoder.parameters() if p.requires_grad], "lr_scale": enc.lr_scale, "encoder": True}]
        others = [p for m in self.trainable() if m is not self.encoder for p in m.parameters() if p.requires_grad]
        return [g for g in groups if g["params"]] + [{"params": others, "lr_scale": 1.0}]

    def state_modules(self) -> dict[str, nn.Module]:
        """Modules whose state dicts go into checkpoints."""
        return {"encoder": self.encoder, "aggregator": self.aggregator}

    def trainable(self) -> list[nn.Module]:
        """Modules the optimiser trains."""
        return [self.encoder, self.aggregator]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.trainable() for p in m.parameters() if p.requires_grad]

    def train(self) -> None:
        for m in self.trainable():
            m.train()

    def eval(self) -> None:
        self.encoder.eval()
        self.aggregator.eval()

    def embedder(self) -> nn.Module | None:
        """The encoder validation embeds tiles with (eval mode, no gradient); None when it reads features."""
        return self.encoder

    def prepare_bag(self, bag: Bag) -> Any:
        """The bag's input made ready for :meth:`bag_step` in the loader thread, off the training thread
        (``bag.prepared``); no random numbers may be drawn here. None (the default): nothing prepared."""
        return None

    def train_reader(self, slides: Sequence[Slide], features_dir: Path | None = None) -> TileReader | FeatureReader:
        """What the training bags are read from: the slides' tile stores (with their stain normalisation)."""
        return TileReader(slides, self.stain)

    def val_inputs(self, slides: Sequence[Slide], features_dir: Path | None = None) -> Sequence[Any]:
        """What validation reads, one entry per slide: the tile stores (with their stain normalisation)."""
        reader = TileReader(slides, self.stain)
        return [reader.store(i) for i in range(len(slides))]

    def epoch_steps(self, n_tiles: list[int]) -> int:
        """Optimiser steps of one epoch over slides of ``n_tiles`` tiles (one per group of bags)."""
        return math.ceil(len(n_tiles) / self.method.train.bags_per_step)

    def train_epoch(
        self,
        reader: TileReader | FeatureReader,
        n_tiles: list[int],
        seed: int,
        epoch: int,
        optimizer_step: Callable[..., None],
        bar: Any,
        sync: distributed.StepSync | None = None,
    ) -> float:
        """One epoch of bags (:func:`~wsi_pipeline.training.epoch.bag_epoch`); returns the mean bag loss."""
        return bag_epoch(self, reader, n_tiles, self.method.train, seed, epoch, optimizer_step, bar, sync)

    def _bn(self) -> str:
        """``encoder.bn`` as the accumulate module's policy names it."""
        return "frozen" if self.method.encoder.bn == "frozen" else "chunk"

    def _prep_device(self) -> torch.device:
        """Where a host-resident bag is converted: the device when augmenting or stain-normalising (fast), else
        the host (no round trip)."""
        normalising = self.stain is not None and self.stain.method != "none"
        return self.device if self.augment is not None or normalising else torch.device("cpu")

    def _loss_fn(self, scale: float) -> Callable[[Any, Any], torch.Tensor]:
        """The bag loss (the endpoint's; cross-entropy for classification) times ``scale``; ``label`` is the slide's target."""
        return lambda output, label: self.endpoint.bag_loss(output, label) * scale

    def bag_step(self, bag: Bag, scale: float) -> float:
        """Add the gradient of ``scale * loss(bag)`` to ``.grad``; return the (unscaled) loss."""
        raise NotImplementedError

    def run_notes(self, reader: Any, n_tiles: Sequence[int]) -> dict[str, str]:
        """Files (name -> text) the loop logs and writes into the run folder before training (none by default)."""
        return {}

    # -- losses that couple the bags of a step (Cox) ---------------------------------------------

    def coupled_input(self, bag: Bag) -> torch.Tensor:
        """The encoder input of ``bag`` for :meth:`group_step` (normalised, augmented tiles)."""
        raise NotImplementedError(f"strategy {self.name!r} does not train losses that couple bags (loss: cox)")

    def coupled_encoder(self) -> tuple[nn.Module, int | None]:
        """The encoder :meth:`group_step` embeds with and its tiles per call (None: a bag at once)."""
        return self.encoder, None

    def group_step(self, bags: Sequence[tuple[int, Bag]], seed: int, epoch: int) -> float:
        """Add the exact gradient of the step's coupled loss (``loss: cox``) over ``bags`` (``(bag number, bag)``)
        to ``.grad`` by three passes (:func:`~wsi_pipeline.training.coupled.coupled_step`); return the loss.

        Each bag's input is made after seeding torch with ``(seed, epoch, bag number)``, as :func:`bag_epoch`
        seeds a bag, so augmentation draws what it draws for that bag in any strategy.
        """
        from wsi_pipeline.training.coupled import coupled_step

        def maker(number: int, bag: Bag) -> Callable[[], torch.Tensor]:
            def make() -> torch.Tensor:
                seed_torch(seed, epoch, number)
                return self.coupled_input(bag)
            return make

        encoder, chunk = self.coupled_encoder()
        return coupled_step(encoder, self.aggregator, [maker(b, bag) for b, bag in bags], [bag.slide.y for _, bag in bags],
                            self.endpoint.group_loss, chunk)


@STRATEGIES.register("frozen")
class FrozenStrategy(Strategy):
    """The aggregator on frozen-encoder embeddings; only the aggregator trains.

    Without augmentation a training bag carries the slide's precomputed features (h5 files,
    :mod:`wsi_pipeline.inference.features`). With augmentation (the Baseline-Aug rows of the
    Big-Layers paper) a training bag carries its uint8 tiles instead: they are augmented with
    one draw of parameters per bag and embedded on the fly by the frozen encoder (eval mode,
    no gradient, ``chunk_size`` tiles at a time), see :meth:`embed`. Validation reads the
    unaugmented h5 features in both cases.
    """

    name = "frozen"
    val_input = "features"
    uses_features = True

    @property
    def input(self) -> str:  # type: ignore[override]
        """``"tiles"`` when augmenting (embedded on the fly), else ``"features"`` (h5 files)."""
        return "features" if self.augment is None else "tiles"

    def trainable(self) -> list[nn.Module]:
        return [self.aggregator]

    def embedder(self) -> None:
        """None: validation reads the h5 features (the aggregator only)."""
        return None

    def _feature_paths(self, slides: Sequence[Slide], features_dir: Path | None) -> list[Any]:
        """One feature file per slide; for a patient bag the list of its slides' files."""
        from wsi_pipeline.data.feature_formats import feature_file

        if features_dir is None:
            raise ValueError(f"method {self.method.name!r} is frozen: pass the folder of its feature files (features_dir)")
        return [[feature_file(features_dir, p.slide_id) for p in s.parts] if s.parts else feature_file(features_dir, s.slide_id)
                for s in slides]

    def train_reader(self, slides: Sequence[Slide], features_dir: Path | None = None) -> TileReader | FeatureReader:
        """The slides' feature files, or their tile stores when augmenting (embedded on the fly)."""
        if self.augment is not None:
            return TileReader(slides, self.stain)
        from wsi_pipeline.inference.features import read_features

        return FeatureReader(slides, self._feature_paths(slides, features_dir), read_features)

    def val_inputs(self, slides: Sequence[Slide], features_dir: Path | None = None) -> Sequence[Any]:
        """The slides' (unaugmented) feature files, read one at a time."""
        return LazyFeatures(self._feature_paths(slides, features_dir))

    def embed(self, tiles: np.ndarray | torch.Tensor, stain: Any = None) -> torch.Tensor:
        """Embed a bag's tiles with the frozen encoder after one augmentation draw for the whole bag.

        Parameters
        ----------
        tiles : uint8 (k, T, T, 3) RGB tiles of one bag.
        stain : the slide's stain normalisation (``bag.stain``), applied before the augmentation.

        Returns
        -------
        tensor (k, D) of torch's default dtype (float32) on the strategy's device, without gradient: the encoder (eval
        mode) applied to the augmented, normalised tiles, ``chunk_size`` tiles at a time.
        Without augmentation it is the embedding the h5 features hold.
        """
        params = self.augment.draw() if self.augment is not None else None
        chunk = int(self.method.chunk_size)
        self.encoder.eval()  # frozen: running BatchNorm statistics, no dropout, whatever the loop set
        parts = []
        with torch.no_grad():
            for a in range(0, len(tiles), chunk):
                x = tiles_to_input(tiles[a : a + chunk], self.augment, params, device=self.device, stain=stain)
                parts.append(self.encoder(x).to(torch.get_default_dtype()))
        return torch.cat(parts)

    def bag_step(self, bag: Bag, scale: float) -> float:
        from wsi_pipeline.training.accumulate import full_step

        if self.augment is None:
            feats = torch.as_tensor(np.asarray(bag.data), dtype=torch.get_default_dtype(), device=self.device)
        else:
            feats = self.embed(bag.data, bag.stain)
        # the features are the encoder's output, so an identity encoder gives the aggregator's exact step
        loss = full_step(nn.Identity(), self.aggregator, feats, bag.slide.y, loss_fn=self._loss_fn(scale))
        return loss / scale

    def coupled_input(self, bag: Bag) -> torch.Tensor:
        """The bag's features (read, or embedded from augmented tiles)."""
        if self.augment is None:
            return torch.as_tensor(np.asarray(bag.data), dtype=torch.get_default_dtype(), device=self.device)
        return self.embed(bag.data, bag.stain)

    def coupled_encoder(self) -> tuple[nn.Module, int | None]:
        return nn.Identity(), None


@STRATEGIES.register("full")
class FullStrategy(Strategy):
    """The whole bag through the encoder with gradient at once (needs memory for all its activations)."""

    name = "full"

    def prepare_bag(self, bag: Bag) -> Any:
        return prepare_tiles(self, bag, device_side=True)

    def bag_step(self, bag: Bag, scale: float) -> float:
        from wsi_pipeline.training.accumulate import full_step

        prepared = bag.prepared
        if prepared is None:
            tiles = tiles_to_input(bag.data, self.augment, device=self.device, stain=bag.stain)
        elif prepared.dtype == torch.uint8:  # pinned uint8: a quarter of the bytes, converted on the device
            tiles = tiles_to_tensor(prepared.to(self.device, non_blocking=True), stain=bag.stain)
        else:
            tiles = prepared.to(self.device)
        loss = full_step(self.encoder, self.aggregator, tiles, bag.slide.y, loss_fn=self._loss_fn(scale), bn=self._bn())
        return loss / scale

    def coupled_input(self, bag: Bag) -> torch.Tensor:
        return tiles_to_input(bag.data, self.augment, device=self.device, stain=bag.stain)


@STRATEGIES.register("accumulate")
class AccumulateStrategy(Strategy):
    """Exact accumulation: the bag stays in host memory, ``chunk_size`` tiles go through the encoder at a time."""

    name = "accumulate"
    bn_modes = ACCUMULATE_BN_MODES

    def prepare_bag(self, bag: Bag) -> Any:
        return prepare_tiles(self, bag, device_side=True)

    def bag_step(self, bag: Bag, scale: float) -> float:
        from wsi_pipeline.training.accumulate import accumulate_step

        chunk = self.method.chunk_size
        prepared = bag.prepared
        tiles: torch.Tensor | DeviceTiles
        if prepared is None:
            tiles = tiles_to_input(bag.data, self.augment, device=self._prep_device(), out_device="cpu", chunk=chunk,
                                   stain=bag.stain)
        elif prepared.dtype == torch.uint8:  # the uint8 bag goes to the device once; each chunk is converted there
            tiles = DeviceTiles(prepared.to(self.device, non_blocking=True), self.device, stain=bag.stain)
        else:  # converted on the host by the loader thread
            tiles = prepared
        loss = accumulate_step(
            self.encoder, self.aggregator, tiles, bag.slide.y, chunk, loss_fn=self._loss_fn(scale), bn=self._bn()
        )
        return loss / scale

    def coupled_input(self, bag: Bag) -> torch.Tensor:
        """The bag's tiles on the host; ``chunk_size`` of them go to the device at a time."""
        return tiles_to_input(bag.data, self.augment, device=self._prep_device(), out_device="cpu", chunk=self.method.chunk_size,
                              stain=bag.stain)

    def coupled_encoder(self) -> tuple[nn.Module, int | None]:
        return self.encoder, int(self.method.chunk_size)


@STRATEGIES.register("bigl")
class BiglStrategy(Strategy):
    """The encoder converted to Big-Layers; the whole bag is one batch whose big activations live in host memory."""

    name = "bigl"

    @classmethod
    def check(cls, method: MethodConfig) -> None:
        super().check(method)
        if method.encoder.foundation:
            raise ValueError(
                f"method {method.name!r}: strategy 'bigl' needs a CNN encoder (resnet18/34/50): Big-Layers splits the "
                f"large early convolution activations of a whole-bag batch by rows, and a ViT such as "
                f"{method.encoder.name!r} has none (its first layer is a patch embedding, its memory grows with the "
                "tiles embedded at once). Train it with strategy 'accumulate', whose memory is set by chunk_size"
            )
        from wsi_pipeline.models.encoders import is_resnet

        if not is_resnet(method.encoder.name):
            raise ValueError(
                f"method {method.name!r}: strategy 'bigl' converts ResNets (resnet18/34/50) to Big-Layers; encoder "
                f"{method.encoder.name!r} is not one (a small patch network's activations fit in memory whole): train it "
                "end to end with strategy 'full' or 'accumulate'"
            )

    def _prep_device(self) -> torch.device:
        """Always the host: the tiles stay there until the first Big-Layer takes its chunks."""
        return torch.device("cpu")

    def embedder(self) -> nn.Module:
        """Validation's encoder: plain on the device when a call fits ``bigl.embed_budget_mib``, else Big-Layers."""
        from wsi_pipeline.bigl import EmbeddingEncoder

        if getattr(self, "_embedder", None) is None:
            self._embedder = EmbeddingEncoder.from_big(self.encoder, budget_bytes=embed_budget(self.method))
        return self._embedder

    def run_notes(self, reader: Any, n_tiles: Sequence[int]) -> dict[str, str]:
        """``bigl_plan.txt``: where the largest training bag's activations live (the device-budget plan, or the fixed plan)."""
        from wsi_pipeline.bigl import BudgetResNet

        if not n_tiles or not hasattr(reader, "store"):
            return {}
        tile = int(reader.store(0).tile_size)
        shape = (min(int(self.method.train.bag_size), max(n_tiles)), 3, tile, tile)
        enc = self.encoder
        if isinstance(enc, BudgetResNet):
            cast = torch.bfloat16 if bf16_active(self.method.train.bf16, self.device) else None
            text = enc.describe(shape, torch.float32, cast=cast, grad=True)
        else:
            text = (f"Big-Layers plan (input {list(shape)}): the fixed plan, the stem and {self.method.bigl.stages} residual "
                    f"stage(s) offloaded layer by layer in chunks of at most {self.method.bigl.max_elements} elements "
                    f"(bigl.device_budget_gb: {self.method.bigl.device_budget_gb!r}"
                    + ("; on the CPU 'auto' sets no budget" if self.method.bigl.device_budget_gb == "auto" else "") + ")")
        return {"bigl_plan.txt": text}

    def bag_step(self, bag: Bag, scale: float) -> float:
        from wsi_pipeline.training.accumulate import full_step

        tiles = bag.prepared
        if tiles is None:
            tiles = tiles_to_input(bag.data, self.augment, device=self._prep_device(), out_device="cpu",
                                   chunk=self.method.chunk_size, stain=bag.stain)
        loss = full_step(self.encoder, self.aggregator, tiles, bag.slide.y, loss_fn=self._loss_fn(scale), bn=self._bn())
        return loss / scale

    def prepare_bag(self, bag: Bag) -> Any:
        return prepare_tiles(self, bag, device_side=False)  # the tiles stay on the host for the Big-Layers

    def coupled_input(self, bag: Bag) -> torch.Tensor:
        """The bag's tiles on the host (the Big-Layers encoder takes the whole bag as one batch)."""
        return tiles_to_input(bag.data, self.augment, device=self._prep_device(), out_device="cpu", chunk=self.method.chunk_size,
                              stain=bag.stain)


@STRATEGIES.register("patchgd")
class PatchGDStrategy(Strategy):
    """PatchGD (:mod:`wsi_pipeline.training.patchgd`): inner iterations over the whole slide, own optimiser steps."""

    name = "patchgd"
    input = "store"
    steps_optimizer = True
    applies_augment = False
    bn_modes = PATCHGD_BN_MODES
    classes_only = True

    def __init__(self, method: MethodConfig, n_classes: int | None, device: torch.device, endpoint: Endpoint | None = None) -> None:
        super().__init__(method, n_classes, device, endpoint)
        from wsi_pipeline.training.patchgd import PatchGDTrainer

        self.impl = PatchGDTrainer(method.patchgd_config, self.encoder, self.aggregator, n_classes)

    @classmethod
    def check(cls, method: MethodConfig) -> None:
        super().check(method)
        _ = method.patchgd_config  # parsed (and checked) once per method config

    @property
    def slides_per_batch(self) -> int:
        """Slides per PatchGD inner loop (``patchgd.slides_per_batch``); the loop hands over groups of this many."""
        return int(self.impl.cfg.slides_per_batch)

    def optimizer_steps(self, n_tiles: int) -> int:
        """Optimiser steps :meth:`run_bag` takes on a slide of ``n_tiles`` tiles."""
        from wsi_pipeline.training.patchgd_plan import accumulation_windows

        cfg = self.impl.cfg
        zeta = cfg.inner_iterations(n_tiles)
        return len(accumulation_windows(zeta, cfg.epsilon if cfg.epsilon is not None else zeta, cfg.partial_window))

    def epoch_steps(self, n_tiles: list[int]) -> int:
        """Optimiser steps of one epoch over slides of ``n_tiles`` tiles: exact with one slide per
        batch; with several, the most the randomly formed batches can take (a batch's zeta is its
        largest slide's)."""
        per = self.slides_per_batch
        if per == 1:
            return sum(self.optimizer_steps(n) for n in n_tiles)
        return -(-len(n_tiles) // per) * max(self.optimizer_steps(n) for n in n_tiles)

    def train_epoch(
        self,
        reader: TileReader | FeatureReader,
        n_tiles: list[int],
        seed: int,
        epoch: int,
        optimizer_step: Callable[[], None],
        bar: Any,
        sync: distributed.StepSync | None = None,
    ) -> float:
        """One epoch of slide batches (:func:`~wsi_pipeline.training.epoch.slide_batch_epoch`); returns the mean batch loss."""
        if not isinstance(reader, TileReader):
            raise TypeError(f"method {self.method.name!r}: PatchGD trains on tile stores (a TileReader); got {type(reader).__name__}")
        return slide_batch_epoch(self, reader, n_tiles, seed, epoch, optimizer_step, bar)

    def run_bag(self, store: TileStoreLike, label: int, optimizer_step: Callable[[], None], generator: torch.Generator) -> float:
        """One slide of PatchGD; ``optimizer_step`` steps and zeroes the gradients."""
        return self.impl.bag_step(store, label, optimizer_step, generator)

    def run_batch(self, stores: list[Any], labels: list[int], optimizer_step: Callable[[], None], generator: torch.Generator,
                  *, part: list[int] | None = None) -> float:
        """A batch of slides through one PatchGD inner loop (:meth:`PatchGDTrainer.batch_step`);
        ``part``: this rank's positions of the batch under torchrun."""
        return self.impl.batch_step(stores, labels, optimizer_step, generator, part=part)


def check_strategy(method: MethodConfig) -> type[Strategy]:
    """The strategy class of ``method``; raises ``ValueError`` listing the valid strategies when unknown,
    ``ValueError`` for an unsupported option."""
    try:
        cls = STRATEGIES.get(method.strategy)
    except ValueError:
        raise ValueError(
            f"method {method.name!r}: unknown strategy {method.strategy!r}; valid strategies: {STRATEGIES.names()}"
        ) from None
    cls.check(method)
    return cls


def prepare_tiles(strategy: Strategy, bag: Bag, *, device_side: bool) -> torch.Tensor | None:
    """What the loader thread makes of a bag of tiles for ``strategy`` (its ``prepare_bag``).

    None when the bag is augmented (its draw belongs to the training thread, seeded per bag) or holds
    features. Otherwise, with ``device_side`` and a CUDA device: the uint8 tiles in pinned memory,
    sent asynchronously and converted on the device (a quarter of float32's bytes); else the float
    input on the host (:func:`~wsi_pipeline.data.tensors.tiles_to_tensor`, the same values the
    training thread would compute), so the training thread never converts.
    """
    data = bag.data
    if strategy.augment is not None or not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        return None
    if device_side and strategy.device.type == "cuda":
        return torch.from_numpy(np.ascontiguousarray(data)).pin_memory()
    return tiles_to_tensor(data, stain=bag.stain)


def build_strategy(method: MethodConfig, n_classes: int | None, device: torch.device | str, augment: SlideAugment | None = None,
                   endpoint: Endpoint | None = None, *, stain: Any = None) -> Strategy:
    """Build the strategy of ``method`` with its models on ``device`` (initialised from torch's global RNG);
    ``endpoint``: the method's, fitted on the training split (default: the config's, for classification and Cox);
    ``stain``: the fitted :class:`~wsi_pipeline.data.stain_slides.StainContext` its tiles go through."""
    cls = check_strategy(method)
    strategy = cls(method, n_classes, torch.device(device), endpoint)
    strategy.augment = augment
    strategy.stain = stain
    return strategy

