"""The saved-for-backward meter against what autograd's formulas save."""

from __future__ import annotations

import torch

from benchmarks.memory import SavedTensorMeter


def test_meter_counts_saved_tensors_until_the_graph_is_freed():
    x = torch.randn(100, 30, dtype=torch.float64, requires_grad=True)  # 24,000 bytes
    with SavedTensorMeter() as meter:
        y = x.sin()  # sin saves its input: 24,000 bytes
        z = y.exp()  # exp saves its result: 24,000 bytes
        assert meter.live == meter.peak == 2 * x.numel() * 8
        z.sum().backward()  # backward frees the graph's saved tensors
    assert meter.live == 0 and meter.peak == 2 * x.numel() * 8
    assert torch.allclose(x.grad, x.cos() * x.sin().exp())


def test_meter_excludes_the_given_modules_parameters():
    lin = torch.nn.Linear(50, 20, bias=False).double()
    x = torch.randn(8, 50, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter() as all_saved:
        lin(x).sum().backward()
    with SavedTensorMeter(exclude=(lin,)) as acts:
        lin(x).sum().backward()
    # the matmul saves its input (for the weight's gradient) and the weight (for the input's)
    assert all_saved.peak == x.numel() * 8 + lin.weight.numel() * 8
    assert acts.peak == x.numel() * 8 and acts.live == 0
