"""Per-slide augmentation: one random draw of parameters per bag, applied identically to all its tiles.

The Big-Layers protocol augments a whole slide uniformly (Gaussian blur, colour jitter,
horizontal and vertical flips, rotation) rather than each tile independently. We draw the
parameters of a bag once (:meth:`SlideAugment.draw`, from torch's global generator, so a seeded
run is reproducible) and apply them with kornia's image functions
(:meth:`SlideAugment.apply`). Because the draw is separate from the application, a bag can be
augmented chunk by chunk on the device and still get one transform (see :func:`tiles_to_input`).

Order of operations: stain normalisation (the slide's, not random: :mod:`wsi_pipeline.data.stain`),
stain mixing, HED jitter (both in optical-density space, :func:`~wsi_pipeline.data.stain.mix_stains`,
:func:`~wsi_pipeline.data.stain.hed_jitter`), blur, brightness, contrast, saturation, hue,
horizontal flip, vertical flip, rotation by a multiple of 90 degrees (lossless on square tiles). Colour-jitter factors
follow kornia's ``ColorJitter``: brightness adds ``b - 1`` with ``b ~ U[1 - B, 1 + B]``,
contrast and saturation multiply by ``U[1 - x, 1 + x]``, hue turns by ``U[-H, H]`` of a full turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from wsi_pipeline.data.stain import StainEstimate, hed_jitter, mix_stains
from wsi_pipeline.models.input_norm import IMAGENET_MEAN, IMAGENET_STD
from wsi_pipeline.data.tensors import tiles_to_tensor

__all__ = ["AugmentParams", "SlideAugment", "build_augment", "tiles_to_input"]


@dataclass(frozen=True)
class AugmentParams:
    """One bag's augmentation: None/False/0 means "not applied"."""

    blur_sigma: float | None = None
    brightness: float | None = None
    contrast: float | None = None
    saturation: float | None = None
    hue: float | None = None
    hflip: bool = False
    vflip: bool = False
    rot90: int = 0
    hed_scale: tuple[float, float, float] | None = None
    hed_shift: tuple[float, float, float] | None = None
    mix_donor: int | None = None
    mix_weight: float = 0.0


def _uniform(low: float, high: float) -> float:
    return float(low + (high - low) * torch.rand(()).item())


class SlideAugment:
    """Draws and applies per-slide augmentation parameters.

    Parameters
    ----------
    cfg : a :class:`wsi_pipeline.config.pipeline.AugmentConfig`.
    donors : the training slides' stain estimates stain mixing draws from (empty: no mixing).
    """

    def __init__(self, cfg: Any, donors: Sequence[StainEstimate] = ()) -> None:
        self.cfg = cfg
        self.donors = list(donors)

    def draw(self) -> AugmentParams:
        """One random draw (torch's global generator) of the parameters of a bag."""
        c = self.cfg
        # every branch draws the same count of numbers whatever the outcome, so one bag's
        # outcome does not shift the random stream of what comes after it
        blur_on, sigma = torch.rand(()).item() < c.blur_p, _uniform(*c.blur_sigma)
        jit_on = torch.rand(()).item() < c.jitter_p
        b = _uniform(max(0.0, 1 - c.brightness), 1 + c.brightness)
        ct = _uniform(max(0.0, 1 - c.contrast), 1 + c.contrast)
        s = _uniform(max(0.0, 1 - c.saturation), 1 + c.saturation)
        h = _uniform(-c.hue, c.hue)
        hflip, vflip = torch.rand(()).item() < 0.5, torch.rand(()).item() < 0.5
        rot = int(torch.randint(0, 4, ()).item())
        extra: dict[str, Any] = {}
        # drawn only when configured, so configs without them keep their random stream
        if c.stain_mix_p > 0:
            mix_on, w = torch.rand(()).item() < c.stain_mix_p, _uniform(0.0, c.stain_mix)
            donor = int(torch.randint(0, max(1, len(self.donors)), ()).item())
            if mix_on and self.donors:
                extra.update(mix_donor=donor, mix_weight=w)
        if c.hed_p > 0:
            hed_on = torch.rand(()).item() < c.hed_p
            scale = tuple(_uniform(1 - c.hed_scale, 1 + c.hed_scale) for _ in range(3))
            shift = tuple(_uniform(-c.hed_shift, c.hed_shift) for _ in range(3))
            if hed_on:
                extra.update(hed_scale=scale, hed_shift=shift)
        return AugmentParams(
            blur_sigma=sigma if blur_on else None,
            brightness=b if jit_on and c.brightness > 0 else None,
            contrast=ct if jit_on and c.contrast > 0 else None,
            saturation=s if jit_on and c.saturation > 0 else None,
            hue=h if jit_on and c.hue > 0 else None,
            hflip=bool(c.flips and hflip),
            vflip=bool(c.flips and vflip),
            rot90=rot if c.rotation else 0,
            **extra,
        )

    def apply(self, images: torch.Tensor, params: AugmentParams, stain: StainEstimate | None = None) -> torch.Tensor:
        """Apply ``params`` to float images ``[k, 3, T, T]`` in [0, 1]; returns a new tensor in [0, 1].

        ``stain``: the stain of the images as they are (after normalisation), which stain mixing
        starts from (no mixing without it).
        """
        from kornia.enhance import adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation
        from kornia.filters import gaussian_blur2d

        x = images
        if x.shape[0] == 0:
            return x
        if params.mix_donor is not None and stain is not None and params.mix_donor < len(self.donors):
            x = mix_stains(x, stain, self.donors[params.mix_donor], params.mix_weight)
        if params.hed_scale is not None and params.hed_shift is not None:
            x = hed_jitter(x, params.hed_scale, params.hed_shift)
        if params.blur_sigma is not None:
            k = self.cfg.blur_kernel
            x = gaussian_blur2d(x, (k, k), (params.blur_sigma, params.blur_sigma))
        if params.brightness is not None:
            x = adjust_brightness(x, params.brightness - 1.0)
        if params.contrast is not None:
            x = adjust_contrast(x, params.contrast)
        if params.saturation is not None:
            x = adjust_saturation(x, params.saturation)
        if params.hue is not None:
            x = adjust_hue(x, params.hue * 2.0 * math.pi)
        if params.hflip:
            x = torch.flip(x, dims=(3,))
        if params.vflip:
            x = torch.flip(x, dims=(2,))
        if params.rot90:
            x = torch.rot90(x, params.rot90, dims=(2, 3))
        return x.clamp(0.0, 1.0)


