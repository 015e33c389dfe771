"""Training on precomputed feature files (``data.features``: TRIDENT, CLAM, STAMP or ours) instead of tile stores.

The cohort's slides are the manifest's rows whose feature file exists in the features folder
(:func:`wsi_pipeline.data.feature_formats.feature_folder`); every file is read once before training, in the
pipeline's ``data.features.format`` (refused by name when it lacks what its format requires), and the
``precomputed`` encoder gets its width D from them (:func:`resolve_precomputed`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from wsi_pipeline.config.pipeline import PipelineConfig
from wsi_pipeline.data.bags import Slide
from wsi_pipeline.data.feature_formats import SlideFeatures, feature_file, feature_folder, read_slide_features

__all__ = ["check_feature_files", "feature_dim", "features_input_dir", "resolve_precomputed", "slide_features", "with_feature_files"]

log = logging.getLogger(__name__)


def features_input_dir(config: PipelineConfig) -> Path:
    """The folder of the pipeline's per-slide feature files (``data.features.dir``, resolved)."""
    assert config.data.features is not None
    return feature_folder(config.data.features.dir)


def with_feature_files(config: PipelineConfig, slides: Sequence[Slide]) -> list[Slide]:
    """``slides`` whose ``store`` is their feature file (``<dir>/<slide_id>.h5`` or ``.pt``) instead of a tile store."""
    folder = features_input_dir(config)
    return [dataclasses.replace(s, store=feature_file(folder, s.slide_id)) for s in slides]


def check_feature_files(config: PipelineConfig, slides: Sequence[Slide], *, split: str, strict: bool = False) -> tuple[list[Slide], int]:
    """The slides whose feature file reads in ``data.features.format`` with at least one row, and the width D.

    Raises ``FileNotFoundError`` naming the slides without a file, ``ValueError`` naming a file that lacks
    what its format requires or whose width differs from the others'. Files with 0 rows are left out with
    a warning (refused with ``strict``).
    """
    assert config.data.features is not None
    fmt = config.data.features.format
    missing = [s.slide_id for s in slides if not Path(s.store).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} {split} slide(s) of the manifest have no feature file (<slide_id>.h5 or .pt) in "
            f"{features_input_dir(config)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
            "fix data.features.dir or the manifest's slide_id column")
    kept: list[Slide] = []
    empty: list[Slide] = []
    dim, first = 0, None
    for s in slides:
        sf = read_slide_features(s.store, fmt)
        if dim and sf.feature_dim != dim:
            raise ValueError(f"feature file {s.store} has {sf.feature_dim} features per tile; {first} has {dim}: every "
                             "file of a cohort must come from one encoder")
        dim, first = dim or sf.feature_dim, first or s.store
        (kept if len(sf) else empty).append(s)
    if empty:
        msg = f"{len(empty)} {split} slide(s) have feature files with 0 rows and are left out: {', '.join(s.slide_id for s in empty[:8])}"
        if strict:
            raise ValueError(msg + "; --strict makes this an error")
        log.warning(msg)
    return kept, dim


def resolve_precomputed(config: PipelineConfig, dim: int) -> PipelineConfig:
    """``config`` with every ``precomputed`` encoder's ``dim`` set to ``dim`` (D of the feature files).

    A method whose ``encoder.dim`` is set to another width is refused (``ValueError``)."""
    methods = []
    for m in config.methods:
        if m.encoder.name == "precomputed":
            if m.encoder.dim is not None and m.encoder.dim != dim:
                raise ValueError(f"method {m.name!r}: encoder.dim={m.encoder.dim}, but the feature files have {dim} "
                                 "features per tile; leave encoder.dim out (it is read from the files)")
            m = dataclasses.replace(m, encoder=dataclasses.replace(m.encoder, dim=dim))
        methods.append(m)
    return dataclasses.replace(config, methods=tuple(methods))


def feature_dim(config: PipelineConfig) -> int:
    """D of the pipeline's feature files: read from the first training slide's file (any slide's when none has one).

    Raises ``FileNotFoundError`` when the folder holds no feature file of the manifest's slides."""
    from wsi_pipeline.manifests.schema import read_manifest

    folder = features_input_dir(config)
    manifest = read_manifest(config.data.manifest)
    order = list(manifest[manifest["split"] == "train"]["slide_id"].astype(str)) + list(manifest["slide_id"].astype(str))
    assert config.data.features is not None
    for sid in order:
        path = feature_file(folder, sid)
        if path.is_file():
            return read_slide_features(path, config.data.features.format).feature_dim
    raise FileNotFoundError(f"no feature file of the manifest {config.data.manifest}'s slides in {folder} "
                            "(expected <slide_id>.h5 or <slide_id>.pt); fix data.features.dir")


def slide_features(config: PipelineConfig, slide_id: str, mpp: object = None) -> SlideFeatures:
    """One slide's feature file of the pipeline (``data.features``), read in its format with coordinates in
    level-0 px; ``mpp``: the manifest's level-0 um/px (for STAMP's micrometres). ``FileNotFoundError`` when absent."""
    assert config.data.features is not None
    try:
        um_per_px = float(mpp) if mpp is not None and str(mpp) not in ("", "nan") else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        um_per_px = None
    path = feature_file(features_input_dir(config), slide_id)
    return read_slide_features(path, config.data.features.format, mpp=um_per_px)
