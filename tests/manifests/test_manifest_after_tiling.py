"""`manifest folder|split --tiles DIR`: splits are drawn among the slides that tiled."""

from __future__ import annotations

import pandas as pd
import pytest


@pytest.mark.slow
def test_slides_without_tiles_are_left_out_before_splits_are_drawn(tmp_path, capsys):
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.synthetic.slides import make_slide

    slides = tmp_path / "slides"
    slides.mkdir()
    rows = []
    for i in range(8):
        make_slide(slides / f"s{i}.svs", size=512, seed=30 + i, tissue_fraction=0.5, mpp=0.5)
        rows.append({"slide_id": f"s{i}", "label": i % 2})
    make_slide(slides / "blank.svs", size=512, seed=9, blank=True, mpp=0.5)
    (slides / "broken.svs").write_bytes(b"not a slide" * 64)
    rows += [{"slide_id": "blank", "label": 0}, {"slide_id": "broken", "label": 1}]
    pd.DataFrame(rows).to_csv(tmp_path / "labels.csv", index=False)
    tiles = tmp_path / "tiles"
    assert main(["tile", "--slides", str(slides), "--out", str(tiles), "--tile-size", "128", "--no-progress"]) == 1  # broken failed
    capsys.readouterr()
    out = tmp_path / "m.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(tmp_path / "labels.csv"),
                 "--tiles", str(tiles), "--split", "0.5,0.25,0.25", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    df = pd.read_csv(out, keep_default_na=False)
    assert sorted(df["slide_id"]) == [f"s{i}" for i in range(8)]
    assert set(df["split"]) == {"train", "val", "test"}
    assert "left out 2 slide(s) without usable tiles" in err and "blank (0 tiles" in err and "broken (failed in tiling" in err
    # the same on an existing manifest, with cross-validation
    full = tmp_path / "full.csv"
    assert main(["manifest", "folder", "--slides", str(slides), "--labels", str(tmp_path / "labels.csv"), "--out", str(full)]) == 0
    assert main(["manifest", "split", "--manifest", str(full), "--tiles", str(tiles), "--crossval", "3", "--out",
                 str(tmp_path / "cv.csv")]) == 0
    cv = pd.read_csv(tmp_path / "cv.csv", keep_default_na=False)
    assert "blank" not in set(cv["slide_id"]) and "broken" not in set(cv["slide_id"])
