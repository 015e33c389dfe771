"""``wsi-pipeline tile``: slides (a folder or a manifest) to zarr tile stores.

The tiling settings go through the config builder every stage uses: a pipeline YAML (``--config``), then
each tiling flag given on the command line at its ``data.tiling`` key (:func:`~wsi_pipeline.cli._common.add_config_flag`),
then ``--set``, which has the last word; the section is checked by its dataclass
(:class:`~wsi_pipeline.config.store_settings.StoreSettings`), argparse only parses.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args, shard_from_args
from wsi_pipeline.cli._common import (
    LazyChoices, add_config_flag, add_failure_argument, add_output_arguments, add_set_argument, config_from_args, failure_status,
)

if TYPE_CHECKING:
    from wsi_pipeline.config.store_settings import StoreSettings
    from wsi_pipeline.config.tiling import TilingConfig

__all__ = ["register", "run", "tiling_from_args"]

DESCRIPTION = (
    "Tile every slide of a folder (or of a manifest) into <out>/<slide_id>.zarr: non-overlapping "
    "full tiles on a grid anchored at (0, 0), kept when their foreground fraction reaches a threshold. "
    "Writes <out>/tiling_report.csv, a QC image per slide (<out>/qc/<slide_id>.png) and the tissue mask's contours "
    "as QuPath annotations (<out>/tissue/<slide_id>.geojson). Reruns skip "
    "complete stores built from the same slide with the same settings, and rebuild partial or outdated "
    "ones; any number of runs may share one --out (each slide is tiled once, under a lock). "
    "Exit status 1 when any slide failed (after all others were tiled); 2 when the arguments are unusable: "
    "no slides found, a setting out of range, or an --out that cannot be created or written (checked before any "
    "work). Formats: whatever OpenSlide reads (SVS, NDPI, SCN, MRXS, BIF, DICOM, generic tiled TIFF, ...), through "
    "tiffslide OME-TIFF, and through wsidicom DICOM WSI (a folder of one slide's .dcm files, or one .dcm file); "
    "plain images (PNG, JPEG, BMP through Pillow; plain striped or tiled TIFF) as one-level slides (a "
    "72-300 dpi resolution tag is ignored: give their mpp in a manifest mpp column or with --mpp; keep --out "
    "and other outputs with PNG files outside an image folder). With --points, one tile centred on each given "
    "point instead of the grid. "
    "The tiling settings are a pipeline's data.tiling: with --config PIPELINE.yaml its data.tiling, changed by "
    "the tiling flags given (each flag sets its data.tiling key), then by --set data.tiling.KEY=VALUE (the last word); "
    "--manifest / --out default to its data.manifest / data.tiles_dir."
)


def _int_or_auto(text: str) -> int | str:
    """``--grey-max``: an integer, or the word as written (``auto``; the dataclass checks it)."""
    try:
        return int(text)
    except ValueError:
        return text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tile`` subcommand."""
    p = subparsers.add_parser("tile", help="tile whole-slide images into zarr tile stores", description=DESCRIPTION)
    _add_input_arguments(p)
    _add_detector_arguments(p)
    _add_resolution_arguments(p)
    _add_store_arguments(p)
    _add_qc_arguments(p)
    _add_region_arguments(p)
    _add_point_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="rebuild every store, even complete and current ones")
    add_output_arguments(p)
    add_failure_argument(p)
    p.add_argument("--lock-stale-after", type=float, default=600.0, metavar="S",
                   help="several runs may share one --out: each slide is tiled under a lock (<out>/.locks) that its run "
                        "refreshes every 30 s; a lock whose run is gone (same host) or not refreshed for S seconds "
                        "(another host) is taken over")
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="YAML",
                   help="pipeline YAML file (as train takes it, with --set): tile with its data.tiling settings (method, "
                        "tile_size, min_foreground, mpp_target, qc_mode, qc_params, grey_min, grey_max, points, points_edge, "
                        "points_filter, region_include, region_exclude, region_min_fraction, compression, backend); "
                        "each tiling flag given on the command line overrides its key, the others keep data.tiling's "
                        "values (then the tiler's defaults). --manifest defaults to data.manifest and --out to "
                        "data.tiles_dir")
    add_set_argument(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--slides", metavar="DIR", help="folder of slides, scanned recursively (or one slide file); slide_id = "
                     "file name without extension (a.ome.tiff -> a), a DICOM folder's name; the same ids as `manifest "
                     "folder` and `predict`")
    src.add_argument("--manifest", metavar="CSV", help="manifest CSV (columns slide_id, path, optional mpp) (with --config: "
                     "default data.manifest)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder for the tile stores, QC images and report (required; with --config: default "
                        "data.tiles_dir)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="slides tiled in parallel, one process each (default: number of cores); 0 = in this process")


def _add_detector_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--method", key="data.tiling.method", choices=LazyChoices("wsi_pipeline.config.tiling_params", "DETECTOR_PARAMS"), default=None,
                   metavar="METHOD",
                   help="tissue detector (data.tiling.method), one of %(choices)s: tissue (default) = stained tissue by "
                        "optical density against each slide's own glass colour, estimated from its thumbnail (any "
                        "brightfield stain: H&E, IHC, special stains, pale sections; glass of any grey level or tint is "
                        "dropped; pen ink is not tissue), tile kept at >= 50 %% tissue; greyscale = the paper's rule, "
                        "per-tile fraction of pixels with grey in [grey-min, grey-max] (PANDA protocol; reproduce the "
                        "paper with --method greyscale --qc off); otsu = tissue mask from Otsu's threshold at low "
                        "resolution (CAMELYON protocol); unet = tissue mask of the whole-image tissue U-Net "
                        "(wsi-pipeline tissue; see --tissue-model), its input scaled to the slide's glass level and its "
                        "mask kept within the tissue rule's stained area")
    p.add_argument("--tissue-model", default=None, metavar="PATH",
                   help="unet method: best.pt of `wsi-pipeline tissue train` (default: the model shipped with the package)")
    add_config_flag(p, "--tile-size", key="data.tiling.tile_size", type=int, default=None, metavar="PX",
                   help="tile side in px at the tile resolution (default 256; any size >= 8, odd sizes such as 27 too)")
    add_config_flag(p, "--min-foreground", key="data.tiling.min_foreground", type=float, default=None, metavar="F",
                   help="keep a tile when its foreground (greyscale) or tissue (tissue, otsu, unet) fraction is >= F "
                        "(a fraction in [0, 1]; default: 0.6 for greyscale, 0.5 for the others)")
    add_config_flag(p, "--grey-min", key="data.tiling.grey_min", type=int, default=None, metavar="G",
                   help="darkest grey value counted as foreground (greyscale method; default 3)")
    add_config_flag(p, "--grey-max", key="data.tiling.grey_max", type=_int_or_auto, default=None, metavar="G",
                   help="brightest grey value counted as foreground (greyscale method; default 230); 'auto': each slide's "
                        "glass grey level, estimated from its thumbnail, minus 10 (230 when a slide shows no glass). The "
                        "glass level is in the report's background_grey column; a warning says when it lies inside the "
                        "foreground band")
    p.add_argument("--no-prescreen", action="store_true",
                   help="greyscale method: decode and test every tile whole, instead of skipping tiles a low-resolution "
                        "bound proves to be background and deciding probable glass from its top rows first "
                        "(same result, slower; for checking)")
    p.add_argument("--allow-dark-background", action="store_true",
                   help="tile slides whose background is dark (fluorescence) with these brightfield rules; by default "
                        "they are reported as skipped: dark background (fluorescence?)")


