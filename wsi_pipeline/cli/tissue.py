"""``wsi-pipeline tissue``: whole-image tissue segmentation (train the paper's U-Net, predict masks)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from wsi_pipeline.cli._common import (
    add_config_flag,
    add_device_argument,
    add_output_arguments,
    add_set_argument,
    add_trust_argument,
    config_from_args,
    section_keys,
)

if TYPE_CHECKING:
    from wsi_pipeline.config.tissue import TissuePredictConfig, TissueTrainConfig
    from wsi_pipeline.tissue_seg.stage import SlideEntry

__all__ = ["register", "settings"]


def _add_inputs(p: argparse.ArgumentParser, section: str) -> None:
    """The inputs, ``--config``/``--set`` and the flags both subcommands share (each sets ``<section>.<key>``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--slides", metavar="DIR", help="folder of slides (searched recursively)")
    src.add_argument("--manifest", metavar="CSV", help="manifest CSV (slide_id, path, optional split: train/val/test)")
    p.add_argument("--config", default=None, metavar="YAML",
                   help=f"YAML file whose `{section}:` section holds the settings (other sections are ignored)")
    add_set_argument(p, sections=lambda: _sections(section), example=f"{section}.device=cuda")
    add_config_flag(p, "--slide-mpp", key=f"{section}.slide_mpp", type=float, metavar="UM",
                    help=f"level-0 um/px for slides whose metadata has none (the slide's own value wins) ({section}.slide_mpp)")
    add_device_argument(p, note="default: cpu; it runs the chunks, activations stay in host memory", key=f"{section}.device")
    add_config_flag(p, "--max-elements", key=f"{section}.max_elements", type=int, metavar="N",
                    help=f"device budget of one chunk step in elements ({section}.max_elements; default: 64 Mi = 256 MiB float32)")
    add_output_arguments(p)


def _classes() -> Mapping[str, type]:
    from wsi_pipeline.config.tissue import TissuePredictConfig, TissueTrainConfig

    return {"tissue.train": TissueTrainConfig, "tissue.predict": TissuePredictConfig}


def _sections(section: str) -> dict[str, tuple[str, ...]]:
    return {section: tuple(section_keys(_classes()[section]))}


def settings(args: argparse.Namespace) -> Any:
    """The subcommand's settings (:class:`~wsi_pipeline.config.tissue.TissueTrainConfig` or
    :class:`~wsi_pipeline.config.tissue.TissuePredictConfig`): --config's section, the flags, --set."""
    from wsi_pipeline.config.overrides import section_of
    from wsi_pipeline.config.schema import build

    section = f"tissue.{args.tissue_command}"
    cls = _classes()[section]
    return config_from_args(args, lambda raw: build(cls, section_of(raw, section), section))


def _entries(args: argparse.Namespace) -> list[SlideEntry]:
    from wsi_pipeline.tissue_seg.stage import slides_from_folder, slides_from_manifest

    return slides_from_manifest(args.manifest) if args.manifest else slides_from_folder(args.slides)


def _log(args: argparse.Namespace) -> Callable[[str], None]:
    """Where the stage's per-epoch and per-slide lines go: nowhere with --quiet (the stage draws no bars)."""
    return (lambda line: None) if args.quiet else print


def _train(args: argparse.Namespace) -> int:
    from wsi_pipeline.tissue_seg.chunked import DEFAULT_MAX_ELEMENTS
    from wsi_pipeline.tissue_seg.stage import train

    cfg: TissueTrainConfig = settings(args)
    best = train(
        _entries(args), args.out, mpp=cfg.mpp, size=cfg.size, slide_mpp=cfg.slide_mpp, epochs=cfg.epochs, lr=cfg.lr,
        seed=cfg.seed, val_fraction=cfg.val_fraction, channels=cfg.channels, device=cfg.device,
        max_elements=cfg.max_elements or DEFAULT_MAX_ELEMENTS, log=_log(args),
    )
    print(f"best: epoch {best['epoch']}, val loss {best['val_loss']:.4f}, val Dice {best['val_dice']:.4f} -> {args.out}/best.pt")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from wsi_pipeline.tissue_seg.chunked import DEFAULT_MAX_ELEMENTS
    from wsi_pipeline.tissue_seg.stage import predict

    cfg: TissuePredictConfig = settings(args)
    predict(args.model, _entries(args), args.out, mpp=cfg.mpp, slide_mpp=cfg.slide_mpp, device=cfg.device,
            max_elements=cfg.max_elements or DEFAULT_MAX_ELEMENTS, log=_log(args))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tissue`` subcommand with ``train`` and ``predict``."""
    p = subparsers.add_parser(
        "tissue", help="whole-image tissue segmentation (the shared-memory paper's U-Net)",
        description="Train the 7-layer large-kernel U-Net of the shared-memory paper on whole slide images "
                    "(labels from the paper's classical pipeline), or predict tissue masks with it.",
    )
    sub = p.add_subparsers(dest="tissue_command", metavar="<train|predict>", required=True)

    t = sub.add_parser("train", help="train on whole images, one slide per step",
                       description="Labels are computed and cached per slide under OUT/cache; OUT gets history.json, "
                                   "last.pt (resume: run the same command again) and best.pt (lowest validation loss).")
    _add_inputs(t, "tissue.train")
    t.add_argument("--out", required=True, metavar="DIR", help="run folder (resumed when it holds last.pt)")
    add_config_flag(t, "--mpp", key="tissue.train.mpp", type=float, metavar="UM",
                    help="working resolution in um/px (tissue.train.mpp; default: 2.0)")
    add_config_flag(t, "--size", key="tissue.train.size", type=int, nargs=2, metavar=("H", "W"),
                    help="crop (top-left) or pad every image to H x W px (multiples of 32; the paper: 16000 64000) "
                         "(tissue.train.size; default: the whole slide padded to multiples of 32)")
    add_config_flag(t, "--epochs", key="tissue.train.epochs", type=int, metavar="N",
                    help="passes over the training slides (tissue.train.epochs; default: 20)")
    add_config_flag(t, "--lr", key="tissue.train.lr", type=float, metavar="LR",
                    help="Adam learning rate (tissue.train.lr; default 1e-3, the paper's)")
    add_config_flag(t, "--seed", key="tissue.train.seed", type=int, metavar="N",
                    help="seed of the weights, the slide order and a drawn validation split (tissue.train.seed; default: 0)")
    add_config_flag(t, "--val-fraction", key="tissue.train.val_fraction", type=float, metavar="F",
                    help="share of slides drawn for validation when the manifest has no split (or --slides is used) "
                         "(tissue.train.val_fraction; default: 0.2)")
    add_config_flag(t, "--channels", key="tissue.train.channels", type=int, metavar="N",
                    help="hidden channels (tissue.train.channels; default 8: 4,409 parameters; the paper: 4,492)")
    t.set_defaults(func=_train)

    q = sub.add_parser("predict", help="write a tissue mask per slide",
                       description="OUT/<slide_id>_mask.png (255 = tissue) at 8 image px per mask px, i.e. 8 x mpp "
                                   "um/px; OUT/<slide_id>_overlay.png (QC, tissue tinted green); OUT/<slide_id>_mask.json.")
    _add_inputs(q, "tissue.predict")
    q.add_argument("--model", required=True, metavar="PT", help="best.pt of `tissue train` or its run folder")
    add_trust_argument(q)
    q.add_argument("--out", required=True, metavar="DIR", help="output folder")
    add_config_flag(q, "--mpp", key="tissue.predict.mpp", type=float, metavar="UM",
                    help="working resolution in um/px (tissue.predict.mpp; default: the model's)")
    q.set_defaults(func=_predict)
