"""CAMELYON16 and CAMELYON17 (lymph-node metastases, binary) manifests from the challenges' files.

CAMELYON16: 270 training slides (``normal_NNN``, ``tumor_NNN``) and 129 test slides
(``test_NNN``). Training labels come from the labels file and must agree with the slide names;
test labels come from the official reference (``reference.csv``: slide, Tumor/Normal, tumour
type, metastasis size; no header), which wins where the labels file disagrees (a
:class:`ManifestWarning` names the slide: the FLamby labels list ``test_114`` as normal, the
reference as tumour). ``test_049`` has no reference label (the organisers left it out of the
evaluation) and no row in the labels file either: it is not in the manifest, and a
``test_049`` file in the slides folder is reported by a warning as an unlabelled slide.

CAMELYON17: ``stage_labels.csv`` has a row per patient (``patient_NNN.zip``, pN stage) and per
slide (``patient_NNN_node_N.tif``: negative, itc, micro or macro). A slide is positive (label 1)
when its stage is in ``positive`` (default ``itc, micro, macro``: any metastasis, isolated tumour
cells included); the validation split is drawn by patient, stratified by pN stage, from the
training patients (000-099); slides of the official test patients (100-199), when the file has
their labels, go to split ``test``.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from wsi_pipeline.manifests.files import check_files_exist, find_slides, first_few
from wsi_pipeline.manifests.schema import ManifestError
from wsi_pipeline.manifests.sources import (
    ManifestWarning,
    check_unique_ids,
    clean_slide_ids,
    finalise,
    pick_column,
    read_table,
)
from wsi_pipeline.manifests.splits import grouped_split

__all__ = [
    "NODE_STAGES",
    "DEFAULT_POSITIVE",
    "FIRST_TEST_PATIENT",
    "parse_positive",
    "pn_stage",
    "build_camelyon16_manifest",
    "build_camelyon17_manifest",
]

log = logging.getLogger(__name__)

#: Slide-level stages of CAMELYON17, in order of severity.
NODE_STAGES: tuple[str, ...] = ("negative", "itc", "micro", "macro")
#: CAMELYON17 patients 000-099 form the training set, 100-199 the official test set.
FIRST_TEST_PATIENT = 100
#: Stages counted as positive by default: any metastasis (isolated tumour cells included).
DEFAULT_POSITIVE: tuple[str, ...] = ("itc", "micro", "macro")

_C16_NAME = re.compile(r"^(normal|tumor|test)_\d+$")
_C17_SLIDE = re.compile(r"^(patient_\d+)_node_\d+$")
_C17_PATIENT = re.compile(r"^patient_\d+$")
_TRUE = {"1", "true", "tumor", "tumour", "yes", "positive"}
_FALSE = {"0", "false", "normal", "no", "negative"}


def _binary(values: pd.Series, ids: pd.Series, *, source: Path, column: str) -> pd.Series:
    """Map True/False, 1/0, Tumor/Normal (any case) to 1/0; error naming the slides otherwise."""
    low = values.astype("string").fillna("").str.strip().str.lower()
    bad = ids[~low.isin(_TRUE | _FALSE)]
    if len(bad):
        raise ManifestError(
            f"{source}: label out of range in column {column} for slide(s) {first_few(bad)} "
            f"(values {first_few(values[bad.index])}); expected True/False, 1/0 or Tumor/Normal"
        )
    return low.isin(_TRUE).astype(int)


def _slide_paths(ids: Iterable[str], slides_dir: Path, *, default_ext: str = ".tif") -> tuple[list[str], dict[str, Path]]:
    """Paths of ``ids`` found anywhere under ``slides_dir`` (default ``slides_dir/<id><ext>``), and the index."""
    index = find_slides(slides_dir) if slides_dir.is_dir() else {}
    base = slides_dir.absolute()
    return [str(index.get(s, base / f"{s}{default_ext}")) for s in ids], index


def _read_reference(path: Path) -> pd.DataFrame:
    """slide_id, label (1 = Tumor), metastasis (macro/micro/'') of the CAMELYON16 test reference."""
    ref = read_table(path, what="CAMELYON16 reference", header=None)
    if ref.shape[1] < 2:
        raise ManifestError(f"{path}: expected columns slide, Tumor/Normal[, type, size], found {ref.shape[1]} column(s)")
    first = clean_slide_ids(ref.iloc[:1, 0]).iloc[0]
    if not _C16_NAME.match(first):  # a header row
        ref = ref.iloc[1:].reset_index(drop=True)
    ids = clean_slide_ids(ref.iloc[:, 0])
    check_unique_ids(ids, source=path, column="slide")
    not_test = ids[~ids.str.match(r"^test_\d+$")]
    if len(not_test):
        raise ManifestError(f"{path}: the reference lists test slides only (test_NNN); found {first_few(not_test)}")
    out = pd.DataFrame({"slide_id": ids, "label": _binary(ref.iloc[:, 1], ids, source=path, column="2 (Tumor/Normal)")})
    if ref.shape[1] >= 4:
        size = ref.iloc[:, 3].astype("string").fillna("").str.strip().str.lower()
        out["metastasis"] = size.where(size.isin(["macro", "micro", "itc"]), "")
    return out


def _read_c16_labels(path: Path) -> pd.DataFrame:
    """slide_id, label of a CAMELYON16 labels file (FLamby ``filenames,tumor`` or ``slide_name,label``)."""
    df = read_table(path, what="CAMELYON16 labels")
    id_col = pick_column(df, ("slide_id", "filenames", "slide_name", "slide", "image_id", "filename"), source=path, what="slide id")
    lab_col = pick_column(df, ("label", "tumor", "tumour"), source=path, what="label")
    ids = clean_slide_ids(df[id_col])
    check_unique_ids(ids, source=path, column=id_col)
    odd = ids[~ids.str.match(_C16_NAME.pattern)]
    if len(odd):
        raise ManifestError(
            f"{path}: slide name(s) {first_few(odd)} are not CAMELYON16 names (normal_NNN, tumor_NNN, test_NNN)"
        )
    return pd.DataFrame({"slide_id": ids, "label": _binary(df[lab_col], ids, source=path, column=lab_col)})


def build_camelyon16_manifest(
    reference_csv: str | os.PathLike,
    labels_csv: str | os.PathLike,
    slides_dir: str | os.PathLike,
    *,
    check_files: bool = True,
) -> pd.DataFrame:
    """Build the CAMELYON16 manifest (cohort ``camelyon16``, label 1 = tumour, official train/test split).

    Parameters
    ----------
    reference_csv : the official test reference (``test_NNN, Tumor|Normal, type, size``).
    labels_csv : labels of the training slides (test rows, if any, are checked against the reference).
    slides_dir : folder searched recursively for ``<slide_id>.tif`` (the official ``training/normal``,
        ``training/tumor``, ``testing/images`` layout works as is); paths are written absolute.
    check_files : raise when slide files are missing.

    Returns
    -------
    Validated manifest frame: training slides (split ``train``) then test slides (split
    ``test``, with the reference's ``metastasis`` size as an extra column).

    Raises
    ------
    ManifestError
        Duplicate slide ids, labels that are not tumour/normal, a training label contradicting
        the slide's name (``tumor_`` / ``normal_``), names that are not CAMELYON16's.
    FileNotFoundError
        A missing input file or (with ``check_files``) missing slide files.
    """
    reference_csv, labels_csv, slides_dir = Path(reference_csv), Path(labels_csv), Path(slides_dir)
    ref = _read_reference(reference_csv)
    lab = _read_c16_labels(labels_csv)

    train = lab[~lab["slide_id"].str.startswith("test_")].copy()
    by_name = train["slide_id"].str.startswith("tumor_").astype(int)
    wrong = train.loc[train["label"] != by_name, "slide_id"]
    if len(wrong):
        raise ManifestError(
            f"{labels_csv}: label contradicts the slide name for {first_few(wrong)} (tumor_NNN slides are 1, normal_NNN 0); "
            "check the label column"
        )
    train["split"] = "train"

    lab_test = lab[lab["slide_id"].str.startswith("test_")].set_index("slide_id")["label"]
    ref_lab = ref.set_index("slide_id")["label"]
    both = lab_test.index.intersection(ref_lab.index)
    overridden = [s for s in both if lab_test[s] != ref_lab[s]]
    for s in overridden:
        warnings.warn(
            f"{s}: {labels_csv.name} says {'tumour' if lab_test[s] else 'normal'}, the official reference "
            f"{reference_csv.name} says {'tumour' if ref_lab[s] else 'normal'}; using the reference",
            ManifestWarning, stacklevel=2,
        )
    no_ref = lab_test.index.difference(ref_lab.index).tolist()
    if no_ref:
        warnings.warn(
            f"{len(no_ref)} test slide(s) of {labels_csv.name} have no label in the official reference and are "
            f"left out: {first_few(no_ref)}",
            ManifestWarning, stacklevel=2,
        )
    test = ref.assign(split="test")
    df = pd.concat([train, test], ignore_index=True)
    if "metastasis" in df.columns:
        df["metastasis"] = df["metastasis"].fillna("")
    df["cohort"] = "camelyon16"
    df["path"], index = _slide_paths(df["slide_id"], slides_dir)
    _warn_unlabelled_files(index, df["slide_id"], slides_dir)
    if check_files:
        check_files_exist(df["slide_id"].tolist(), df["path"].tolist(), root=slides_dir)
    return finalise(df, source=labels_csv, n_classes=2)


def _warn_unlabelled_files(index: dict[str, Path], ids: pd.Series, slides_dir: Path) -> None:
    extra = sorted(set(index) - set(ids))
    if extra:
        warnings.warn(
            f"{len(extra)} slide file(s) under {slides_dir} have no label and are not in the manifest: {first_few(extra)}",
            ManifestWarning, stacklevel=3,
        )


def parse_positive(positive: str | Iterable[str]) -> tuple[str, ...]:
    """The node stages counted as positive, from ``"itc,micro,macro"`` or a list; checked."""
    items = positive.split(",") if isinstance(positive, str) else list(positive)
    stages = tuple(dict.fromkeys(s.strip().lower() for s in items if s.strip()))
    bad = [s for s in stages if s not in NODE_STAGES[1:]]
    if not stages or bad:
        raise ValueError(
            f"positive={positive!r}: expected a non-empty comma-separated subset of {list(NODE_STAGES[1:])}"
            + (f", found {bad}" if bad else "")
        )
    return stages


def pn_stage(node_stages: Iterable[str]) -> str:
    """The patient's pN stage implied by its slides' stages (CAMELYON17 rules, at most 5 nodes).

    pN0: all negative; pN0(i+): isolated tumour cells only; pN1mi: micro-metastases, no macro;
    pN1: 1-3 nodes with metastases (micro or macro), at least one macro; pN2: 4-9 such nodes,
    at least one macro.
    """
    stages = list(node_stages)
    n_meta = sum(s in ("micro", "macro") for s in stages)
    if "macro" in stages:
        return "pN1" if n_meta <= 3 else "pN2"
    if "micro" in stages:
        return "pN1mi"
    if "itc" in stages:
        return "pN0(i+)"
    return "pN0"


def _read_c17_stages(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """CAMELYON17 ``stage_labels.csv`` -> (slides: slide_id, node_stage, patient_id; patients: patient_id, pn_stage), checked."""
    raw = read_table(path, what="CAMELYON17 stage labels")
    id_col = pick_column(raw, ("patient", "slide", "slide_id"), source=path, what="patient/slide")
    st_col = pick_column(raw, ("stage", "label"), source=path, what="stage")
    names = raw[id_col].astype("string")
    is_patient = names.str.lower().str.endswith(".zip")
    patients = pd.DataFrame({"patient_id": names[is_patient].str[:-4], "pn_stage": raw.loc[is_patient, st_col]})
    slides = pd.DataFrame({"slide_id": clean_slide_ids(names[~is_patient]), "node_stage": raw.loc[~is_patient, st_col].str.lower()})
    if slides.empty:
        raise ManifestError(f"{path}: no slide rows (patient_NNN_node_N.tif); is this the stage_labels.csv of CAMELYON17?")
    check_unique_ids(slides["slide_id"], source=path, column=id_col)
    check_unique_ids(patients["patient_id"], source=path, column=f"{id_col} (patient rows)")
    odd = slides.loc[~slides["slide_id"].str.match(_C17_SLIDE.pattern), "slide_id"]
    if len(odd):
        raise ManifestError(f"{path}: slide name(s) {first_few(odd)} are not patient_NNN_node_N")
    bad = slides.loc[~slides["node_stage"].isin(NODE_STAGES), "slide_id"]
    if len(bad):
        raise ManifestError(
            f"{path}: label out of range (stage) for slide(s) {first_few(bad)} "
            f"(values {first_few(slides.loc[bad.index, 'node_stage'])}); expected one of {list(NODE_STAGES)}"
        )
    slides["patient_id"] = slides["slide_id"].str.extract(_C17_SLIDE.pattern, expand=False)
    return slides, patients


def _patient_pn_stages(slides: pd.DataFrame, patients: pd.DataFrame, source: Path) -> dict:
    """patient_id -> pN stage: the file's patient row where there is one, else implied by the slides (warns where they differ)."""
    implied = slides.groupby("patient_id")["node_stage"].agg(pn_stage)
    given = patients.set_index("patient_id")["pn_stage"]
    differ = [p for p in given.index.intersection(implied.index) if given[p] != implied[p]]
    if differ:
        warnings.warn(
            f"{source}: the pN stage of {len(differ)} patient(s) does not follow from their slides' stages: "
            f"{first_few(f'{p} ({given[p]} vs {implied[p]})' for p in differ)}",
            ManifestWarning, stacklevel=3,
        )
    return {p: (given[p] if p in given.index else implied[p]) for p in implied.index}


def _assign_c17_splits(slides: pd.DataFrame, pn: dict, *, val_fraction: float, split_seed: int) -> None:
    """Set ``slides["split"]``: official test patients -> test; the others train/val by patient, stratified by pN stage."""
    fractions = {"train": 1.0 - float(val_fraction), "val": float(val_fraction)}
    official_test = slides["patient_id"].str[len("patient_"):].astype(int) >= FIRST_TEST_PATIENT
    slides["split"] = "test"
    dev = slides[~official_test]
    if len(dev):
        slides.loc[dev.index, "split"] = grouped_split(
            dev["slide_id"], dev["patient_id"], fractions, seed=split_seed, group_strata=pn
        )
    if official_test.any():
        log.info("%d slides of the official test patients (>= %d) go to split test", int(official_test.sum()), FIRST_TEST_PATIENT)


def build_camelyon17_manifest(
    stage_labels_csv: str | os.PathLike,
    slides_dir: str | os.PathLike,
    *,
    positive: str | Iterable[str] = DEFAULT_POSITIVE,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    check_files: bool = True,
) -> pd.DataFrame:
    """Build the CAMELYON17 manifest (cohort ``camelyon17``, binary, train/val split by patient).

    Parameters
    ----------
    stage_labels_csv : the challenge's ``stage_labels.csv`` (columns ``patient``, ``stage``).
    slides_dir : folder searched recursively for ``patient_NNN_node_N.tif`` (the official
        ``center_K`` folders work as is); paths are written absolute.
    positive : node stages labelled 1 (the others, and ``negative``, are 0).
    val_fraction : fraction of the training *patients* (000-099) in the validation split
        (0 <= f < 1), stratified by pN stage. Patients 100-199 (the official test set) go to ``test``.
    split_seed : seed of that split.
    check_files : raise when slide files are missing.

    Returns
    -------
    Validated manifest frame with ``patient_id``, the slide's ``node_stage`` and the patient's
    ``pn_stage`` as extra columns.

    Raises
    ------
    ManifestError
        Duplicate slides, stages that are not negative/itc/micro/macro, names that are not
        ``patient_NNN_node_N``.
    ValueError
        A bad ``positive`` or ``val_fraction``.
    """
    stage_labels_csv, slides_dir = Path(stage_labels_csv), Path(slides_dir)
    pos = parse_positive(positive)
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: expected 0 <= val_fraction < 1 (fraction of patients in validation)")
    slides, patients = _read_c17_stages(stage_labels_csv)
    pn = _patient_pn_stages(slides, patients, stage_labels_csv)
    slides["pn_stage"] = slides["patient_id"].map(pn)
    slides["label"] = slides["node_stage"].isin(pos).astype(int)
    _assign_c17_splits(slides, pn, val_fraction=val_fraction, split_seed=split_seed)
    slides["cohort"] = "camelyon17"
    slides["path"], index = _slide_paths(slides["slide_id"], slides_dir)
    _warn_unlabelled_files(index, slides["slide_id"], slides_dir)
    if check_files:
        check_files_exist(slides["slide_id"].tolist(), slides["path"].tolist(), root=slides_dir)
    cols = ["slide_id", "path", "label", "split", "cohort", "patient_id", "node_stage", "pn_stage"]
    return finalise(slides[cols].reset_index(drop=True), source=stage_labels_csv, n_classes=2)
