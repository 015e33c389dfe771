"""The one shape of tiling settings: :class:`StoreSettings`.

A tile store records the settings that made it (``tiling_identity`` of its attributes, compared on
resume); training checks that its stores agree and saves their settings with the model, so
``predict`` tiles new slides as the training data was tiled; the pipeline's ``data.tiling`` section
says what it expects of its stores. All four are a :class:`StoreSettings`: every field optional
(``None``: not given, e.g. taken from the stores), bounds checked on construction.

:meth:`StoreSettings.to_state` gives the settings as a store records them (plain JSON, the keys the
stores have always had, plus ``schema_version``); :meth:`StoreSettings.from_state` reads any
recorded settings back, through :func:`migrate`, the one place that knows older stores.

Schema versions
---------------
1. Stores and checkpoints before ``StoreSettings`` (no ``schema_version`` key). Settings recorded
   before tile QC existed have no ``qc_mode``: those stores were made without QC (``"off"``),
   which is also how ``qc_mode="off"`` is recorded (no QC keys).
2. ``schema_version`` recorded; same keys otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsi_pipeline.config.choices import PointEdge, QCMode
from wsi_pipeline.config.io import short_repr
from wsi_pipeline.failures import ConfigTypeError
from wsi_pipeline.config.limits import MAX_TILE_SIZE
from wsi_pipeline.config.schema import Checked, build, spec
from wsi_pipeline.config.tiling_params import (
    DETECTOR_PARAMS, MIN_TILE_SIZE, QCParams, TissueParams, detector_names, json_values,
)

__all__ = ["SCHEMA_VERSION", "SLIDE_KEYS", "StoreSettings", "migrate", "same_identity"]

#: The version :meth:`StoreSettings.to_state` writes.
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class StoreSettings(Checked):
    """Tiling settings: what a store records, what a model saves and what ``data.tiling`` expects.

    Every field is optional (None: not given). The detector's own settings (e.g. the greyscale band
    ``grey_min``, ``grey_max``; the Otsu parameters under ``otsu``) are in ``detector``, as the
    detector records them (:meth:`~wsi_pipeline.config.tiling_params.DetectorParams.recorded`); in a state or
    a YAML section they are keys beside the others (``data.tiling.grey_max: auto``).

    Attributes
    ----------
    method : the tissue detector (``tile --method``).
    tile_size : tile side in px at the read resolution (>= 8).
    min_foreground : keep a tile at >= this foreground fraction (0..1).
    mpp_target : read resolution in um/px (None in a store: native level 0).
    mpp_tolerance : relative mpp difference within which a level is read without resizing (recorded with
        ``mpp_target``).
    qc_mode : tile artifact QC (``drop``, ``flag``, ``off``); the paper pipelines and the demo set ``off``.
    qc_params : QC thresholds (recorded with QC on).
    tissue : the stained-tissue density settings (recorded when the detector or QC uses them).
    detector : the detector's own recorded settings (keys of its ``recorded_keys()``).
    region_include, region_exclude, region_min_fraction : the regions rule (recorded with ``tile --regions``).
    points : a points file or folder (``data.tiling``: used by ``tile --config``), or in a store True (tiled
        on points; the points themselves are identified per slide).
    points_edge, points_filter : the point tiles' edge rule and whether the foreground rule applies.
    compression, backend : how a store was written and read (recorded; never compared nor reused).
    schema_version : the version of the recorded shape (:data:`SCHEMA_VERSION`).
    """

    method: str | None = field(default=None, metadata=spec(choices=detector_names))
    tile_size: int | None = field(default=None, metadata=spec(ge=MIN_TILE_SIZE, le=MAX_TILE_SIZE))
    min_foreground: float | None = field(default=None, metadata=spec(ge=0.0, le=1.0))
    mpp_target: float | None = field(default=None, metadata=spec(gt=0.0))
    mpp_tolerance: float | None = field(default=None, metadata=spec(ge=0.0))
    qc_mode: QCMode | None = None
    qc_params: QCParams | None = None
    tissue: TissueParams | None = None
    detector: dict[str, Any] | None = None
    region_include: tuple[str, ...] | None = None
    region_exclude: tuple[str, ...] | None = None
    region_min_fraction: float | None = field(default=None, metadata=spec(ge=0.0, le=1.0))
    points: str | bool | None = None
    points_edge: PointEdge | None = None
    points_filter: bool | None = None
    compression: str | None = None
    backend: str | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.detector is not None:  # a key that is a field of its own (``tissue``) is that field's, not the detector's
            own = {f.name for f in dataclasses.fields(self)}
            object.__setattr__(self, "detector", {k: v for k, v in self.detector.items() if k not in own} or None)
        if self.detector:
            _check_detector(self.method, self.detector, type(self).__name__)

    # --- the recorded shape -------------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The settings as a store records them: plain JSON values, fields left None out, the detector's
        settings beside the others."""
        out: dict[str, Any] = {}
        complete = self.method is not None  # recorded settings: the keys stores always had, None included
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "detector" or (value is None and not (complete and f.name in _ALWAYS)):
                continue
            if f.name == "qc_mode" and value == "off" and complete:
                continue  # recorded as no QC keys, as stores always did
            out[f.name] = json_values(dataclasses.asdict(value) if isinstance(value, (QCParams, TissueParams)) else value)
        out.update(json_values(self.detector or {}))
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any], where: str = "tiling settings") -> StoreSettings:
        """Settings recorded by any release (a store's ``tiling_identity``, a checkpoint's ``tiling``), migrated
        (:func:`migrate`); keys that describe the slide rather than the tiling (its fingerprint, mpp) are ignored."""
        return cls._build(migrate(state), where, recorded=True)

    @classmethod
    def from_section(cls, raw: Any, where: str = "data.tiling") -> StoreSettings:
        """The ``data.tiling`` section of a YAML config (every key optional, the detector's keys beside the others)."""
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, Mapping):
            raise ConfigTypeError(f"{where}: expected a mapping of tiling settings, got {type(raw).__name__} {short_repr(raw)}")
        return cls._build({k: v for k, v in raw.items() if v is not None}, where, recorded=False)  # None: not given

    def to_raw(self) -> dict[str, Any]:
        """The ``data.tiling`` section as a config file writes it (:func:`~wsi_pipeline.config.io.config_to_dict`;
        :meth:`from_section` reads it back)."""
        out = {k: v for k, v in self.to_state().items() if k != "schema_version"}
        if self.qc_mode == "off":
            out["qc_mode"] = "off"  # a section says so (a store records it by leaving QC keys out)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def _build(cls, raw: Mapping[str, Any], where: str, *, recorded: bool) -> StoreSettings:
        own = {f.name for f in dataclasses.fields(cls)} - {"detector"}
        keys = _detector_keys()  # any detector's (another detector's keys than the method's are ignored, as always)
        unknown = [k for k in raw if k not in own and k not in keys and not (recorded and k in SLIDE_KEYS)]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in section {where!r}; valid keys: {sorted(own | keys)}")
        kw = {k: v for k, v in raw.items() if k in own}
        if "points" in kw and isinstance(kw["points"], bool):
            kw.pop("points")
        built = build(cls, kw, where)
        detector = {k: raw[k] for k in keys if raw.get(k) is not None and k not in own}
        if recorded and built.method is None and built.tile_size is None:
            raise ValueError(f"{where}: no tiling settings recorded (method, tile_size) in {short_repr(dict(raw))}")
        _check_detector(built.method, detector, where)
        return dataclasses.replace(built, detector=detector or None,
                                   points=raw["points"] if isinstance(raw.get("points"), bool) else built.points)

    # --- what the settings mean ---------------------------------------------------------------------------------
    def detector_state(self) -> dict[str, Any]:
        """The detector's recorded settings with the density settings (``tissue``) beside them: what
        :meth:`~wsi_pipeline.config.tiling_params.DetectorParams.from_recorded` reads."""
        return {**(self.detector or {}), **({"tissue": json_values(dataclasses.asdict(self.tissue))} if self.tissue else {})}

    def disagreements(self, expected: StoreSettings) -> list[str]:
        """``name: expected X vs recorded Y`` for each of method, tile size, keep threshold and mpp target that
        ``expected`` sets and these settings differ in."""
        wrong = []
        for name in ("method", "tile_size", "min_foreground", "mpp_target"):
            want, got = getattr(expected, name), getattr(self, name)
            if want is not None and not (got == want or (isinstance(got, float) and abs(got - float(want)) < 1e-9)):
                wrong.append(f"{name}: expected {want} vs recorded {got}")
        return wrong


