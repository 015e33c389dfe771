"""`wsi-pipeline tile --method unet`: tiles kept by the tissue U-Net's predicted mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from wsi_pipeline.slides.opener import open_slide
from wsi_pipeline.synthetic.slides import make_slide
from wsi_pipeline.tiling.cohort import tile_cohort
from wsi_pipeline.data.store import open_store
from wsi_pipeline.tiling.params import output_params
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.config.tiling_params import UNetParams
from wsi_pipeline.tissue_seg import stage
from wsi_pipeline.tissue_seg.builtin import BUILTIN_MODEL
from wsi_pipeline.tissue_seg.labels import paper_labels
from wsi_pipeline.tissue_seg.model import TissueUNet
from wsi_pipeline.tissue_seg.checkpoint import TissueCheckpoint, save_tissue_checkpoint


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_slide(tmp_path_factory.mktemp("unet_tile") / "held_out.svs", size=(2048, 1536), seed=2024,
                      tissue_fraction=0.35, mpp=0.5).path


def _constant_model(path: Path, logit: float) -> Path:
    """A model whose output is ``logit`` everywhere (all weights 0): every px tissue (> 0) or glass (< 0)."""
    m = TissueUNet()
    for p in m.parameters():
        torch.nn.init.zeros_(p)
    m.conv7.bias.data.fill_(logit)
    save_tissue_checkpoint(path, TissueCheckpoint.build(m, mpp=2.0))
    return path


@pytest.mark.parametrize("logit", [20.0, -20.0])
def test_unet_method_keeps_tiles_by_the_predicted_mask(slide: Path, tmp_path: Path, logit: float) -> None:
    model = _constant_model(tmp_path / "m.pt", logit)
    cfg = TilingConfig(method="unet", detector=UNetParams(tissue_model=str(model)), qc=False, qc_mode="off")
    rep = tile_cohort([SlideJob("s", str(slide))], tmp_path / "tiles", cfg, workers=0, progress=False)
    res = rep.results[0]
    assert res.status == "ok", res.error
    if logit < 0:
        assert res.n_tiles == 0
        return
    # a model calling everything tissue: the tiler keeps its mask only where the stain rule sees stained
    # tissue, so the tiles kept are the slide's tissue tiles (painted truth, 16 level-0 px per mask px)
    store = open_store(tmp_path / "tiles" / "s.zarr")
    assert store.attrs["method"] == "unet" and store.attrs["unet_info"]["model_mpp"] == 2.0
    truth = make_slide(tmp_path / "again.svs", size=(2048, 1536), seed=2024, tissue_fraction=0.35, mpp=0.5).tissue
    frac = truth[: 1536 // 16, : 2048 // 16].reshape(6, 16, 8, 16).mean(axis=(1, 3))
    kept = np.zeros(frac.shape, bool)
    kept[store.grid[:, 1], store.grid[:, 0]] = True
    assert kept[frac >= 0.75].all() and not kept[frac < 0.25].any(), (frac.round(2), kept)


def test_unet_method_refuses_a_missing_model(slide: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tissue model not found"):
        output_params(TilingConfig(method="unet", detector=UNetParams(tissue_model=str(tmp_path / "none.pt"))))


@pytest.mark.skipif(not BUILTIN_MODEL.is_file(), reason="shipped tissue model not built")
def test_shipped_model_is_small_and_matches_paper_labels_on_a_held_out_slide(slide: Path) -> None:
    assert BUILTIN_MODEL.stat().st_size < 64 * 1024
    model, mpp = stage.load_tissue_model(BUILTIN_MODEL)
    im = stage.load_image(slide, mpp=mpp)
    mask, _ = stage.predict_mask(model, im.grey, im.valid)
    truth = im.label[::8, ::8][: mask.shape[0], : mask.shape[1]]  # paper labels are constant on 8 x 8 blocks
    assert stage.dice(mask, truth) >= 0.95


@pytest.mark.real_slides
@pytest.mark.skipif(not BUILTIN_MODEL.is_file(), reason="shipped tissue model not built")
def test_real_cmu1_unet_covers_greyscale_tissue_tiles_and_no_glass(real_slides_dir: Path, tmp_path: Path) -> None:
    src = real_slides_dir / "CMU-1-Small-Region.svs"
    jobs = [SlideJob("cmu", str(src))]
    rep_u = tile_cohort(jobs, tmp_path / "u", TilingConfig(method="unet", qc=False), workers=0, progress=False)
    rep_g = tile_cohort(jobs, tmp_path / "g", TilingConfig(method="greyscale", qc=False), workers=0, progress=False)
    assert rep_u.ok and rep_g.ok
    kept_u = {(int(x), int(y)) for x, y in open_store(tmp_path / "u" / "cmu.zarr").coords}
    kept_g = {(int(x), int(y)) for x, y in open_store(tmp_path / "g" / "cmu.zarr").coords}
    # independent references from level 0: the paper's label and the glass level
    with open_slide(src) as s:
        w, h = s.dimensions
        rgb = s.read_region((0, 0), 0, (w, h))
    lab = paper_labels(rgb)
    grey = rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    glass_level = np.median(grey[grey > np.percentile(grey, 50)])
    tissue_tiles, glass_tiles = set(), set()
    for y in range(0, h - 255, 256):
        for x in range(0, w - 255, 256):
            if lab[y : y + 256, x : x + 256].mean() >= 0.5:
                tissue_tiles.add((x, y))
            if (grey[y : y + 256, x : x + 256] > glass_level - 10).mean() > 0.95:
                glass_tiles.add((x, y))
    assert kept_g & tissue_tiles <= kept_u  # every greyscale tile that is tissue is kept
    assert not kept_u & glass_tiles  # no glass tile is kept
    assert len(kept_u) > 0


@pytest.mark.real_slides
@pytest.mark.skipif(not BUILTIN_MODEL.is_file(), reason="shipped tissue model not built")
def test_real_cmu1_held_out_half_meets_the_dice_target(real_slides_dir: Path) -> None:
    """The shipped model's recipe trains on mosaics of CMU-1's top half only: on the bottom half,
    read here with the reader directly and labelled by the paper's pipeline, Dice >= 0.98 (the
    issue's target; the paper: 0.989 +- 0.005)."""
    from wsi_pipeline.slides.scaled import read_scaled
    from wsi_pipeline.tissue_seg.builtin import TEST_SOURCES

    name, rows, _ = TEST_SOURCES[0]
    model, mpp = stage.load_tissue_model(BUILTIN_MODEL)
    with open_slide(real_slides_dir / name) as s:
        rgb = read_scaled(s, mpp / s.mpp)
    part = rgb[int(round(rows[0] * rgb.shape[0])) : int(round(rows[1] * rgb.shape[0]))]
    h, w = part.shape[:2]
    padded = np.full((-(-h // 32) * 32, -(-w // 32) * 32, 3), 255, np.uint8)  # white glass, as in training
    padded[:h, :w] = part
    import cv2

    grey = cv2.cvtColor(padded, cv2.COLOR_RGB2GRAY)  # the model's input as the stage makes it
    mask, _ = stage.predict_mask(model, grey, (h, w))
    truth = paper_labels(padded)[::8, ::8][: mask.shape[0], : mask.shape[1]]  # constant on 8 x 8 blocks
    assert 0.2 < truth.mean() < 0.8
    assert stage.dice(mask, truth) >= 0.98
