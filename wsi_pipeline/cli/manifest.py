"""``wsi-pipeline manifest``: build a manifest CSV from a slide folder or a public cohort's own files.

Each builder validates its inputs (duplicate slide ids, labels out of range, a slide or a patient
in two splits), writes the manifest atomically, and prints a table of slides per split and label.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["register", "run", "summary_table"]

#: The label and reference files the builders read (flag, argparse dest): a manifest written over one is refused.
_LABEL_INPUTS = (("--labels", "labels"), ("--reference", "reference"), ("--stage-labels", "stage_labels"),
                 ("--exclude-noisy", "exclude_noisy"))

_NO_CHECK = "write the manifest even when slide files are missing (e.g. before downloading the slides)"


def _add_split_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split", default="0.6,0.2,0.2", metavar="TRAIN,VAL,TEST",
                   help="fractions of patients (slides when there is no patient_id) drawn into train, val and test "
                   "for labelled slides without a split; label-stratified, patient-grouped")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the drawn splits")
    folds = p.add_mutually_exclusive_group()
    folds.add_argument("--folds", type=int, metavar="K",
                       help="K folds with a fixed test split: draw the test split, cut the rest into K label-stratified "
                       "folds, write OUT with a 'fold' column and one manifest per fold, OUT_fold<k>.csv (fold k = val). "
                       "On a manifest whose slides all have a split already, its test split is kept and its train and "
                       "val slides are cut into the folds")
    folds.add_argument("--crossval", type=int, metavar="K",
                       help="K-fold cross-validation in which every labelled slide is tested once (--split is not used): "
                       "label-stratified (survival: event-stratified), patient-grouped folds (scikit-learn's "
                       "StratifiedGroupKFold); fold k = test, fold k+1 (mod K) = val, the others train. Writes "
                       "OUT_fold<k>.csv (OUT_r<r>_fold<k>.csv with --repeats) and OUT with columns cv_fold_r<r> (each "
                       "slide's test fold per repeat). An external cohort (a cohort whose labelled slides are all pinned to "
                       "test) stays test in every fold; the other cohorts' input splits are replaced; K >= 3")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="with --crossval: repeat the cross-validation R times with different cuts (seeded by --seed)")
    p.add_argument("--tiles", metavar="DIR",
                   help="the --out folder of `wsi-pipeline tile`: slides without usable tiles there (skipped or failed by "
                   "the tiler, 0 tiles, no complete store) are left out of the manifest before splits are drawn, and "
                   "counted; so draw splits after tiling (tile with --slides DIR first)")


def _add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="CSV", help="manifest CSV to write (atomically; parent folders are created)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``manifest`` and its cohort subcommands."""
    parser = subparsers.add_parser(
        "manifest",
        help="build a manifest CSV from a slide folder or a public cohort's label files",
        description=(
            "Build a manifest CSV (slide_id, path, label, split, cohort, ...; see data_manifests/README.md) "
            "from a folder of slides or from the label and split files that come with PANDA, CAMELYON16, "
            "CAMELYON17 or TCGA-PRAD. Inputs are checked for duplicate slides, labels out of range and "
            "slides or patients in two splits; a summary per split and label is printed."
        ),
    )
    sub = parser.add_subparsers(dest="cohort_builder", metavar="<source>", required=True)
    for add in (_add_folder, _add_split, _add_panda, _add_camelyon16, _add_camelyon17, _add_tcga_prad, _add_merge):
        add(sub)


