"""Tiling: tissue masks, the tile grid, the zarr tile store and the folder runner."""
