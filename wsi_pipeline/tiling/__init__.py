"""Tiling: tissue masks, the tile grid, tile decoding and the folder runner (the store format: :mod:`wsi_pipeline.data.store`)."""
