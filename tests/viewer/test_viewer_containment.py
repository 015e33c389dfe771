"""The viewer reads only what it was given (issue 51, part A, item 1).

Every file the viewer opens (slides, stores, predictions' scores, tissue contours, annotations, lesion masks)
resolves, symlinks followed, inside a folder named on its command line, or it is refused with a reason and
never served; GeoJSON is parsed and checked before it is served; a slide whose pixels cannot be read is failed
on the list; bad query values are 400s naming the value; ``--host`` that is no address names the flag.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from wsi_pipeline.cli.main import main
from wsi_pipeline.viewer import build_catalog

from conftest import serving

SECRET = "SECRET-CONTENT-OUTSIDE-THE-FOLDERS root:x:0:0"
POLY = [[[100, 100], [900, 120], [800, 900], [120, 800], [100, 100]]]
GOOD = {"type": "FeatureCollection", "features": [
    {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": POLY}, "properties": {"objectType": "annotation"}}]}


def _fetch(url: str) -> tuple[int, bytes]:
    """(status, body) of a GET, 4xx and 5xx included."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        try:
            return e.code, e.read()
        finally:
            e.close()


def _error(body: bytes) -> str:
    return str(json.loads(body)["error"])


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside every folder given to the viewer, holding what must never be served."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "secret.geojson").write_text(SECRET)
    (d / "secret_valid.geojson").write_text(json.dumps({**GOOD, "name": SECRET}))
    return d


def test_a_symlinked_annotation_is_refused_and_an_ordinary_one_served(cohort, outside, tmp_path) -> None:
    ann = tmp_path / "ann"
    ann.mkdir()
    os.symlink("/etc/passwd", ann / "pen.geojson")  # the reported case
    os.symlink(outside / "secret_valid.geojson", ann / "gone.geojson")  # valid GeoJSON, still outside
    (ann / "les.geojson").write_text(json.dumps(GOOD))
    cat = build_catalog(slides=cohort["slides"], tiles=cohort["tiles"], annotations=ann)
    with serving(cat) as srv:
        bodies = []
        for sid in ("pen", "gone"):
            status, body = _fetch(srv.url + f"geojson/{sid}/annotations")
            bodies.append(body)
            assert status in (403, 404), (sid, status, body[:200])
            assert "outside" in _error(body) and "ann" in _error(body)
        status, body = _fetch(srv.url + "geojson/les/annotations")
        assert status == 200 and json.loads(body)["features"][0]["geometry"]["coordinates"] == POLY
        tissue = json.loads(_fetch(srv.url + "geojson/les/tissue")[1])  # the tiler's contours pass the same check
        assert tissue["type"] == "FeatureCollection" and tissue["features"]
        info = {sid: json.loads(_fetch(srv.url + f"api/slide/{sid}")[1]) for sid in ("pen", "les")}
        assert info["les"]["geojson"] == ["tissue", "annotations"]
        assert "annotations" not in info["pen"]["geojson"] and "outside" in info["pen"]["refused"]["annotations"]
        for sid in ("pen", "gone", "les"):
            bodies.append(_fetch(srv.url + f"api/slide/{sid}")[1])
        bodies.append(_fetch(srv.url + "api/slides")[1])
    passwd = Path("/etc/passwd").read_bytes()[:40]
    assert not any(SECRET.encode() in b or (passwd and passwd in b) for b in bodies)


