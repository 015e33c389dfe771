"""PANDA (prostate biopsies, ISUP grade 0-5) manifest from the challenge's own files.

Inputs, as the data's publishers ship them (see ``data_manifests/README.md``):

- the challenge ``train.csv``: ``image_id, data_provider, isup_grade, gleason_score`` (10616 rows);
  label = ``isup_grade``;
- optionally a noise-flag file with ``image_id`` and ``noise_ratio_10``; slides with
  ``noise_ratio_10 == 0`` (1061 of them) are the noisy slides the Big-Layers paper drops;
- optionally a folder with the paper's split, ``train.csv``, ``val.csv``, ``test.csv``, each with a
  slide id column (``image_id``, ``slide_id`` or ``FILENAME``); otherwise a seeded label-stratified
  80:10:10 split (:func:`wsi_pipeline.manifests.splits.stratified_split`).

Slide files are ``<slides_dir>/<image_id>.tiff``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import pandas as pd

from wsi_pipeline.manifests.files import check_files_exist, first_few
from wsi_pipeline.manifests.schema import SPLITS, ManifestError
from wsi_pipeline.manifests.sources import (
    SLIDE_ID_COLUMNS,
    ManifestWarning,
    check_label_range,
    check_one_split_per_slide,
    check_patient_splits,
    check_unique_ids,
    clean_slide_ids,
    finalise,
    pick_column,
    read_table,
)
from wsi_pipeline.manifests.splits import check_fractions, stratified_split

__all__ = ["PANDA_CLASSES", "NOISE_COLUMN", "build_panda_manifest"]

log = logging.getLogger(__name__)

#: ISUP grades 0 (benign) to 5.
PANDA_CLASSES = 6
#: The noise flag the Big-Layers paper (after Song et al. 2024) uses: 0 = noisy, dropped.
NOISE_COLUMN = "noise_ratio_10"
_PATIENT_COLUMNS = ("patient_id", "PATIENT", "case_id")


def _read_labels(path: Path) -> pd.DataFrame:
    """slide_id, label (ISUP grade, Int64) and the kept extra columns of the challenge's train.csv."""
    df = read_table(path, what="PANDA labels (train.csv)")
    id_col = pick_column(df, ("image_id",) + SLIDE_ID_COLUMNS, source=path, what="slide id (image_id)")
    grade_col = pick_column(df, ("isup_grade",), source=path, what="ISUP grade")
    df = df.rename(columns={id_col: "slide_id"})
    df["slide_id"] = clean_slide_ids(df["slide_id"])
    check_unique_ids(df["slide_id"], source=path, column=id_col)
    df["label"] = check_label_range(df, n_classes=PANDA_CLASSES, source=path, column=grade_col)
    if df["label"].isna().any():
        raise ManifestError(f"{path}: empty {grade_col} for slide(s) {first_few(df.loc[df['label'].isna(), 'slide_id'])}")
    keep = [c for c in ("data_provider", "gleason_score") if c in df.columns]
    return df[["slide_id", "label"] + keep]


