"""The viewer without a browser: the list, tiles against the reader, overlays against the data, clicks, errors."""

from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from wsi_pipeline.cli.main import main
from wsi_pipeline.data.store import open_store
from wsi_pipeline.export.heatmap import colormap
from wsi_pipeline.slides import open_slide
from wsi_pipeline.viewer import Catalog, SlideEntry, build_catalog
from wsi_pipeline.viewer.overlays import COLOURS, OUTLINE_PX, SlideOverlays
from wsi_pipeline.viewer.tiles import TILE, DeepZoomTiles, SlideTiles, StoreTiles, max_zoom


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def test_list_names_every_slide_sorted_by_probability_and_marks_the_broken_one(server, cohort) -> None:
    pred = pd.read_csv(cohort["pred"] / "predictions.csv")
    expected = pred.assign(p=pred[["prob_0", "prob_1"]].max(axis=1)).sort_values("p", ascending=False)["slide_id"].tolist()
    data = json.loads(_get(server.url + "api/slides?sort=prob&order=desc"))
    ids = [r["slide_id"] for r in data["rows"]]
    assert sorted(ids) == ["broken", "gone", "les", "pen"]  # every slide of the folder, the store-only one too
    assert ids[: len(expected)] == expected  # slides without a probability come last
    status = {r["slide_id"]: r["status"] for r in data["rows"]}
    assert "not a readable whole-slide image" in status["broken"]
    assert all(status[s] == "ok" for s in ("pen", "les", "gone"))
    by_split = json.loads(_get(server.url + "api/slides?sort=split"))["rows"]
    assert [r["split"] for r in by_split if r["split"]] == ["test", "train", "val"]
    info = json.loads(_get(server.url + "api/slide/broken"))
    assert "broken.svs" in info["error"]


def test_list_pages_thousands_of_slides() -> None:
    cat = Catalog()
    rng = np.random.default_rng(0)
    probs = rng.random(5000)
    for i, p in enumerate(probs):
        cat.entries[f"s{i:05d}"] = SlideEntry(f"s{i:05d}", prob=float(p))
    total, rows = cat.page(sort="prob", descending=True, offset=100, limit=50)
    assert total == 5000 and len(rows) == 50
    np.testing.assert_allclose([r.prob for r in rows], np.sort(probs)[::-1][100:150])
    total, rows = cat.page(query="s0499", limit=500)
    assert total == 10 and {r.slide_id for r in rows} == {f"s0499{k}" for k in range(10)}


