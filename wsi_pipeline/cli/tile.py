"""``wsi-pipeline tile``: slides (a folder or a manifest) to zarr tile stores."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from wsi_pipeline.cli._cluster import add_cluster_arguments, cluster_from_args, shard_from_args
from wsi_pipeline.cli._common import add_failure_argument, add_set_argument, failure_status, LazyChoices, add_output_arguments

if TYPE_CHECKING:
    from wsi_pipeline.config.tiling import StoreTiling

__all__ = ["pipeline_tiling", "register", "run"]


class _Default:
    """A flag's default, told apart from the same value given on the command line: with ``--config``, only
    the flags given override the pipeline's ``data.tiling``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def _given(value: object) -> bool:
    return value is not None and not isinstance(value, _Default)


def _value(value: Any) -> Any:
    return value.value if isinstance(value, _Default) else value


#: TilingConfig fields that data.tiling may set, and the flags (argparse dests) that override them.
_TILING_FLAGS = {"method": "method", "tile_size": "tile_size", "min_foreground": "min_foreground", "mpp_target": "mpp_target",
                 "qc_mode": "qc", "grey_min": "grey_min", "grey_max": "grey_max", "points": "points",
                 "points_edge": "points_edge", "points_filter": "points_filter"}


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return v


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return v


def _grey_max(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a grey level 0..255 nor 'auto'") from None
    if not 0 <= v <= 255:
        raise argparse.ArgumentTypeError(f"{text} is not a grey level in [0, 255]")
    return v


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tile`` subcommand."""
    p = subparsers.add_parser(
        "tile",
        help="tile whole-slide images into zarr tile stores",
        description=(
            "Tile every slide of a folder (or of a manifest) into <out>/<slide_id>.zarr: non-overlapping "
            "full tiles on a grid anchored at (0, 0), kept when their foreground fraction reaches a threshold. "
            "Writes <out>/tiling_report.csv, a QC image per slide (<out>/qc/<slide_id>.png) and the tissue mask's contours "
            "as QuPath annotations (<out>/tissue/<slide_id>.geojson). Reruns skip "
            "complete stores built from the same slide with the same settings, and rebuild partial or outdated "
            "ones; any number of runs may share one --out (each slide is tiled once, under a lock). "
            "Exit status 1 when any slide failed (after all others were tiled); 2 when the arguments are unusable: "
            "no slides found, or an --out that cannot be created or written (checked before any work). Formats: "
            "whatever OpenSlide reads (SVS, NDPI, SCN, MRXS, BIF, DICOM, generic tiled TIFF, ...), through tiffslide "
            "OME-TIFF, and through wsidicom DICOM WSI (a folder of one slide's .dcm files, or one .dcm file); "
            "plain images (PNG, JPEG, BMP through Pillow; plain striped or tiled TIFF) as one-level slides (a "
            "72-300 dpi resolution tag is ignored: give their mpp in a manifest mpp column or with --mpp; keep --out "
            "and other outputs with PNG files outside an image folder). With --points, one tile centred on each given "
            "point instead of the grid. "
            "With --config PIPELINE.yaml the pipeline's data.tiling settings are used (the tile flags given "
            "override them), and --manifest / --out default to its data.manifest / data.tiles_dir."
        ),
    )
    p.add_argument("--config", default=None, metavar="YAML",
                   help="pipeline YAML file (as train takes it, with --set): tile with its data.tiling settings (method, "
                        "tile_size, min_foreground, mpp_target, qc_mode, grey_min, grey_max, points, points_edge, "
                        "points_filter); the tile flags given on the command line override them, the others keep "
                        "data.tiling's values (then the tiler's defaults). --manifest defaults to data.manifest and --out "
                        "to data.tiles_dir")
    add_set_argument(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--slides", metavar="DIR", help="folder of slides, scanned recursively (or one slide file); slide_id = file name without extension "
                          "(a.ome.tiff -> a), a DICOM folder's name; the same ids as `manifest folder` and `predict`")
    src.add_argument("--manifest", metavar="CSV", help="manifest CSV (columns slide_id, path, optional mpp) (with --config: "
                     "default data.manifest)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder for the tile stores, QC images and report (required; with --config: default data.tiles_dir)")
    p.add_argument("--method", choices=LazyChoices("wsi_pipeline.config.choices", "TILING_METHODS"), default=_Default("tissue"),
                   metavar="METHOD",
                   help="foreground test, one of %(choices)s: tissue (default) = stained tissue by optical density against "
                        "each slide's own glass colour, estimated from its thumbnail (any brightfield stain: H&E, IHC, special "
                        "stains, pale sections; glass of any grey level or tint is dropped; pen ink is not tissue), tile kept at "
                        ">= 50 %% tissue; greyscale = the paper's rule, per-tile fraction of pixels with grey in "
                        "[grey-min, grey-max] (PANDA protocol; reproduce the paper with --method greyscale --qc off); "
                        "otsu = tissue mask from Otsu's threshold at low resolution (CAMELYON protocol); "
                        "unet = tissue mask of the whole-image tissue U-Net (wsi-pipeline tissue; see --tissue-model), its "
                        "input scaled to the slide's glass level and its mask kept within the tissue rule's stained area")
    p.add_argument("--tissue-model", default=None, metavar="PATH",
                   help="unet method: best.pt of `wsi-pipeline tissue train` (default: the model shipped with the package)")
    p.add_argument("--tile-size", type=int, default=_Default(256), metavar="PX",
                   help="tile side in px at the tile resolution (any size >= 8; odd sizes such as 27 too)")
    p.add_argument("--min-foreground", type=_fraction, default=None, metavar="F",
                   help="keep a tile when its foreground (greyscale) or tissue (tissue, otsu, unet) fraction is >= F "
                        "(default: 0.6 for greyscale, 0.5 for the others)")
    p.add_argument("--grey-min", type=int, default=_Default(3), metavar="G", help="darkest grey value counted as foreground (greyscale method)")
    p.add_argument("--grey-max", type=_grey_max, default=_Default(230), metavar="G",
                   help="brightest grey value counted as foreground (greyscale method); 'auto': each slide's glass grey "
                        "level, estimated from its thumbnail, minus 10 (230 when a slide shows no glass). The glass level "
                        "is in the report's background_grey column; a warning says when it lies inside the foreground band")
    p.add_argument("--allow-dark-background", action="store_true",
                   help="tile slides whose background is dark (fluorescence) with these brightfield rules; by default "
                        "they are reported as skipped: dark background (fluorescence?)")
    p.add_argument("--mpp-target", type=_positive, default=None, metavar="UM",
                   help="tile resolution in um/px (0.5 is about 20x): read the best pyramid level at or finer than it "
                        "and resize (default: the native resolution of level 0)")
    mpp = p.add_mutually_exclusive_group()
    mpp.add_argument("--mpp", type=_positive, default=None, metavar="UM",
                     help="um/px of level 0 for slides that have none (neither in their metadata nor in a manifest mpp "
                          "column); slides with their own mpp keep it. A resolution tag that is not a microscope's (a TIFF/PNG/JPEG/BMP "
                          "dpi such as 72 or 300, i.e. above 20 um/px) is ignored with a warning, so such images take this "
                          "value. The report's mpp_source column says which was used (ignored-dpi:<dpi> when none was)")
    mpp.add_argument("--mpp-force", type=_positive, default=None, metavar="UM",
                     help="um/px of level 0 for every slide, overriding the slides' metadata and any manifest mpp column "
                          "(for scanners that write wrong values)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="slides tiled in parallel, one process each (default: number of cores); 0 = in this process")
    p.add_argument("--compression", choices=LazyChoices("wsi_pipeline.data.store", "COMPRESSIONS"), default="zstd",
                   metavar="CODEC", help="tile compression in the store, one of %(choices)s: zstd (lossless), "
                                         "jpeg (lossy, quality 90, ~10x smaller) or none")
    p.add_argument("--shard-tiles", type=int, default=None, metavar="N",
                   help="tiles per shard file in new stores (zarr v3 sharding; a tile is still read on its own) "
                        "(default: 1024); 0 = one file per tile (the older layout, 100-1000x more files)")
    p.add_argument("--backend", choices=LazyChoices("wsi_pipeline.slides.opener", "BACKENDS"), default="auto",
                   metavar="READER", help="slide reader, one of %(choices)s; auto tries OpenSlide, then tiffslide "
                                          "(for a DICOM file: OpenSlide, then wsidicom; a .png/.jpg/.jpeg/.bmp image is "
                                          "read by Pillow as a one-level slide)")
    p.add_argument("--no-prescreen", action="store_true",
                   help="decode and test every tile whole, instead of skipping tiles a low-resolution bound proves "
                        "to be background and deciding probable glass from its top rows first "
                        "(same result, slower; for checking)")
    p.add_argument("--qc", choices=LazyChoices("wsi_pipeline.config.choices", "QC_MODES"), default=_Default("drop"), metavar="MODE",
                   help="tile artifact QC, one of %(choices)s: drop = drop the tiles with the artifacts of --qc-drop and flag "
                        "the others; flag = record every artifact, drop nothing; off = no QC (the paper's tiles). Artifacts: "
                        "pen = marker ink (green, blue, red, black; by colour on an overview of 16 um px) on >= --qc-pen of the tile; "
                        "blur = focus measure E[(g-G1 g)^2] / (E[(G1 g-G3 g)^2] + 4) of the tile's grey image below "
                        "--qc-focus-min (G_s: Gaussian of sigma s px, at <= 0.5 um/px); fold = folded tissue (2.5x the slide's median "
                        "optical density, same colour, over >= 0.02 mm^2) on >= 25 %% of the tile. A slide losing > 10 %% of its tissue "
                        "tiles to QC is warned about. Per-tile arrays qc_flags, qc_focus, qc_pen, qc_fold in the "
                        "store; counts per slide in tiling_report.csv (qc_dropped, qc_pen, qc_blur, qc_fold) and the QC image "
                        "(flagged tiles orange, dropped red)")
    p.add_argument("--qc-drop", default="pen,blur", metavar="LIST",
                   help="artifacts --qc drop removes, comma-separated from pen, blur, fold")
    p.add_argument("--qc-pen", type=_fraction, default=0.1, metavar="F", help="a tile with >= F of its area in ink is pen")
    p.add_argument("--qc-focus-min", type=_positive, default=0.12, metavar="V",
                   help="a tile holding stained tissue with a focus measure below V is blur (in-focus tissue scores 0.2-0.6, "
                        "a point spread of sigma >= 2 px <= 0.08)")
    p.add_argument("--regions", default=None, metavar="FILE_OR_DIR",
                   help="QuPath GeoJSON regions (File > Export objects as GeoJSON; Polygon/MultiPolygon with holes, level-0 "
                        "px): one file for every slide, or a folder of <slide_id>.geojson files. Only tiles with >= "
                        "--region-min-fraction of their area inside the included and outside the excluded regions are kept; "
                        "each tile's fraction and class are stored (region_fraction, region_label + attribute regions) and "
                        "written to <out>/regions/<slide_id>.csv")
    p.add_argument("--region-include", action="append", default=[], metavar="CLASS",
                   help="classification name (shell pattern, case-insensitive) whose regions include tiles; repeatable "
                        "(default: every region not excluded)")
    p.add_argument("--region-exclude", action="append", default=None, metavar="CLASS",
                   help="classification name (pattern) whose regions exclude tiles; repeatable "
                        "(default: Ignore*, Exclude, Excluded, Background)")
    p.add_argument("--region-min-fraction", type=_fraction, default=0.5, metavar="F",
                   help="keep a tile when at least F of it lies inside the included, not excluded area")
    p.add_argument("--points", default=None, metavar="FILE_OR_DIR",
                   help="cut one tile of --tile-size px centred on each given point instead of the grid: a CSV "
                        "slide_id,x,y[,class] for every slide (an 'image' column is taken as slide_id), or a folder of "
                        "<slide_id>.csv files (x,y[,class]) or <slide_id>.geojson QuPath exports (Point: the point; "
                        "Polygon: its centroid; class: the classification). x, y in level-0 px, pixel i covering [i, i+1): "
                        "tile px (T//2, T//2) is the point's pixel (the centre for odd sizes such as 27). Level 0 only "
                        "(no --mpp-target). The store records each tile's class (array point_class, an index into the "
                        "attribute point_classes; -1 = none) and point (point_xy); grid is the T-px grid cell holding "
                        "the point. By default every point inside the image gets its tile (no foreground rule, see "
                        "--points-filter); tile QC (--qc) is never applied to point tiles")
    p.add_argument("--points-edge", choices=LazyChoices("wsi_pipeline.config.choices", "POINT_EDGES"), default=_Default("pad"),
                   metavar="RULE",
                   help="a point tile crossing the image edge, one of %(choices)s: pad (default) = the part outside the "
                        "image is the slide's glass colour (its reader's background: white unless the slide says "
                        "otherwise); skip = left out and counted (store attribute points.n_edge_skipped, report note). "
                        "Points outside the image are always left out and counted")
    p.add_argument("--points-filter", action="store_true", default=_Default(False),
                   help="apply the foreground rule (--method, --min-foreground) to point tiles too and drop those below "
                        "it (default: off, every point keeps its tile; the foreground fraction is stored either way)")
    p.add_argument("--no-qc", action="store_true", help="do not write QC images (tile QC itself is --qc)")
    p.add_argument("--overwrite", action="store_true", help="rebuild every store, even complete and current ones")
    add_output_arguments(p)
    add_failure_argument(p)
    p.add_argument("--lock-stale-after", type=_positive, default=600.0, metavar="S",
                   help="several runs may share one --out: each slide is tiled under a lock (<out>/.locks) that its run "
                        "refreshes every 30 s; a lock whose run is gone (same host) or not refreshed for S seconds "
                        "(another host) is taken over")
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the tiling; return 0 when no slide failed, 1 otherwise, 2 for unusable arguments (no slides, an
    unwritable --out), 130 on Ctrl-C."""
    from wsi_pipeline.config.tiling import DEFAULT_REGION_EXCLUDE, QCParams
    from wsi_pipeline.tiling.cohort import tile_cohort
    from wsi_pipeline.config.tiling import TilingConfig

    drop = tuple(a.strip() for a in args.qc_drop.split(",") if a.strip())
    qc_params = QCParams(drop=drop, pen_fraction=args.qc_pen, focus_min=args.qc_focus_min)
    settings: dict[str, Any] = {name: _value(getattr(args, dest)) for name, dest in _TILING_FLAGS.items()}
    source, out = args.slides if args.slides is not None else args.manifest, args.out
    if args.config is not None:
        from wsi_pipeline.config.pipeline import load_config

        pipeline = load_config(args.config, args.overrides)
        given = {name for name, dest in _TILING_FLAGS.items() if _given(getattr(args, dest))}
        settings.update({k: v for k, v in pipeline_tiling(pipeline.data.tiling).items() if k not in given})
        source = source if source is not None else str(pipeline.data.manifest)
        out = out if out is not None else str(pipeline.data.tiles_dir)
    elif args.overrides:
        raise ValueError("--set changes a pipeline config: give it with --config PIPELINE.yaml")
    if source is None:
        raise ValueError("give the slides: --slides DIR or --manifest CSV (or --config PIPELINE.yaml with data.manifest)")
    if out is None:
        raise ValueError("give the output folder: --out DIR (or --config PIPELINE.yaml with data.tiles_dir)")
    config = TilingConfig(
        **settings, mpp=args.mpp, mpp_force=args.mpp_force,
        compression=args.compression, backend=args.backend, prescreen=not args.no_prescreen, qc=not args.no_qc,
        allow_dark_background=args.allow_dark_background, tissue_model=args.tissue_model,
        qc_params=qc_params, regions=args.regions, region_include=tuple(args.region_include),
        region_exclude=DEFAULT_REGION_EXCLUDE if args.region_exclude is None else tuple(args.region_exclude),
        region_min_fraction=args.region_min_fraction,
        **({} if args.shard_tiles is None else {"shard_tiles": args.shard_tiles}),
    )
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers {args.workers} must be >= 0")
    cluster, shard = cluster_from_args(args), shard_from_args(args)
    report = tile_cohort(source, out, config, workers=args.workers, overwrite=args.overwrite,
                         progress=not args.no_progress, lock_stale_s=args.lock_stale_after,
                         cluster=cluster, retries=args.retries, shard=shard)
    print(report.summary())
    return failure_status(not report.ok, args)


def pipeline_tiling(tiling: StoreTiling) -> dict[str, Any]:
    """The tiler settings a pipeline's ``data.tiling`` sets (the fields it leaves empty are left out), through
    :func:`~wsi_pipeline.config.tiling.tiler_config`, the bridge ``predict`` uses too; ``points`` (which that
    bridge never takes from a model's saved settings) is taken as written."""
    import dataclasses

    from wsi_pipeline.config.tiling import tiler_config

    built = tiler_config(tiling)
    out = {name: getattr(built, name) for name in _TILING_FLAGS if name != "points" and getattr(tiling, name, None) is not None}
    if tiling.points is not None:
        out["points"] = str(tiling.points)
    assert set(out) <= {f.name for f in dataclasses.fields(built)}
    return out
