"""Exact gradient accumulation: accumulate_step == full_step (gradients, loss), BatchNorm policies, memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.memory import SavedTensorMeter
from wsi_pipeline.models import build_aggregator
from wsi_pipeline.models.aggregators.dtfd import DISTILL_MODES
from wsi_pipeline.training.accumulate import accumulate_step, classification_loss, full_step

FEAT = 16


class TinyCNN(nn.Module):
    """A small encoder with BatchNorm (and optional dropout): [k, 3, H, W] -> [k, FEAT]."""

    def __init__(self, width: int = 8, p_drop: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Dropout(p_drop),
            nn.Conv2d(2 * width, FEAT, 3, stride=2, padding=1), nn.BatchNorm2d(FEAT), nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean((2, 3))


def _encoder(seed: int = 0, p_drop: float = 0.0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    enc = TinyCNN(p_drop=p_drop).to(dtype)
    with torch.no_grad():  # non-trivial running statistics so frozen BN is not the identity
        for m in enc.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return enc.train()


CASES = [("abmil", {}), ("abmil", {"gated": False}), ("transmil", {"dim": 32, "num_landmarks": 8})] + [
    ("dtfd", {"distill": d, "ipg": 2, "n_groups": 3}) for d in DISTILL_MODES
]
IDS = ["abmil", "abmil-nongated", "transmil"] + [f"dtfd-{d}" for d in DISTILL_MODES]


def _agg_kwargs(name: str) -> dict:
    # DTFD draws random pseudo-bags: both steps must see the same split
    return {"generator": torch.Generator().manual_seed(3)} if name == "dtfd" else {}


def _grads(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for m in modules for p in m.parameters()]


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_accumulate_equals_full_step(name: str, opts: dict) -> None:
    n = 20
    enc = _encoder()
    torch.manual_seed(1)
    agg = build_aggregator(name, FEAT, 3, dropout=0.0, **opts).double()
    tiles = torch.randn(n, 3, 12, 12, dtype=torch.float64)
    label = 2

    ref_loss = full_step(enc, agg, tiles, label, aggregator_kwargs=_agg_kwargs(name))
    ref = _grads(enc, agg)
    assert all(torch.isfinite(g).all() for g in ref)
    assert sum(float(g.abs().sum()) for g in ref[: len(list(enc.parameters()))]) > 0, "encoder must get gradient"
    for chunk in (1, 7, n):
        enc.zero_grad(set_to_none=True)
        agg.zero_grad(set_to_none=True)
        loss = accumulate_step(enc, agg, tiles, label, chunk, aggregator_kwargs=_agg_kwargs(name))
        assert abs(loss - ref_loss) <= 1e-12
        got = _grads(enc, agg)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        assert diff <= 1e-9, f"chunk {chunk}: max abs gradient difference {diff}"
    # BatchNorm modes were restored (the encoder stays in train mode)
    assert all(m.training for m in enc.modules())


def test_full_step_matches_plain_autograd_and_adds_to_grad() -> None:
    enc = _encoder()
    torch.manual_seed(2)
    agg = build_aggregator("abmil", FEAT, 2, dropout=0.0).double()
    tiles = torch.randn(9, 3, 8, 8, dtype=torch.float64)
    # independent reference: eval-mode BatchNorm, one forward, one backward
    enc.eval()
    out = agg(enc(tiles))
    ref_loss = nn.functional.cross_entropy(out.logits[None], torch.tensor([1]))
    ref_loss.backward()
    ref = _grads(enc, agg)
    enc.train()
    enc.zero_grad(set_to_none=True)
    agg.zero_grad(set_to_none=True)
    loss = accumulate_step(enc, agg, tiles, 1, 4)
    assert abs(loss - float(ref_loss.detach())) < 1e-12
    # a second bag ADDS to .grad (callers accumulate over bags)
    accumulate_step(enc, agg, tiles, 1, 3)
    got = _grads(enc, agg)
    assert max(float((a - 2 * b).abs().max()) for a, b in zip(got, ref)) < 1e-9


def test_chunk_bn_exact_for_its_own_function_and_running_stats_once() -> None:
    """bn='chunk' with dropout: gradient equals autograd through the same chunked computation."""
    n, chunk = 13, 5
    enc = _encoder(p_drop=0.3)
    torch.manual_seed(3)
    agg = build_aggregator("abmil", FEAT, 2, dropout=0.0).double()
    tiles = torch.randn(n, 3, 8, 8, dtype=torch.float64)
    bns = [m for m in enc.modules() if isinstance(m, nn.BatchNorm2d)]
    before = [(m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)) for m in bns]

    # reference: every chunk through the encoder WITH grad (train-mode BN per chunk, dropout from
    # the same RNG stream), then the aggregator, one backward; running stats restored afterwards
    torch.manual_seed(42)
    z = torch.cat([enc(tiles[a : a + chunk]) for a in range(0, n, chunk)])
    ref_loss = classification_loss(agg(z), 1)
    ref_loss.backward()
    ref = _grads(enc, agg)
    with torch.no_grad():
        for m, (rm, rv, nb) in zip(bns, before):
            m.running_mean.copy_(rm)
            m.running_var.copy_(rv)
            m.num_batches_tracked.fill_(nb)
    enc.zero_grad(set_to_none=True)
    agg.zero_grad(set_to_none=True)

    torch.manual_seed(42)
    loss = accumulate_step(enc, agg, tiles, 1, chunk, bn="chunk")
    assert abs(loss - float(ref_loss.detach())) < 1e-12
    got = _grads(enc, agg)
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref)) < 1e-9

    # running statistics updated exactly once per bag, with the bag's statistics; the first
    # BatchNorm's input (conv1 output) does not depend on the chunking, so check it directly
    for m, (_, _, nb) in zip(bns, before):
        assert int(m.num_batches_tracked) == nb + 1
    with torch.no_grad():
        x = enc.body[0](tiles)
    mean = x.mean((0, 2, 3))
    var = x.var((0, 2, 3), unbiased=True)
    rm, rv, _ = before[0]
    torch.testing.assert_close(bns[0].running_mean, 0.9 * rm + 0.1 * mean)
    torch.testing.assert_close(bns[0].running_var, 0.9 * rv + 0.1 * var)


def test_chunk_bn_whole_bag_equals_full_step_chunk() -> None:
    enc_a, enc_b = _encoder(), _encoder()
    torch.manual_seed(4)
    agg = build_aggregator("abmil", FEAT, 2, dropout=0.0).double()
    tiles = torch.randn(10, 3, 8, 8, dtype=torch.float64)
    la = full_step(enc_a, agg, tiles, 0, bn="chunk")
    ga = _grads(enc_a)
    lb = accumulate_step(enc_b, agg, tiles, 0, 10, bn="chunk")
    gb = _grads(enc_b)
    assert abs(la - lb) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(ga, gb)) < 1e-9
    for ma, mb in zip(enc_a.modules(), enc_b.modules()):
        if isinstance(ma, nn.BatchNorm2d):
            torch.testing.assert_close(ma.running_mean, mb.running_mean)
            torch.testing.assert_close(ma.running_var, mb.running_var)
            assert int(ma.num_batches_tracked) == int(mb.num_batches_tracked)


def test_frozen_bn_leaves_running_stats_alone() -> None:
    enc = _encoder()
    agg = build_aggregator("abmil", FEAT, 2, dropout=0.0).double()
    state = {k: v.clone() for k, v in enc.state_dict().items()}
    accumulate_step(enc, agg, torch.randn(6, 3, 8, 8, dtype=torch.float64), 1, 4)
    for k, v in enc.state_dict().items():
        torch.testing.assert_close(v, state[k])


def test_input_errors() -> None:
    enc = _encoder()
    agg = build_aggregator("abmil", FEAT, 2).double()
    tiles = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunk_size=0"):
        accumulate_step(enc, agg, tiles, 0, 0)
    with pytest.raises(ValueError, match="bn='batch'"):
        accumulate_step(enc, agg, tiles, 0, 2, bn="batch")
    with pytest.raises(TypeError, match="float tensor"):
        accumulate_step(enc, agg, tiles.to(torch.uint8), 0, 2)


def test_resnet18_small_tiles() -> None:
    encoders = pytest.importorskip("wsi_pipeline.models.encoders")
    torch.manual_seed(5)
    enc = encoders.build_encoder("resnet18").double().train()
    agg = build_aggregator("abmil", enc.num_features, 2, dropout=0.0).double()
    tiles = torch.randn(9, 3, 32, 32, dtype=torch.float64)
    ref_loss = full_step(enc, agg, tiles, 1)
    ref = _grads(enc, agg)
    enc.zero_grad(set_to_none=True)
    agg.zero_grad(set_to_none=True)
    loss = accumulate_step(enc, agg, tiles, 1, 4)
    assert abs(loss - ref_loss) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(_grads(enc, agg), ref)) <= 1e-9


# ---------------------------------------------------------------- memory
def test_saved_activation_memory_does_not_grow_with_the_bag() -> None:
    torch.manual_seed(6)
    enc = TinyCNN(width=16).train()
    agg = build_aggregator("abmil", FEAT, 2, hidden=32, attn_dim=16, dropout=0.0)
    peaks = {}
    for n in (64, 512):
        tiles = torch.randn(n, 3, 32, 32)
        for kind in ("acc", "full"):
            with SavedTensorMeter() as meter:
                if kind == "acc":
                    accumulate_step(enc, agg, tiles, 1, 16)
                else:
                    full_step(enc, agg, tiles, 1)
            assert meter.live == 0  # every graph was freed
            peaks[kind, n] = meter.peak
    assert peaks["acc", 512] <= 1.02 * peaks["acc", 64], peaks
    ratio = peaks["full", 512] / peaks["full", 64]
    assert 7.0 < ratio <= 8.5, peaks
    assert peaks["full", 512] > 5 * peaks["acc", 512], peaks
