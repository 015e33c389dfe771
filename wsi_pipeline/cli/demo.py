"""`wsi-pipeline demo`: the whole pipeline on a generated synthetic cohort (`make demo`)."""

from __future__ import annotations

import argparse


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
    p.add_argument("--config", default="pipelines/demo.yaml", help="pipeline config (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.epochs=2 (repeatable)")
    p.add_argument("--internal", type=int, default=40, help="internal slides (default: %(default)s)")
    p.add_argument("--external", type=int, default=16, help="external-cohort slides (default: %(default)s)")
    p.add_argument("--size", type=int, default=896, help="slide side in level-0 px (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="cohort seed (default: %(default)s)")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S,S,...",
                   help="seed study: train every method once per training seed (e.g. 0,1,2,3,4 or 0-4; same cohort "
                        "and tiles, finished runs reused), evaluate into <results>/seed-study/ and print mean +- sd "
                        "and min per method of internal AUC, localisation and external AUC (default: the config's seeds)")
    p.add_argument("--workers", type=int, default=None, help="tiling worker processes (default: number of cores)")
    p.add_argument("--device", default=None, help="training/eval device: auto, cpu, cuda (default: the config's)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds`` value: distinct integers >= 0 (``0,1,2`` or ``0-4``); a usage error otherwise."""
    from wsi_pipeline.demo import parse_seeds

    try:
        return parse_seeds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.demo import DemoCohort, run_demo

    cohort = DemoCohort(n_internal=args.internal, n_external=args.external, size=args.size, seed=args.seed)
    return run_demo(args.config, cohort=cohort, workers=args.workers, device=args.device,
                    overrides=tuple(args.overrides), progress=not args.no_progress, seeds=args.seeds)
