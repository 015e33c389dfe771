"""One manifest from an internal cohort and its external test cohorts.

The training stage reads the ``train``/``val`` rows of a manifest and the evaluation stage the
internal ``test`` rows plus every other cohort, so a pipeline's manifest holds both. Rows of an
external cohort are evaluated only: they all get ``split = "test"``, whatever split their own
manifest gave them (CAMELYON16 has official train/test splits, but the Big-Layers paper tests on
the whole of it). Without this, the 270 CAMELYON16 training slides would be trained on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import pandas as pd

from wsi_pipeline.manifests.files import first_few
from wsi_pipeline.manifests.schema import ManifestError, read_manifest
from wsi_pipeline.manifests.sources import finalise

__all__ = ["merge_manifests"]

log = logging.getLogger(__name__)


def merge_manifests(
    internal: Sequence[str | os.PathLike], external: Sequence[str | os.PathLike] = ()
) -> pd.DataFrame:
    """Concatenate manifests; every row of an ``external`` manifest becomes split ``test``.

    Parameters
    ----------
    internal : manifests whose splits are kept (the cohort trained on).
    external : manifests of cohorts only tested on.

    Returns
    -------
    Validated manifest frame, paths absolute (resolved against each input's folder), the
    union of the inputs' columns (missing values empty).

    Raises
    ------
    ManifestError
        A slide id in two inputs, or a cohort both internal and external.
    """
    if not internal:
        raise ValueError("merge_manifests: give at least one internal manifest (the cohort trained on)")
    frames: list[pd.DataFrame] = []
    origin: dict[str, str] = {}
    cohorts: dict[str, set[str]] = {"internal": set(), "external": set()}
    for kind, paths in (("internal", internal), ("external", external)):
        for path in paths:
            df = read_manifest(path)
            clash = df.loc[df["slide_id"].isin(list(origin)), "slide_id"].tolist()
            if clash:
                raise ManifestError(
                    f"{path}: slide id(s) {first_few(clash)} also in {origin[clash[0]]}; slide ids must be unique "
                    "across the merged manifests"
                )
            origin.update(dict.fromkeys(df["slide_id"], str(path)))
            if kind == "external":
                moved = int((df["split"] != "test").sum())
                if moved:
                    log.info("%s: %d row(s) set to split test (external cohort, evaluated only)", path, moved)
                df = df.assign(split="test")
            cohorts[kind].update(df["cohort"])
            frames.append(df)
    both = sorted(cohorts["internal"] & cohorts["external"])
    if both:
        raise ManifestError(f"cohort(s) {both} given as both internal and external; a cohort is one or the other")
    merged = pd.concat(frames, ignore_index=True)
    for col in merged.columns:
        if col not in ("label", "mpp") and merged[col].dtype == object:
            merged[col] = merged[col].fillna("")
    return finalise(merged, source="merged manifest", n_classes=None)
