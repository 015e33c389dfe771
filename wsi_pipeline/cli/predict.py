"""``wsi-pipeline predict``: predictions and heatmaps for a folder of new slides with a trained model."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args, join_torchrun
from wsi_pipeline.cli._common import (
    add_config_flag,
    add_device_argument,
    add_failure_argument,
    add_heatmap_mode_argument,
    add_output_arguments,
    add_set_argument,
    add_trust_argument,
    config_from_args,
    failure_status,
    section_keys,
)

if TYPE_CHECKING:
    from wsi_pipeline.config.predict import PredictConfig

__all__ = ["register", "run", "settings"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "predict",
        help="predict new, unlabelled slides with a trained model (predictions CSV + heatmaps)",
        description=(
            "Tile every slide of a folder with the tiling parameters saved with the model (tile size, mpp, "
            "foreground threshold), embed each slide once, aggregate, and write <out>/predictions.csv plus "
            "<out>/heatmaps/<slide_id>.png (attention over the thumbnail), .geojson (opens in QuPath) and "
            "_scores.csv. A folder of <slide_id>.zarr tile stores is used as it is, without tiling. "
            "No labels are needed. Each slide's stain colour and intensity are compared with the training tiles': "
            "slides far outside them are flagged (columns stain_distance and off_distribution, and a warning) "
            "but still predicted. A model trained with stain normalisation (data.stain) applies the normaliser stored "
            "in its checkpoint to every slide, from the slide's own stain estimate (columns stain_normalised and "
            "stain_problem: a slide whose stain cannot be estimated is predicted unnormalised). Under torchrun (torchrun --nproc_per_node=G -m wsi_pipeline.cli.main predict ...) "
            "the ranks tile the folder together, each scores a shard of the slides, and rank 0 writes the same "
            "files one process writes. The settings (protocols, workers, device, batch size, mpp, seed, heatmaps) may "
            "come from the `predict:` section of a YAML file (--config) and --set predict.KEY=VALUE; a flag given "
            "sets its key."
        ),
    )
    p.add_argument("--config", default=None, metavar="YAML",
                   help="YAML file whose `predict:` section holds the settings, e.g. {protocols: [all, sub256x100], "
                        "mpp: 0.25} (other sections are ignored)")
    add_set_argument(p, sections=_sections, example="predict.seed=3")
    p.add_argument("--model", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (runs/<pipeline>/<method>/seed<k>; its best.pt is used) or a .pt checkpoint")
    p.add_argument("--slides", required=True, metavar="DIR",
                   help="folder of slide files (searched recursively; found and named as `tile --slides` and "
                        "`manifest folder` do: a.ome.tiff -> a) or of .zarr stores; for a model trained on "
                        "precomputed features (encoder 'precomputed'), a folder of feature files <slide_id>.h5/.pt "
                        "(TRIDENT, CLAM, STAMP or ours, detected per file; see docs/interop.md)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; tiles go to <out>/tiles)")
    add_config_flag(p, "--workers", key="predict.workers", type=int, metavar="N",
                    help="tiling processes (predict.workers; default: one per core); 0 = in this process")
    add_device_argument(p, note="default: auto", key="predict.device")
    add_config_flag(p, "--protocol", key="predict.protocols", dest="protocols", action="append", metavar="P",
                    help="scoring protocol: all (default), sub<k>x<R> such as sub256x100 (R draws of k tiles) or "
                         "ens<k>x<R> (repeatable; predict.protocols)")
    add_config_flag(p, "--batch-size", key="predict.batch_size", type=int, metavar="N",
                    help="tiles per encoder call (predict.batch_size; default: the method's chunk_size)")
    add_config_flag(p, "--mpp", key="predict.mpp", type=float, metavar="UM",
                    help="level-0 resolution in um/px to assume for slides whose files do not record it (predict.mpp)")
    add_config_flag(p, "--seed", key="predict.seed", type=int, metavar="N",
                    help="seed of the random tile subsets of subsample protocols (predict.seed; default: 0)")
    add_config_flag(p, "--no-heatmaps", key="predict.heatmaps", dest="heatmaps", action="store_false",
                    help="predictions only (predict.heatmaps: false)")
    add_config_flag(p, "--encoder-weights", key="predict.encoder_weights", metavar="FILE",
                    help="the base weights file of a fine-tuned foundation encoder (its checkpoint keeps only the trained "
                         "tensors: LoRA adapters, unfrozen blocks) when it is no longer where the training config says; "
                         "a file whose sha256 differs from the one recorded at training is refused (predict.encoder_weights)")
    add_config_flag(p, "--allow-other-tiling", key="predict.allow_other_tiling", action="store_true",
                    help="score a folder of .zarr stores tiled with other settings than the model's training stores "
                         "(another tile size, resolution, method or threshold) with a warning instead of refusing it "
                         "(predict.allow_other_tiling)")
    add_config_flag(p, "--tissue-model", key="predict.tissue_model", metavar="FILE",
                    help="the tissue model file that tiled the model's training stores (their `tile --method unet "
                         "--tissue-model FILE`); new slides are tiled with it. A model whose stores another tissue model "
                         "tiled than the one given (default: the shipped one) is refused, naming both fingerprints "
                         "(predict.tissue_model)")
    add_heatmap_mode_argument(p, "predict")
    add_output_arguments(p)
    add_failure_argument(p)
    add_trust_argument(p)
    add_cluster_arguments(p, shard=False)  # --cluster runs the tiling on Dask; embedding stays in this process
    p.set_defaults(func=run)


def _sections() -> dict[str, tuple[str, ...]]:
    from wsi_pipeline.config.predict import PredictConfig

    return {"predict": tuple(section_keys(PredictConfig))}


def settings(args: argparse.Namespace) -> PredictConfig:
    """The command's :class:`~wsi_pipeline.config.predict.PredictConfig`: --config's ``predict:`` section, the flags, --set."""
    from wsi_pipeline.config.overrides import section_of
    from wsi_pipeline.config.predict import PredictConfig
    from wsi_pipeline.config.schema import build

    return config_from_args(args, lambda raw: build(PredictConfig, section_of(raw, "predict"), "predict"))


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from wsi_pipeline.evaluation.predict import predict_slides
    from wsi_pipeline.tasks import get_task
    from wsi_pipeline.training import distributed

    config = settings(args)  # a bad value is refused before torchrun is joined
    try:
        main = join_torchrun(args)
        cluster = cluster_from_args(args)
        s = predict_slides(args.model, args.slides, args.out, **config.keywords(), progress=not args.no_progress,
                           cluster=cluster, retries=args.retries)
    finally:
        distributed.shutdown()
    if not main:
        return 0
    df = pd.DataFrame(s.rows)
    n = df["slide_id"].nunique() if len(df) else 0
    print(f"\nPredicted {n} slide(s) in {s.seconds:.1f} s ({n / s.seconds * 3600 if s.seconds > 0 else 0:,.0f} slides/h, "
          "tiling included).")
    if len(df):
        show = df[["slide_id", "protocol", "n_tiles"]].copy()
        cells = [get_task(s.task).summary_cells(r) for r in s.rows]  # the task says what a row shows
        for heading in cells[0]:
            show[heading] = [c.get(heading, "") for c in cells]
        if s.stain_checks:  # distance of the slide's stain from the training tiles'
            show["stain"] = [("OFF {:.1f}" if r["off_distribution"] else "ok {:.1f}").format(r["stain_distance"])
                             if r["stain_distance"] is not None else "-" for r in s.rows]
        print(show.to_string(index=False))
    off = sorted(sid for sid, c in s.stain_checks.items() if c.off_distribution)
    if off:
        print(f"\n{len(off)} slide(s) look unlike the model's training tiles (stain distance > "
              f"{s.stain_checks[off[0]].threshold:g}; off_distribution in predictions.csv): {', '.join(off)}. "
              "They were predicted anyway; do not trust those predictions without checking the slides.")
    for sid, why in s.failed:
        print(f"  not predicted: {sid}: {why}")
    print(f"\nOutputs in {s.out_dir}/")
    print(f"  predictions  {s.predictions}")
    if s.heatmaps_dir is not None and len(df):
        print(f"  heatmaps     {s.heatmaps_dir}/<slide_id>.png, .geojson (QuPath: File > Import objects), _scores.csv")
    print(f"  {'features   ' if s.features else 'tile stores'}  {s.tiles_dir}")
    return failure_status(bool(s.failed), args)