def _add_folder(sub: argparse._SubParsersAction) -> None:
    """``manifest folder``."""
    from wsi_pipeline.slides.finder import describe_extensions

    p = sub.add_parser(
        "folder", help="every slide under a folder, labels from an optional CSV",
        description=f"List every slide file under DIR (recursively; the endings {describe_extensions()}, any case), "
        "slide_id = file name without its ending, labels joined from an optional CSV; unlabelled slides are kept "
        "(for `predict`).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--slides", metavar="DIR", help="folder searched recursively for slide files")
    src.add_argument("--features", metavar="DIR",
                     help="a folder of feature files instead of slides, each file a slide: <slide_id>.h5 made by TRIDENT "
                     "(features_<encoder>/), CLAM (h5_files/, or pt_files/<slide_id>.pt: features only), STAMP or "
                     "`wsi-pipeline features`; a CLAM or TRIDENT output folder is looked into. Train on them with "
                     "data.features: {dir: DIR} and encoder: {name: precomputed} (docs/interop.md)")
    p.add_argument("--labels", metavar="CSV", help="optional CSV with columns slide_id,label[,patient_id][,split][,mpp] "
                   "(label: integer class, empty = unlabelled); its split, cohort, patient_id, mpp and other columns "
                   "are carried over. Without a split column, splits are drawn (see --split). Survival: columns "
                   "time (follow-up, any unit) and event (1 = observed, 0 = censored); regression: column target; "
                   "label may then be left out")
    p.add_argument("--time-column", metavar="NAME", help="the labels CSV's survival time column, when not called 'time'")
    p.add_argument("--event-column", metavar="NAME", help="the labels CSV's event column (1/0), when not called 'event'")
    p.add_argument("--target-column", metavar="NAME", help="the labels CSV's regression target column, when not called 'target'")
    _add_split_options(p)
    _add_out(p)
    p.set_defaults(func=run)


def _add_split(sub: argparse._SubParsersAction) -> None:
    """``manifest split``."""
    p = sub.add_parser(
        "split", help="draw train/val/test splits (or K folds) for an existing manifest",
        description="Read a manifest and draw a split for every labelled slide whose split is empty: "
        "label-stratified and patient-grouped (all slides of a patient_id in one split). Slides that already "
        "have a split keep it, and so do their patients' other slides.",
    )
    p.add_argument("--manifest", required=True, metavar="CSV", help="the manifest to split")
    p.add_argument("--redraw", action="store_true", help="discard the manifest's existing splits and draw all of them")
    _add_split_options(p)
    _add_out(p)
    p.set_defaults(func=run)


