"""The parameters of the tiler's building blocks: each tissue detector's (a :class:`DetectorParams` subclass,
registered by name in :data:`DETECTOR_PARAMS`) and tile QC's (:class:`QCParams`).

The detectors' masks live in :mod:`wsi_pipeline.tiling.detectors` (a stage above the config); their
parameters live here so that a config file or the command line is checked before any slide is opened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from wsi_pipeline.config.choices import QC_ARTIFACTS, TILING_METHODS
from wsi_pipeline.config.schema import Checked, build, spec
from wsi_pipeline.models.registry import Registry

__all__ = [
    "DEFAULT_REGION_EXCLUDE", "DETECTOR_PARAMS", "MIN_TILE_SIZE", "DetectorParams", "GreyscaleParams", "OtsuParams",
    "QCParams", "TissueParams", "UNetParams", "detector_names", "json_values", "register_params",
]

#: The smallest tile side the tiler makes (px); every shape of the tiling settings has this bound.
MIN_TILE_SIZE = 8
#: QuPath classifications whose regions exclude tiles by default (QuPath's own "Ignore*" class among them).
DEFAULT_REGION_EXCLUDE: tuple[str, ...] = ("Ignore*", "Exclude", "Excluded", "Background")


class DetectorParams(Checked):
    """Base of a tissue detector's parameters (a frozen :class:`~wsi_pipeline.config.schema.Checked` dataclass).

    Class attributes
    ----------------
    name : the detector's registered name (``tile --method``, ``data.tiling.method``); set by :func:`register_params`.
    min_foreground : the detector's default keep threshold (fraction of a tile).

    :meth:`recorded` gives the settings the store records (compared on resume, saved with a model) and
    :meth:`from_recorded` reads them back; by default the parameters are recorded under the detector's name.
    """

    name: ClassVar[str] = ""
    min_foreground: ClassVar[float] = 0.5

    @classmethod
    def recorded_keys(cls) -> tuple[str, ...]:
        """The keys :meth:`recorded` writes among a store's settings (by default, the detector's name)."""
        return (cls.name,)

    def recorded(self) -> dict[str, Any]:
        """The parameters as the store records them (plain JSON values)."""
        return {self.name: json_values(dataclasses.asdict(self))}  # type: ignore[call-overload]

    @classmethod
    def from_recorded(cls: type[P], settings: Mapping[str, Any], where: str = "") -> P:
        """The parameters from a store's recorded settings (the inverse of :meth:`recorded`; defaults where absent);
        ``where`` names the settings in errors."""
        raw = settings.get(cls.name)
        if raw is None:
            return cls()
        return build(cls, raw, f"{where}.{cls.name}" if where else cls.name)


P = TypeVar("P", bound=DetectorParams)

#: The tissue detectors' parameter classes by name (the masks: :data:`wsi_pipeline.tiling.detectors.DETECTORS`).
DETECTOR_PARAMS: Registry[type[DetectorParams]] = Registry("tissue detector")


def register_params(name: str) -> Any:
    """Class decorator: register a :class:`DetectorParams` subclass as detector ``name``'s parameters."""
    def deco(cls: type[P]) -> type[P]:
        cls.name = name
        DETECTOR_PARAMS.register(name)(cls)
        return cls

    return deco


def detector_names() -> list[str]:
    """The registered tissue detectors, the default first (``tile --method``, ``data.tiling.method``)."""
    names = DETECTOR_PARAMS.names()
    return [TILING_METHODS[0], *[n for n in names if n != TILING_METHODS[0]]]


def json_values(value: Any) -> Any:
    """``value`` as a store's JSON attributes hold it (tuples become lists)."""
    if isinstance(value, Mapping):
        return {k: json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_values(v) for v in value]
    return value


