"""A `tile` flag that the chosen tissue detector does not take is refused (exit 2, naming the flag and the
detectors that take it), never silently dropped (issue 50, one settings path per command)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from wsi_pipeline.cli.main import main


@pytest.fixture
def one_image(tmp_path):
    folder = tmp_path / "slides"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(folder / "s1.png")
    return folder


@pytest.mark.parametrize("method, flag, takers", [
    ("tissue", ["--tissue-model", "mine.pt"], "unet"),
    ("otsu", ["--tissue-model", "mine.pt"], "unet"),
    ("tissue", ["--no-prescreen"], "greyscale"),
    ("unet", ["--no-prescreen"], "greyscale"),
])
def test_a_flag_the_detector_does_not_take_is_refused(one_image, tmp_path, capsys, method, flag, takers) -> None:
    from wsi_pipeline.tiling.detectors import DETECTORS
    import dataclasses

    key = "tissue_model" if flag[0] == "--tissue-model" else "prescreen"
    expected = [n for n in DETECTORS.names() if key in {f.name for f in dataclasses.fields(DETECTORS.get(n).Params)}]
    assert expected == [takers]  # the registry's answer, which the message must give
    out = tmp_path / "tiles"
    code = main(["tile", "--slides", str(one_image), "--out", str(out), "--tile-size", "32", "--method", method,
                 "--no-progress", *flag])
    err = capsys.readouterr().err
    assert code == 2
    assert flag[0] in err and repr(method) in err and takers in err
    assert not list(out.glob("*.zarr")) if out.exists() else True


def test_the_flag_still_works_for_its_detector(one_image, tmp_path, capsys) -> None:
    out = tmp_path / "tiles"
    code = main(["tile", "--slides", str(one_image), "--out", str(out), "--tile-size", "32", "--method", "greyscale",
                 "--no-prescreen", "--qc", "off", "--no-progress"])
    assert code in (0, 1), capsys.readouterr().err
    assert "does not apply" not in capsys.readouterr().err