def test_symlinked_slides_stores_scores_tissue_and_masks_outside_are_refused(cohort, outside, tmp_path) -> None:
    root = tmp_path / "given"
    slides, tiles, pred = root / "slides", root / "tiles", root / "pred"
    for d in (slides, tiles / "tissue", pred / "heatmaps"):
        d.mkdir(parents=True)
    shutil.copy(cohort["slides"] / "pen.svs", slides / "pen.svs")
    os.symlink(cohort["slides"] / "les.svs", slides / "les.svs")  # a slide outside
    os.symlink(cohort["tiles"] / "gone.zarr", tiles / "gone.zarr")  # a store outside
    shutil.copytree(cohort["tiles"] / "pen.zarr", tiles / "pen.zarr")
    shutil.copytree(cohort["tiles"] / "gone.zarr", tiles / "lnk.zarr")  # a store inside, one chunk a link out
    chunk = next(f for f in sorted((tiles / "lnk.zarr").rglob("*")) if f.is_file() and f.stat().st_size > 100)
    chunk.unlink()
    os.symlink(outside / "secret.geojson", chunk)
    os.symlink(outside / "secret.geojson", tiles / "tissue" / "pen.geojson")  # tissue contours outside
    os.symlink(cohort["pred"] / "heatmaps" / "pen_scores.csv", pred / "heatmaps" / "pen_scores.csv")  # scores outside
    pd.read_csv(cohort["pred"] / "predictions.csv").to_csv(pred / "predictions.csv", index=False)
    manifest = root / "manifest.csv"
    pd.DataFrame({"slide_id": ["pen"], "path": ["slides/pen.svs"], "label": [0], "split": ["test"],
                  "lesion_mask": [str(cohort["manifest"].parent / "masks" / "les.png")], "mask_downsample": [16]}).to_csv(manifest, index=False)
    cat = build_catalog(slides=slides, manifest=manifest, predictions=pred, tiles=tiles)
    with serving(cat) as srv:
        rows = {r["slide_id"]: r for r in json.loads(_fetch(srv.url + "api/slides")[1])["rows"]}
        assert rows["pen"]["status"] == "ok"
        for sid in ("les", "gone"):
            assert "outside" in rows[sid]["status"], rows[sid]
            status, body = _fetch(srv.url + f"tile/{sid}/0/0/0.jpg")
            assert status in (403, 404, 422) and "outside" in _error(body)
        assert _fetch(srv.url + "tile/pen/0/0/0.jpg")[0] == 200
        info = json.loads(_fetch(srv.url + "api/slide/pen")[1])
        assert "tissue" not in info["geojson"] and "heatmap" not in info["overlays"] and "lesion" not in info["overlays"]
        assert "tiles" in info["overlays"]  # its own store, inside, is used
        status, body = _fetch(srv.url + "geojson/pen/tissue")
        assert status in (403, 404) and SECRET.encode() not in body
        for kind in ("heatmap", "lesion"):
            status, body = _fetch(srv.url + f"overlay/pen/{kind}/0/0/0.png")
            assert status in (403, 404) and "outside" in _error(body), (kind, status, body[:200])
    assert "holds a link" in rows["lnk"]["status"], rows["lnk"]


def test_a_fifo_inside_the_folders_is_refused_without_blocking(cohort, tmp_path) -> None:
    """A FIFO named as a slide and as a lesion mask by a manifest: opening one would wait for a writer forever."""
    root = tmp_path / "given"
    root.mkdir()
    shutil.copy(cohort["slides"] / "pen.svs", root / "pen.svs")
    os.mkfifo(root / "mask.png")
    os.mkfifo(root / "fifo.svs")
    pd.DataFrame({"slide_id": ["pen", "fifo"], "path": ["pen.svs", "fifo.svs"], "lesion_mask": ["mask.png", None],
                  "mask_downsample": [16, None]}).to_csv(root / "manifest.csv", index=False)
    with serving(build_catalog(manifest=root / "manifest.csv")) as srv:
        rows = {r["slide_id"]: r["status"] for r in json.loads(_fetch(srv.url + "api/slides")[1])["rows"]}
        assert rows["pen"] == "ok" and "not a regular file" in rows["fifo"], rows
        status, body = _fetch(srv.url + "overlay/pen/lesion/0/0/0.png")
        assert status == 403 and "not a regular file" in _error(body)


@pytest.mark.parametrize("content, reason", [
    ("[1, 2, 3]", "FeatureCollection"),
    ('"junk"', "FeatureCollection"),
    ("not json at all", "JSON"),
    ('{"type": "FeatureCollection", "features": "x"}', "features"),
    ('{"type": "FeatureCollection", "features": [[1, 2, 3]]}', "feature 0"),
    ('{"type": "FeatureCollection", "features": [{"type": "Feature", "geometry": "junk"}]}', "feature 0"),
])
def test_junk_annotations_are_checked_before_they_are_served(cohort, tmp_path, content, reason) -> None:
    ann = tmp_path / "ann"
    ann.mkdir()
    (ann / "pen.geojson").write_text(content)
    with serving(build_catalog(slides=cohort["slides"], annotations=ann)) as srv:
        status, body = _fetch(srv.url + "geojson/pen/annotations")
        assert status == 422 and reason in _error(body) and "pen.geojson" in _error(body), (status, body[:300])
        info = json.loads(_fetch(srv.url + "api/slide/pen")[1])
    assert "annotations" not in info["geojson"] and reason in info["refused"]["annotations"]  # the page never draws it
    assert content.encode() not in body or len(content) < 12


