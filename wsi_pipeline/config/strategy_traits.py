"""What the layers below training need to know about each training strategy, in one table.

The strategies themselves live in :mod:`wsi_pipeline.training.strategies` (``STRATEGIES``), above
the config, method-model, checkpoint and memory code that also depends on what a strategy does.
Those layers ask :func:`strategy_traits` (``strategy_traits(method.strategy).trains_encoder``) and
never compare a strategy's name with a string; ``tests/project/test_strategy_dispatch.py`` checks
that. The table's keys are the names ``methods[].strategy`` accepts (:func:`strategy_names`), so a new
strategy is its registered class plus one entry here; ``tests/config/test_config_sections.py`` checks
that the registry and this table name the same strategies.

=============  ==============  ==========  ===========  ==========  ==========
strategy       trains_encoder  big_layers  grid_head    embeds_per  device_bag
=============  ==============  ==========  ===========  ==========  ==========
``frozen``     no              no          no           chunk       none
``full``       yes             no          no           bag         float
``accumulate`` yes             no          no           chunk       uint8
``bigl``       yes             yes         no           bag         none
``patchgd``    yes             no          yes          bag         none
=============  ==============  ==========  ===========  ==========  ==========
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.plugins import load_plugins

__all__ = ["DEVICE_BAGS", "EMBEDS_PER", "STRATEGY_TRAITS", "DeviceBag", "EmbedsPer", "StrategyTraits", "grid_head_strategies",
           "strategy_names", "strategy_traits"]

EmbedsPer = Literal["chunk", "bag"]
EMBEDS_PER: tuple[str, ...] = typing.get_args(EmbedsPer)
DeviceBag = Literal["uint8", "float", "none"]
DEVICE_BAGS: tuple[str, ...] = typing.get_args(DeviceBag)


@dataclass(frozen=True)
class StrategyTraits(Checked):
    """The facts about one training strategy that code outside the strategy registry acts on.

    Attributes
    ----------
    trains_encoder : the encoder is trained (False: a frozen encoder, loaded with its weights,
        eval mode and no gradient; the method's features can be read from saved feature files;
        BatchNorm never sees bag statistics).
    big_layers : the encoder is converted to Big-Layers for training (its activations and the
        bag's floats on the host; a plain encoder's checkpoint state converts to it), and embeds
        through :class:`~wsi_pipeline.bigl.EmbeddingEncoder` at inference.
    grid_head : the method trains a PatchGD grid head on one slide's tile grid: its ``patchgd``
        options are parsed and saved in the checkpoint, the head replaces the aggregator, and a
        bag must be one slide (not a patient's slides).
    embeds_per : how many tiles one encoder pass holds activations for in training: ``chunk``
        (``chunk_size`` tiles at a time) or ``bag`` (the whole bag).
    device_bag : what of the bag the GPU holds during a step, besides state and activations:
        ``uint8`` (the bag's tiles, moved once), ``float`` (the bag as a float tensor) or ``none``.
    """

    trains_encoder: bool
    big_layers: bool = False
    grid_head: bool = False
    embeds_per: EmbedsPer = field(default="bag", metadata=spec(choices=EMBEDS_PER))
    device_bag: DeviceBag = field(default="none", metadata=spec(choices=DEVICE_BAGS))


#: Every training strategy's traits, keyed by its ``methods[].strategy`` name (the one list of the strategies; a plugin adds its own entry).
STRATEGY_TRAITS: dict[str, StrategyTraits] = {
    "frozen": StrategyTraits(trains_encoder=False, embeds_per="chunk"),
    "full": StrategyTraits(trains_encoder=True, device_bag="float"),
    "accumulate": StrategyTraits(trains_encoder=True, embeds_per="chunk", device_bag="uint8"),
    "bigl": StrategyTraits(trains_encoder=True, big_layers=True),
    "patchgd": StrategyTraits(trains_encoder=True, grid_head=True),
}


def strategy_traits(name: str) -> StrategyTraits:
    """The traits of strategy ``name``; ``ValueError`` naming the known strategies for another name."""
    if name not in STRATEGY_TRAITS:
        load_plugins()  # a plugin's strategy adds its traits entry when it loads
    try:
        return STRATEGY_TRAITS[name]
    except (KeyError, TypeError):
        raise ValueError(f"strategy={name!r}; expected one of {list(STRATEGY_TRAITS)}") from None


def strategy_names() -> list[str]:
    """Every training strategy (``methods[].strategy``): the keys of :data:`STRATEGY_TRAITS`."""
    load_plugins()
    return list(STRATEGY_TRAITS)


def grid_head_strategies() -> list[str]:
    """The strategies that train a PatchGD grid head (those that take ``patchgd`` options)."""
    return [name for name, traits in STRATEGY_TRAITS.items() if traits.grid_head]
