"""Hostile and unlucky inputs, the rest of issue 51: ``predict`` re-tiling with another tissue model, a truncated
slide in ``tile``, ``tile --config`` of a pipeline without methods, ``predict --encoder-weights`` for a model that
needs none, and ``demo`` run outside the repository.

Each case reproduces what a new user met (a silent exit 0, a reader's error that does not say what is wrong, a
refusal of something that is not needed) and checks the behaviour they should get instead: the training's own
setting used, or one line naming the file or flag, what was found and what to pass, exit 2.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from wsi_pipeline.cli.main import main

from pipeline_helpers import replace_best


def _one_error_line(err: str) -> str:
    """The one ``wsi-pipeline <command>: error: ...`` line of ``err`` (and no traceback)."""
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("wsi-pipeline ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, store_cohort: Path) -> Path:
    """One finished frozen-encoder run (``<root>/runs/t/m/seed0``), trained one epoch on the store cohort."""
    from pipeline_helpers import make_config

    root = tmp_path_factory.mktemp("shared")
    cfg = make_config(root, store_cohort, [{"name": "m", "strategy": "frozen", "chunk_size": 16}], train={"epochs": 1})
    assert main(["train", "--config", str(cfg), "--no-progress", "--quiet"]) == 0
    return root


@pytest.fixture(scope="module")
def one_slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one small generated slide (512 px, 0.5 um/px)."""
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path_factory.mktemp("new_slides")
    make_slide(d / "new.svs", size=512, mpp=0.5, seed=7, tile_size=256)
    return d


# ----------------------------------------------------------------------------------------------
# Defect 3: predict tiles with the training's own tissue model, or refuses
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def my_tissue_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tissue model other than the shipped one (the shipped weights with another ``best`` record: other bytes)."""
    from wsi_pipeline.tissue_seg.builtin import BUILTIN_MODEL
    from wsi_pipeline.tissue_seg.checkpoint import load_tissue_checkpoint, save_tissue_checkpoint

    ckpt = load_tissue_checkpoint(BUILTIN_MODEL)
    path = tmp_path_factory.mktemp("tissue") / "MINE.pt"
    save_tissue_checkpoint(path, dataclasses.replace(ckpt, best={"epoch": 3, "val_loss": 0.25, "val_dice": 0.9}))
    return path


def _unet_run(shared: Path, tmp_path: Path, fingerprint: str) -> Path:
    """A copy of ``shared``'s run whose training stores are recorded as tiled by the unet detector with the tissue
    model of ``fingerprint``."""
    def unet(ckpt: Any) -> Any:
        tiling = {"method": "unet", "tile_size": 32, "min_foreground": 0.5, "mpp_target": None, "mpp_tolerance": 0.1,
                  "tissue_model_fingerprint": fingerprint}
        return dataclasses.replace(ckpt, tiling=tiling)

    return replace_best(shared, tmp_path, unet)


def _predict(run: Path, slides: Path, out: Path, *extra: str) -> int:
    return main(["predict", "--model", str(run), "--slides", str(slides), "--out", str(out), "--no-progress",
                 "--no-heatmaps", "--device", "cpu", "--workers", "0", *extra])


def test_predict_refuses_to_retile_with_another_tissue_model_naming_both_fingerprints(shared, one_slide, my_tissue_model,
                                                                                     tmp_path, capsys):
    from wsi_pipeline.slides.fingerprint import slide_fingerprint
    from wsi_pipeline.tissue_seg.builtin import BUILTIN_MODEL

    mine, shipped = slide_fingerprint(my_tissue_model), slide_fingerprint(BUILTIN_MODEL)
    assert mine != shipped
    run = _unet_run(shared, tmp_path, mine)
    rc = _predict(run, one_slide, tmp_path / "pred")
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and mine in line and shipped in line and "--tissue-model" in line, line
    assert not (tmp_path / "pred" / "tiles").exists() or not list((tmp_path / "pred" / "tiles").glob("*.zarr"))
    # another file than the training's is refused too, naming the file passed
    other = tmp_path / "other.pt"
    shutil.copy(BUILTIN_MODEL, other)
    rc = _predict(run, one_slide, tmp_path / "pred", "--tissue-model", str(other))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(other) in line and mine in line and shipped in line, line


def test_predict_tiles_with_the_training_tissue_model_when_given_it(shared, one_slide, my_tissue_model, tmp_path, capsys):
    from wsi_pipeline.data.store import open_store
    from wsi_pipeline.slides.fingerprint import slide_fingerprint

    mine = slide_fingerprint(my_tissue_model)
    run = _unet_run(shared, tmp_path, mine)
    assert _predict(run, one_slide, tmp_path / "pred", "--tissue-model", str(my_tissue_model)) == 0, capsys.readouterr().err
    identity = open_store(tmp_path / "pred" / "tiles" / "new.zarr").attrs["tiling_identity"]
    assert identity["method"] == "unet" and identity["tissue_model_fingerprint"] == mine


def test_predict_refuses_a_tissue_model_for_a_model_tiled_without_one(shared, one_slide, my_tissue_model, tmp_path, capsys):
    def greyscale(ckpt: Any) -> Any:
        return dataclasses.replace(ckpt, tiling={"method": "greyscale", "tile_size": 32, "min_foreground": 0.5,
                                                 "mpp_target": None, "mpp_tolerance": 0.1, "grey_min": 0, "grey_max": 220})

    run = replace_best(shared, tmp_path, greyscale)
    rc = _predict(run, one_slide, tmp_path / "pred", "--tissue-model", str(my_tissue_model))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--tissue-model" in line and "'greyscale'" in line, line


def test_predict_refuses_stores_of_another_tissue_model(shared, one_slide, my_tissue_model, tmp_path, capsys):
    """A folder of stores tiled by the shipped U-Net is refused for a model whose stores the user's U-Net tiled."""
    from wsi_pipeline.slides.fingerprint import slide_fingerprint

    assert main(["tile", "--slides", str(one_slide), "--out", str(tmp_path / "stores"), "--method", "unet",
                 "--tile-size", "32", "--workers", "0", "--no-progress"]) == 0
    run = _unet_run(shared, tmp_path, slide_fingerprint(my_tissue_model))
    rc = _predict(run, tmp_path / "stores", tmp_path / "pred")
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "tissue_model_fingerprint" in line and slide_fingerprint(my_tissue_model) in line, line


