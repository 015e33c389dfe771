"""`wsi-pipeline demo`: the whole pipeline on a generated synthetic cohort (`make demo`)."""

from __future__ import annotations

import argparse

from wsi_pipeline.cli._common import add_device_argument, add_output_arguments, add_set_argument

#: The tasks the demo has a synthetic cohort for, with their pipeline config (in pipelines/: the working folder's,
#: else the repository's beside the package, :func:`wsi_pipeline.demo.default_config`).
DEMO_CONFIGS: dict[str, str] = {"classification": "demo.yaml", "survival": "demo_survival.yaml"}
#: The tasks the lung mosaic cohort (real tiles, two classes) has labels for, with their pipeline config.
MOSAIC_CONFIGS: dict[str, str] = {"classification": "lung_mosaic.yaml"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run tile -> train -> eval on a synthetic cohort generated on the fly",
        description=(
            "Generate a synthetic cohort (internal slides split train/val/test, and an external cohort "
            "with another stain tint and scanner noise; label = planted lesions present), tile it, train "
            "the frozen baseline and the end-to-end methods of the pipeline, evaluate them, and write "
            "predictions, heatmaps and report.html. Finished stages are reused on a second run. "
            "--cohort lung-mosaic builds slides of real tissue instead: mosaics of real tiles from --source "
            "(LC25000 lung: benign slides, and slides with 1-10 %% adenocarcinoma tiles in clusters; near-copies "
            "kept within one split), with a pipeline YAML beside them (docs/real-data-lung.md)."
        ),
    )
    p.add_argument("--cohort", choices=("synthetic", "lung-mosaic"), default="synthetic",
                   help="synthetic (default: generated slides) or lung-mosaic (real tiles from --source laid on a grid; "
                        "pipelines/lung_mosaic.yaml, its paths put under --out)")
    p.add_argument("--source", default=None, metavar="DIR",
                   help="lung-mosaic: folder with lung_n/ (benign) and lung_aca/ (adenocarcinoma) tile folders, "
                        "e.g. ../shared/realdata/lc25000-lung")
    p.add_argument("--out", default="runs/lung_mosaic", metavar="DIR",
                   help="lung-mosaic: folder of the cohort (DIR/cohort: slides, masks, manifest.csv, labels.csv, tiles.csv, "
                        "groups.csv), the pipeline YAML (DIR/lung_mosaic.yaml), tiles, runs and results (default runs/lung_mosaic)")
    p.add_argument("--grid", type=int, default=8, metavar="N",
                   help="lung-mosaic: tiles per slide side (default 8: 64 tiles, 1792 px slides of 224 px tiles; 16 makes "
                        "3584 px slides of 256 tiles, four times the training time)")
    p.add_argument("--make-only", action="store_true",
                   help="write the cohort (and, for lung-mosaic, its pipeline YAML) and stop: no tiling, training or evaluation")
    p.add_argument("--task", choices=tuple(DEMO_CONFIGS), default="classification",
                   help="classification (default: label = lesions present; pipelines/demo.yaml) or survival (hazard rising "
                        "with lesion burden, 25 %% censored; pipelines/demo_survival.yaml, frozen baseline vs end-to-end "
                        "Cox; prints the C-index table)")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="pipeline config (default: pipelines/demo.yaml, or pipelines/demo_survival.yaml with --task survival)")
    add_set_argument(p)
    p.add_argument("--internal", type=int, default=None, metavar="N",
                   help="internal slides (split train/val/test; default 40, survival 48, lung-mosaic 48)")
    p.add_argument("--external", type=int, default=None, metavar="N",
                   help="external-cohort slides (test only; default 16; synthetic cohorts only)")
    p.add_argument("--size", type=int, default=None, metavar="PX", help="slide side in level-0 px (default 896; synthetic cohorts only)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="cohort seed (slides, lesions, splits)")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S,S,...",
                   help="seed study: train every method once per training seed (e.g. 0,1,2,3,4 or 0-4; same cohort "
                        "and tiles, finished runs reused), evaluate into <results>/seed-study/ and print mean +- sd "
                        "and min per method of internal AUC, localisation and external AUC (default: the config's seeds)")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="tiling worker processes (default: number of cores)")
    add_device_argument(p, default=None, note="used by training and evaluation "
                        "(default: the config's train.device for training, auto for evaluation)")
    add_output_arguments(p)
    p.set_defaults(func=run)


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds`` value: distinct integers >= 0 (``0,1,2`` or ``0-4``); a usage error otherwise."""
    from wsi_pipeline.demo import parse_seeds

    try:
        return parse_seeds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.synthetic.cohort import DemoCohort
    from wsi_pipeline.demo import SurvivalCohort, default_config, run_demo

    if args.cohort == "lung-mosaic":
        return _run_mosaic(args)
    if args.source is not None:
        raise ValueError("--source is for --cohort lung-mosaic; the synthetic cohort is generated")
    kind = {"classification": DemoCohort, "survival": SurvivalCohort}[args.task]
    default_name = DEMO_CONFIGS[args.task]
    internal = args.internal if args.internal is not None else kind.n_internal
    cohort = kind(n_internal=internal, n_external=16 if args.external is None else args.external,
                  size=896 if args.size is None else args.size, seed=args.seed)
    config = args.config or default_config(default_name)
    return run_demo(config, cohort=cohort, workers=args.workers, device=args.device, overrides=tuple(args.overrides),
                    progress=not args.no_progress, seeds=args.seeds, make_only=args.make_only)


def _run_mosaic(args: argparse.Namespace) -> int:
    """``--cohort lung-mosaic``: the pipeline YAML under ``--out``, then the demo's stages on the mosaic cohort."""
    from pathlib import Path

    from wsi_pipeline.demo import default_config, mosaic_config, run_demo
    from wsi_pipeline.synthetic.mosaic import LungMosaicCohort

    if args.source is None:
        raise ValueError("--cohort lung-mosaic needs --source DIR, the folder with lung_n/ and lung_aca/ "
                         "(e.g. ../shared/realdata/lc25000-lung)")
    if MOSAIC_CONFIGS.get(args.task) is None:
        raise ValueError(f"--cohort lung-mosaic is a classification cohort; --task {args.task} is not available for it")
    for flag, value in (("--external", args.external), ("--size", args.size)):
        if value is not None:
            raise ValueError(f"{flag} is for the synthetic cohort; the lung mosaic has no external cohort and its size is --grid")
    if not Path(args.source).is_dir():
        raise FileNotFoundError(f"--source {args.source}: no such folder")
    cohort = LungMosaicCohort(source=str(Path(args.source).resolve()), n_slides=args.internal or LungMosaicCohort.n_slides,
                              grid=args.grid, seed=args.seed)
    config = mosaic_config(args.config or default_config(MOSAIC_CONFIGS[args.task]), args.out)
    print(f"[demo] pipeline config: {config}")
    return run_demo(config, cohort=cohort, workers=args.workers, device=args.device, overrides=tuple(args.overrides),
                    progress=not args.no_progress, seeds=args.seeds, make_only=args.make_only)
