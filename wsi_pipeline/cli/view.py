"""``wsi-pipeline view``: serve the slide viewer (:mod:`wsi_pipeline.viewer`) on a local port."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import socket
import sys
import threading

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 8765
#: One label of a host name: letters, digits and inner hyphens, 1 to 63 characters.
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "view",
        help="look at slides in the browser: every zoom, with attention, kept/QC tiles, tissue and annotations",
        description=(
            "Serve a local web page (http://127.0.0.1:PORT/) that lists the slides of a folder, a manifest, a "
            "predictions or results folder and/or a tiles folder, sortable by prediction, probability, label and "
            "split, 50 a page; and shows each slide zoomable from the thumbnail to level 0 (and 4x beyond), with "
            "overlays, each with a toggle and an opacity slider: the attention heatmap (heatmaps/<slide_id>_scores.csv "
            "of predict or eval; colour = the tile's attention rank in the slide, 1 = highest = dark red), the tiles "
            "the tiler kept (green outlines), tiles QC dropped (red) or flagged (orange) by reason, the tissue "
            "contours (<tiles>/tissue/<slide_id>.geojson), QuPath annotations (--annotations) and the manifest's "
            "lesion masks. Clicking a tile shows its coordinates, attention rank, QC measures and a full-resolution "
            "crop. A slide whose file is gone is drawn from its tile store; a slide that fails to open is marked on "
            "the list and the others stay viewable. Only files inside the folders given (--slides, --predictions, "
            "--tiles, --annotations, the manifest's folder) are read: a file or link that resolves outside them is "
            "refused with the reason. Stop with Ctrl-C."
        ),
    )
    p.add_argument("--slides", metavar="DIR", help="folder of slide files (searched recursively; ids as `tile --slides`)")
    p.add_argument("--manifest", metavar="CSV", help="manifest CSV (slide_id, path, label, split; lesion_mask + "
                   "mask_downsample give the lesion overlay)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--predictions", metavar="DIR", help="`predict --out` folder (predictions.csv, heatmaps/, tiles/)")
    src.add_argument("--results", metavar="DIR", dest="predictions",
                     help="`eval` results folder (predictions_<cohort>_<protocol>.csv, heatmaps/); same as --predictions")
    p.add_argument("--method", metavar="NAME", help="an eval results folder lists every method and seed: show this "
                   "method's predictions, averaged over its seeds (default: the first method in the file)")
    p.add_argument("--tiles", metavar="DIR", help="folder of <slide_id>.zarr tile stores (kept and QC tiles, tissue "
                   "contours; slides whose file is gone are viewed from their store); default: <predictions>/tiles")
    p.add_argument("--annotations", metavar="DIR", help="folder of QuPath GeoJSON annotations, <slide_id>.geojson")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                   help=f"port to serve on (default {DEFAULT_PORT}; 0 = any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to bind (default 127.0.0.1: this machine only). Another address (e.g. 0.0.0.0) "
                        "shares the slides with everyone who can reach it, without a password: a warning says so")
    p.add_argument("--max-open", type=int, default=None, metavar="N",
                   help="slides kept open at once, least recently viewed closed first (default 16)")
    p.add_argument("--backend", default="auto", metavar="READER",
                   help="slide reader: auto (default: OpenSlide, then tiffslide, then wsidicom), openslide, tiffslide or "
                        "wsidicom; slides OpenSlide reads are tiled by its DeepZoom generator, others by the reader")
    p.add_argument("--seconds", type=float, default=0.0, metavar="S",
                   help="stop serving after S seconds (default 0: until Ctrl-C)")
    p.set_defaults(func=run)


def check_host(host: str) -> str:
    """``host`` when it is an IP address or a host name (RFC 1123 labels); ``ValueError`` naming ``--host`` otherwise
    (checked here, without a name lookup: the viewer opens no network connection)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if 0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return host
    raise ValueError(f"--host {host!r}: not an address; expected an IP address (127.0.0.1, 0.0.0.0, ::1) or a host "
                     "name such as localhost")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.viewer import MAX_OPEN, build_catalog, make_server

    if not any((args.slides, args.manifest, args.predictions, args.tiles)):
        raise ValueError("nothing to view: give --slides DIR, --manifest CSV, --predictions DIR / --results DIR or --tiles DIR")
    if args.port < 0 or args.port > 65535:
        raise ValueError(f"--port {args.port}: expected 0..65535")
    check_host(args.host)
    catalog = build_catalog(slides=args.slides, manifest=args.manifest, predictions=args.predictions, tiles=args.tiles,
                            annotations=args.annotations, method=args.method)
    if not _is_loopback(args.host):
        log.warning("serving on %s: anyone who can reach this address can see every listed slide (no password)", args.host)
    try:
        server = make_server(catalog, host=args.host, port=args.port, max_open=args.max_open or MAX_OPEN, backend=args.backend)
    except socket.gaierror as err:  # a host name this machine does not know
        raise OSError(f"--host {args.host!r}: cannot bind to it ({err.strerror or err}); expected an address of this "
                      "machine, such as 127.0.0.1 or 0.0.0.0") from None
    print(f"wsi-pipeline view: {len(catalog.entries)} slides at {server.url} (Ctrl-C to stop)", flush=True)
    timer = None
    if args.seconds > 0:
        timer = threading.Timer(args.seconds, server.shutdown)
        timer.daemon = True
        timer.start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        if timer is not None:
            timer.cancel()
        server.server_close()
    print("wsi-pipeline view: stopped", file=sys.stderr)
    return 0