@register_params("tissue")
@dataclass(frozen=True)
class TissueParams(DetectorParams):
    """The ``tissue`` method (:mod:`wsi_pipeline.tiling.density`): stained tissue by optical density
    against each slide's own glass. Sizes are in overview px (the overview has 16 px per tile side).

    Attributes
    ----------
    min_od : an overview pixel is tissue when, in some RGB channel, its optical density
        ``log10(glass / value)`` reaches this (0.03: 6.7 % of the light absorbed; on the
        generated fields glass stays under 0.015 and the palest tissue over 0.05).
    glass_margin_od : the threshold is at least the glass pixels' 99.9th percentile plus this
        (an unevenly lit slide raises it).
    min_object : tissue components smaller than this fraction of a tile's area are dropped (dust).
    max_hole : holes smaller than this fraction of a tile's area are filled.
    """

    min_od: float = field(default=0.03, metadata=spec(gt=0.0))
    glass_margin_od: float = field(default=0.01, metadata=spec(ge=0.0))
    min_object: float = field(default=0.05, metadata=spec(ge=0.0))
    max_hole: float = field(default=0.1, metadata=spec(ge=0.0))


@dataclass(frozen=True)
class QCParams(Checked):
    """Tile artifact QC (:mod:`wsi_pipeline.tiling.artifacts`): thresholds and what ``--qc drop`` drops.

    Attributes
    ----------
    drop : artifacts dropped by ``qc_mode="drop"`` (the others are only flagged).
    pen_fraction : a tile is ``pen`` when at least this fraction of it is ink (green, blue, red
        or black marker, by colour on the overview).
    focus_min : a tile is ``blur`` when its focus measure (:func:`~wsi_pipeline.tiling.artifacts.focus_measure`)
        is below this and it holds stained tissue.
    fold_fraction : a tile is ``fold`` when at least this fraction of it is folded tissue (a
        double layer: optical density at least ``fold_od_ratio`` times the slide's median tissue
        density, in the same colour direction).
    fold_od_ratio : see ``fold_fraction``.
    fold_min_area_um2 : folded regions smaller than this (um^2) are not folds (a fold runs along the section).
    overview_um : um per pixel of the overview ink and folds are judged on (at least: a coarser tiler overview
        is used as it is); a fixed physical scale, so the verdict does not depend on the tile size or the
        magnification. Slides without an mpp are taken to be at 0.5 um/px.
    """

    drop: tuple[str, ...] = ("pen", "blur")
    pen_fraction: float = field(default=0.1, metadata=spec(ge=0.0, le=1.0))
    focus_min: float = field(default=0.12, metadata=spec(gt=0.0))
    fold_fraction: float = field(default=0.25, metadata=spec(ge=0.0, le=1.0))
    fold_od_ratio: float = field(default=2.5, metadata=spec(gt=0.0))
    fold_min_area_um2: float = field(default=20_000.0, metadata=spec(ge=0.0))
    overview_um: float = field(default=16.0, metadata=spec(gt=0.0))

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [a for a in self.drop if a not in QC_ARTIFACTS]
        if bad:
            raise ValueError(f"qc_params.drop={self.drop!r}: unknown artifact(s) {bad}; expected some of {QC_ARTIFACTS}")


@register_params("otsu")
@dataclass(frozen=True)
class OtsuParams(DetectorParams):
    """Otsu tissue-mask settings; sizes in um / um^2 (independent of the mask resolution).

    Attributes
    ----------
    median_um : median-blur kernel width.
    closing_um : radius of the disk used for morphological closing.
    min_object_um2 : tissue components smaller than this are removed.
    min_hole_um2 : holes smaller than this are filled.
    min_contrast : levels (0..255) below which the image is taken as uniform (a blank slide),
        no tissue: on a bright background with glass, between the upper Otsu class's mean and
        the glass's median; otherwise between the two Otsu class means.
    glass_margin : levels (0..255) of the thresholded channel above the glass's 99th
        percentile at which a pixel is tissue even when Otsu's threshold is higher.
    background : ``"auto"`` (dark when :func:`~wsi_pipeline.tiling.background.estimate_background`
        says so), ``"bright"`` (brightfield) or ``"dark"`` (fluorescence).
    channel : what Otsu thresholds. ``"auto"``: on a bright background the HSV saturation
        (stained tissue, pale stroma included, against grey-white glass, as CLAM does); on a
        dark background the brightest channel (a DAPI-blue nucleus has faint luma).
        ``"grey"``: luma, tissue darker than the threshold (bright) or brighter (dark).
    """

    median_um: float = 30.0
    closing_um: float = 30.0
    min_object_um2: float = 10_000.0
    min_hole_um2: float = 10_000.0
    min_contrast: float = 15.0
    glass_margin: float = 20.0
    background: str = field(default="auto", metadata=spec(choices=("auto", "bright", "dark")))
    channel: str = field(default="auto", metadata=spec(choices=("auto", "grey")))