def _add_resolution_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--mpp-target", key="data.tiling.mpp_target", type=float, default=None, metavar="UM",
                   help="tile resolution in um/px (> 0; 0.5 is about 20x): read the best pyramid level at or finer than "
                        "it and resize (default: the native resolution of level 0)")
    mpp = p.add_mutually_exclusive_group()
    mpp.add_argument("--mpp", type=float, default=None, metavar="UM",
                     help="um/px of level 0 for slides that have none (neither in their metadata nor in a manifest mpp "
                          "column); slides with their own mpp keep it. A resolution tag that is not a microscope's (a "
                          "TIFF/PNG/JPEG/BMP dpi such as 72 or 300, i.e. above 20 um/px) is ignored with a warning, so "
                          "such images take this value. The report's mpp_source column says which was used "
                          "(ignored-dpi:<dpi> when none was)")
    mpp.add_argument("--mpp-force", type=float, default=None, metavar="UM",
                     help="um/px of level 0 for every slide, overriding the slides' metadata and any manifest mpp column "
                          "(for scanners that write wrong values)")


def _add_store_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--compression", key="data.tiling.compression", choices=LazyChoices("wsi_pipeline.data.store", "COMPRESSIONS"), default=None,
                   metavar="CODEC", help="tile compression in the store, one of %(choices)s: zstd (lossless, default), "
                                         "jpeg (lossy, quality 90, ~10x smaller) or none")
    p.add_argument("--shard-tiles", type=int, default=None, metavar="N",
                   help="tiles per shard file in new stores (zarr v3 sharding; a tile is still read on its own) "
                        "(default: 1024); 0 = one file per tile (the older layout, 100-1000x more files)")
    add_config_flag(p, "--backend", key="data.tiling.backend", choices=LazyChoices("wsi_pipeline.slides.opener", "BACKENDS"), default=None,
                   metavar="READER", help="slide reader, one of %(choices)s; auto (default) tries OpenSlide, then "
                                          "tiffslide (for a DICOM file: OpenSlide, then wsidicom; a .png/.jpg/.jpeg/.bmp "
                                          "image is read by Pillow as a one-level slide)")
    p.add_argument("--no-qc-images", action="store_true", help="do not write the QC images (qc/<slide_id>.png); tile QC itself is --qc MODE")


