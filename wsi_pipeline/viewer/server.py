"""The viewer's HTTP server: the standard library's ``ThreadingHTTPServer``, bound to 127.0.0.1 by default.

Routes (all GET; ``<id>`` is a slide id, URL-quoted):

- ``/``: the slide list page; ``/slide/<id>``: the viewer page of one slide.
- ``/api/slides?sort=&order=asc|desc&offset=&limit=&q=``: one page of the list as JSON (``total``, ``rows``);
  each row says whether the slide opened (``status``), checked when its page is first listed.
- ``/api/slide/<id>``: size, zoom range, the overlays it has, or the error that stops it opening.
- ``/tile/<id>/<z>/<x>/<y>.jpg``: an image tile; ``/overlay/<id>/<kind>/<z>/<x>/<y>.png?reasons=``: an overlay tile.
- ``/api/slide/<id>/at?x=&y=``: the tile under a level-0 point (click); ``/crop/<id>?x=&y=&size=``: a
  full-resolution PNG crop (at most 1024 px a side).
- ``/geojson/<id>/<tissue|annotations>``: the slide's GeoJSON; ``/static/...``: the page's files and Leaflet's.

Memory is bounded: at most :data:`MAX_OPEN` slides are open at once (least recently used closed first), and the
list holds a few hundred bytes per slide. A slide that fails to open gets its error on the list and its page;
every other slide stays viewable.
"""

from __future__ import annotations

import errno
import json
import logging
import mimetypes
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.data.store import TileStore, open_store
from wsi_pipeline.export.heatmap import colormap
from wsi_pipeline.slides import open_slide
from wsi_pipeline.viewer.catalog import SORT_KEYS, Catalog, SlideEntry
from wsi_pipeline.viewer.containment import Folders, GeoJSONError, RefusedFileError
from wsi_pipeline.viewer.overlays import KINDS, QC_REASONS, SlideOverlays
from wsi_pipeline.slides.truncation import check_complete, unreadable_reason
from wsi_pipeline.viewer.probe import probe
from wsi_pipeline.viewer.query import BadRequest, integer, number
from wsi_pipeline.viewer.tiles import BlankTiles, DeepZoomTiles, SlideTiles, StoreTiles, TileSource, encode, max_zoom

__all__ = ["MAX_OPEN", "SlideUnavailable", "ViewerServer", "leaflet_dir", "make_server"]

log = logging.getLogger(__name__)

#: Slides kept open at once (each holds a file handle and its overlay tables).
MAX_OPEN = 16
#: Largest side of a full-resolution crop, px.
MAX_CROP = 1024
#: Largest level-0 coordinate a request may name (px; no slide is larger).
MAX_COORD = float(1 << 31)
STATIC = Path(__file__).parent / "static"


def leaflet_dir() -> Path:
    """The folder of Leaflet's files, from the installed ``xstatic-leaflet`` package."""
    try:
        import xstatic.pkg.leaflet as leaflet
    except ImportError as e:
        raise ImportError("the viewer needs the xstatic-leaflet package (Leaflet's JavaScript): "
                          "pip install xstatic-leaflet, or reinstall wsi-pipeline") from e
    return Path(leaflet.BASE_DIR)


