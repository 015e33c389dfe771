"""Hostile model files and points files (issue 51, part A: items 2 and 3).

- A model file whose pickle allocates from a number (``bytearray(10**12)``: 1.3 KB that passes torch's
  ``weights_only`` loader and asks for a terabyte) is refused by the one loader every ``.pt``/``.pth``/``.bin``
  goes through, before ``torch.load`` runs, with one line naming the file and what was found; ordinary files
  still load. No test here lets ``torch.load`` see a hostile file: a scan that missed would allocate.
- ``tile --points`` with a missing file, a file without ``slide_id`` or junk features is refused once, before any
  slide is tiled, with one line naming the file (and the feature); no numpy warning leaks from the points reader.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from wsi_pipeline.cli.main import main

TERABYTE = 10**12


class _Allocates:
    """Pickles as ``bytearray(n)``: what the hostile file's reduce calls on loading."""

    def __init__(self, n: int, call: Any = bytearray) -> None:
        self.n, self.call = n, call

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (self.call, (self.n,))


class _Reduces:
    """Pickles as ``call(*args)`` (a function of torch's allow-list given a hostile shape)."""

    def __init__(self, call: Any, args: tuple[Any, ...]) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.call, self.args)


def _hostile(path: Path, payload: Any = None, **save_kw: Any) -> Path:
    """A small torch file holding an ordinary tensor and ``payload`` (default: ``bytearray(10**12)``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.ones(3), "evil": _Allocates(TERABYTE) if payload is None else payload}, path, **save_kw)
    return path


@pytest.fixture
def never_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.load`` raises if reached: the refusal must come from the scan before it."""

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.load reached a hostile file")

    monkeypatch.setattr(torch, "load", refuse)


# ----------------------------------------------------------------------------------------------
# Model files: the one loader scans the pickle first
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pickle_allocating_a_terabyte_is_refused_by_the_one_loader(tmp_path, never_torch_load, protocol):
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError
    from wsi_pipeline.model_files.loader import load_torch_file

    p = _hostile(tmp_path / "evil.pt", pickle_protocol=protocol)
    assert p.stat().st_size < 4096
    with pytest.raises(UnsafeModelFileError) as e:
        load_torch_file(p)
    msg = str(e.value)
    assert "evil.pt" in msg and "bytearray" in msg and str(TERABYTE) in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)  # a user error: the CLI prints it in one line


def test_legacy_non_zip_files_are_scanned_too(tmp_path, never_torch_load):
    from wsi_pipeline.model_files.loader import load_torch_file
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError

    p = _hostile(tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeModelFileError, match=r"old\.pth.*bytearray"):
        load_torch_file(p)


def test_bytes_and_a_large_shape_to_an_allowed_rebuild_function_are_refused(tmp_path, never_torch_load):
    from wsi_pipeline.model_files.loader import load_torch_file
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError

    with pytest.raises(UnsafeModelFileError, match=r"b\.pt.*bytes"):
        load_torch_file(_hostile(tmp_path / "b.pt", _Allocates(TERABYTE, bytes), pickle_protocol=4))
    # _rebuild_qtensor allocates from its size argument: each side < 2**31, the product 10**12
    q = _Reduces(torch._utils._rebuild_qtensor, ("storage", 0, (10**6, 10**6), (10**6, 1), (torch.per_tensor_affine, 1.0, 0), False, {}))
    with pytest.raises(UnsafeModelFileError, match=r"q\.pt.*_rebuild_qtensor.*1000000"):
        load_torch_file(_hostile(tmp_path / "q.pt", q))
    big = _Reduces(torch._utils._rebuild_meta_tensor_no_storage, (torch.float32, (2**40,), (1,), False))
    with pytest.raises(UnsafeModelFileError, match=r"m\.pt.*1099511627776"):
        load_torch_file(_hostile(tmp_path / "m.pt", big))


def test_variants_cut_short_hidden_in_a_polyglot_or_passed_as_a_function_are_refused(tmp_path, never_torch_load):
    """The pickle cut right after the call (no STOP: the unpickler runs the call before it fails), a legacy pickle
    with a zip directory appended (torch.load reads it as legacy, by its first bytes), and bytearray handed to an
    allowed rebuilder as the function it calls."""
    import io
    import zipfile

    from wsi_pipeline.model_files.loader import load_torch_file
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError

    raw = pickle.dumps({"w": 1, "evil": _Allocates(TERABYTE)}, protocol=2)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(raw[: raw.index(b"R") + 1])  # ... bytearray (10**12,) REDUCE, then nothing
    with pytest.raises(UnsafeModelFileError, match=r"cut\.pt.*bytearray"):
        load_torch_file(cut)
    legacy = _hostile(tmp_path / "poly.pt", _use_new_zipfile_serialization=False)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"ok": 1}, protocol=2))
    legacy.write_bytes(legacy.read_bytes() + buf.getvalue())
    assert zipfile.is_zipfile(legacy)  # Python's zipfile sees a zip; torch.load sees a legacy file
    with pytest.raises(UnsafeModelFileError, match=r"poly\.pt.*bytearray"):
        load_torch_file(legacy)
    as_function = _Reduces(torch._tensor._rebuild_from_type_v2, (bytearray, torch.Tensor, (TERABYTE,), {}))
    with pytest.raises(UnsafeModelFileError, match=r"fn\.pt.*bytearray"):
        load_torch_file(_hostile(tmp_path / "fn.pt", as_function))