def _add_qc_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--qc", key="data.tiling.qc_mode", choices=LazyChoices("wsi_pipeline.config.choices", "QC_MODES"), default=None, metavar="MODE",
                   help="tile artifact QC (data.tiling.qc_mode), one of %(choices)s: drop (default) = drop the tiles "
                        "with the artifacts of --qc-drop and flag the others; flag = record every artifact, drop "
                        "nothing; off = no QC (the paper's tiles). Artifacts: pen = marker ink (green, blue, red, black; "
                        "by colour on an overview of 16 um px) on >= --qc-pen of the tile; blur = focus measure "
                        "E[(g-G1 g)^2] / (E[(G1 g-G3 g)^2] + 4) of the tile's grey image below --qc-focus-min (G_s: "
                        "Gaussian of sigma s px, at <= 0.5 um/px); fold = folded tissue (2.5x the slide's median "
                        "optical density, same colour, over >= 0.02 mm^2) on >= 25 %% of the tile. A slide losing > 10 %% "
                        "of its tissue tiles to QC is warned about. Per-tile arrays qc_flags, qc_focus, qc_pen, qc_fold "
                        "in the store; counts per slide in tiling_report.csv (qc_dropped, qc_pen, qc_blur, qc_fold) and "
                        "the QC image (flagged tiles orange, dropped red)")
    add_config_flag(p, "--qc-drop", key="data.tiling.qc_params.drop", type=lambda text: [a.strip() for a in text.split(",") if a.strip()], default=None,
                   metavar="LIST", help="artifacts --qc drop removes, comma-separated from pen, blur, fold (default pen,blur)")
    add_config_flag(p, "--qc-pen", key="data.tiling.qc_params.pen_fraction", type=float, default=None, metavar="F",
                   help="a tile with >= F (a fraction; default 0.1) of its area in ink is pen")
    add_config_flag(p, "--qc-focus-min", key="data.tiling.qc_params.focus_min", type=float, default=None, metavar="V",
                   help="a tile holding stained tissue with a focus measure below V (default 0.12) is blur (in-focus "
                        "tissue scores 0.2-0.6, a point spread of sigma >= 2 px <= 0.08)")


