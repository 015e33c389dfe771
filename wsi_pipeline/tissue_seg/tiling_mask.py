"""The tissue U-Net as the tiler's tissue mask (``wsi-pipeline tile --method unet``)."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from wsi_pipeline.slides.base import Slide
    from wsi_pipeline.tissue_seg.model import TissueUNet

__all__ = ["unet_tissue_mask", "resolve_tissue_model"]


def resolve_tissue_model(path: str | os.PathLike | None) -> str:
    """The model file to use: ``path``, or the shipped model when None (error if it is missing)."""
    from wsi_pipeline.tissue_seg.builtin import BUILTIN_MODEL

    p = BUILTIN_MODEL if path is None else os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"tissue model not found: {p}" + (
            "; the shipped model is missing from this installation, give one with --tissue-model" if path is None else ""))
    return os.fspath(p)


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[TissueUNet, float]:
    from wsi_pipeline.tissue_seg.stage import load_tissue_model

    return load_tissue_model(path)


#: Glass grey level the shipped model was trained on (its glass was drawn from 232..250): a slide's
#: greyscale input is scaled so that its own glass lands here.
TRAINED_GLASS_GREY = 242.0


def unet_tissue_mask(slide: Slide, slide_mpp: float, model_path: str | os.PathLike | None = None,
                     threshold: float = 0.5, *, glass_grey: float | None = None) -> tuple[np.ndarray, float, dict[str, Any]]:
    """Tissue mask of a whole slide predicted by the tissue U-Net.

    The slide is read whole at the model's working resolution (``mpp`` stored in the model) and
    the prediction is made at 8 image px per mask px. The model sees greyscale only and was
    trained on glass at grey 232..250: given the slide's glass level (``glass_grey``), the
    greyscale input is scaled by ``TRAINED_GLASS_GREY / glass_grey``, so glass at 216 looks like
    glass at 242 to it instead of like tissue. (The tiler also intersects the mask with its stain
    rule, :mod:`wsi_pipeline.tiling.plan`, so that the model never keeps glass.)

    Parameters
    ----------
    slide : an open slide.
    slide_mpp : um per level-0 px of the slide.
    model_path : ``best.pt`` of ``wsi-pipeline tissue train``; None: the model shipped with the package.
    glass_grey : the slide's glass grey level (None: unknown, the input is not scaled).

    Returns
    -------
    (bool mask, level-0 px per mask px, info dict for the store's attributes)
    """
    from wsi_pipeline.slides.scaled import read_scaled
    from wsi_pipeline.tissue_seg.stage import MASK_DOWNSAMPLE, predict_mask
    import cv2

    path = resolve_tissue_model(model_path)
    model, model_mpp = _load(path)
    down = model_mpp / slide_mpp
    if down < 1:
        raise ValueError(f"slide {slide.path}: its level 0 ({slide_mpp:.4g} um/px) is coarser than the tissue model's "
                         f"working resolution ({model_mpp:.4g} um/px)")
    rgb = read_scaled(slide, down)
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    scale = TRAINED_GLASS_GREY / float(glass_grey) if glass_grey else 1.0
    if scale != 1.0:
        grey = np.clip(np.rint(grey.astype(np.float32) * scale), 0, 255).astype(np.uint8)
    mask, prob = predict_mask(model, grey, threshold=threshold)
    mask = mask.astype(bool)
    info: dict[str, Any] = {"model": path, "model_mpp": model_mpp, "mask_downsample": down * MASK_DOWNSAMPLE,
                            "input_scale": round(scale, 4)}
    info["tissue_fraction"] = float(mask.mean())
    return mask, down * MASK_DOWNSAMPLE, info
