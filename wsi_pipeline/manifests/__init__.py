"""Cohort manifests: the CSV schema every stage reads, and builders for the public cohorts."""

from wsi_pipeline.manifests.schema import (
    MANIFEST_COLUMNS,
    SPLITS,
    ManifestError,
    read_manifest,
    validate_manifest,
    write_manifest,
)

__all__ = ["MANIFEST_COLUMNS", "SPLITS", "ManifestError", "read_manifest", "validate_manifest", "write_manifest"]
