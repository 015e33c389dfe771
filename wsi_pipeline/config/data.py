"""The ``data`` section: manifest, tile stores, feature files, classes, expected tiling."""

from __future__ import annotations

from dataclasses import dataclass, field

from wsi_pipeline.config.choices import BagUnit
from wsi_pipeline.config.tiling import StoreTiling

__all__ = ["DataConfig"]


@dataclass(frozen=True)
class DataConfig:
    """Where the cohort lives.

    Attributes
    ----------
    manifest : manifest CSV (train/val splits are read from its ``split`` column).
    tiles_dir : folder of ``<slide_id>.zarr`` tile stores.
    n_classes : number of classes C of a classification pipeline; labels must lie in ``[0, C)``.
        Survival and regression pipelines need none (their targets are the manifest's ``time`` and
        ``event``, or ``target``, columns).
    features_dir : root of frozen-encoder feature files; a frozen method reads
        ``<features_dir>/<encoder name>`` unless the method sets its own ``features_dir``.
    tiling : tiling parameters (saved for ``predict``).
    bags : ``slide`` (default: a bag is one slide's tiles) or ``patient``: one bag per patient,
        the tiles of all its slides (``patient_id``), in training and evaluation; every record and
        prediction row is then a patient's (its ``slide_id`` is the patient id). Not for PatchGD.
    """

    manifest: str
    tiles_dir: str
    n_classes: int | None = None
    features_dir: str = "features"
    tiling: StoreTiling = field(default_factory=StoreTiling)
    bags: BagUnit = "slide"

    def __post_init__(self) -> None:
        if self.n_classes is not None and self.n_classes < 2:
            raise ValueError(f"data.n_classes={self.n_classes}; expected >= 2 (binary tasks use 2)")
