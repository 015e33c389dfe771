"""Chunked whole-image execution vs plain autograd (float64, exact up to summation order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from wsi_pipeline.bigl.instrument import monitor_transfers
from wsi_pipeline.bigl.chunk_loop import ChunkRunner
from wsi_pipeline.tissue_seg.chunked import ChunkedTissueUNet
from wsi_pipeline.tissue_seg.model import PAPER_PARAMETERS, TissueUNet, count_parameters, prepare_input


def test_parameter_count_within_ten_percent_of_paper() -> None:
    n = count_parameters(TissueUNet())
    assert abs(n - PAPER_PARAMETERS) <= 0.1 * PAPER_PARAMETERS
    convs = [m for m in TissueUNet().modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
    assert len(convs) == 7
    assert not any(isinstance(m, (torch.nn.MaxPool2d, torch.nn.AvgPool2d)) for m in TissueUNet().modules())


def _data(h: int, w: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    grey = rng.integers(0, 256, (h, w), dtype=np.uint8)
    label = (rng.random((h, w)) > 0.5).astype(np.uint8)
    return grey, label


@pytest.mark.parametrize("max_elements", [6_000, 40_000, 10**9])
def test_chunked_loss_and_gradients_match_plain_autograd_float64(max_elements: int) -> None:
    torch.manual_seed(0)
    model = TissueUNet().double()
    for p in model.parameters():  # larger weights so ReLUs are mixed and gradients are not tiny
        p.data.mul_(3.0)
    grey, label = _data(96, 128, 1)
    # plain autograd reference
    x = prepare_input(torch.from_numpy(grey)[None, None], torch.float64)
    ref = F.binary_cross_entropy_with_logits(model(x), torch.from_numpy(label)[None, None].double())
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    big = ChunkedTissueUNet(model, ChunkRunner("cpu"), max_elements=max_elements)
    with monitor_transfers() as mon:
        loss = big.loss(grey, label)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        rel = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-300)
        assert rel <= 1e-10, (name, rel)
    if max_elements == 6_000:
        # several chunks per layer, and the head never had more than its budget of elements at once
        assert mon.count("chunk") > 20
        full_res = 96 * 128
        assert mon.max_transfer < full_res


def test_predict_low_matches_plain_forward() -> None:
    torch.manual_seed(1)
    model = TissueUNet().double()
    grey, _ = _data(64, 96, 2)
    big = ChunkedTissueUNet(model, ChunkRunner("cpu"), max_elements=5_000)
    with torch.no_grad():
        p = torch.sigmoid(model(prepare_input(torch.from_numpy(grey)[None, None], torch.float64)))
        ref = F.avg_pool2d(p, 8)[0, 0].float().numpy()
    # float32 output of float64 means: within one float32 rounding of values in [0, 1] (2**-24)
    assert np.abs(big.predict_low(grey) - ref).max() <= 2.0**-24


def test_bad_shapes_are_rejected() -> None:
    big = ChunkedTissueUNet(TissueUNet())
    with pytest.raises(ValueError, match="multiples of 32"):
        big.loss(np.zeros((40, 64), np.uint8), np.zeros((40, 64), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        big.loss(np.zeros((64, 64), np.float32), np.zeros((64, 64), np.uint8))


@pytest.mark.parametrize("s", [8, 4])
def test_block_counts_vs_reshape_sum(s: int) -> None:
    from wsi_pipeline.tissue_seg.chunked import _block_counts

    lab = torch.from_numpy((np.random.default_rng(3).random((8 * s, 16 * s)) > 0.3).astype(np.uint8))
    ref = lab.double().reshape(8, s, 16, s).sum(dim=(1, 3))
    assert torch.equal(_block_counts(lab[None, None], s)[0, 0].double(), ref)


def test_label_values_are_checked() -> None:
    big = ChunkedTissueUNet(TissueUNet())
    with pytest.raises(ValueError, match="0 \\(glass\\) and 1"):
        big.loss(np.zeros((64, 64), np.uint8), np.full((64, 64), 255, np.uint8))
