"""Stain estimation and normalisation (Macenko, Reinhard) on torch tensors, batched, on any device.

A slide's stain is estimated once, from a sample of its tiles (:func:`estimate_stain`), into a
:class:`StainEstimate` of plain numbers; a :class:`StainNormaliser` holds a target estimate (the
training split's, or one reference slide's) and maps every tile of a slide from that slide's
estimate to the target, per pixel, on the tiles' device and dtype (:meth:`StainNormaliser.apply`).
The transform of a tile depends only on the tile and the two estimates, never on the other tiles
of the batch, so batching and tile order do not change it (channel mixing is written out as
element-wise products, not a batched matmul whose kernel could depend on the batch size).

Optical density (OD), the variant of the published reference implementations of Macenko et al.
(2009) (Veta's MATLAB code and its Python ports): ``OD = -ln((I + 1) / Io)`` per channel with
``I`` in 0..255 and background intensity ``Io = 240``. A pixel is *tissue* when some channel's OD
reaches ``BETA = 0.15`` (glass reaches none). The reference code instead drops a pixel when any
channel's OD is below 0.15, which on pale eosin (red OD about 0.05) keeps only the nuclei: on the
demo's synthetic tissue that left 9 % of the pixels and Macenko normalisation of a tinted copy
moved it further from the original (mean |error| 18 grey levels against 12 unnormalised), where
the some-channel rule keeps 100 % and brings it closer (11; Reinhard 0.5).

Macenko (per slide): the tissue pixels' OD covariance (float64), its two leading eigenvectors
(the first signed to point into positive OD), the angle of each pixel's projection on their plane,
the 1st and 99th angle percentiles (``ALPHA = 1``, linear interpolation as NumPy's default) give
the two stain vectors; the one with the larger red OD is haematoxylin (H), the other eosin (E).
Concentrations are the least-squares solution ``C = pinv(HE) OD``; ``max_c`` is their 99th
percentile over the tissue pixels (the reference code takes it over all pixels; our sample is of
tissue tiles, and the tissue pixels make it independent of how much glass a tile shows).
Normalising: ``C' = C * max_c_target / max_c_slide``, ``OD' = HE_target C'``,
``I' = Io exp(-OD') - 1`` (the exact inverse of the OD above), clipped to [0, 255].

Reinhard et al. (2001), in CIE L*a*b* (kornia's sRGB D65 conversion, the one scikit-image's
``rgb2lab`` computes): per channel mean and standard deviation (ddof 0) over the slide's tissue
pixels; normalising maps ``(lab - mean_slide) / std_slide * std_target + mean_target`` for every
pixel, back to RGB clipped to [0, 1].

Fallback: a slide whose stain cannot be estimated (too little tissue, saturated, a dark
fluorescence-like image, a single colour, stain vectors with negative OD, anything non-finite)
gets a :class:`StainEstimate` with ``ok_for(method) == (False, reason)``; its tiles are left
as they are (:meth:`StainNormaliser.apply` returns them unchanged), and the stages log a warning
and record the reason per slide. Nothing raises and nothing becomes NaN.

HED jitter (Tellez et al. 2018, 2019) and stain mixing (:func:`hed_jitter`, :func:`mix_stains`)
are the augmentations in optical-density space; :mod:`wsi_pipeline.data.augment` draws them once
per bag.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "ALPHA", "BETA", "IO", "METHODS", "MIN_TISSUE_PIXELS", "RGB_FROM_HED", "StainEstimate", "StainNormaliser",
    "estimate_stain", "fit_target", "hed_jitter", "mix_stains", "od_to_rgb", "order_stains", "rgb_to_od",
]

#: Normalisation methods (``data.stain.normalise``).
METHODS: tuple[str, ...] = ("none", "macenko", "reinhard")
#: Background (glass) transmitted intensity of the OD definition (0..255 scale).
IO = 240.0
#: OD threshold of a tissue pixel (every channel).
BETA = 0.15
#: Angle percentile of Macenko's stain vectors (and 100 - ALPHA).
ALPHA = 1.0
#: Percentile of the concentrations that sets ``max_c``.
MAX_C_PERCENTILE = 99.0
#: Fewest tissue pixels an estimate needs.
MIN_TISSUE_PIXELS = 200
#: A sample whose median channel-mean OD exceeds this is dark (grey below about 32: a fluorescence
#: background, or a failed scan). Dense, dark H&E tissue stays well below it (the synthetic stores'
#: all-lesion tiles: 1.3).
DARK_MEDIAN_OD = 2.0
#: A sample with more of its tissue pixels clipped at 0 in some channel than this is saturated.
SATURATED_FRACTION = 0.25
#: Smallest angle (radians) between the two stain vectors of a usable estimate (~1 degree).
MIN_STAIN_ANGLE = 0.0175
#: Smallest component of a unit stain vector: an absorbing stain has no (clearly) negative OD in any channel.
MIN_STAIN_OD = -0.2
#: Ruifrok & Johnston's haematoxylin, eosin and DAB OD vectors (rows), as scikit-image's ``rgb_from_hed``.
RGB_FROM_HED = ((0.65, 0.70, 0.29), (0.07, 0.99, 0.11), (0.27, 0.57, 0.78))
#: scikit-image's ``rgb2hed`` divides the natural-log OD by ``ln(1e6)``; our HED values do not.
SKIMAGE_HED_UNIT = math.log(1e6)
_FORMAT = "stain-normaliser-v1"


@dataclass(frozen=True)
class StainEstimate:
    """One slide's (or the target's) stain, as plain numbers.

    Attributes
    ----------
    he : 3 x 2, the unit OD vectors of haematoxylin (column 0) and eosin (column 1), rows R, G, B.
    max_c : 99th percentile of the H and E concentrations (OD units).
    lab_mean, lab_std : mean and standard deviation of L*, a*, b* over the tissue pixels.
    n_pixels, n_tissue : pixels sampled, and tissue pixels among them.
    macenko_problem, reinhard_problem : why that method cannot use this estimate ("" = it can).
    """

    he: tuple[tuple[float, float], tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0))
    max_c: tuple[float, float] = (0.0, 0.0)
    lab_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    lab_std: tuple[float, float, float] = (0.0, 0.0, 0.0)
    n_pixels: int = 0
    n_tissue: int = 0
    macenko_problem: str = ""
    reinhard_problem: str = ""

    def ok_for(self, method: str) -> tuple[bool, str]:
        """``(usable, reason)`` for normalisation ``method`` (``none`` is always usable)."""
        problem = {"macenko": self.macenko_problem, "reinhard": self.reinhard_problem}.get(method, "")
        return (not problem, problem)

    def to_dict(self) -> dict[str, Any]:
        """Plain containers (lists, floats, ints, strings): JSON and ``weights_only`` checkpoints hold them exactly."""
        return {"he": [list(r) for r in self.he], "max_c": list(self.max_c), "lab_mean": list(self.lab_mean),
                "lab_std": list(self.lab_std), "n_pixels": int(self.n_pixels), "n_tissue": int(self.n_tissue),
                "macenko_problem": self.macenko_problem, "reinhard_problem": self.reinhard_problem}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StainEstimate:
        """The inverse of :meth:`to_dict` (``ValueError`` naming a missing or malformed key)."""
        try:
            he = tuple(tuple(float(v) for v in row) for row in d["he"])
            max_c, lab_mean, lab_std = (tuple(float(v) for v in d[k]) for k in ("max_c", "lab_mean", "lab_std"))
            n_pixels, n_tissue = int(d["n_pixels"]), int(d["n_tissue"])
            macenko_problem, reinhard_problem = str(d["macenko_problem"]), str(d["reinhard_problem"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"stain estimate {dict(d)!r:.200}: {e!r}; expected the keys of StainEstimate.to_dict") from e
        if len(he) != 3 or any(len(r) != 2 for r in he) or len(max_c) != 2 or len(lab_mean) != 3 or len(lab_std) != 3:
            raise ValueError(f"stain estimate has he {he}, max_c {max_c}: expected 3 x 2 and 2 values")
        return cls(he=((he[0][0], he[0][1]), (he[1][0], he[1][1]), (he[2][0], he[2][1])), max_c=(max_c[0], max_c[1]),
                   lab_mean=(lab_mean[0], lab_mean[1], lab_mean[2]), lab_std=(lab_std[0], lab_std[1], lab_std[2]),
                   n_pixels=n_pixels, n_tissue=n_tissue, macenko_problem=macenko_problem, reinhard_problem=reinhard_problem)


# ----------------------------------------------------------------------------------------------
# Colour spaces
# ----------------------------------------------------------------------------------------------


def rgb_to_od(x: torch.Tensor) -> torch.Tensor:
    """OD ``-ln((255 x + 1) / Io)`` of float images ``x`` in [0, 1] (any shape); same dtype and device."""
    return -torch.log((x * 255.0 + 1.0) / IO)


def od_to_rgb(od: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rgb_to_od`, clipped to [0, 1]."""
    return ((IO * torch.exp(-od) - 1.0) / 255.0).clamp(0.0, 1.0)


