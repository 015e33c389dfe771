"""`wsi-pipeline demo`: the whole pipeline on a generated synthetic cohort (`make demo`)."""

from __future__ import annotations

import argparse

from wsi_pipeline.cli._common import add_device_argument, add_output_arguments, add_set_argument


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run tile -> train -> eval on a synthetic cohort generated on the fly",
        description=(
            "Generate a synthetic cohort (internal slides split train/val/test, and an external cohort "
            "with another stain tint and scanner noise; label = planted lesions present), tile it, train "
            "the frozen baseline and the end-to-end methods of the pipeline, evaluate them, and write "
            "predictions, heatmaps and report.html. Finished stages are reused on a second run."
        ),
    )
    p.add_argument("--task", choices=("classification", "survival"), default="classification",
                   help="classification (default: label = lesions present; pipelines/demo.yaml) or survival (hazard rising "
                        "with lesion burden, 25 %% censored; pipelines/demo_survival.yaml, frozen baseline vs end-to-end "
                        "Cox; prints the C-index table)")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="pipeline config (default: pipelines/demo.yaml, or pipelines/demo_survival.yaml with --task survival)")
    add_set_argument(p)
    p.add_argument("--internal", type=int, default=None, metavar="N",
                   help="internal slides (split train/val/test; default 40, survival 48)")
    p.add_argument("--external", type=int, default=16, metavar="N", help="external-cohort slides (test only)")
    p.add_argument("--size", type=int, default=896, metavar="PX", help="slide side in level-0 px")
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
    from wsi_pipeline.demo import SurvivalCohort, run_demo

    survival = args.task == "survival"
    kind = SurvivalCohort if survival else DemoCohort
    internal = args.internal if args.internal is not None else kind.n_internal
    cohort = kind(n_internal=internal, n_external=args.external, size=args.size, seed=args.seed)
    config = args.config or ("pipelines/demo_survival.yaml" if survival else "pipelines/demo.yaml")
    return run_demo(config, cohort=cohort, workers=args.workers, device=args.device,
                    overrides=tuple(args.overrides), progress=not args.no_progress, seeds=args.seeds)
