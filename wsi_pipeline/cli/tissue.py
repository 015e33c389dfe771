"""``wsi-pipeline tissue``: whole-image tissue segmentation (train the paper's U-Net, predict masks)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from wsi_pipeline.cli._common import add_device_argument, add_output_arguments, add_trust_argument

__all__ = ["register"]


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return v


def _add_inputs(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--slides", metavar="DIR", help="folder of slides (searched recursively)")
    src.add_argument("--manifest", metavar="CSV", help="manifest CSV (slide_id, path, optional split: train/val/test)")
    p.add_argument("--slide-mpp", type=_positive, default=None, metavar="UM",
                   help="level-0 um/px for slides whose metadata has none (the slide's own value wins)")
    add_device_argument(p, default="cpu", note="it runs the chunks, activations stay in host memory")
    p.add_argument("--max-elements", type=int, default=None, metavar="N",
                   help="device budget of one chunk step in elements (default: 64 Mi = 256 MiB float32)")
    add_output_arguments(p)


def _entries(args: argparse.Namespace):
    from wsi_pipeline.tissue_seg.stage import slides_from_folder, slides_from_manifest

    return slides_from_manifest(args.manifest) if args.manifest else slides_from_folder(args.slides)


def _log(args: argparse.Namespace) -> Callable[[str], None]:
    """Where the stage's per-epoch and per-slide lines go: nowhere with --quiet (the stage draws no bars)."""
    return (lambda line: None) if args.quiet else print


def _train(args: argparse.Namespace) -> int:
    from wsi_pipeline.tissue_seg.chunked import DEFAULT_MAX_ELEMENTS
    from wsi_pipeline.tissue_seg.stage import train

    best = train(
        _entries(args), args.out, mpp=args.mpp, size=tuple(args.size) if args.size else None, slide_mpp=args.slide_mpp,
        epochs=args.epochs, lr=args.lr, seed=args.seed, val_fraction=args.val_fraction, channels=args.channels,
        device=args.device, max_elements=args.max_elements or DEFAULT_MAX_ELEMENTS, log=_log(args),
    )
    print(f"best: epoch {best['epoch']}, val loss {best['val_loss']:.4f}, val Dice {best['val_dice']:.4f} -> {args.out}/best.pt")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from wsi_pipeline.tissue_seg.chunked import DEFAULT_MAX_ELEMENTS
    from wsi_pipeline.tissue_seg.stage import predict

    predict(args.model, _entries(args), args.out, mpp=args.mpp, slide_mpp=args.slide_mpp, device=args.device,
            max_elements=args.max_elements or DEFAULT_MAX_ELEMENTS, log=_log(args))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
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
    _add_inputs(t)
    t.add_argument("--out", required=True, metavar="DIR", help="run folder (resumed when it holds last.pt)")
    t.add_argument("--mpp", type=_positive, default=2.0, metavar="UM", help="working resolution in um/px")
    t.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), default=None,
                   help="crop (top-left) or pad every image to H x W px (multiples of 32; the paper: 16000 64000); "
                        "(default: the whole slide padded to multiples of 32)")
    t.add_argument("--epochs", type=int, default=20, metavar="N", help="passes over the training slides")
    t.add_argument("--lr", type=_positive, default=1e-3, metavar="LR", help="Adam learning rate (the paper: 1e-3)")
    t.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the weights, the slide order and a drawn validation split")
    t.add_argument("--val-fraction", type=float, default=0.2, metavar="F",
                   help="share of slides drawn for validation when the manifest has no split (or --slides is used)")
    t.add_argument("--channels", type=int, default=8, metavar="N",
                   help="hidden channels (8: 4,409 parameters; the paper: 4,492)")
    t.set_defaults(func=_train)

    q = sub.add_parser("predict", help="write a tissue mask per slide",
                       description="OUT/<slide_id>_mask.png (255 = tissue) at 8 image px per mask px, i.e. 8 x mpp "
                                   "um/px; OUT/<slide_id>_overlay.png (QC, tissue tinted green); OUT/<slide_id>_mask.json.")
    _add_inputs(q)
    q.add_argument("--model", required=True, metavar="PT", help="best.pt of `tissue train` or its run folder")
    add_trust_argument(q)
    q.add_argument("--out", required=True, metavar="DIR", help="output folder")
    q.add_argument("--mpp", type=_positive, default=None, metavar="UM",
                   help="working resolution in um/px (default: the model's)")
    q.set_defaults(func=_predict)
