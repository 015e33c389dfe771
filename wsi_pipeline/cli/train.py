"""``wsi-pipeline train``: train every method x seed of a pipeline config into ``runs/<pipeline>/``."""

from __future__ import annotations

import argparse
import logging
import sys

from wsi_pipeline.cli._common import add_device_argument, add_output_arguments, add_set_argument, pipeline_from_args

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the methods of a pipeline config (frozen, full, accumulate, bigl, patchgd)",
        description=(
            "Train every method x seed of a pipeline YAML into runs/<pipeline>/<method>/seed<k>/ "
            "(config.yaml, history.csv, last.pt, best.pt, done). The config, manifest, labels, tile stores, "
            "strategies and models are checked before any training. Finished runs (with a `done` file) are "
            "skipped; an interrupted run (Ctrl-C, kill, crash) continues exactly from its last finished epoch when the "
            "same command is run again. Frozen methods extract missing "
            "feature files first. Relative paths in the config are relative to the current directory. "
            "Under `torchrun --nproc_per_node=G` (e.g. `make train NPROC=G`) G processes share each optimiser "
            "step's bags and sum the gradients (NCCL on GPUs, gloo on CPUs); only rank 0 writes and logs. "
            "Stain: data.stain.normalise (none, macenko, reinhard; e.g. --set data.stain.normalise=macenko) is fitted "
            "once before training on the training slides' stain estimates (or data.stain.target=SLIDE_ID, one reference "
            "slide), saved in each run folder (stain.json, stain.csv) and checkpoint, and applied to every tile of "
            "training, validation, frozen features, eval and predict; a slide whose stain cannot be estimated is left "
            "unnormalised with a warning. Stain augmentation: train.augment.hed_p (HED jitter, strengths hed_scale, "
            "hed_shift) and stain_mix_p (mixing with training slides' stains, weight up to stain_mix), one draw per bag."
        ),
    )
    p.add_argument("--config", required=True, metavar="YAML", help="pipeline YAML file, e.g. pipelines/demo.yaml")
    add_set_argument(p)
    p.add_argument("--method", dest="methods", action="append", default=None, metavar="NAME",
                   help="train only this method (repeatable; default: every method of the config)")
    p.add_argument("--seed", dest="seeds", action="append", type=int, default=None, metavar="N",
                   help="train only this seed (repeatable; default: the config's seeds)")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=True,
                   help="stop with an error when an interrupted run is found (last.pt but no done file); by default it "
                        "continues from its last epoch")
    add_device_argument(p, key="train.device",
                        note="a method's own train.device still wins; --set has the last word, as for every flag")
    add_output_arguments(p)
    p.add_argument("--strict", action="store_true",
                   help="stop when a train/val slide's store holds 0 tiles (default: leave it out with a warning)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="train even when a method's predicted peak memory (logged before training, recorded with the "
                        "measured peak in <run>/memory.json) exceeds the memory available")
    p.add_argument("--folds", action="store_true",
                   help="train every fold of the manifest, fold k as pipeline <name>_fold<k>: the fixed-test folds of "
                   "`wsi-pipeline manifest ... --folds K` (its 'fold' column, M_fold<k>.csv) or every repeat and fold of "
                   "a cross-validation from `manifest ... --crossval K [--repeats R]` (columns cv_fold_r<r>; "
                   "M_r<r>_fold<k>.csv and pipelines <name>_r<r>_fold<k> when R > 1); finished runs are skipped")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.training import distributed
    from wsi_pipeline.training.loop import train_pipeline

    # a training run is long: report each epoch unless the user asked for less (--quiet; -v gives debug)
    pkg = logging.getLogger("wsi_pipeline")
    main_rank = distributed.env_rank() == 0  # under torchrun only rank 0 logs and shows progress
    if not main_rank:
        pkg.setLevel(logging.ERROR)
        args.no_progress = True
    elif pkg.getEffectiveLevel() > logging.INFO and not getattr(args, "quiet", False):
        pkg.setLevel(logging.INFO)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        config = pipeline_from_args(args)  # --device sets train.device; --method, --seed choose what to train
        configs = [config]
        if getattr(args, "folds", False):
            from wsi_pipeline.manifests.folds import fold_config, fold_runs

            configs = [fold_config(config, k) for k in fold_runs(config.data.manifest)]
        else:
            from wsi_pipeline.manifests.folds import check_not_crossval

            check_not_crossval(config.data.manifest, "train")
        runs = []
        with logging_redirect_tqdm():  # log lines go above the progress bars, not through them
            for cfg in configs:
                runs += train_pipeline(
                    cfg, methods=args.methods, seeds=args.seeds, resume=args.resume,
                    progress=not args.no_progress, strict=args.strict,
                    memory_check=not args.no_memory_check,
                )
    finally:
        distributed.shutdown()
    if not main_rank:
        return 0
    from wsi_pipeline.training.rundir import DONE, run_holder

    busy = [(r, who) for r in runs if not (r / DONE).exists() and (who := run_holder(r)) is not None]
    print(f"trained {len(runs) - len(busy)} run(s) of pipeline {config.name!r}:")
    for r in runs:
        if all(r != b for b, _ in busy):
            print(f"  {r}")
    for r, who in busy:
        print(f"wsi-pipeline train: not trained here: {r}: another process is training it ({who}); run the same "
              "command again after it finishes", file=sys.stderr)
    return 1 if busy else 0