def build_augment(cfg: Any, donors: Sequence[StainEstimate] = ()) -> SlideAugment | None:
    """A :class:`SlideAugment` when ``cfg.enabled``, else None (``donors``: see :class:`SlideAugment`)."""
    return SlideAugment(cfg, donors) if cfg.enabled else None


def tiles_to_input(
    tiles: np.ndarray | torch.Tensor,
    augment: SlideAugment | None = None,
    params: AugmentParams | None = None,
    *,
    device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    chunk: int | None = None,
    stain: Any = None,
) -> torch.Tensor:
    """uint8 tiles ``(k, T, T, 3)`` RGB -> normalised float ``(k, 3, T, T)``, stain-normalised and augmented per slide.

    Parameters
    ----------
    tiles : the bag's tiles.
    augment, params : the augmentation and this bag's draw (``params`` is drawn when None).
    device : where the conversion and augmentation run.
    out_device : where the result goes (default ``device``); with ``chunk``, a bag bigger than
        the device can hold is processed ``chunk`` tiles at a time and collected there.
    chunk : tiles per piece (None: the whole bag at once).
    stain : the slide's :class:`~wsi_pipeline.data.stain_slides.SlideStain` (None: not normalised).

    Without ``augment`` the result equals :func:`wsi_pipeline.data.tensors.tiles_to_tensor`.
    """
    out_device = device if out_device is None else out_device
    # the augmentation and this bag's draw (drawn here when not given)
    drawn = None if augment is None else (augment, params if params is not None else augment.draw())
    t = torch.as_tensor(tiles)
    if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
        raise ValueError(f"tiles must be uint8 (k, T, T, 3); got {t.dtype} {tuple(t.shape)}")
    n = t.shape[0]
    step = n if not chunk else max(1, int(chunk))
    pieces = []
    for a in range(0, max(n, 1), max(step, 1)):
        part = t[a : a + step]
        if drawn is None:
            x = tiles_to_tensor(part, device=device, stain=stain)
        else:
            x = part.to(device=device).permute(0, 3, 1, 2).to(torch.get_default_dtype()).div_(255.0)
            if stain is not None:
                x = stain.apply(x)
            x = drawn[0].apply(x, drawn[1], stain.effective if stain is not None else None)
            mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
            x = x.sub_(mean).div_(std).contiguous()
        pieces.append(x.to(out_device) if out_device is not None else x)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
