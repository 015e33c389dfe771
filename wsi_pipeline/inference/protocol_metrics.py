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

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from wsi_pipeline.data.store import TileStore, open_store
from wsi_pipeline.tasks.metrics import compute_metrics, compute_repeat_metrics
from wsi_pipeline.config.evaluation import EvalProtocol, parse_protocol
from wsi_pipeline.inference.protocols import (
    SlidePrediction, embed_slide, predict_slide, protocol_rng, repeat_probs, slide_embedding, subset_indices,
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
    """The metrics :func:`validate_model` returns, from every slide's prediction (in the order of ``labels``)."""
    prot = parse_protocol(protocol)
    y = np.asarray([int(v) for v in labels], dtype=np.int64)
    if len(preds) != len(y):
        raise ValueError(f"validation_metrics: {len(preds)} predictions but {len(y)} labels")
    if prot.per_repeat:
        stack = repeat_probs(list(preds), prot.repeats) if len(preds) else np.zeros((prot.repeats, 0, n_classes))
    else:
        stack = np.stack([p.probs for p in preds])[None] if len(preds) else np.zeros((1, 0, n_classes))
    if not prot.per_repeat:
        out = compute_metrics(y, stack[0], n_classes)
    else:
        rm = compute_repeat_metrics(y, stack, n_classes)
        out = {**rm.mean, **{f"{m}_repeat_std": v for m, v in rm.std.items()}}
    if len(y):
        # per repeat (one repeat for all/ensemble), then the mean over repeats
        ce = -np.log(np.clip(stack[:, np.arange(len(y)), y], 1e-7, None))
        out["loss"] = float(ce.mean())
    else:
        out["loss"] = math.nan
    return out


def endpoint_validation_metrics(endpoint: Any, targets: Sequence[Any], preds: Sequence[SlidePrediction],
                                protocol: EvalProtocol | str) -> dict[str, float]:
    """Validation values of a survival or regression model (the task's ``validation_metrics``).

    Survival: ``c_index`` (Harrell's) and ``loss`` (the training loss over all validation slides:
    Cox with every slide in one risk set, or the mean discrete-time NLL); regression: ``rmse``,
    ``mae``, ``pearson``, ``spearman`` and ``loss`` (the training loss, standardised units). For a
    per-repeat protocol each is the mean over repeats of its value on that repeat's outputs.
    """
    from wsi_pipeline.tasks.metrics import summarise_repeats

    prot = parse_protocol(protocol)
    if len(preds) != len(targets):
        raise ValueError(f"endpoint_validation_metrics: {len(preds)} predictions but {len(targets)} targets")
    if not preds:
        return {m: math.nan for m in endpoint.definition.validation_metrics}
    reps = prot.repeats if prot.per_repeat else 1
    logits = [p.repeat_logits for p in preds]
    if any(z is None for z in logits):
        raise ValueError("endpoint_validation_metrics: a slide prediction has no repeat_logits (the model's outputs); "
                         "score the slides with slide_predictions")
    per = []
    for r in range(reps):
        z = np.stack([lg[r if len(lg) > 1 else 0] if prot.per_repeat else lg.mean(0) for lg in logits if lg is not None])
        outputs = [_Out(torch.as_tensor(row)) for row in z]
        with torch.no_grad():
            loss = float(endpoint.group_loss(outputs, list(targets)))
        per.append({"loss": loss, **endpoint.definition.validation(endpoint, list(targets), endpoint.scores(z))})
    names = endpoint.definition.validation_metrics
    if not prot.per_repeat:
        return {m: per[0][m] for m in names}
    rm = summarise_repeats(per, names)
    return {**rm.mean, **{f"{m}_repeat_std": v for m, v in rm.std.items()}}


class _Out:
    """An aggregator output carrying only ``logits`` (for the endpoint's losses on stored outputs)."""

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits


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
