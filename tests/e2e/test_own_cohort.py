"""The README's "Your own cohort" sequence, run as written on generated slides.

The commands are read from the README itself (the block between the `own-cohort` markers), so
the README and this test cannot drift apart. The only change the test makes: shorter training
(`--set train.epochs=1 --set train.bag_size=8`) and CPU. The folder holds an OME-TIFF (double
extension), a blank slide (0 tiles), and a slide without mpp whose mpp comes from the labels file;
where ../shared/slides is present (or $WSI_TEST_SLIDES), also the real slides a new user brings: an
Aperio SVS, a fluorescence NDPI (skipped by the brightfield rules, wherever its split lands) and a
single-file DICOM among the other slides (its own id and label; its placeholder mpp replaced by the
labels file's).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
REAL = Path(os.environ.get("WSI_TEST_SLIDES", REPO.parent / "shared" / "slides"))
#: the real slides added where present: (file under REAL, name in the cohort folder, label, mpp override)
REAL_SLIDES = (("CMU-1-Small-Region.svs", "CMU-1-Small-Region.svs", 1, None),
               ("test3-DAPI-2-387.ndpi", "dapi.ndpi", 0, None),
               ("dicom-bone/jpeg.dcm", "bone.dcm", 0, 0.5))
FAST = ["--set", "train.epochs=1", "--set", "train.bag_size=8", "--device", "cpu"]


def readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- own-cohort -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README has no ```bash block after <!-- own-cohort -->"
    lines = [ln.split("#")[0].strip() for ln in block.group(1).splitlines()]
    return [shlex.split(ln) for ln in lines if ln]


def _write_ome(src: Path, dest: Path, mpp: float) -> None:
    """An OME-TIFF copy of a generated slide's level 0 (tiled, with its physical pixel size)."""
    import tifffile

    img = tifffile.imread(src, level=0)
    tifffile.imwrite(dest, img, ome=True, tile=(256, 256), photometric="rgb",
                     metadata={"axes": "YXS", "PhysicalSizeX": mpp, "PhysicalSizeY": mpp,
                               "PhysicalSizeXUnit": "µm", "PhysicalSizeYUnit": "µm"})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from wsi_pipeline.synthetic.slides import make_slide

    root = tmp_path_factory.mktemp("own")
    slides = root / "my_slides"
    slides.mkdir()
    rows = []
    for i in range(10):
        label = i % 2
        name = f"case{i:02d}"
        make_slide(slides / f"{name}.svs", size=2048, mpp=0.25, seed=100 + i, n_lesions=3 * label, tile_size=256)
        rows.append({"slide_id": name, "label": label, "patient_id": f"P{i // 2 if i < 4 else i}"})
    _write_ome(slides / "case09.svs", slides / "ome_case.ome.tif", 0.25)
    rows.append({"slide_id": "ome_case", "label": 1, "patient_id": "P20"})
    make_slide(slides / "nompp.svs", size=2048, mpp=None, seed=7, tile_size=256)
    rows.append({"slide_id": "nompp", "label": 0, "patient_id": "P21", "mpp": 0.25})
    make_slide(slides / "blank.svs", size=2048, mpp=0.25, seed=8, blank=True, tile_size=256)
    rows.append({"slide_id": "blank", "label": 0, "patient_id": "P22"})
    if (REAL / "CMU-1-Small-Region.svs").is_file():
        for i, (src, name, label, mpp) in enumerate(REAL_SLIDES):
            shutil.copy(REAL / src, slides / name)
            rows.append({"slide_id": name.split(".")[0], "label": label, "patient_id": f"R{i}", **({"mpp": mpp} if mpp else {})})
    pd.DataFrame(rows).to_csv(root / "labels.csv", index=False)
    (root / "pipelines").mkdir()
    shutil.copy(REPO / "pipelines" / "own_cohort.yaml", root / "pipelines" / "own_cohort.yaml")
    new = root / "new_slides"
    new.mkdir()
    make_slide(new / "fresh.svs", size=2048, mpp=0.25, seed=55, n_lesions=2, tile_size=256)
    return root


@pytest.mark.slow
def test_the_readme_sequence_runs_as_written(workdir, monkeypatch, capsys, caplog):
    from wsi_pipeline.cli.main import main
    from wsi_pipeline.manifests.schema import read_manifest
    from wsi_pipeline.models import imagenet

    from pipeline_helpers import published_copy

    monkeypatch.chdir(workdir)
    # own_cohort.yaml starts from ImageNet weights: a stand-in checkpoint in torchvision's layout and naming
    weights, _ = published_copy(workdir, "resnet18")
    monkeypatch.setattr(imagenet, "imagenet_file", lambda name: weights)
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["wsi-pipeline", "manifest"], ["wsi-pipeline", "tile"], ["wsi-pipeline", "train"],
                                         ["wsi-pipeline", "eval"], ["wsi-pipeline", "predict"]]
    for argv in commands:
        extra = FAST if argv[1] in ("train", "eval") else (["--device", "cpu"] if argv[1] == "predict" else [])
        rc = main(argv[1:] + extra)
        out = capsys.readouterr()
        assert rc == 0, f"{' '.join(argv)} -> {rc}\n{out.out[-3000:]}\n{out.err[-3000:]}"

    assert "randomly initialised" not in caplog.text  # own_cohort.yaml starts from ImageNet

    manifest = read_manifest(workdir / "data_manifests" / "mine.csv")
    assert {"ome_case", "nompp", "blank"} <= set(manifest["slide_id"])  # one slide id rule: a.ome.tif -> a
    assert set(manifest["split"]) == {"train", "val", "test"}
    report = pd.read_csv(workdir / "tiles" / "mine" / "tiling_report.csv").set_index("slide_id")
    assert report.loc["nompp", "status"] == "ok" and report.loc["nompp", "mpp_source"] == "manifest"
    assert report.loc["blank", "n_tiles"] == 0
    real = {"CMU-1-Small-Region", "dapi", "bone"} & set(report.index)
    assert (report.loc[~report.index.isin(["blank", "dapi"]), "n_tiles"] > 0).all()
    if real:
        assert real == {"CMU-1-Small-Region", "dapi", "bone"}
        # the single-file DICOM keeps its own id and label (not the folder's name), its mpp from the labels file
        assert manifest.set_index("slide_id").loc["bone", "label"] == 0
        assert report.loc["bone", "status"] == "ok" and report.loc["bone", "mpp_source"] == "manifest"
        assert report.loc["dapi", "status"] == "skipped"  # fluorescence: left out, and nothing downstream failed
    pred = pd.read_csv(workdir / "predictions" / "mine" / "predictions.csv")
    assert set(pred["slide_id"]) == {"fresh"}
    assert np.isfinite(pred["prob_1"]).all()
    assert (workdir / "results" / "mine" / "metrics.json").is_file()