@pytest.mark.parametrize("backend", ["openslide", "tiffslide"])
def test_tiles_are_the_slide_at_every_zoom(cohort, backend: str) -> None:
    """Level 0 tiles are the reader's pixels exactly; zoomed-out tiles are the level-0 pixels box-averaged."""
    slide = open_slide(cohort["slides"] / "les.svs", backend)
    src = DeepZoomTiles(slide) if backend == "openslide" else SlideTiles(slide)
    try:
        ref = open_slide(cohort["slides"] / "les.svs", backend)
        zmax = max_zoom(slide.dimensions)
        np.testing.assert_array_equal(src.tile(zmax, 2, 3), ref.read_region((512, 768), 0, (TILE, TILE)))
        # zoom zmax - 2: 4 level-0 px per screen px; the reference: level 0 averaged over 4 x 4 blocks
        full = ref.read_region((1024, 1024), 0, (4 * TILE, 4 * TILE)).astype(np.float64)
        expect = full.reshape(TILE, 4, TILE, 4, 3).mean(axis=(1, 3))
        got = src.tile(zmax - 2, 1, 1).astype(np.float64)
        assert np.abs(got - expect).mean() < 4.0
        # the whole slide in one tile at zoom 0, padded with the background
        t0 = src.tile(0, 0, 0)
        w, h = slide.dimensions
        s = 1 << zmax
        assert t0.shape == (TILE, TILE, 3)
        assert (t0[-(TILE - -(-h // s)):, :] == slide.background).all()
        with pytest.raises(ValueError, match="outside"):
            src.tile(zmax, 100, 0)
        ref.close()
    finally:
        src.close()


def test_store_alone_gives_the_stored_tiles(cohort) -> None:
    store = open_store(cohort["tiles"] / "gone.zarr")
    src = StoreTiles(store)
    assert src.dimensions == tuple(store.attrs["slide_dimensions"])
    zmax = max_zoom(src.dimensions)
    x, y = (int(v) for v in store.coords[0])
    assert x % TILE == 0 and y % TILE == 0  # the tiler's grid is the viewer's at zoom max
    np.testing.assert_array_equal(src.tile(zmax, x // TILE, y // TILE), store.read([0])[0])
    np.testing.assert_array_equal(src.region(x + 10, y + 20, 50, 40), store.read([0])[0][20:60, 10:60])
    assert src.tile(0, 0, 0).shape == (TILE, TILE, 3)


def _overlays(cohort, sid: str) -> SlideOverlays:
    store = open_store(cohort["tiles"] / f"{sid}.zarr")
    dims = tuple(store.attrs["slide_dimensions"])
    return SlideOverlays(dims, store=store, scores=cohort["pred"] / "heatmaps" / f"{sid}_scores.csv",
                         lesion_mask=cohort["manifest"].parent / "masks" / f"{sid}.png", mask_downsample=16)


def test_heatmap_top_tile_is_the_top_of_the_scale_and_dropped_tiles_are_red(cohort) -> None:
    ov = _overlays(cohort, "pen")
    scores = pd.read_csv(cohort["pred"] / "heatmaps" / "pen_scores.csv")
    top = scores.loc[scores["attention"].idxmax()]
    zmax = max_zoom(ov.dimensions)
    tx, ty = int(top["x"]) // TILE, int(top["y"]) // TILE
    img = ov.render("heatmap", zmax, tx, ty)
    cx, cy = int(top["x"]) - tx * TILE + 128, int(top["y"]) - ty * TILE + 128
    assert tuple(img[cy, cx]) == (*colormap(np.array(1.0)).tolist(), 255)
    low = scores.loc[scores["attention"].idxmin()]
    lx, ly = int(low["x"]) // TILE, int(low["y"]) // TILE
    assert tuple(ov.render("heatmap", zmax, lx, ly)[128, 128, :3]) == tuple(colormap(np.array(0.0)).tolist())
    # QC: the store records where it dropped tiles and why; their outlines are red, inside transparent
    store = open_store(cohort["tiles"] / "pen.zarr")
    dropped = store.array("qc_dropped_coords")
    flags = store.array("qc_dropped_flags")
    assert len(dropped) == store.attrs["qc"]["n_dropped"] > 0 and (flags & 1).any()  # pen
    x, y = (int(v) for v in dropped[0])
    q = ov.render("qc", zmax, x // TILE, y // TILE)
    ox, oy = x % TILE, y % TILE
    assert tuple(q[oy + 128, ox + 1]) == (*COLOURS["dropped"], 255)
    assert tuple(q[oy + 128, ox + OUTLINE_PX + 2]) == (0, 0, 0, 0)
    assert not ov.render("qc", zmax, x // TILE, y // TILE, reasons=("fold",))[oy + 128, ox + 1].any()
    info = ov.tile_at(x + 5, y + 5)
    assert info is not None and info["status"] == "dropped by QC" and "pen" in info["qc_flags"]
    info = ov.tile_at(float(top["x"]) + 100, float(top["y"]) + 100)
    assert info is not None and info["position"] == 1 and info["tile"] == int(top["tile"])
    assert info["x"] == int(top["x"]) and "qc_focus" in info


def test_lesion_overlay_follows_the_mask(cohort) -> None:
    ov = _overlays(cohort, "les")
    mask = np.asarray(Image.open(cohort["manifest"].parent / "masks" / "les.png")) > 127
    zmax = max_zoom(ov.dimensions)
    # zoom zmax - 4: 16 level-0 px per screen px = one mask px per screen px
    img = ov.render("lesion", zmax - 4, 0, 0)
    h, w = mask.shape
    np.testing.assert_array_equal(img[:h, :w, 3] > 0, mask)
    assert mask.any() and (img[:h, :w][mask][:, :3] == COLOURS["lesion"]).all()


def test_crop_is_full_resolution(server, cohort) -> None:
    png = _get(server.url + "crop/les?x=700&y=900&size=300")
    got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    with open_slide(cohort["slides"] / "les.svs") as s:
        np.testing.assert_array_equal(got, s.read_region((700, 900), 0, (300, 300)))
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(server.url + "api/slide/nosuch")
    assert e.value.code == 404
    e.value.close()


def test_cli_errors_name_the_folder_and_the_port(tmp_path: Path, capsys, cohort) -> None:
    assert main(["view", "--slides", str(tmp_path / "absent")]) == 2
    assert "slides folder not found" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["view", "--tiles", str(cohort["tiles"]), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port}" in err and "already in use" in err
    assert main(["view", "--tiles", str(cohort["tiles"]), "--port", "0", "--seconds", "0.5"]) == 0
    assert "3 slides at http://127.0.0.1:" in capsys.readouterr().out


def test_catalog_joins_sources(cohort) -> None:
    cat = build_catalog(predictions=cohort["pred"])  # predictions alone: the slides it predicted
    assert set(cat.entries) == {"pen", "les"} and cat.get("les").prob == pytest.approx(0.9)
    with pytest.raises(FileNotFoundError, match="predictions folder not found"):
        build_catalog(predictions=cohort["pred"] / "nope")


def test_eval_results_list_one_method_averaged_over_seeds(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = []
    for method in ("transmil", "abmil"):
        for seed in range(3):
            for sid in ("a", "b", "c"):
                p = float(rng.random())
                rows.append({"slide_id": sid, "cohort": "x", "label": int(sid == "b"), "pred": int(p > 0.5),
                             "prob_0": 1 - p, "prob_1": p, "method": method, "seed": seed})
    df = pd.DataFrame(rows)
    df.to_csv(tmp_path / "predictions_x_all.csv", index=False)
    df.assign(prob_1=0.0).to_csv(tmp_path / "predictions_x_sub8x10.csv", index=False)  # not the 'all' protocol: ignored
    for method in (None, "abmil"):
        cat = build_catalog(predictions=tmp_path, method=method)
        assert cat.sources == [f"predictions {tmp_path} (method {method or 'transmil'}, mean over its seeds)"]
        chosen = df[df["method"] == (method or "transmil")].groupby("slide_id")[["prob_0", "prob_1"]].mean()
        for sid in ("a", "b", "c"):
            e = cat.get(sid)
            assert e.prob == pytest.approx(chosen.loc[sid].max())
            assert e.pred == int(chosen.loc[sid].to_numpy().argmax()) and e.label == int(sid == "b")
    with pytest.raises(ValueError, match="no method 'dtfd'"):
        build_catalog(predictions=tmp_path, method="dtfd")


def test_printed_view_command_parses_to_the_same_sources(tmp_path: Path) -> None:
    import shlex

    from wsi_pipeline.cli.main import build_parser
    from wsi_pipeline.viewer import view_command

    cmd = view_command(manifest=tmp_path / "a b" / "m.csv", predictions=tmp_path / "res", tiles=tmp_path / "tiles", port=9000)
    argv = shlex.split(cmd)
    assert argv[:2] == ["wsi-pipeline", "view"]
    args = build_parser().parse_args(argv[1:])
    assert (Path(args.manifest), Path(args.predictions), Path(args.tiles), args.port) == (
        tmp_path / "a b" / "m.csv", tmp_path / "res", tmp_path / "tiles", 9000)


@pytest.mark.parametrize("backend", ["auto", "tiffslide"])
def test_ome_tiff_pyramid_is_viewed(tmp_path: Path, backend: str) -> None:
    """An OME-TIFF (pyramid in SubIFDs), through the server: OpenSlide's DeepZoom over its level 0, or tiffslide's
    levels; level-0 tiles are the image, the zoom-0 tile its 8 x 8 box average (DeepZoom filters with Lanczos:
    blocks of 64 px keep its ringing to the block edges)."""
    import tifffile

    from conftest import serving

    rng = np.random.default_rng(0)
    img = np.kron(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8), np.ones((64, 64, 1), np.uint8))  # 1024 x 1536
    path = tmp_path / "slides" / "o.ome.tif"
    path.parent.mkdir()
    with tifffile.TiffWriter(path, ome=True) as tw:
        tw.write(img, tile=(256, 256), photometric="rgb", subifds=1, metadata={"axes": "YXS"})
        tw.write(img[::2, ::2], tile=(256, 256), photometric="rgb", subfiletype=1)
    with serving(build_catalog(slides=path.parent), backend=backend) as srv:
        info = json.loads(_get(srv.url + "api/slide/o"))
        assert info["dimensions"] == [1536, 1024] and info["max_zoom"] == 3
        crop = np.asarray(Image.open(io.BytesIO(_get(srv.url + "crop/o?x=300&y=500&size=200"))).convert("RGB"))
        np.testing.assert_array_equal(crop, img[500:700, 300:500])
        src = srv.slides.get("o").source
        np.testing.assert_array_equal(src.tile(3, 1, 2), img[512:768, 256:512])
        expect = img.astype(np.float64).reshape(128, 8, 192, 8, 3).mean(axis=(1, 3))
        assert np.abs(src.tile(0, 0, 0)[:128, :192] - expect).mean() < 3.0


def test_open_slides_are_capped_and_an_evicted_one_still_serves(catalog) -> None:
    from conftest import serving

    with serving(catalog, max_open=2) as srv:
        held = srv.slides.get("pen").source  # a request in flight holds its slide
        before = held.tile(0, 0, 0)
        for sid in ("les", "gone", "les"):
            srv.slides.get(sid)
        assert srv.slides.n_open == 2
        np.testing.assert_array_equal(held.tile(0, 0, 0), before)  # evicted, not closed under the reader
        assert srv.slides.status("broken") == srv.slides.status("broken") != "ok"
        assert srv.slides.status("pen") == "ok" and srv.slides.n_open == 2  # the list's check keeps nothing open


def test_survival_predictions_list_the_risk(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    df = pd.DataFrame({"slide_id": [s for s in "abcd" for _ in range(2)], "risk": rng.normal(size=8),
                       "time": 1.0, "event": 1, "method": "cox", "seed": [0, 1] * 4})
    df.to_csv(tmp_path / "predictions_x_all.csv", index=False)
    cat = build_catalog(predictions=tmp_path)
    mean = df.groupby("slide_id")["risk"].mean()
    _, rows = cat.page(sort="risk", descending=True)
    assert [e.slide_id for e in rows] == mean.sort_values(ascending=False).index.tolist()
    assert [e.risk for e in rows] == pytest.approx(mean.sort_values(ascending=False).tolist())
    assert all(e.prob is None and e.pred is None for e in rows)