def _add_panda(sub: argparse._SubParsersAction) -> None:
    """``manifest panda``."""
    p = sub.add_parser(
        "panda", help="PANDA prostate biopsies, ISUP grade 0-5",
        description="PANDA manifest from the challenge's train.csv (label = isup_grade), optionally without the "
        "noisy slides, with the paper's split files or a seeded label-stratified 80:10:10 split.",
    )
    p.add_argument("--labels", required=True, metavar="TRAIN_CSV", help="the PANDA challenge train.csv (image_id, isup_grade, ...)")
    p.add_argument("--exclude-noisy", metavar="NOISE_CSV",
                   help="noise-flag CSV (image_id, noise_ratio_10); slides with noise_ratio_10 == 0 are dropped")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--splits", metavar="DIR", help="folder with train.csv, val.csv, test.csv listing slide ids (the paper's split)")
    group.add_argument("--split-seed", type=int, default=0, metavar="N",
                       help="seed of the label-stratified 80:10:10 split used without --splits")
    p.add_argument("--slides", required=True, metavar="DIR", help="folder of the slide files, <image_id>.tiff")
    _add_out(p)
    p.add_argument("--no-check-files", action="store_true", help=_NO_CHECK)
    p.set_defaults(func=run)


def _add_camelyon16(sub: argparse._SubParsersAction) -> None:
    """``manifest camelyon16``."""
    p = sub.add_parser(
        "camelyon16", help="CAMELYON16 lymph nodes, tumour vs normal, official train/test",
        description="CAMELYON16 manifest: training labels from the labels file, test labels from the official "
        "reference, which wins where the two disagree (a warning names the slide).",
    )
    p.add_argument("--reference", required=True, metavar="REF_CSV", help="official test reference: test_NNN, Tumor|Normal, type, size (no header)")
    p.add_argument("--labels", required=True, metavar="LABELS_CSV", help="slide labels (e.g. FLamby's filenames,tumor) for the training slides")
    p.add_argument("--slides", required=True, metavar="DIR", help="folder searched recursively for <slide>.tif")
    _add_out(p)
    p.add_argument("--no-check-files", action="store_true", help=_NO_CHECK)
    p.set_defaults(func=run)


def _add_camelyon17(sub: argparse._SubParsersAction) -> None:
    """``manifest camelyon17``."""
    p = sub.add_parser(
        "camelyon17", help="CAMELYON17 lymph nodes, binary slide labels, validation split by patient",
        description="CAMELYON17 manifest from stage_labels.csv: label 1 when the slide's stage is in --positive, "
        "patient_id filled, validation split drawn by patient (stratified by pN stage).",
    )
    p.add_argument("--stage-labels", required=True, metavar="CSV", help="the challenge's stage_labels.csv (patient, stage)")
    p.add_argument("--slides", required=True, metavar="DIR", help="folder searched recursively for patient_NNN_node_N.tif")
    _add_out(p)
    p.add_argument("--positive", default="itc,micro,macro", metavar="STAGES",
                   help="comma-separated slide stages labelled 1 (a subset of itc,micro,macro)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F", help="fraction of patients in the validation split")
    p.add_argument("--split-seed", type=int, default=0, metavar="N", help="seed of the validation split")
    p.add_argument("--no-check-files", action="store_true", help=_NO_CHECK)
    p.set_defaults(func=run)


def _add_tcga_prad(sub: argparse._SubParsersAction) -> None:
    """``manifest tcga-prad``."""
    p = sub.add_parser(
        "tcga-prad", help="TCGA-PRAD external test cohort from your own grade CSV",
        description="TCGA-PRAD manifest (cohort tcga_prad, split test) from a CSV of slide ids and grades "
        "(isup_grade/label/grade 0-5, or gleason_score '4+3' converted to ISUP).",
    )
    p.add_argument("--labels", required=True, metavar="CSV", help="CSV of slide ids and grades")
    p.add_argument("--slides", required=True, metavar="DIR", help="folder searched recursively for the slide files")
    _add_out(p)
    p.add_argument("--one-per-patient", action="store_true", help="keep one randomly chosen slide per patient (as the paper does)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of --one-per-patient's choice")
    p.add_argument("--no-check-files", action="store_true", help=_NO_CHECK)
    p.set_defaults(func=run)


def _add_merge(sub: argparse._SubParsersAction) -> None:
    """``manifest merge``."""
    p = sub.add_parser(
        "merge", help="one manifest from an internal cohort and its external test cohorts",
        description="Concatenate manifests for one pipeline: --internal manifests keep their splits (train/val/test); "
        "every row of an --external manifest gets split test (evaluated, never trained on; e.g. all 399 "
        "CAMELYON16 slides). Slide ids must be unique across the inputs.",
    )
    p.add_argument("--internal", required=True, action="append", metavar="CSV",
                   help="manifest of the cohort trained on (repeatable)")
    p.add_argument("--external", action="append", default=[], metavar="CSV",
                   help="manifest of an external test cohort (repeatable)")
    _add_out(p)
    p.set_defaults(func=run)


def summary_table(df) -> str:
    """Slides per split (rows) and label (columns), with totals, as text."""
    import pandas as pd

    split = df["split"].astype("string").fillna("").replace("", "(none)")
    label = df["label"].astype("string").fillna("unlabelled")
    table = pd.crosstab(split.rename("split"), label.rename("label"), margins=True, margins_name="total")
    order = [s for s in ("train", "val", "test", "(none)") if s in table.index] + ["total"]
    lines = [f"{len(df)} slides, cohort(s) {', '.join(sorted(df['cohort'].astype(str).unique()))}"]
    if "patient_id" in df.columns and (df["patient_id"] != "").any():
        per = df[df["patient_id"] != ""].groupby(split)["patient_id"].nunique()
        lines.append(f"{df.loc[df['patient_id'] != '', 'patient_id'].nunique()} patients; per split: "
                     + ", ".join(f"{k} {v}" for k, v in per.items()))
    lines.append(table.loc[order].to_string())
    if df["cohort"].nunique() > 1:
        lines.append("per cohort and split: " + ", ".join(
            f"{c}/{s or '(none)'} {n}" for (c, s), n in df.groupby(["cohort", "split"]).size().items()))
    return "\n".join(lines)


def _drawn(df, args: argparse.Namespace):
    """``df`` with splits (and folds) drawn for labelled slides that have none."""
    from wsi_pipeline.manifests.assign import assign_splits, parse_fractions

    if getattr(args, "tiles", None):
        from wsi_pipeline.manifests.tiled import without_untiled

        df, left = without_untiled(df, args.tiles)
        if left:
            shown = "; ".join(f"{sid} ({why})" for sid, why in list(left.items())[:5])
            print(f"left out {len(left)} slide(s) without usable tiles in {args.tiles}, before drawing splits: {shown}"
                  + (f" (and {len(left) - 5} more)" if len(left) > 5 else ""), file=sys.stderr)
    if getattr(args, "crossval", None) is not None:
        from wsi_pipeline.manifests.crossval import assign_crossval

        source = getattr(args, "labels", None) or getattr(args, "manifest", None)
        return assign_crossval(df, args.crossval, repeats=args.repeats, seed=args.seed, source=source)
    if getattr(args, "repeats", 1) != 1:
        raise ValueError(f"--repeats {args.repeats} needs --crossval K (repeats of the cross-validation)")
    from wsi_pipeline.manifests.crossval import crossval_columns

    df = df.drop(columns=crossval_columns(df.columns))  # an earlier cross-validation no longer describes the splits
    return assign_splits(df, parse_fractions(args.split), seed=args.seed, folds=args.folds)


def _builder(args: argparse.Namespace) -> Callable[[], Any]:
    """The library call for the chosen source (heavy imports happen here)."""
    if args.cohort_builder == "merge":
        from wsi_pipeline.manifests.merge import merge_manifests

        return lambda: merge_manifests(args.internal, args.external)
    if args.cohort_builder == "folder":
        from wsi_pipeline.manifests.folder import build_folder_manifest

        columns = {k: v for k, v in (("time", args.time_column), ("event", args.event_column),
                                     ("target", args.target_column)) if v}
        return lambda: _drawn(build_folder_manifest(args.slides or args.features, args.labels, columns=columns,
                                                    features=bool(args.features)), args)
    if args.cohort_builder == "split":
        from wsi_pipeline.manifests.schema import read_manifest

        def split_existing():
            df = read_manifest(args.manifest)
            if args.redraw:
                df["split"] = ""
            return _drawn(df, args)

        return split_existing
    if args.cohort_builder == "panda":
        from wsi_pipeline.manifests.panda import build_panda_manifest

        return lambda: build_panda_manifest(
            args.labels, args.slides, noise_csv=args.exclude_noisy, splits_dir=args.splits,
            split_seed=args.split_seed, check_files=not args.no_check_files,
        )
    if args.cohort_builder == "camelyon16":
        from wsi_pipeline.manifests.camelyon import build_camelyon16_manifest

        return lambda: build_camelyon16_manifest(args.reference, args.labels, args.slides, check_files=not args.no_check_files)
    if args.cohort_builder == "camelyon17":
        from wsi_pipeline.manifests.camelyon import build_camelyon17_manifest

        return lambda: build_camelyon17_manifest(
            args.stage_labels, args.slides, positive=args.positive, val_fraction=args.val_fraction,
            split_seed=args.split_seed, check_files=not args.no_check_files,
        )
    from wsi_pipeline.manifests.tcga import build_tcga_prad_manifest

    return lambda: build_tcga_prad_manifest(
        args.labels, args.slides, one_per_patient=args.one_per_patient, seed=args.seed, check_files=not args.no_check_files,
    )


def run(args: argparse.Namespace) -> int:
    """Build, write and summarise the manifest (wrong inputs: the command line's one error line, exit 2)."""
    from wsi_pipeline.manifests.schema import write_manifest
    from wsi_pipeline.output_dirs import check_not_an_input, check_output_file

    build = _builder(args)
    # the builders' label files are inputs of another kind (`manifest split --manifest M --out M` rewrites M on purpose)
    check_not_an_input(args.out, "--out", {flag: getattr(args, dest, None) for flag, dest in _LABEL_INPUTS})
    check_output_file(args.out, "the manifest")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            df = build()
        finally:
            for w in caught:
                print(f"warning: {w.message}", file=sys.stderr)
    _warn_duplicate_files(df)
    from wsi_pipeline.manifests.crossval import crossval_columns

    if crossval_columns(df.columns):
        return _write_crossval(df, args.out)
    path = write_manifest(df, args.out)
    print(f"wrote {path}")
    print(summary_table(df))
    if "fold" in df.columns:
        from pathlib import Path

        from wsi_pipeline.manifests.assign import fold_manifests

        out = Path(args.out)
        for k, fold_df in enumerate(fold_manifests(df)):
            fold_path = write_manifest(fold_df, out.with_name(f"{out.stem}_fold{k}{out.suffix}"))
            n_val = int((fold_df["split"] == "val").sum())
            print(f"wrote {fold_path} (fold {k}: {n_val} val slides)")
        print(f"cross-validate with `wsi-pipeline train --config X.yaml --set data.manifest={out} --folds`, then "
              "the same with `eval`: one report with mean ± std across folds")
    return 0


def _write_crossval(df, out) -> int:
    """Write the per-fold manifests of a cross-validation, then the main manifest (last: it marks the set complete)."""
    from wsi_pipeline.manifests.crossval import crossval_columns, crossval_manifest_path, crossval_manifests
    from wsi_pipeline.manifests.schema import write_manifest

    cols = crossval_columns(df.columns)
    repeats = len(cols)
    for r, k, fold_df in crossval_manifests(df):
        fold_path = write_manifest(fold_df, crossval_manifest_path(out, k, r, repeats))
        n = fold_df["split"].value_counts()
        print(f"wrote {fold_path} (repeat {r}, fold {k}: {n.get('train', 0)} train, {n.get('val', 0)} val, "
              f"{n.get('test', 0)} test slides)")
    path = write_manifest(df, out)
    print(f"wrote {path}")
    print(summary_table(df))
    n_folds = int(df[cols[0]].max()) + 1
    n_cv = int((df[cols[0]] >= 0).sum())
    import pandas as pd

    cv = df[df[cols[0]] >= 0]
    label = cv["label"].astype("string").fillna("none") if cv["label"].notna().any() else pd.Series("all", index=cv.index)
    print(f"slides per test fold (repeat 0) and label:\n{pd.crosstab(cv[cols[0]].rename('fold'), label.rename('label'))}")
    print(f"{n_folds}-fold cross-validation x {repeats} repeat(s): each of {n_cv} slides is tested once per repeat. "
          f"Run `wsi-pipeline train --config X.yaml --set data.manifest={path} --folds`, then the same with `eval`: "
          "one table pooled over the out-of-fold predictions")
    return 0


def _warn_duplicate_files(df) -> None:
    """Warn when two slide ids point to the same file (a leak when they fall in different splits)."""
    from wsi_pipeline.manifests.assign import duplicate_files
    from wsi_pipeline.manifests.schema import first_few

    if "path" not in df.columns:
        return
    for ids in duplicate_files(df):
        splits = sorted(set(df.loc[df["slide_id"].isin(ids), "split"].astype(str)) - {""})
        leak = f"; they are in different splits ({', '.join(splits)}): a leak" if len(splits) > 1 else ""
        print(f"warning: {len(ids)} slide ids ({first_few(ids)}) point to the same file (same path or content){leak}",
              file=sys.stderr)
