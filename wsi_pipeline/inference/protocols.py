"""Test protocols: embed a slide once, then aggregate all tiles or R random k-tile subsets.

The papers score a slide on all its foreground tiles and on R repeats of k random tiles (TCGA-PRAD
100 x 256, CAMELYON 10 x 2048). Because the encoder sees each tile independently in eval mode, a
tile's embedding does not depend on which subset it is in: we embed every tile once
(:func:`embed_slide`) and re-run only the aggregator on index subsets (:func:`predict_slide`).
This is exactly what re-embedding each subset would give, at the cost of one encoder pass plus R
cheap aggregator passes.

Two ways to score R x k subsets (same subsets, different statistics)
--------------------------------------------------------------------
- ``sub<k>x<R>``, the papers' protocol: repeat r predicts
  every slide from that repeat's tiles; the metric is computed over slides for each repeat; the
  model's score is the mean of the R per-repeat metrics (std over repeats beside it). Big-Layers
  Table 3: "we test each model 10 times and use the mean AUC of the 10 runs".
- ``ens<k>x<R>``: each slide's probabilities are
  averaged over its R repeats and the metric is computed once on those means (an ensemble over
  subsets; not the papers' number, usually higher).

Reproducibility: the subsets of a slide come from a NumPy generator seeded by
``(seed, slide_id, sub<k>x<R>)`` (:func:`protocol_rng`), so they do not depend on the order of
slides, on the other protocols, or on the model; repeats differ from each other; the two
statistics above see the same subsets.

Validation (:func:`validate_model`, :func:`slide_predictions`, :func:`validation_metrics`) lives in
:mod:`wsi_pipeline.inference.protocol_metrics`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from wsi_pipeline.config.evaluation import ALL, EvalProtocol, parse_protocol
from wsi_pipeline.data.tensors import tiles_to_tensor
from wsi_pipeline.data.store import TileStore, open_store
from wsi_pipeline.progress import progress_bar

__all__ = [
    "protocol_rng",
    "subset_indices",
    "SlidePrediction",
    "calibrated_prediction",
    "embed_slide",
    "predict_slide",
    "predict_protocols",
    "repeat_probs",
    "run_aggregator",
]


def protocol_rng(seed: int, slide_id: str, protocol: EvalProtocol | str) -> np.random.Generator:
    """The generator of one slide's subsets under one protocol, from a stable hash of the three.

    A protocol is keyed by its :attr:`EvalProtocol.draw_name`, so ``sub<k>x<R>`` and ``ens<k>x<R>``
    draw the same subsets; a string that is not a protocol name is used as it is.
    """
    if isinstance(protocol, str):
        try:
            protocol = parse_protocol(protocol)
        except ValueError:
            pass
    name = protocol.draw_name if isinstance(protocol, EvalProtocol) else str(protocol)
    key = f"{int(seed)}\x1f{slide_id}\x1f{name}".encode()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def subset_indices(n_tiles: int, protocol: EvalProtocol, generator: np.random.Generator | None = None) -> list[np.ndarray]:
    """Tile indices of each repeat, each sorted ascending (the store's order, which TransMIL's
    positional layout expects).

    ``all``, or ``k >= n_tiles``: one repeat holding every tile. Otherwise ``repeats`` draws of
    ``k`` distinct tiles, each drawn independently from ``generator``.
    """
    if n_tiles < 1:
        raise ValueError("a slide with no tiles cannot be scored; check its tile store (n_tiles=0)")
    if protocol.is_all or protocol.k >= n_tiles:  # type: ignore[operator]
        return [np.arange(n_tiles)]
    if generator is None:
        raise ValueError(f"protocol {protocol} draws random subsets: pass a generator (see protocol_rng)")
    return [np.sort(generator.choice(n_tiles, size=protocol.k, replace=False)) for _ in range(protocol.repeats)]


@dataclass
class SlidePrediction:
    """One slide's prediction under one protocol.

    Attributes
    ----------
    probs : float64 (C,), mean over repeats of the softmax class probabilities.
    prob_std : float64 (C,), standard deviation over repeats (ddof 0; zeros for one repeat).
    attention : float32 (N,) or None, one score per tile of the slide from the all-tiles pass
        (for every protocol, so heatmaps do not depend on random subsets).
    instance_scores : float32 (N, C) or None, per-tile class scores from the all-tiles pass
        when the aggregator defines them.
    n_repeats : aggregator passes averaged (1 for ``all`` or when k >= n_tiles).
    n_tiles : tiles in the slide (N).
    protocol : the protocol's name.
    repeat_probs : float64 (n_repeats, C), the class probabilities of each repeat, in repeat
        order (what the per-repeat score is computed from; see :func:`repeat_probs`).
    repeat_logits : float64 (n_repeats, C), the aggregator's raw outputs of each repeat (what
        survival and regression scores are computed from, :meth:`~wsi_pipeline.tasks.base.Endpoint.scores`).
    """

    probs: np.ndarray
    prob_std: np.ndarray
    attention: np.ndarray | None
    instance_scores: np.ndarray | None
    n_repeats: int
    n_tiles: int
    protocol: str = "all"
    repeat_probs: np.ndarray | None = None
    repeat_logits: np.ndarray | None = None

    @property
    def pred(self) -> int:
        return int(np.argmax(self.probs))


@contextmanager
def _eval_mode(*modules: nn.Module | None) -> Iterator[None]:
    """Eval mode and no gradient inside; previous train/eval flags restored on exit."""
    mods = [m for m in modules if m is not None]
    flags = [m.training for m in mods]
    try:
        for m in mods:
            m.eval()
        with torch.no_grad():
            yield
    finally:
        for m, f in zip(mods, flags):
            m.train(f)


def _module_device(module: nn.Module, default: torch.device | str | None = None) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device(default or "cpu")


def embed_slide(
    encoder: nn.Module,
    store: TileStore | str | os.PathLike,
    *,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    on_batch: Callable[[np.ndarray, np.ndarray], None] | None = None,
    progress: bool = False,
    indices: np.ndarray | None = None,
) -> Tensor:
    """Embed every tile of a store once (or the tiles ``indices`` names), in eval mode without gradient.

    Parameters
    ----------
    encoder : [B, 3, T, T] -> [B, D].
    store : an open store or its path.
    batch_size : tiles per encoder call.
    device : where the encoder runs (default: where its parameters are).
    on_batch : called as ``on_batch(indices, tiles_uint8)`` for every batch read (e.g. to build a
        thumbnail from the tiles without reading the store twice).
    progress : show a tqdm bar over batches.
    indices : ascending tile indices to embed (default: all); row i of the result is then tile
        ``indices[i]``.

    Returns
    -------
    Tensor float32 [N, D] on the CPU, row i = tile i of the store. The next batch is read in a
    background thread while the current one is embedded. Tiles go through the store's stain
    normalisation (``store.stain``, attached by the stage that opened it) when it has one.
    """
    st = store if isinstance(store, TileStore) else open_store(store)
    which = np.arange(len(st)) if indices is None else np.asarray(indices, dtype=np.int64)
    n = len(which)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; expected >= 1")
    dev = torch.device(device) if device is not None else _module_device(encoder)
    starts = list(range(0, n, batch_size))
    out: list[Tensor] = []
    with _eval_mode(encoder), ThreadPoolExecutor(max_workers=1) as pool:
        read = lambda s: st.read(which[s : s + batch_size])  # noqa: E731
        pending = pool.submit(read, starts[0]) if starts else None
        it = starts
        if progress:
            it = progress_bar(starts, desc=f"embed {st.slide_id}", unit="batch", leave=False)
        for i, s in enumerate(it):
            tiles = pending.result()  # type: ignore[union-attr]
            pending = pool.submit(read, starts[i + 1]) if i + 1 < len(starts) else None
            if on_batch is not None:
                on_batch(which[s : s + len(tiles)], tiles)
            z = encoder(tiles_to_tensor(tiles, device=dev, stain=st.stain))
            out.append(z.float().cpu())
    if not out:
        raise ValueError(f"tile store {st.path} has no tiles; nothing to embed")
    return torch.cat(out, 0)


def run_aggregator(aggregator: nn.Module, z: Tensor, grid: Tensor | np.ndarray | None = None) -> Any:
    """Call an aggregator on one bag, passing the tile grid to heads that declare ``needs_grid``."""
    if getattr(aggregator, "needs_grid", False):
        if grid is None:
            raise ValueError(
                f"{type(aggregator).__name__} needs the tile grid (needs_grid=True) but none was given; "
                "pass the store's grid [n, 2] (col, row)"
            )
        g = torch.as_tensor(np.asarray(grid), device=z.device)
        return aggregator(z, g)
    return aggregator(z)


def predict_slide(
    aggregator: nn.Module,
    z: Tensor,
    grid: Tensor | np.ndarray | None = None,
    protocol: EvalProtocol | str = ALL,
    generator: np.random.Generator | None = None,
    *,
    with_attention: bool = True,
) -> SlidePrediction:
    """Score one embedded slide under ``protocol``, re-running only the aggregator per subset.

    Parameters
    ----------
    aggregator : MIL aggregator, ``forward(z [n, D]) -> MILOutput`` (or ``forward(z, grid)`` when
        it has ``needs_grid = True``).
    z : float [N, D] tile embeddings (from :func:`embed_slide`).
    grid : (N, 2) tile (col, row), required by grid heads only.
    protocol : ``all`` or a subsample protocol.
    generator : NumPy generator for the subsets (see :func:`protocol_rng`); unused for ``all``.
    with_attention : also return the all-tiles attention. For a subsample protocol this costs
        one extra aggregator pass over all tiles.
    """
    protocol = parse_protocol(protocol)
    n = int(z.shape[0])
    subsets = subset_indices(n, protocol, generator)
    grid_np = None if grid is None else np.asarray(grid.cpu() if isinstance(grid, Tensor) else grid)
    with _eval_mode(aggregator):
        zd = z.to(_module_device(aggregator), next(aggregator.parameters(), z).dtype)  # the aggregator's dtype
        probs, logits = [], []
        attention = instance_scores = None
        for idx in subsets:
            whole = len(idx) == n
            sub = zd if whole else zd[torch.as_tensor(idx, device=zd.device)]
            out = run_aggregator(aggregator, sub, None if grid_np is None else grid_np[idx])
            probs.append(torch.softmax(out.logits.detach().float().reshape(-1), 0).cpu().double().numpy())
            logits.append(out.logits.detach().reshape(-1).cpu().double().numpy())
            if whole and with_attention:
                attention, instance_scores = _tile_scores(out)
        if with_attention and attention is None:
            attention, instance_scores = _tile_scores(run_aggregator(aggregator, zd, grid_np))
    p = np.stack(probs)
    return SlidePrediction(
        probs=p.mean(0),
        prob_std=p.std(0),
        attention=attention,
        instance_scores=instance_scores,
        n_repeats=len(subsets),
        n_tiles=n,
        protocol=protocol.name,
        repeat_probs=p,
        repeat_logits=np.stack(logits),
    )


def calibrated_prediction(pred: SlidePrediction, endpoint: Any) -> SlidePrediction:
    """``pred`` with its class probabilities re-read through ``endpoint``'s calibration
    (:attr:`~wsi_pipeline.tasks.base.Endpoint.logit_map`, fitted on the run's validation slides); ``pred``
    itself when the endpoint has none."""
    if endpoint is None or endpoint.calibration == "none" or pred.repeat_logits is None:
        return pred
    p = np.asarray(endpoint.scores(pred.repeat_logits)[endpoint.definition.score_key], dtype=np.float64)
    return replace(pred, probs=p.mean(0), prob_std=p.std(0), repeat_probs=p)


def repeat_probs(preds: Sequence[SlidePrediction], repeats: int) -> np.ndarray:
    """Stack slides' per-repeat probabilities as float64 (R, N, C), R = ``repeats``.

    Row r holds every slide's prediction from repeat r's tiles; a slide scored in one pass (at
    most k tiles: every repeat would hold all its tiles) contributes that pass to every repeat.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; expected >= 1")
    cols = []
    for pred in preds:
        rp = pred.repeat_probs if pred.repeat_probs is not None else pred.probs[None]
        if len(rp) == 1:
            rp = np.repeat(rp, repeats, axis=0)
        elif len(rp) != repeats:
            raise ValueError(f"slide prediction ({pred.protocol}) has {len(rp)} repeats; expected 1 or {repeats}")
        cols.append(rp)
    if not cols:
        return np.zeros((repeats, 0, 0))
    return np.stack(cols, axis=1)


def _tile_scores(out: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    att = getattr(out, "attention", None)
    inst = getattr(out, "instance_scores", None)
    a = None if att is None else att.detach().float().reshape(-1).cpu().numpy()
    s = None if inst is None else inst.detach().float().cpu().numpy()
    return a, s


def predict_protocols(
    encoder: nn.Module | None,
    aggregator: nn.Module,
    slide: TileStore | Tensor | tuple[Tensor, Any],
    protocols: Sequence[EvalProtocol],
    *,
    slide_id: str,
    seed: int = 0,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    on_batch: Callable[[np.ndarray, np.ndarray], None] | None = None,
    with_attention: bool = True,
) -> dict[str, SlidePrediction]:
    """Embed one slide once and score it under every protocol; keys are protocol names.

    The all-tiles attention is computed once and shared by every protocol's prediction;
    ``sub<k>x<R>`` and ``ens<k>x<R>`` share their aggregator passes (same subsets).
    """
    z, grid = slide_embedding(encoder, slide, batch_size=batch_size, device=device, on_batch=on_batch)
    out: dict[str, SlidePrediction] = {}
    by_draw: dict[str, SlidePrediction] = {}
    attention = instance = None
    any_all = any(p.is_all for p in protocols)
    for prot in protocols:
        if prot.draw_name in by_draw:
            out[prot.name] = replace(by_draw[prot.draw_name], protocol=prot.name)
            continue
        # attention comes from the all-tiles pass: the "all" protocol's own, else one extra pass
        want = with_attention and attention is None and (prot.is_all or not any_all)
        pred = predict_slide(aggregator, z, grid, prot, protocol_rng(seed, slide_id, prot), with_attention=want)
        if pred.attention is not None:
            attention, instance = pred.attention, pred.instance_scores
        out[prot.name] = by_draw[prot.draw_name] = pred
    for pred in out.values():
        pred.attention, pred.instance_scores = attention, instance
    return out


def slide_embedding(
    encoder: nn.Module | None,
    slide: TileStore | str | os.PathLike | Tensor | tuple[Tensor, Any],
    *,
    batch_size: int,
    device: torch.device | str | None,
    on_batch: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> tuple[Tensor, np.ndarray | None]:
    if isinstance(slide, tuple):
        return torch.as_tensor(slide[0]), None if slide[1] is None else np.asarray(slide[1])
    if isinstance(slide, (Tensor, np.ndarray)):
        return torch.as_tensor(slide), None
    st = slide if isinstance(slide, TileStore) else open_store(slide)
    if encoder is None:
        raise ValueError(f"slide {st.path} is a tile store but encoder is None; pass the encoder or precomputed embeddings")
    return embed_slide(encoder, st, batch_size=batch_size, device=device, on_batch=on_batch), st.grid
