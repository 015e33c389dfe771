"""Tile QC on real tissue: nucleus-dense real H&E tiles are kept at 32 and 256 px, a real pen image's ink
is still dropped, the glass estimate ignores scanner padding, and a slide losing many tiles is warned about.

References: the published nucleus centres of CRCHistoPhenotypes (``../shared/realdata``; tests skip
without it), the painted tissue of generated fields, and ink truth masks beside the real pen images
(``$WSI_PIPELINE_TESTDATA/pen``, default ``~/.cache/wsi-pipeline-testdata/pen``; skipped when absent).
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from wsi_pipeline.config.tiling import TilingConfig
from wsi_pipeline.data.store import open_store
from wsi_pipeline.synthetic.fields import FieldSpec, make_field, write_one_level_slide
from wsi_pipeline.synthetic.texture import HE_STAIN
from wsi_pipeline.tiling.artifacts import QC_BITS, focus_factor, focus_measure, qc_loss_note
from wsi_pipeline.tiling.background import estimate_background
from wsi_pipeline.tiling.job import SlideJob
from wsi_pipeline.tiling.tiler import tile_slide

REAL = Path(__file__).resolve().parents[2].parent / "shared" / "realdata" / "crc-histophenotypes"
PEN = Path(os.environ.get("WSI_PIPELINE_TESTDATA", Path.home() / ".cache" / "wsi-pipeline-testdata")) / "pen"


def _kept(store: Path) -> set[tuple[int, int]]:
    return {(int(c), int(r)) for c, r in open_store(store).grid} if store.exists() else set()


def _dense_images(n: int) -> list[str]:
    nuclei = pd.read_csv(REAL / "nuclei.csv")
    dense = nuclei[nuclei["class"].isin(["epithelial", "inflammatory"])]
    return list(dense.groupby("image").size().sort_values(ascending=False).index[:n])


@pytest.mark.slow
@pytest.mark.skipif(not (REAL / "nuclei.csv").exists(), reason=f"real data absent: {REAL}")
@pytest.mark.parametrize("tile, scale", [(32, 1), (256, 2)], ids=["32px-20x", "256px-40x"])
def test_nucleus_dense_real_tiles_are_kept(tile: int, scale: int, tmp_path: Path) -> None:
    """The tiles holding the most epithelial and inflammatory nuclei (published centres) of the densest CRC
    images are all kept by the default QC, at 32 px (20x) and 256 px on the images enlarged to 40x geometry."""
    from PIL import Image

    nuclei = pd.read_csv(REAL / "nuclei.csv")
    checked = 0
    for name in _dense_images(4):
        rgb = np.asarray(Image.open(REAL / "images" / f"{name}.png").convert("RGB"))
        if scale != 1:
            rgb = cv2.resize(rgb, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
        path = write_one_level_slide(tmp_path / f"{name}.svs", rgb, 0.5 / scale, quality=95)
        res = tile_slide(SlideJob(name, str(path)), tmp_path / "out", TilingConfig(tile_size=tile, qc=False))
        assert res.status == "ok", res
        kept = _kept(tmp_path / "out" / f"{name}.zarr")
        pts = nuclei[(nuclei["image"] == name) & nuclei["class"].isin(["epithelial", "inflammatory"])]
        cols = (pts["x"].to_numpy() * scale // tile).astype(int)
        rows = (pts["y"].to_numpy() * scale // tile).astype(int)
        n_side = rgb.shape[0] // tile
        inside = (cols < n_side) & (rows < n_side)
        counts = np.zeros((n_side, n_side), int)
        np.add.at(counts, (rows[inside], cols[inside]), 1)
        # nucleus-dense: at least 3 epithelial/inflammatory nuclei per 32 x 32 px of 20x (16 um square)
        dense = counts >= max(3, int(3 * (tile / scale / 32) ** 2))
        missing = {(int(c), int(r)) for r, c in zip(*np.nonzero(dense))} - kept
        assert not missing, (name, sorted(missing), res.note)
        checked += int(dense.sum())
    assert checked >= 4


@pytest.mark.skipif(not (PEN / "tcga-green-pen.ink.png").exists(), reason=f"real pen image absent: {PEN}")
def test_real_pen_image_keeps_dropping_its_ink(tmp_path: Path) -> None:
    """A real TCGA field with a green marker stroke (histolab's test fixture, Apache-2.0): tiles that are at
    least half ink (truth mask beside it) are dropped, tiles free of ink and mostly tissue are kept."""
    from PIL import Image

    rgb = np.asarray(Image.open(PEN / "tcga-green-pen.png").convert("RGB"))
    truth = np.asarray(Image.open(PEN / "tcga-green-pen.ink.png"))
    truth = truth[..., 0] if truth.ndim == 3 else truth
    path = write_one_level_slide(tmp_path / "pen.svs", rgb, 2.0, quality=95)
    T = 32
    res = tile_slide(SlideJob("pen", str(path)), tmp_path / "out", TilingConfig(tile_size=T, qc=False))
    assert res.status == "ok", res
    kept = _kept(tmp_path / "out" / "pen.zarr")
    rows, cols = rgb.shape[0] // T, rgb.shape[1] // T

    def frac(m: np.ndarray) -> np.ndarray:
        return m[: rows * T, : cols * T].reshape(rows, T, cols, T).mean(axis=(1, 3))

    ink, clean = frac(truth == 255), frac(truth == 0)
    inked = {(c, r) for r, c in zip(*np.nonzero(ink >= 0.5))}
    assert len(inked) >= 20 and len(inked & kept) <= 0.1 * len(inked), (len(inked), len(inked & kept))
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    tissue = frac(grey < 215) >= 0.8
    clean_tissue = {(c, r) for r, c in zip(*np.nonzero((clean == 1.0) & tissue))}
    assert len(clean_tissue - kept) <= 0.02 * len(clean_tissue), len(clean_tissue - kept)


def _padded_field(seed: int, pad: int) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """A generated H&E field on grey-pink glass (~235) with ``pad`` px of pure white scanner padding on the right."""
    glass = (238.0, 231.0, 236.0)
    f = make_field(FieldSpec((1024, 1024), glass, HE_STAIN, 0.35), seed=seed)
    rgb = np.concatenate([f.rgb, np.full((1024, pad, 3), 255, np.uint8)], axis=1)
    tissue = np.concatenate([f.tissue, np.zeros((1024, pad), bool)], axis=1)
    return rgb, tissue, glass


def test_glass_estimate_ignores_saturated_padding() -> None:
    rgb, _, glass = _padded_field(3, 2048)  # twice as much padding as scanned area
    ov = cv2.resize(rgb, (rgb.shape[1] // 16, rgb.shape[0] // 16), interpolation=cv2.INTER_AREA)
    bg = estimate_background(ov)
    assert bg.kind == "bright" and np.abs(np.asarray(bg.rgb) - np.asarray(glass)).max() <= 3, (bg, glass)
    # an all-white slide (a scanner that white-balances glass to 255) keeps its one level
    white = np.full((64, 64, 3), 255, np.uint8)
    white[20:40, 20:40] = (200, 150, 190)
    assert estimate_background(white).grey == 255


def test_no_glass_tile_kept_beside_padding(tmp_path: Path) -> None:
    """Tiles wholly on the grey glass (painted truth) are not kept when white padding dominates the slide."""
    rgb, tissue, _ = _padded_field(5, 2048)
    path = write_one_level_slide(tmp_path / "padded.svs", rgb, 0.5, quality=95)
    T = 64
    assert tile_slide(SlideJob("padded", str(path)), tmp_path / "out", TilingConfig(tile_size=T, qc=False)).status == "ok"
    kept = _kept(tmp_path / "out" / "padded.zarr")
    rows, cols = rgb.shape[0] // T, rgb.shape[1] // T
    t = tissue[: rows * T, : cols * T].reshape(rows, T, cols, T).mean(axis=(1, 3))
    glass_tiles = {(c, r) for r, c in zip(*np.nonzero(t == 0))}
    tissue_tiles = {(c, r) for r, c in zip(*np.nonzero(t >= 0.9))}
    assert not (glass_tiles & kept), sorted(glass_tiles & kept)[:10]
    assert len(tissue_tiles - kept) <= 0.02 * len(tissue_tiles), len(tissue_tiles - kept)


def test_focus_is_judged_at_a_fixed_physical_scale() -> None:
    """A sharp 20x tile enlarged 4x (0.125 um/px) is soft per pixel; averaged back to 0.5 um/px it reads as sharp,
    while a truly blurred one (sigma 2 px at 20x) stays blurred."""
    from wsi_pipeline.config.tiling_params import QCParams

    f = make_field(FieldSpec((256, 256), (240.0, 240.0, 240.0), HE_STAIN, 1.0), seed=2)
    up = cv2.resize(f.rgb, None, fx=4, fy=4, interpolation=cv2.INTER_CUBIC)
    soft = cv2.resize(cv2.GaussianBlur(f.rgb, (0, 0), 2.0), None, fx=4, fy=4, interpolation=cv2.INTER_CUBIC)
    k = focus_factor(0.125)
    assert k == 4.0 and focus_factor(0.5) == 1.0 and focus_factor(1.0) == 1.0 and focus_factor(None) == 1.0
    fmin = QCParams().focus_min
    assert focus_measure([up])[0] < fmin <= focus_measure([up], factor=k)[0]
    assert focus_measure([soft], factor=k)[0] < fmin


def test_qc_loss_note_names_slide_detector_and_flag() -> None:
    counts = {"dropped": {"pen": 30, "blur": 5, "fold": 0}, "n_dropped": 35, "flagged": {}}
    note = qc_loss_note("s1", counts, 165, ("pen", "blur"))
    assert "s1" in note and "35 of 200" in note and "pen 15 %" in note and "--qc flag" in note and "--qc-drop" in note
    assert qc_loss_note("s1", {"dropped": {"pen": 10}, "n_dropped": 10}, 190, ("pen", "blur")) == ""
    assert QC_BITS["pen"] == 1


def test_run_summary_gives_the_share_qc_dropped_per_detector(tmp_path: Path) -> None:
    from wsi_pipeline.tiling.job import SlideResult
    from wsi_pipeline.tiling.report import CohortReport

    a = SlideResult("a", "ok", n_tiles=90, qc_dropped=10, qc_pen=6, qc_blur=4, qc_fold=3)
    b = SlideResult("b", "ok", n_tiles=100)
    text = CohortReport([a, b], tmp_path / "r.csv", 1.0).summary()
    # 200 tissue tiles (kept + dropped): 10 dropped = 5 %, pen 6 = 3 %, blur 4 = 2 %, fold 3 = 1.5 %
    assert "QC dropped 10 of 200 tissue tiles (5.0 %; found: pen 3.0 %, blur 2.0 %, fold 1.5 %)" in text, text
    assert "QC dropped" not in CohortReport([b], tmp_path / "r.csv", 1.0).summary()
