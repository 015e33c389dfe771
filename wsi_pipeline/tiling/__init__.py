"""Tiling: tissue masks, the tile grid, the zarr tile store and the folder runner.

Importing this package registers the JPEG tile codec with zarr, so stores written with
``compression="jpeg"`` open wherever :mod:`wsi_pipeline.tiling.store` is imported.
"""

from wsi_pipeline.tiling.codecs import register_codecs as _register_codecs

_register_codecs()