def test_a_storage_declared_larger_than_its_record_is_refused(tmp_path, never_torch_load):
    """The storage's element count in its persistent id is 10**12 while its record holds 8 bytes."""
    import zipfile

    from wsi_pipeline.model_files.loader import load_torch_file
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    forged = tmp_path / "forged.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(forged, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                count = b"K\x02t"  # BININT1 2, then TUPLE: the end of the persistent id ('storage', ..., 'cpu', 2)
                assert data.count(count) == 1
                data = data.replace(count, b"\x8a\x06" + (10**12).to_bytes(6, "little") + b"t")  # LONG1 10**12
            dst.writestr(info, data)
    with pytest.raises(UnsafeModelFileError, match=r"forged\.pt.*storage of 1000000000000 elements held in 8 bytes"):
        load_torch_file(forged)


def test_ordinary_files_still_load_through_the_loader(tmp_path):
    from wsi_pipeline.checkpoints.files import load_checkpoint, save_checkpoint
    from wsi_pipeline.model_files.loader import load_torch_file

    sd = {"a.weight": torch.randn(64, 3, 7, 7), "a.bias": torch.zeros(64), "n": torch.tensor(2**40)}
    for kw in ({}, {"_use_new_zipfile_serialization": False}):
        p = tmp_path / f"sd{len(kw)}.pth"
        torch.save(sd, p, **kw)
        back = load_torch_file(p)
        assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # a run-like checkpoint: RNG state lists of ints up to 2**32 and a large seed are plain values, not calls
    state = {"models": {"w": torch.linspace(0, 1, 10)}, "rng": list(range(2**32 - 5, 2**32)), "seed": 2**40}
    p = save_checkpoint(tmp_path / "best.pt", state)
    assert load_checkpoint(p)["seed"] == 2**40


def test_every_model_file_entry_point_refuses_it(tmp_path, never_torch_load):
    """load_checkpoint (run checkpoints, predict --model, tile --tissue-model, tissue predict), the tissue model,
    features --weights / encoder.weights (torchvision and foundation files) and the small CNN's weights."""
    from wsi_pipeline.checkpoints.files import load_checkpoint
    from wsi_pipeline.model_files.pickle_scan import UnsafeModelFileError
    from wsi_pipeline.models.encoders import build_encoder, load_torchvision_weights
    from wsi_pipeline.models.foundation import load_state_file
    from wsi_pipeline.models.small_cnn import IlseCNN
    from wsi_pipeline.models.small_cnn import load_state_file as load_small
    from wsi_pipeline.tissue_seg.stage import load_tissue_model

    p = _hostile(tmp_path / "evil.pt")
    calls = {
        "load_checkpoint": lambda: load_checkpoint(p, trust_unverified=True),
        "load_tissue_model": lambda: load_tissue_model(p),
        "load_torchvision_weights": lambda: load_torchvision_weights(build_encoder("resnet18"), p),
        "foundation load_state_file": lambda: load_state_file(p, what="weights of preset x"),
        "small_cnn load_state_file": lambda: load_small(IlseCNN(), p),
    }
    for name, call in calls.items():
        with pytest.raises(UnsafeModelFileError, match=r"evil\.pt.*bytearray") as e:
            call()
        assert "\n" not in str(e.value), name


def test_the_commands_print_one_line_naming_the_file(tmp_path, capsys, never_torch_load):
    p = _hostile(tmp_path / "evil.pt")
    slides = tmp_path / "slides"
    slides.mkdir()
    from wsi_pipeline.synthetic.slides import make_slide

    make_slide(slides / "s0.svs", size=512, seed=1)
    for argv in (
        ["tissue", "predict", "--slides", str(slides), "--model", str(p), "--out", str(tmp_path / "o1")],
        ["predict", "--model", str(p), "--slides", str(slides), "--out", str(tmp_path / "o2"), "--no-progress",
         "--device", "cpu", "--workers", "0"],
        ["tile", "--slides", str(slides), "--out", str(tmp_path / "o3"), "--method", "unet", "--tissue-model", str(p),
         "--workers", "0", "--no-progress"],
    ):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert "evil.pt" in err and "bytearray" in err and "Traceback" not in err, err
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert not (tmp_path / "o3").exists() or not list((tmp_path / "o3").glob("*.zarr"))  # refused before any slide


def test_the_scan_reads_what_genops_reads_and_stops_where_the_unpickler_would(tmp_path):
    """A file that is no pickle at all is left to torch.load's own error (no false refusal)."""
    from wsi_pipeline.model_files.pickle_scan import scan_model_file

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a model" * 10)
    scan_model_file(junk)  # nothing found: torch.load reports what it is
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"a": [1, 2, 3]}, protocol=2))
    scan_model_file(raw)


