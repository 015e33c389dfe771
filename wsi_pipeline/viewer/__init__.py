"""``wsi-pipeline view``: a local slide viewer in the browser, with attention, tiles, QC, tissue and annotations.

Stack, and why:

- **Zoom and pan: Leaflet** (``L.CRS.Simple`` over a 256 px tile pyramid), from the PyPI package
  ``xstatic-leaflet`` (Leaflet 1.9.3 packaged as Python data files; the server serves them from the installed
  package, nothing is copied into this repository). OpenSeadragon, the usual slide viewer, is on PyPI only
  inside a Dash component (``dash-paperdragon``, which needs Dash and React) and as an unrelated ``seadragon``;
  Bokeh (TIAToolbox's choice) ships its JS too but tiles in web-map projections with a full plotting runtime.
  Leaflet does what a slide viewer needs: pyramid tiles with a native zoom limit and overzoom, tile layers with
  opacity for overlays, GeoJSON layers for contours and QuPath annotations, pixel-exact projection for clicks.
- **Tiles: OpenSlide's DeepZoom generator** (``openslide.deepzoom.DeepZoomGenerator``, a kept library) for
  slides our OpenSlide backend reads; for slides it cannot (OME-TIFF via tiffslide, DICOM via wsidicom) the
  same pyramid over :func:`wsi_pipeline.slides.open_slide`'s ``read_region``; for slides whose file is gone,
  the tile store (:mod:`wsi_pipeline.viewer.tiles`).
- **Server: the standard library's** ``http.server.ThreadingHTTPServer`` (no framework to install; the routes
  are a dozen GET endpoints, :mod:`wsi_pipeline.viewer.server`), bound to 127.0.0.1 unless ``--host`` says.
- Overlays are rendered on the server as transparent PNG tiles (:mod:`wsi_pipeline.viewer.overlays`), so a
  slide with 100,000 tiles costs the browser no more than one with 100.
"""

from wsi_pipeline.viewer.catalog import SORT_KEYS, Catalog, SlideEntry, build_catalog, view_command
from wsi_pipeline.viewer.server import MAX_OPEN, ViewerServer, make_server

__all__ = ["MAX_OPEN", "SORT_KEYS", "Catalog", "SlideEntry", "ViewerServer", "build_catalog", "make_server", "view_command"]
