"""Fixtures of the viewer tests: a small cohort (slides, tile stores, predictions, manifest, annotation), a server on a
free port of 127.0.0.1, and headless Chromium (skipped with a reason where /usr/bin/chromium is absent)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import numpy as np
import pandas as pd
from PIL import Image

from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.data.store import open_store
from wsi_pipeline.export.scores import tile_scores_frame, write_tile_scores
from wsi_pipeline.synthetic.fields import field_spec, make_field, write_field
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.tiler import tile_slide
from wsi_pipeline.viewer import Catalog, ViewerServer, build_catalog, make_server

CHROMIUM = Path("/usr/bin/chromium")


def build_cohort(root: Path) -> dict[str, Path]:
    """Slides ``pen`` (a field with pen ink: QC drops tiles), ``les`` (a slide with a planted lesion and its mask),
    ``gone`` (tiled, then its file removed) and ``broken`` (not a slide); their stores, a predictions folder with
    scores for ``pen`` and ``les``, a manifest and an annotation. Returns the folders."""
    slides, tiles, pred = root / "slides", root / "tiles", root / "pred"
    slides.mkdir(parents=True)
    f = make_field(field_spec("pen", np.random.default_rng(3), (1536, 1536)), seed=3)
    write_field(slides / "pen.svs", f)
    les = make_slide(slides / "les.svs", size=(2560, 2048), seed=5, n_lesions=1, mask_downsample=16)
    make_slide(root / "gone.svs", size=1536, seed=7)
    for sid, path in (("pen", slides / "pen.svs"), ("les", slides / "les.svs"), ("gone", root / "gone.svs")):
        res = tile_slide(SlideJob(sid, str(path)), tiles, TilingConfig(), background_write=False, threads=1)
        assert res.status == "ok", res.error
    (root / "gone.svs").unlink()
    (slides / "broken.svs").write_bytes(b"this is not a slide" * 100)
    masks = root / "masks"
    masks.mkdir()
    Image.fromarray(les.lesion.astype(np.uint8) * 255).save(masks / "les.png")
    pd.DataFrame({"slide_id": ["pen", "les", "broken"], "path": ["slides/pen.svs", "slides/les.svs", "slides/broken.svs"],
                  "label": [0, 1, 0], "split": ["train", "test", "val"],
                  "lesion_mask": [None, "masks/les.png", None], "mask_downsample": [None, 16, None]}).to_csv(root / "manifest.csv", index=False)
    heat = pred / "heatmaps"
    heat.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for sid, p1 in (("pen", 0.2), ("les", 0.9)):
        st = open_store(tiles / f"{sid}.zarr")
        extent = st.tile_size * float(st.attrs["downsample"])
        write_tile_scores(heat / f"{sid}_scores.csv", tile_scores_frame(st.coords, st.grid, extent, rng.random(len(st))))
        rows.append({"slide_id": sid, "label": int(p1 > 0.5), "pred": int(p1 > 0.5), "prob_0": 1 - p1, "prob_1": p1})
    pd.DataFrame(rows).to_csv(pred / "predictions.csv", index=False)
    ann = root / "ann"
    ann.mkdir()
    poly = [[[100, 100], [900, 120], [800, 900], [120, 800], [100, 100]]]
    ann.joinpath("pen.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": poly}, "properties": {"objectType": "annotation"}}]}))
    return {"slides": slides, "tiles": tiles, "pred": pred, "manifest": root / "manifest.csv", "ann": ann}


@contextmanager
def serving(catalog: Catalog, **kw: object) -> Iterator[ViewerServer]:
    """The viewer on a free port of 127.0.0.1, in a thread, shut down on exit."""
    server = make_server(catalog, port=0, **kw)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_cohort(tmp_path_factory.mktemp("viewer_cohort"))


@pytest.fixture(scope="session")
def catalog(cohort: dict[str, Path]) -> Catalog:
    return build_catalog(slides=cohort["slides"], manifest=cohort["manifest"], predictions=cohort["pred"],
                         tiles=cohort["tiles"], annotations=cohort["ann"])


@pytest.fixture(scope="session")
def server(catalog: Catalog) -> Iterator[ViewerServer]:
    with serving(catalog) as srv:
        yield srv


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Chromium driven by Playwright (no browser download: Debian's /usr/bin/chromium)."""
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package chromium); the browser tests need it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            yield b
        finally:
            b.close()