def _add_region_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regions", default=None, metavar="FILE_OR_DIR",
                   help="QuPath GeoJSON regions (File > Export objects as GeoJSON; Polygon/MultiPolygon with holes, level-0 "
                        "px): one file for every slide, or a folder of <slide_id>.geojson files. Only tiles with >= "
                        "--region-min-fraction of their area inside the included and outside the excluded regions are kept; "
                        "each tile's fraction and class are stored (region_fraction, region_label + attribute regions) and "
                        "written to <out>/regions/<slide_id>.csv")
    add_config_flag(p, "--region-include", key="data.tiling.region_include", action="append", default=None, metavar="CLASS",
                   help="classification name (shell pattern, case-insensitive) whose regions include tiles; repeatable "
                        "(default: every region not excluded)")
    add_config_flag(p, "--region-exclude", key="data.tiling.region_exclude", action="append", default=None, metavar="CLASS",
                   help="classification name (pattern) whose regions exclude tiles; repeatable "
                        "(default: Ignore*, Exclude, Excluded, Background)")
    add_config_flag(p, "--region-min-fraction", key="data.tiling.region_min_fraction", type=float, default=None, metavar="F",
                   help="keep a tile when at least F (default 0.5) of it lies inside the included, not excluded area")


def _add_point_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flag(p, "--points", key="data.tiling.points", default=None, metavar="FILE_OR_DIR",
                   help="cut one tile of --tile-size px centred on each given point instead of the grid: a CSV "
                        "slide_id,x,y[,class] for every slide (an 'image' column is taken as slide_id), or a folder of "
                        "<slide_id>.csv files (x,y[,class]) or <slide_id>.geojson QuPath exports (Point: the point; "
                        "Polygon: its centroid; class: the classification). x, y in level-0 px, pixel i covering [i, i+1): "
                        "tile px (T//2, T//2) is the point's pixel (the centre for odd sizes such as 27). Level 0 only "
                        "(no --mpp-target). The store records each tile's class (array point_class, an index into the "
                        "attribute point_classes; -1 = none) and point (point_xy); grid is the T-px grid cell holding "
                        "the point. By default every point inside the image gets its tile (no foreground rule, see "
                        "--points-filter); tile QC (--qc) is never applied to point tiles")
    add_config_flag(p, "--points-edge", key="data.tiling.points_edge", choices=LazyChoices("wsi_pipeline.config.choices", "POINT_EDGES"), default=None,
                   metavar="RULE",
                   help="a point tile crossing the image edge, one of %(choices)s: pad (default) = the part outside the "
                        "image is the slide's glass colour (its reader's background: white unless the slide says "
                        "otherwise); skip = left out and counted (store attribute points.n_edge_skipped, report note). "
                        "Points outside the image are always left out and counted")
    add_config_flag(p, "--points-filter", key="data.tiling.points_filter", action="store_const", const=True, default=None,
                   help="apply the foreground rule (--method, --min-foreground) to point tiles too and drop those below "
                        "it (default: off, every point keeps its tile; the foreground fraction is stored either way)")


def tiling_from_args(args: argparse.Namespace) -> tuple[StoreSettings, str | None, str | None]:
    """(``data.tiling`` as the config file, the tiling flags and ``--set`` make it, the slides, the output folder),
    through the builder of every stage: with ``--config`` the pipeline is checked
    (:func:`~wsi_pipeline.config.pipeline.tiling_of_pipeline`: whole, or without methods when it has none); without,
    ``data.tiling`` alone
    (:func:`~wsi_pipeline.cli._common.config_from_args`)."""
    from wsi_pipeline.config.overrides import section_of
    from wsi_pipeline.config.store_settings import StoreSettings

    source, out = args.slides if args.slides is not None else args.manifest, args.out
    if args.config is not None:  # a pipeline without methods (a file that only says how to tile) is one too
        from pathlib import Path

        from wsi_pipeline.config.pipeline import tiling_of_pipeline

        tiling, manifest, tiles_dir = config_from_args(
            args, lambda raw: tiling_of_pipeline(raw, default_name=Path(args.config).stem), what="pipeline config")
        return tiling, source if source is not None else manifest, out if out is not None else tiles_dir
    other = [o for o in args.overrides if not o.startswith("data.tiling.")]
    if other:
        raise ValueError(f"--set {other[0]}: without --config only data.tiling keys can be set; give the pipeline "
                         "config with --config PIPELINE.yaml")
    tiling = config_from_args(args, lambda raw: StoreSettings.from_section(section_of(raw, "data.tiling")),
                              what="tiling settings")
    return tiling, source, out