class SlideUnavailable(ValueError):
    """A slide that cannot be viewed (its open error, remembered); ``status`` is the HTTP status: 403 when a file
    was refused as outside the viewer's folders, 422 otherwise."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Open:
    source: TileSource
    overlays: SlideOverlays
    kind: str  # "slide (<backend>)" or "tile store"


class _Slides:
    """Open slides, least recently used closed first; open errors remembered per slide."""

    def __init__(self, catalog: Catalog, max_open: int = MAX_OPEN, backend: str = "auto") -> None:
        self.catalog = catalog
        self.max_open = max_open
        self.backend = backend
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self.errors: dict[str, str] = {}
        self._refused: set[str] = set()  # ids whose files lie outside the folders (403)
        self._checked: dict[str, bool] = {}  # ids that opened once (the list's status column) -> read from their file
        self._lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}

    def _load(self, e: SlideEntry) -> _Open:
        """Open a slide (its file, else its store), every file checked inside the folders, its pixels probed."""
        folders: Folders = self.catalog.folders
        store: TileStore | None = None
        store_problem: Exception | None = None
        if e.store is not None:
            try:
                store = open_store(folders.check(e.store, "tile store"))
            except (OSError, ValueError) as err:  # outside the folders, gone or damaged: the slide file may do
                store_problem = err
                log.warning("slide %s: tile store %s not usable: %s", e.slide_id, e.store, err)
        path = None
        if e.path is not None:
            try:
                path = folders.check(e.path, "slide file")
            except FileNotFoundError:
                path = None  # gone: viewed from its store when there is one
        source: TileSource
        if path is not None:
            try:
                slide = open_slide(path, self.backend)
            except Exception as err:  # any reader error: this slide only, truncation named
                raise ValueError(unreadable_reason(path, err)) from err
            try:
                source = DeepZoomTiles(slide) if slide.backend == "openslide" else SlideTiles(slide)
            except Exception as err:
                slide.close()
                raise ValueError(unreadable_reason(path, err)) from err
            try:
                probe(source)
                check_complete(path)  # the probed pieces may be whole while others are cut off
            except Exception as err:
                source.close()
                raise ValueError(unreadable_reason(path, err)) from err
            kind = f"slide ({slide.backend})"
        elif store is not None:
            source = StoreTiles(store)
            gone = e.path if e.path is not None else store.attrs.get("slide_path")
            kind = f"tile store (slide file gone: {gone})"
        elif store_problem is not None and e.path is None:
            raise store_problem
        elif e.path is None and e.scores is not None:  # a heatmap only (predictions of feature files): a blank canvas
            source = BlankTiles.from_scores(folders.check(e.scores, "scores file"))
            kind = "heatmap only (no slide file or tile store: a blank canvas)"
        elif e.path is not None:
            raise FileNotFoundError(f"slide file not found: {e.path}, and no tile store for {e.slide_id}")
        else:
            raise FileNotFoundError(f"no slide file and no tile store for {e.slide_id} (give --slides or --tiles)")
        ov = SlideOverlays(source.dimensions, store=store, scores=e.scores, lesion_mask=e.lesion_mask,
                           mask_downsample=e.mask_downsample, folders=folders)
        return _Open(source, ov, kind)

    def _failed(self, slide_id: str, err: BaseException) -> str:
        """Remember why ``slide_id`` does not open (asked again, the same answer without retrying); return it."""
        msg = str(err) if isinstance(err, (RefusedFileError, ValueError)) and str(err) else f"{type(err).__name__}: {err}"
        log.warning("slide %s cannot be viewed: %s", slide_id, msg)
        with self._lock:
            self.errors[slide_id] = msg
            if isinstance(err, RefusedFileError):
                self._refused.add(slide_id)
        return msg

    def _unavailable(self, slide_id: str) -> SlideUnavailable:
        return SlideUnavailable(self.errors[slide_id], 403 if slide_id in self._refused else 422)

    def get(self, slide_id: str) -> _Open:
        """The open slide (opened now if needed); raises the slide's open error again on later calls."""
        entry = self.catalog.get(slide_id)
        with self._lock:
            if slide_id in self._open:
                self._open.move_to_end(slide_id)
                return self._open[slide_id]
            if slide_id in self.errors:
                raise self._unavailable(slide_id)
            gate = self._opening.setdefault(slide_id, threading.Lock())
        with gate:  # one opener per slide
            with self._lock:
                if slide_id in self._open:
                    return self._open[slide_id]
            try:
                opened = self._load(entry)
            except Exception as err:  # any reader error marks this slide only
                self._failed(slide_id, err)
                raise self._unavailable(slide_id) from err
            with self._lock:
                self._open[slide_id] = opened
                while len(self._open) > self.max_open:
                    # dropped, not closed: a request still reading it keeps its reference, and the readers
                    # close their files when the last reference goes (OpenSlide's and tifffile's finalisers)
                    self._open.popitem(last=False)
            return opened

    @property
    def n_open(self) -> int:
        """Slides open now (at most ``max_open``)."""
        return len(self._open)

    def status(self, slide_id: str) -> str:
        """"ok" or the open error. A slide not yet tried is opened and closed again at once (the list checks
        every slide of its page; the slides being viewed stay open). A slide read from its file is looked at
        again when that file is gone or no longer resolves inside the folders (moved away, replaced by a link)."""
        entry = self.catalog.get(slide_id)
        with self._lock:
            if slide_id in self._open or slide_id in self._checked:
                from_file = self._open[slide_id].kind.startswith("slide") if slide_id in self._open else self._checked[slide_id]
                if not from_file or self.catalog.folders.contains(entry.path):
                    return "ok"
                self._open.pop(slide_id, None)  # a request still reading it keeps its reference
                self._checked.pop(slide_id, None)
            if slide_id in self.errors:
                return self.errors[slide_id]
        try:
            opened = self._load(entry)
        except Exception as err:  # any reader error marks this slide only
            return self._failed(slide_id, err)
        opened.source.close()
        with self._lock:
            self._checked[slide_id] = opened.kind.startswith("slide")
        return "ok"

    def close(self) -> None:
        with self._lock:
            for o in self._open.values():
                o.source.close()
            self._open.clear()


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"
    #: seconds a kept-alive connection may sit idle before its thread ends (each connection's loop is bounded)
    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # -- replies ----------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    def _file(self, path: Path) -> None:
        if not path.is_file():
            self._error(404, f"not found: {self.path}")
            return
        ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if path.suffix == ".js":
            ctype = "text/javascript"
        self._send(200, path.read_bytes(), ctype, cache=True)

    # -- routing ----------------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            self._route(parts, query)
        except KeyError as err:
            self._error(404, str(err.args[0]) if err.args else "not found")
        except BadRequest as err:
            self._error(400, str(err))
        except SlideUnavailable as err:
            self._error(err.status, str(err))
        except (GeoJSONError, ValueError) as err:
            self._error(422, str(err))
        except RefusedFileError as err:
            self._error(403, str(err))
        except FileNotFoundError as err:
            self._error(404, str(err))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as err:  # never kill the server thread; the message goes to the page
            log.exception("request %s failed", self.path)
            self._error(500, f"{type(err).__name__}: {err}")

    def _route(self, parts: list[str], q: dict[str, str]) -> None:
        slides = self.server.slides
        if not parts:
            self._file(STATIC / "list.html")
        elif parts[0] == "slide" and len(parts) == 2:
            slides.catalog.get(parts[1])
            self._file(STATIC / "slide.html")
        elif parts[0] == "static" and len(parts) >= 2:
            base = leaflet_dir() if parts[1] == "leaflet" else STATIC
            rel = parts[2:] if parts[1] == "leaflet" else parts[1:]
            try:
                path = Folders.of([base]).check(base / "/".join(rel), "page file")
            except OSError:  # outside the page's folders or absent: the same answer
                raise KeyError(f"not found: {self.path}") from None
            self._file(path)
        elif parts == ["api", "slides"]:
            self._slide_page(q)
        elif parts[0] == "api" and parts[1:2] == ["slide"] and len(parts) == 3:
            self._json(self._slide_info(parts[2]))
        elif parts[0] == "api" and parts[1:2] == ["slide"] and len(parts) == 4 and parts[3] == "at":
            x, y = (number(q, k, -MAX_COORD, MAX_COORD) for k in ("x", "y"))
            ov = slides.get(parts[2]).overlays
            self._json({"tile": ov.tile_at(x, y)})
        elif parts[0] == "tile" and len(parts) == 5:
            z, x, y = _tile_address(parts[2:5])
            src = slides.get(parts[1]).source
            self._send(200, encode(src.tile(z, x, y), "JPEG"), "image/jpeg", cache=True)
        elif parts[0] == "overlay" and len(parts) == 6:
            z, x, y = _tile_address(parts[3:6])
            ov = slides.get(parts[1]).overlays
            reasons = tuple(r for r in q.get("reasons", ",".join(QC_REASONS)).split(",") if r)
            self._send(200, encode(ov.render(parts[2], z, x, y, reasons), "PNG"), "image/png", cache=True)
        elif parts[0] == "crop" and len(parts) == 2:
            size = int(number(q, "size", 1, MAX_CROP, default=256))
            src = slides.get(parts[1]).source
            w, h = src.dimensions
            x = int(number(q, "x", 1 - size, w - 1))  # the crop meets the slide (point tiles start left of it)
            y = int(number(q, "y", 1 - size, h - 1))
            crop = src.region(x, y, size, size)
            self._send(200, encode(np.ascontiguousarray(crop), "PNG"), "image/png")
        elif parts[0] == "geojson" and len(parts) == 3:
            entry = slides.catalog.get(parts[1])
            geojson = {"tissue": entry.tissue, "annotations": entry.annotations}.get(parts[2])
            if geojson is None:
                raise KeyError(f"slide {parts[1]} has no {parts[2]} GeoJSON")
            doc = slides.catalog.folders.read_geojson(geojson, f"{parts[2]} file")
            self._send(200, json.dumps(doc).encode(), "application/geo+json")
        else:
            raise KeyError(f"not found: {self.path}")

    def _slide_page(self, q: dict[str, str]) -> None:
        cat = self.server.slides.catalog
        if q.get("sort", "name") not in SORT_KEYS:
            raise BadRequest(f"sort={q['sort'][:40]!r}: expected one of {', '.join(SORT_KEYS)}")
        total, rows = cat.page(sort=q.get("sort", "name"), descending=q.get("order") == "desc",
                               offset=integer(q.get("offset"), "offset", 0, 1 << 31, default=0),
                               limit=integer(q.get("limit"), "limit", 1, 1 << 31, default=50), query=q.get("q", ""))
        out = []
        for e in rows:
            r = e.row()
            r["status"] = self.server.slides.status(e.slide_id)
            out.append(r)
        self._json({"total": total, "rows": out, "sources": cat.sources})

    def _slide_info(self, slide_id: str) -> dict[str, Any]:
        entry = self.server.slides.catalog.get(slide_id)
        info: dict[str, Any] = {"row": entry.row()}
        try:
            o = self.server.slides.get(slide_id)
        except SlideUnavailable as err:
            info["error"] = str(err)
            return info
        info.update(
            dimensions=list(o.source.dimensions), max_zoom=max_zoom(o.source.dimensions), source=o.kind,
            overlays=o.overlays.available(), geojson=[],
            qc_reasons=list(QC_REASONS), kinds=list(KINDS), scale=colormap(np.linspace(0.0, 1.0, 9)).tolist(),
            mpp=getattr(getattr(o.source, "slide", None), "mpp", None),
        )
        refused = dict(o.overlays.refused)  # overlay kind or GeoJSON kind -> why its file is not read
        for kind, path in (("tissue", entry.tissue), ("annotations", entry.annotations)):
            if path is None:
                continue
            try:  # checked here too, so that the page draws only what it will get
                self.server.slides.catalog.folders.read_geojson(path, f"{kind} file")
                info["geojson"].append(kind)
            except (OSError, ValueError) as err:
                refused[kind] = str(err)
        info["refused"] = refused
        if "heatmap" in info["overlays"]:
            scores = o.overlays.scores()
            info["heatmap_grid"] = {"tiles": len(scores), "size": sorted(set(scores["size"].round(1).tolist()))}
        return info


