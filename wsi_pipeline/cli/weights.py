"""``wsi-pipeline weights``: fetch torchvision's ImageNet checkpoints once, so ``weights: imagenet`` works offline."""

from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from wsi_pipeline.models.imagenet import IMAGENET_WEIGHTS

    p = subparsers.add_parser(
        "weights",
        help="fetch or locate the ImageNet weights that `encoder: {weights: imagenet}` uses",
        description=(
            "`encoder: {name: resnet18, weights: imagenet}` (and `features --weights imagenet`) start the ResNet from "
            "torchvision's published ImageNet checkpoint, read from torchvision's cache ($TORCH_HOME/hub/checkpoints, "
            "~/.cache/torch without TORCH_HOME). No run ever downloads it: `fetch` does, once, where the network is "
            "allowed (torchvision's downloader; the file's sha256 is checked against its published name); `where` "
            "prints the path and whether the file is there (copy it there by hand on a machine without network)."
        ),
    )
    p.add_argument("action", choices=("fetch", "where"), help="fetch: download into the cache (kept if present and "
                   "intact); where: print the path and whether it is there")
    p.add_argument("encoders", nargs="+", choices=sorted(IMAGENET_WEIGHTS), metavar="ENCODER",
                   help=f"encoder(s): {', '.join(sorted(IMAGENET_WEIGHTS))}")
    p.add_argument("--file", metavar="PTH", default=None,
                   help="with where: check this file (e.g. downloaded by hand) instead of the cache: it must carry the "
                   "published name and its sha256 must begin with the digits in that name; then copy it into the cache")
    p.add_argument("--no-progress", action="store_true", help="no download progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.models.imagenet import check_published_hash, fetch_imagenet, imagenet_file

    if args.file is not None:
        from pathlib import Path

        if args.action != "where" or len(args.encoders) != 1:
            raise ValueError("--file checks one file: `wsi-pipeline weights where ENCODER --file PTH`")
        given = Path(args.file)
        if not given.is_file():
            raise FileNotFoundError(f"--file {given}: no such file")
        want = imagenet_file(args.encoders[0]).name
        if given.name != want:
            raise ValueError(f"--file {given}: the published checkpoint of {args.encoders[0]} is named {want}")
        check_published_hash(given)
        print(f"{args.encoders[0]}: {given} is the published checkpoint (sha256 checked); copy it to {imagenet_file(args.encoders[0])}")
        return 0
    missing = 0
    for name in args.encoders:
        if args.action == "fetch":
            print(f"{name}: {fetch_imagenet(name, progress=not args.no_progress)} (sha256 checked)")
            continue
        path = imagenet_file(name)
        if path.is_file():
            check_published_hash(path)
            print(f"{name}: {path} (present, sha256 checked)")
        else:
            missing += 1
            print(f"{name}: {path} (missing: `wsi-pipeline weights fetch {name}`)")
    return 1 if missing else 0
