"""Keep the slides that tiled: ``manifest folder|split --tiles DIR`` draws splits among them only.

A slide left without usable tiles (skipped by a rule, failed, 0 tiles, damaged or absent store)
drawn into a split is a split one slide short (or, when it was the only test slide, an evaluation
of nothing); drawing splits after tiling, among the slides that have tiles, avoids both.
"""

from __future__ import annotations

import os

import pandas as pd

from wsi_pipeline.data.bags import skipped_by_tiler
from wsi_pipeline.data.store import open_store, store_path

__all__ = ["without_untiled"]


def without_untiled(df: pd.DataFrame, tiles_dir: str | os.PathLike) -> tuple[pd.DataFrame, dict[str, str]]:
    """``df`` without its slides that have no usable tiles in ``tiles_dir``, and ``{slide_id: why}`` of those left out.

    A slide is kept when its store opens (complete, its files present) and holds at least one tile.

    Raises
    ------
    FileNotFoundError : ``tiles_dir`` is not a folder.
    """
    if not os.path.isdir(tiles_dir):
        raise FileNotFoundError(f"--tiles {tiles_dir}: not a folder; pass the --out folder of `wsi-pipeline tile`")
    by_tiler = skipped_by_tiler(tiles_dir)
    out: dict[str, str] = {}
    for sid in df["slide_id"].astype(str):
        if sid in by_tiler:
            out[sid] = by_tiler[sid]
            continue
        try:
            n = len(open_store(store_path(tiles_dir, sid)))
        except (OSError, ValueError) as e:
            out[sid] = f"no usable store ({e})"
            continue
        if n == 0:
            out[sid] = "0 tiles (every tile failed the foreground rule)"
    return df[~df["slide_id"].astype(str).isin(out)].reset_index(drop=True), out
