"""The ``data`` section: manifest, tile stores, feature files, classes, expected tiling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wsi_pipeline.config.choices import BagUnit
from wsi_pipeline.config.limits import MAX_COUNT
from wsi_pipeline.config.schema import Checked, spec
from wsi_pipeline.config.store_settings import StoreSettings

__all__ = ["DataConfig", "FeaturesInputConfig", "StainConfig", "STAIN_NORMALISERS"]

#: ``data.features.format`` values (``wsi_pipeline.data.feature_formats.FEATURE_FORMATS``, kept equal by a test).
FeaturesFormat = Literal["auto", "trident", "clam", "stamp", "wsi-pipeline"]

#: ``data.stain.normalise`` values (``wsi_pipeline.data.stain.METHODS``, kept equal by a test).
StainNormalise = Literal["none", "macenko", "reinhard"]
STAIN_NORMALISERS: tuple[str, ...] = ("none", "macenko", "reinhard")


@dataclass(frozen=True)
class StainConfig(Checked):
    """Stain normalisation (``data.stain``), fitted once at training time and stored with the model.

    Attributes
    ----------
    normalise : ``none``, ``macenko`` or ``reinhard``.
    target : ``train`` (the medians of the training slides' estimates) or the ``slide_id`` of a
        reference slide (any slide of the manifest with a tile store).
    max_tiles : tiles per slide read (evenly spaced) for its stain estimate.
    """

    normalise: StainNormalise = "none"
    target: str = "train"
    max_tiles: int = field(default=32, metadata=spec(ge=1, le=MAX_COUNT))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.target:
            raise ValueError("data.stain.target is empty; expected `train` or a slide_id")


@dataclass(frozen=True)
class FeaturesInputConfig(Checked):
    """Precomputed feature files as the cohort's input (``data.features``), instead of tile stores.

    Attributes
    ----------
    dir : the folder of ``<slide_id>.h5`` (or CLAM's ``<slide_id>.pt``) files; a CLAM output folder
        (``h5_files/``, ``pt_files/``) or a TRIDENT job folder with one ``features_<encoder>/`` works too.
    format : ``auto`` (detected per file), ``trident``, ``clam``, ``stamp`` or ``wsi-pipeline``
        (:mod:`wsi_pipeline.data.feature_formats`; ``docs/interop.md``).
    """

    dir: str
    format: FeaturesFormat = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.dir:
            raise ValueError("data.features.dir is empty; expected the folder of the feature files")


@dataclass(frozen=True)
class DataConfig(Checked):
    """Where the cohort lives.

    Attributes
    ----------
    manifest : manifest CSV (train/val splits are read from its ``split`` column).
    tiles_dir : folder of ``<slide_id>.zarr`` tile stores; may be left out when ``features`` is given.
    n_classes : number of classes C of a classification pipeline; labels must lie in ``[0, C)``.
        Survival and regression pipelines need none (their targets are the manifest's ``time`` and
        ``event``, or ``target``, columns).
    features_dir : root of frozen-encoder feature files; a frozen method reads
        ``<features_dir>/<encoder name>`` unless the method sets its own ``features_dir``.
    tiling : the tiling the stores are expected to have (:class:`~wsi_pipeline.config.store_settings.StoreSettings`,
        every key optional; the detector's keys, e.g. ``grey_max``, beside the others).
    bags : ``slide`` (default: a bag is one slide's tiles) or ``patient``: one bag per patient,
        the tiles of all its slides (``patient_id``), in training and evaluation; every record and
        prediction row is then a patient's (its ``slide_id`` is the patient id). Not for PatchGD.
    stain : stain normalisation (:class:`StainConfig`).
    features : precomputed feature files (TRIDENT, CLAM, STAMP or ours) as the input
        (:class:`FeaturesInputConfig`); its methods are ``strategy: frozen`` with ``encoder: {name: precomputed}``.
    """

    manifest: str
    tiles_dir: str | None = None
    n_classes: int | None = field(default=None, metadata=spec(ge=2))
    features_dir: str = "features"
    tiling: StoreSettings = field(default_factory=StoreSettings, metadata=spec(parse=StoreSettings.from_section))
    bags: BagUnit = "slide"
    stain: StainConfig = field(default_factory=StainConfig)
    features: FeaturesInputConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiles_dir is None and self.features is None:
            raise ValueError("data has neither tiles_dir (the folder of the tile stores) nor features (precomputed "
                             "feature files: `features: {dir: DIR, format: auto}`); give one of them")
        if self.features is not None and self.stain.normalise != "none":  # (checked here: tiles are needed)
            raise ValueError(f"data.stain.normalise={self.stain.normalise!r} with data.features: precomputed features "
                             "were embedded already and cannot be stain-normalised; use normalise: none")
        if self.bags == "patient" and self.stain.normalise != "none":
            # a patient bag mixes slides, each with its own stain estimate; one normaliser per bag would be wrong
            raise ValueError(f"data.bags=patient with data.stain.normalise={self.stain.normalise!r} is not supported: "
                             "a patient's slides each need their own normalisation; use bags: slide, or normalise: none")

    def stores_dir(self) -> str:
        """``tiles_dir``; ``ValueError`` for a pipeline of precomputed feature files that has none."""
        if self.tiles_dir is None:
            raise ValueError("this pipeline has no tile stores (data.tiles_dir is not set; it reads data.features), "
                             "but this step needs them")
        return self.tiles_dir