def test_an_annotation_file_above_the_bound_is_refused(cohort, tmp_path, monkeypatch) -> None:
    from wsi_pipeline.viewer import containment

    monkeypatch.setattr(containment, "MAX_GEOJSON_BYTES", 1000)
    ann = tmp_path / "ann"
    ann.mkdir()
    big = {**GOOD, "features": GOOD["features"] * 20}
    (ann / "pen.geojson").write_text(json.dumps(big))
    with serving(build_catalog(slides=cohort["slides"], annotations=ann)) as srv:
        status, body = _fetch(srv.url + "geojson/pen/annotations")
    assert status in (413, 422) and "1000" in _error(body) and "pen.geojson" in _error(body)


@pytest.mark.parametrize("kept", [0.5, 0.97])
def test_a_truncated_slide_is_failed_on_the_list(cohort, tmp_path, kept) -> None:
    """Cut at half (the reader fails) and near the end (the reader opens it and the probed tiles are whole: the
    image directories past the end give it away)."""
    slides = tmp_path / "slides"
    slides.mkdir()
    raw = (cohort["slides"] / "les.svs").read_bytes()
    (slides / "cut.svs").write_bytes(raw[: int(len(raw) * kept)])
    shutil.copy(cohort["slides"] / "pen.svs", slides / "pen.svs")
    with serving(build_catalog(slides=slides)) as srv:
        rows = {r["slide_id"]: r["status"] for r in json.loads(_fetch(srv.url + "api/slides")[1])["rows"]}
        assert rows["pen"] == "ok"
        assert rows["cut"] != "ok" and "truncated" in rows["cut"], rows
        assert _fetch(srv.url + "tile/cut/0/0/0.jpg")[0] in (404, 422)


def test_a_slide_moved_away_or_replaced_by_a_link_while_served_is_no_longer_ok(cohort, outside, tmp_path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for sid in ("pen", "les"):
        shutil.copy(cohort["slides"] / f"{sid}.svs", slides / f"{sid}.svs")
    with serving(build_catalog(slides=slides)) as srv:
        assert _fetch(srv.url + "tile/les/0/0/0.jpg")[0] == 200  # open, being viewed
        rows = {r["slide_id"]: r["status"] for r in json.loads(_fetch(srv.url + "api/slides")[1])["rows"]}
        assert rows == {"pen": "ok", "les": "ok"}
        (slides / "pen.svs").rename(outside / "pen.svs")
        (slides / "les.svs").unlink()
        os.symlink(outside / "pen.svs", slides / "les.svs")
        rows = {r["slide_id"]: r["status"] for r in json.loads(_fetch(srv.url + "api/slides")[1])["rows"]}
        assert "not found" in rows["pen"] and "outside" in rows["les"], rows


@pytest.mark.parametrize("path", [
    "crop/pen?x=inf&y=0", "crop/pen?x=nan&y=0", "crop/pen?x=-5000&y=0", "crop/pen?x=1e30&y=0", "crop/pen?x=0&y=0&size=inf",
    "crop/pen?x=0&y=0&size=-3", "crop/pen?x=abc&y=0", "crop/pen?x=&y=0", "api/slide/pen/at?x=nan&y=1", "api/slide/pen/at?x=1e400&y=1",
    "api/slides?offset=abc", "api/slides?limit=inf", "api/slides?offset=-1", "tile/pen/abc/0/0.jpg", "tile/pen/99999999999999999999/0/0.jpg",
    "overlay/pen/tiles/0/x/0.png",
])
def test_bad_query_values_are_400_naming_the_value(server, path) -> None:
    status, body = _fetch(server.url + path)
    assert status == 400, (path, status, body[:300])
    msg = _error(body)
    assert "Error" not in msg.split(":")[0]  # a reason, not an exception's name
    name = path.split("?")[1].split("=")[0] if "?" in path else "z"
    assert name in msg or "zoom" in msg or "tile" in msg, msg


def test_the_bad_query_values_keep_the_server_serving(server) -> None:
    assert _fetch(server.url + "crop/pen?x=inf&y=0")[0] == 400
    assert _fetch(server.url + "crop/pen?x=10&y=20&size=64")[0] == 200


def test_a_host_that_is_no_address_names_the_flag(cohort, capsys) -> None:
    rc = main(["view", "--tiles", str(cohort["tiles"]), "--host", "not a host", "--port", "0", "--seconds", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--host" in err and "not a host" in err and "Traceback" not in err, err


def test_one_containment_helper_resolves_paths_for_the_whole_viewer() -> None:
    """Only the containment module resolves paths in the viewer: every file goes through its one check."""
    viewer = Path(__import__("wsi_pipeline.viewer", fromlist=["x"]).__file__).parent
    users = sorted(p.name for p in viewer.glob("*.py") if ".resolve(" in p.read_text() and p.name != "containment.py")
    assert users == []