def _mix(m: Sequence[Sequence[float]], x: torch.Tensor) -> torch.Tensor:
    """``y[:, r] = sum_c m[r][c] x[:, c]`` for ``x`` (k, C, H, W): written element-wise so a tile's result
    never depends on the batch it is in."""
    rows = []
    for r in m:
        acc = x[:, 0] * float(r[0])
        for c in range(1, len(r)):
            acc = acc + x[:, c] * float(r[c])
        rows.append(acc)
    return torch.stack(rows, 1)


def _lab(x: torch.Tensor) -> torch.Tensor:
    from kornia.color import rgb_to_lab

    return rgb_to_lab(x)


def _rgb(lab: torch.Tensor) -> torch.Tensor:
    from kornia.color import lab_to_rgb

    return lab_to_rgb(lab, clip=True)


# ----------------------------------------------------------------------------------------------
# Estimation
# ----------------------------------------------------------------------------------------------


def _percentile(v: torch.Tensor, q: float) -> float:
    """``numpy.percentile(v, q)`` (linear interpolation) of a 1-D tensor."""
    s = torch.sort(v).values
    pos = q / 100.0 * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def _as_uint8_pixels(tiles: Any) -> torch.Tensor:
    """uint8 tiles (k, T, T, 3) -> (n, 3) uint8 pixels on the CPU."""
    t = torch.as_tensor(np.asarray(tiles) if not isinstance(tiles, torch.Tensor) else tiles).detach().cpu()
    if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
        raise ValueError(f"tiles must be uint8 (k, T, T, 3) RGB; got {t.dtype} {tuple(t.shape)}")
    return t.reshape(-1, 3)


