"""The slide's background (glass) level, estimated from a low-resolution thumbnail.

One estimate serves three decisions: the greyscale rule's ``grey_max="auto"`` and its
glass-in-the-foreground-band warning, the Otsu mask's check that the field shows glass at all
before a bimodal threshold is trusted, and the skip of dark-background (fluorescence) slides
by the brightfield rules.

The rule, on a thumbnail (any scale at which a pixel averages many level-0 px, e.g. the
tiler's overview at 16 px per tile side):

1. **Dark**: when the thumbnail's median grey (BT.601 luma, 0..255) is below
   :data:`DARK_MAX_GREY`, more than half of the slide is darker than any glass a brightfield
   scanner records: the background is dark (fluorescence). Its level is the median grey of
   the darker half of the pixels.
2. **Glass**: otherwise a pixel is glass when it is neutral (HSV saturation <=
   :data:`GLASS_MAX_SATURATION`, of 255), bright (grey >= :data:`GLASS_MIN_GREY`) and flat
   (standard deviation of grey over its 5 x 5 neighbourhood <= :data:`GLASS_MAX_STD`). Glass
   averaged over a thumbnail pixel is flat to a grey level or so whatever its level (scanners
   put it anywhere between about 210 and 255); tissue, even pale, unevenly counterstained
   stroma, carries the texture of nuclei and fibres. Scanner padding (the area outside the
   scanned region, or a label area blanked by the scanner) is flat too, but written at a
   saturated level: every channel >= :data:`PADDING_MIN` (or <= 255 - that). It is left out of
   the estimate whenever real glass (unsaturated glass pixels, at least
   :data:`MIN_GLASS_FRACTION` of the thumbnail) is in view, so grey-pink glass at 235 beside white
   padding at 255 is estimated at 235, not 255 (with the padding's level, real glass would read
   as faint stain). Limit: an unsaturated border (a white frame at 248 beside glass at 235) is
   not told from the glass: pale tissue is just as flat and neutral at this scale. When
   glass pixels make up at least :data:`MIN_GLASS_FRACTION` of the thumbnail, the background is
   ``bright`` and its level is their median grey.
3. **None**: neither: the field is covered by tissue and shows no glass (a crop inside the
   tissue); the level is unknown (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "DARK_MAX_GREY",
    "GLASS_MAX_SATURATION",
    "GLASS_MAX_STD",
    "GLASS_MIN_GREY",
    "MIN_GLASS_FRACTION",
    "PADDING_MIN",
    "Background",
    "auto_grey_max",
    "estimate_background",
    "glass_pixels",
]

#: A thumbnail whose median grey is below this has a dark (fluorescence) background.
DARK_MAX_GREY = 64
#: Highest HSV saturation (0..255, i.e. 10 %) of a glass pixel.
GLASS_MAX_SATURATION = 25
#: Lowest grey level of a glass pixel.
GLASS_MIN_GREY = 150
#: Highest standard deviation of grey (levels) over a glass pixel's 5 x 5 neighbourhood.
GLASS_MAX_STD = 2.0
#: Smallest fraction of the thumbnail's pixels that must be glass for glass to be reported.
MIN_GLASS_FRACTION = 0.02
#: A glass pixel with every channel at least this (or at most 255 minus this) is scanner padding.
PADDING_MIN = 253


@dataclass(frozen=True)
class Background:
    """A slide's background as seen on its thumbnail.

    Attributes
    ----------
    kind : ``"bright"`` (glass found: brightfield), ``"dark"`` (dark background: fluorescence?)
        or ``"none"`` (no glass visible: the field is covered by tissue).
    grey : background grey level (0..255); None when ``kind == "none"``.
    fraction : fraction of the thumbnail's pixels taken as background (glass pixels for
        ``bright``, the darker half for ``dark``, 0 for ``none``).
    rgb : the glass colour, per-channel median of the glass pixels (``bright`` only, else None):
        glass may be tinted (slightly blue on some scanners), so optical density is measured
        against each channel's own glass level.
    """

    kind: str
    grey: float | None
    fraction: float
    rgb: tuple[float, float, float] | None = None


    @property
    def is_dark(self) -> bool:
        """True for a dark (fluorescence) background."""
        return self.kind == "dark"

    def as_dict(self) -> dict[str, float | str | list[float] | None]:
        """JSON-ready form (store attributes, Otsu info)."""
        return {"kind": self.kind, "grey": self.grey, "fraction": self.fraction,
                "rgb": None if self.rgb is None else [float(v) for v in self.rgb]}


def _local_std(g: np.ndarray, k: int = 5) -> np.ndarray:
    import cv2

    f = g.astype(np.float32)
    m = cv2.blur(f, (k, k), borderType=cv2.BORDER_REFLECT)
    m2 = cv2.blur(f * f, (k, k), borderType=cv2.BORDER_REFLECT)
    return np.sqrt(np.maximum(m2 - m * m, 0.0))


def glass_pixels(rgb: np.ndarray) -> np.ndarray:
    """Bool (H, W): pixels of a uint8 (H, W, 3) RGB thumbnail that look like glass (neutral, bright, flat)."""
    import cv2

    rgb = np.ascontiguousarray(rgb)
    g = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    sat = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)[..., 1]
    return (sat <= GLASS_MAX_SATURATION) & (g >= GLASS_MIN_GREY) & (_local_std(g) <= GLASS_MAX_STD)


def estimate_background(rgb: np.ndarray) -> Background:
    """Estimate the background (glass) of a slide from its thumbnail (rule in the module docstring).

    Parameters
    ----------
    rgb : uint8 (H, W, 3) RGB thumbnail; each pixel should average many level-0 px (the
        flatness test assumes scanner noise is averaged away).

    Returns
    -------
    :class:`Background`.
    """
    import cv2

    rgb = np.ascontiguousarray(rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8 or rgb.size == 0:
        raise ValueError(f"thumbnail must be a non-empty uint8 (H, W, 3) RGB array; got {rgb.dtype} {rgb.shape}")
    g = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)  # BT.601 luma, as tissue.grey
    median = float(np.median(g))
    if median < DARK_MAX_GREY:
        dark = g[g <= median]
        return Background("dark", float(np.median(dark)), float(dark.size / g.size))
    glass = _real_glass(rgb, glass_pixels(rgb))
    fraction = float(glass.mean())
    if fraction >= MIN_GLASS_FRACTION:
        rgb_glass = np.median(rgb[glass].reshape(-1, 3).astype(np.float64), axis=0)
        r, gr, b = (float(v) for v in rgb_glass)
        return Background("bright", float(np.median(g[glass])), fraction, (r, gr, b))
    return Background("none", None, 0.0)


def _real_glass(rgb: np.ndarray, glass: np.ndarray) -> np.ndarray:
    """The glass pixels less scanner padding when unsaturated glass is in view (module docstring, rule 2)."""
    padding = glass & ((rgb.min(axis=-1) >= PADDING_MIN) | (rgb.max(axis=-1) <= 255 - PADDING_MIN))
    real = glass & ~padding
    if real.mean() < MIN_GLASS_FRACTION:
        return glass  # no unsaturated glass: the saturated level is the glass (a scanner white-balanced to 255)
    return real


def auto_grey_max(background: Background, margin: float) -> int | None:
    """``grey_max`` for ``--grey-max auto``: the glass level minus ``margin`` grey levels, rounded down.

    None when no glass was found (``background.kind`` is not ``bright``); the caller falls back
    to the paper's 230.
    """
    if background.kind != "bright" or background.grey is None:
        return None
    return int(max(0, min(255, np.floor(background.grey - float(margin)))))