# ----------------------------------------------------------------------------------------------
# Weak cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kept", [0.6, 0.97])  # 0.97: the pyramid's base level whole, the end of the file cut off
def test_tile_calls_a_truncated_slide_truncated(kept, tmp_path, capsys):
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path / "slides"
    d.mkdir()
    make_slide(d / "good.svs", size=1024, mpp=0.5, seed=10, tile_size=256)
    make_slide(d / "cut.svs", size=1024, mpp=0.5, seed=11, tile_size=256)
    data = (d / "cut.svs").read_bytes()
    (d / "cut.svs").write_bytes(data[: int(len(data) * kept)])
    rc = main(["tile", "--slides", str(d), "--out", str(tmp_path / "tiles"), "--workers", "0", "--no-progress"])
    assert rc == 1
    report = pd.read_csv(tmp_path / "tiles" / "tiling_report.csv").set_index("slide_id")
    assert report.loc["good", "status"] == "ok"
    error = str(report.loc["cut", "error"])
    assert report.loc["cut", "status"] == "failed" and "cut.svs is truncated" in error and "file ends at byte" in error, error


def test_tile_config_of_a_pipeline_without_methods_tiles(tmp_path, capsys):
    from wsi_pipeline.synthetic.slides import make_slide

    d = tmp_path / "slides"
    d.mkdir()
    make_slide(d / "a.svs", size=512, mpp=0.5, seed=3, tile_size=256)
    cfg = tmp_path / "tiling_only.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "data": {"tiles_dir": str(tmp_path / "tiles"), "tiling": {"tile_size": 64}}}))
    rc = main(["tile", "--config", str(cfg), "--slides", str(d), "--workers", "0", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "tiles" / "a.zarr").is_dir()
    # a pipeline that is wrong in another way is still refused, naming the key
    cfg.write_text(yaml.safe_dump({"name": "t", "data": {"tiles_dir": str(tmp_path / "tiles"), "tiling": {"tile_size": 64}},
                                   "train": {"epochs": -1}}))
    rc = main(["tile", "--config", str(cfg), "--slides", str(d), "--workers", "0", "--no-progress"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "epochs" in line, line


def test_predict_encoder_weights_for_a_model_that_needs_none_is_refused(shared, one_slide, tmp_path, capsys):
    weights = tmp_path / "base.pth"
    weights.write_bytes(b"not used")
    run = shared / "runs" / "t" / "m" / "seed0"
    rc = _predict(run, one_slide, tmp_path / "pred", "--encoder-weights", str(weights))
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--encoder-weights" in line and str(weights) in line and "best.pt" in line, line
    assert not (tmp_path / "pred" / "predictions.csv").exists()


def test_demo_outside_the_repository_finds_its_pipeline(tmp_path, monkeypatch):
    import wsi_pipeline.demo

    seen: dict[str, Any] = {}

    def fake_run_demo(config: Any, **kw: Any) -> int:
        seen["config"] = config
        return 0

    monkeypatch.setattr(wsi_pipeline.demo, "run_demo", fake_run_demo)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--make-only"]) == 0
    found = Path(seen["config"])
    assert found.is_absolute() and found.is_file() and found.name == "demo.yaml", found
    assert main(["demo", "--make-only", "--task", "survival"]) == 0
    assert Path(seen["config"]).name == "demo_survival.yaml" and Path(seen["config"]).is_file()


def test_demo_without_its_pipeline_names_what_to_pass(tmp_path, monkeypatch, capsys):
    import wsi_pipeline.demo

    monkeypatch.setattr(wsi_pipeline.demo, "REPOSITORY_PIPELINES", tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    rc = main(["demo", "--make-only"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "pipelines/demo.yaml" in line and "--config" in line and str(tmp_path) in line, line