def _drop_noisy(labels: pd.DataFrame, noise_csv: Path) -> tuple[pd.DataFrame, set[str]]:
    """``labels`` without the noisy slides, and the set of noisy slide ids."""
    noise = read_table(noise_csv, what="PANDA noise-flag file")
    id_col = pick_column(noise, ("image_id",) + SLIDE_ID_COLUMNS, source=noise_csv, what="slide id (image_id)")
    flag_col = pick_column(noise, (NOISE_COLUMN,), source=noise_csv, what="noise flag")
    noise = noise.rename(columns={id_col: "slide_id"})
    noise["slide_id"] = clean_slide_ids(noise["slide_id"])
    check_unique_ids(noise["slide_id"], source=noise_csv, column=id_col)
    flag = pd.to_numeric(noise[flag_col], errors="coerce")
    bad = noise.loc[~flag.isin([0, 1]), "slide_id"]
    if len(bad):
        raise ManifestError(
            f"{noise_csv}: {flag_col} must be 0 (noisy) or 1 (kept); slide(s) {first_few(bad)} have "
            f"{first_few(noise.loc[bad.index, flag_col])}"
        )
    noise = noise.assign(_flag=flag.astype(int)).set_index("slide_id")
    unflagged = labels.loc[~labels["slide_id"].isin(noise.index), "slide_id"]
    if len(unflagged):
        raise ManifestError(
            f"{noise_csv}: no noise flag for {len(unflagged)} of {len(labels)} labelled slide(s): {first_few(unflagged)}; "
            "the noise-flag file must cover every slide of the labels file (is it from the same PANDA release?)"
        )
    if "isup_grade" in noise.columns:
        theirs = pd.to_numeric(noise.loc[labels["slide_id"], "isup_grade"], errors="coerce").to_numpy()
        differ = labels.loc[labels["label"].to_numpy() != theirs, "slide_id"]
        if len(differ):
            raise ManifestError(
                f"{noise_csv}: isup_grade differs from the labels file for {len(differ)} slide(s): {first_few(differ)}; "
                "the two files do not belong together"
            )
    noisy = noise.loc[labels["slide_id"], "_flag"].to_numpy() == 0
    log.info("dropping %d noisy slides (%s == 0) of %d", int(noisy.sum()), NOISE_COLUMN, len(labels))
    return labels.loc[~noisy], set(labels.loc[noisy, "slide_id"])


def _read_split_dir(splits_dir: Path) -> pd.DataFrame:
    """One row per slide: slide_id, split, source file, isup_grade and patient_id when given."""
    if not splits_dir.is_dir():
        raise FileNotFoundError(f"PANDA split folder not found: {splits_dir}; it must hold train.csv, val.csv and test.csv")
    missing = [f"{s}.csv" for s in SPLITS if not (splits_dir / f"{s}.csv").is_file()]
    if missing:
        found = sorted(p.name for p in splits_dir.glob("*.csv"))
        raise FileNotFoundError(f"{splits_dir}: missing {missing}; a split folder holds train.csv, val.csv, test.csv (found {found})")
    parts = []
    for split in SPLITS:
        path = splits_dir / f"{split}.csv"
        df = read_table(path, what=f"PANDA {split} split file")
        id_col = pick_column(df, ("image_id", "slide_id", "FILENAME") + SLIDE_ID_COLUMNS, source=path, what="slide id")
        part = pd.DataFrame({"slide_id": clean_slide_ids(df[id_col]), "split": split, "file": path.name})
        if "isup_grade" in df.columns:
            part["isup_grade"] = pd.to_numeric(df["isup_grade"], errors="coerce")
        lower = {c.lower(): c for c in df.columns}
        pcol = next((lower[c.lower()] for c in _PATIENT_COLUMNS if c.lower() in lower), None)
        if pcol is not None:
            part["patient_id"] = df[pcol].astype("string")
        parts.append(part)
    listing = pd.concat(parts, ignore_index=True)
    empty = listing.loc[listing["slide_id"] == "", "file"]
    if len(empty):
        raise ManifestError(f"{splits_dir}: empty slide id in {len(empty)} row(s) of {first_few(empty.unique())}")
    check_one_split_per_slide(listing, source=splits_dir, where="file")
    check_patient_splits(listing, source=splits_dir)
    return listing