# ----------------------------------------------------------------------------------------------
# Points: refused once, before any slide is tiled
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path_factory.mktemp("points_slides")
    for i in range(2):
        make_slide(d / f"s{i}.svs", size=512, seed=i)
    return d


def _tile(slides: Path, points: Path, out: Path) -> list[str]:
    return ["tile", "--slides", str(slides), "--out", str(out), "--points", str(points), "--tile-size", "32",
            "--workers", "0", "--no-progress"]


def _features(*feats: Any) -> str:
    return json.dumps({"type": "FeatureCollection", "features": list(feats)})


def _point(x: Any, y: Any) -> dict[str, Any]:
    return {"type": "Feature", "geometry": {"type": "Point", "coordinates": [x, y]}, "properties": {}}


JUNK_GEOJSON = {
    "a list and a string as features": (_features([1, 2, 3], "junk"), "feature 0"),
    "a junk feature after a good one": (_features(_point(5, 5), "junk"), "feature 1"),
    "a line, not a point": (_features(_point(5, 5), {"type": "Feature", "geometry": {"type": "LineString", "coordinates": [[0, 0], [1, 1]]}}), "feature 1"),
    "a string geometry": (_features({"type": "Feature", "geometry": "junk"}), "feature 0"),
    "string properties": (_features({"type": "Feature", "geometry": {"type": "Point", "coordinates": [1, 2]}, "properties": "junk"}), "feature 0"),
    "an infinite coordinate": ('{"type": "FeatureCollection", "features": [' + json.dumps(_point(1, 2)) + ', {"type": "Feature", "geometry": {"type": "Point", "coordinates": [Infinity, 2]}}]}', "feature 1"),
    "an empty polygon": (_features({"type": "Feature", "geometry": {"type": "Polygon", "coordinates": []}}), "feature 0"),
    "a null geometry": (_features(_point(1, 2), {"type": "Feature", "geometry": None}), "feature 1"),
    "a nested point": (_features({"type": "Feature", "geometry": {"type": "Point", "coordinates": [[1, 2]]}}), "feature 0"),
    "a junk multipoint": (_features({"type": "Feature", "geometry": {"type": "MultiPoint", "coordinates": [[1, 2], "a"]}}), "feature 0"),
    "nested too deep": ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    "not json": ("slide_id,x,y", "not readable JSON"),
}


@pytest.mark.parametrize("case", sorted(JUNK_GEOJSON))
def test_junk_geojson_points_are_refused_once_before_any_slide(case, two_slides, tmp_path, capsys):
    text, where = JUNK_GEOJSON[case]
    pts = tmp_path / "points"
    pts.mkdir()
    (pts / "s0.geojson").write_text(_features(_point(10, 10)))
    (pts / "s1.geojson").write_text(text)
    out = tmp_path / "tiles"
    rc = main(_tile(two_slides, pts, out))
    cap = capsys.readouterr()
    assert rc == 2, cap
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "s1.geojson" in lines[0] and where in lines[0], cap.err
    assert "Traceback" not in cap.err and "interrupted" not in cap.err + cap.out
    assert not list(out.glob("*.zarr"))  # s0's points were fine, but nothing was tiled


@pytest.mark.parametrize("case", ["missing file", "no slide_id column", "a non-numeric x"])
def test_a_bad_points_csv_is_refused_once(case, two_slides, tmp_path, capsys):
    pts = tmp_path / "points.csv"
    if case == "no slide_id column":
        pts.write_text("x,y\n10,10\n20,20\n")
    elif case == "a non-numeric x":
        pts.write_text("slide_id,x,y\ns0,10,10\ns1,abc,20\n")
    out = tmp_path / "tiles"
    rc = main(_tile(two_slides, pts, out))
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "points.csv" in lines[0], cap.err
    assert {"missing file": "not found", "no slide_id column": "slide_id", "a non-numeric x": "row 3"}[case] in lines[0]
    assert not list(out.glob("*.zarr")) and "interrupted" not in cap.err + cap.out


def test_good_points_still_tile_and_far_points_leak_no_numpy_warning(two_slides, tmp_path, capsys):
    from wsi_pipeline.tiling.points import point_origins, read_points

    pts = tmp_path / "points.csv"
    pts.write_text("slide_id,x,y\ns0,100,100\ns0,1e300,5\ns0,-1e300,5\ns1,200,200\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = read_points(pts, "s0")
        where = point_origins(p.xy, 32, (512, 512))
    assert where.n_outside == 2 and where.index.tolist() == [0]
    assert main(_tile(two_slides, pts, tmp_path / "tiles")) == 0, capsys.readouterr().err
    assert sorted(q.name for q in (tmp_path / "tiles").glob("*.zarr")) == ["s0.zarr", "s1.zarr"]
    np.testing.assert_array_equal(where.origins, [[84, 84]])