def _grey_max_value(value: Any, where: str) -> int | str:
    """``grey_max``: a grey level 0..255 or ``"auto"``."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"{where}={value!r}; expected a grey level 0..255 or 'auto'")
    return int(value)


@register_params("greyscale")
@dataclass(frozen=True)
class GreyscaleParams(DetectorParams):
    """The ``greyscale`` detector (the papers' rule, :mod:`wsi_pipeline.tiling.tissue`): a pixel is foreground
    when its BT.601 grey level lies in ``[grey_min, grey_max]``; measured on each decoded tile.

    Attributes
    ----------
    grey_min, grey_max : inclusive grey range of a foreground pixel; ``grey_max="auto"``: each slide's glass grey
        level (estimated from its thumbnail, :mod:`wsi_pipeline.tiling.background`) minus ``grey_auto_margin``,
        or 230 when the slide shows no glass.
    grey_auto_margin : grey levels between the glass level and ``grey_max="auto"`` (10: on CMU-1, 0.06 % of
        level-0 glass pixels lie 10 or more levels below the glass level).
    prescreen : skip tiles the low-resolution bound proves to be background, and decide tiles that are probably
        glass from their top rows first where the stored tiles are JPEG (the kept set is unchanged).
    prescreen_margin : grey levels of slack in that bound.
    """

    min_foreground: ClassVar[float] = 0.6

    grey_min: int = field(default=3, metadata=spec(ge=0, le=255))
    grey_max: int | str = field(default=230, metadata=spec(parse=_grey_max_value))
    grey_auto_margin: int = field(default=10, metadata=spec(ge=0, le=255))
    prescreen: bool = True
    prescreen_margin: float = field(default=8.0, metadata=spec(ge=0.0))

    def __post_init__(self) -> None:
        super().__post_init__()
        _grey_max_value(self.grey_max, "GreyscaleParams.grey_max")
        if not isinstance(self.grey_max, str) and self.grey_min > self.grey_max:
            raise ValueError(f"grey range [{self.grey_min}, {self.grey_max}] must satisfy 0 <= grey_min <= grey_max <= 255")

    @classmethod
    def recorded_keys(cls) -> tuple[str, ...]:
        return ("grey_min", "grey_max", "grey_auto_margin")

    def recorded(self) -> dict[str, Any]:
        """Flat keys ``grey_min``, ``grey_max`` (and ``grey_auto_margin`` with ``"auto"``), as stores always recorded them."""
        out: dict[str, Any] = {"grey_min": int(self.grey_min),
                               "grey_max": self.grey_max if self.grey_max == "auto" else int(self.grey_max)}
        if self.grey_max == "auto":
            out["grey_auto_margin"] = int(self.grey_auto_margin)
        return out

    @classmethod
    def from_recorded(cls, settings: Mapping[str, Any], where: str = "") -> GreyscaleParams:
        return build(cls, {k: settings[k] for k in cls.recorded_keys() if settings.get(k) is not None}, where)


@register_params("unet")
@dataclass(frozen=True)
class UNetParams(DetectorParams):
    """The ``unet`` detector (:mod:`wsi_pipeline.tissue_seg`): the whole-image tissue U-Net's mask, kept within
    the ``tissue`` rule's stained area on brightfield slides.

    Attributes
    ----------
    tissue_model : the model file (``best.pt`` of ``wsi-pipeline tissue train``); None = the shipped one.
        The store records the file's fingerprint, not its path.
    """

    tissue_model: str | None = None

    @classmethod
    def recorded_keys(cls) -> tuple[str, ...]:
        return ("tissue_model_fingerprint",)

    def recorded(self) -> dict[str, Any]:
        return {}  # the model file's fingerprint: wsi_pipeline.tiling.detectors (it reads the file)

    @classmethod
    def from_recorded(cls, settings: Mapping[str, Any], where: str = "") -> UNetParams:
        return cls()  # a model file is identified by its fingerprint only: the shipped one is used