#: Keys recorded even when None (``mpp_target`` None: native level 0).
_ALWAYS = frozenset({"mpp_target", "mpp_tolerance"})
#: Keys of a store's ``tiling_identity`` that identify the slide and its run, not the tiling settings.
SLIDE_KEYS = frozenset({"fingerprint", "tile_formula", "mpp_manifest", "mpp_force", "mpp_override", "mpp", "mpp_source",
                        "regions_sha256", "points_sha256"})


def _detector_keys() -> set[str]:
    """The keys the registered detectors record."""
    return {k for n in DETECTOR_PARAMS.names() for k in DETECTOR_PARAMS.get(n).recorded_keys()}


def _check_detector(method: str | None, detector: Mapping[str, Any], where: str) -> None:
    """Bounds of a detector's settings: they build its parameters (of every detector they belong to, without a method)."""
    names = [method] if method else DETECTOR_PARAMS.names()
    for name in names:
        cls = DETECTOR_PARAMS.get(name)
        if set(detector) & set(cls.recorded_keys()):
            cls.from_recorded(detector, where)


def migrate(state: Mapping[str, Any]) -> dict[str, Any]:
    """Recorded settings of any schema version as the current version holds them (every migration is here)."""
    out = dict(state)
    version = int(out.pop("schema_version", 1))
    if version > SCHEMA_VERSION:
        raise ValueError(f"tiling settings of schema version {version}, newer than this release's {SCHEMA_VERSION}: "
                         "upgrade wsi-pipeline")
    # version 1 -> 2: the same keys; nothing to change
    if out.get("method") and "qc_mode" not in out:
        out["qc_mode"] = "off"  # every version: QC off is recorded as no QC keys (and stores before QC had none)
    return {**out, "schema_version": SCHEMA_VERSION}


def same_identity(recorded: Mapping[str, Any], expected: Mapping[str, Any]) -> bool:
    """Whether a store's recorded ``tiling_identity`` (any schema version) equals ``expected`` (this release's): the
    slide's keys as they are, the settings through :meth:`StoreSettings.from_state`."""
    if {k: v for k, v in recorded.items() if k in SLIDE_KEYS} != {k: v for k, v in expected.items() if k in SLIDE_KEYS}:
        return False
    try:
        return StoreSettings.from_state(recorded) == StoreSettings.from_state(expected)
    except (TypeError, ValueError):  # settings this release cannot read: the store is rebuilt
        return False
