"""Upper bounds of the user's counts and sizes, beside the lower bounds in each field's :func:`~wsi_pipeline.config.schema.spec`.

A number beyond these is a typo or a unit mistake (``epochs: 1e23``, a tile size in nm), refused when
the config is built with the whole allowed range in the message, instead of an ETA of 10^20 hours
or a store with no tiles. Each bound is far above any real use.
"""

from __future__ import annotations

__all__ = ["MAX_BAG_TILES", "MAX_BATCH_BAGS", "MAX_CHUNK_TILES", "MAX_COUNT", "MAX_EPOCHS", "MAX_TILE_SIZE", "MAX_WORKERS"]

#: Most training epochs (``train.epochs``, warm-up and early-stopping patience).
MAX_EPOCHS = 100_000
#: Largest tile side in pixels (``data.tiling.tile_size``, ``tile --tile-size``): 8192 px is 4 mm at 0.5 um/px.
MAX_TILE_SIZE = 8192
#: Most tiles in a training bag (``train.bag_size``): a whole slide at 20x has well under a million.
MAX_BAG_TILES = 1_000_000
#: Most bags per optimiser step and steps accumulated (``train.batch_bags``, ``train.accumulate_batches``).
MAX_BATCH_BAGS = 10_000
#: Most tiles per encoder call (``methods[].chunk_size``, every stage's ``batch_size``, tiles per level read).
MAX_CHUNK_TILES = 100_000
#: Most tiling or loading processes (``predict.workers``).
MAX_WORKERS = 4096
#: Largest other count of tiles or grid cells (BatchNorm calibration tiles, stain estimate tiles, PatchGD counts,
#: tiles per store shard).
MAX_COUNT = 1_000_000
