"""``wsi-pipeline features``: frozen-encoder features, one HDF5 file per slide (the frozen baseline)."""

from __future__ import annotations

import argparse

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "features",
        help="embed tile stores with a frozen encoder into one .h5 per slide",
        description=(
            "Embed every slide's tile store (<tiles>/<slide_id>.zarr) with a frozen encoder and write "
            "<out>/<slide_id>.h5 with `features` [N, D] float32, `coords` [N, 2] (level-0 px) and attributes "
            "naming the encoder, the sha256 of its weights and the store's fingerprint. Up-to-date files are "
            "skipped; a per-slide status table goes to <out>/features_report.csv."
        ),
    )
    p.add_argument("--manifest", required=True, help="manifest CSV; its slide_id column selects the stores")
    p.add_argument("--tiles", required=True, help="folder of tile stores written by `wsi-pipeline tile`")
    p.add_argument("--out", required=True, help="output folder for the .h5 feature files (created)")
    p.add_argument("--encoder", default="resnet18", help="registered encoder name (default: resnet18)")
    p.add_argument(
        "--weights",
        default=None,
        help="torchvision-style checkpoint for the encoder; without it the encoder is randomly initialised (seed 0)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="tiles per forward pass (default: 64)")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--overwrite", action="store_true", help="re-extract files that are already up to date")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    add_cluster_arguments(p, shard=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.inference.features import extract_features
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.models import ENCODERS

    if args.encoder not in ENCODERS:
        print(f"error: --encoder {args.encoder!r} is unknown; choose one of {ENCODERS.names()}")
        return 2
    try:
        cluster = cluster_from_args(args)
    except ValueError as err:
        print(f"wsi-pipeline features: error: {err}")
        return 2
    df = read_manifest(args.manifest)
    report = extract_features(
        df,
        args.tiles,
        args.out,
        args.encoder,
        args.weights,
        batch_size=args.batch_size,
        device=args.device,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        cluster=cluster,
        retries=args.retries,
    )
    counts = report["status"].value_counts().to_dict()
    print(f"features: {counts.get('ok', 0)} written, {counts.get('skipped', 0)} up to date, "
          f"{counts.get('failed', 0)} failed -> {args.out}")
    for _, r in report[report["status"] == "failed"].iterrows():
        print(f"  failed {r['slide_id']}: {r['error']}")
    return 1 if counts.get("failed", 0) else 0
