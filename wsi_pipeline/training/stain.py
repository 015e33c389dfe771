"""The run's stain normalisation: fitted once before training (``data.stain``), saved with every run.

:func:`fit_run_stain` estimates every training slide's stain from its tile store and fits the
target (the training split's medians, or the named reference slide); it is needed when
``data.stain.normalise`` is not ``none`` or a method mixes stains (``train.augment.stain_mix_p``).
:func:`write_run_stain` writes ``stain.json`` (the state every checkpoint also carries, under
``stain``, with ``stain_normalise`` naming the method) and ``stain.csv`` (per training slide:
normalised or the reason it falls back) into a run folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from wsi_pipeline.config.pipeline import MethodConfig, PipelineConfig
from wsi_pipeline.data.stain_slides import StainContext, fit_stain_context
from wsi_pipeline.data.store import store_path
from wsi_pipeline.io_atomic import write_text_atomic

__all__ = ["STAIN_CSV", "STAIN_JSON", "fit_run_stain", "needs_stain", "write_run_stain"]

log = logging.getLogger(__name__)

STAIN_JSON = "stain.json"
STAIN_CSV = "stain.csv"


def needs_stain(config: PipelineConfig, methods: Sequence[MethodConfig]) -> bool:
    """Whether the run needs stain estimates: normalisation, or stain mixing in some method's augmentation."""
    return config.data.stain.normalise != "none" or any(
        m.train.augment.enabled and m.train.augment.stain_mix_p > 0 for m in methods)


def fit_run_stain(config: PipelineConfig, methods: Sequence[MethodConfig], train: Sequence[Any], manifest: pd.DataFrame,
                  *, progress: bool = False) -> StainContext | None:
    """The fitted :class:`~wsi_pipeline.data.stain_slides.StainContext` of a run (None when not needed).

    Raises ``ValueError`` naming ``data.stain.target`` when the reference slide is not in the
    manifest or its stain cannot be estimated, or when no training slide's stain can be.
    """
    if not needs_stain(config, methods):
        return None
    sc = config.data.stain
    target_store = None
    if sc.target != "train":
        if sc.target not in set(manifest["slide_id"].astype(str)):
            raise ValueError(f"data.stain.target={sc.target!r} is not a slide_id of {config.data.manifest}; "
                             "name a slide of the manifest (with a tile store), or use target: train")
        target_store = store_path(config.data.stores_dir(), sc.target)
        if not Path(target_store).exists():
            raise FileNotFoundError(f"data.stain.target={sc.target!r}: its tile store {target_store} does not exist; "
                                    "tile that slide first (wsi-pipeline tile)")
    ctx = fit_stain_context(sc.normalise, sc.target, {s.slide_id: s.store for s in train}, target_store=target_store,
                            max_tiles=sc.max_tiles, progress=progress)
    if sc.normalise != "none":
        log.info("stain: %s normalisation to %s (%d slide(s)), estimates from up to %d tiles per slide", sc.normalise,
                 "the training split's median stain" if sc.target == "train" else f"slide {sc.target}",
                 ctx.normaliser.n_target_slides, sc.max_tiles)
    return ctx


def write_run_stain(run_dir: Path, ctx: StainContext) -> None:
    """``stain.json`` (the normaliser and the training estimates, as in the checkpoint) and ``stain.csv``
    (per training slide: ``slide_id, training, normalise, stain_normalised, stain_problem``), atomically."""
    write_text_atomic(run_dir / STAIN_JSON, json.dumps(ctx.state(), indent=1) + "\n")
    rows = [r for r in ctx.report() if r["training"]]
    cols = ["slide_id", "training", "normalise", "stain_normalised", "stain_problem"]
    write_text_atomic(run_dir / STAIN_CSV, pd.DataFrame(rows, columns=cols).to_csv(index=False))