def estimate_stain(tiles: Any) -> StainEstimate:
    """The stain of a sample of one slide's tiles (uint8 ``(k, T, T, 3)`` RGB), pooled over their pixels.

    Computed on the CPU in float64 (once per slide; MPS has no float64). Never raises on odd
    content: a sample that cannot be estimated gets its reason in ``macenko_problem`` /
    ``reinhard_problem`` (see the module docstring).
    """
    px = _as_uint8_pixels(tiles)
    n = int(px.shape[0])
    if n == 0:
        return StainEstimate(macenko_problem="no tiles", reinhard_problem="no tiles")
    od_lut = -torch.log((torch.arange(256, dtype=torch.float64) + 1.0) / IO)
    od = od_lut[px.long()]  # (n, 3), exact per grey level
    tissue = (od >= BETA).any(1)
    nt = int(tissue.sum())
    common = ""
    if float(od.mean(1).median()) > DARK_MEDIAN_OD:
        common = f"dark image (median optical density {float(od.mean(1).median()):.2f} > {DARK_MEDIAN_OD}: fluorescence?)"
    elif nt < MIN_TISSUE_PIXELS:
        common = f"too little tissue ({nt} of {n} pixels reach optical density {BETA} in some channel; {MIN_TISSUE_PIXELS} needed)"
    elif float((px[tissue] == 0).any(1).double().mean()) > SATURATED_FRACTION:
        common = (f"saturated ({100 * float((px[tissue] == 0).any(1).double().mean()):.0f} % of tissue pixels are clipped at 0; "
                  f"more than {100 * SATURATED_FRACTION:.0f} %)")
    if common:
        return StainEstimate(n_pixels=n, n_tissue=nt, macenko_problem=common, reinhard_problem=common)
    odt = od[tissue]
    he, max_c, mac_problem = _macenko(odt)
    lab_mean, lab_std, rh_problem = _reinhard_stats(px[tissue])
    return StainEstimate(he=he, max_c=max_c, lab_mean=lab_mean, lab_std=lab_std, n_pixels=n, n_tissue=nt,
                         macenko_problem=mac_problem, reinhard_problem=rh_problem)


