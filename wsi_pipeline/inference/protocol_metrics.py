"""Validation of a model on labelled slides: per-slide predictions under a protocol, then metrics.

``validate_model(encoder, aggregator, slides, labels, protocol="all", *, n_classes,
device=None, batch_size=64, seed=0, progress=False, slide_ids=None) -> dict[str, float]``

``slides`` holds, per slide, a :class:`~wsi_pipeline.data.store.TileStore`, a store path, or
precomputed embeddings (a Tensor [N, D], or a tuple ``(z, grid)``) when the encoder is frozen
(then ``encoder`` may be None). The result has the keys of
:func:`~wsi_pipeline.tasks.metrics.compute_metrics` plus ``loss`` (mean cross-entropy of
the slide probabilities, natural log); for a per-repeat protocol every value is the mean over
repeats (the checkpoint criterion the paper uses) and ``<metric>_repeat_std`` is added. Both
modules are put in eval mode for the call and their previous train/eval mode is restored
afterwards; no gradient is recorded.

The protocols themselves (subset drawing, embedding, per-slide prediction) are in
:mod:`wsi_pipeline.inference.protocols`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from wsi_pipeline.data.store import TileStore, open_store
from wsi_pipeline.tasks import Endpoint
from wsi_pipeline.config.evaluation import EvalProtocol, parse_protocol
from wsi_pipeline.inference.protocols import (
    SlidePrediction, embed_slide, predict_slide, protocol_rng, slide_embedding, subset_indices,
)
from wsi_pipeline.progress import progress_bar

__all__ = ["endpoint_validation_metrics", "slide_predictions", "validation_metrics", "validate_model"]


def slide_predictions(
    encoder: nn.Module | None,
    aggregator: nn.Module,
    slides: Sequence[TileStore | str | os.PathLike | Tensor | tuple[Tensor, Any]],
    protocol: EvalProtocol | str = "all",
    *,
    n_classes: int,
    device: torch.device | str | None = None,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
    slide_ids: Sequence[str] | None = None,
    positions: Sequence[int] | None = None,
) -> list[SlidePrediction]:
    """Each slide embedded once and scored under ``protocol`` (subsets seeded per slide, so the
    prediction of a slide does not depend on which other slides are scored with it); under a
    subsample protocol only the tiles of its subsets are embedded.

    ``positions`` are the slides' places in the whole validation set (default ``0..n-1``): they
    key the subsets of precomputed embeddings (``#<position>``) when ``slide_ids`` is not given,
    so a rank scoring a shard of the slides draws what one process scoring them all draws.
    Other parameters as :func:`validate_model`.
    """
    prot = parse_protocol(protocol)
    where = list(range(len(slides))) if positions is None else [int(i) for i in positions]
    if len(where) != len(slides):
        raise ValueError(f"slide_predictions: {len(slides)} slides but {len(where)} positions")
    preds: list[SlidePrediction] = []
    items: Any = enumerate(slides)
    if progress:
        items = progress_bar(items, total=len(slides), desc="validate", unit="slide", leave=False)
    for i, slide in items:
        if isinstance(slide, (str, os.PathLike)):
            slide = open_store(slide)
        # subsets are keyed by slide id (stores) or position (embeddings), stable across epochs
        if slide_ids is not None:
            sid = str(slide_ids[i])
        else:
            sid = slide.slide_id if isinstance(slide, TileStore) else f"#{where[i]}"
        if isinstance(slide, TileStore) and encoder is not None and prot.k is not None and prot.k < len(slide):
            z, grid = _subset_embedding(encoder, slide, prot, protocol_rng(seed, sid, prot), batch_size, device)
        else:
            z, grid = slide_embedding(encoder, slide, batch_size=batch_size, device=device)
        pred = predict_slide(aggregator, z, grid, prot, protocol_rng(seed, sid, prot), with_attention=False)
        if pred.probs.shape != (n_classes,):
            raise ValueError(f"aggregator returned {pred.probs.shape[0]} classes; n_classes={n_classes}")
        preds.append(pred)
    return preds


def _subset_embedding(encoder: nn.Module, store: TileStore, prot: EvalProtocol, generator: np.random.Generator,
                      batch_size: int, device: torch.device | str | None) -> tuple[Tensor, np.ndarray | None]:
    """The embeddings a subsample protocol reads: only the tiles of its subsets are embedded (the
    subsets :func:`predict_slide` draws from a generator seeded like ``generator``); the other rows
    are zero and never read. A 512-tile validation subset of a 5,500-tile slide embeds 512 tiles."""
    needed = np.unique(np.concatenate(subset_indices(len(store), prot, generator)))
    zs = embed_slide(encoder, store, batch_size=batch_size, device=device, indices=needed)
    z = zs.new_zeros((len(store), zs.shape[1]))
    z[torch.as_tensor(needed)] = zs
    return z, store.grid


def validation_metrics(labels: Sequence[int], preds: Sequence[SlidePrediction], protocol: EvalProtocol | str,
                       n_classes: int) -> dict[str, float]:
    """The metrics :func:`validate_model` returns (a classifier of ``n_classes``), from every slide's prediction
    (in the order of ``labels``): :meth:`Classification.validation_values
    <wsi_pipeline.tasks.classification.Classification.validation_values>`."""
    return endpoint_validation_metrics(Endpoint(n_outputs=int(n_classes)), labels, preds, protocol)


def endpoint_validation_metrics(endpoint: Any, targets: Sequence[Any], preds: Sequence[SlidePrediction],
                                protocol: EvalProtocol | str) -> dict[str, float]:
    """Validation values of a model of any task (the task's ``validation_metrics``; :meth:`Task.validation_values
    <wsi_pipeline.tasks.base.Task.validation_values>`): classification the class metrics and the cross-entropy of
    the slide probabilities; survival ``c_index`` (Harrell's) and ``loss`` (the training loss over all validation
    slides: Cox with every slide in one risk set, or the mean discrete-time NLL); regression ``rmse``, ``mae``,
    ``pearson``, ``spearman`` and ``loss`` (the training loss, standardised units). For a per-repeat protocol each is
    the mean over repeats of its value on that repeat's outputs."""
    return endpoint.definition.validation_values(endpoint, targets, preds, parse_protocol(protocol))


def validate_model(
    encoder: nn.Module | None,
    aggregator: nn.Module,
    slides: Sequence[TileStore | str | os.PathLike | Tensor | tuple[Tensor, Any]],
    labels: Sequence[int],
    protocol: EvalProtocol | str = "all",
    *,
    n_classes: int,
    device: torch.device | str | None = None,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
    slide_ids: Sequence[str] | None = None,
) -> dict[str, float]:
    """Validation metrics of a model on labelled slides (the training loop's checkpoint criterion).

    Parameters
    ----------
    encoder : tile encoder, or None when ``slides`` are precomputed embeddings.
    aggregator : MIL aggregator (or grid head with ``needs_grid``).
    slides : per slide a TileStore, a store path, a Tensor [N, D] or ``(z, grid)``.
    labels : int class per slide, same order.
    protocol : test-time protocol (``"all"``, ``"sub256x100"``, ``"ens256x100"`` or a EvalProtocol);
        subsets are seeded per slide by ``seed`` (see :func:`protocol_rng`), so every epoch
        sees the same subsets.
    n_classes : C.
    device : where the encoder runs (default: where its parameters are).
    batch_size : tiles per encoder call.
    progress : tqdm bar over slides.
    slide_ids : ids keying each slide's subsets (default: the store's slide id, or ``#<i>`` for
        precomputed embeddings); pass them with embeddings to draw the subsets evaluation draws.

    Returns
    -------
    dict: ``qwk``, ``accuracy``, ``balanced_accuracy``, ``auc``, ``n_slides`` (see
    :func:`~wsi_pipeline.tasks.metrics.compute_metrics`) and ``loss`` (mean cross-entropy
    of the slide probabilities, natural log, probabilities clipped at 1e-7). For ``all`` and an
    ensemble protocol they are computed on the (mean) slide probabilities; for a per-repeat
    protocol (``sub<k>x<R>``, the papers' validation with the test sampling) each is the mean over
    repeats of its value on that repeat's predictions, with ``<metric>_repeat_std`` (std over
    repeats, ddof 1) and ``n_repeats`` added.
    """
    if len(slides) != len(labels):
        raise ValueError(f"validate_model: {len(slides)} slides but {len(labels)} labels; give one label per slide")
    preds = slide_predictions(encoder, aggregator, slides, protocol, n_classes=n_classes, device=device,
                              batch_size=batch_size, seed=seed, progress=progress, slide_ids=slide_ids)
    return validation_metrics(labels, preds, protocol, n_classes)
