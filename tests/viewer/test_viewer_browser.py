"""The viewer in headless Chromium: the list, level 0, every overlay's toggle, a click, and screenshots' pixels
against the data (the top-attention tile is the top of the colour scale, a dropped tile's outline is red, level 0
is the reader's pixels). Skipped with a reason where /usr/bin/chromium or Playwright is absent.

``WSI_VIEWER_DOCS=1`` also writes the demo screenshot to ``docs/images/viewer.png`` (generated, for the README).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from wsi_pipeline.data.store import open_store
from wsi_pipeline.export.heatmap import colormap
from wsi_pipeline.slides import open_slide
from wsi_pipeline.viewer.overlays import COLOURS

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "images"


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1200, "height": 800}, device_scale_factor=1)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.base = server.url  # type: ignore[attr-defined]
    yield pg
    ctx.close()
    assert not errors, errors


def _open(page, sid: str) -> None:
    page.goto(page.base + "slide/" + sid)
    page.wait_for_function("window.viewer && window.viewer.ready", timeout=30000)


def _only(page, kinds: list[str], opacity: int = 100) -> None:
    """Show exactly the overlays ``kinds`` (by clicking their toggles) at ``opacity`` percent."""
    for box in page.query_selector_all("#layers input[id^=toggle-]"):
        want = box.get_attribute("id")[len("toggle-"):] in kinds
        if box.is_checked() != want:
            box.click()
    for kind in kinds:
        page.eval_on_selector(f"#opacity-{kind}", "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", opacity)


def _go(page, x: float, y: float, zoom_below_max: int = 0) -> tuple[int, int]:
    """Centre level-0 point (x, y) at zoom max - ``zoom_below_max``; wait for every tile; return its page px."""
    page.evaluate("([x, y, dz]) => { const v = window.viewer; v.map.setView(v.toLL(x, y), v.Z - dz, {animate: false}); }",
                  [x, y, zoom_below_max])
    page.wait_for_timeout(200)
    page.wait_for_function("window.viewer.idle()", timeout=30000)
    page.wait_for_timeout(300)  # tiles of the zoom left behind are pruned
    p = page.evaluate("""([x, y]) => { const v = window.viewer; const c = v.toScreen(x, y);
        const r = document.getElementById('map').getBoundingClientRect(); return [c.x + r.left, c.y + r.top]; }""", [x, y])
    return round(p[0]), round(p[1])


def _shot(page) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("RGB")).astype(np.int16)


def test_list_page_names_every_slide_and_sorts(page, cohort) -> None:
    page.goto(page.base)
    page.wait_for_selector("tbody tr")
    rows = page.eval_on_selector_all("tbody tr", "rs => rs.map(r => r.dataset.slide)")
    assert sorted(rows) == ["broken", "gone", "les", "pen"]
    assert "failed" in page.get_attribute("tr[data-slide=broken]", "class")
    pred = pd.read_csv(cohort["pred"] / "predictions.csv")
    order = pred.assign(p=pred[["prob_0", "prob_1"]].max(axis=1)).sort_values("p")["slide_id"].tolist()
    for expected in (order, order[::-1]):  # first click ascending, second descending
        before = page.get_attribute("body", "data-loaded")
        page.click("th[data-sort=prob]")
        page.wait_for_function(f"document.body.dataset.loaded !== '{before}'")
        got = page.eval_on_selector_all("tbody tr", "rs => rs.map(r => r.dataset.slide)")
        assert got[: len(expected)] == expected


def test_level_zero_is_the_slide_and_each_overlay_toggles(page, cohort) -> None:
    _open(page, "les")
    _only(page, [])
    with open_slide(cohort["slides"] / "les.svs") as s:
        ref = s.read_region((1200, 900), 0, (200, 200)).astype(np.int16)
    px, py = _go(page, 1300, 1000)  # the centre of that region, 1 screen px = 1 level-0 px
    got = _shot(page)[py - 100:py + 100, px - 100:px + 100]
    assert np.abs(got - ref).mean() < 4.0  # JPEG tiles, quality 85
    kinds = page.eval_on_selector_all("#layers input[id^=toggle-]", "bs => bs.map(b => b.id.slice(7))")
    assert set(kinds) == {"heatmap", "tiles", "qc", "lesion", "tissue"}
    for kind in kinds:
        page.click(f"#toggle-{kind}")
        assert page.evaluate(f"window.viewer.map.hasLayer(window.viewer.layers['{kind}'])")
        page.click(f"#toggle-{kind}")
        assert not page.evaluate(f"window.viewer.map.hasLayer(window.viewer.layers['{kind}'])")


def test_heatmap_colour_at_the_top_tile_is_the_top_of_the_scale(page, cohort) -> None:
    scores = pd.read_csv(cohort["pred"] / "heatmaps" / "les_scores.csv")
    top = scores.loc[scores["attention"].idxmax()]
    _open(page, "les")
    _only(page, ["heatmap"])
    px, py = _go(page, top["x"] + top["size"] / 2, top["y"] + top["size"] / 2, zoom_below_max=1)
    img = _shot(page)
    assert np.abs(img[py, px] - colormap(np.array(1.0)).astype(np.int16)).max() <= 2
    assert f"({len(scores)} tiles of 256 level-0 px)" in page.inner_text("#heatmap-grid")
    if os.environ.get("WSI_VIEWER_DOCS") == "1":
        _only(page, ["heatmap", "tiles", "qc", "tissue", "lesion"], opacity=60)
        _go(page, 1280, 1024, zoom_below_max=2)
        page.click("#map", position={"x": px - 300, "y": py - 10})
        page.wait_for_function("document.querySelector('#crop') && document.querySelector('#crop').complete")
        DOCS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS / "viewer.png"))


def test_dropped_tile_outline_is_red_and_a_click_shows_the_tile(page, cohort) -> None:
    store = open_store(cohort["tiles"] / "pen.zarr")
    x, y = (int(v) for v in store.array("qc_dropped_coords")[0])
    _open(page, "pen")
    _only(page, ["qc"])
    px, py = _go(page, x + 128, y + 128)
    img = _shot(page)
    assert np.abs(img[py, px - 127] - np.array(COLOURS["dropped"])).max() <= 2  # the left edge, inside the outline
    assert np.abs(img[py, px] - np.array(COLOURS["dropped"])).max() > 60  # the tile itself is not painted
    # click the first kept tile: the panel shows its coordinates, rank and QC measures, and a level-0 crop
    kx, ky = (int(v) for v in store.coords[0])
    px, py = _go(page, kx + 128, ky + 128)
    page.mouse.click(px, py)
    page.wait_for_selector("#tile-info")
    text = page.inner_text("#info")
    assert f"x\t{kx}" in text and f"y\t{ky}" in text and "attention rank" in text and "qc_focus" in text
    page.wait_for_function("document.querySelector('#crop').complete && document.querySelector('#crop').naturalWidth > 0")
    assert page.evaluate("document.querySelector('#crop').naturalWidth") == 256


def test_slide_without_file_is_drawn_from_its_store_and_a_broken_one_says_why(page, cohort) -> None:
    store = open_store(cohort["tiles"] / "gone.zarr")
    x, y = (int(v) for v in store.coords[len(store) // 2])
    _open(page, "gone")
    _only(page, [])
    assert "tile store" in page.inner_text("#meta")
    px, py = _go(page, x + 128, y + 128)
    got = _shot(page)[py - 128:py + 128, px - 128:px + 128]
    assert np.abs(got - store.read([len(store) // 2])[0].astype(np.int16)).mean() < 4.0
    _open(page, "broken")
    assert "cannot be opened" in page.inner_text("#error") and "broken.svs" in page.inner_text("#error")