def order_stains(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(haematoxylin, eosin)`` of two stain vectors: the one with the larger red OD is haematoxylin
    (Macenko et al.'s rule; a nearest-reference-vector rule can give both stains the same vector,
    HistomicsTK issue 556)."""
    return (a, b) if float(a[0]) > float(b[0]) else (b, a)


def _macenko(odt: torch.Tensor) -> tuple[Any, Any, str]:
    """(he 3 x 2, max_c, problem) of tissue-pixel ODs (m, 3) float64."""
    zero_he = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0))
    centred = odt - odt.mean(0)
    cov = centred.T @ centred / max(1, len(odt) - 1)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    if not bool(torch.isfinite(evals).all()) or float(evals[2]) <= 0:
        return zero_he, (0.0, 0.0), "no stain variation (a flat colour)"
    v1, v2 = evecs[:, 2], evecs[:, 1]
    if float(v1.sum()) < 0:  # eigenvectors have no sign: the principal one points into positive OD
        v1 = -v1
    if float(evals[1]) <= 1e-9 * float(evals[2]):
        return zero_he, (0.0, 0.0), "a single colour (no second stain direction)"
    proj1, proj2 = odt @ v1, odt @ v2
    phi = torch.atan2(proj2, proj1)
    lo, hi = _percentile(phi, ALPHA), _percentile(phi, 100.0 - ALPHA)
    a = v1 * math.cos(lo) + v2 * math.sin(lo)
    b = v1 * math.cos(hi) + v2 * math.sin(hi)
    h, e = order_stains(a, b)
    h, e = h / h.norm(), e / e.norm()
    if float(torch.dot(h, e).clamp(-1, 1).arccos()) < MIN_STAIN_ANGLE:
        return zero_he, (0.0, 0.0), "one stain only (the two stain vectors are within 1 degree)"
    he_t = torch.stack([h, e], 1)  # (3, 2)
    if not bool(torch.isfinite(he_t).all()):
        return zero_he, (0.0, 0.0), "non-finite stain vectors"
    if float(he_t.min()) < MIN_STAIN_OD:
        vecs = "; ".join(", ".join(f"{v:.2f}" for v in col) for col in he_t.T.tolist())
        return zero_he, (0.0, 0.0), f"stain vectors with negative optical density ({vecs}): not a brightfield stain?"
    conc = odt @ torch.linalg.pinv(he_t).T  # (m, 2)
    max_c = (_percentile(conc[:, 0], MAX_C_PERCENTILE), _percentile(conc[:, 1], MAX_C_PERCENTILE))
    if not all(math.isfinite(c) and c > 1e-6 for c in max_c):
        return zero_he, (0.0, 0.0), f"a stain is absent (99th percentile concentrations {max_c[0]:.3g}, {max_c[1]:.3g})"
    he = tuple(tuple(float(v) for v in row) for row in he_t.tolist())
    return he, (float(max_c[0]), float(max_c[1])), ""


def _reinhard_stats(px: torch.Tensor) -> tuple[Any, Any, str]:
    """(mean, std, problem) of L*a*b* over uint8 pixels (m, 3)."""
    x = (px.double() / 255.0).T.reshape(1, 3, -1, 1)
    lab = _lab(x).reshape(3, -1)
    mean, std = lab.mean(1), lab.std(1, correction=0)
    if not bool(torch.isfinite(mean).all() and torch.isfinite(std).all()):
        return (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), "non-finite colour statistics"
    if float(std.min()) < 1e-3:
        return (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), "a flat colour channel (L*a*b* std " + ", ".join(f"{v:.2g}" for v in std.tolist()) + ")"
    return tuple(float(v) for v in mean), tuple(float(v) for v in std), ""


def fit_target(estimates: Iterable[StainEstimate], method: str) -> tuple[StainEstimate, int]:
    """The training split's target: per value the median over the slides that can use it (H and E
    vectors re-normalised to unit length; Macenko values over the slides Macenko can use, L*a*b*
    statistics over those Reinhard can use); ``(target, slides used by method)``.

    Raises ``ValueError`` when no slide's estimate is usable by ``method``, naming the reasons found.
    """
    ests = list(estimates)
    mac = [e for e in ests if e.ok_for("macenko")[0]]
    rh = [e for e in ests if e.ok_for("reinhard")[0]]
    usable = mac if method == "macenko" else rh
    if not usable:
        reasons = sorted({e.ok_for(method)[1] for e in ests})
        raise ValueError(f"no training slide's stain could be estimated for {method} normalisation ({'; '.join(reasons)[:300]}); "
                         "set data.stain.normalise: none, or data.stain.target to a slide whose stain can be estimated")
    out: dict[str, Any] = {"n_pixels": sum(e.n_pixels for e in usable), "n_tissue": sum(e.n_tissue for e in usable)}
    if mac:
        he = np.median(np.array([e.he for e in mac]), axis=0)
        he = he / np.linalg.norm(he, axis=0, keepdims=True)
        out.update(he=tuple(tuple(float(v) for v in r) for r in he),
                   max_c=tuple(float(v) for v in np.median([e.max_c for e in mac], 0)))
    else:
        out["macenko_problem"] = "no training slide's stain vectors could be estimated"
    if rh:
        out.update(lab_mean=tuple(float(v) for v in np.median([e.lab_mean for e in rh], 0)),
                   lab_std=tuple(float(v) for v in np.median([e.lab_std for e in rh], 0)))
    else:
        out["reinhard_problem"] = "no training slide's colour statistics could be estimated"
    return StainEstimate(**out), len(usable)


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------


def _pinv(he: Sequence[Sequence[float]]) -> list[list[float]]:
    """2 x 3 pseudo-inverse of a 3 x 2 stain matrix (float64)."""
    return np.linalg.pinv(np.asarray(he, np.float64)).tolist()


@dataclass(frozen=True)
class StainNormaliser:
    """A fitted normaliser: ``method`` (``none``, ``macenko``, ``reinhard``), its ``target`` estimate
    and where the target came from (``target_name``: ``train`` or a slide id).

    :meth:`state` / :meth:`from_state` round-trip it through plain containers exactly (checkpoints,
    ``stain.json``).
    """

    method: str = "none"
    target: StainEstimate = field(default_factory=StainEstimate)
    target_name: str = "train"
    n_target_slides: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"stain normalisation {self.method!r}; expected one of {list(METHODS)}")

    def usable(self, source: StainEstimate) -> tuple[bool, str]:
        """Whether a slide of estimate ``source`` is normalised, and if not why ("" for ``none``)."""
        if self.method == "none":
            return False, ""
        return source.ok_for(self.method)

    def apply(self, x: torch.Tensor, source: StainEstimate) -> torch.Tensor:
        """Normalise float images ``x`` (k, 3, H, W) in [0, 1] of one slide of estimate ``source``.

        Returns a new tensor of ``x``'s dtype and device, in [0, 1]; ``x`` itself when the
        method is ``none`` or ``source`` cannot be used (the slide's fallback).
        """
        ok, _ = self.usable(source)
        if not ok or x.shape[0] == 0:
            return x
        if self.method == "macenko":
            od = rgb_to_od(x)
            conc = _mix(_pinv(source.he), od)
            scale = [t / s for t, s in zip(self.target.max_c, source.max_c)]
            conc = conc * torch.tensor(scale, dtype=x.dtype, device=x.device).view(1, 2, 1, 1)
            return od_to_rgb(_mix(self.target.he, conc))
        lab = _lab(x)
        gain = torch.tensor([t / s for t, s in zip(self.target.lab_std, source.lab_std)], dtype=x.dtype, device=x.device)
        src_mean = torch.tensor(source.lab_mean, dtype=x.dtype, device=x.device)
        tgt_mean = torch.tensor(self.target.lab_mean, dtype=x.dtype, device=x.device)
        lab = (lab - src_mean.view(1, 3, 1, 1)) * gain.view(1, 3, 1, 1) + tgt_mean.view(1, 3, 1, 1)
        return _rgb(lab)

    def tag(self, source: StainEstimate) -> str:
        """What a slide's normalised tiles depend on, as a short string (the frozen features' cache key):
        ``none``, or the method and a hash of the target and the slide's estimate (``none`` too for a
        slide that falls back)."""
        if not self.usable(source)[0]:
            return "none"
        blob = json.dumps([self.method, self.target.to_dict(), source.to_dict()], sort_keys=True).encode()
        return f"{self.method}:{hashlib.sha256(blob).hexdigest()[:16]}"

    def state(self) -> dict[str, Any]:
        """Plain-container state: ``method`` names the normalisation (``none``/``macenko``/``reinhard``)."""
        return {"format": _FORMAT, "method": self.method, "target_name": self.target_name,
                "n_target_slides": int(self.n_target_slides), "target": self.target.to_dict(),
                "constants": {"io": IO, "beta": BETA, "alpha": ALPHA, "max_c_percentile": MAX_C_PERCENTILE}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StainNormaliser:
        """The inverse of :meth:`state`; ``ValueError`` for another format or other constants."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"stain normaliser state has format {state.get('format')!r}; expected {_FORMAT!r}")
        consts = {"io": IO, "beta": BETA, "alpha": ALPHA, "max_c_percentile": MAX_C_PERCENTILE}
        if dict(state.get("constants", {})) != consts:
            raise ValueError(f"stain normaliser saved with constants {state.get('constants')}; this version uses {consts}")
        return cls(method=str(state["method"]), target=StainEstimate.from_dict(state["target"]),
                   target_name=str(state.get("target_name", "train")), n_target_slides=int(state.get("n_target_slides", 0)))


