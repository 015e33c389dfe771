"""``wsi-pipeline predict``: predictions and heatmaps for a folder of new slides with a trained model."""

from __future__ import annotations

import argparse

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args, join_torchrun
from wsi_pipeline.cli._common import add_failure_argument, add_trust_argument, failure_status, add_device_argument, add_heatmap_mode_argument, add_output_arguments

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
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
            "files one process writes."
        ),
    )
    p.add_argument("--model", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (runs/<pipeline>/<method>/seed<k>; its best.pt is used) or a .pt checkpoint")
    p.add_argument("--slides", required=True, metavar="DIR",
                   help="folder of slide files (searched recursively; found and named as `tile --slides` and "
                        "`manifest folder` do: a.ome.tiff -> a) or of .zarr stores")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; tiles go to <out>/tiles)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tiling processes (default: one per core); 0 = in this process")
    add_device_argument(p)
    p.add_argument("--protocol", dest="protocols", action="append", default=None, metavar="P",
                   help="scoring protocol: all (default), sub<k>x<R> such as sub256x100 (R draws of k tiles) or ens<k>x<R> (repeatable)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="tiles per encoder call (default: the method's chunk_size)")
    p.add_argument("--mpp", type=float, default=None, metavar="UM",
                   help="level-0 resolution in um/px to assume for slides whose files do not record it")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random tile subsets of subsample protocols")
    p.add_argument("--no-heatmaps", action="store_true", help="predictions only")
    p.add_argument("--encoder-weights", default=None, metavar="FILE",
                   help="the base weights file of a fine-tuned foundation encoder (its checkpoint keeps only the trained "
                        "tensors: LoRA adapters, unfrozen blocks) when it is no longer where the training config says; "
                        "a file whose sha256 differs from the one recorded at training is refused")
    p.add_argument("--allow-other-tiling", action="store_true",
                   help="score a folder of .zarr stores tiled with other settings than the model's training stores "
                   "(another tile size, resolution, method or threshold) with a warning instead of refusing it")
    add_heatmap_mode_argument(p)
    add_output_arguments(p)
    add_failure_argument(p)
    add_trust_argument(p)
    add_cluster_arguments(p, shard=False)  # --cluster runs the tiling on Dask; embedding stays in this process
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from wsi_pipeline.evaluation.predict import predict_slides
    from wsi_pipeline.training import distributed

    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers {args.workers} must be >= 0")
    try:
        main = join_torchrun(args)
        cluster = cluster_from_args(args)
        s = predict_slides(
            args.model, args.slides, args.out,
            protocols=args.protocols or ["all"], device=args.device, workers=args.workers, batch_size=args.batch_size,
            mpp=args.mpp, heatmaps=not args.no_heatmaps, heatmap_mode=args.heatmap_mode, seed=args.seed,
            progress=not args.no_progress, allow_other_tiling=args.allow_other_tiling, cluster=cluster, retries=args.retries,
            encoder_weights=args.encoder_weights,
        )
    finally:
        distributed.shutdown()
    if not main:
        return 0
    df = pd.DataFrame(s.rows)
    n = df["slide_id"].nunique() if len(df) else 0
    print(f"\nPredicted {n} slide(s) in {s.seconds:.1f} s ({n / s.seconds * 3600 if s.seconds > 0 else 0:,.0f} slides/h, "
          "tiling included).")
    if len(df):
        probs = [c for c in df.columns if c.startswith("prob_") and c != "prob_std"]
        show = df[["slide_id", "protocol", "n_tiles", "pred"]].copy()
        show["p(pred)"] = ["{:.3f}".format(r["prob_" + str(int(r["pred"]))]) for r in s.rows]
        show["probs"] = [" ".join(f"{v:.3f}" for v in r) for r in df[probs].to_numpy()]
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
    print(f"  tile stores  {s.tiles_dir}")
    return failure_status(bool(s.failed), args)
