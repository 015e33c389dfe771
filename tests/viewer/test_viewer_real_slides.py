"""The viewer on the real vendor slides of ../shared/slides (SVS, NDPI, DICOM) with predictions, in Chromium:
the list names every slide, each page loads its tiles, and level 0 of the SVS is the reader's pixels.
``WSI_VIEWER_REAL_SHOT=FILE.png`` also saves a screenshot there (outside the repository: real images are not
committed)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.data.store import open_store
from wsi_pipeline.export.scores import tile_scores_frame, write_tile_scores
from wsi_pipeline.slides import open_slide
from wsi_pipeline.slides.finder import find_slide_files
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.tiler import tile_slide
from wsi_pipeline.viewer import build_catalog

from conftest import serving

pytestmark = [pytest.mark.slow, pytest.mark.real_slides,
              pytest.mark.filterwarnings("ignore:.*hamamatsu-format metadata parsing:UserWarning")]

SVS = "CMU-1-Small-Region"


def test_real_slides_with_predictions_load_in_the_browser(real_slides_dir: Path, browser, tmp_path: Path) -> None:
    found = {sf.slide_id: sf.path for sf in find_slide_files(real_slides_dir)}
    assert SVS in found and len(found) >= 3
    tiles, pred = tmp_path / "tiles", tmp_path / "pred"
    assert tile_slide(SlideJob(SVS, str(found[SVS])), tiles, TilingConfig(), background_write=False, threads=1).status == "ok"
    store = open_store(tiles / f"{SVS}.zarr")
    attention = np.asarray(store.foreground, np.float64)  # any per-tile score will do: the viewer shows its rank
    (pred / "heatmaps").mkdir(parents=True)
    write_tile_scores(pred / "heatmaps" / f"{SVS}_scores.csv",
                      tile_scores_frame(store.coords, store.grid, store.tile_size * float(store.attrs["downsample"]), attention))
    pd.DataFrame({"slide_id": list(found), "pred": 1, "prob_0": 0.3, "prob_1": 0.7}).to_csv(pred / "predictions.csv", index=False)
    cat = build_catalog(slides=real_slides_dir, predictions=pred, tiles=tiles)
    with serving(cat) as srv:
        ctx = browser.new_context(viewport={"width": 1200, "height": 800}, device_scale_factor=1)
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url)
        page.wait_for_selector("tbody tr")
        listed = page.eval_on_selector_all("tbody tr", "rs => rs.map(r => r.dataset.slide)")
        assert sorted(listed) == sorted(found)
        for sid in found:
            page.goto(srv.url + "slide/" + sid)
            page.wait_for_function("window.viewer && window.viewer.ready", timeout=30000)
            assert page.evaluate("window.viewer.error") is None, sid
            page.wait_for_function("window.viewer.idle()", timeout=30000)
            loaded = page.eval_on_selector_all(".leaflet-tile-loaded", "ts => ts.length")
            assert loaded >= 1, sid
        page.goto(srv.url + "slide/" + SVS)
        page.wait_for_function("window.viewer && window.viewer.ready", timeout=30000)
        page.evaluate("() => { const v = window.viewer; v.map.setView(v.toLL(1200, 1500), v.Z, {animate: false}); }")
        page.wait_for_timeout(200)
        page.wait_for_function("window.viewer.idle()", timeout=30000)
        page.wait_for_timeout(300)
        p = page.evaluate("""() => { const c = window.viewer.toScreen(1200, 1500);
            const r = document.getElementById('map').getBoundingClientRect(); return [c.x + r.left, c.y + r.top]; }""")
        px, py = round(p[0]), round(p[1])
        shot = np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("RGB")).astype(np.int16)
        with open_slide(found[SVS]) as s:
            ref = s.read_region((1100, 1400), 0, (200, 200)).astype(np.int16)
        # re-encoding this (already JPEG) tissue at the tiles' quality 85 alone costs ~6 grey levels; one px off, ~18
        assert np.abs(shot[py - 100:py + 100, px - 100:px + 100] - ref).mean() < 9.0
        if os.environ.get("WSI_VIEWER_REAL_SHOT"):
            for kind in ("heatmap", "tiles", "tissue"):
                page.click(f"#toggle-{kind}")
            page.evaluate("() => { const v = window.viewer; v.map.setView(v.toLL(1110, 1480), v.Z - 2, {animate: false}); }")
            page.wait_for_timeout(300)
            page.wait_for_function("window.viewer.idle()", timeout=30000)
            page.mouse.click(px + 60, py - 40)
            page.wait_for_function("document.querySelector('#crop') && document.querySelector('#crop').complete")
            page.screenshot(path=os.environ["WSI_VIEWER_REAL_SHOT"])
        ctx.close()
        assert not errors, errors