def _tile_address(parts: list[str]) -> tuple[int, int, int]:
    """``(z, x, y)`` of a tile path ``<z>/<x>/<y>.<ext>``; :class:`BadRequest` naming a part that is no integer."""
    z = integer(parts[0], "zoom", 0, 64)
    x = integer(parts[1], "tile x", 0, 1 << 31)
    y = integer(parts[2].split(".")[0], "tile y", 0, 1 << 31)
    return z, x, y


class ViewerServer(ThreadingHTTPServer):
    """The HTTP server with the viewer's state (:class:`_Slides`); threads are daemons."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], slides: _Slides) -> None:
        self.slides = slides
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser that went away mid-request (page closed, tiles cancelled) is not an error."""
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionResetError, BrokenPipeError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, err)
        else:
            log.exception("request from %s failed", client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def server_close(self) -> None:
        super().server_close()
        self.slides.close()


def make_server(catalog: Catalog, *, host: str = "127.0.0.1", port: int = 8765, max_open: int = MAX_OPEN,
                backend: str = "auto", on_bind: Callable[[str], None] | None = None) -> ViewerServer:
    """Bind the viewer to ``host:port`` (``port=0``: any free port); raise ``OSError`` naming the port when it is taken.

    ``backend``: the slide reader (:data:`wsi_pipeline.slides.BACKENDS`); slides OpenSlide opens are tiled by its
    DeepZoom generator, the others through the reader's ``read_region``."""
    leaflet_dir()  # a missing viewer library fails here, not at the first page
    try:
        server = ViewerServer((host, port), _Slides(catalog, max_open, backend))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"port {port} on {host} is already in use (another viewer or program); "
                          "choose another with --port N, or --port 0 for any free port") from None
        raise
    if on_bind is not None:
        on_bind(server.url)
    return server