def _apply_split_dir(
    df: pd.DataFrame, splits_dir: Path, noisy: set[str], *, labels_csv: Path, noise_csv: str | os.PathLike | None,
) -> pd.DataFrame:
    """The labelled slides ``df`` with the paper's ``split`` (and ``patient_id``) from ``splits_dir``'s files, checked.

    Slides in none of the split files are dropped with a :class:`ManifestWarning`.
    """
    listing = _read_split_dir(splits_dir)
    flagged = listing.loc[listing["slide_id"].isin(noisy), "slide_id"]
    if len(flagged):
        raise ManifestError(
            f"{splits_dir}: {len(flagged)} slide(s) in the split files are flagged noisy in {noise_csv}: "
            f"{first_few(flagged)}; the split and the noise flags do not belong together"
        )
    unknown = listing.loc[~listing["slide_id"].isin(df["slide_id"]), "slide_id"]
    if len(unknown):
        raise ManifestError(
            f"{splits_dir}: {len(unknown)} slide(s) in the split files are not in {labels_csv}: {first_few(unknown)}; "
            "the split files must list slides of the labels file"
        )
    listing = listing.set_index("slide_id")
    unsplit = df.loc[~df["slide_id"].isin(listing.index), "slide_id"]
    if len(unsplit):
        hint = "" if noise_csv is not None else " (pass the noise-flag file to drop the noisy slides first)"
        warnings.warn(
            f"{len(unsplit)} labelled slide(s) are in none of the split files of {splits_dir} and are left out"
            f"{hint}: {first_few(unsplit)}",
            ManifestWarning, stacklevel=3,
        )
        df = df[df["slide_id"].isin(listing.index)]
    df = df.assign(split=listing.loc[df["slide_id"], "split"].to_numpy())
    if "isup_grade" in listing.columns:
        theirs = listing.loc[df["slide_id"], "isup_grade"].to_numpy()
        differ = df.loc[df["label"].to_numpy() != theirs, "slide_id"]
        if len(differ):
            raise ManifestError(
                f"{splits_dir}: isup_grade in the split files differs from {labels_csv} for {len(differ)} slide(s): "
                f"{first_few(differ)}; the files do not belong together"
            )
    if "patient_id" in listing.columns:
        df["patient_id"] = listing.loc[df["slide_id"], "patient_id"].fillna("").to_numpy()
    return df


def build_panda_manifest(
    labels_csv: str | os.PathLike,
    slides_dir: str | os.PathLike,
    *,
    noise_csv: str | os.PathLike | None = None,
    splits_dir: str | os.PathLike | None = None,
    split_seed: int = 0,
    fractions: dict[str, float] | None = None,
    check_files: bool = True,
) -> pd.DataFrame:
    """Build the PANDA manifest (cohort ``panda``, label = ISUP grade 0-5).

    Parameters
    ----------
    labels_csv : the challenge's ``train.csv`` (``image_id``, ``isup_grade``; ``data_provider`` and
        ``gleason_score`` are kept as extra columns).
    slides_dir : folder of ``<image_id>.tiff``; paths are written absolute.
    noise_csv : noise-flag file; slides with ``noise_ratio_10 == 0`` are dropped.
    splits_dir : folder with ``train.csv``, ``val.csv``, ``test.csv`` (the paper's split). Labelled
        slides in none of them are dropped with a :class:`ManifestWarning`.
    split_seed : seed of the stratified split used when ``splits_dir`` is None.
    fractions : split fractions of that split; default train 0.8, val 0.1, test 0.1.
    check_files : raise when slide files are missing (False: write the paths anyway).

    Returns
    -------
    Validated manifest frame, in the labels file's row order.

    Raises
    ------
    ManifestError
        Duplicate slide ids, grades outside 0-5, a slide in two split files, a patient in two
        splits, split files naming slides absent from the labels, flagged noisy, or graded
        differently there, noise flags missing for labelled slides.
    FileNotFoundError
        A missing input file, or missing slide files (count and first few) when ``check_files``.
    """
    labels_csv, slides_dir = Path(labels_csv), Path(slides_dir)
    df = _read_labels(labels_csv)
    noisy: set[str] = set()
    if noise_csv is not None:
        df, noisy = _drop_noisy(df, Path(noise_csv))
    if splits_dir is not None:
        df = _apply_split_dir(df, Path(splits_dir), noisy, labels_csv=labels_csv, noise_csv=noise_csv)
    else:
        fr = check_fractions(fractions or {"train": 0.8, "val": 0.1, "test": 0.1})
        df = df.assign(split=stratified_split(df["slide_id"], df["label"].astype(int), fr, seed=split_seed))
    df["path"] = [str(slides_dir.absolute() / f"{s}.tiff") for s in df["slide_id"]]
    df["cohort"] = "panda"
    if check_files:
        check_files_exist(df["slide_id"].tolist(), df["path"].tolist(), root=slides_dir)
    cols = ["slide_id", "path", "label", "split", "cohort"] + [c for c in df.columns if c not in ("slide_id", "path", "label", "split", "cohort")]
    return finalise(df[cols].reset_index(drop=True), source=labels_csv, n_classes=PANDA_CLASSES)
