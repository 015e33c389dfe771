"""Whole-image tissue segmentation as a stage: train on folders of slides, predict a mask per slide.

Training (:func:`train`): every slide is read whole at ``mpp`` um/px (or cropped/padded to
``size``), its label is built by the paper's pipeline (:func:`~wsi_pipeline.tissue_seg.labels.paper_labels`)
and both are cached under ``OUT/cache``. One optimiser step per slide (batch 1, Adam, BCE) runs
through :class:`~wsi_pipeline.tissue_seg.chunked.ChunkedTissueUNet`, so the whole image is one
input. After each epoch the validation loss and Dice are computed, ``history.json`` and
``last.pt`` are written (resume: run the same command again) and ``best.pt`` is replaced when the
validation loss is the lowest so far (the paper's model selection).

Prediction (:func:`predict`): ``OUT/<slide_id>_mask.png`` (uint8, 255 = tissue) at 8 image px per
mask px, i.e. ``8 * mpp`` um per mask px, ``OUT/<slide_id>_overlay.png`` (QC: the image at the same
scale, tissue tinted green) and ``OUT/<slide_id>_mask.json`` (scales, tissue fraction).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsi_pipeline.tissue_seg.checkpoint import TissueCheckpoint, TissueResume, load_tissue_checkpoint, save_tissue_checkpoint
from wsi_pipeline.tissue_seg.chunked import DEFAULT_MAX_ELEMENTS, ChunkedTissueUNet
from wsi_pipeline.tissue_seg.labels import paper_labels
from wsi_pipeline.tissue_seg.model import MULTIPLE, TissueUNet
from wsi_pipeline.io_atomic import atomic_path, write_text_atomic
from wsi_pipeline.slide_ids import slide_output_path

__all__ = [
    "SlideEntry",
    "TissueImage",
    "slides_from_folder",
    "slides_from_manifest",
    "split_slides",
    "load_image",
    "cached_image",
    "dice",
    "train",
    "load_tissue_model",
    "predict_mask",
    "predict",
]

#: Image px per mask px of the model's output (the total stride of ``up7``).
MASK_DOWNSAMPLE = 8


@dataclass(frozen=True)
class SlideEntry:
    """One slide: id, path and split (``train``, ``val``, ``test`` or ``""`` for unassigned)."""

    slide_id: str
    path: Path
    split: str = ""


@dataclass
class TissueImage:
    """A slide read at the working resolution.

    Attributes
    ----------
    grey : uint8 (H, W) greyscale, H and W multiples of 32 px (padding is white glass).
    label : uint8 (H, W) {0, 1} paper label, or None when not computed.
    valid : (height, width) px of the part that is slide, not padding.
    level0_per_px : level-0 px per image px.
    """

    grey: np.ndarray
    label: np.ndarray | None
    valid: tuple[int, int]
    level0_per_px: float
    rgb: np.ndarray | None = None


def slides_from_folder(folder: str | os.PathLike) -> list[SlideEntry]:
    """Every slide file under ``folder`` (see :func:`wsi_pipeline.manifests.files.find_slides`)."""
    from wsi_pipeline.manifests.files import find_slides

    found = find_slides(folder)
    if not found:
        raise ValueError(f"no slide files found under {folder}")
    return [SlideEntry(sid, Path(p)) for sid, p in found.items()]


def slides_from_manifest(path: str | os.PathLike) -> list[SlideEntry]:
    """Slides of a manifest CSV (columns ``slide_id``, ``path``, optional ``split``)."""
    from wsi_pipeline.manifests.schema import read_manifest

    df = read_manifest(path)
    return [SlideEntry(str(r.slide_id), Path(str(r.path)), str(r.split or "")) for r in df.itertuples()]


def split_slides(slides: Sequence[SlideEntry], val_fraction: float, seed: int) -> tuple[list[SlideEntry], list[SlideEntry]]:
    """Training and validation slides: the ``split`` column when any slide has ``train``/``val``,
    else a seeded random ``val_fraction`` (at least one validation slide when there are two or more).
    ``test`` slides are left out. With a single slide it serves as both (said in the history)."""
    if any(s.split in ("train", "val") for s in slides):
        return [s for s in slides if s.split == "train"], [s for s in slides if s.split == "val"]
    pool = [s for s in slides if s.split != "test"]
    if len(pool) < 2:
        return list(pool), list(pool)
    order = np.random.default_rng(seed).permutation(len(pool))
    n_val = min(len(pool) - 1, max(1, int(round(val_fraction * len(pool)))))
    val = sorted((pool[i] for i in order[:n_val]), key=lambda s: s.slide_id)
    train = sorted((pool[i] for i in order[n_val:]), key=lambda s: s.slide_id)
    return train, val


def _pad_to(img: np.ndarray, h: int, w: int) -> np.ndarray:
    out = np.full((h, w) + img.shape[2:], 255, np.uint8)
    hh, ww = min(h, img.shape[0]), min(w, img.shape[1])
    out[:hh, :ww] = img[:hh, :ww]
    return out


def load_image(path: str | os.PathLike, *, mpp: float, size: tuple[int, int] | None = None, slide_mpp: float | None = None,
               with_label: bool = True, keep_rgb: bool = False) -> TissueImage:
    """Read a slide whole at ``mpp`` um/px, crop/pad it and compute the paper's label.

    Parameters
    ----------
    mpp : working resolution (um per image px).
    size : (height, width) px: crop from the top-left or pad with glass to exactly this (multiples
        of 32); None: the whole slide, padded with glass to the next multiples of 32.
    slide_mpp : level-0 um/px for slides whose metadata lacks it (the slide's own value wins).
    """
    import cv2

    from wsi_pipeline.slides.mpp import MissingMppError, resolve_mpp
    from wsi_pipeline.slides.opener import open_slide
    from wsi_pipeline.slides.scaled import read_scaled

    if not mpp > 0:
        raise ValueError(f"mpp must be > 0 um/px, got {mpp}")
    if size is not None and (size[0] % MULTIPLE or size[1] % MULTIPLE or min(size) < MULTIPLE):
        raise ValueError(f"--size must be positive multiples of {MULTIPLE} px (height width), got {size}")
    with open_slide(path) as slide:
        try:
            level0_mpp, _ = resolve_mpp(slide.mpp, run_mpp=None if slide.mpp else slide_mpp, path=str(path),
                                        needed_for=f"reading at --mpp {mpp}")
        except MissingMppError as e:  # the tissue commands' flag is --slide-mpp (their --mpp is the working resolution)
            raise MissingMppError(f"{path}: the slide has no mpp (um per px) in its metadata, and reading it at --mpp {mpp} "
                                  "um/px needs one; give it with --slide-mpp <um/px> (used for every slide that lacks one, "
                                  "e.g. 0.25 for 40x, 0.5 for 20x)") from e
        down = mpp / level0_mpp
        if down < 1:
            raise ValueError(f"{path}: --mpp {mpp} is finer than the slide's level 0 ({level0_mpp:.4g} um/px)")
        rgb = read_scaled(slide, down)
    vh, vw = rgb.shape[:2]
    if size is None:
        h, w = -(-vh // MULTIPLE) * MULTIPLE, -(-vw // MULTIPLE) * MULTIPLE
    else:
        h, w = size
    rgb = _pad_to(rgb, h, w)
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    label = paper_labels(rgb) if with_label else None
    return TissueImage(grey, label, (min(vh, h), min(vw, w)), float(down), rgb if keep_rgb else None)


def _save_npz(path: Path, **arrays: Any) -> None:
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))


def cached_image(entry: SlideEntry, cache: Path, *, mpp: float, size: tuple[int, int] | None,
                 slide_mpp: float | None = None) -> TissueImage:
    """:func:`load_image` with its result cached in ``cache/<slide_id>.npz``, keyed by the slide's
    fingerprint and the reading parameters (a changed slide or setting recomputes it)."""
    from wsi_pipeline.slides.fingerprint import slide_fingerprint

    key = json.dumps({"fp": slide_fingerprint(entry.path), "mpp": mpp, "size": list(size) if size else None,
                      "slide_mpp": slide_mpp, "labels": "paper-v1"}, sort_keys=True)
    f = slide_output_path(cache, entry.slide_id, ".npz")
    if f.is_file():
        with np.load(f) as z:
            if str(z["key"]) == key:
                return TissueImage(z["grey"], z["label"], (int(z["valid"][0]), int(z["valid"][1])), float(z["level0_per_px"]))
    img = load_image(entry.path, mpp=mpp, size=size, slide_mpp=slide_mpp)
    cache.mkdir(parents=True, exist_ok=True)
    _save_npz(f, grey=img.grey, label=img.label, valid=np.array(img.valid), level0_per_px=np.array(img.level0_per_px),
              key=np.array(key))
    return img


def dice(pred: np.ndarray, truth: np.ndarray) -> float:
    """Dice coefficient of two binary masks (1.0 when both are empty)."""
    p, t = pred.astype(bool), truth.astype(bool)
    denom = p.sum() + t.sum()
    return 1.0 if denom == 0 else float(2.0 * np.logical_and(p, t).sum() / denom)


def _low_label(label: np.ndarray) -> np.ndarray:
    """The paper's labels are constant on 8 x 8 px blocks (built at 1/8 scale): one px per block."""
    return label[::MASK_DOWNSAMPLE, ::MASK_DOWNSAMPLE]


def _evaluate(big: ChunkedTissueUNet, images: Sequence[TissueImage]) -> tuple[float, float]:
    losses, dices = [], []
    with torch.no_grad():
        for im in images:
            losses.append(float(big.loss(im.grey, im.label)))
            vh, vw = (-(-v // MASK_DOWNSAMPLE) for v in im.valid)
            pred = big.predict_low(im.grey)[:vh, :vw] > 0.5
            dices.append(dice(pred, _low_label(im.label)[:vh, :vw]))
    return float(np.mean(losses)), float(np.mean(dices))


def _readable_images(entries: Sequence[SlideEntry], cache: Path, kw: dict[str, Any], split: str,
                     log: Callable[[str], None]) -> list[TissueImage]:
    """The images of ``entries``; a slide that cannot be read is named with why and left out (not the whole run).

    Raises
    ------
    ValueError : no slide of the split could be read (each one's reason listed).
    """
    images, failed = [], []
    for s in entries:
        try:
            images.append(cached_image(s, cache, **kw))
        except (OSError, ValueError) as e:
            failed.append(f"slide {s.slide_id!r} ({s.path}): {e}")
            log(f"{split} slide {s.slide_id} left out: it could not be read: {e}")
    if not images:
        raise ValueError(f"none of the {len(entries)} {split} slide(s) could be read: " + "; ".join(failed[:5]))
    return images


def train(
    slides: Sequence[SlideEntry],
    out: str | os.PathLike,
    *,
    mpp: float = 2.0,
    size: tuple[int, int] | None = None,
    slide_mpp: float | None = None,
    epochs: int = 20,
    lr: float = 1e-3,
    seed: int = 0,
    val_fraction: float = 0.2,
    channels: int = 8,
    device: str = "cpu",
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the tissue U-Net on whole images (one slide per step); resumes from ``out/last.pt``.

    Returns the best record ``{"epoch", "val_loss", "val_dice"}``. Files in ``out``: ``cache/``,
    ``history.json`` (one dict per epoch), ``last.pt`` (model, optimiser, epoch, history),
    ``best.pt`` (model of the lowest validation loss; read by :func:`load_tissue_model`).
    """
    from wsi_pipeline.bigl.chunk_loop import ChunkRunner

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_s, val_s = split_slides(slides, val_fraction, seed)
    if not train_s:
        raise ValueError("no training slides (the manifest's split column has no 'train' rows)")
    if not val_s:
        raise ValueError("no validation slides (the manifest's split column has no 'val' rows)")
    settings = {"mpp": float(mpp), "size": list(size) if size else None, "slide_mpp": slide_mpp, "lr": float(lr),
                "seed": int(seed), "channels": int(channels), "train": [s.slide_id for s in train_s],
                "val": [s.slide_id for s in val_s]}
    torch.manual_seed(seed)
    model = TissueUNet(channels).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history: list[dict[str, Any]] = []
    best: dict[str, Any] = {"epoch": -1, "val_loss": float("inf"), "val_dice": float("nan")}
    start = 0
    last = out / "last.pt"
    if last.is_file():
        ckpt = load_tissue_checkpoint(last)
        if ckpt.resume is None or ckpt.best is None:
            raise ValueError(f"{last} holds no optimiser state (a best.pt copied over it?); delete it to start over")
        if json.loads(ckpt.resume.settings) != settings:
            raise ValueError(f"{last} was written with other settings ({ckpt.resume.settings}); now {json.dumps(settings)}: "
                             "use another --out or delete it to start over")
        model.load_state_dict(ckpt.model)
        opt.load_state_dict(ckpt.resume.optimizer)
        history, best, start = list(ckpt.resume.history), dict(ckpt.best), ckpt.resume.epoch
        log(f"resuming from {last} after epoch {start}")
    big = ChunkedTissueUNet(model, ChunkRunner(device), max_elements)
    cache = out / "cache"
    kw: dict[str, Any] = {"mpp": mpp, "size": size, "slide_mpp": slide_mpp}
    train_im = _readable_images(train_s, cache, kw, "training", log)
    val_im = _readable_images(val_s, cache, kw, "validation", log)
    for epoch in range(start, epochs):
        t0 = time.perf_counter()
        order = np.random.default_rng([seed, epoch]).permutation(len(train_im))
        losses = []
        for i in order:
            opt.zero_grad(set_to_none=True)
            loss = big.loss(train_im[i].grey, train_im[i].label)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        val_loss, val_dice = _evaluate(big, val_im)
        row = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)), "val_loss": val_loss, "val_dice": val_dice,
               "seconds": round(time.perf_counter() - t0, 3)}
        history.append(row)
        if val_loss < best["val_loss"]:
            best = {"epoch": epoch + 1, "val_loss": val_loss, "val_dice": val_dice}
            save_tissue_checkpoint(out / "best.pt", TissueCheckpoint.build(model, mpp=mpp, best=best))
        resume = TissueResume(settings=json.dumps(settings), optimizer=opt.state_dict(), epoch=epoch + 1, history=history)
        save_tissue_checkpoint(last, TissueCheckpoint.build(model, mpp=mpp, best=best, resume=resume))
        _write_json(out / "history.json", history)
        log(f"epoch {epoch + 1}/{epochs}: train loss {row['train_loss']:.4f}, val loss {val_loss:.4f}, "
            f"val Dice {val_dice:.4f}, best epoch {best['epoch']} ({row['seconds']:.1f} s)")
    return best


def load_tissue_model(path: str | os.PathLike, device: str = "cpu") -> tuple[TissueUNet, float]:
    """The model of a ``best.pt`` (or a run folder holding one) and its working mpp (um/px).

    Read with ``torch.load(weights_only=True)``; a file that is not a tissue model is refused.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "best.pt"
    ckpt = load_tissue_checkpoint(p)
    model = TissueUNet(ckpt.channels)
    model.load_state_dict(ckpt.model)
    return model.to(device).eval(), ckpt.mpp


def predict_mask(model: TissueUNet, grey: np.ndarray, valid: tuple[int, int] | None = None, *,
                 max_elements: int = DEFAULT_MAX_ELEMENTS, threshold: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 {0, 1} mask, float32 probability) at 8 image px per px for a uint8 greyscale image
    (any size: padded with glass to multiples of 32 px, the result cropped to ``valid`` or the image)."""
    h, w = grey.shape
    ph, pw = -(-h // MULTIPLE) * MULTIPLE, -(-w // MULTIPLE) * MULTIPLE
    g = _pad_to(grey, ph, pw)
    prob = ChunkedTissueUNet(model, max_elements=max_elements).predict_low(g)
    vh, vw = valid or (h, w)
    prob = prob[: -(-vh // MASK_DOWNSAMPLE), : -(-vw // MASK_DOWNSAMPLE)]
    return (prob > threshold).astype(np.uint8), prob


#: Longest side (px) of the QC overlay: the image at the model's resolution, shrunk to this when larger.
OVERLAY_MAX_SIDE = 2048


def tissue_overlay(rgb: np.ndarray, mask: np.ndarray, max_side: int = OVERLAY_MAX_SIDE) -> np.ndarray:
    """The QC overlay: ``rgb`` (the image at the model's mpp, (H, W, 3) uint8) with ``mask`` (0/1 at 1/8 of it)
    tinted green and outlined, at the image's own size (at most ``max_side`` px on the long side).

    Drawn at the mask's size the overlay was a few dozen pixels wide for a small slide: too small to
    see what was kept.
    """
    import cv2

    h, w = rgb.shape[:2]
    scale = min(1.0, max_side / max(h, w))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    base = rgb if scale == 1.0 else cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
    big = cv2.resize(mask.astype(np.uint8), size, interpolation=cv2.INTER_NEAREST).astype(bool)
    out = base.copy()
    out[big] = (0.55 * base[big] + 0.45 * np.array([0, 200, 0], np.float32)).astype(np.uint8)
    contours, _ = cv2.findContours(big.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    cv2.drawContours(out, contours, -1, (0, 110, 0), max(1, round(max(size) / 600)))
    return out


def predict(model_path: str | os.PathLike, slides: Sequence[SlideEntry], out: str | os.PathLike, *,
            mpp: float | None = None, slide_mpp: float | None = None, device: str = "cpu",
            max_elements: int = DEFAULT_MAX_ELEMENTS, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Write a mask PNG, a QC overlay PNG and a JSON record per slide (see the module docstring)."""
    import cv2

    model, model_mpp = load_tissue_model(model_path, device)
    mpp = float(mpp or model_mpp)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for s in slides:
        im = load_image(s.path, mpp=mpp, slide_mpp=slide_mpp, with_label=False, keep_rgb=True)
        mask, _ = predict_mask(model, im.grey, im.valid, max_elements=max_elements)
        overlay = tissue_overlay(im.rgb[: im.valid[0], : im.valid[1]], mask)
        for suffix, arr in (("_mask.png", mask * 255), ("_overlay.png", overlay[..., ::-1])):
            with atomic_path(slide_output_path(out, s.slide_id, suffix)) as tmp:
                if not cv2.imwrite(str(tmp), arr):
                    raise OSError(f"could not write {tmp}")
        rec = {"slide_id": s.slide_id, "path": str(s.path), "mask": f"{s.slide_id}_mask.png",
               "mpp_image": mpp, "mask_downsample_image": MASK_DOWNSAMPLE,
               "mask_downsample_level0": im.level0_per_px * MASK_DOWNSAMPLE, "mpp_mask": mpp * MASK_DOWNSAMPLE,
               "shape": list(mask.shape), "tissue_fraction": float(mask.mean())}
        _write_json(slide_output_path(out, s.slide_id, "_mask.json"), rec)
        records.append(rec)
        log(f"{s.slide_id}: tissue {rec['tissue_fraction']:.1%} of {mask.shape[0]}x{mask.shape[1]} mask px "
            f"({rec['mpp_mask']:.3g} um/px)")
    return records