# ----------------------------------------------------------------------------------------------
# Augmentation in optical-density space
# ----------------------------------------------------------------------------------------------


def hed_jitter(x: torch.Tensor, scale: Sequence[float], shift: Sequence[float]) -> torch.Tensor:
    """Tellez et al.'s HED augmentation: ``s_c -> scale_c * s_c + shift_c`` for the haematoxylin,
    eosin and DAB channels ``s`` of Ruifrok & Johnston's colour deconvolution.

    ``x``: float images (k, 3, H, W) in [0, 1]. HED values are optical densities (natural log):
    ``-ln(max(x, 1e-6))`` times ``inv(RGB_FROM_HED)``, the deconvolution scikit-image's ``rgb2hed``
    computes without its division by ``ln(1e6)`` (:data:`SKIMAGE_HED_UNIT`: a shift of 0.05 here is
    0.0036 in ``rgb2hed`` units; 0.05 in ``rgb2hed`` units darkens H&E tissue by about 85 grey
    levels) and without its clipping of negative values to 0, so scale 1 and shift 0 return ``x``
    (to rounding). Returns a new tensor in [0, 1].
    """
    od = -torch.log(x.clamp_min(1e-6))
    inv = np.linalg.inv(np.asarray(RGB_FROM_HED, np.float64))  # row vector convention: hed = od @ inv
    hed = _mix(inv.T.tolist(), od)
    hed = hed * torch.tensor(list(scale), dtype=x.dtype, device=x.device).view(1, 3, 1, 1) \
        + torch.tensor(list(shift), dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    od2 = _mix(np.asarray(RGB_FROM_HED, np.float64).T.tolist(), hed)
    return torch.exp(-od2).clamp(0.0, 1.0)


def mix_stains(x: torch.Tensor, source: StainEstimate, donor: StainEstimate, weight: float) -> torch.Tensor:
    """Stain mixing: re-stain tiles of stain ``source`` with ``(1 - w) source + w donor``.

    The tiles' H and E concentrations (w.r.t. ``source``) are rescaled by
    ``(1 - w) + w max_c_donor / max_c_source`` and recombined with the column-normalised mixture of
    the two stain matrices; what lies off the source's stain plane (the OD residual) is kept, so
    ``w = 0`` returns the tiles (to rounding) and ``w = 1`` is Macenko normalisation to ``donor``
    plus that residual. ``x`` is returned unchanged when either estimate is unusable for Macenko.
    """
    if not (source.ok_for("macenko")[0] and donor.ok_for("macenko")[0]) or x.shape[0] == 0:
        return x
    w = float(weight)
    od = rgb_to_od(x)
    conc = _mix(_pinv(source.he), od)
    residual = od - _mix(source.he, conc)
    he = (1 - w) * np.asarray(source.he) + w * np.asarray(donor.he)
    he = he / np.linalg.norm(he, axis=0, keepdims=True)
    scale = [(1 - w) + w * d / s for d, s in zip(donor.max_c, source.max_c)]
    conc = conc * torch.tensor(scale, dtype=x.dtype, device=x.device).view(1, 2, 1, 1)
    return od_to_rgb(_mix(he.tolist(), conc) + residual)