def _detectors_taking(key: str) -> list[str]:
    """The registered tissue detectors whose parameters have the field ``key``."""
    from wsi_pipeline.tiling.detectors import DETECTORS

    return [name for name in DETECTORS.names() if key in getattr(DETECTORS.get(name).Params, "__dataclass_fields__", {})]


def tiler_from_args(tiling: StoreSettings, args: argparse.Namespace) -> TilingConfig:
    """The tiler config of ``data.tiling`` and the run's own flags (fallback mpp, store layout, QC images,
    regions file, the detector's run options ``--tissue-model`` and ``--no-prescreen``)."""
    from wsi_pipeline.config.tiling import tiler_config

    base = tiler_config(tiling)
    run_detector = {"tissue_model": args.tissue_model, "prescreen": False if args.no_prescreen else None}
    names = {f.name for f in dataclasses.fields(base.detector)}
    flags = {"tissue_model": "--tissue-model", "prescreen": "--no-prescreen"}
    for key, value in run_detector.items():
        if value is not None and key not in names:  # refused, never dropped: the user asked for something
            takers = _detectors_taking(key)
            raise ValueError(f"{flags[key]} does not apply to the {tiling.method!r} detector (it has no {key} setting); "
                             f"it is for --method {' or '.join(takers) or '(none)'}")
    detector = dataclasses.replace(base.detector, **{k: v for k, v in run_detector.items() if v is not None})
    kw: dict[str, Any] = {"points": tiling.points if isinstance(tiling.points, str) else None,
                          "compression": tiling.compression, "backend": tiling.backend, "shard_tiles": args.shard_tiles}
    return dataclasses.replace(
        base, detector=detector, mpp=args.mpp, mpp_force=args.mpp_force, qc=not args.no_qc_images,
        allow_dark_background=args.allow_dark_background, regions=args.regions,
        **{k: v for k, v in kw.items() if v is not None},
    )


def run(args: argparse.Namespace) -> int:
    """Run the tiling; return 0 when no slide failed, 1 otherwise, 2 for unusable arguments (no slides, a setting
    out of range, an unwritable --out), 130 on Ctrl-C."""
    from wsi_pipeline.tiling.cohort import tile_cohort

    tiling, source, out = tiling_from_args(args)
    if source is None:
        raise ValueError("give the slides: --slides DIR or --manifest CSV (or --config PIPELINE.yaml with data.manifest)")
    if out is None:
        raise ValueError("give the output folder: --out DIR (or --config PIPELINE.yaml with data.tiles_dir)")
    if args.slides is not None:  # a second run would take the first one's stores for slides (DICOM folders, ...)
        from wsi_pipeline.output_dirs import check_not_an_input

        check_not_an_input(out, "--out", {"--slides": args.slides})
    config = tiler_from_args(tiling, args)
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers {args.workers} must be >= 0")
    if not args.lock_stale_after > 0:
        raise ValueError(f"--lock-stale-after {args.lock_stale_after} must be > 0 seconds")
    cluster, shard = cluster_from_args(args), shard_from_args(args)
    report = tile_cohort(source, out, config, workers=args.workers, overwrite=args.overwrite,
                         progress=not args.no_progress, lock_stale_s=args.lock_stale_after,
                         cluster=cluster, retries=args.retries, shard=shard)
    print(report.summary())
    return failure_status(not report.ok, args)
