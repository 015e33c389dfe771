"""``wsi-pipeline features``: frozen-encoder features, one HDF5 file per slide (the frozen baseline)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args
from wsi_pipeline.cli._common import (
    LazyChoices,
    add_device_argument,
    add_failure_argument,
    add_output_arguments,
    add_config_flag,
    add_set_argument,
    config_from_args,
    failure_status,
)

if TYPE_CHECKING:
    from wsi_pipeline.config.features import FeaturesConfig

__all__ = ["register", "run", "settings"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "features",
        help="embed tile stores with a frozen encoder into one .h5 per slide",
        description=(
            "Embed every slide's tile store (<tiles>/<slide_id>.zarr) with a frozen encoder and write "
            "<out>/<slide_id>.h5 with `features` [N, D] float32, `coords` [N, 2] (level-0 px) and attributes "
            "naming the encoder, the sha256 of its weights (and of its weights file), its preprocessing (resize "
            "to the model's input size, normalisation) and the store's fingerprint. Up-to-date files are "
            "skipped; a per-slide status table goes to <out>/features_report.csv. The settings (encoder, weights, "
            "batch size, bf16, device) may come from the `features:` section of a YAML file (--config) and --set "
            "features.KEY=VALUE; a flag given sets its key."
        ),
    )
    p.add_argument("--config", default=None, metavar="YAML",
                   help="YAML file whose `features:` section holds the settings, e.g. {encoder: uni_v1, batch_size: 128} "
                        "(other sections are ignored)")
    add_set_argument(p, sections=_sections, example="features.batch_size=128")
    p.add_argument("--manifest", required=True, metavar="CSV", help="manifest CSV; its slide_id column selects the stores")
    p.add_argument("--tiles", required=True, metavar="DIR", help="folder of tile stores written by `wsi-pipeline tile`")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder for the .h5 feature files (created)")
    add_config_flag(p, "--encoder", key="features.encoder", choices=LazyChoices("wsi_pipeline.models", "encoder_choices"),
                    metavar="NAME",
                    help="tile encoder, one of %(choices)s: our ResNets, the foundation-model presets (UNI, UNI2-h, "
                         "Virchow2, H-optimus-0/1, Prov-GigaPath tile encoder; README 'Foundation models'), or any timm "
                         "architecture as timm:<name> (features.encoder; default resnet18)")
    add_config_flag(
        p, "--weights", key="features.weights", metavar="FILE",
        help="weights file: a torchvision checkpoint for a ResNet, or `imagenet` for torchvision's ImageNet checkpoint "
             "(`wsi-pipeline weights fetch`); for a foundation preset the file its model card publishes "
             "(pytorch_model.bin, model.safetensors or .pth), loaded strictly, never downloaded; without it the encoder "
             "is randomly initialised (seed 0) (features.weights)",
    )
    add_config_flag(p, "--batch-size", key="features.batch_size", type=int, metavar="N",
                    help="tiles per forward pass (features.batch_size; default: 64)")
    add_config_flag(p, "--bf16", key="features.bf16", action="store_true",
                    help="embed under bfloat16 autocast (fast on recent GPUs; features are stored as float32 and the "
                         "precision is recorded, so float32 and bf16 files never mix) (features.bf16)")
    add_device_argument(p, note="default: auto", key="features.device")
    p.add_argument("--layout", choices=("wsi-pipeline", "trident", "stamp"), default="wsi-pipeline",
                   help="file layout (default wsi-pipeline, ours): `trident` writes TRIDENT's job-folder layout, "
                        "<out>/features_<encoder>/<slide_id>.h5 with `features` [N, D] and `coords` [N, 2] (level-0 px) "
                        "carrying patch_size, patch_size_level0, level0_magnification, target_magnification, overlap, "
                        "level0_width, level0_height; `stamp` writes <out>/<slide_id>.h5 with `feats` [N, D] and `coords` "
                        "[N, 2] in micrometres and the attributes extractor, unit (um), tile_size_um, tile_size_px (needs "
                        "the stores' mpp). Our own attributes are kept in every layout (docs/interop.md)")
    p.add_argument("--overwrite", action="store_true", help="re-extract files that are already up to date")
    add_output_arguments(p)
    add_failure_argument(p)
    add_cluster_arguments(p, shard=False)
    p.set_defaults(func=run)


def _sections() -> dict[str, tuple[str, ...]]:
    from wsi_pipeline.cli._common import section_keys
    from wsi_pipeline.config.features import FeaturesConfig

    return {"features": tuple(section_keys(FeaturesConfig))}


def settings(args: argparse.Namespace) -> FeaturesConfig:
    """The command's :class:`~wsi_pipeline.config.features.FeaturesConfig`: --config's ``features:`` section, the flags, --set."""
    from wsi_pipeline.config.features import FeaturesConfig
    from wsi_pipeline.config.overrides import section_of
    from wsi_pipeline.config.schema import build

    return config_from_args(args, lambda raw: build(FeaturesConfig, section_of(raw, "features"), "features"))


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.inference.features import LEFT_OUT_NOTE, extract_features
    from wsi_pipeline.manifests.schema import read_manifest

    config = settings(args)
    cluster = cluster_from_args(args)
    df = read_manifest(args.manifest)
    out = args.out
    if args.layout == "trident":  # TRIDENT's job folder: one features_<encoder> folder per encoder
        from pathlib import Path

        out = str(Path(args.out) / f"features_{config.encoder.replace(':', '-')}")
    report = extract_features(
        df,
        args.tiles,
        out,
        config.encoder,
        config.weights,
        batch_size=config.batch_size,
        device=config.device,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        cluster=cluster,
        retries=args.retries,
        bf16=config.bf16,
        layout=args.layout,
    )
    counts = report["status"].value_counts().to_dict()
    left = report["note"].fillna("").astype(str).str.startswith(LEFT_OUT_NOTE)
    print(f"features: {counts.get('ok', 0)} written, {counts.get('skipped', 0) - int(left.sum())} up to date, "
          f"{int(left.sum())} skipped (left out by the tiler), {counts.get('failed', 0)} failed -> {out}"
          + (f" ({args.layout} layout)" if args.layout != "wsi-pipeline" else ""))
    for _, r in report[left].iterrows():
        print(f"  skipped {r['slide_id']}: {r['note']}")
    for _, r in report[report["status"] == "failed"].iterrows():
        print(f"  failed {r['slide_id']}: {r['error']}")
    return failure_status(bool(counts.get("failed", 0)), args)
